"""The progress engine (``overlap/backends/job/engine.py``): one thread per process that runs
what it is handed, watches descriptors and MPI requests, and runs timers — and a bug in any
one callback is logged without stopping it. Its :class:`Completion` and :class:`Backoff`.
Every wait here is bounded; the only times asserted are lower bounds the engine enforces."""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from overlap.backends.job.engine import Backoff, Completion, Engine
from overlap.errors import CollectiveAborted
from overlap.scope import CancelScope

BOUND_S = 10.0


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine("overlap-engine-test")
    yield e
    e.close()


def on_engine(engine: Engine, fn=lambda: None):
    """Run ``fn()`` on the engine's thread and return what it returned (bounded)."""
    box: list = []
    ran = threading.Event()

    def call() -> None:
        box.append(fn())
        ran.set()

    engine.call_soon(call)
    assert ran.wait(BOUND_S), "the engine never ran the call"
    return box[0]


def test_calls_run_on_the_engines_thread_in_the_order_handed_over(engine):
    seen: list[tuple[int, str, bool]] = []
    done = threading.Event()
    for k in range(5):
        engine.call_soon(lambda k=k: seen.append((k, threading.current_thread().name,
                                                  engine.on_thread())))
    engine.call_soon(done.set)
    assert done.wait(BOUND_S)
    assert seen == [(k, "overlap-engine-test", True) for k in range(5)]
    assert not engine.on_thread()  # (this thread is not the engine's)


def test_a_call_handed_over_from_the_engines_own_thread_runs_too(engine):
    done = threading.Event()
    engine.call_soon(lambda: engine.call_soon(done.set))
    assert done.wait(BOUND_S)


def test_a_callback_that_raises_is_logged_and_the_engine_goes_on(engine, caplog):
    def bad() -> None:
        raise RuntimeError("a source's bug")

    with caplog.at_level(logging.ERROR, logger="overlap"):
        engine.call_soon(bad)
        assert on_engine(engine, lambda: "still here") == "still here"
    assert [str(r.exc_info[1]) for r in caplog.records if r.exc_info] == ["a source's bug"]
    assert engine.failure is None


def test_a_watched_reader_is_called_while_it_has_bytes_and_not_once_forgotten(engine, caplog):
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    got: list[bytes] = []
    arrived = threading.Event()

    def readable() -> None:
        assert engine.on_thread()
        got.append(ours.recv(100))
        arrived.set()

    try:
        engine.watch_reader(ours.fileno(), readable)
        theirs.sendall(b"one")
        assert arrived.wait(BOUND_S)
        assert got == [b"one"]
        engine.forget(ours.fileno())  # (returns once the engine has dropped it)
        theirs.sendall(b"two")
        on_engine(engine)  # (the engine went round with the bytes waiting: not called)
        assert got == [b"one"]
        with caplog.at_level(logging.WARNING, logger="overlap"):
            ours.close()  # (forgotten first: the engine never waits on a closed descriptor)
            assert on_engine(engine, lambda: "on") == "on"
        assert not [r for r in caplog.records if "closed while watched" in r.getMessage()]
        assert engine.failure is None
    finally:
        ours.close()
        theirs.close()


def test_a_watched_descriptor_closed_without_forget_is_dropped_and_the_engine_goes_on(
        engine, caplog):
    """Closed under the engine (not forgotten first): the engine drops it, saying so, and
    goes on. (A ``select`` under way when it closed may still report it ready once on
    Linux: its reader then fails to read, as a host link's would, and that is logged.)"""
    ours, theirs = socket.socketpair()
    calls: list[int] = []

    def readable() -> None:
        calls.append(1)
        ours.recv(1)  # (closed: raises)

    try:
        engine.watch_reader(ours.fileno(), readable)
        on_engine(engine)  # (registered)
        with caplog.at_level(logging.WARNING, logger="overlap"):
            ours.close()
            assert on_engine(engine, lambda: "on") == "on"
            seen = len(calls)
            assert on_engine(engine, lambda: "on") == "on"  # (dropped: never called again)
        assert len(calls) == seen <= 1
        assert any("closed while watched" in r.getMessage() for r in caplog.records)
        assert engine.failure is None
    finally:
        ours.close()
        theirs.close()


