"""scheduler — the pure planner/compiler of ``overlap``: no GPU, no asyncio, no I/O.

Cluster, meshes and shardings; the cross-mesh resharding planner; the cost model and the
physical lower bound; pipeline schedules, their lowering to per-device stream programs, the
validator and the discrete-event simulator. See DESIGN.md and docs/architecture.md.
"""

from __future__ import annotations

from .balance import BALANCES
from .cluster import Cluster
from .cost import CostModel, lower_bound_for, paper_model_time
from .errors import ClusterError, PlanError, ShardingError
from .mesh import DeviceMesh
from .plan import ReshardPlan, Transfer
from .planner import STRATEGIES, plan_resharding
from .programs import (
    Boundary,
    Compute,
    DeviceProgram,
    ProgramError,
    Programs,
    Record,
    Reshard,
    Wait,
    lower,
    validate,
)
from .regions import Region
from .schedules import SCHEDULES, Action, Schedule, make_schedule
from .sharding import P, Replicate, Shard, Sharding, ShardingSpec
from .simulator import Span, Timeline, simulate


def lower_bound(shape, dtype, src: Sharding, dst: Sharding, cluster: Cluster) -> float:
    """Seconds no resharding plan can beat on ``cluster`` (see :func:`cost.lower_bound_for`)."""
    return lower_bound_for(shape, dtype, src, dst, cluster)


__all__ = [
    "BALANCES",
    "SCHEDULES",
    "STRATEGIES",
    "Action",
    "Boundary",
    "Cluster",
    "ClusterError",
    "Compute",
    "CostModel",
    "DeviceMesh",
    "DeviceProgram",
    "P",
    "PlanError",
    "ProgramError",
    "Programs",
    "Record",
    "Region",
    "Replicate",
    "Reshard",
    "ReshardPlan",
    "Schedule",
    "Shard",
    "Sharding",
    "ShardingError",
    "ShardingSpec",
    "Span",
    "Timeline",
    "Transfer",
    "Wait",
    "lower",
    "lower_bound",
    "make_schedule",
    "paper_model_time",
    "plan_resharding",
    "simulate",
    "validate",
]
