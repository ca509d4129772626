"""Cancellation (``overlap.scope``) and a call's scope (``overlap.call``): every wait
registers with its call's scope, cancelling wakes them all at once, scopes nest, a call's
wait for its work is woken once, and one call runs at a time whatever the event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from overlap.backends import make_backend
from overlap.call import CallGate, Calls, root_cause
from overlap.errors import (
    CallMismatch,
    CollectiveAborted,
    CollectiveTimeout,
    RankFailed,
    StreamError,
)
from overlap.scope import CancelScope
from overlap.waits import OneShot, Waiter, block_on, sleep

SETTLE_S = 5.0


def test_a_waiter_woken_before_it_blocks_returns_at_once_and_times_out_otherwise():
    early = Waiter()
    early.wake()
    early.wake()  # (any number of times)
    assert early.block(60.0) is True
    assert Waiter().block(0.001) is False


def test_a_waiter_is_woken_from_another_thread():
    waiter, answers = Waiter(), []
    t = threading.Thread(target=lambda: answers.append(waiter.block(60.0)))
    t.start()
    waiter.wake()
    t.join(SETTLE_S)
    assert not t.is_alive() and answers == [True]


def test_cancelling_runs_every_callback_once_and_later_registrations_see_it():
    scope = CancelScope("call")
    called: list[str] = []
    scope.on_cancel(lambda: called.append("a"))
    handle = scope.on_cancel(lambda: called.append("removed"))
    scope.on_cancel(lambda: called.append("b"))
    scope.remove(handle)
    first, second = CollectiveAborted("first"), CollectiveAborted("second")
    scope.cancel(first)
    scope.cancel(second)  # (only the first counts)
    assert called == ["a", "b"] and scope.cancelled and scope.error is first
    assert scope.on_cancel(lambda: called.append("late")) is None and called == ["a", "b"]
    with pytest.raises(CollectiveAborted, match=r"waiting: aborted \(first\)"):
        scope.check("waiting")


def test_a_parent_cancels_its_children_and_a_childs_failure_stays_in_the_child():
    runtime = CancelScope("runtime")
    call = CancelScope("call", runtime)
    boom = StreamError("boom", device=0, stream="compute", op="F s0 mb0")
    call.fail(boom)
    assert call.cancelled and call.failures == [boom] and not runtime.cancelled
    nxt = CancelScope("next call", runtime)
    peer = RankFailed("rank 1 failed", rank=1, error="x")
    runtime.fail(peer)
    assert nxt.error is peer and runtime.failures == [peer]
    late = CancelScope("after", runtime)  # born under a cancelled parent: cancelled at once
    assert late.error is peer


def test_a_closed_child_is_no_longer_cancelled_by_its_parent():
    runtime = CancelScope("runtime")
    call = CancelScope("call", runtime)
    call.close()
    runtime.cancel(CollectiveAborted("closed"))
    assert not call.cancelled


def test_forgetting_failures_keeps_the_reason_not_the_exception_objects():
    scope = CancelScope("call")
    try:
        raise StreamError("boom", device=0, stream="compute", op="F")
    except StreamError as exc:
        scope.fail(exc)
    scope.forget_failures()
    assert scope.cancelled and scope.failures == []
    assert isinstance(scope.error, CollectiveAborted) and "boom" in str(scope.error)
    assert scope.error.__traceback__ is None


def test_the_blocking_wait_returns_when_done_times_out_and_raises_when_cancelled():
    done = OneShot()
    scope = CancelScope("call")
    t = threading.Timer(0.05, done.finish)
    t.start()
    assert block_on(done, scope, "the flag", SETTLE_S) is True
    assert block_on(OneShot(), scope, "never", 0.01) is False
    threading.Timer(0.05, lambda: scope.cancel(CollectiveAborted("stop"))).start()
    start = time.perf_counter()
    with pytest.raises(CollectiveAborted, match="a nap: aborted"):
        sleep(60.0, scope, "a nap")
    assert time.perf_counter() - start < SETTLE_S


def test_the_root_cause_is_a_mismatch_then_a_first_failure_then_a_peer_then_a_timeout():
    abort = CollectiveAborted("aborted")
    tmo = CollectiveTimeout("t", op="x", devices=(), missing=())
    peer = RankFailed("peer", rank=1, error="e")
    own = StreamError("own", device=0, stream="compute", op="F")
    mismatch = CallMismatch("m", ranks=(2,))
    assert root_cause(abort, [tmo, peer, own, mismatch]) is mismatch
    assert root_cause(abort, [tmo, peer, own]) is own
    assert root_cause(abort, [tmo, peer]) is peer
    assert root_cause(abort, [abort, tmo]) is tmo
    assert root_cause(abort, []) is abort


# ---- a call's scope ---------------------------------------------------------------------------


@pytest.mark.parametrize("fail", [False, True], ids=["all-complete", "one-fails"])
async def test_a_calls_wait_is_woken_once_not_once_per_event(fail):
    """A call waits for its lanes' ends all at once: the loop is woken from the streams'
    threads once — by the last end, or at once by a failure while others still wait."""
    backend = make_backend("cpu", 4)
    gates = [threading.Event() for _ in range(4)]
    never = backend.new_event("never recorded")

    def launch(scope: CancelScope, report: object) -> list:
        events = []
        for d in range(4):
            s = backend.stream(d)
            if fail and d == 0:
                def bad(g=gates[0]) -> None:
                    g.wait(SETTLE_S)
                    raise KeyError("gone")
                s.launch("bad", bad, scope=scope)
            elif fail:
                s.wait_event(never, scope=scope)  # (a wait: the failure ends it)
            else:
                s.launch("gated", lambda g=gates[d]: g.wait(SETTLE_S), scope=scope)
            events.append(s.record(f"end {d}", scope=scope))
        return events

    loop = asyncio.get_running_loop()
    woken, real = [], loop.call_soon_threadsafe

    def counted(cb, *args, **kwargs):
        if threading.current_thread().name.startswith("overlap-d"):
            woken.append(threading.current_thread().name)
        return real(cb, *args, **kwargs)

    calls = Calls(backend, CancelScope("runtime"))
    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    try:
        waiting = asyncio.ensure_future(calls.run("test call", None, launch))
        for _ in range(3):  # (asleep in its wait)
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
        await asyncio.to_thread(backend.close)
    assert len(woken) == 1, woken


async def test_one_call_at_a_time_in_the_order_they_came_whatever_the_loop():
    """The gate admits one call at a time: calls from another thread's event loop wait
    their turn (none is mixed with another), in order; one that gives up leaves the queue."""
    gate = CallGate()
    inside: list[str] = []
    order: list[str] = []
    max_inside = [0]

    async def call(name: str, hold: float) -> None:
        async with gate:
            inside.append(name)
            max_inside[0] = max(max_inside[0], len(inside))
            order.append(name)
            await asyncio.sleep(hold)
            inside.remove(name)

    async with gate:  # held: everybody queues
        others = [threading.Thread(target=lambda n=n: asyncio.run(call(n, 0.01)))
                  for n in ("thread 1", "thread 2")]
        for t in others:
            t.start()
            await asyncio.sleep(0.05)  # (so that they queue in this order)
        mine = asyncio.ensure_future(call("this loop", 0.01))
        quitter = asyncio.ensure_future(call("gives up", 0.01))
        await asyncio.sleep(0.05)
        quitter.cancel()
    await asyncio.wait_for(mine, SETTLE_S)
    for t in others:
        await asyncio.to_thread(t.join, SETTLE_S)
    assert order == ["thread 1", "thread 2", "this loop"] and max_inside[0] == 1
    async with gate:  # free again
        pass
