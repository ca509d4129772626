"""The backend protocol on the CPU device kind: streams, events, scopes, collectives, the
end of a call's work, close, link emulation.

Ordering and concurrency are proven with ``threading.Event`` hand-offs, never with sleeps;
the only timing assertions are lower bounds the backend enforces (watchdog, link emulation).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import numpy as np
import pytest

from overlap.backends import SETTLE_GRACE_S, Backend, CpuDevices, Event, OpReport, make_backend
from overlap.backends.devices.backend import RETURN_GRACE_S
from overlap.errors import (
    CollectiveAborted,
    CollectiveMismatch,
    CollectiveTimeout,
    OverlapRuntimeError,
    StreamError,
)
from overlap.scope import CancelScope

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
    uvloop = None

RUNNERS = [pytest.param(asyncio.run, id="asyncio"),
           pytest.param(getattr(uvloop, "run", None), id="uvloop",
                        marks=pytest.mark.skipif(uvloop is None, reason="no uvloop"))]

# Generous bound for work that should finish at once; only reached when something is broken.
SETTLE_S = 5.0


def settle(ev: Event, timeout: float = SETTLE_S) -> Event:
    """Block until ``ev`` is launched; fail the test if it is not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not ev.launched():
        assert time.monotonic() < deadline, f"{ev!r} did not complete within {timeout:g} s"
        time.sleep(0.002)
    return ev


@pytest.fixture
def scope():
    """The scope of a test's work (a call's, at the backend level)."""
    s = CancelScope("test")
    yield s
    s.cancel(CollectiveAborted("test teardown"))  # a test that failed mid-collective ends


@pytest.fixture
def make():
    """CPU backend factory; every backend is closed after the test."""
    made: list[Backend] = []

    def build(num_devices: int, **kwargs) -> Backend:
        b = make_backend("cpu", num_devices, **kwargs)
        made.append(b)
        return b

    yield build
    for b in made:
        b.close()


def blocked_op(started: threading.Event, gate: threading.Event, then=None):
    """An op that signals it is running, then blocks until ``gate`` opens."""

    def op() -> None:
        started.set()
        assert gate.wait(SETTLE_S), "gate never opened"
        if then is not None:
            then()

    return op


# ---- streams ------------------------------------------------------------------------------


def test_stream_runs_ops_in_launch_order(make, scope):
    s = make(1).stream(0)
    seen: list[int] = []
    for i in range(200):
        s.launch(f"op{i}", functools.partial(seen.append, i), scope=scope)
    assert settle(s.record("end", scope=scope)).error is None
    assert seen == list(range(200))


@pytest.mark.parametrize("a, b", [((0, "compute"), (1, "compute")),
                                  ((0, "compute"), (0, "comm"))],
                         ids=["two-devices", "one-device-two-streams"])
def test_streams_run_concurrently(make, scope, a, b):
    """An op on stream A that waits for an op on stream B launched later still completes."""
    backend = make(2)
    sa, sb = backend.stream(*a), backend.stream(*b)
    b_ran = threading.Event()
    observed: list[bool] = []
    sa.launch("wait for B", lambda: observed.append(b_ran.wait(SETTLE_S)), scope=scope)
    sb.launch("set", b_ran.set, scope=scope)
    settle(sa.record(scope=scope))
    settle(sb.record(scope=scope))
    assert observed == [True], "stream A never saw stream B's op: streams are serialized"


def test_record_completes_only_after_prior_work(make, scope):
    s = make(1).stream(0)
    started, gate = threading.Event(), threading.Event()
    side: list[str] = []
    s.launch("blocked", blocked_op(started, gate, then=lambda: side.append("op")), scope=scope)
    ev = s.record("after blocked", scope=scope)
    assert started.wait(SETTLE_S)
    assert not ev.done(), "the event completed while earlier work was still running"
    gate.set()
    assert settle(ev).error is None
    assert side == ["op"]


def test_wait_event_orders_streams(make, scope):
    backend = make(2)
    sa, sb = backend.stream(0), backend.stream(1)
    started, gate = threading.Event(), threading.Event()
    side: list[str] = []
    seen_by_b: list[list[str]] = []
    sa.launch("produce", blocked_op(started, gate, then=lambda: side.append("A")), scope=scope)
    ev_a = sa.record("A produced", scope=scope)
    sb.wait_event(ev_a, scope=scope)
    sb.launch("consume", lambda: seen_by_b.append(list(side)), scope=scope)
    ev_b = sb.record("B consumed", scope=scope)
    assert started.wait(SETTLE_S)
    assert not ev_b.done()
    gate.set()
    assert settle(ev_b).error is None
    assert seen_by_b == [["A"]], "stream B ran before the event it waits for"


