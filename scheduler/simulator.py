"""The pipeline simulator: a step graph through the cost model, on the event kernel.

:func:`simulate` costs every op of the graph — a compute its stage's duration, a transfer
what the cost model says (its ports, latency, pipeline fill; in **signal** mode only its
latency: the paper's upper bound, a 1-byte message), a gradient reduction a ring all-reduce
(:meth:`CostModel.all_reduce_cost`) — and runs them on the cost model's one
engine (:meth:`CostModel.run_ops`, the same that costs a resharding plan), which drives the
event kernel (:mod:`scheduler.kernel`): an op starts when it heads every lane it runs on
and what it waits for has ended; transfers running together share NIC and NVLink ports
max-min fairly. The dependencies are the graph's, so they are those the runtime launches.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .cluster import Cluster
from .cost import CostModel, TransferCost
from .graph import Compute, GradReduce, StepGraph
from .timeline import SpanTable, Timeline

ComputeCosts = Mapping[Any, float] | Callable[[int, str], float]


def _compute_cost_fn(compute_costs: ComputeCosts, num_stages: int,
                     kinds: Sequence[str] = ("F", "B")) -> Callable[[int, str], float]:
    if callable(compute_costs):
        fn = compute_costs
    elif isinstance(compute_costs, Mapping):
        table = dict(compute_costs)

        def fn(stage: int, kind: str) -> float:
            if (stage, kind) in table:
                return table[(stage, kind)]
            if kind in table:
                return table[kind]
            raise ValueError(
                f"compute_costs: no duration for stage {stage} {kind!r}; give "
                "{(stage, 'F'): seconds, ...} or {'F': seconds, 'B': seconds} (and 'I', 'W' "
                "for a schedule that splits the backward)"
            )
    else:
        raise TypeError(
            f"compute_costs: expected a mapping or a callable (stage, kind) -> seconds, got "
            f"{type(compute_costs).__name__}"
        )
    durations: dict[tuple[int, str], float] = {}
    for s in range(num_stages):
        for k in kinds:
            v = fn(s, k)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
                raise TypeError(f"compute_costs: stage {s} {k!r} has duration {v!r} "
                                f"({type(v).__name__}); need a number of seconds")
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"compute_costs: stage {s} {k!r} has duration {v!r}; "
                                 "need finite seconds >= 0")
            durations[(s, k)] = float(v)
    return lambda stage, kind: durations[(stage, kind)]


def simulate(
    graph: StepGraph,
    cluster: Cluster,
    compute_costs: ComputeCosts,
    *,
    signal: bool = False,
    microbatch_costs: Callable[[int, str, int], float] | None = None,
) -> Timeline:
    """Simulate one training step (or resharding) of ``graph`` on ``cluster``.

    Args:
        compute_costs: seconds per (stage, kind): a mapping ``{(stage, "F"): s, ...}`` or
            ``{"F": s, "B": s}`` for every stage, or a callable ``(stage, kind) -> s``.
        signal: cost every transfer only its latency (the paper's upper bound).
        microbatch_costs: ``(stage, kind, microbatch) -> seconds``, for steps whose
            microbatches differ in size (:class:`~scheduler.MicrobatchBoundaries`): each
            compute's own duration — e.g. in proportion to its sequence length
            (``graph.plan_for(channel, i).shape``); ``compute_costs`` then only checks.

    Raises :class:`~scheduler.validate.ProgramError` (with the validator's report) if the
    graph cannot run to its end.
    """
    if not isinstance(graph, StepGraph):
        raise TypeError(f"graph: expected a StepGraph, got {type(graph).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
    kinds = sorted({op.body.kind for op in graph.ops if isinstance(op.body, Compute)})
    cost_of = _compute_cost_fn(compute_costs, len(graph.stages), kinds)
    model = CostModel(cluster)
    if microbatch_costs is not None and not callable(microbatch_costs):
        raise TypeError(f"microbatch_costs: expected a callable (stage, kind, microbatch) -> "
                        f"seconds, got {type(microbatch_costs).__name__}")
    costs = _op_costs(graph, model, cost_of, signal, microbatch_costs)
    succ, need = graph.successors
    try:
        start, end = model.run_ops(costs, succ, need)
    except RuntimeError:
        from .validate import validate  # names the cycle, with the grid

        validate(graph)
        raise
    return _timeline(graph, start, end)


def _op_costs(graph: StepGraph, model: CostModel, cost_of: Callable[[int, str], float],
              signal: bool, per_mb: Callable[[int, str, int], float] | None = None
              ) -> list[TransferCost]:
    """Every op's cost: one value per stage and kind (and microbatch, with ``per_mb``), and
    per plan transfer."""
    by_body: dict[Any, TransferCost] = {}
    costs = []
    for op in graph.ops:
        b = op.body
        if isinstance(b, Compute):
            key: Any = (b.stage, b.kind) if per_mb is None else (b.stage, b.kind, b.microbatch)
        elif isinstance(b, GradReduce):
            key = b
        else:
            key = id(b.transfer)
        tc = by_body.get(key)
        if tc is None:
            if isinstance(b, Compute):
                seconds = cost_of(b.stage, b.kind) if per_mb is None else \
                    _seconds(per_mb(b.stage, b.kind, b.microbatch),
                             f"microbatch_costs: stage {b.stage} {b.kind!r} microbatch "
                             f"{b.microbatch}")
                tc = TransferCost((), seconds, 0, math.inf)
            elif isinstance(b, GradReduce):
                tc = model.all_reduce_cost(b.group, b.nbytes)
                if signal:
                    tc = TransferCost((), tc.fixed_s, 0, math.inf)
            elif signal:
                t = b.transfer
                tc = TransferCost((), model.latency_of(t.sender, t.receivers), 0, math.inf)
            else:
                tc = model.transfer_cost(b.transfer)
            by_body[key] = tc
        costs.append(tc)
    return costs


def _seconds(v: Any, what: str) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{what} has duration {v!r} ({type(v).__name__}); need a number of "
                        "seconds")
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{what} has duration {v!r}; need finite seconds >= 0")
    return float(v)


def _timeline(graph: StepGraph, start: list[float], end: list[float]) -> Timeline:
    """Spans of every op on each of its devices (made on first use), with the graph's data
    edges."""
    stage_of = {d: graph.stage_of(d) for d in graph.devices}
    return Timeline(SpanTable(graph.ops, start, end), len(graph.stages), graph.devices,
                    stage_of, graph.data_inputs)
