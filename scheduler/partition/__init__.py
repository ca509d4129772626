"""Automatic pipeline partitioning: from a model's layers and a cluster, the stages, each
stage's submesh and its data-parallel × tensor-parallel degrees, the boundary layouts and the
schedule.

    import scheduler as s

    layers = [s.Layer({1: 0.045, 4: 0.012}, {1: 0.090, 4: 0.024}, (1024, 8192), "float16",
                      params_bytes=3 << 30, activation_bytes=800 << 20) for _ in range(24)]
    plan = s.partition(layers, s.Cluster.preset("p3.8xlarge", 4), num_microbatches=16,
                       memory_per_device=16 << 30)
    print(plan.to_text())                  # stages, layers, meshes, TP, DP, layouts, schedule
    graph = plan.lower()                   # what simulate and the runtime take

Three steps (docs/partition.md): a dynamic program over layers × devices × submesh sizes
(:mod:`scheduler.partition.search`) finds the candidates of least estimate E
(:mod:`scheduler.partition.model`: 1F1B's closed form with every boundary's resharding
costed by the cost model); the best few are lowered and simulated under every fixed schedule
that fits memory and the fastest also under ``auto`` (:mod:`scheduler.partition.rank`); the
fastest simulated pipeline is the plan. Deterministic: every budget counts work, never time.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from ..cluster import Cluster
from ..errors import ShardingError, check_positive_int
from ..plan import fmt_bytes
from ..planner import PlanOptions
from ..schedules import check_size
from .chunks import rank_memory
from .model import (
    Layer,
    PartitionError,
    Problem,
    all_reduce_seconds,
    submesh_shape,
    submesh_sizes,
)
from .plan import PartitionPlan, StagePlan
from .rank import Trial, rank
from .search import MAX_DEVICES, MAX_SEARCH_BYTES, Found, search, search_bytes


@dataclass(frozen=True)
class SearchBudget:
    """How much work :func:`partition` may do — counted in work, never in seconds.

    Attributes:
        cells: cells of the dynamic program evaluated over all its runs (beyond it the
            thresholds thin to a geometric grid; the plan's ``search["gap"]`` says how far
            from the estimate's optimum that can leave it).
        simulated: compute ops simulated (microbatches × kinds × devices, per schedule
            tried) while ranking the finalists.
        finalists: candidates (best estimate first) handed to the simulator.
    """

    cells: int = 300_000_000
    simulated: int = 100_000
    finalists: int = 4

    def __post_init__(self) -> None:
        for name in ("cells", "simulated", "finalists"):
            check_positive_int(name, getattr(self, name))


def partition(layers: Sequence[Layer], cluster: Cluster, num_microbatches: int, *,
              memory_per_device: float | None = None, options: PlanOptions | None = None,
              budget: SearchBudget | None = None,
              data_parallel: bool = True) -> PartitionPlan:
    """The fastest pipeline found for ``layers`` on ``cluster`` (module doc).

    Args:
        layers: the model as a chain of :class:`Layer` (each one's seconds per microbatch at
            the TP degrees it supports, its output, parameter and activation bytes).
        cluster: where it runs; stages take Alpa's submeshes of it (``1 × g`` inside a host,
            whole hosts), each ``dp × tp`` (data-parallel × tensor-parallel) over all its
            devices.
        num_microbatches: per step.
        memory_per_device: bytes each device may hold (None: no limit); every stage fits it
            with the activations its schedule keeps, or :class:`PartitionError` names the
            stage (or layer) that cannot and what it needs.
        options: how boundaries are planned (strategy and balance) when lowering.
        budget: :class:`SearchBudget` (default: 96 layers on 64 GPUs plan in seconds).
        data_parallel: whether a stage may split its microbatches' batch over a ``"dp"``
            axis of its submesh (False: DP degree 1 everywhere, tensor-parallel only — for a
            runtime that runs no data-parallel stage).
    """
    if not isinstance(data_parallel, bool):
        raise TypeError(f"data_parallel: expected a bool, got {data_parallel!r}")
    problem = make_problem(layers, cluster, num_microbatches, memory_per_device, options,
                       data_parallel)
    check_search_size(problem)
    budget = budget if budget is not None else SearchBudget()
    if not isinstance(budget, SearchBudget):
        raise TypeError(f"budget: expected a SearchBudget, got {type(budget).__name__}")
    options = options or PlanOptions()
    found = search(problem, budget.cells, budget.finalists)
    if not found.candidates:
        raise _no_fit(problem, budget)
    trials = rank(problem, found.candidates, options, budget.simulated)
    return _plan(problem, trials, found, options)


def make_problem(layers: object, cluster: object, m: object, memory: object,
                 options: object, data_parallel: bool = True) -> Problem:
    """The checked :class:`~scheduler.partition.model.Problem` :func:`partition` searches
    (its arguments' checks, in its order; what :func:`search_bytes` sizes)."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise TypeError(f"layers: expected a non-empty sequence of scheduler.Layer, got "
                        f"{type(layers).__name__}")
    for i, layer in enumerate(layers):
        if not isinstance(layer, Layer):
            raise TypeError(f"layers[{i}]: expected a scheduler.Layer, got "
                            f"{type(layer).__name__}")
        if i:
            try:
                layer.input_spec.padded(len(layers[i - 1].output_shape))
            except ShardingError as exc:
                raise ValueError(f"layers[{i}].input_spec: its input is layers[{i - 1}]'s "
                                 f"output: {exc}") from None
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a scheduler.Cluster, got {type(cluster).__name__}")
    m = check_positive_int("num_microbatches", m)
    check_size(min(len(layers), cluster.num_devices), m)
    if cluster.num_devices > MAX_DEVICES:
        raise PartitionError(f"cluster: {cluster.num_hosts} hosts × {cluster.gpus_per_host} "
                             f"GPUs is {cluster.num_devices} devices; a partition searches at "
                             f"most {MAX_DEVICES}")
    if memory is not None and (isinstance(memory, bool) or not isinstance(
            memory, numbers.Real) or not 0 < memory < math.inf):
        raise ValueError(f"memory_per_device: expected bytes > 0 (or None: no limit), got "
                         f"{memory!r}")
    if options is not None and not isinstance(options, PlanOptions):
        raise TypeError(f"options: expected a PlanOptions, got {type(options).__name__}")
    sizes = submesh_sizes(cluster)
    for i, layer in enumerate(layers):
        if not set(layer.degrees) & set(sizes):
            raise PartitionError(f"layers[{i}]{_named(layer)}: supports TP degrees "
                                 f"{list(layer.degrees)}, none of them a submesh of this "
                                 f"cluster (sizes {list(sizes)}: g | {cluster.gpus_per_host} "
                                 "GPUs of a host, or whole hosts)")
    return Problem(tuple(layers), cluster, m,
                   None if memory is None else float(memory),  # type: ignore[arg-type]
                   (options or PlanOptions()).strategy, data_parallel)


