"""Cross-mesh resharding planner: unit tasks -> strategy -> sender choice and order -> plan.

1. :func:`~scheduler.tasks.unit_tasks` cuts the tensor into boxes with their holders and
   needers.
2. Needs served without the network come first: a device that holds a box copies it locally;
   devices on a host where some device holds the box get it over NVLink from that holder.
3. The rest needs the network. The strategy turns each such box into *sends* (a region, the
   devices that could send it, its receivers): ``send_recv`` one per receiver,
   ``broadcast`` one chained broadcast to every receiver, ``local_allgather`` one slice per
   receiver of a host followed by an NVLink all-gather inside that host.
4. The balance mode (``scheduler.balance``) picks a sender for each send — possibly cutting a
   send into pieces that different holders send — and the launch order.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .balance import BALANCES, Send, balance_sends
from .cluster import Cluster
from .dtypes import check_dtype
from .plan import ReshardPlan, Transfer
from .regions import Region, is_empty, split_region, volume
from .sharding import Sharding, check_shape
from .tasks import UnitTask, unit_tasks

STRATEGIES = ("send_recv", "local_allgather", "broadcast")


@dataclass(frozen=True)
class _Decomposed:
    before: list[Transfer]  # local work that needs no network, launched first
    sends: list[Send]
    after: list[tuple[int, Region, tuple[int, ...]]]  # (send index, piece, local receivers)


@dataclass(frozen=True)
class PlanOptions:
    """How to plan a resharding: one value where four arguments used to travel.

    Attributes:
        strategy: ``"send_recv"``, ``"local_allgather"`` or ``"broadcast"`` (see module doc).
        balance: ``"none"``, ``"size"``, ``"greedy"``, ``"search"`` or ``"auto"``
            (see :mod:`scheduler.balance`).
        seed: seeds the randomized balancers; same inputs, same plan.
        budget: work units (search nodes, candidate evaluations) the balancer may spend in
            all; never wall-clock time, so a plan does not depend on machine load. (``auto``
            divides it among its candidates and among classes of independent host groups;
            600 000 gives each of its ~28 candidates about what the older
            whole-budget-per-candidate scheme gave the best ones.)
    """

    strategy: str = "broadcast"
    balance: str = "auto"
    seed: int = 0
    budget: int = 600_000

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: unknown {self.strategy!r}; choose one of {STRATEGIES}")
        if self.balance not in BALANCES:
            raise ValueError(f"balance: unknown {self.balance!r}; choose one of {BALANCES}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed: expected an int, got {self.seed!r}")
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"budget: expected an int >= 1, got {self.budget!r}")

    def __str__(self) -> str:
        return f"{self.strategy}/{self.balance} (seed {self.seed}, budget {self.budget})"


def plan_resharding(
    shape: Sequence[int],
    dtype: object,
    src: Sharding,
    dst: Sharding,
    cluster: Cluster,
    options: PlanOptions | None = None,
) -> ReshardPlan:
    """Plan moving a ``shape``/``dtype`` tensor from layout ``src`` to layout ``dst``
    (``options``: strategy, balance, seed and budget; :class:`PlanOptions` by default)."""
    options = _check_options(options)
    strategy = options.strategy
    dt = check_dtype(dtype)
    check_nbytes(check_shape(shape), dt)
    tasks = unit_tasks(shape, dt, src, dst, cluster)
    parts = _decompose(tasks, dt.itemsize, cluster, strategy)
    ordered, stats = balance_sends(parts.sends, cluster, options.balance, seed=options.seed,
                                   budget=options.budget, before=parts.before)
    transfers = list(parts.before)
    offset = len(transfers)
    for _, region, sender, receivers, after, lane in ordered:
        transfers.append(
            Transfer(region, sender, receivers, volume(region) * dt.itemsize,
                     tuple(offset + j for j in after), lane)
        )
    brought: dict[int, list[int]] = {}  # send index -> the plan's transfers of it
    for k, entry in enumerate(ordered):
        brought.setdefault(entry[0], []).append(offset + k)
    for idx, region, local in parts.after:
        # The all-gather step of local_allgather: the slice's receiver forwards it on-host,
        # once what it forwards has landed (on whichever lane that came).
        owner = parts.sends[idx].receivers[0]
        transfers.append(Transfer(region, owner, local, volume(region) * dt.itemsize,
                                  tuple(brought.get(idx, ()))))
    return ReshardPlan(
        shape=tuple(int(n) for n in shape),
        dtype=dt.name,
        src=src,
        dst=dst,
        transfers=tuple(transfers),
        strategy=strategy,
        balance=options.balance,
        stats=stats,
    )


MAX_TENSOR_BYTES = 1 << 62  # far above any device's memory; byte counts stay exact int64


def check_nbytes(shape: tuple[int, ...], dtype: np.dtype, argument: str = "shape") -> int:
    """The tensor's bytes; ValueError naming ``argument`` past :data:`MAX_TENSOR_BYTES`."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    if n > MAX_TENSOR_BYTES:
        raise ValueError(f"{argument}: {tuple(shape)} {dtype.name} is {n} bytes, more than "
                         f"{MAX_TENSOR_BYTES} (2**62): no device holds that, and byte counts "
                         "would overflow")
    return n


