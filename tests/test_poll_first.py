"""The ``*_sync`` loop's selector (``overlap.poll_first``): it looks again, without waiting,
for up to ``POLL_FIRST_S`` before it sleeps, yielding the core between looks, and never waits
longer in all than the timeout asked. Its clock and its yields are replaced here, and the
looks it makes are recorded: no test depends on how fast this machine runs."""

from __future__ import annotations

import selectors
import socket

import pytest

from overlap import poll_first
from overlap.poll_first import POLL_FIRST_S, PollFirstSelector


@pytest.fixture
def looks(monkeypatch):
    """Every wait the selector asks of the system (its timeout), its yields counted, the look
    from which a registered socket reads as ready (``ready_after[0]``; None: never), and the
    clock at each wait — a clock that moves 10 µs a reading."""
    asked: list[float | None] = []
    when: list[float] = []  # (the clock at each)
    yields = [0]
    ready_after: list[int | None] = [None]
    real = selectors.DefaultSelector.select

    def select(self, timeout=None):
        asked.append(timeout)
        when.append(now[0])
        if ready_after[0] is not None and len(asked) > ready_after[0]:
            return real(self, 0)
        return []

    now = [0.0]

    def clock() -> float:
        now[0] += 10e-6
        return now[0]

    monkeypatch.setattr(selectors.DefaultSelector, "select", select)
    monkeypatch.setattr(poll_first.time, "perf_counter", clock)
    monkeypatch.setattr(poll_first.os, "sched_yield", lambda: yields.__setitem__(0, yields[0] + 1))
    return asked, yields, ready_after, when


@pytest.fixture
def selector():
    a, b = socket.socketpair()
    sel = PollFirstSelector()
    sel.register(a, selectors.EVENT_READ)
    b.send(b"x")  # (ready whenever a look is let through to the real selector)
    yield sel
    sel.close()
    a.close()
    b.close()


@pytest.mark.parametrize("timeout", [None, 1.0])
def test_it_looks_without_waiting_then_waits_the_rest(looks, selector, timeout):
    asked, yields, _, when = looks
    assert selector.select(timeout) == []
    *first, last = asked
    assert len(first) > 1 and all(t == 0 for t in first)  # looks that never wait...
    assert yields[0] == len(first) - 1  # ...with the core yielded between them
    # ...for the budget (the clock moves 10 µs a reading), then a wait for the rest
    assert POLL_FIRST_S <= when[-1] - when[0] <= POLL_FIRST_S + 30e-6
    assert last is None if timeout is None else last == pytest.approx(timeout - POLL_FIRST_S)


def test_a_timeout_shorter_than_the_looks_is_never_overrun(looks, selector):
    asked, _, _, when = looks
    selector.select(POLL_FIRST_S / 2)
    assert asked[-1] == 0.0  # (what is left of the timeout after the looks: nothing)
    assert when[-1] - when[0] <= POLL_FIRST_S / 2 + 30e-6


def test_a_zero_timeout_is_one_look(looks, selector):
    asked, yields, _, _ = looks
    assert selector.select(0) == []
    assert asked == [0] and yields[0] == 0


@pytest.mark.parametrize("after", [0, 2])
def test_what_comes_while_it_looks_is_returned_without_a_wait(looks, selector, after):
    asked, yields, ready_after, _ = looks
    ready_after[0] = after
    got = selector.select(1.0)
    assert [mask for _, mask in got] == [selectors.EVENT_READ]
    assert asked == [0] * (after + 1) and yields[0] == after  # (no wait asked at all)


def test_the_sync_calls_loop_on_the_main_thread_waits_with_it():
    from overlap.runtime import _new_loop

    loop = _new_loop()
    try:
        assert isinstance(loop._selector, PollFirstSelector)  # type: ignore[attr-defined]
        assert loop.run_until_complete(_answer()) == 42
    finally:
        loop.close()


async def _answer() -> int:
    return 42
