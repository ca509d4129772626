"""Lowering: a schedule over stage meshes becomes the step graph (:mod:`scheduler.graph`).

Each boundary is planned once per direction — activations producer → consumer, gradients
back — through a :class:`~scheduler.planner.PlanCache`, or taken from ``plans``. Ops are made
in one global launch order, a dependency order of the schedule
(:func:`~scheduler.schedules.dependency_order`): for each stage action, its compute on every
device of the stage mesh, each waiting for the transfers of its input's resharding that its
device takes part in (those that bring it the input, and those that forward the input from its
buffer to others, which the compute may overwrite);
then the transfers of the resharding of its output on the output's channel, each sender that
computed the data waiting for that compute on its device, each ``Transfer.after`` a wait
between senders. Every lane lists its ops in that order, so:

- an activation leaves on its channel right after the F that made it, with nothing of other
  boundaries in front of it (each channel has its own stream);
- the consumer waits only right before the compute that needs it;
- every channel's collectives have one launch order, the same on all their devices.

A stage with ``data_parallel`` gets, right after the schedule's last backward (B or W) of the
stage, one :class:`~scheduler.graph.GradReduce` per line of its mesh along the axis, on the
stage's stream ``dp<s>``: each device of the line waits there for its own last backward of
the stage, so the reduction runs while the device's compute stream (and every other stage)
goes on.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .cluster import Cluster
from .dtypes import check_dtype, is_floating
from .errors import ClusterError
from .graph import (
    COMPUTE,
    Channel,
    Compute,
    DataParallel,
    Dep,
    GradReduce,
    Op,
    PlanKey,
    StepGraph,
    channel_sets,
    dp_stream,
    inputs_of,
    lanes_of,
    outputs_of,
    plan_for,
    reduce_lines,
    transfer_ops,
)
from .mesh import DeviceMesh
from .plan import ReshardPlan
from .planner import PlanCache, PlanOptions, check_nbytes
from .schedules import Schedule, dependency_order
from .sharding import Sharding, check_shape


@dataclass(frozen=True)
class Boundary:
    """The tensor crossing from stage ``s`` to ``s + 1`` (its gradient crosses back).

    Checked and canonicalized when made: ``shape`` a sequence of ints >= 0 (stored as a
    tuple), ``dtype`` a supported dtype (stored by name), the tensor within 2**62 bytes, both
    layouts :class:`Sharding` values — a ValueError or TypeError naming the field otherwise.
    (Whether the layouts fit the shape and their stages' meshes is checked where the
    boundary meets them: :func:`lower`.)"""

    shape: tuple[int, ...]
    dtype: str
    producer: Sharding  # on stage s's mesh
    consumer: Sharding  # on stage s+1's mesh

    def __post_init__(self) -> None:
        shape = check_shape(self.shape, argument="Boundary shape")
        dtype = check_dtype(self.dtype, "Boundary dtype")
        check_nbytes(shape, dtype, "Boundary shape")
        for name in ("producer", "consumer"):
            value = getattr(self, name)
            if not isinstance(value, Sharding):
                raise TypeError(f"Boundary {name}: expected a Sharding, got "
                                f"{type(value).__name__} {value!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype.name)


BoundaryGroup = Boundary | tuple[Boundary, ...]
"""What crosses one stage boundary: a tensor, or a tuple of them (each its own channel, its
own layouts and plan; a gradient channel back for each floating-point one)."""


def elements(group: BoundaryGroup) -> tuple[Boundary, ...]:
    """The tensors of a boundary: itself, or the tuple's."""
    return group if isinstance(group, tuple) else (group,)


def _check_group(group: object, argument: str) -> None:
    if isinstance(group, tuple):
        if not group:
            raise ValueError(f"{argument}: an empty tuple; a boundary carries at least one "
                             "tensor")
        for e, b in enumerate(group):
            if not isinstance(b, Boundary):
                raise TypeError(f"{argument}[{e}]: expected a Boundary, got {type(b).__name__}")
    elif not isinstance(group, Boundary):
        raise TypeError(f"{argument}: expected a Boundary (or a tuple of them), got "
                        f"{type(group).__name__}")


