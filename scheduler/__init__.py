"""scheduler — the pure planner/compiler of ``overlap``: no GPU, no asyncio, no I/O.

Cluster, meshes and shardings; the cross-mesh resharding planner; the cost model and the
physical lower bound. See DESIGN.md and docs/architecture.md.
"""

from __future__ import annotations

from .balance import BALANCES
from .cluster import Cluster
from .cost import CostModel, lower_bound_for, paper_model_time
from .errors import ClusterError, PlanError, ShardingError
from .mesh import DeviceMesh
from .plan import ReshardPlan, Transfer
from .planner import STRATEGIES, plan_resharding
from .regions import Region
from .sharding import P, Replicate, Shard, Sharding, ShardingSpec


def lower_bound(shape, dtype, src: Sharding, dst: Sharding, cluster: Cluster) -> float:
    """Seconds no resharding plan can beat on ``cluster`` (see :func:`cost.lower_bound_for`)."""
    return lower_bound_for(shape, dtype, src, dst, cluster)


__all__ = [
    "BALANCES",
    "STRATEGIES",
    "Cluster",
    "ClusterError",
    "CostModel",
    "DeviceMesh",
    "P",
    "PlanError",
    "Region",
    "Replicate",
    "ReshardPlan",
    "Shard",
    "Sharding",
    "ShardingError",
    "ShardingSpec",
    "Transfer",
    "lower_bound",
    "paper_model_time",
    "plan_resharding",
]
