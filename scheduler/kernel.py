"""The discrete-event kernel: SimPy's core and nothing else.

One heap of ``(time, priority, insertion count, event)``: events run in time order, ties by
priority (lower first), then in the order they were scheduled — so a run is deterministic and
every scheduled event is either run or still in the heap when the run stops (nothing is
dropped silently). ``event`` is whatever the handler understands (the cost model's engine uses
small ints). The kernel knows nothing of transfers, ports or graphs: the cost model's fluid
engine (:mod:`scheduler.cost`) drives it for plans and for whole pipeline steps.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any


class Kernel:
    """A clock and a heap of scheduled events (see module doc)."""

    __slots__ = ("_count", "_heap", "now", "processed")

    def __init__(self) -> None:
        self.now = 0.0
        self.processed = 0  # events run so far
        self._heap: list[tuple[float, int, int, Any]] = []
        self._count = itertools.count()

    def schedule(self, time: float, event: Any, priority: int = 0) -> int:
        """Run ``event`` at ``time`` (not before now); returns its insertion count, which
        names this scheduling of it (a handler can tell a superseded one from the latest)."""
        if time < self.now:
            raise ValueError(f"time: {time!r} is before now ({self.now!r})")
        count = next(self._count)
        heapq.heappush(self._heap, (time, priority, count, event))
        return count

    def peek(self) -> tuple[float, int, int, Any] | None:
        """The next entry ``(time, priority, count, event)``, or None when none is left."""
        return self._heap[0] if self._heap else None

    def pop(self) -> tuple[float, int, int, Any]:
        """Take the next entry and advance the clock to its time."""
        entry = heapq.heappop(self._heap)
        self.now = entry[0]
        self.processed += 1
        return entry

    def run(self, handle: Callable[[int, Any], None], until: float = math.inf) -> None:
        """Pop every event in order, calling ``handle(count, event)`` at its time, until the
        heap is empty (handlers may schedule more) or the next event is later than
        ``until`` (it stays in the heap)."""
        heap, pop = self._heap, heapq.heappop
        processed = self.processed
        try:
            while heap and heap[0][0] <= until:
                time, _, count, event = pop(heap)
                self.now = time
                processed += 1
                handle(count, event)
        finally:
            self.processed = processed

    def __len__(self) -> int:
        return len(self._heap)
