"""What each boundary of a pipeline costs: the planner's plan against its lower bound."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from scheduler import (
    Boundary,
    Cluster,
    CostModel,
    PlanOptions,
    Sharding,
    lower_bound,
    plan_resharding,
)

from ..runtime import Runtime


@dataclass(frozen=True)
class BoundaryReport:
    """One boundary, one direction (``"fwd"``: the activation, producer to consumer;
    ``"bwd"``: its gradient, back): the layouts, the plan's transfers, the bytes they deliver
    per microbatch (every receiver's, inside hosts too) and those that cross the network, the
    plan's estimated seconds on the cluster, the lower bound no plan can beat, and their
    ratio (1.0 when nothing has to move)."""

    boundary: int
    direction: str
    shape: tuple[int, ...]
    dtype: str
    src: str
    dst: str
    transfers: int
    bytes: int
    network_bytes: int
    plan_seconds: float
    bound_seconds: float

    @property
    def ratio(self) -> float:
        """The plan's estimate over the lower bound (1.0: no plan could be faster)."""
        if self.bound_seconds <= 0:
            return 1.0 if self.plan_seconds <= 0 else float("inf")
        return self.plan_seconds / self.bound_seconds

    def __str__(self) -> str:
        return (f"boundary {self.boundary} {self.direction}: {self.shape} {self.dtype} "
                f"{self.src} -> {self.dst}: {self.transfers} transfers, {self.bytes} bytes "
                f"({self.network_bytes} over the network), plan {self.plan_seconds * 1e6:.1f} us, "
                f"bound {self.bound_seconds * 1e6:.1f} us, ratio {self.ratio:.3f}")


def report_boundary(index: int, b: Boundary, cluster: Cluster,
                    options: PlanOptions | None = None) -> tuple[BoundaryReport, ...]:
    """Both directions of boundary ``index`` planned on ``cluster``."""
    model = CostModel(cluster)
    rows = []
    for direction, src, dst in (("fwd", b.producer, b.consumer),
                                ("bwd", b.consumer, b.producer)):
        plan = plan_resharding(b.shape, b.dtype, src, dst, cluster, options)
        rows.append(BoundaryReport(
            index, direction, tuple(b.shape), str(b.dtype), _fmt(src), _fmt(dst),
            len(plan.transfers), sum(t.nbytes * len(t.receivers) for t in plan.transfers),
            model.network_bytes(plan), model.plan_time(plan),
            lower_bound(b.shape, b.dtype, src, dst, cluster)))
    return tuple(rows)


def cluster_of(cluster: Any) -> Cluster:
    """``cluster``: a :class:`scheduler.Cluster`, or a runtime's."""
    if isinstance(cluster, Runtime):
        cluster = cluster.cluster
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a scheduler.Cluster or an overlap.Runtime, got "
                        f"{type(cluster).__name__}")
    return cluster


def report_boundaries(boundaries: Iterable[Boundary], cluster: Cluster,
                      options: PlanOptions | None = None) -> tuple[BoundaryReport, ...]:
    """Every boundary's two directions (:func:`report_boundary`), in order."""
    return tuple(row for i, b in enumerate(boundaries)
                 for row in report_boundary(i, b, cluster, options))


def _fmt(sharding: Sharding) -> str:
    mesh = sharding.mesh
    return f"{sharding.spec!r} on {mesh.shape} {list(mesh.device_ids)}"


__all__ = ["BoundaryReport", "cluster_of", "report_boundaries", "report_boundary"]