def test_a_watched_writer_is_called_while_there_is_room_until_it_says_no_more(engine):
    ours, theirs = socket.socketpair()
    calls: list[bool] = []
    room = threading.Event()

    def writable() -> None:
        calls.append(engine.on_thread())
        engine.watch_writer(ours.fileno(), None)  # (on the engine's thread: at once)
        room.set()

    try:
        engine.watch_writer(ours.fileno(), writable)
        assert room.wait(BOUND_S)
        on_engine(engine)
        on_engine(engine)  # (the engine went round twice more: not called again)
        assert calls == [True]
    finally:
        engine.forget(ours.fileno())
        ours.close()
        theirs.close()


def test_timers_run_every_period_on_the_engines_thread(engine):
    period, runs = 0.02, 3
    times: list[float] = []
    threads: list[bool] = []
    done = threading.Event()

    def tick() -> None:
        times.append(time.perf_counter())
        threads.append(engine.on_thread())
        if len(times) == runs:
            done.set()

    started = time.perf_counter()
    engine.every(period, tick)
    assert done.wait(BOUND_S)
    assert all(threads)
    # (Lower bounds only: each run comes at least a period after the one before.)
    assert times[0] - started >= period
    assert all(b - a >= period for a, b in itertools.pairwise(times))


def test_a_timer_whose_call_raises_is_logged_and_runs_again(engine, caplog):
    calls: list[int] = []
    again = threading.Event()

    def tick() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a tick's bug")
        again.set()

    with caplog.at_level(logging.ERROR, logger="overlap"):
        engine.every(0.001, tick)
        assert again.wait(BOUND_S), "the timer stopped after its call raised"
    assert any("a tick's bug" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    assert engine.failure is None


class FakeRequest:
    """An MPI request stand-in: complete after ``looks`` tests (or raising on the first)."""

    def __init__(self, looks: int, error: Exception | None = None) -> None:
        self.looks, self.error, self.tested = looks, error, 0
        self.threads: set[str] = set()

    def Test(self, status=None) -> bool:
        self.threads.add(threading.current_thread().name)
        self.tested += 1
        if self.error is not None:
            raise self.error
        if self.tested >= self.looks and status is not None:
            status.append("filled")
        return self.tested >= self.looks


def test_mpi_requests_are_tested_until_complete_then_called_back_on_the_engine(engine):
    quick, slow = FakeRequest(1), FakeRequest(5)
    seen: dict[str, object] = {}
    both = threading.Event()

    def finished(name: str):
        def done(status) -> None:
            seen[name] = (status, engine.on_thread())
            if len(seen) == 2:
                both.set()
        return done

    status: list[str] = []
    engine.watch_mpi(slow, finished("slow"), status)
    engine.watch_mpi(quick, finished("quick"))
    assert both.wait(BOUND_S)
    assert seen == {"quick": (None, True), "slow": (["filled"], True)}
    assert slow.tested == 5 and quick.tested == 1
    assert slow.threads == quick.threads == {"overlap-engine-test"}  # (nobody else tests)


def test_an_mpi_error_goes_to_that_requests_callback_only(engine):
    broken, fine = FakeRequest(1, RuntimeError("MPI_ERR_TRUNCATE")), FakeRequest(2)
    seen: dict[str, object] = {}
    both = threading.Event()

    def done(name: str):
        def cb(status) -> None:
            seen[name] = status
            if len(seen) == 2:
                both.set()
        return cb

    engine.watch_mpi(broken, done("broken"))
    engine.watch_mpi(fine, done("fine"))
    assert both.wait(BOUND_S)
    assert isinstance(seen["broken"], RuntimeError) and seen["fine"] is None
    assert engine.failure is None


def test_close_ends_the_thread_and_refuses_mpi_requests():
    engine = Engine("overlap-engine-test")
    thread = on_engine(engine, threading.current_thread)
    pending = FakeRequest(10**9)
    engine.watch_mpi(pending, lambda status: pytest.fail("a dropped request was called back"))
    engine.close()
    assert not thread.is_alive()
    with pytest.raises(CollectiveAborted, match="progress engine is closed"):
        engine.watch_mpi(FakeRequest(1), lambda status: None)
    engine.close()  # (twice: nothing)
    engine.forget(12345)  # (the thread is gone: at once)


def test_close_waits_for_a_held_engine_no_longer_than_its_bound():
    """A thread held in a call (a callback stuck) is waited for ``timeout`` at most: close
    returns with it still running, and the thread ends once the call returns."""
    engine = Engine("overlap-engine-test")
    thread = on_engine(engine, threading.current_thread)
    entered, release = threading.Event(), threading.Event()
    engine.call_soon(lambda: (entered.set(), release.wait(BOUND_S)))
    assert entered.wait(BOUND_S)
    try:
        started = time.perf_counter()
        engine.close(timeout=0.05)
        assert time.perf_counter() - started >= 0.05  # (it did wait its bound)
        assert thread.is_alive()
    finally:
        release.set()
    thread.join(BOUND_S)
    assert not thread.is_alive()


def test_close_from_the_engines_own_thread_does_not_wait_for_itself():
    engine = Engine("overlap-engine-test")
    thread = on_engine(engine, threading.current_thread)
    on_engine(engine, engine.close)
    thread.join(BOUND_S)
    assert not thread.is_alive()


# ---- completions ---------------------------------------------------------------------------


def test_a_completion_completes_once_and_calls_back_each_callback_once():
    c = Completion("a message", peer=3)
    calls: list[str] = []
    assert c.add_callback(lambda: calls.append("a"))
    assert c.add_callback(lambda: calls.append("b"))
    assert not c.over
    c.complete(12)
    c.complete(99)
    c.fail(RuntimeError("late"))  # (over already: nothing)
    assert calls == ["a", "b"] and c.done and c.count == 12 and c.error is None
    assert not c.add_callback(lambda: calls.append("c")), "refused: the caller looks again"
    assert c.block(CancelScope("t"), "a message", 0.0)


def test_a_failed_completion_raises_its_error_where_it_is_waited_for():
    c = Completion("a message")
    c.fail(CollectiveAborted("the link is closed"))
    assert c.over and not c.done
    with pytest.raises(CollectiveAborted, match="the link is closed"):
        c.block(CancelScope("t"), "a message", BOUND_S)


def test_a_completion_callback_that_raises_does_not_keep_the_others_from_running(caplog):
    c = Completion("a message")
    after = threading.Event()
    c.add_callback(lambda: 1 / 0)
    c.add_callback(after.set)
    with caplog.at_level(logging.ERROR, logger="overlap"):
        c.complete()
    assert after.is_set()
    assert any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)


