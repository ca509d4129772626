"""A selector that looks again, briefly, before it sleeps: the ``*_sync`` calls' event loop
(on the main thread) waits with it.

A process asleep in ``epoll_wait`` that a message (or another thread's hand-off) wakes runs
again 20-35 µs later on the 2-core machine of docs/benchmarks.md; one still looking sees it
at once. A tiny cross-process call has two such wake-ups on its critical path, about a fifth
of its time. So before it sleeps this selector looks again without waiting, for up to
``POLL_FIRST_S``, yielding the core between looks: ``sched_yield`` gives the core to any
process that needs it (a peer on the same machine is not kept from it), and both calls
release the interpreter's lock (the process's own threads run meanwhile). A wait longer
than that sleeps as before; the whole wait is never longer than the timeout asked.
"""

from __future__ import annotations

import os
import selectors
import time
from typing import Any

# Measured on that machine (docs/benchmarks.md): 50 µs took the tiny call from 184-197 to
# 160-164 µs on its two ranks alone, and from 284-308 to 252-267 µs with all four ranks
# calling; 100 and 200 µs gained no more there and cost the 16-transfer call, whose four
# ranks share the two cores.
POLL_FIRST_S = 50e-6


class PollFirstSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """``select(timeout)`` that looks without waiting for up to ``POLL_FIRST_S`` (at most
    ``timeout``), yielding the core between looks, before it waits for the rest."""

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        ready = super().select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        budget = POLL_FIRST_S if timeout is None else min(POLL_FIRST_S, timeout)
        end = time.perf_counter() + budget
        while time.perf_counter() < end:
            os.sched_yield()
            ready = super().select(0)
            if ready:
                return ready
        return super().select(None if timeout is None else max(0.0, timeout - budget))
