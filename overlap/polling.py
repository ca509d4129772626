"""Looking again, briefly, before sleeping: the wait policy of every thread that blocks.

A thread asleep in the kernel that another wakes costs both of them: on the 2-core VM of
docs/benchmarks.md a wake-up takes 25–35 µs to run the sleeper again and tens of µs of the
waker's CPU (a ``sendmsg`` that wakes a sleeping peer cost its sender ~56 µs), and a tiny
cross-process call has several on its path. So a thread about to block — a stream waiting
for its next item or for an event, the progress engine in ``select``, the ``*_sync`` calls'
event loop — first looks again without waiting, for up to ``POLL_FIRST_S``, giving the core
away between looks (``sched_yield``: a peer that needs it gets it, and the interpreter's
lock is released meanwhile). What comes in that time is taken without any wake-up; past it,
the thread sleeps as before, and a wait is never longer than it would have been.
"""

from __future__ import annotations

import os
import selectors
import time
from collections.abc import Callable
from typing import Any

# Measured (docs/benchmarks.md, "Looking before sleeping"): see the table there.
POLL_FIRST_S = 50e-6

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def poll_first(ready: Callable[[], bool], budget: float = POLL_FIRST_S) -> bool:
    """Look at ``ready()`` again and again, yielding the core between looks, for up to
    ``budget`` seconds: True as soon as it says so, False once the time is up."""
    if budget <= 0:
        return False
    end = time.perf_counter() + budget
    while True:
        _yield()
        if ready():
            return True
        if time.perf_counter() >= end:
            return False


class PollFirstSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """``select(timeout)`` that looks without waiting for up to ``POLL_FIRST_S`` (at most
    ``timeout``), yielding the core between looks, before it waits for the rest: the
    ``*_sync`` calls' event loop on the main thread waits with it."""

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        ready = super().select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        budget = POLL_FIRST_S if timeout is None else min(POLL_FIRST_S, timeout)
        found: list[list[tuple[Any, int]]] = []

        def look() -> bool:
            got = super(PollFirstSelector, self).select(0)
            if got:
                found.append(got)
            return bool(got)

        if poll_first(look, budget):
            return found[0]
        return super().select(None if timeout is None else max(0.0, timeout - budget))


__all__ = ["POLL_FIRST_S", "PollFirstSelector", "poll_first"]