def test_every_op_runs_on_its_own_streams_thread(make, scope):
    """No thread advances another stream: the consumer runs on its stream's thread even
    though the producer's thread is the one that completes the event it waits for."""
    backend = make(2)
    sa, sb = backend.stream(0), backend.stream(1, "comm")
    where: dict[str, str] = {}
    sa.launch("produce", lambda: where.setdefault("produce", threading.current_thread().name),
              scope=scope)
    ev = sa.record("produced", scope=scope)
    sb.wait_event(ev, scope=scope)
    sb.launch("consume", lambda: where.setdefault("consume", threading.current_thread().name),
              scope=scope)
    settle(sb.record(scope=scope))
    assert where == {"produce": "overlap-d0-compute", "consume": "overlap-d1-comm"}


def test_a_failing_op_cancels_its_scope_everywhere_and_later_scopes_run(make):
    """The first failure of a call's work cancels its scope: the rest of that call's work is
    skipped on every stream (its records complete with the failure), while a later call's
    work runs on the very same streams — no reset."""
    backend = make(2)
    s, other = backend.stream(1), backend.stream(0, "comm")
    ran: list[str] = []
    call = CancelScope("call 1")
    gate = threading.Event()
    other.launch("waits for the failure", lambda: gate.wait(SETTLE_S), scope=call)
    other.launch("after it, same call", lambda: ran.append("other"), scope=call)
    ev_other = other.record("other end", scope=call)

    def bad() -> None:
        raise ValueError("bad value")

    s.launch("good 1", lambda: ran.append("good 1"), scope=call)
    s.launch("matmul#3", bad, scope=call)
    s.launch("good 2", lambda: ran.append("good 2"), scope=call)
    ev = s.record("after failure", scope=call)
    settle(ev)
    gate.set()
    settle(ev_other)
    assert ran == ["good 1"], "work of the failed call ran after its failure"
    err = ev.error
    assert isinstance(err, StreamError), err
    assert (err.device, err.stream, err.op) == (1, "compute", "matmul#3")
    assert "device 1" in str(err) and "'compute'" in str(err) and "matmul#3" in str(err)
    assert isinstance(err.__cause__, ValueError) and str(err.__cause__) == "bad value"
    assert ev_other.error is err and call.failures == [err] and call.cancelled

    later = CancelScope("call 2")
    s.launch("good 3", lambda: ran.append("good 3"), scope=later)
    other.launch("good 4", lambda: ran.append("good 4"), scope=later)
    assert settle(s.record(scope=later)).error is None
    assert settle(other.record(scope=later)).error is None
    assert ran[0] == "good 1" and sorted(ran[1:]) == ["good 3", "good 4"]  # (two streams)


# ---- events from asyncio --------------------------------------------------------------------


async def test_await_event_does_not_block_the_loop(make, scope):
    loop = asyncio.get_running_loop()
    assert loop.get_debug(), "conftest should run coroutine tests in debug mode"
    s = make(1).stream(0)
    started, gate = threading.Event(), threading.Event()
    side: list[str] = []
    s.launch("blocked", blocked_op(started, gate, then=lambda: side.append("op")), scope=scope)
    ev = s.record("after blocked", scope=scope)
    waiter = asyncio.ensure_future(ev.wait())
    for _ in range(5):  # the loop keeps running other work while the event is pending
        await asyncio.sleep(0)
    assert not waiter.done()
    loop.call_soon(gate.set)
    await asyncio.wait_for(waiter, SETTLE_S)
    assert ev.done() and ev.error is None and side == ["op"]
    await ev.wait()  # an already completed event returns at once


