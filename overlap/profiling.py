"""Capture windows: which training steps a profiler should record.

``Runtime(..., profile_steps=range(3, 5))`` (or ``"3:5"``, or the environment variable
``OVERLAP_PROFILE_STEPS=3:5``, which ``overlap profile --steps`` sets) starts the profiler
(``cudaProfilerStart``) before step 3 is launched and stops it (``cudaProfilerStop``) when step
4 has ended, so ``nsys profile --capture-range=cudaProfilerApi`` records those steps only.
Steps count from 0, as the runtime's ``step N`` NVTX ranges do. On the CPU backend starting
and stopping is a no-op (the ranges are still opened).
"""

from __future__ import annotations

import os

from scheduler.traces import PROFILE_STEPS_ENV as ENV
from scheduler.traces import steps_window


def profile_window(steps: range | str | None) -> range | None:
    """The steps to capture, from ``profile_steps`` or, when that is None, from the
    environment; None for no window. ValueError/TypeError naming the argument otherwise."""
    if steps is not None:
        return steps_window(steps, "profile_steps")
    spec = os.environ.get(ENV)
    return steps_window(spec, f"the environment variable {ENV}") if spec else None