@dataclass(frozen=True)
class MicrobatchBoundaries:
    """Boundaries that differ from microbatch to microbatch — sequences of different lengths,
    a short last batch: ``per[i][s]`` is boundary ``s`` of microbatch ``i`` (its shape; its
    dtype and layouts are those of every microbatch's). Each distinct shape is planned once
    (the plan cache); the step graph carries each microbatch's plans."""

    per: tuple[tuple[Boundary, ...], ...]

    def __post_init__(self) -> None:
        per = self.per
        if isinstance(per, (str, bytes)) or not isinstance(per, Sequence) or not per:
            raise TypeError("per: expected a non-empty sequence (one per microbatch) of "
                            "sequences of Boundary")
        rows = []
        for i, row in enumerate(per):
            if isinstance(row, Boundary) or not isinstance(row, Sequence):
                raise TypeError(f"per[{i}]: expected a sequence of Boundary (microbatch {i}'s "
                                f"boundaries), got {type(row).__name__}")
            for s, b in enumerate(row):
                _check_group(b, f"per[{i}][{s}]")
            if len(row) != len(per[0]):
                raise ValueError(f"per[{i}]: {len(row)} boundaries, microbatch 0 has "
                                 f"{len(per[0])}")
            for s, (g, g0) in enumerate(zip(row, per[0])):
                if isinstance(g, tuple) != isinstance(g0, tuple) or \
                        len(elements(g)) != len(elements(g0)):
                    raise ValueError(f"per[{i}][{s}]: {len(elements(g))} tensors, microbatch "
                                     f"0's boundary {s} has {len(elements(g0))}")
                for b, b0 in zip(elements(g), elements(g0)):
                    if (b.dtype, b.producer, b.consumer) != (b0.dtype, b0.producer,
                                                             b0.consumer):
                        raise ValueError(
                            f"per[{i}][{s}]: dtype and layouts must be microbatch 0's "
                            f"({b0.dtype}, {b0.producer!r} -> {b0.consumer!r}); only the "
                            "shape may differ")
            rows.append(tuple(row))
        object.__setattr__(self, "per", tuple(rows))

    @property
    def num_microbatches(self) -> int:
        """The number of microbatches (one row of boundaries each)."""
        return len(self.per)

    @property
    def shapes(self) -> tuple[tuple[Any, ...], ...]:
        """Per microbatch, each boundary's shape (a tuple of shapes for a boundary of several
        tensors)."""
        return tuple(tuple(tuple(tuple(e.shape) for e in b) if isinstance(b, tuple)
                           else tuple(b.shape) for b in row) for row in self.per)


Boundaries = Sequence[BoundaryGroup] | MicrobatchBoundaries


def per_microbatch(boundaries: Boundaries, num_microbatches: int
                   ) -> tuple[tuple[BoundaryGroup, ...], ...]:
    """Each microbatch's boundaries (the same tuple for all of a plain sequence)."""
    if isinstance(boundaries, MicrobatchBoundaries):
        if boundaries.num_microbatches != num_microbatches:
            raise ValueError(f"boundaries: given for {boundaries.num_microbatches} "
                             f"microbatches, the step has {num_microbatches}")
        return boundaries.per
    row = tuple(boundaries)
    return (row,) * num_microbatches


def boundaries_key(boundaries: Boundaries) -> Any:
    """A hashable key of a step's boundaries (for caches)."""
    if isinstance(boundaries, MicrobatchBoundaries):
        rows = set(boundaries.per)
        return boundaries.per[0] if len(rows) == 1 else boundaries
    return tuple(boundaries)


