"""Resharding a whole state at once (an RL weight refit): many tensors, one plan.

:func:`plan_state_resharding` builds several candidate plans of the whole state
(:mod:`scheduler.state_candidates`) and keeps the one the cost model times fastest:

- **joint**: per tensor, :func:`~scheduler.tasks.unit_tasks` and the planner's decomposition
  into local work and *sends* (boxes that must cross the network, any source replica a
  candidate sender, a destination's replicas reached by one chained broadcast under the
  default strategy); then ONE balancing (:func:`~scheduler.balance.balance_sends`) over the
  union of every tensor's sends, after the union of their local work;
- **joint-paced**: the same decomposition (long chains to a replicated destination cut per
  host), each send whole from its least-loaded holder, then *paced*: each tensor's transfers
  in rounds that share no device, whole tensors spread over the lanes by load, each lane's
  rounds rotated so that at any moment the lanes reach different receivers
  (:func:`~scheduler.state_candidates.paced_entries`); launched in its own estimated start
  order, so costed with one run of the cost model;
- with ``StateOptions(per_tensor=True)`` only (one full plan per distinct tensor: seconds
  each): **per-tensor**, every tensor's own :func:`~scheduler.planner.plan_resharding` plan
  (with the same options), one after another — so the kept plan is never slower, under the
  cost model, than planning tensor by tensor, bucketed the same way — and
  **per-tensor-interleaved**, the same plans, those of tensors whose sources are on different
  hosts (pipeline stages) side by side, each group at the same pace.

Identical tensors (same shape, dtype, specs and mesh shapes, devices the same up to a renaming
of hosts) are planned once: their unit tasks and plans are renamed copies, exact in cost.

Each candidate's transfers larger than a bucket are first cut into parts that fit (one that
cannot be cut small enough — a row longer than the bucket — is listed in
:attr:`StateReshardPlan.oversized`); they are launched in the order they start when the cost
model runs them unconstrained; that launch order is cut into *buckets* in which no device
stages more than :attr:`StateOptions.bucket_bytes` bytes.

**Memory guarantee.** A device stages (sends from, or receives into, a buffer) the bytes of
every transfer it takes part in except local copies. The **staging window**
(:func:`staging_window`, enforced by :meth:`StateReshardPlan.schedule` and
:func:`state_graph`) makes each staged transfer wait, on each of its devices, until every
transfer that device launched before the longest run of its transfers (ending with this one)
that fits in ``bucket_bytes`` has ended. So at no moment does a device have more than
``bucket_bytes`` staged bytes started and not finished — or a single oversized transfer,
which runs alone. :attr:`StateReshardPlan.peak_staging_bytes` gives, per device, the most
any of its windows holds (at most ``bucket_bytes`` but for an oversized transfer). Unlike a
barrier between buckets, a device never drains its lanes to start the next part.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .cluster import Cluster
from .cost import CostModel, lower_bound_of_tasks, ratio_text
from .dtypes import check_dtype
from .errors import ClusterError, PlanError, ShardingError, load_json
from .graph import COMPUTE, Dep, Op, StepGraph, TransferOp, lane_stream, lanes_of
from .plan import ReshardPlan, Transfer, fmt_bytes
from .planner import PlanOptions, check_nbytes
from .regions import is_empty, split_region, volume
from .sharding import Sharding, check_shape
from .state_candidates import (
    concatenated,
    interleaved,
    joint_entries,
    paced_entries,
    per_tensor_plans,
    plans_of,
    state_tasks,
    tensor_classes,
)
from .tasks import check_fits, unit_tasks

DEFAULT_BUCKET_BYTES = 256 << 20

Key = tuple[str, int]  # (tensor name, index of the transfer in that tensor's plan)


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a state: its global ``shape`` and ``dtype``, where it is (``src``) and
    where it must go (``dst``). Any meshes: disjoint, overlapping or the same devices."""

    shape: tuple[int, ...]
    dtype: str
    src: Sharding
    dst: Sharding

    def __post_init__(self) -> None:
        shape = check_shape(self.shape)
        dt = check_dtype(self.dtype)
        check_nbytes(shape, dt)
        for name in ("src", "dst"):
            value = getattr(self, name)
            if not isinstance(value, Sharding):
                raise TypeError(f"{name}: expected a Sharding, got {type(value).__name__}")
            try:
                value.device_regions(shape)
            except ShardingError as exc:
                raise ShardingError(f"{name}: {exc}") from None
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dt.name)

    @property
    def nbytes(self) -> int:
        """The tensor's bytes."""
        return math.prod(self.shape) * check_dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "src": self.src.to_json(),
                "dst": self.dst.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StateTensor:
        return cls(tuple(int(n) for n in data["shape"]), str(data["dtype"]),
                   Sharding.from_json(data["src"]), Sharding.from_json(data["dst"]))


