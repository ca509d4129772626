"""The CPU backend: streams, events, collectives, failures, abort, close, link emulation.

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

from overlap.backends.cpu import CpuBackend, CpuEvent
from overlap.errors import (
    CollectiveAborted,
    CollectiveMismatch,
    CollectiveTimeout,
    OverlapRuntimeError,
    StreamError,
)

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
    uvloop = None

RUNNERS = [pytest.param(asyncio.run, id="asyncio"),
           pytest.param(getattr(uvloop, "run", None), id="uvloop",
                        marks=pytest.mark.skipif(uvloop is None, reason="no uvloop"))]

# Generous bound for work that should finish at once; only reached when something is broken.
SETTLE_S = 5.0


def settle(ev: CpuEvent, timeout: float = SETTLE_S) -> CpuEvent:
    """Block until ``ev`` completes; fail the test if it does not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not ev.done():
        assert time.monotonic() < deadline, f"{ev!r} did not complete within {timeout:g} s"
        time.sleep(0.002)
    return ev


@pytest.fixture
def make_backend():
    """CpuBackend factory; every backend is aborted and closed after the test."""
    made: list[CpuBackend] = []

    def make(num_devices: int, **kwargs) -> CpuBackend:
        b = CpuBackend(num_devices, **kwargs)
        made.append(b)
        return b

    yield make
    for b in made:
        b.abort("test teardown")  # so a test that failed mid-collective cannot hang here
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


def test_stream_runs_ops_in_launch_order(make_backend):
    s = make_backend(1).stream(0)
    seen: list[int] = []
    for i in range(200):
        s.launch(f"op{i}", functools.partial(seen.append, i))
    assert settle(s.record("end")).error is None
    assert seen == list(range(200))


@pytest.mark.parametrize("a, b", [((0, "compute"), (1, "compute")),
                                  ((0, "compute"), (0, "comm"))],
                         ids=["two-devices", "one-device-two-streams"])
def test_streams_run_concurrently(make_backend, a, b):
    """An op on stream A that waits for an op on stream B launched later still completes."""
    backend = make_backend(2)
    sa, sb = backend.stream(*a), backend.stream(*b)
    b_ran = threading.Event()
    observed: list[bool] = []
    sa.launch("wait for B", lambda: observed.append(b_ran.wait(SETTLE_S)))
    sb.launch("set", b_ran.set)
    settle(sa.record())
    settle(sb.record())
    assert observed == [True], "stream A never saw stream B's op: streams are serialized"


def test_record_completes_only_after_prior_work(make_backend):
    s = make_backend(1).stream(0)
    started, gate = threading.Event(), threading.Event()
    side: list[str] = []
    s.launch("blocked", blocked_op(started, gate, then=lambda: side.append("op")))
    ev = s.record("after blocked")
    assert started.wait(SETTLE_S)
    assert not ev.done(), "the event completed while earlier work was still running"
    gate.set()
    assert settle(ev).error is None
    assert side == ["op"]


def test_wait_event_orders_streams(make_backend):
    backend = make_backend(2)
    sa, sb = backend.stream(0), backend.stream(1)
    started, gate = threading.Event(), threading.Event()
    side: list[str] = []
    seen_by_b: list[list[str]] = []
    sa.launch("produce", blocked_op(started, gate, then=lambda: side.append("A")))
    ev_a = sa.record("A produced")
    sb.wait_event(ev_a)
    sb.launch("consume", lambda: seen_by_b.append(list(side)))
    ev_b = sb.record("B consumed")
    assert started.wait(SETTLE_S)
    assert not ev_b.done()
    gate.set()
    assert settle(ev_b).error is None
    assert seen_by_b == [["A"]], "stream B ran before the event it waits for"


def test_wait_event_on_failed_event_fails_the_waiting_stream(make_backend):
    backend = make_backend(2)
    sa, sb = backend.stream(0), backend.stream(1)

    def bad() -> None:
        raise ValueError("producer broke")

    sa.launch("produce", bad)
    ev_a = sa.record("A produced")
    ran: list[str] = []
    sb.wait_event(ev_a)
    sb.launch("consume", lambda: ran.append("B"))
    ev_b = settle(sb.record("B consumed"))
    assert isinstance(ev_b.error, StreamError)
    assert ev_b.error.device == 0 and "producer broke" in str(ev_b.error)
    assert ran == []