def lower(
    stages: Sequence[DeviceMesh],
    boundaries: Boundaries,
    schedule: Schedule,
    cluster: Cluster,
    options: PlanOptions | None = None,
    *,
    plans: Mapping[Channel, ReshardPlan] | None = None,
    cache: PlanCache | None = None,
    data_parallel: Mapping[int, DataParallel] | None = None,
) -> StepGraph:
    """Lower ``schedule`` over ``stages`` to the step graph every consumer executes.

    ``boundaries[s]`` is the tensor stage ``s`` sends to stage ``s + 1`` (or a tuple of them,
    each its own channel: :data:`BoundaryGroup`): its producer sharding must be on
    ``stages[s]`` and its consumer sharding on ``stages[s + 1]``. Gradients travel back with
    the same shape and dtype, from the consumer layout to the producer layout (in a tuple,
    for its floating-point tensors only).
    :class:`MicrobatchBoundaries` gives each microbatch its own shapes: every distinct shape
    is planned once, and the graph holds each microbatch's plans (keys ``(channel, i)``).
    Channels are planned with ``options`` (through ``cache`` when given, so a caller that
    lowers often plans each boundary once); ``plans`` gives some channels' plans instead
    (checked: the channel's layouts, shape and dtype, and the plan's invariants).
    ``data_parallel[s]``: stage ``s``'s gradients are reduced over that mesh axis after its
    last backward (see module doc; not for a forward-only schedule).
    """
    stages = tuple(stages)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule: expected a Schedule, got {type(schedule).__name__}")
    if not isinstance(boundaries, MicrobatchBoundaries):
        boundaries = tuple(boundaries)
    per = per_microbatch(boundaries, schedule.num_microbatches)
    distinct = list(dict.fromkeys(per))
    for row in distinct:
        _check_inputs(stages, row, schedule, cluster)
    if options is not None and not isinstance(options, PlanOptions):
        raise TypeError(f"options: expected a PlanOptions, got {type(options).__name__}")
    if cache is not None and (not isinstance(cache, PlanCache) or cache.cluster != cluster):
        raise ValueError("cache: expected a PlanCache of this cluster")
    cache = cache if cache is not None else PlanCache(cluster)
    options = options or PlanOptions()
    dp = check_data_parallel(data_parallel, stages, schedule)
    if len(distinct) == 1:
        return _build(stages, schedule, _plan_channels(distinct[0], cluster, options,
                                                       plans or {}, cache), dp)
    if plans:
        raise ValueError("plans: given plans fit one shape per channel; with boundaries that "
                         "differ by microbatch every shape is planned (leave plans out)")
    by_row = {row: _plan_channels(row, cluster, options, {}, cache) for row in distinct}
    keyed: dict[PlanKey, ReshardPlan] = {
        (channel, i): plan for i, row in enumerate(per) for channel, plan in by_row[row].items()}
    return _build(stages, schedule, keyed, dp)


def check_data_parallel(data_parallel: Mapping[int, DataParallel] | None,
                        stages: tuple[DeviceMesh, ...], schedule: Schedule
                        ) -> dict[int, DataParallel]:
    """``data_parallel`` checked against the stages (each key a stage whose mesh has the
    axis; none for a forward-only schedule), as a plain dict."""
    if data_parallel is None:
        return {}
    if not isinstance(data_parallel, Mapping):
        raise TypeError(f"data_parallel: expected a mapping stage -> DataParallel, got "
                        f"{type(data_parallel).__name__}")
    out: dict[int, DataParallel] = {}
    for s, dp in data_parallel.items():
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < len(stages):
            raise ValueError(f"data_parallel: key {s!r} is not a stage (0..{len(stages) - 1})")
        if not isinstance(dp, DataParallel):
            raise TypeError(f"data_parallel[{s}]: expected a DataParallel, got "
                            f"{type(dp).__name__}")
        if dp.axis not in stages[s].axis_names:
            raise ValueError(f"data_parallel[{s}]: stage {s}'s mesh {stages[s]!r} has no axis "
                             f"{dp.axis!r}")
        out[s] = dp
    if out and schedule.forward_only:
        raise ValueError("data_parallel: a forward-only schedule has no gradients to reduce")
    return out


