"""Measuring a runtime's calls: the timeline of a trace, a step's figures, step hooks.

Every training step records its ops' spans into a trace (a reshard when asked); the last
traced call's :class:`~scheduler.Timeline` is made from it on demand (:func:`timeline_of`),
as are the last step's :class:`~overlap.stats.StepStats` (on first read) and its mean compute
times (what ``schedule="auto"`` takes when no ``compute_time`` was given). A step is
bracketed by :meth:`Measurements.step`: its index, its NVTX range, the profiler window, its
trace, its figures and the hooks that get them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from scheduler import DeviceMesh, Span, StepGraph, Timeline, TransferOp, span_meta

from .errors import OverlapRuntimeError
from .nvtx import range_end, range_start
from .profiling import Profiler
from .stats import StepHookHandle, StepHooks, StepStats, step_stats

if TYPE_CHECKING:
    from .backends import Backend, Trace


def timeline_of(backend: Backend, trace: Trace, graph: StepGraph) -> Timeline:
    """What ``trace`` recorded of ``graph``'s ops, as a measured Timeline (the simulator's
    type, with the same op ids): this process's devices."""
    records = trace.records
    sec = functools.partial(backend.span_seconds, trace)
    # A transfer moves nothing before its last participant reaches it: a receiver that
    # got there first was waiting for its producer (a bubble, not communication), as the
    # simulator's transfers start when sender and receivers are ready. Each participant's
    # span starts at the latest arrival this process saw.
    # (Only this process's participants are seen: across processes a transfer's spans
    # start where this process's part of it did.)
    timed = [(r, sec(r.start), sec(r.end)) for r in records]
    arrived: dict[int, float] = {}
    for r, start, _ in timed:
        if isinstance(graph.ops[r.op].body, TransferOp):
            arrived[r.op] = max(arrived.get(r.op, -math.inf), start)
    spans = []
    for r, start, end in timed:
        name, stage, mb, kind = span_meta(graph.ops[r.op].body)
        start = min(end, max(start, arrived.get(r.op, -math.inf)))
        spans.append(Span(r.device, r.stream, name, start, end, stage, mb, kind, r.op))
    spans.sort(key=lambda s: (s.device, s.start))
    # A process of a multi-process job measured its own devices only.
    stage_of = {d: graph.stage_of(d) for d in graph.devices if backend.is_local(d)}
    return Timeline(tuple(spans), len(graph.stages), tuple(sorted(stage_of)), stage_of,
                    graph.data_inputs)


class Measurements:
    """A runtime's measured calls (see module doc): the last traced call, the last step's
    trace and figures, the step hooks, the step count and the profiler."""

    def __init__(self, backend: Backend, profiler: Profiler) -> None:
        self.backend = backend
        self.profiler = profiler
        self.steps = 0  # training steps so far (they name their NVTX ranges)
        # The last call's trace and graph (``timeline()``), and the last training step's
        # (``auto`` takes its measured compute times).
        self._last_trace: tuple[Trace, StepGraph] | None = None
        self._last_step: tuple[Trace, StepGraph] | None = None
        self._stats: tuple[Any, ...] | StepStats | None = None  # (see last_step)
        self._hooks = StepHooks()

    def timeline(self) -> Timeline:
        """The last traced call's measured timeline (OverlapRuntimeError before any)."""
        if self._last_trace is None:
            raise OverlapRuntimeError("timeline: no traced call has run yet (a train_step, or a "
                                      "reshard with trace=True)")
        return timeline_of(self.backend, *self._last_trace)

    @property
    def last_step(self) -> StepStats | None:
        """The last successful step's figures, made on first read (None: none)."""
        if self._stats is None or isinstance(self._stats, StepStats):
            return self._stats
        index, seconds, trace, graph = self._stats
        self._stats = step_stats(index, seconds, timeline_of(self.backend, trace, graph))
        return self._stats

    def register_step_hook(self, hook: Callable[[StepStats], Any]) -> StepHookHandle:
        return self._hooks.add(hook)

    def compute_means(self, meshes: tuple[DeviceMesh, ...]
                      ) -> dict[tuple[int, str], float] | None:
        """The last step's mean compute seconds per (stage, kind) — B as I + W where the
        backward was split — when it ran on these stage meshes; else None."""
        if self._last_step is None:
            return None
        if self._last_step[1].stages != meshes:
            return None
        spans: dict[tuple[int, str], list[float]] = {}
        for sp in timeline_of(self.backend, *self._last_step).spans:
            if sp.stream == "compute":
                spans.setdefault((sp.stage, sp.kind), []).append(sp.end - sp.start)
        table = {key: sum(v) / len(v) for key, v in spans.items()}
        for s in range(len(meshes)):
            if (s, "B") not in table and (s, "I") in table:
                table[(s, "B")] = table[(s, "I")] + table.get((s, "W"), 0.0)
        return table

    @contextlib.contextmanager
    def traced(self, graph: StepGraph, on: bool) -> Iterator[Trace | None]:
        """A call of ``graph`` that records its ops' spans when ``on`` (then, ended well or
        not, the last traced call)."""
        trace = self.backend.start_trace() if on else None
        try:
            yield trace
        finally:
            if trace is not None:
                self._last_trace = (trace, graph)

    @contextlib.contextmanager
    def step(self, graph: StepGraph) -> Iterator[Trace]:
        """A training step of ``graph``: numbered, in an NVTX range of its own, the
        profiler's window kept, its ops traced; once it ended well, its figures are kept
        (a failed step has none) and the hooks get them."""
        index = self.steps
        self.steps += 1
        self.profiler.step_starts(index)
        step_range = range_start(f"step {index}", "step")  # Nsight: one range a step
        trace = self.backend.start_trace()
        began = time.perf_counter()
        self._stats = None  # (a failed step has none)
        try:
            yield trace
        finally:
            range_end(step_range)
            self.profiler.step_ended(index)
            self._last_trace = self._last_step = (trace, graph)
        self._stats = (index, time.perf_counter() - began, trace, graph)
        self._hooks.run(self)


__all__ = ["Measurements", "timeline_of"]