async def test_await_failed_event_raises_the_stream_error(make, scope):
    s = make(2).stream(1, "comm")

    def bad() -> None:
        raise KeyError("gone")

    s.launch("lookup", bad, scope=scope)
    ev = s.record(scope=scope)
    with pytest.raises(StreamError, match=r"device 1 .*'comm'.*lookup") as info:
        await asyncio.wait_for(ev.wait(), SETTLE_S)
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("runner", RUNNERS)
def test_abandoned_await_does_not_break_the_stream(make, scope, runner):
    """A coroutine that stopped awaiting an event on a loop that is now closed must not take
    the stream down when the event completes later: later work still runs."""
    s = make(1).stream(0)
    started, gate = threading.Event(), threading.Event()
    s.launch("blocked", blocked_op(started, gate), scope=scope)
    ev = s.record("awaited then abandoned", scope=scope)

    async def impatient() -> bool:
        try:
            await asyncio.wait_for(ev.wait(), 0.05)
        except asyncio.TimeoutError:
            return False
        return True

    assert runner(impatient()) is False  # the loop is closed now
    gate.set()
    settle(ev)
    ran: list[str] = []
    s.launch("later", lambda: ran.append("later"), scope=scope)
    settle(s.record("later", scope=scope))
    assert ran == ["later"], (
        "the stream stopped working after an event it completed had a waiter whose loop "
        "was closed")


def test_a_failing_callback_of_an_event_leaves_the_others_called(caplog):
    """Callbacks run on the thread that completes the event: one that raises (a bug) is
    logged, and every other callback still runs — a waiter left unwoken would hang its
    call."""
    ev = Event("lane end")
    called: list[str] = []

    def bad(_: Event) -> None:
        called.append("bad")
        raise RuntimeError("a waiter's bug")

    ev.add_done_callback(bad)
    ev.add_done_callback(lambda _: called.append("good"))
    with caplog.at_level("ERROR", logger="overlap"):
        ev.finish()
    assert called == ["bad", "good"] and ev.done()
    assert "a callback of Event('lane end', done) failed" in caplog.text


# ---- collectives ----------------------------------------------------------------------------


def _run_on_devices(backend: Backend, scope: CancelScope, devices, make_op) -> list[Event]:
    events = []
    for d in devices:
        s = backend.stream(d, "comm")
        s.launch(f"collective on {d}", make_op(d), scope=scope)
        events.append(s.record(f"done on {d}", scope=scope))
    return [settle(ev) for ev in events]


def test_broadcast_copies_root_buffer_into_receivers(make, scope):
    backend = make(3)
    root = 1
    bufs = {d: np.zeros((2, 3)) for d in range(3)}
    bufs[root][:] = np.arange(6.0).reshape(2, 3)
    events = _run_on_devices(backend, scope, [2, 0, 1], lambda d: lambda: backend.broadcast(
        (0, 1, 2), d, root, bufs[d], "b", scope=scope))
    assert [ev.error for ev in events] == [None] * 3
    for d in range(3):
        np.testing.assert_array_equal(bufs[d], np.arange(6.0).reshape(2, 3), err_msg=f"dev {d}")
    assert len({id(b) for b in bufs.values()}) == 3  # separate buffers: bytes really moved


def test_broadcast_shape_mismatch_fails_every_participant(make, scope):
    backend = make(2, timeout=0.5)
    bufs = {0: np.ones(4), 1: np.zeros(5)}
    events = _run_on_devices(backend, scope, [0, 1], lambda d: lambda: backend.broadcast(
        (0, 1), d, 0, bufs[d], "b", scope=scope))
    for ev in events:
        assert ev.error is not None and "device 1" in str(ev.error), ev


def test_all_reduce_sums_in_device_order(make, scope):
    backend = make(3)
    bufs = {d: np.full(4, d + 1.0) for d in range(3)}
    events = _run_on_devices(backend, scope, [2, 0, 1], lambda d: lambda: backend.all_reduce(
        (0, 1, 2), d, bufs[d], "r", scope=scope))
    assert [ev.error for ev in events] == [None] * 3
    for d in range(3):
        np.testing.assert_array_equal(bufs[d], np.full(4, 6.0))
    # Device order, whatever the arrival order: ((a - b) - c), bit for bit.
    order = []
    bufs = {d: np.full(2, float(d + 1)) for d in range(3)}
    events = _run_on_devices(backend, scope, [1, 2, 0], lambda d: lambda: backend.all_reduce(
        (0, 1, 2), d, bufs[d], "r", op=lambda a, b: order.append(float(b[0])) or a - b,
        scope=scope))
    assert order == [2.0, 3.0] and all(b.tolist() == [-4.0, -4.0] for b in bufs.values())