def check_search_size(problem: Problem) -> None:
    """PartitionError naming what to shrink when the search's tables would take more than
    :data:`~scheduler.partition.search.MAX_SEARCH_BYTES` (:func:`search_bytes`): ``layers``
    when the layers² part is the larger, else ``cluster`` (its devices and stage shapes)."""
    square, boundary = search_bytes(problem)
    if square + boundary <= MAX_SEARCH_BYTES:
        return
    L, N = len(problem.layers), problem.cluster.num_devices
    field = "layers" if square >= boundary else "cluster"
    raise PartitionError(f"{field}: {L} layers on {N} devices ({len(problem.shapes)} stage "
                         f"shapes) need about {fmt_bytes(square + boundary)} of search "
                         f"tables, more than {fmt_bytes(MAX_SEARCH_BYTES)}: fewer layers "
                         "(or repeats), hosts or TP degrees")


def _named(layer: Layer) -> str:
    return f" ({layer.name})" if layer.name else ""


def _no_fit(problem: Problem, budget: SearchBudget) -> PartitionError:
    """Why nothing fits: a layer too big even alone on its widest submesh, else the stage
    that overflows most in the best partition without the memory limit."""
    cap = problem.memory_per_device
    sizes = problem.sizes
    for i, layer in enumerate(problem.layers):
        fits = [t for t in layer.degrees if t in sizes]
        widest = max(fits)
        params, acts = problem.stage_bytes(i, i + 1, widest)
        if cap is not None and not problem.fits(i, i + 1, widest, 1):
            return PartitionError(
                f"layers[{i}]{_named(layer)} cannot fit even alone on {widest} devices (TP "
                f"{widest}, its widest): it needs {fmt_bytes(params + acts)} per device "
                f"(parameters {fmt_bytes(params)} + one microbatch's activations "
                f"{fmt_bytes(acts)}); memory_per_device is {fmt_bytes(cap)}")
    free = Problem(problem.layers, problem.cluster, problem.num_microbatches, None,
                   problem.strategy, problem.data_parallel)
    found = search(free, budget.cells, 1)
    if not found.candidates or cap is None:
        return PartitionError(
            f"no partition of the {len(problem.layers)} layers fits the cluster's "
            f"{problem.cluster.num_devices} devices: stages of different TP degrees cannot "
            f"share a submesh, and the layers support {_degree_summary(problem)}")
    stages = found.candidates[0][1]
    p, m = len(stages), problem.num_microbatches
    need = []
    for s, (a, b, _, size, dp) in enumerate(stages):
        params, acts = problem.stage_bytes(a, b, size, dp)
        k = min(m, p - s)
        need.append((params + k * acts, s, a, b, size, params, acts, k))
    total, s, a, b, size, params, acts, k = max(need)
    return PartitionError(
        f"no partition fits memory_per_device {fmt_bytes(cap)}: the best without the limit has "
        f"stage {s} (layers {a}-{b - 1} on {size} devices{_dp_note(stages[s][4])}) needing "
        f"{fmt_bytes(total)} per "
        f"device (parameters {fmt_bytes(params)} + activations {fmt_bytes(acts)} × {k}, the "
        f"microbatches 1f1b keeps there); fewer layers per stage need more devices than the "
        f"cluster's {problem.cluster.num_devices}")


