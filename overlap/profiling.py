"""Capture windows: which training steps a profiler should record.

``Runtime(..., profile_steps=range(3, 5))`` (or ``"3:5"``, or the environment variable
``OVERLAP_PROFILE_STEPS=3:5``, which ``overlap profile --steps`` sets) starts the profiler
(``cudaProfilerStart``) before step 3 is launched and stops it (``cudaProfilerStop``) when step
4 has ended, so ``nsys profile --capture-range=cudaProfilerApi`` records those steps only.
Steps count from 0, as the runtime's ``step N`` NVTX ranges do. On the CPU backend starting
and stopping is a no-op (the ranges are still opened). :class:`Profiler` is a runtime's
switch: the window's steps, and ``rt.capture()`` blocks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from scheduler.traces import PROFILE_STEPS_ENV as ENV
from scheduler.traces import steps_window

if TYPE_CHECKING:
    from .backends import Backend


def profile_window(steps: range | str | None) -> range | None:
    """The steps to capture, from ``profile_steps`` or, when that is None, from the
    environment; None for no window. ValueError/TypeError naming the argument otherwise."""
    if steps is not None:
        return steps_window(steps, "profile_steps")
    spec = os.environ.get(ENV)
    return steps_window(spec, f"the environment variable {ENV}") if spec else None


class Profiler:
    """A runtime's profiler switch: on for the steps of its window and inside
    :meth:`capture` blocks; the backend's ``profiler(on)`` is called only when the state
    changes (``cudaProfilerStart``/``Stop`` per local GPU; nothing on the CPU)."""

    def __init__(self, backend: Backend, window: range | None) -> None:
        self.backend = backend
        self.window = window  # the steps to capture (None: none)
        self._on = False

    def switch(self, on: bool) -> None:
        if on != self._on:
            self._on = on
            self.backend.profiler(on)

    def step_starts(self, index: int) -> None:
        """Step ``index`` is about to launch: the window's first step starts the profiler."""
        if self.window is not None and index == self.window.start:
            self.switch(True)

    def step_ended(self, index: int) -> None:
        """Step ``index`` ended (well or not): the window's last step stops the profiler."""
        if self.window is not None and index == self.window.stop - 1:
            self.switch(False)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """On inside the block (see ``Runtime.capture``)."""
        self.switch(True)
        try:
            yield
        finally:
            self.switch(False)