def test_all_gather_stacks_in_group_order(make, scope):
    backend = make(3)
    bufs = {d: np.full(2, 10.0 * d) + np.arange(2) for d in range(3)}
    outs = {d: np.zeros((3, 2)) for d in range(3)}
    events = _run_on_devices(backend, scope, [1, 2, 0], lambda d: lambda: backend.all_gather(
        (0, 1, 2), d, bufs[d], outs[d], "g", scope=scope))
    assert [ev.error for ev in events] == [None] * 3
    want = np.array([[0.0, 1.0], [10.0, 11.0], [20.0, 21.0]])
    for d in range(3):
        np.testing.assert_array_equal(outs[d], want, err_msg=f"device {d}")


def test_collectives_match_by_launch_position(make, scope):
    """Two broadcasts on the same group, launched in the same order, pair up in order."""
    backend = make(2)
    first = {0: np.array([1.0]), 1: np.zeros(1)}
    second = {0: np.zeros(1), 1: np.array([2.0])}
    for d in (0, 1):
        s = backend.stream(d, "comm")
        s.launch("first", lambda d=d: backend.broadcast((0, 1), d, 0, first[d], "first",
                                                        scope=scope), scope=scope)
        s.launch("second", lambda d=d: backend.broadcast((0, 1), d, 1, second[d], "second",
                                                         scope=scope), scope=scope)
    for d in (0, 1):
        assert settle(backend.stream(d, "comm").record(scope=scope)).error is None
    assert first[1][0] == 1.0 and second[0][0] == 2.0


# ---- deadlocks and the watchdog -------------------------------------------------------------


def test_cyclic_launch_order_times_out_naming_missing_devices(make):
    backend = make(3, timeout=0.5)
    order = {0: [(0, 1), (0, 2)], 1: [(1, 2), (0, 1)], 2: [(0, 2), (1, 2)]}
    ran: list[int] = []
    events = {}
    t0 = time.perf_counter()
    # One scope per device: the first timeout would cancel a shared one, and what the others
    # waited for would be named "aborted", not timed out.
    scopes = {d: CancelScope(f"device {d}") for d in order}
    for d, groups in order.items():
        s = backend.stream(d, "comm")
        for g in groups:
            buf = np.zeros(2)
            s.launch(f"bcast {g}", lambda d=d, g=g, buf=buf: backend.broadcast(
                g, d, min(g), buf, f"bcast{g}", scope=scopes[d]), scope=scopes[d])
        s.launch("after", functools.partial(ran.append, d), scope=scopes[d])
        events[d] = s.record(f"after on {d}", scope=scopes[d])
    for ev in events.values():
        settle(ev)
    assert time.perf_counter() - t0 >= 0.5  # the watchdog waited its timeout first
    # Each device blocks on its first group, whose other member is blocked elsewhere.
    missing = {0: (1,), 1: (2,), 2: (0,)}
    for d, ev in events.items():
        err = ev.error
        assert isinstance(err, CollectiveTimeout), (d, err)
        assert err.missing == missing[d], (d, err)
        assert err.devices == order[d][0]
        assert f"device {d}" in str(err) and f"{list(missing[d])}" in str(err), str(err)
    assert ran == [], "work after a timed-out collective ran anyway"


def test_swapped_collectives_on_one_group_mismatch(make, scope):
    backend = make(2, timeout=0.5)
    bufs = {d: {"A": np.zeros(3), "B": np.zeros(3)} for d in (0, 1)}
    plan = {0: ["A", "B"], 1: ["B", "A"]}
    events = {}
    for d, names in plan.items():
        s = backend.stream(d, "comm")
        for name in names:
            s.launch(f"bcast {name}", lambda d=d, name=name: backend.broadcast(
                (0, 1), d, 0, bufs[d][name], name, scope=scope), scope=scope)
        events[d] = s.record(scope=scope)
    for d, ev in events.items():
        err = settle(ev).error
        assert isinstance(err, CollectiveMismatch), (d, err)
        assert "device 0" in str(err) and "device 1" in str(err), str(err)
        assert "[A]" in str(err) and "[B]" in str(err), str(err)


# ---- cancellation reaches every wait ----------------------------------------------------------


