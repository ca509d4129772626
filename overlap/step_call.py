"""``Runtime.train_step``: one training step run as one call.

The pipeline's arguments are checked, the step's graph comes from the step-graph cache
(lowered, or chosen by ``auto``, off the event loop, once per configuration; or the
caller's, checked once), the step is measured (:meth:`overlap.measurements.Measurements.step`)
and runs through :meth:`overlap.call.Calls.run` — the one path every call takes. Across
processes the last stage's owner's end-of-call row carries the losses to every process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from scheduler import Boundaries, PlanOptions, Schedule, Sharding, StepGraph

from .backends import OpReport
from .pipeline import Stage, StepState, check_pipeline, launch_step, step_channels
from .runtime_parts import RuntimeParts, check_bound
from .scope import CancelScope


async def train_step(parts: RuntimeParts, stages: Sequence[Stage], boundaries: Boundaries,
                     microbatches: Sequence[np.ndarray], *, input_sharding: Sharding,
                     schedule: str | Schedule | None, options: PlanOptions | None,
                     graph: StepGraph | None, max_activations: int | Sequence[int] | None,
                     timeout: float | None) -> list[float]:
    """Run one training step (see ``Runtime.train_step``); returns the losses."""
    parts.calls.check_open()
    check_bound(timeout)
    check_pipeline(stages, boundaries, input_sharding, microbatches, parts.array_types())
    if max_activations is not None and schedule != "auto":
        raise ValueError("max_activations: only schedule='auto' chooses under a cap; a "
                         "named schedule's peaks are fixed (Schedule.peak_activations)")
    graph, digest = await parts.graphs.step_graph(stages, boundaries, len(microbatches),
                                                  schedule, options, graph, max_activations)
    state = StepState()
    m = len(microbatches)
    backend, graphs, distributed = parts.backend, parts.graphs, parts.distributed
    # The last stage's first device computes the losses; across processes its owner's
    # end-of-call row carries them to every other process.
    first = stages[-1].mesh.device_ids[0]

    def losses() -> bytes:
        if not backend.is_local(first):
            return bytes(8 * m)
        return np.array([float(state.losses[i]) for i in range(m)], np.float64).tobytes()

    def go(scope: CancelScope, report: OpReport) -> list[Any]:
        routes = graphs.routes(graph, lambda op: str(op.body))
        return launch_step(backend, graph, stages, boundaries, input_sharding, microbatches,
                           routes=routes, scope=scope, report=report,
                           compute_time=parts.compute_time, state=state)

    with parts.measure.step(graph) as trace:
        table = await parts.calls.run(
            "train_step", graph, go, subject="the step graph",
            channels=step_channels(graph, boundaries, stages), digest=digest, trace=trace,
            payload=losses if distributed else None, timeout=timeout)
    if not distributed:
        return [float(state.losses[i]) for i in range(m)]
    owner = backend.placement.owners[first]  # type: ignore[union-attr]
    return [float(v) for v in np.frombuffer(table[owner], np.float64)]  # type: ignore[index]


__all__ = ["train_step"]