def test_blocking_on_a_completion_is_woken_by_the_thread_that_completes_it():
    c = Completion("a message")
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(
        c.block(CancelScope("t"), "a message", BOUND_S * 6)))
    waiter.start()
    c.complete(4)
    waiter.join(BOUND_S)
    assert results == [True]


def test_blocking_on_a_completion_times_out_no_sooner_than_asked():
    c = Completion("a message")
    started = time.perf_counter()
    assert c.block(CancelScope("t"), "a message", 0.05) is False
    assert time.perf_counter() - started >= 0.05


def test_cancelling_the_scope_wakes_a_wait_on_a_completion():
    c = Completion("a message")
    scope = CancelScope("a call")
    errors: list[BaseException] = []

    def block() -> None:
        try:
            c.block(scope, "a message from rank 2", BOUND_S * 6)
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=block)
    waiter.start()
    scope.cancel(RuntimeError("rank 1 failed"))
    waiter.join(BOUND_S)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], CollectiveAborted)
    assert "a message from rank 2: aborted" in str(errors[0])
    assert not c.over  # (the completion itself is untouched)


# ---- backoff -------------------------------------------------------------------------------


def test_backoff_spins_then_doubles_up_to_its_cap():
    b = Backoff(spin=2, start=1e-5, cap=4e-5)
    assert [b.delay(k) for k in range(6)] == [0.0, 0.0, 1e-5, 2e-5, 4e-5, 4e-5]
    assert Backoff().delay(10**6) == Backoff().cap  # (no overflow however long it polls)


@pytest.mark.parametrize("kwargs", [{"spin": -1}, {"start": -1e-6}, {"start": 1e-3, "cap": 1e-4}])
def test_bad_backoffs_are_named(kwargs):
    with pytest.raises(ValueError, match="poll: need spin >= 0"):
        Backoff(**kwargs)