def test_cancelling_wakes_a_blocked_collective_and_a_later_one_works(make):
    backend = make(2, timeout=30.0)
    call = CancelScope("call")
    s = backend.stream(0, "comm")
    entered = threading.Event()

    def lonely() -> None:
        entered.set()
        backend.broadcast((0, 1), 0, 0, np.zeros(2), "lonely", scope=call)

    s.launch("lonely bcast", lonely, scope=call)
    ev = s.record("after lonely", scope=call)
    assert entered.wait(SETTLE_S)
    assert not ev.done()
    call.cancel(KeyboardInterrupt("operator pressed ^C"))
    settle(ev, 2.0)  # (woken by the cancellation: far before the 30 s timeout)
    assert isinstance(ev.error, CollectiveAborted), ev.error
    assert "operator pressed ^C" in str(ev.error)
    assert call.failures and "device 0" in str(call.failures[0])

    # forget() drops the half-joined rendezvous: a complete broadcast works again.
    assert backend.settle(lambda b: time.perf_counter() + SETTLE_S) == []
    backend.forget()
    again = CancelScope("call 2")
    bufs = {0: np.array([7.0, 8.0]), 1: np.zeros(2)}
    events = _run_on_devices(backend, again, [0, 1], lambda d: lambda: backend.broadcast(
        (0, 1), d, 0, bufs[d], "again", scope=again))
    assert [e.error for e in events] == [None, None]
    np.testing.assert_array_equal(bufs[1], [7.0, 8.0])


def test_cancelling_wakes_a_stream_waiting_for_an_event(make):
    backend = make(2, timeout=30.0)
    call = CancelScope("call")
    started, gate = threading.Event(), threading.Event()
    sa, sb = backend.stream(0), backend.stream(1)
    sa.launch("blocked", blocked_op(started, gate), scope=call)
    ev_a = sa.record("A", scope=call)
    sb.wait_event(ev_a, scope=call)
    ev_b = sb.record("B", scope=call)
    assert started.wait(SETTLE_S)
    call.cancel(CollectiveAborted("cancelled"))
    settle(ev_b, 2.0)
    assert isinstance(ev_b.error, CollectiveAborted) and "cancelled" in str(ev_b.error)
    gate.set()
    assert backend.settle(lambda b: time.perf_counter() + SETTLE_S) == []


def test_settle_names_the_streams_that_do_not_stop_by_their_bound(make, scope):
    backend = make(1)
    started, gate = threading.Event(), threading.Event()
    backend.stream(0).launch("blocked", blocked_op(started, gate), scope=scope, op=7)
    assert started.wait(SETTLE_S)
    now = time.perf_counter()
    stuck = backend.settle(lambda b: now)  # (past every bound now)
    assert [(b.label, b.op, b.category, b.waiting, b.scope) for b in stuck] == [
        ("blocked", 7, "compute", False, scope)]
    gate.set()
    assert backend.settle(lambda b: time.perf_counter() + SETTLE_S) == []
    assert backend.busy() == []


def test_settle_waits_for_the_queue_behind_a_slow_op_to_drain(make):
    """An op slower than the grace (but not hung) ends; the waits queued behind it then see
    the cancellation and drain. They began late: they get their grace from then, and are not
    taken for stuck (which abandoned a healthy stream after an interrupted call)."""
    backend = make(2, timeout=30.0)
    call = CancelScope("call")
    s = backend.stream(0)
    started = threading.Event()
    never = backend.new_event("never recorded")

    def slow() -> None:
        started.set()
        time.sleep(2 * SETTLE_GRACE_S)

    s.launch("slow op", slow, scope=call)
    for _ in range(3):
        s.wait_event(never, scope=call)
    assert started.wait(SETTLE_S)
    call.cancel(CollectiveAborted("interrupted"))
    start = time.perf_counter()
    assert backend.settle(lambda b: backend.stop_bound(b, start)) == []
    assert backend.busy() == []