def _dp_note(dp: int) -> str:
    return f", DP {dp}" if dp > 1 else ""


def _degree_summary(problem: Problem) -> str:
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, layer in enumerate(problem.layers):
        groups.setdefault(layer.degrees, []).append(i)
    return "; ".join(f"degrees {list(d)} (layers {_ranges(ix)})" for d, ix in groups.items())


def _ranges(ix: list[int]) -> str:
    out, start = [], ix[0]
    for prev, cur in zip(ix, [*ix[1:], None]):
        if cur != prev + 1:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(out)


def _plan(problem: Problem, trials: list[Trial], found: Found,
          options: PlanOptions) -> PartitionPlan:
    best = trials[0]
    pipe, sched = best.pipeline, best.schedule
    stages = []
    for s, (a, b, _, size, dp) in enumerate(pipe.stages):
        params, acts = problem.stage_bytes(a, b, size, dp)
        c = pipe.costs
        stages.append(StagePlan(range(a, b), pipe.meshes[s], size // dp,
                                submesh_shape(size, problem.cluster), c[(s, "F")], c[(s, "B")],
                                c.get((s, "I")), c.get((s, "W")), params, acts, dp))
    per_rank = rank_memory(problem, sched, pipe.stages)
    peaks = [per_rank[sched.rank_of(s)] for s in range(len(stages))]
    tl = best.timeline
    report = {"runs": found.runs, "cells": found.cells, "gap": found.gap,
              "finalists": [(describe(t.pipeline.stages), t.schedule.name, t.seconds,
                             t.estimate) for t in trials]}
    return PartitionPlan(tuple(stages), pipe.boundaries, sched, problem.cluster,
                         problem.num_microbatches, best.seconds, tl.bubble_fraction,
                         tl.exposed_comm_fraction, tuple(peaks), best.estimate, options,
                         report)


def describe(stages: Sequence[tuple[int, int, int, int, int]]) -> str:
    """``0-11@4 12-23@2x2``: each stage's layers and TP degree, as ``dp x tp`` when its DP
    degree is above 1."""
    return " ".join(f"{a}-{b - 1}@{size}" if dp == 1 else f"{a}-{b - 1}@{dp}x{size // dp}"
                    for a, b, _, size, dp in stages)


__all__ = ["Layer", "PartitionError", "PartitionPlan", "SearchBudget", "StagePlan",
           "all_reduce_seconds", "describe", "make_problem", "partition", "search_bytes"]