def channels(boundaries: Sequence[BoundaryGroup]
             ) -> Iterator[tuple[Channel, Boundary, Sharding, Sharding]]:
    """Each boundary's channels, with the layouts their plans move between: activations from
    the producer's to the consumer's, gradients back — a channel each way per tensor of a
    tuple, gradients only for its floating-point tensors (integer ones, positions or masks,
    have none)."""
    for s, group in enumerate(boundaries):
        grouped = isinstance(group, tuple)
        for e, b in enumerate(elements(group)):
            yield Channel("fwd", s, e), b, b.producer, b.consumer
            if not grouped or is_floating(check_dtype(b.dtype)):
                yield Channel("bwd", s, e), b, b.consumer, b.producer


def plan_mismatch(plan: ReshardPlan, boundary: Boundary, src: Sharding, dst: Sharding
                  ) -> str | None:
    """None when ``plan`` moves ``boundary``'s tensor from ``src`` to ``dst``; else both sides,
    for a message."""
    want = (tuple(boundary.shape), str(check_dtype(boundary.dtype)), src, dst)
    if (plan.shape, plan.dtype, plan.src, plan.dst) == want:
        return None
    return (f"the plan moves {plan.shape} {plan.dtype} {plan.src!r} -> {plan.dst!r}; the "
            f"channel needs {want[0]} {want[1]} {src!r} -> {dst!r}")


def _plan_channels(boundaries: tuple[BoundaryGroup, ...], cluster: Cluster, options: PlanOptions,
                   given: Mapping[Channel, ReshardPlan], cache: PlanCache
                   ) -> dict[Channel, ReshardPlan]:
    out: dict[Channel, ReshardPlan] = {}
    for channel, b, src, dst in channels(boundaries):
        plan = given.get(channel)
        if plan is None:
            plan = cache.plan(b.shape, b.dtype, src, dst, options)
        else:
            if not isinstance(plan, ReshardPlan):
                raise TypeError(f"plans[{channel}]: expected a ReshardPlan, got "
                                f"{type(plan).__name__}")
            mismatch = plan_mismatch(plan, b, src, dst)
            if mismatch is not None:
                raise ValueError(f"plans[{channel}]: {mismatch}")
            plan.check()
        out[channel] = plan
    extra = sorted(str(k) for k in given if k not in out)
    if extra:
        raise ValueError(f"plans: channels {extra} are not channels of this pipeline "
                         f"({len(boundaries)} boundaries)")
    return out


def _build(stages: tuple[DeviceMesh, ...], schedule: Schedule,
           plans: dict[PlanKey, ReshardPlan],
           data_parallel: dict[int, DataParallel] | None = None) -> StepGraph:
    """The ops in the global launch order (see module doc), and every lane's order."""
    p = len(stages)
    ops: list[Op] = []
    dp = data_parallel or {}
    order = list(dependency_order(schedule))
    # Each data-parallel stage's last backward action: its reductions follow it.
    last_backward = {s: k for k, (s, a) in enumerate(order) if a.kind in ("B", "W")}
    # (channel, microbatch) -> device -> the transfer ops it takes part in (what the compute
    # that consumes the data there waits for).
    delivered: dict[tuple[Channel, int], dict[int, list[int]]] = {}
    sets = channel_sets(plans)
    for k, (s, action) in enumerate(order):
        i, kind = action.microbatch, action.kind
        got: dict[int, list[int]] = {}
        for into in inputs_of(s, kind, p, sets):
            for d, ids in delivered.pop((into, i), {}).items():
                got.setdefault(d, []).extend(ids)
        body = Compute(s, i, kind)  # one value for every device of the stage
        here: dict[int, Dep] = {}
        for d in stages[s].device_ids:
            here[d] = Dep(len(ops), d, d)
            ops.append(Op(len(ops), body, COMPUTE, (d,),
                          tuple(Dep(t, d, d) for t in got.get(d, ()))))
        if s in dp and last_backward.get(s) == k:
            for line in reduce_lines(stages[s], dp[s].axis):
                ops.append(Op(len(ops), GradReduce(s, line, dp[s].nbytes), dp_stream(s), line,
                              tuple(here[d] for d in line)))
        for out in outputs_of(s, kind, p, sets):
            new = transfer_ops(plan_for(plans, out, i), out, i, str(out), len(ops), here)
            ops += new
            to = delivered[(out, i)] = {}
            for op in new:
                for r in op.devices:
                    to.setdefault(r, []).append(op.id)
    return StepGraph(tuple(ops), lanes_of(ops), stages, schedule, plans, dp)