@pytest.mark.parametrize("category", ["comm", "compute"])
def test_a_transfer_gets_the_grace_and_user_code_its_timeout(make, category):
    """After a cancellation a comm op (a transfer: its waits see the cancellation) or a wait
    counts as stuck once it had the grace; a compute op (user code, which nothing can
    interrupt) only once it has run the timeout — and, if it has already, after a moment in
    which a thread that held the interpreter lock may say it returned."""
    backend = make(2, timeout=0.2)
    call = CancelScope("call")
    started, release = threading.Event(), threading.Event()
    s = backend.stream(0, "comm")
    s.launch("op", lambda: started.set() or release.wait(SETTLE_S), category=category,
             scope=call)
    assert started.wait(SETTLE_S)
    (busy,) = backend.busy()
    start = busy.since + 0.3  # cancelled past the 0.2 s timeout
    bound = backend.stop_bound(busy, start)
    release.set()
    if category == "comm":
        assert bound == pytest.approx(start + SETTLE_GRACE_S)
    else:
        assert bound == pytest.approx(start + RETURN_GRACE_S)  # hung already: almost at once
        # Cancelled while it had run less: until its timeout, and at least the grace.
        assert backend.stop_bound(busy, busy.since) == pytest.approx(
            busy.since + max(0.2, SETTLE_GRACE_S))


def test_an_abandoned_stream_runs_nothing_more_and_refuses_work(make, scope):
    backend = make(1)
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []
    s = backend.stream(0)
    s.launch("stuck", blocked_op(started, gate), scope=scope)
    s.launch("behind it", lambda: ran.append("behind"), scope=scope)
    assert started.wait(SETTLE_S)
    thread = s.thread
    stuck = backend.busy()
    backend.abandon(stuck, "stuck in user code")
    assert backend.lost == stuck and backend.streams() == []
    with pytest.raises(OverlapRuntimeError, match="stuck in user code"):
        s.launch("late", lambda: None, scope=scope)
    assert thread is not None and thread.daemon  # (it cannot keep the process alive)
    gate.set()
    thread.join(SETTLE_S)  # the op returned: the thread ends, running nothing after it
    assert not thread.is_alive() and ran == []


# ---- close ----------------------------------------------------------------------------------


@pytest.mark.parametrize("queued_after", [True, False],
                         ids=["work-queued-behind", "nothing-queued-behind"])
def test_close_cancels_what_is_in_flight_and_joins_its_threads(make, scope, queued_after):
    """close() returns promptly even when a stream thread is in a collective whose peer never
    arrives (its work is cancelled), whether or not more work is queued behind it."""
    backend = make(3, timeout=30.0)
    entered = threading.Event()

    def lonely() -> None:
        entered.set()
        backend.broadcast((0, 1), 0, 0, np.zeros(2), "lonely", scope=scope)

    backend.stream(0, "comm").launch("lonely bcast", lonely, scope=scope)
    if queued_after:
        backend.stream(0, "comm").record("behind", scope=scope)
    backend.stream(2).launch("idle stream", lambda: None, scope=scope)
    settle(backend.stream(2).record(scope=scope))
    assert entered.wait(SETTLE_S)
    threads = [s.thread for s in backend.streams()]
    closer = threading.Thread(target=backend.close, name="test-closer", daemon=True)
    closer.start()
    closer.join(2.0)
    assert not closer.is_alive(), "close() waited for the collective's 30 s timeout"
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(OverlapRuntimeError, match="closed"):
        backend.stream(0, "comm").launch("late", lambda: None, scope=scope)
    with pytest.raises(OverlapRuntimeError, match="closed"):
        backend.stream(1, "new")


def test_close_is_idempotent_and_joins_idle_threads(make, scope):
    before = set(threading.enumerate())
    backend = make(4)
    for d in range(4):
        backend.stream(d).launch("noop", lambda: None, scope=scope)
    started = [t for t in threading.enumerate() if t not in before]
    assert sorted(t.name for t in started) == [f"overlap-d{d}-compute" for d in range(4)]
    backend.close()
    assert [t.name for t in started if t.is_alive()] == []
    backend.close()


# ---- link emulation -------------------------------------------------------------------------


async def test_link_emulation_holds_broadcast_for_link_time(make, scope):
    calls = []

    def link_time(root, receivers, nbytes):
        calls.append((root, list(receivers), nbytes))
        return 0.2

    backend = make(3, link_time=link_time)
    bufs = {0: np.arange(3.0), 1: np.zeros(3), 2: np.zeros(3)}
    t0 = time.perf_counter()
    events = []
    for d in range(3):
        s = backend.stream(d, "comm")
        s.launch("bcast", lambda d=d: backend.broadcast((0, 1, 2), d, 0, bufs[d], "slow",
                                                        scope=scope), scope=scope)
        events.append(s.record(scope=scope))
    for ev in events:
        await asyncio.wait_for(ev.wait(), SETTLE_S)
    assert time.perf_counter() - t0 >= 0.2
    assert calls == [(0, [1, 2], 24)]
    for d in (1, 2):
        np.testing.assert_array_equal(bufs[d], np.arange(3.0))


