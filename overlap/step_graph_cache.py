"""The step-graph cache: what a runtime works out once and reuses — plans, step graphs,
their agreement digests, resolved routes — and how a step's graph is chosen.

:class:`StepGraphCache` keeps them (least recently used dropped past :data:`MEMO_SIZE`):
a training step's graph lowered (and planned) off the event loop per configuration, or the
caller's own graph checked once (:func:`check_graph`, :func:`check_given_graph`);
``schedule="auto"``'s choice, made once from ``compute_time`` or the last step's measured
compute times; a resharding plan's inputs, graph and digest; each graph's routes. The
schedule by name is :func:`resolve_schedule` (public: the torch adapter uses it too);
:func:`agreement_digest` is what a step's agreement compares across processes.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from scheduler import (
    Boundaries,
    Channel,
    Cluster,
    DataParallel,
    DeviceMesh,
    PlanCache,
    PlanError,
    PlanOptions,
    Region,
    ReshardPlan,
    Schedule,
    StepGraph,
    auto_schedule,
    boundaries_key,
    channels,
    check_caps,
    lower,
    make_schedule,
    per_microbatch,
    plan_mismatch,
    region_shape,
    reshard_graph,
    validate,
)

from .pipeline import Stage, check_split
from .reshard import resolve

if TYPE_CHECKING:
    from .backends import Backend

T = TypeVar("T")
log = logging.getLogger("overlap")
MEMO_SIZE = 64  # graphs, digests, routes, plan inputs kept per runtime (least recent dropped)
_MISSING = object()
# Seconds per (stage, kind) that the last step measured on these stage meshes, or None.
MeasuredCosts = Callable[[tuple[DeviceMesh, ...]], "dict[tuple[int, str], float] | None"]


def resolve_schedule(schedule: str | Schedule | None, num_stages: int,
                     num_microbatches: int) -> Schedule:
    """The step's schedule: ``schedule`` itself (checked against the step's stages and
    microbatches), or the one named (default ``"eager-1f1b"``)."""
    if isinstance(schedule, Schedule):
        if (schedule.num_stages, schedule.num_microbatches) != (num_stages, num_microbatches):
            raise ValueError(f"schedule: built for {schedule.num_stages} stages × "
                             f"{schedule.num_microbatches} microbatches; this step has "
                             f"{num_stages} × {num_microbatches}")
        return schedule
    if schedule is not None and not isinstance(schedule, str):
        raise TypeError(f"schedule: expected a name or a Schedule, got {type(schedule).__name__}")
    return _named_schedule(schedule or "eager-1f1b", num_stages, num_microbatches)


@functools.lru_cache(maxsize=64)
def _named_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """A step by name makes (and checks) its schedule once per size, not every call: that
    was ~0.06 s a step at 64 stages × 256 microbatches. (A bad name raises every time:
    errors are not cached.)"""
    return make_schedule(name, num_stages, num_microbatches)


def data_parallel_of(stages: Sequence[Stage]) -> dict[int, DataParallel]:
    """The stages' gradient reductions, as the lowering takes them."""
    return {s: DataParallel(st.data_parallel.axis, st.data_parallel.nbytes)
            for s, st in enumerate(stages) if st.data_parallel is not None}


def check_graph(graph: StepGraph, meshes: tuple[DeviceMesh, ...],
                boundaries: Boundaries, num_microbatches: int,
                data_parallel: Mapping[int, DataParallel] | None = None) -> None:
    """Raise ValueError naming ``graph`` unless it was lowered for these stage meshes,
    boundaries (every channel's plan moves its boundary's tensor between its layouts),
    number of microbatches and data-parallel stages."""
    if not isinstance(graph, StepGraph):
        raise TypeError(f"graph: expected a StepGraph, got {type(graph).__name__}")
    if graph.schedule is None or graph.stages != meshes:
        raise ValueError("graph: lowered for other stage meshes (or not a pipeline's graph)")
    if graph.schedule.num_microbatches != num_microbatches:
        raise ValueError(f"graph: lowered for {graph.schedule.num_microbatches} microbatches, "
                         f"got {num_microbatches}")
    want = dict(data_parallel or {})
    if dict(graph.data_parallel) != want:
        raise ValueError(f"graph: lowered with data-parallel stages {dict(graph.data_parallel)}, "
                         f"the stages have {want} (lower(..., data_parallel=...))")
    per = per_microbatch(boundaries, num_microbatches)
    rows = range(1) if all(k is None or not isinstance(k, tuple) for k in graph.plans) \
        and len(set(per)) == 1 else range(num_microbatches)
    for i in rows:
        for channel, b, src, dst in channels(per[i]):
            try:
                plan: ReshardPlan | None = graph.plan_for(channel, i)
            except KeyError:
                plan = None
            mismatch = "it has none" if plan is None else plan_mismatch(plan, b, src, dst)
            if mismatch is not None:
                raise ValueError(f"graph: its plan for {channel} (microbatch {i}) does not fit "
                                 f"boundaries[{channel.boundary}]: {mismatch}")