def _check_meshes(stages: tuple[DeviceMesh, ...], schedule: Schedule, cluster: Cluster) -> None:
    """The stages of one rank (the schedule's placement) share that rank's mesh; stages of
    different ranks share no device (one compute stream per device runs its rank's list)."""
    rank_mesh: dict[int, tuple[int, DeviceMesh]] = {}  # rank -> (its first stage, mesh)
    owner: dict[int, tuple[int, int]] = {}  # device -> (rank, first stage on it)
    for s, mesh in enumerate(stages):
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"stages[{s}]: expected a DeviceMesh, got {type(mesh).__name__}")
        r = schedule.rank_of(s)
        first, want = rank_mesh.setdefault(r, (s, mesh))
        if mesh != want:
            raise ValueError(f"stages[{s}]: {schedule.name} runs stage {s} on rank {r} with "
                             f"stage {first}, so it needs stage {first}'s mesh {want!r}, got "
                             f"{mesh!r}")
        for dev in mesh.device_ids:
            if dev >= cluster.num_devices:
                raise ClusterError(f"stages[{s}]: device {dev} is outside the cluster "
                                   f"(devices 0..{cluster.num_devices - 1})")
            other, t = owner.setdefault(dev, (r, s))
            if other != r:
                raise ValueError(f"stages: device {dev} is in stage {t} and stage {s}, which "
                                 f"run on different ranks ({other} and {r}); meshes of "
                                 "different ranks must be disjoint (one compute stream per "
                                 "device)")


def _check_inputs(stages, boundaries, schedule, cluster) -> None:
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule: expected a Schedule, got {type(schedule).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
    if not stages:
        raise ValueError("stages: need at least one stage mesh")
    if schedule.num_stages != len(stages):
        raise ValueError(f"schedule: built for {schedule.num_stages} stages, but {len(stages)} "
                         "stage meshes were given")
    _check_meshes(stages, schedule, cluster)
    if len(boundaries) != len(stages) - 1:
        raise ValueError(f"boundaries: {len(stages)} stages need {len(stages) - 1} boundaries, "
                         f"got {len(boundaries)}")
    for s, group in enumerate(boundaries):
        _check_group(group, f"boundaries[{s}]")
        for e, b in enumerate(elements(group)):
            name = f"boundaries[{s}][{e}]" if isinstance(group, tuple) else f"boundaries[{s}]"
            check_nbytes(check_shape(b.shape, argument=f"{name}.shape"),
                         check_dtype(b.dtype, f"{name}.dtype"), f"{name}.shape")
            if b.producer.mesh != stages[s]:
                raise ValueError(f"{name}.producer: its mesh {b.producer.mesh!r} is not "
                                 f"stage {s}'s mesh {stages[s]!r}")
            if b.consumer.mesh != stages[s + 1]:
                raise ValueError(f"{name}.consumer: its mesh {b.consumer.mesh!r} is not "
                                 f"stage {s + 1}'s mesh {stages[s + 1]!r}")