# ---- traces and what runs -------------------------------------------------------------------


def test_an_op_with_an_id_is_traced_from_its_start_to_its_end(make):
    backend = make(1)
    call = CancelScope("call")
    report = OpReport(trace=backend.start_trace())
    started, gate = threading.Event(), threading.Event()
    s = backend.stream(0, "comm")
    s.launch("receive", blocked_op(started, gate), category="comm", op=11, scope=call,
             report=report)
    s.launch("untraced", lambda: None, scope=call, report=report)  # (no op id: not traced)
    assert started.wait(SETTLE_S)
    (busy,) = backend.busy()
    assert (busy.label, busy.op, busy.category, busy.waiting) == ("receive", 11, "comm", False)
    gate.set()
    settle(s.record(scope=call))
    (rec,) = report.trace.records
    assert (rec.op, rec.device, rec.stream) == (11, 0, "comm")
    assert 0 <= backend.span_seconds(report.trace, rec.start) <= backend.span_seconds(
        report.trace, rec.end)


@pytest.mark.parametrize("category", ["compute", "comm"])
def test_a_compute_op_that_returns_past_the_timeout_fails_its_call_as_its_report_names_it(
        make, category):
    """A compute op that returned only after the timeout (nothing could name it while it
    ran) fails its scope with the error its call's report makes; a comm op bounds its own
    waits and is not judged so, nor is an op launched without a report."""
    backend = make(1, timeout=0.05)
    named = []

    def overran(busy, seconds):
        named.append((busy.label, seconds))
        return KeyError(f"{busy.label} overran")

    call, bare = CancelScope("call"), CancelScope("bare")
    s = backend.stream(0)
    s.launch("slow", lambda: time.sleep(0.1), category=category, scope=call,
             report=OpReport(overran=overran))
    s.launch("slow, no report", lambda: time.sleep(0.1), scope=bare)
    settle(s.record(scope=bare))
    if category == "comm":
        assert named == [] and not call.cancelled
    else:
        [(label, seconds)] = named
        assert label == "slow" and seconds >= 0.05
        assert isinstance(call.error, KeyError) and call.failures == [call.error]
    assert not bare.cancelled


# ---- bad arguments --------------------------------------------------------------------------


@pytest.mark.parametrize("args, kwargs, name", [
    ((0,), {}, "num_devices"),
    ((-2,), {}, "num_devices"),
    ((True,), {}, "num_devices"),
    ((2.0,), {}, "num_devices"),
    ((2,), {"timeout": 0}, "timeout"),
    ((2,), {"timeout": -1.0}, "timeout"),
    ((2,), {"timeout": float("nan")}, "timeout"),
])
def test_bad_backend_arguments(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        Backend(CpuDevices(), *args, **kwargs)


@pytest.mark.parametrize("device", [2, -1, 100, True])
def test_stream_device_out_of_range(make, device):
    backend = make(2)
    with pytest.raises(ValueError, match=rf"device.*{device}"):
        backend.stream(device)
    assert backend.streams() == []


@pytest.mark.parametrize("started", [False, True], ids=["before-start", "while-starting"])
def test_ctrl_c_while_a_stream_thread_starts_leaves_the_stream_usable(monkeypatch, started):
    # Ctrl-C landing in Thread.start() (the test suite saw it in a step's launch) left a
    # thread object that never ran: the stream then looked stuck in queued work for good.
    real = threading.Thread.start
    calls = []

    def interrupted(self):
        calls.append(self.name)
        if len(calls) == 1:
            if started:
                real(self)  # it got going; the caller still sees the interrupt
            raise KeyboardInterrupt
        real(self)

    backend = make_backend("cpu", 1)
    scope = CancelScope("test")
    try:
        s = backend.stream(0, "compute")
        monkeypatch.setattr(threading.Thread, "start", interrupted)
        with pytest.raises(KeyboardInterrupt):
            s.launch("first", lambda: None, scope=scope)
        ran = threading.Event()
        s.launch("second", ran.set, scope=scope)
        ev = s.record(scope=scope)
        assert ran.wait(5.0) and settle(ev).error is None
    finally:
        monkeypatch.undo()
        backend.close()