@dataclass(frozen=True)
class StateOptions(PlanOptions):
    """The planner's :class:`~scheduler.planner.PlanOptions` plus ``bucket_bytes``: the most
    bytes of staged (non-local) transfers a device has started and not finished at any
    moment (the staging window), so the most extra memory it needs (256 MiB by default);
    and ``per_tensor``: also build the per-tensor candidates (every distinct tensor planned
    alone by :func:`~scheduler.planner.plan_resharding`, at the full ``budget`` each), so
    that the kept plan is never slower than planning tensor by tensor — at the price of one
    full plan per distinct tensor (seconds each), hence off by default. ``budget`` goes to
    the joint balancing (and to each per-tensor plan)."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    per_tensor: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        b = self.bucket_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"bucket_bytes: expected an int >= 1, got {b!r}")
        if not isinstance(self.per_tensor, bool):
            raise TypeError(f"per_tensor: expected a bool, got {self.per_tensor!r}")

    def __str__(self) -> str:
        return (f"{super().__str__()}, buckets of {fmt_bytes(self.bucket_bytes)}"
                + (", per-tensor candidates" if self.per_tensor else ""))


@dataclass(frozen=True)
class StateReshardPlan:
    """Every tensor's transfers, chosen jointly, and the buckets they launch in.

    ``plans[name]`` is the tensor's own :class:`~scheduler.plan.ReshardPlan` (its transfers
    in the tensor's launch order; ``after`` names transfers of the same tensor only).
    ``buckets``: the launch order of the whole state, cut into buckets (in none does a
    device stage more than ``bucket_bytes``), each a tuple of ``(tensor name, transfer
    index)``. The figures are those of the cluster it was planned for: ``bound_seconds``
    (:func:`state_lower_bound`), ``estimate_seconds`` (the cost model running
    :meth:`schedule`), ``network_bytes`` (each transfer's bytes times its inter-host hops)
    and ``peak_staging_bytes`` (device -> the most staged bytes it can have in flight:
    :func:`staging_window`). ``stats``: which candidate was kept (``choice``), every
    candidate's estimate (``candidates``; ``inf`` for one screened out: its run passed the
    best estimate of those costed before it and was stopped there), the classes of
    identical tensors.
    """

    tensors: Mapping[str, StateTensor]
    plans: Mapping[str, ReshardPlan]
    buckets: tuple[tuple[Key, ...], ...]
    bucket_bytes: int
    bound_seconds: float
    estimate_seconds: float
    network_bytes: int
    peak_staging_bytes: Mapping[int, int]
    stats: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("tensors", "plans", "peak_staging_bytes", "stats"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    __hash__ = None  # type: ignore[assignment]  # (mappings inside: compared, not hashed)

    @property
    def ratio(self) -> float:
        """``estimate_seconds / bound_seconds`` (nan when the bound is 0: nothing moves)."""
        return self.estimate_seconds / self.bound_seconds if self.bound_seconds > 0 else math.nan

    @property
    def nbytes(self) -> int:
        """Bytes delivered, every receiver counted (local copies included)."""
        return sum(p.nbytes for p in self.plans.values())

    @property
    def num_transfers(self) -> int:
        return sum(len(p.transfers) for p in self.plans.values())

    @property
    def oversized(self) -> tuple[Key, ...]:
        """Staged transfers larger than a bucket (each alone in its bucket): none unless a
        box could not be cut small enough."""
        return tuple(k for b in self.buckets for k in b
                     if _staged(self._transfer(k)) > self.bucket_bytes)

    def _transfer(self, key: Key) -> Transfer:
        return self.plans[key[0]].transfers[key[1]]

    @property
    def launch_order(self) -> tuple[Key, ...]:
        """Every transfer of the state, bucket by bucket: op ``g`` of :func:`state_graph`
        runs ``launch_order[g]``."""
        return tuple(k for b in self.buckets for k in b)

    def bucket_nbytes(self, k: int) -> int:
        """Bytes of the staged transfers of bucket ``k``."""
        return sum(_staged(self._transfer(key)) for key in self.buckets[k])

    def bucket_device_nbytes(self, k: int) -> dict[int, int]:
        """Device -> the bytes it stages in bucket ``k`` (each at most ``bucket_bytes``
        unless the bucket is one transfer)."""
        staged: dict[int, int] = {}
        for key in self.buckets[k]:
            t = self._transfer(key)
            if not t.is_local_copy:
                for d in t.devices:
                    staged[d] = staged.get(d, 0) + t.nbytes
        return staged

    # ---- running ---------------------------------------------------------------------------

    def schedule(self) -> list[tuple[Key, Transfer]]:
        """The whole state's transfers in launch order, each with ``after`` in indices of
        this list: its plan's own ``after``, plus the staging window's waits
        (:func:`staging_window`: a device starts a staged transfer only once the bytes it
        has started and not finished, this one included, fit in ``bucket_bytes``)."""
        transfers = [self._transfer(key) for key in self.launch_order]
        return self._scheduled(transfers, staging_window(transfers, self.bucket_bytes)[0])

    def _scheduled(self, transfers: Sequence[Transfer],
                   window: Sequence[Sequence[tuple[int, int]]]) -> list[tuple[Key, Transfer]]:
        """:meth:`schedule`, given the launch order's transfers and their staging window
        (planning has it already: computing it is a pass over every transfer's devices)."""
        order = self.launch_order
        position = {key: g for g, key in enumerate(order)}
        out: list[tuple[Key, Transfer]] = []
        for g, (key, t) in enumerate(zip(order, transfers)):
            deps = {position[(key[0], j)] for j in t.after}
            deps.update(j for j, _ in window[g])
            out.append((key, Transfer(t.region, t.sender, t.receivers, t.nbytes,
                                      tuple(sorted(deps)), t.lane)))
        return out

    # ---- invariants ------------------------------------------------------------------------

    def check(self) -> None:
        """Raise :class:`PlanError` unless every tensor's plan delivers each element of its
        destination exactly once (:meth:`ReshardPlan.check`), the plans are those of the
        tensors, the buckets launch every transfer once, each tensor's in its plan's order,
        and in no bucket a device stages more than ``bucket_bytes`` bytes unless the bucket
        is one transfer (listed in :attr:`oversized`)."""
        if set(self.plans) != set(self.tensors):
            raise PlanError(f"plans for {sorted(self.plans)} but tensors {sorted(self.tensors)}")
        for name, plan in self.plans.items():
            t = self.tensors[name]
            if (plan.shape, plan.dtype, plan.src, plan.dst) != (t.shape, t.dtype, t.src, t.dst):
                raise PlanError(f"tensor {name!r}: its plan is for another shape or layout")
            try:
                plan.check()
            except PlanError as exc:
                raise PlanError(f"tensor {name!r}: {exc}") from None
        nxt = dict.fromkeys(self.plans, 0)
        for b, bucket in enumerate(self.buckets):
            for name, i in bucket:
                if nxt.get(name) != i:
                    raise PlanError(f"bucket {b}: ({name!r}, {i}) out of order (expected "
                                    f"transfer {nxt.get(name)} of {name!r} next)")
                nxt[name] = i + 1
            if len(bucket) == 1:
                continue
            for d, size in self.bucket_device_nbytes(b).items():
                if size > self.bucket_bytes:
                    raise PlanError(f"bucket {b}: device {d} stages {size} bytes in "
                                    f"{len(bucket)} transfers, more than "
                                    f"bucket_bytes={self.bucket_bytes}")
        for name, plan in self.plans.items():
            if nxt[name] != len(plan.transfers):
                raise PlanError(f"tensor {name!r}: transfers {nxt[name]}.. are in no bucket")

    # ---- reporting -------------------------------------------------------------------------

    def to_text(self) -> str:
        """A summary: tensors, bytes, buckets, the bound, the estimate and their ratio."""
        total = sum(t.nbytes for t in self.tensors.values())
        peak = max(self.peak_staging_bytes.values(), default=0)
        over = self.oversized
        lines = [
            f"StateReshardPlan: {len(self.tensors)} tensors, {fmt_bytes(total)}, "
            f"{self.num_transfers} transfers in {len(self.buckets)} buckets of at most "
            f"{fmt_bytes(self.bucket_bytes)} per device",
            f"  bytes delivered {fmt_bytes(self.nbytes)}, over the network "
            f"{fmt_bytes(self.network_bytes)}",
            f"  peak staging {fmt_bytes(peak)} per device (on "
            f"{sum(v == peak for v in self.peak_staging_bytes.values())} of "
            f"{len(self.peak_staging_bytes)} staging devices)",
            f"  estimate {self.estimate_seconds * 1e3:.3f} ms, lower bound "
            f"{self.bound_seconds * 1e3:.3f} ms, "
            + ratio_text(self.estimate_seconds, self.bound_seconds,
                         (0,) if not total else (1,)),
        ]
        if over:
            lines.append(f"  {len(over)} transfer(s) larger than a bucket, each alone: "
                         + ", ".join(f"{n}[{i}]" for n, i in over[:5])
                         + (" ..." if len(over) > 5 else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    def to_json(self) -> str:
        """The whole plan as JSON text (:meth:`from_json` reads it back)."""
        return json.dumps({
            "tensors": {n: t.to_json() for n, t in self.tensors.items()},
            "plans": {n: json.loads(p.to_json()) for n, p in self.plans.items()},
            "buckets": [[[n, i] for n, i in b] for b in self.buckets],
            "bucket_bytes": self.bucket_bytes,
            "bound_seconds": self.bound_seconds,
            "estimate_seconds": self.estimate_seconds,
            "network_bytes": self.network_bytes,
            "peak_staging_bytes": {str(d): v for d, v in self.peak_staging_bytes.items()},
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> StateReshardPlan:
        """The plan ``text`` (from :meth:`to_json`) describes; ValueError naming what is
        wrong with it (read only: :meth:`check` says whether it is correct)."""
        return load_json(text, "state plan JSON", cls._from_data)

    @classmethod
    def _from_data(cls, data: dict[str, Any]) -> StateReshardPlan:
        return cls(
            tensors={str(n): StateTensor.from_json(t) for n, t in data["tensors"].items()},
            plans={str(n): ReshardPlan._from_data(p) for n, p in data["plans"].items()},
            buckets=tuple(tuple((str(n), int(i)) for n, i in b) for b in data["buckets"]),
            bucket_bytes=int(data["bucket_bytes"]),
            bound_seconds=float(data["bound_seconds"]),
            estimate_seconds=float(data["estimate_seconds"]),
            network_bytes=int(data["network_bytes"]),
            peak_staging_bytes={int(d): int(v) for d, v in data["peak_staging_bytes"].items()},
        )


def _staged(t: Transfer) -> int:
    """Bytes a transfer stages (a local copy goes shard to shard: none)."""
    return 0 if t.is_local_copy else t.nbytes


# ---- planning ------------------------------------------------------------------------------


def _check_state(tensors: object, cluster: object, options: object
                 ) -> tuple[dict[str, StateTensor], StateOptions]:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors: expected a mapping of names to StateTensor, got "
                        f"{type(tensors).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
    if options is None:
        options = StateOptions()
    elif type(options) is PlanOptions:
        options = StateOptions(options.strategy, options.balance, options.seed, options.budget)
    elif not isinstance(options, StateOptions):
        raise TypeError(f"options: expected a StateOptions, got {type(options).__name__}")
    out: dict[str, StateTensor] = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensors: names are non-empty strings, got {name!r}")
        if not isinstance(t, StateTensor):
            raise TypeError(f"tensors[{name!r}]: expected a StateTensor, got {type(t).__name__}")
        for side in ("src", "dst"):
            try:
                check_fits(getattr(t, side), cluster, argument=side)
            except ClusterError as exc:
                raise ClusterError(f"tensors[{name!r}].{exc}") from None
        out[name] = t
    return out, options


def state_lower_bound(tensors: Mapping[str, StateTensor], cluster: Cluster) -> float:
    """Seconds no plan of the whole state can beat on ``cluster``.

    :func:`~scheduler.cost.lower_bound_for` with every term summed over the tensors before
    the largest is taken (:func:`~scheduler.cost.lower_bound_of_tasks`): the larger of::

        max( max over destination hosts h:  Σ_tensors in_h  / (NICs per host × NIC rate),
             max over holder-host sets S:   Σ_tensors out_S / (|S| × NICs per host × NIC rate) )
        + one network latency (when anything crosses hosts),
        max over destination GPUs g:   Σ_tensors in_g  / (NVLink rate + NIC rate)
        + the least latency of a hop

    where ``in_h`` is the bytes host h's devices need that no source device on h holds,
    ``in_g`` the bytes GPU g needs and does not hold, and ``out_S`` the bytes held only on
    hosts within S and needed on a host outside it.
    """
    tensors, _ = _check_state(tensors, cluster, None)
    return lower_bound_of_tasks(
        (unit_tasks(t.shape, t.dtype, t.src, t.dst, cluster) for t in tensors.values()), cluster)


def plan_state_resharding(
    tensors: Mapping[str, StateTensor],
    cluster: Cluster,
    options: StateOptions | None = None,
) -> StateReshardPlan:
    """Plan resharding every tensor of ``tensors`` (name -> :class:`StateTensor`) on
    ``cluster`` at once: senders and NICs balanced over the whole state, transfers in buckets
    of at most ``options.bucket_bytes`` (see the module doc). Input errors name the argument
    and are raised before any planning."""
    state, options = _check_state(tensors, cluster, options)
    items = list(state.values())
    classes = tensor_classes(items, cluster)
    task_lists = state_tasks(items, classes, cluster)
    itemsizes = [check_dtype(t.dtype).itemsize for t in items]
    model = CostModel(cluster)
    joint, stats = joint_entries(task_lists, itemsizes, cluster, options)
    paced, paced_stats = paced_entries(task_lists, itemsizes, cluster, options)
    stats.update(paced_stats)
    # (label, entries, whether to launch in the order they start unconstrained: the paced
    # candidate is already in its estimated start order)
    candidates = [("joint-paced", paced, False), ("joint", joint, True)]
    if options.per_tensor:
        alone = per_tensor_plans(items, classes, cluster, options)
        candidates += [("per-tensor", concatenated(alone), True),
                       ("per-tensor-interleaved", interleaved(alone, items, cluster), True)]
    best: tuple[float, str, StateReshardPlan] | None = None
    estimates: dict[str, float] = {}
    for label, entries, by_start in candidates:
        # Screening: a candidate whose run passes the best estimate so far is dropped there
        # (its estimate reads inf): the paced one, costed first, is often the best.
        plan = _assemble(state, entries, options, model, by_start,
                         until=math.inf if best is None else best[0])
        estimates[label] = math.inf if plan is None else plan.estimate_seconds
        if plan is not None and (best is None or plan.estimate_seconds < best[0]):
            best = (plan.estimate_seconds, label, plan)
    assert best is not None
    _, choice, plan = best
    return dataclasses.replace(
        plan, bound_seconds=lower_bound_of_tasks(task_lists, cluster),
        stats={**stats, "options": str(options), "choice": choice,
               "candidates": estimates, "tensor_classes": len(classes)})


def _assemble(state: Mapping[str, StateTensor], entries: Sequence[tuple[int, Transfer]],
              options: StateOptions, model: CostModel, by_start: bool = True,
              until: float = math.inf) -> StateReshardPlan | None:
    """A candidate's entries as a plan: staged transfers larger than a bucket cut, (when
    ``by_start``) put in the order they start unconstrained, the launch order cut into
    buckets, the transfers split back per tensor, and the estimate (the cost model running
    :meth:`StateReshardPlan.schedule`); the bound is left 0. ``None`` (a screened-out
    candidate) when a run passes ``until``: the unconstrained run of ``by_start`` — the
    staging window only adds waits, so such a candidate is all but sure to end later — or
    the plan's own run (which then ends later for certain); each stops there."""
    names = list(state)
    entries = _cut(entries, options.bucket_bytes)
    if by_start:
        entries = _by_start(entries, model, until)
        if entries is None:
            return None
    buckets_g = _buckets([t for _, t in entries], options.bucket_bytes)
    per_tensor, local_index = plans_of(entries, len(names))
    plans = {
        name: ReshardPlan(shape=t.shape, dtype=t.dtype, src=t.src, dst=t.dst,
                          transfers=tuple(per_tensor[k]), strategy=options.strategy,
                          balance=options.balance)
        for k, (name, t) in enumerate(state.items())
    }
    buckets = tuple(tuple((names[entries[g][0]], local_index[g]) for g in b) for b in buckets_g)
    # (The launch order is ``entries``' order: buckets are consecutive runs of it.)
    transfers = [t for _, t in entries]
    window, peak = staging_window(transfers, options.bucket_bytes)
    draft = StateReshardPlan(state, plans, buckets, options.bucket_bytes, 0.0, 0.0, 0, peak)
    schedule = [t for _, t in draft._scheduled(
        [draft._transfer(key) for key in draft.launch_order], window)]
    ends = [x.end for x in model.run(schedule, until=until)]
    if any(e != e for e in ends):  # nan: not ended by ``until``
        return None
    est = max(ends, default=0.0)
    net = sum(t.nbytes * sum(h.network for h in model.chain(t.sender, t.receivers))
              for t in schedule)
    return dataclasses.replace(draft, estimate_seconds=est, network_bytes=net)


def state_graph(plan: StateReshardPlan, stream: str = "comm") -> StepGraph:
    """The step graph of a whole-state resharding: one :class:`~scheduler.graph.TransferOp`
    per transfer, in :attr:`StateReshardPlan.launch_order` (op ``g``'s ``index`` is ``g``;
    its tensor and transfer are ``launch_order[g]``), each on its lane's stream.

    Waits: each transfer's ``after`` within its tensor (as :func:`~scheduler.reshard_graph`
    makes them: on the sender, for what it forwards or for its NIC's order), and the
    **staging window** (:func:`staging_window`): on each device, a staged transfer waits, on
    that device, for the last transfer of each of its other streams before its window, so
    a device never has more than ``bucket_bytes`` staged bytes started and not finished
    (:attr:`StateReshardPlan.peak_staging_bytes`), and no device ever drains its streams at
    a bucket's end. Every wait names an earlier op, so the graph cannot deadlock."""
    if not isinstance(plan, StateReshardPlan):
        raise TypeError(f"plan: expected a StateReshardPlan, got {type(plan).__name__}")
    if not isinstance(stream, str) or not stream or stream == COMPUTE \
            or re.fullmatch(r".*\.\d+", stream):
        raise ValueError(f"stream: expected a comm stream name other than {COMPUTE!r}, not "
                         f"ending like a lane's (<name>.<lane>), got {stream!r}")
    order = plan.launch_order
    position = {key: g for g, key in enumerate(order)}
    transfers = [plan.plans[name].transfers[i] for name, i in order]
    window, _ = staging_window(transfers, plan.bucket_bytes)
    ops: list[Op] = []
    for g, ((name, _i), t) in enumerate(zip(order, transfers)):
        waits: dict[Dep, None] = {}
        for j in t.after:
            earlier = plan.plans[name].transfers[j]
            src = t.sender if t.sender in earlier.devices else earlier.sender
            waits[Dep(position[(name, j)], src, t.sender)] = None
        for j, d in window[g]:
            waits[Dep(j, d, d)] = None
        ops.append(Op(g, TransferOp(None, 0, g, t), lane_stream(stream, t), t.devices,
                      tuple(waits)))
    return StepGraph(tuple(ops), lanes_of(ops))


def staging_window(transfers: Sequence[Transfer], cap: int
                   ) -> tuple[list[list[tuple[int, int]]], dict[int, int]]:
    """The staging window: for each transfer of a launch order, the ``(earlier transfer,
    device)`` pairs it waits for so that no device has more than ``cap`` staged bytes
    started and not finished.

    On each device, a staged transfer (not a local copy, which goes shard to shard) waits
    until every transfer of that device before its *window* has ended: the window is the
    longest run of the device's transfers ending with this one whose staged bytes fit in
    ``cap`` (just this one when it alone is larger: an oversized transfer runs alone). It
    waits, on each of the device's other lanes, for that lane's last transfer before the
    window (its own lane is FIFO anyway). At any moment, then, what a device has started
    and not finished lies in the window of the last transfer it started: at most ``cap``
    bytes, or one oversized transfer. Unlike a barrier between buckets, a device never
    drains: while its slowest lane ends one part, its other lanes already move the next.

    Returns the waits of each transfer and, per device, the most staged bytes any of its
    windows holds: the most it can have in flight (its peak staging memory)."""
    out: list[list[tuple[int, int]]] = [[] for _ in transfers]
    peak: dict[int, int] = {}
    mine: dict[int, list[int]] = defaultdict(list)  # device -> its transfers so far
    start: dict[int, int] = defaultdict(int)  # device -> index in mine where its window begins
    inflight: dict[int, int] = defaultdict(int)  # device -> staged bytes from there on
    ended: dict[int, dict[int, int]] = defaultdict(dict)  # device -> lane -> last before it
    waited: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)  # (device, lane) -> ...
    for g, t in enumerate(transfers):
        b = _staged(t)
        for d in t.devices:
            mine[d].append(g)
            if not b:
                continue
            seq, lo = mine[d], start[d]
            inflight[d] += b
            while lo < len(seq) - 1 and (inflight[d] > cap or b > cap):
                inflight[d] -= _staged(transfers[seq[lo]])
                ended[d][transfers[seq[lo]].lane] = seq[lo]
                lo += 1
            start[d] = lo
            peak[d] = max(peak.get(d, 0), inflight[d])
            done = waited[(d, t.lane)]
            for lane, j in ended[d].items():
                if lane != t.lane and j > done.get(lane, -1):
                    out[g].append((j, d))
                    done[lane] = j
    return out, peak


def _by_start(entries: Sequence[tuple[int, Transfer]], model: CostModel,
              until: float = math.inf) -> list[tuple[int, Transfer]] | None:
    """The entries in the order they start when the cost model runs them with no staging
    limit (``after`` renumbered). The staging window makes a transfer wait for everything
    its devices launched before its window; in this order a device's transfers are listed
    as they would start, so a transfer listed early but held up (its sender busy on another
    lane) does not hold back the many listed after it. ``None`` when that run passes
    ``until`` (stopped there)."""
    if not entries:
        return []
    timings = model.run([t for _, t in entries], until=until)
    if any(x.end != x.end for x in timings):  # passed ``until``: None
        return None
    order = sorted(range(len(entries)), key=lambda g: (timings[g].start, g))
    position = {g: n for n, g in enumerate(order)}
    return [(entries[g][0], dataclasses.replace(
                entries[g][1], after=tuple(sorted(position[a] for a in entries[g][1].after))))
            for g in order]


def _cut(entries: Sequence[tuple[int, Transfer]], cap: int) -> list[tuple[int, Transfer]]:
    """Every staged transfer larger than ``cap`` bytes cut into parts along its longest dim
    (same sender, receivers and lane); ``after`` renumbered, naming every part of a cut one."""
    parts_of: list[list[int]] = []
    out: list[tuple[int, Transfer]] = []
    for k, t in entries:
        after = tuple(j for a in t.after for j in parts_of[a])
        n = -(-_staged(t) // cap)
        if n <= 1 or not t.region:
            pieces = [t.region]
        else:
            longest = max(b - a for a, b in t.region)
            pieces = [p for p in split_region(t.region, [1.0] * min(n, longest))
                      if not is_empty(p)]
        itemsize = t.nbytes // max(1, volume(t.region))
        parts_of.append(list(range(len(out), len(out) + len(pieces))))
        out += [(k, Transfer(p, t.sender, t.receivers, volume(p) * itemsize, after, t.lane))
                for p in pieces]
    return out


def _buckets(transfers: Sequence[Transfer], cap: int) -> list[list[int]]:
    """The launch order cut into consecutive buckets in which no device stages more than
    ``cap`` bytes (a transfer larger than that alone in its own). The cap is per device —
    what bounds a device's extra memory — so a bucket of a state spread over many devices
    holds many devices' ``cap``: fewer buckets, fewer barriers."""
    out: list[list[int]] = []
    current: list[int] = []
    staged: dict[int, int] = {}
    for g, t in enumerate(transfers):
        b = _staged(t)
        if current and b and any(staged.get(d, 0) + b > cap for d in t.devices):
            out.append(current)
            current, staged = [], {}
        if b > cap:  # oversized: alone
            out.append([g])
            continue
        current.append(g)
        if b:
            for d in t.devices:
                staged[d] = staged.get(d, 0) + b
    if current:
        out.append(current)
    return out


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "StateOptions",
    "StateReshardPlan",
    "StateTensor",
    "plan_state_resharding",
    "staging_window",
    "state_graph",
    "state_lower_bound",
]
