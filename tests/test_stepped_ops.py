"""Stepped ops on CPU streams (``CpuStream.launch(..., stepped=True)``): steps that never
block, run in stream order; where the backend allows helpers, the thread that completes the
event a stream waits for starts its stepped op, and a thread that waits for an event
recorded after one steps it (the MPI backend's transfers: no thread hand-off per hop).

Who ran a step is read from ``threading.current_thread()`` inside it. Hand-offs are proven
with ``threading.Event``s and the helper count the stream keeps, never with sleeps.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from overlap.backends import cpu
from overlap.backends.cpu import Busy, CpuBackend, CpuEvent
from overlap.errors import CollectiveAborted, OverlapRuntimeError, StreamError
from overlap.launch import is_stepped, stepped

SETTLE_S = 5.0


def settle(ev: CpuEvent) -> CpuEvent:
    deadline = time.monotonic() + SETTLE_S
    while not ev.done():
        assert time.monotonic() < deadline, f"{ev!r} did not complete within {SETTLE_S:g} s"
        time.sleep(0.002)
    return ev


def until(cond, what: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.001)


@pytest.fixture
def backend():
    made: list[CpuBackend] = []

    def make(helping: bool) -> CpuBackend:
        b = CpuBackend(2, timeout=10.0)
        b.helping = helping
        made.append(b)
        return b

    yield make
    for b in made:
        b.abort("test teardown")
        b.close()


def gated(gate: threading.Event, log: list, *, first: str = "", last: str = "",
          every: float = 0.002):
    """A stepped op: notes the thread of its first step (``first``), then waits for
    ``gate`` (yielding when to look again), notes the thread of its last step (``last``)."""
    def steps():
        if first:
            log.append((first, threading.current_thread().name))
        while not gate.is_set():
            yield time.perf_counter() + every
        if last:
            log.append((last, threading.current_thread().name))
    return steps


def test_a_stepped_op_keeps_its_place_in_the_stream(backend):
    b = backend(helping=False)
    s = b.stream(0, "comm")
    log: list = []
    gate = threading.Event()
    s.launch("before", lambda: log.append("before"))
    s.launch("stepped", gated(gate, log, first="first", last="last"), stepped=True)
    s.launch("after", lambda: log.append("after"))
    done = s.record("end")
    until(lambda: len(log) == 2, "the stepped op began")
    assert not done.done()  # it yields until the gate opens; nothing after it runs
    assert log[1][0] == "first" and "after" not in log
    gate.set()
    assert settle(done).error is None
    assert [x if isinstance(x, str) else x[0] for x in log] == ["before", "first", "last",
                                                               "after"]


def test_without_helping_every_step_runs_on_the_streams_own_thread(backend):
    b = backend(helping=False)
    comm, compute = b.stream(0, "comm"), b.stream(0, "compute")
    log: list = []
    gate = threading.Event()
    produced = compute.record("produced")
    comm.wait_event(produced)
    comm.launch("send", gated(gate, log, first="first", last="last"), stepped=True)
    landed = comm.record("landed")
    compute.wait_event(landed)
    compute.launch("consume", lambda: log.append(("consume", threading.current_thread().name)))
    gate.set()
    settle(compute.record("end"))
    names = dict(log)
    assert names["first"] == names["last"] == "overlap-d0-comm"


def test_the_thread_that_completes_an_event_starts_the_stepped_op_waiting_for_it(
        backend, monkeypatch):
    # The comm stream's own thread never wakes on its own meanwhile: only the producer's
    # completion can start the op (a 10 s look-in instead of 20 ms).
    monkeypatch.setattr(cpu, "_POLL_S", 10.0)
    b = backend(helping=True)
    comm, compute = b.stream(0, "comm"), b.stream(0, "compute")
    log: list = []
    go = threading.Event()
    produced = b.new_event("produced")
    comm.wait_event(produced)
    comm.launch("send", gated(threading.Event(), log, first="first"), stepped=True)
    # (Its wait registered — not busy()'s "queued work", which the thread has yet to take.)
    until(lambda: comm._current is not None and comm._current[1] is produced,
          "the comm stream waits for the producer")
    compute.launch("produce", go.wait)
    compute.record(event=produced)
    go.set()
    until(lambda: log, "the send began")
    assert log == [("first", "overlap-d0-compute")]


def test_a_thread_waiting_for_what_follows_a_stepped_op_completes_it(backend):
    b = backend(helping=True)
    comm, compute = b.stream(0, "comm"), b.stream(0, "compute")
    log: list = []
    gate = threading.Event()
    comm.launch("receive", gated(gate, log, first="first", last="last"), stepped=True)
    landed = comm.record("landed")
    compute.wait_event(landed)
    compute.launch("consume", lambda: log.append(("consume", threading.current_thread().name)))
    end = compute.record("end")
    # Once the compute stream's thread helps (it waits for ``landed``), the comm stream's
    # own thread leaves the op to it: the step that sees the gate open is the helper's.
    until(lambda: comm._helpers == 1, "the compute stream's thread helps")
    gate.set()
    assert settle(end).error is None
    names = dict(log)
    assert names["first"] == "overlap-d0-comm"  # posted by its own stream's thread
    assert names["last"] == names["consume"] == "overlap-d0-compute"


def test_a_failing_step_fails_its_stream_and_whoever_waits(backend):
    b = backend(helping=True)
    comm, compute = b.stream(0, "comm"), b.stream(0, "compute")

    def steps():
        yield 0.0
        raise ValueError("the peer sent garbage")

    comm.launch("receive #3", steps, stepped=True)
    landed = comm.record("landed")
    compute.wait_event(landed)
    compute.launch("consume", lambda: None)
    end = compute.record("end")
    err = settle(landed).error
    assert isinstance(err, StreamError) and "receive #3" in str(err)
    assert "the peer sent garbage" in str(err) and err.op == "receive #3"
    assert settle(end).error is err
    assert err in b.failures


@pytest.mark.parametrize("helping", [False, True])
def test_abort_ends_a_stepped_op_that_never_looks_at_it(backend, helping):
    b = backend(helping=helping)
    s = b.stream(1, "comm")
    ended = threading.Event()

    def steps():
        try:
            while True:
                yield time.perf_counter() + 0.001
        finally:
            ended.set()  # its requests would be cancelled here

    s.launch("receive #9", steps, stepped=True)
    done = s.record("done")
    until(lambda: s.busy() is not None and s.busy().op is None and not s.busy().waiting,
          "the op is under way")
    b.abort("a peer failed")
    err = settle(done).error
    assert isinstance(err, CollectiveAborted) and "receive #9" in str(err)
    assert "a peer failed" in str(err) and ended.is_set()


def test_busy_names_a_stepped_op_under_way(backend):
    b = backend(helping=True)
    s = b.stream(1, "comm")
    gate = threading.Event()
    s.launch("receive #4 on device 1", gated(gate, []), category="comm", op=4, stepped=True)
    until(lambda: s.busy() is not None and s.busy().op == 4, "the op is under way")
    busy = s.busy()
    assert isinstance(busy, Busy) and not busy.waiting
    assert (busy.label, busy.category, busy.device) == ("receive #4 on device 1", "comm", 1)
    gate.set()
    settle(s.record("end"))
    assert s.busy() is None


def test_a_stepped_op_is_traced_from_its_first_step_to_its_last(backend):
    b = backend(helping=True)
    b.start_trace()
    s = b.stream(0, "comm")
    gate, log = threading.Event(), []
    s.launch("receive", gated(gate, log, first="first"), category="comm", op=11, stepped=True)
    until(lambda: log, "the op is under way")
    opened = time.perf_counter()
    gate.set()
    settle(s.record("end"))
    (rec,) = b.trace
    assert rec.op == 11 and rec.stream == "comm" and rec.start < opened <= rec.end


def test_one_process_backends_step_nothing():
    b = CpuBackend(2)
    try:
        assert b.helping is False and not b.steps_broadcast((0, 1), 0)
        with pytest.raises(OverlapRuntimeError, match="not stepped"):
            next(iter(b.broadcast_steps((0, 1), 0, 0, None, "x")))
    finally:
        b.close()


def test_stepped_marks_a_body_for_launch():
    def body():
        yield 0.0

    assert not is_stepped(body)
    assert stepped(body) is body and is_stepped(body)


def test_a_stepped_op_under_way_when_a_trace_starts_stays_out_of_it(backend):
    """As a plain op does: the trace a call starts holds its own ops only (a stepped op of
    an earlier call, finishing meanwhile, would have no start in it)."""
    b = backend(helping=True)
    s = b.stream(0, "comm")
    gate, log = threading.Event(), []
    s.launch("receive #3 (earlier call)", gated(gate, log, first="first"), category="comm",
             op=3, stepped=True)
    until(lambda: log, "the op is under way")
    b.start_trace()
    gate.set()
    settle(s.record("end"))
    assert b.trace == []


def test_a_stream_whose_head_a_helper_took_still_sees_abort(backend, monkeypatch):
    """The stream's thread goes idle (nothing queued, nothing parked) in the instant a
    helper holds the stepped op it popped but has not parked yet; work launched while the
    op is parked must still wake it, or its untimed wait misses every abort."""
    b = backend(helping=True)
    comm, compute = b.stream(0, "comm"), b.stream(0, "compute")
    produced, later = b.new_event("produced"), b.new_event("later")
    launched: list = []

    def steps():  # one step, while parked: the next call's work is launched meanwhile
        comm.wait_event(later)  # (never completes: only an abort ends the wait)
        comm.launch("next", lambda: None)
        launched.append(comm.record("next end"))
        return
        yield  # (a generator: a stepped op's body)

    real_start = cpu.range_start

    def start(message: str, category: str):
        if message == "send":  # the helper, between popping the op and parking it ...
            assert threading.current_thread() is not comm._thread
            with comm._lock:
                comm._cv.notify()  # ... lets the comm thread look: nothing queued, nothing
            until(lambda: comm._idle, "the comm thread goes idle")  # parked: it goes idle
        return real_start(message, category)

    monkeypatch.setattr(cpu, "range_start", start)
    # The comm thread wakes only when woken (so that the helper, not it, takes the send).
    monkeypatch.setattr(cpu, "_POLL_S", 1.0)
    comm.wait_event(produced)
    comm.launch("send", steps, stepped=True)
    # (Its wait registered — not busy()'s "queued work", which the thread has yet to take.)
    until(lambda: comm._current is not None and comm._current[1] is produced,
          "the comm stream waits for the producer")
    compute.record(event=produced)  # its completion starts the send on this thread
    # (Not through busy(): it wakes a thread it finds idle beside queued work.)
    until(lambda: launched and comm._current is not None and comm._current[1] is later
          and not comm._drive.locked(),
          "the helper left the comm stream waiting for the next call's event")
    b.abort("a peer failed")
    err = settle(launched[0]).error
    assert isinstance(err, CollectiveAborted) and "a peer failed" in str(err)


def test_abandoning_a_stream_ends_its_stepped_op(backend):
    b = backend(helping=False)
    s = b.stream(0, "comm")
    ended, log = threading.Event(), []

    def steps():
        log.append("first")
        try:
            while True:
                yield time.perf_counter() + 60.0  # (its thread does not step it meanwhile)
        finally:
            ended.set()  # its requests would be cancelled here

    s.launch("receive #5", steps, category="comm", op=5, stepped=True)
    until(lambda: s._parked is not None and s._parked.until > 0, "the op is parked")
    b.abandon([s.busy()], "given up")
    assert ended.is_set() and s.lost == "given up"


def test_a_producer_begins_its_send_even_while_the_one_before_is_under_way(
        backend, monkeypatch):
    """The wait behind a parked op kicks its stream too: the producer's thread steps the
    op before (whatever it said about when to look again) and, once it is over, begins the
    next send itself."""
    monkeypatch.setattr(cpu, "_POLL_S", 10.0)  # (the comm thread does not look in meanwhile)
    b = backend(helping=True)
    comm, compute = b.stream(0, "comm"), b.stream(0, "compute")
    first_sent, log = threading.Event(), []
    e1, e2 = b.new_event("F0"), b.new_event("F1")

    def send0():
        log.append(("begun", threading.current_thread().name))
        while not first_sent.is_set():
            yield time.perf_counter() + 60.0  # (its own thread will not look again soon)

    comm.wait_event(e1)
    comm.launch("send 0", send0, stepped=True)
    comm.wait_event(e2)
    comm.launch("send 1", gated(threading.Event(), log, first="send 1"), stepped=True)
    # (Each record behind a forward on the compute stream, so that its thread makes it; a
    # record on an idle stream would be made by the launcher — here, this test's thread.)
    compute.launch("F0", lambda: None)
    compute.record(event=e1)
    until(lambda: comm._parked is not None and comm._parked.until > 0, "send 0 is under way")
    first_sent.set()  # its receiver took it; nobody has looked yet
    compute.launch("F1", lambda: None)
    compute.record(event=e2)
    until(lambda: len(log) == 2, "send 1 began")
    assert log[1] == ("send 1", "overlap-d0-compute")


def test_a_blocking_mpi_wait_sleeps_no_longer_than_an_abort_allows():
    """Where an MPI transfer runs its steps on one thread (several participants on its
    rank), a step's long "not before" (a learned wait of seconds) is slept in short pieces
    that end once the backend is aborted; the next step then raises."""
    from overlap.backends.mpi import _drive

    class Aborted(Exception):
        pass

    class Backend:
        abort_reason = None

    backend = Backend()

    def steps():
        while True:
            if backend.abort_reason is not None:
                raise Aborted(backend.abort_reason)
            yield time.perf_counter() + 600.0

    threading.Timer(0.05, setattr, (backend, "abort_reason", "a peer failed")).start()
    started = time.monotonic()
    with pytest.raises(Aborted, match="a peer failed"):
        _drive(steps(), backend)
    assert time.monotonic() - started < SETTLE_S  # not the step's 600 s


def test_work_that_became_ready_during_a_step_is_begun_at_once(backend):
    """The event a stream's next wait waits for completes while the parked op before it is
    taking a step (no kick is hooked yet): the op is stepped again at once — not at its own
    "not before" — and what follows begins."""
    b = backend(helping=True)
    s, t = b.stream(0, "comm"), b.stream(1, "compute")
    queued, armed, sent, log = threading.Event(), threading.Event(), threading.Event(), []
    box: dict = {}

    def send0():  # (its first step waits, in this test only, to place the interleaving)
        assert queued.wait(SETTLE_S)  # the wait and the op behind it are queued
        while not sent.is_set():  # (not yet, when the step begins)
            if not armed.is_set():
                armed.set()  # the producer finishes now, during this step
                assert box["ready"]._done.wait(SETTLE_S)
            yield time.perf_counter() + 60.0

    s.launch("send 0", send0, stepped=True)
    t.launch("produce", lambda: (armed.wait(SETTLE_S), sent.set()))
    box["ready"] = t.record("produced")
    s.wait_event(box["ready"])
    s.launch("send 1", gated(threading.Event(), log, first="send 1"), stepped=True)
    queued.set()
    until(lambda: log, "send 1 began")  # (else: 60 s later)


# ---- steps woken by what they wait for (step_waker) ---------------------------------------


@pytest.mark.parametrize("helping", [False, True])
def test_a_step_that_waits_on_its_waker_is_stepped_again_when_called(backend, helping,
                                                                     monkeypatch):
    """A step hands its waker to whatever signals completion (a host link's message) and
    asks to be looked at only an hour later: the call has it stepped at once, by a helper
    where allowed, else by the stream's thread (woken: it does not look in meanwhile)."""
    monkeypatch.setattr(cpu, "_POLL_S", 10.0)
    b = backend(helping=helping)
    s = b.stream(0, "comm")
    message, log = threading.Event(), []
    assert cpu.step_waker() is None  # (outside a step)

    def receive():
        wake = cpu.step_waker()
        assert wake is not None
        threading.Thread(target=lambda: (message.wait(SETTLE_S), wake())).start()
        while not message.is_set():
            yield time.perf_counter() + 3600.0
        log.append(threading.current_thread().name)

    s.launch("receive", receive, stepped=True)
    done = s.record("received")
    until(lambda: s._parked is not None and s._parked.until > 0, "the receive waits")
    message.set()
    settle(done)
    assert len(log) == 1
    if not helping:
        assert log == ["overlap-d0-comm"]


def test_a_waker_called_during_its_step_makes_the_next_one_due_at_once(backend):
    """The message comes after the step looked but before it yielded its hour: the call is
    not lost — the op is due at once."""
    b = backend(helping=False)
    s = b.stream(0, "comm")
    message = threading.Event()

    def receive():
        while not message.is_set():
            message.set()  # (arrives now, after the look)
            cpu.step_waker()()
            yield time.perf_counter() + 3600.0

    s.launch("receive", receive, stepped=True)
    settle(s.record("received"))


def test_a_blocking_mpi_wait_is_woken_by_its_waker():
    """The same where an MPI transfer's steps run on one thread (``_drive``)."""
    from overlap.backends.mpi import _drive

    class Backend:
        abort_reason = None

    message = threading.Event()

    def steps():
        wake = cpu.step_waker()
        threading.Thread(target=lambda: (message.wait(SETTLE_S), wake())).start()
        while not message.is_set():
            yield time.perf_counter() + 3600.0

    threading.Timer(0.01, message.set).start()
    started = time.monotonic()
    _drive(steps(), Backend())
    assert time.monotonic() - started < SETTLE_S  # not the step's hour


def test_work_launched_after_a_helper_finished_the_head_wakes_the_paused_thread(
        backend, monkeypatch):
    """The stream's thread pauses on a parked op; a helper (the thread that completes what
    it waited for) finishes it. A plain op launched next — only that thread may run it —
    wakes it, instead of waiting out its pause (here 10 s)."""
    monkeypatch.setattr(cpu, "_POLL_S", 10.0)
    b = backend(helping=True)
    s = b.stream(0, "comm")
    box: dict = {}
    message = threading.Event()

    def receive():
        box["wake"] = cpu.step_waker()
        while not message.is_set():
            yield time.perf_counter() + 3600.0

    s.launch("receive", receive, stepped=True)
    until(lambda: s._paused_on is not None, "the thread pauses on the receive")
    message.set()
    box["wake"]()  # (from this thread: it steps the receive to its end)
    assert s._parked is None
    ran = threading.Event()
    s.launch("after", ran.set)
    assert ran.wait(SETTLE_S), "the thread slept on through its pause"


def _warm(s) -> None:
    """Start the stream's thread and let it go idle (what a launch on it then finds)."""
    s.launch("warm", lambda: None)
    settle(s.record("warm"))
    until(lambda: s._idle, "the stream's thread waits for work")


def waiting_on_its_waker(log: list, wakers: list, *, look_again: float = 60.0,
                         first: str = "begun"):
    """A stepped op that waits for something that calls its ``step_waker`` (a link's
    message): notes who took its first and last step."""
    def steps():
        log.append((first, threading.current_thread().name))
        wakers.append(cpu.step_waker())
        landed = threading.Event()
        wakers.append(landed.set)
        while not landed.is_set():
            yield time.perf_counter() + look_again
        log.append(("over", threading.current_thread().name))
    return steps


def _idle_stream_then_a_receive(backend):
    """An idle comm stream (whose wake-ups are noted by thread), then a receive launched on
    it that waits on its waker: (stream, woken, the op's log, its wakers)."""
    s = backend(helping=True).stream(0, "comm")
    _warm(s)
    woken: list = []
    real = s._cv.notify
    s._cv.notify = lambda n=1: (woken.append(threading.current_thread().name), real(n))
    log: list = []
    wakers: list = []
    s.launch("recv", waiting_on_its_waker(log, wakers), stepped=True)
    return s, woken, log, wakers


def test_a_launch_on_an_idle_stream_begins_the_stepped_op_itself_and_wakes_no_thread(backend):
    """The launcher begins a stepped op on a stream with nothing under way (a send posted,
    a receive posted early) and records the event behind it; the stream's thread sleeps on:
    whoever completes the op (its waker's caller) runs what follows."""
    s, woken, log, wakers = _idle_stream_then_a_receive(backend)
    ev = s.record("after recv")
    me = threading.current_thread().name
    assert log == [("begun", me)] and not ev.done()

    def land() -> None:  # as a link thread does: the message is in, the op is poked
        wakers[1]()
        wakers[0]()

    t = threading.Thread(target=land, name="link")
    t.start()
    t.join(SETTLE_S)
    settle(ev)
    assert log[1] == ("over", "link") and ev.error is None
    assert woken == [], woken  # the stream's thread was never needed


def test_abort_wakes_the_idle_thread_beside_an_op_its_launcher_began(backend):
    """Nobody completes the op (its message never comes): an abort wakes the idle thread,
    which steps it; the step sees the abort and the stream fails at once."""
    b = backend(helping=True)
    s = b.stream(0, "comm")
    _warm(s)
    seen: list = []

    def steps():
        while b.abort_reason is None:
            yield time.perf_counter() + 60.0  # (its waker is never called)
        seen.append(threading.current_thread().name)
        raise CollectiveAborted(f"recv: aborted ({b.abort_reason})")

    s.launch("recv", steps, stepped=True)
    ev = s.record("after recv")
    b.abort("a peer failed")
    settle(ev)
    assert isinstance(ev.error, CollectiveAborted) and seen == ["overlap-d0-comm"]


def test_an_op_its_launcher_began_is_stepped_once_its_time_to_look_again_comes(backend):
    """Its waker is never called (a timeout to name): once the time it asked to be looked
    at again has passed, the runtime's look at the streams (``busy``) wakes the thread."""
    b = backend(helping=True)
    s = b.stream(0, "comm")
    _warm(s)
    log: list = []
    wakers: list = []
    s.launch("recv", waiting_on_its_waker(log, wakers, look_again=2 * cpu._POLL_S),
             stepped=True)
    ev = s.record("after recv")
    wakers[1]()  # landed, but nobody pokes it
    until(lambda: b.busy() is not None and ev.done(), "the op was looked at again")
    assert log[-1] == ("over", "overlap-d0-comm")


def test_ctrl_c_in_a_step_the_launcher_takes_reaches_the_launcher(backend):
    """A Ctrl-C landing in a step run by the launching (main) thread is raised to it, not
    swallowed into the stream's failure; the stream fails too (its work is cut short)."""
    b = backend(helping=True)
    s = b.stream(0, "comm")
    _warm(s)

    def steps():
        raise KeyboardInterrupt
        yield 0.0  # (a generator)

    with pytest.raises(KeyboardInterrupt):
        s.launch("send", steps, stepped=True)
    ev = s.record("after send")
    settle(ev)
    assert isinstance(ev.error, StreamError)
    assert s.busy() is None  # nothing left looking busy


def test_a_helper_leaves_the_idle_thread_asleep_beside_an_op_that_waits_on_its_waker(backend):
    """After a helper advanced a stream up to an op that waits on its waker (a receive over
    a link), the stream's idle thread is not woken for it; one due soon (an MPI request
    polled with backoff) still wakes it."""
    s, woken, _, wakers = _idle_stream_then_a_receive(backend)
    s._wake_if_needed()  # (what a helper calls after advancing the stream)
    assert woken == [] and s._idle
    s._parked.until = time.perf_counter()  # due now: polled, not woken by a waker
    s._wake_if_needed()
    assert woken == [threading.current_thread().name]
    wakers[1]()
    wakers[0]()
    until(lambda: s._parked is None, "the receive completed")


def _local_copy(b: CpuBackend, n: int):
    """Device 0's part of a transfer of ``n`` float64 to itself (a local copy) — the op and
    its source and destination arrays."""
    from overlap.reshard import transfer_op

    region = ((0, n),)
    shards, outs = {0: np.arange(float(n))}, {0: np.zeros(n)}
    fn = transfer_op(b, region, 0, (0,), 0, {0: region}, {0: region}, shards, outs,
                     np.dtype(np.float64), "#0", "comm")
    return fn, shards[0], outs[0]


def test_a_small_local_copy_is_copied_by_the_thread_that_launches_it(backend):
    """On a backend whose helpers run stepped ops, a small local copy is one: launched onto
    an idle stream it is done before the launch returns, on the launching thread (a wake-up
    of the stream's thread costs more than the copy)."""
    from overlap.reshard import INLINE_COPY_BYTES

    b = backend(helping=True)
    fn, src, out = _local_copy(b, INLINE_COPY_BYTES // 8)
    assert is_stepped(fn)
    s = b.stream(0, "comm")
    _warm(s)
    s.launch("copy", fn, stepped=True)
    np.testing.assert_array_equal(out, src)  # (before any wait: copied by this thread)
    assert settle(s.record("after")).error is None


@pytest.mark.parametrize("case", ["large", "no helpers", "emulated link time"])
def test_other_local_copies_stay_plain_ops_on_the_streams_thread(backend, case):
    """A copy too large to hold the launch up, one on a backend without helpers, and one
    whose time is emulated (it sleeps) stay plain ops, run by the stream's own thread."""
    from overlap.reshard import INLINE_COPY_BYTES

    b = backend(helping=case != "no helpers")
    if case == "emulated link time":
        b.link_time = lambda root, receivers, nbytes: 0.0
    n = INLINE_COPY_BYTES // 8 + (1 if case == "large" else 0)
    fn, src, out = _local_copy(b, n)
    assert not is_stepped(fn)
    s = b.stream(0, "comm")
    s.launch("copy", fn)
    assert settle(s.record("after")).error is None
    np.testing.assert_array_equal(out, src)