# ---- events from asyncio --------------------------------------------------------------------


async def test_await_event_does_not_block_the_loop(make_backend):
    loop = asyncio.get_running_loop()
    assert loop.get_debug(), "conftest should run coroutine tests in debug mode"
    s = make_backend(1).stream(0)
    started, gate = threading.Event(), threading.Event()
    side: list[str] = []
    s.launch("blocked", blocked_op(started, gate, then=lambda: side.append("op")))
    ev = s.record("after blocked")
    waiter = asyncio.ensure_future(ev.wait())
    for _ in range(5):  # the loop keeps running other work while the event is pending
        await asyncio.sleep(0)
    assert not waiter.done()
    loop.call_soon(gate.set)
    await asyncio.wait_for(waiter, SETTLE_S)
    assert ev.done() and ev.error is None and side == ["op"]
    await ev.wait()  # an already completed event returns at once


async def test_await_failed_event_raises_the_stream_error(make_backend):
    s = make_backend(2).stream(1, "comm")

    def bad() -> None:
        raise KeyError("gone")

    s.launch("lookup", bad)
    ev = s.record()
    with pytest.raises(StreamError, match=r"device 1 .*'comm'.*lookup") as info:
        await asyncio.wait_for(ev.wait(), SETTLE_S)
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("fail", [False, True], ids=["all-complete", "one-fails"])
async def test_a_calls_wait_is_woken_once_not_once_per_event(make_backend, fail):
    """``wait_all`` (a call's wait for its lanes' ends) is woken from the streams' threads
    once: by the last event, or at once by a failure (raised while others still wait)."""
    from overlap.watch import wait_all

    b = make_backend(4)
    gates = [threading.Event() for _ in range(4)]
    streams = [b.stream(d) for d in range(4)]
    for d, s in enumerate(streams):
        if fail and d == 0:
            s.launch("bad", lambda g=gates[0]: g.wait(SETTLE_S) and (_ for _ in ()).throw(
                KeyError("gone")))
        else:
            s.launch("gated", lambda g=gates[d]: g.wait(SETTLE_S))
    events = [s.record(f"end {d}") for d, s in enumerate(streams)]
    loop = asyncio.get_running_loop()
    woken, real = [], loop.call_soon_threadsafe

    def counted(cb, *args, **kwargs):
        woken.append(threading.current_thread().name)
        return real(cb, *args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    try:
        waiting = asyncio.ensure_future(wait_all(b, events, None))
        for _ in range(3):  # (asleep in its wait, whatever it awaits)
            await asyncio.sleep(0)
        if fail:
            gates[0].set()  # the others stay blocked: the failure alone must end the wait
            with pytest.raises(StreamError, match="bad"):
                await asyncio.wait_for(waiting, SETTLE_S)
        else:
            for g in gates:  # one by one, each lane's end from its own stream's thread
                g.set()
            await asyncio.wait_for(waiting, SETTLE_S)
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
        for g in gates:
            g.set()
    assert len(woken) == 1, woken


@pytest.mark.parametrize("runner", RUNNERS)
def test_abandoned_await_does_not_break_the_stream(make_backend, runner):
    """A coroutine that stopped awaiting an event on a loop that is now closed must not take
    the stream down when the event completes later: later work still runs."""
    s = make_backend(1).stream(0)
    started, gate = threading.Event(), threading.Event()
    s.launch("blocked", blocked_op(started, gate))
    ev = s.record("awaited then abandoned")

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
    s.launch("later", lambda: ran.append("later"))
    later = s.record("later")
    deadline = time.monotonic() + 1.0
    while not later.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert later.done() and ran == ["later"], (
        "the stream stopped working after an event it completed had a waiter whose loop "
        "was closed"
    )


# ---- collectives ----------------------------------------------------------------------------


def _run_on_devices(backend: CpuBackend, devices, make_op) -> list[CpuEvent]:
    events = []
    for d in devices:
        s = backend.stream(d, "comm")
        s.launch(f"collective on {d}", make_op(d))
        events.append(s.record(f"done on {d}"))
    return [settle(ev) for ev in events]


def test_broadcast_copies_root_buffer_into_receivers(make_backend):
    backend = make_backend(3)
    root = 1
    bufs = {d: np.zeros((2, 3)) for d in range(3)}
    bufs[root][:] = np.arange(6.0).reshape(2, 3)
    events = _run_on_devices(backend, [2, 0, 1], lambda d: lambda: backend.broadcast(
        (0, 1, 2), d, root, bufs[d], "b"))
    assert [ev.error for ev in events] == [None] * 3
    for d in range(3):
        np.testing.assert_array_equal(bufs[d], np.arange(6.0).reshape(2, 3), err_msg=f"dev {d}")
    assert len({id(b) for b in bufs.values()}) == 3  # separate buffers: bytes really moved


def test_broadcast_shape_mismatch_fails_every_participant(make_backend):
    backend = make_backend(2, timeout=0.5)
    bufs = {0: np.ones(4), 1: np.zeros(5)}
    events = _run_on_devices(backend, [0, 1], lambda d: lambda: backend.broadcast(
        (0, 1), d, 0, bufs[d], "b"))
    for ev in events:
        assert ev.error is not None and "device 1" in str(ev.error), ev


def test_all_reduce_sums(make_backend):
    backend = make_backend(3)
    bufs = {d: np.full(4, d + 1.0) for d in range(3)}
    events = _run_on_devices(backend, range(3), lambda d: lambda: backend.all_reduce(
        (0, 1, 2), d, bufs[d], "r"))
    assert [ev.error for ev in events] == [None] * 3
    for d in range(3):
        np.testing.assert_array_equal(bufs[d], np.full(4, 6.0))


def test_all_gather_stacks_in_group_order(make_backend):
    backend = make_backend(3)
    bufs = {d: np.full(2, 10.0 * d) + np.arange(2) for d in range(3)}
    outs = {d: np.zeros((3, 2)) for d in range(3)}
    events = _run_on_devices(backend, [1, 2, 0], lambda d: lambda: backend.all_gather(
        (0, 1, 2), d, bufs[d], outs[d], "g"))
    assert [ev.error for ev in events] == [None] * 3
    want = np.array([[0.0, 1.0], [10.0, 11.0], [20.0, 21.0]])
    for d in range(3):
        np.testing.assert_array_equal(outs[d], want, err_msg=f"device {d}")


def test_collectives_match_by_launch_position(make_backend):
    """Two broadcasts on the same group, launched in the same order, pair up in order."""
    backend = make_backend(2)
    first = {0: np.array([1.0]), 1: np.zeros(1)}
    second = {0: np.zeros(1), 1: np.array([2.0])}
    for d in (0, 1):
        s = backend.stream(d, "comm")
        s.launch("first", lambda d=d: backend.broadcast((0, 1), d, 0, first[d], "first"))
        s.launch("second", lambda d=d: backend.broadcast((0, 1), d, 1, second[d], "second"))
    for d in (0, 1):
        assert settle(backend.stream(d, "comm").record()).error is None
    assert first[1][0] == 1.0 and second[0][0] == 2.0


# ---- deadlocks and the watchdog -------------------------------------------------------------


def test_cyclic_launch_order_times_out_naming_missing_devices(make_backend):
    backend = make_backend(3, timeout=0.5)
    order = {0: [(0, 1), (0, 2)], 1: [(1, 2), (0, 1)], 2: [(0, 2), (1, 2)]}
    ran: list[int] = []
    events = {}
    t0 = time.perf_counter()
    for d, groups in order.items():
        s = backend.stream(d, "comm")
        for g in groups:
            buf = np.zeros(2)
            s.launch(f"bcast {g}", lambda d=d, g=g, buf=buf: backend.broadcast(
                g, d, min(g), buf, f"bcast{g}"))
        s.launch("after", functools.partial(ran.append, d))
        events[d] = s.record(f"after on {d}")
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
    assert len(backend.failures) == 3


def test_swapped_collectives_on_one_group_mismatch(make_backend):
    backend = make_backend(2, timeout=0.5)
    bufs = {d: {"A": np.zeros(3), "B": np.zeros(3)} for d in (0, 1)}
    plan = {0: ["A", "B"], 1: ["B", "A"]}
    events = {}
    for d, names in plan.items():
        s = backend.stream(d, "comm")
        for name in names:
            s.launch(f"bcast {name}", lambda d=d, name=name: backend.broadcast(
                (0, 1), d, 0, bufs[d][name], name))
        events[d] = s.record()
    for d, ev in events.items():
        err = settle(ev).error
        assert isinstance(err, CollectiveMismatch), (d, err)
        assert "device 0" in str(err) and "device 1" in str(err), str(err)
        assert "[A]" in str(err) and "[B]" in str(err), str(err)


# ---- failures ---------------------------------------------------------------------------------


def test_failing_op_fails_its_stream_only_until_reset(make_backend):
    backend = make_backend(2)
    s = backend.stream(1, "compute")
    other_device, other_stream = backend.stream(0, "compute"), backend.stream(1, "comm")
    ran: list[str] = []

    def bad() -> None:
        raise ValueError("bad value")

    s.launch("good 1", lambda: ran.append("good 1"))
    s.launch("matmul#3", bad)
    s.launch("good 2", lambda: ran.append("good 2"))
    ev1 = s.record("after failure")
    s.launch("good 3", lambda: ran.append("good 3"))
    ev2 = s.record("later")
    settle(ev1)
    settle(ev2)
    assert ran == ["good 1"], "ops after the failure ran"
    for ev in (ev1, ev2):
        err = ev.error
        assert isinstance(err, StreamError), err
        assert (err.device, err.stream, err.op) == (1, "compute", "matmul#3")
        assert "device 1" in str(err) and "'compute'" in str(err) and "matmul#3" in str(err)
        assert isinstance(err.__cause__, ValueError) and str(err.__cause__) == "bad value"
    assert backend.failures == [ev1.error]

    # Other streams, on this device and on others, are unaffected.
    other = []
    for st in (other_device, other_stream):
        st.launch("fine", lambda st=st: other.append(st.name))
        other.append(settle(st.record()).error)
    assert other == ["compute", None, "comm", None]

    backend.reset()
    assert backend.failures == []
    s.launch("good 4", lambda: ran.append("good 4"))
    assert settle(s.record("after reset")).error is None
    assert ran == ["good 1", "good 4"]


def test_abort_wakes_blocked_collective(make_backend):
    backend = make_backend(2, timeout=30.0)
    s = backend.stream(0, "comm")
    entered = threading.Event()

    def lonely() -> None:
        entered.set()
        backend.broadcast((0, 1), 0, 0, np.zeros(2), "lonely")

    s.launch("lonely bcast", lonely)
    ev = s.record("after lonely")
    assert entered.wait(SETTLE_S)
    assert not ev.done()
    backend.abort("operator pressed ^C")
    assert backend.quiesce(timeout=2) is True
    assert isinstance(ev.error, CollectiveAborted), ev.error
    assert "operator pressed ^C" in str(ev.error) and "device 0" in str(ev.error)

    # reset() forgets the half-joined rendezvous: a complete broadcast works again.
    backend.reset()
    bufs = {0: np.array([7.0, 8.0]), 1: np.zeros(2)}
    events = _run_on_devices(backend, [0, 1], lambda d: lambda: backend.broadcast(
        (0, 1), d, 0, bufs[d], "again"))
    assert [e.error for e in events] == [None, None]
    np.testing.assert_array_equal(bufs[1], [7.0, 8.0])


def test_abort_wakes_stream_waiting_for_event(make_backend):
    backend = make_backend(2, timeout=30.0)
    started, gate = threading.Event(), threading.Event()
    sa, sb = backend.stream(0), backend.stream(1)
    sa.launch("blocked", blocked_op(started, gate))
    ev_a = sa.record("A")
    sb.wait_event(ev_a)
    ev_b = sb.record("B")
    assert started.wait(SETTLE_S)
    backend.abort("cancelled")
    settle(ev_b, 2.0)
    assert isinstance(ev_b.error, CollectiveAborted) and "cancelled" in str(ev_b.error)
    gate.set()
    assert backend.quiesce(timeout=2) is True


def test_quiesce_reports_streams_that_do_not_stop(make_backend):
    backend = make_backend(1)
    started, gate = threading.Event(), threading.Event()
    backend.stream(0).launch("blocked", blocked_op(started, gate))
    assert started.wait(SETTLE_S)
    assert backend.quiesce(timeout=0.1) is False
    gate.set()
    assert backend.quiesce(timeout=2) is True


# ---- close ----------------------------------------------------------------------------------


@pytest.mark.parametrize("queued_after", [True, False],
                         ids=["work-queued-behind", "nothing-queued-behind"])
def test_close_joins_threads_blocked_in_a_collective(make_backend, queued_after):
    """close() must return promptly even when a stream thread is stuck in a collective whose
    peer never arrives — whether or not more work is queued behind it."""
    backend = make_backend(3, timeout=30.0)
    entered = threading.Event()

    def lonely() -> None:
        entered.set()
        backend.broadcast((0, 1), 0, 0, np.zeros(2), "lonely")

    backend.stream(0, "comm").launch("lonely bcast", lonely)
    if queued_after:
        backend.stream(0, "comm").record("behind")
    backend.stream(2).launch("idle stream", lambda: None)
    settle(backend.stream(2).record())  # an idle stream must not decide whether close aborts
    assert entered.wait(SETTLE_S)
    closer = threading.Thread(target=backend.close, name="test-closer", daemon=True)
    closer.start()
    closer.join(1.0)
    stuck = closer.is_alive()
    if stuck:  # unblock it so the rest of the session is not held up by the bug
        backend.abort("test cleanup")
        closer.join(SETTLE_S)
    assert not stuck, ("close() did not return within 1 s: it waits for the blocked collective's "
                       "30 s timeout instead of aborting it")
    with pytest.raises(OverlapRuntimeError, match="closed"):
        backend.stream(0, "comm").launch("late", lambda: None)
    with pytest.raises(OverlapRuntimeError, match="closed"):
        backend.stream(1, "new")


def test_close_is_idempotent_and_joins_idle_threads(make_backend):
    before = set(threading.enumerate())
    backend = make_backend(4)
    for d in range(4):
        backend.stream(d).launch("noop", lambda: None)
    started = [t for t in threading.enumerate() if t not in before]
    assert sorted(t.name for t in started) == [f"overlap-d{d}-compute" for d in range(4)]
    backend.close()
    assert [t.name for t in started if t.is_alive()] == []
    backend.close()


# ---- link emulation -------------------------------------------------------------------------


async def test_link_emulation_holds_broadcast_for_link_time(make_backend):
    calls = []

    def link_time(root, receivers, nbytes):
        calls.append((root, list(receivers), nbytes))
        return 0.2

    backend = make_backend(3, link_time=link_time)
    bufs = {0: np.arange(3.0), 1: np.zeros(3), 2: np.zeros(3)}
    t0 = time.perf_counter()
    events = []
    for d in range(3):
        s = backend.stream(d, "comm")
        s.launch("bcast", lambda d=d: backend.broadcast((0, 1, 2), d, 0, bufs[d], "slow"))
        events.append(s.record())
    for ev in events:
        await asyncio.wait_for(ev.wait(), SETTLE_S)
    assert time.perf_counter() - t0 >= 0.2
    assert calls == [(0, [1, 2], 24)]
    for d in (1, 2):
        np.testing.assert_array_equal(bufs[d], np.arange(3.0))


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
        CpuBackend(*args, **kwargs)


@pytest.mark.parametrize("device", [2, -1, 100])
def test_stream_device_out_of_range(make_backend, device):
    backend = make_backend(2)
    with pytest.raises(ValueError, match=rf"device.*{device}"):
        backend.stream(device)
    assert backend.streams() == []


def test_stopping_waits_for_the_queue_behind_a_slow_op_to_drain(make_backend):
    # An op slower than the grace (but not hung) ends; the waits queued behind it then see
    # the abort and drain. They began late: they must get their grace from then, not be
    # taken for stuck (which abandoned a healthy stream after an interrupted call).
    from overlap.backends.cpu import STOP_GRACE_S

    backend = make_backend(2, timeout=30.0)
    s = backend.stream(0)
    started = threading.Event()
    never = backend.new_event("never recorded")

    def slow() -> None:
        started.set()
        time.sleep(2 * STOP_GRACE_S)

    s.launch("slow op", slow)
    for _ in range(3):
        s.wait_event(never)
    assert started.wait(SETTLE_S)
    backend.abort("interrupted")
    assert backend.stop_hung() == []
    assert backend.busy() == []


@pytest.mark.parametrize("category", ["comm", "compute"])
def test_a_transfer_past_its_timeout_gets_the_grace_to_see_an_abort(make_backend, category):
    """After an abort, a comm op (a transfer, whose waits look at aborts themselves) that has
    run past the timeout gets the grace to end; a compute op (user code, which may never
    look) past it is hung at once."""
    backend = make_backend(2, timeout=0.2)
    s = backend.stream(0, "comm")
    started, release = threading.Event(), threading.Event()

    def transfer() -> None:  # looks at the abort every 50 ms, as a transfer's wait does
        started.set()
        while not release.is_set() and (category == "compute" or backend.abort_reason is None):
            time.sleep(0.05)

    s.launch("transfer", transfer, category=category)
    assert started.wait(SETTLE_S)
    time.sleep(0.3)  # past the 0.2 s timeout
    backend.abort("a peer failed")
    stuck = backend.stop_hung()
    release.set()
    if category == "comm":
        assert stuck == [] and backend.busy() == []
    else:
        assert [b.label for b in stuck] == ["transfer"]


@pytest.mark.parametrize("started", [False, True], ids=["before-start", "while-starting"])
def test_ctrl_c_while_a_stream_thread_starts_leaves_the_stream_usable(monkeypatch, started):
    # Ctrl-C landing in Thread.start() (the test suite saw it in a step's launch) left a
    # thread object that never ran: the stream then looked stuck in queued work for good,
    # and the next step was refused as DeviceThreadLost.
    import threading

    real = threading.Thread.start
    calls = []

    def interrupted(self):
        calls.append(self.name)
        if len(calls) == 1:
            if started:
                real(self)  # it got going; the caller still sees the interrupt
            raise KeyboardInterrupt
        real(self)

    backend = CpuBackend(1)
    try:
        s = backend.stream(0, "compute")
        monkeypatch.setattr(threading.Thread, "start", interrupted)
        with pytest.raises(KeyboardInterrupt):
            s.launch("first", lambda: None)
        backend.reset()  # what the runtime does after an interrupted call
        ran = threading.Event()
        s.launch("second", ran.set)
        ev = s.record()
        assert ran.wait(5.0) and ev._done.wait(5.0)
    finally:
        monkeypatch.undo()
        backend.close()


def test_a_wakeup_lost_to_ctrl_c_is_recovered_when_the_runtime_looks():
    # Ctrl-C landing between a launch's append and its notify() (Python code) left a stream
    # thread asleep beside its queued op: after 10 s it was declared lost (seen in CI). The
    # recovery's look at the streams (busy()) wakes such a thread.
    import threading

    backend = CpuBackend(1)
    try:
        s = backend.stream(0, "compute")
        s.launch("start the thread", lambda: None)
        assert s.record()._done.wait(5.0)
        ran = threading.Event()
        notify = s._cv.notify
        s._cv.notify = lambda n=1: None  # the interrupted launch's notify never happens
        try:
            s.launch("lost wakeup", ran.set)
        finally:
            s._cv.notify = notify
        backend.busy()  # what stop() and stop_hung() poll
        assert ran.wait(5.0)
    finally:
        backend.close()


def test_an_events_flag_wakes_a_blocked_waiter_and_answers_the_rest_at_once():
    """``CpuEvent``'s done flag (``cpu._Flag``): ``wait`` answers at once when set (no
    condition made for it), times out when never set, and a thread blocked in it is woken
    by ``set`` from another thread — not left to its timeout."""
    from overlap.backends.cpu import _Flag

    never = _Flag()
    assert never.wait(0.001) is False and not never.is_set()
    early = _Flag()
    early.set()
    assert early.wait(60.0) is True and early._cond is None
    flag, answers, waiting = _Flag(), [], threading.Event()

    def waiter() -> None:
        waiting.set()
        answers.append(flag.wait(60.0))  # (woken by set, or the join below gives up)

    t = threading.Thread(target=waiter)
    t.start()
    assert waiting.wait(10.0)
    while flag._cond is None:  # (the waiter made the condition: it is in wait)
        t.join(0.001)
    flag.set()
    t.join(10.0)
    assert not t.is_alive() and answers == [True]


def test_a_failing_callback_of_an_event_leaves_the_others_called(caplog):
    """Callbacks run on the thread that completes the event: one that raises (a bug) is
    logged, and every other callback still runs — a waiter left unwoken would hang its
    call."""
    ev = CpuEvent("lane end")
    called: list[str] = []

    def bad(_: CpuEvent) -> None:
        called.append("bad")
        raise RuntimeError("a waiter's bug")

    ev.add_done_callback(bad)
    ev.add_done_callback(lambda _: called.append("good"))
    with caplog.at_level("ERROR", logger="overlap"):
        ev._complete()
    assert called == ["bad", "good"] and ev.done()
    assert "a callback of event 'lane end' failed" in caplog.text
