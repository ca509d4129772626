"""The resharding plan: a value listing transfers in launch order."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .dtypes import check_dtype
from .errors import PlanError, load_json
from .plan_check import Budget, check_delivered, holds
from .regions import Region, contains, fmt_region, intersect, volume
from .sharding import Sharding


@dataclass(frozen=True)
class Transfer:
    """Send ``region`` from ``sender`` to every device in ``receivers``.

    One receiver is a point-to-point copy; several are one (pipelined, chained) broadcast.
    ``receivers == (sender,)`` is a local copy from the device's source shard into its
    destination buffer. ``after`` names earlier transfers (plan indices) that must end before
    this one starts, beyond the FIFO order of each device's stream: the planner uses it to
    keep a NIC serving one transfer at a time where its schedule says so (a runtime waits on
    their completion events; on the sender's own part of a transfer it took part in).

    ``lane``: the comm stream of each participant that runs it — transfers on different
    lanes of a device run side by side (as NCCL operations on different streams do), so a
    device that receives many small pieces from different senders pays their latencies at
    once instead of one after another; the transfers of one lane run in plan order. A sender
    that forwards what an earlier transfer brought it must be on that transfer's lane or
    name it in ``after`` (:meth:`ReshardPlan.check`).
    """

    region: Region
    sender: int
    receivers: tuple[int, ...]
    nbytes: int
    after: tuple[int, ...] = ()
    lane: int = 0

    @property
    def is_local_copy(self) -> bool:
        """Whether the sender is the only receiver: a copy within one device."""
        return self.receivers == (self.sender,)

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device taking part, sender first."""
        if self.is_local_copy:
            return (self.sender,)
        return (self.sender, *self.receivers)

    def to_json(self) -> dict[str, Any]:
        """The transfer as a JSON-ready dict."""
        return {
            "region": [list(p) for p in self.region],
            "sender": self.sender,
            "receivers": list(self.receivers),
            "nbytes": self.nbytes,
            **({"after": list(self.after)} if self.after else {}),
            **({"lane": self.lane} if self.lane else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Transfer:
        """A transfer from :meth:`to_json`'s dict."""
        return cls(
            region=tuple((int(a), int(b)) for a, b in data["region"]),
            sender=int(data["sender"]),
            receivers=tuple(int(r) for r in data["receivers"]),
            nbytes=int(data["nbytes"]),
            after=tuple(int(j) for j in data.get("after", ())),
            lane=int(data.get("lane", 0)),
        )

    def __str__(self) -> str:
        if self.is_local_copy:
            return f"copy {fmt_region(self.region)} on {self.sender} ({self.nbytes} B)"
        to = ",".join(map(str, self.receivers))
        dep = f" after {','.join(map(str, self.after))}" if self.after else ""
        lane = f" lane {self.lane}" if self.lane else ""
        return f"{fmt_region(self.region)} {self.sender} -> {to} ({self.nbytes} B){dep}{lane}"


PLAN_LANES = 8  # = the planner's MAX_LANES (scheduler/balance.py): comm streams per device


@dataclass(frozen=True)
class ReshardPlan:
    """Transfers, in launch order, that move a tensor from layout ``src`` to layout ``dst``."""

    shape: tuple[int, ...]
    dtype: str
    src: Sharding
    dst: Sharding
    transfers: tuple[Transfer, ...]
    strategy: str
    balance: str
    # How the plan was found (e.g. which auto candidate won); not part of the plan's value.
    stats: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stats", MappingProxyType(dict(self.stats)))

    def __hash__(self) -> int:
        # Computed once (the runtime looks a plan up on every call; a plan of many transfers
        # costs as many hashes), never pickled (string hashes differ between processes).
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.shape, self.dtype, self.src, self.dst, self.transfers,
                      self.strategy, self.balance))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        state["stats"] = dict(state["stats"])  # (a mappingproxy does not pickle)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, stats=MappingProxyType(state["stats"]))

    @property
    def itemsize(self) -> int:
        """Bytes per element of the plan's dtype."""
        return check_dtype(self.dtype, "plan dtype").itemsize

    @property
    def nbytes(self) -> int:
        """Bytes moved, counting each receiver of a broadcast once (local copies included)."""
        return sum(t.nbytes * len(t.receivers) for t in self.transfers)

    # ---- invariants ----------------------------------------------------------------------

    def check(self) -> None:
        """Raise :class:`PlanError` unless the plan is correct.

        Every sender holds the whole region when its transfer starts (from the source layout
        or an earlier transfer), and afterwards every destination device has received exactly
        its destination region, each element once. Exact, by box arithmetic
        (:mod:`scheduler.plan_check`): time and memory in proportion to the transfers, however
        large the tensor or finely its regions cut it; a plan that would need more than
        :data:`~scheduler.plan_check.MAX_CHECK_WORK` box operations is refused.
        """
        rank = len(self.shape)
        src_regions = self.src.device_regions(self.shape)
        dst_regions = self.dst.device_regions(self.shape)
        _check_ranks(self.transfers, rank)  # (before anything indexes by dimension)
        budget, itemsize = Budget(), self.itemsize
        got: dict[int, list[tuple[int, int, Region]]] = {}  # device -> (i, lane, region)
        for i, t in enumerate(self.transfers):
            if t.nbytes != volume(t.region) * itemsize:
                raise PlanError(f"transfer {i} ({t}): nbytes != region volume × itemsize")
            if any(not 0 <= j < i for j in t.after):
                raise PlanError(f"transfer {i} ({t}): 'after' must name earlier transfers")
            if not all(0 <= a <= b <= n for (a, b), n in zip(t.region, self.shape)):
                raise PlanError(f"transfer {i} ({t}): region outside shape {self.shape}")
            own, brought = src_regions.get(t.sender), got.get(t.sender, [])
            if not holds(own, brought, t.region, budget):
                raise PlanError(f"transfer {i} ({t}): sender {t.sender} does not hold the region")
            _check_lane(i, t, own, brought, budget)
            if len(set(t.receivers)) != len(t.receivers):
                raise PlanError(f"transfer {i} ({t}): repeated receiver")
            if t.sender in t.receivers and not t.is_local_copy:
                raise PlanError(f"transfer {i} ({t}): sender also listed as a broadcast receiver")
            for r in t.receivers:
                if r not in dst_regions or not contains(dst_regions[r], t.region):
                    raise PlanError(
                        f"transfer {i} ({t}): receiver {r} does not need region "
                        f"{fmt_region(t.region)} (its destination region is "
                        f"{fmt_region(dst_regions[r]) if r in dst_regions else 'none'})"
                    )
                got.setdefault(r, []).append((i, t.lane, t.region))  # local copies too
        for dev, region in dst_regions.items():
            check_delivered(dev, region, got.get(dev, ()), budget)

    # ---- reporting -----------------------------------------------------------------------

    def summary(self) -> str:
        """What the plan moves, and how (costs: :func:`scheduler.cost.plan_report`)."""
        kinds = Counter(
            "local copy" if t.is_local_copy else ("send/recv" if len(t.receivers) == 1
                                                 else "broadcast")
            for t in self.transfers
        )
        return "\n".join([
            f"ReshardPlan {self.shape} {self.dtype}: {self.src.spec!r} on {self.src.mesh!r}",
            f"  -> {self.dst.spec!r} on {self.dst.mesh!r}",
            f"  strategy={self.strategy} balance={self.balance}: {len(self.transfers)} transfers ("
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")",
            f"  bytes delivered: {fmt_bytes(self.nbytes)}",
        ])

    def to_json(self) -> str:
        """The whole plan as JSON text (:meth:`from_json` reads it back; the runtime checks a plan
        it did not make before using it)."""
        return json.dumps(
            {
                "shape": list(self.shape),
                "dtype": self.dtype,
                "src": self.src.to_json(),
                "dst": self.dst.to_json(),
                "strategy": self.strategy,
                "balance": self.balance,
                "transfers": [t.to_json() for t in self.transfers],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> ReshardPlan:
        """The plan ``text`` (from :meth:`to_json`) describes; ValueError naming what is wrong
        with it. Read only: :meth:`check` says whether the plan itself is correct (the runtime
        checks every plan before it runs one)."""
        return load_json(text, "plan JSON", cls._from_data)

    @classmethod
    def _from_data(cls, data: dict[str, Any]) -> ReshardPlan:
        return cls(
            shape=tuple(int(n) for n in data["shape"]),
            dtype=check_dtype(str(data["dtype"]), "plan JSON dtype").name,
            src=Sharding.from_json(data["src"]),
            dst=Sharding.from_json(data["dst"]),
            transfers=tuple(Transfer.from_json(t) for t in data["transfers"]),
            strategy=data["strategy"],
            balance=data["balance"],
        )

    def __str__(self) -> str:
        return self.summary()


def _check_ranks(transfers: Sequence[Transfer], rank: int) -> None:
    for i, t in enumerate(transfers):
        if len(t.region) != rank:
            raise PlanError(f"transfer {i} ({t}): region rank != tensor rank {rank}")


def _check_lane(i: int, t: Transfer, own: Region | None,
                brought: Sequence[tuple[int, int, Region]], budget: Budget) -> None:
    """Transfer ``i`` runs on a valid lane, after every earlier transfer on another lane
    that brought its sender part of what it sends (``brought``: (index, lane, region)). A
    sender whose source region (``own``) holds the region reads that, as the runtime does:
    then no earlier transfer matters."""
    if isinstance(t.lane, bool) or not isinstance(t.lane, int) or t.lane < 0:
        raise PlanError(f"transfer {i} ({t}): lane must be an int >= 0, got {t.lane!r}")
    if t.lane >= PLAN_LANES:  # (each lane is a comm stream, a thread, on every device)
        raise PlanError(f"transfer {i} ({t}): lane {t.lane}; a plan runs on at most "
                        f"{PLAN_LANES} lanes (0..{PLAN_LANES - 1})")
    if own is not None and contains(own, t.region):
        return
    budget.spend(len(brought))
    for j, lane, where in brought:
        if lane != t.lane and j not in t.after and intersect(where, t.region) is not None:
            raise PlanError(
                f"transfer {i} ({t}): sender {t.sender} forwards what transfer {j} brought it "
                f"on lane {lane}, but runs on lane {t.lane} without waiting for it (put it on "
                f"lane {lane}, or name {j} in 'after')")


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def transfers_text(transfers: Sequence[Transfer]) -> str:
    return "\n".join(f"{i:4d}  {t}" for i, t in enumerate(transfers))
