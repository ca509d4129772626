"""The waits (``overlap.waits``): one blocking wait, one awaiting wait, and the one-shot
completion they wait on — set once, waking thread and loop waiters, a cancellation raising
what was awaited, the overdue rule past each timeout, and one wake-up of the loop per
completion."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from overlap.backends.job.distributed import Round
from overlap.backends.job.engine import Completion
from overlap.errors import CollectiveAborted, CollectiveTimeout
from overlap.scope import CancelScope
from overlap.waits import OneShot, block_on, wait_on, when_all

SETTLE_S = 5.0
LONG_S = 60.0  # a timeout no test may reach: only a wake-up ends these waits


# ---- the one-shot completion -----------------------------------------------------------------


def test_a_one_shot_is_set_once_and_runs_each_callback_once():
    shot, calls = OneShot(), []
    assert shot.add_callback(lambda: calls.append("a"))
    assert shot.add_callback(lambda: calls.append("b"))
    assert not shot.over and shot.error is None and shot.result is None
    assert shot.finish(None, 42) is True
    assert shot.finish(KeyError("late")) is False  # (only the first counts)
    assert shot.over and shot.result == 42 and shot.error is None and calls == ["a", "b"]
    assert shot.add_callback(lambda: calls.append("after")) is False and calls == ["a", "b"]


def test_a_failed_one_shot_keeps_its_error_and_a_callbacks_bug_wakes_the_others(caplog):
    shot, calls = OneShot(), []
    boom = KeyError("gone")

    def bad() -> None:
        raise RuntimeError("a waiter's bug")

    shot.add_callback(bad)
    shot.add_callback(lambda: calls.append("good"))
    with caplog.at_level("ERROR", logger="overlap"):
        shot.finish(boom)
    assert shot.over and shot.error is boom and shot.result is None and calls == ["good"]
    assert "a callback of" in caplog.text


def test_one_shot_finished_from_many_threads_at_once_is_set_by_exactly_one():
    shot, woken = OneShot(), []
    shot.add_callback(lambda: woken.append(1))
    won: list[bool] = []
    start = threading.Barrier(8)

    def race(i: int) -> None:
        start.wait(SETTLE_S)
        won.append(shot.finish(None, i))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SETTLE_S)
    assert won.count(True) == 1 and woken == [1] and shot.result in range(8)


def test_when_all_calls_once_after_the_last_source_and_at_once_when_there_is_none():
    shots = [OneShot() for _ in range(3)]
    shots[1].finish()  # (over before: counted at once)
    calls: list[str] = []
    when_all(shots, lambda: calls.append("all"))
    shots[0].finish()
    assert calls == []
    shots[2].finish(KeyError("failed counts as over"))
    assert calls == ["all"]
    when_all([], lambda: calls.append("none"))
    assert calls == ["all", "none"]


# ---- the blocking wait -----------------------------------------------------------------------


def _in_thread(fn):
    out: list = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:
            out.append(("raised", exc))

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_a_thread_blocked_on_a_one_shot_is_woken_by_another_thread():
    shot = OneShot()
    t, out = _in_thread(lambda: block_on(shot, CancelScope("call"), "the shot", LONG_S))
    shot.finish()
    t.join(SETTLE_S)
    assert not t.is_alive() and out == [("ok", True)]


def test_cancelling_the_scope_wakes_a_blocked_thread_naming_what_it_awaited():
    scope = CancelScope("call")
    t, out = _in_thread(lambda: block_on(OneShot(), scope, "rank 1's row", LONG_S))
    start = time.perf_counter()
    scope.cancel(KeyError("a peer failed"))
    t.join(SETTLE_S)
    assert not t.is_alive() and time.perf_counter() - start < SETTLE_S
    (kind, err), = out
    assert kind == "raised" and isinstance(err, CollectiveAborted)
    assert "rank 1's row: aborted" in str(err) and "a peer failed" in str(err)


def test_a_scope_cancelled_before_the_wait_raises_at_once_and_a_done_source_wins():
    scope = CancelScope("call")
    scope.cancel(CollectiveAborted("stop"))
    with pytest.raises(CollectiveAborted, match="the shot: aborted"):
        block_on(OneShot(), scope, "the shot", LONG_S)
    done = OneShot()
    done.finish(KeyError("its own failure"))
    assert block_on(done, scope, "the shot", LONG_S) is True  # (the source comes first)


def test_past_the_timeout_overdue_decides_wait_on_give_up_or_raise():
    asked: list[int] = []

    def on_twice_then_give_up() -> bool:
        asked.append(1)
        return len(asked) < 3

    scope = CancelScope("call")
    assert block_on(OneShot(), scope, "a message", 0.01, on_twice_then_give_up) is False
    assert len(asked) == 3
    assert block_on(OneShot(), scope, "a message", 0.01) is False  # (no overdue: give up)

    def late() -> bool:
        raise CollectiveTimeout("a message: rank 2 never sent it", op="a message",
                                devices=(), missing=())

    with pytest.raises(CollectiveTimeout, match="a message: rank 2 never sent it"):
        block_on(OneShot(), scope, "a message", 0.01, late)


def test_a_source_finished_while_overdue_is_asked_ends_the_wait_as_done():
    shot = OneShot()

    def finishes_it() -> bool:
        shot.finish()
        return True

    assert block_on(shot, CancelScope("call"), "the shot", 0.01, finishes_it) is True


# ---- the awaiting wait -----------------------------------------------------------------------


def _count_wakes(loop: asyncio.AbstractEventLoop) -> tuple[list[str], object]:
    woken: list[str] = []
    real = loop.call_soon_threadsafe
    here = threading.current_thread()

    def counted(cb, *args, **kwargs):
        if threading.current_thread() is not here:
            woken.append(threading.current_thread().name)
        return real(cb, *args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    return woken, real


async def test_a_one_shot_set_from_another_thread_wakes_a_loop_waiter_exactly_once():
    shot = OneShot()
    scope = CancelScope("call")
    loop = asyncio.get_running_loop()
    woken, real = _count_wakes(loop)
    try:
        waiting = asyncio.ensure_future(wait_on(shot, scope, "the shot", LONG_S))
        await asyncio.sleep(0)
        t = threading.Thread(target=shot.finish, name="finisher")
        t.start()
        assert await asyncio.wait_for(waiting, SETTLE_S) is True
        t.join(SETTLE_S)
        scope.cancel(CollectiveAborted("after"))  # (the wait is over: no wake-up more)
        await asyncio.sleep(0.01)
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    assert woken == ["finisher"]


async def test_cancelling_the_scope_wakes_an_awaiting_task_naming_what_it_awaited():
    scope = CancelScope("call")
    waiting = asyncio.ensure_future(wait_on(OneShot(), scope, "every rank's work", LONG_S))
    await asyncio.sleep(0)
    t = threading.Thread(target=scope.cancel, args=(KeyError("a stage failed"),))
    t.start()
    with pytest.raises(CollectiveAborted, match="every rank's work: aborted"):
        await asyncio.wait_for(waiting, SETTLE_S)
    t.join(SETTLE_S)


async def test_a_cancelled_awaiting_task_stops_waiting_and_is_not_woken_again():
    shot = OneShot()
    loop = asyncio.get_running_loop()
    woken, real = _count_wakes(loop)
    try:
        waiting = asyncio.ensure_future(wait_on(shot, CancelScope("call"), "the shot"))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.to_thread(shot.finish)
        await asyncio.sleep(0.01)
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    assert woken == []


async def test_past_the_timeout_an_async_overdue_is_awaited_and_decides():
    asked: list[int] = []

    async def ask() -> bool:
        asked.append(1)
        await asyncio.sleep(0)
        return len(asked) < 2

    assert await wait_on(OneShot(), CancelScope("call"), "a row", 0.01, ask) is False
    assert len(asked) == 2
    assert await wait_on(OneShot(), None, "a row", 0.01) is False

    def late() -> bool:
        raise CollectiveTimeout("a row: rank 3 never sent it", op="a row", devices=(),
                                missing=())

    with pytest.raises(CollectiveTimeout, match="rank 3 never sent it"):
        await wait_on(OneShot(), CancelScope("call"), "a row", 0.01, late)


# ---- the classes built on it ------------------------------------------------------------------


async def test_a_round_wakes_its_loop_once_when_its_last_message_completes():
    """(A round used to wake the loop once per message.)"""
    recvs = [Completion(f"row from rank {r}", r) for r in (1, 2, 3)]
    sends = [Completion(f"row to rank {r}", r) for r in (1, 2, 3)]
    rnd = Round(SimpleNamespace(timeout=LONG_S, rank=0), recvs, sends, (0, 1, 2, 3))
    loop = asyncio.get_running_loop()
    woken, real = _count_wakes(loop)
    try:
        waiting = asyncio.ensure_future(rnd.wait(CancelScope("call"), "the agreement"))
        await asyncio.sleep(0)

        def complete_all() -> None:
            for c in [*recvs, *sends]:
                c.complete(8)

        t = threading.Thread(target=complete_all, name="engine")
        t.start()
        assert await asyncio.wait_for(waiting, SETTLE_S) is True
        t.join(SETTLE_S)
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    assert woken == ["engine"] and rnd.done


async def test_a_rounds_failed_message_ends_its_wait_at_once_with_that_error():
    recvs = [Completion(f"row from rank {r}", r) for r in (1, 2)]
    rnd = Round(SimpleNamespace(timeout=LONG_S, rank=0), recvs, [], (0, 1, 2))
    waiting = asyncio.ensure_future(rnd.wait(CancelScope("call"), "the agreement"))
    await asyncio.sleep(0)
    broken = ConnectionResetError("the link to rank 1 broke")
    await asyncio.to_thread(recvs[0].fail, broken)  # (rank 2's row still pending)
    with pytest.raises(ConnectionResetError, match="rank 1 broke"):
        await asyncio.wait_for(waiting, SETTLE_S)
    assert not rnd.done


def test_a_completion_blocks_until_complete_and_raises_what_failed_it():
    ok, bad = Completion("a send"), Completion("a receive")
    t, out = _in_thread(lambda: ok.block(CancelScope("call"), "a send", LONG_S))
    ok.complete(16)
    t.join(SETTLE_S)
    assert out == [("ok", True)] and ok.done and ok.count == 16
    bad.fail(ConnectionResetError("reset"))
    with pytest.raises(ConnectionResetError):
        bad.block(CancelScope("call"), "a receive", LONG_S)
    assert not bad.done and bad.count == -1