def agreement_digest(graph: StepGraph) -> bytes:
    """What a step's agreement compares across processes: the graph's digest, then the
    number of microbatches and each one's first-boundary shape (a mismatch of counts is
    named by both counts, one of shapes by microbatch)."""
    from .backends import shape_table

    m = graph.schedule.num_microbatches if graph.schedule is not None else 0
    first = Channel("fwd", 0)
    shapes = [graph.plan_for(first, i).shape for i in range(m)] if len(graph.stages) > 1 \
        else []
    return graph.digest() + shape_table(shapes, m)


def check_given_graph(graph: StepGraph) -> None:
    """A graph the runtime did not lower may be broken (edited JSON, another tool): its plans
    must be correct and the graph must validate (every transfer present, data dependencies
    kept, no deadlock) — once per graph, before it first runs."""
    for channel, plan in graph.plans.items():
        try:
            plan.check()
        except PlanError as exc:
            raise PlanError(f"graph: its plan for {channel}: {exc}") from None
    validate(graph)

class StepGraphCache:
    """A runtime's derived values (see module doc), for ``backend``'s devices in
    ``cluster``. ``distributed``: a multi-process job (digests are made, and ``auto`` takes
    no measured costs: processes measure different devices and must choose alike);
    ``compute_time``: the runtime's; ``measured``: the last step's measured costs."""

    def __init__(self, cluster: Cluster, backend: Backend, *, distributed: bool,
                 compute_time: Callable[[int, str], float] | None,
                 measured: MeasuredCosts) -> None:
        self.cluster = cluster
        self.backend = backend
        self.distributed = distributed
        self.compute_time = compute_time
        self.measured = measured
        self.plans = PlanCache(cluster)  # each boundary planned once per options
        self._memo: OrderedDict[Any, Any] = OrderedDict()  # step graphs, plan digests

    def cached(self, key: Any, make: Callable[[], T]) -> T:
        """``make()``, kept for ``key`` with the other derived values (graphs, digests); the
        least recently used dropped past a bound."""
        value = self._memo.pop(key, _MISSING)
        if value is _MISSING:
            value = make()
        self.remember(key, value)
        return value  # type: ignore[return-value]

    def remember(self, key: Any, value: Any) -> None:
        self._memo[key] = value  # most recently used last
        while len(self._memo) > MEMO_SIZE:
            self._memo.popitem(last=False)

    # ---- resharding ----------------------------------------------------------------------

    def reshard_inputs(self, plan: ReshardPlan) -> tuple[
            dict[int, Region], dict[int, Region], dict[int, tuple[int, ...]]]:
        """A plan's source and destination regions and the shards a call must pass (source
        device -> its region's shape: this process's devices), once its devices are known to
        be in the cluster (else ValueError, naming the device) — worked out at the plan's
        first call (checks that raise keep nothing): a plan a loop passes again costs a
        lookup, not a walk of its meshes."""
        return self.cached(("reshard inputs", plan), lambda: self._reshard_inputs(plan))

    def _reshard_inputs(self, plan: ReshardPlan) -> tuple[
            dict[int, Region], dict[int, Region], dict[int, tuple[int, ...]]]:
        top = max((*plan.src.mesh.device_ids, *plan.dst.mesh.device_ids), default=-1)
        if top >= self.cluster.num_devices:
            raise ValueError(f"plan: device {top} is outside the runtime's cluster "
                             f"(devices 0..{self.cluster.num_devices - 1})")
        mine = self.backend.is_local if self.distributed else (lambda _: True)
        src = plan.src.device_regions(plan.shape)
        return src, plan.dst.device_regions(plan.shape), {
            d: region_shape(r) for d, r in src.items() if mine(d)}

    def reshard_graph(self, plan: ReshardPlan, stream: str) -> StepGraph:
        """The plan's step graph on ``stream``. A plan this runtime did not make may be
        broken (edited JSON, another tool): checked once, with its graph, before anything
        moves, so that no destination keeps uninitialised memory."""
        def make() -> StepGraph:
            plan.check()
            return reshard_graph(plan, stream)
        return self.cached(("reshard", plan, stream), make)

    def plan_agreement(self, plan: ReshardPlan) -> tuple[bytes, tuple[int, ...] | None]:
        """What a resharding call's agreement compares (a SHA-256 of the plan), and among
        whom: the ranks holding a device of either layout — the others have no part in it.
        (b"", None) in one process."""
        if not self.distributed:
            return b"", None
        return self.cached(("digest", plan), lambda: self._plan_agreement(plan))

    def _plan_agreement(self, plan: ReshardPlan) -> tuple[bytes, tuple[int, ...]]:
        placement = self.backend.placement
        assert placement is not None  # (a multi-process backend's)
        owners = placement.ranks_of((*plan.src.mesh.device_ids, *plan.dst.mesh.device_ids))
        return hashlib.sha256(plan.to_json().encode()).digest(), tuple(sorted(owners))

    def routes(self, graph: StepGraph, name: Callable[[Any], str]) -> Any:
        """Each transfer op's part on each local device, resolved once per graph — at its
        first launch, once the call prepared the channels it spans (a route resolved before
        would have to be resolved again at every transfer)."""
        return self.cached(("routes", id(graph)), lambda: (graph, resolve(
            self.backend, graph, name)))[1]

    # ---- training steps ------------------------------------------------------------------

    async def step_graph(self, stages: Sequence[Stage], boundaries: Boundaries,
                          num_microbatches: int, schedule: str | Schedule | None,
                          options: PlanOptions | None, graph: StepGraph | None,
                          max_activations: int | Sequence[int] | None = None
                          ) -> tuple[StepGraph, bytes]:
        """The step's graph and its digest: the caller's (checked), or lowered — and planned
        — in a worker thread (seconds of planning never block the event loop), cached."""
        meshes = tuple(st.mesh for st in stages)
        if graph is None and options is not None and not isinstance(options, PlanOptions):
            raise TypeError(f"options: expected a PlanOptions, got {type(options).__name__}")
        if schedule == "auto" and graph is None:
            return await self._auto_graph(stages, meshes, boundaries, num_microbatches,
                                          options, max_activations)
        if graph is not None:
            if schedule is not None or options is not None:
                raise ValueError("graph: give a step graph, or a schedule and options to "
                                 "lower one, not both")
            check_graph(graph, meshes, boundaries, num_microbatches, data_parallel_of(stages))
            key: Any = ("given", id(graph))
        else:
            sched = resolve_schedule(schedule, len(stages), num_microbatches)
            key = ("lowered", meshes, boundaries_key(boundaries), sched,
                   options or PlanOptions(), tuple(sorted(data_parallel_of(stages).items())))
        chosen = graph.schedule if graph is not None else sched
        check_split(stages, chosen.kinds)  # type: ignore[union-attr]
        hit = self._memo.pop(key, None)
        if hit is None or (graph is not None and hit[0] is not graph):

            def make() -> tuple[StepGraph, bytes]:
                if graph is not None:
                    check_given_graph(graph)
                g = graph if graph is not None else lower(
                    meshes, boundaries, key[3], self.cluster, key[4], cache=self.plans,
                    data_parallel=dict(key[5]))
                return g, (agreement_digest(g) if self.distributed else b"")

            hit = await asyncio.to_thread(make)
        self.remember(key, hit)
        return hit

    async def _auto_graph(self, stages: Sequence[Stage], meshes: tuple[DeviceMesh, ...],
                          boundaries: Boundaries, num_microbatches: int,
                          options: PlanOptions | None,
                          max_activations: int | Sequence[int] | None
                          ) -> tuple[StepGraph, bytes]:
        """``schedule="auto"``: :func:`scheduler.auto_schedule` over the step's stages with
        the runtime's compute costs, chosen once per pipeline, microbatch count and options
        (planned off the event loop, like a lowering), then reused."""
        cap = check_caps(max_activations, len(stages))  # bad caps named before any work
        dp = data_parallel_of(stages)
        key = ("auto", meshes, boundaries_key(boundaries), num_microbatches,
               options or PlanOptions(),
               None if cap is None else tuple(cap), tuple(sorted(dp.items())))
        hit = self._memo.pop(key, None)
        if hit is None:
            costs = self._auto_costs(stages, meshes)

            def make() -> tuple[StepGraph, bytes]:
                choice = auto_schedule(meshes, boundaries, num_microbatches, self.cluster,
                                       costs, key[4], max_activations=cap, cache=self.plans,
                                       data_parallel=dp)
                log.info("schedule 'auto' chose %s (%.3g s simulated)", choice.schedule.name,
                         choice.seconds)
                g = choice.graph
                return g, (agreement_digest(g) if self.distributed else b"")

            hit = await asyncio.to_thread(make)
        self.remember(key, hit)
        return hit

    def _auto_costs(self, stages: Sequence[Stage], meshes: tuple[DeviceMesh, ...]
                    ) -> Callable[[int, str], float]:
        """Seconds per (stage, kind) for ``auto``: ``compute_time`` when given, else the last
        step's measured means (one process only: processes measure different devices and
        must choose alike). The backward is split only where every stage can and I/W costs
        are known."""
        split = all(st.backward_weight is not None for st in stages)
        table: dict[tuple[int, str], float] | None = None
        if self.compute_time is None:
            table = None if self.distributed else self.measured(meshes)
            if table is None:
                raise ValueError(
                    "schedule: 'auto' chooses from compute costs; give Runtime(compute_time="
                    "...), or run a step of this pipeline with another schedule first (its "
                    "measured times are used; one process only), or pass "
                    "scheduler.auto_schedule(...).schedule")
        fn = self.compute_time

        def cost(stage: int, kind: str) -> float:
            if kind in ("I", "W") and not split:
                raise KeyError(kind)  # (auto_schedule then keeps the full backward)
            return fn(stage, kind) if table is None else table[(stage, kind)]
        return cost


__all__ = ["MEMO_SIZE", "StepGraphCache", "agreement_digest", "check_given_graph",
           "check_graph", "data_parallel_of", "resolve_schedule"]
