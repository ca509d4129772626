"""``Runtime.reshard``: one resharding plan run as one call.

The arguments are checked against what the plan asks (its inputs worked out once per plan by
the step-graph cache), the destination buffers are made on first use by their devices'
streams, and the plan's step graph runs through :meth:`overlap.call.Calls.run` — the one path
every call of the runtime takes (gate, agreement across processes, bound, cancellation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from scheduler import ReshardPlan, region_shape

from .backends import OpReport
from .reshard import (
    BufferTable,
    check_outs,
    check_shards,
    launch_reshard,
    reshard_channels,
    shards_match,
)
from .runtime_parts import RuntimeParts
from .scope import CancelScope


async def reshard(parts: RuntimeParts, plan: ReshardPlan, shards: Mapping[int, np.ndarray], *,
                  out: Mapping[int, np.ndarray] | None, stream: str, trace: bool
                  ) -> dict[int, np.ndarray]:
    """Run ``plan`` on ``shards`` (see ``Runtime.reshard``); returns this process's
    destination regions."""
    parts.calls.check_open()
    if not isinstance(plan, ReshardPlan):
        raise TypeError(f"plan: expected a ReshardPlan, got {type(plan).__name__}")
    graphs, backend, arrays = parts.graphs, parts.backend, parts.array_types()
    src, regions, expected = graphs.reshard_inputs(plan)
    dtype = np.dtype(plan.dtype)
    if not shards_match(expected, shards, dtype, arrays):
        check_shards(plan, shards, arrays,  # (names what is wrong)
                     backend.is_local if parts.distributed else None)
    xp = backend.xp
    if out is not None:
        check_outs(plan, out, shards, arrays, backend.is_local, xp)
    graph = graphs.reshard_graph(plan, stream)
    digest, members = graphs.plan_agreement(plan)
    # Each destination buffer is made on first use, by its device's stream (its memory).
    outs = BufferTable(lambda d: xp.empty(region_shape(regions[d]), dtype))
    if out is not None:
        outs.update(out)

    def go(scope: CancelScope, report: OpReport) -> list[Any]:
        base = parts.tags.take(len(graph.ops))  # (taken once launched)
        routes = graphs.routes(graph, lambda op: f"#{op.id}")
        return launch_reshard(backend, plan, shards, outs, graph, routes, (src, regions),
                              scope=scope, report=report, tag_base=base)

    with parts.measure.traced(graph, trace) as recorded:
        await parts.calls.run("reshard", graph, go, subject="the plan",
                              channels=(reshard_channels(graph, plan), []), digest=digest,
                              members=members, trace=recorded)
    # Devices that got nothing: empty regions. In a multi-process job, this process's.
    return {d: outs[d] for d in regions if backend.is_local(d)}


__all__ = ["reshard"]