def _check_options(options: object) -> PlanOptions:
    if options is None:
        return PlanOptions()
    if not isinstance(options, PlanOptions):
        raise TypeError(f"options: expected a PlanOptions, got {type(options).__name__}")
    return options


class PlanCache:
    """Plans by (shape, dtype, source layout, destination layout, options) on one cluster,
    the ``size`` most recently used kept (1024 by default: a step of 64 distinct shapes on
    8 stages plans 896). Thread-safe: the runtime plans in worker threads
    (two threads asking for the same missing plan may both plan it; the plans are equal)."""

    def __init__(self, cluster: Cluster, size: int = 1024) -> None:
        if not isinstance(cluster, Cluster):
            raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size: expected an int >= 1, got {size!r}")
        self.cluster = cluster
        self.size = size
        self._plans: OrderedDict[tuple, ReshardPlan] = OrderedDict()
        self._lock = threading.Lock()

    def plan(self, shape: Sequence[int], dtype: object, src: Sharding, dst: Sharding,
             options: PlanOptions | None = None) -> ReshardPlan:
        """The plan of :func:`plan_resharding` for these arguments, made once and kept."""
        options = _check_options(options)
        key = (tuple(shape), str(dtype), src, dst, options)
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = plan_resharding(shape, dtype, src, dst, self.cluster, options)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return plan

    def __len__(self) -> int:
        return len(self._plans)


def _decompose(
    tasks: Sequence[UnitTask], itemsize: int, cluster: Cluster, strategy: str
) -> _Decomposed:
    before: list[Transfer] = []
    sends: list[Send] = []
    after: list[tuple[int, Region, tuple[int, ...]]] = []
    nvlink_load: dict[int, int] = {}
    for task in tasks:
        holders = set(task.holders)
        holder_hosts: dict[int, list[int]] = {}
        for h in task.holders:
            holder_hosts.setdefault(cluster.host_of(h), []).append(h)
        remote: dict[int, list[int]] = {}
        on_host: dict[int, list[int]] = {}
        for r in task.needers:
            if r in holders:
                before.append(Transfer(task.region, r, (r,), task.nbytes))
                continue
            host = cluster.host_of(r)
            (on_host if host in holder_hosts else remote).setdefault(host, []).append(r)
        for host, receivers in on_host.items():
            # The least-used holder on the host forwards over NVLink.
            sender = min(holder_hosts[host], key=lambda d: (nvlink_load.get(d, 0), d))
            nvlink_load[sender] = nvlink_load.get(sender, 0) + task.nbytes * len(receivers)
            groups = [(r,) for r in receivers] if strategy == "send_recv" else [tuple(receivers)]
            before += [Transfer(task.region, sender, g, task.nbytes) for g in groups]
        if not remote:
            continue
        if strategy == "broadcast":
            receivers = tuple(r for rs in remote.values() for r in rs)
            sends.append(Send(task.region, task.nbytes, task.holders, receivers))
            continue
        for receivers in remote.values():
            slices = split_region(task.region, [1.0] * len(receivers))
            if strategy == "send_recv" or len(receivers) == 1 or any(map(is_empty, slices)):
                sends += [Send(task.region, task.nbytes, task.holders, (r,)) for r in receivers]
                continue
            for i, (r, piece) in enumerate(zip(receivers, slices)):
                sends.append(Send(piece, volume(piece) * itemsize, task.holders, (r,)))
                others = tuple(receivers[:i] + receivers[i + 1 :])
                after.append((len(sends) - 1, piece, others))
    return _Decomposed(before, sends, after)
