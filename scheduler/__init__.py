"""scheduler — the planner/compiler of ``overlap``: no GPU, no asyncio.

Cluster, meshes and shardings; the cross-mesh resharding planner; the cost model and the
physical lower bound; pipeline schedules, their lowering to the step graph (typed ops on
device streams with explicit dependencies), the validator, the event kernel, the simulator
and timelines; automatic partitioning (``scheduler/partition/``). None of these reads or
writes a file; the I/O is in ``scheduler/cli/`` (the command line) and ``scheduler/traces/``
(the trace readers and reports), and at the edges the caller names: a timeline's trace file
and plot, ``Cluster.detect()``'s environment. See docs/architecture.md (the user guide:
docs/index.md).
"""

from __future__ import annotations

from .auto import AutoChoice, auto_schedule
from .balance import BALANCES
from .cluster import Cluster
from .cost import CostModel, estimate, lower_bound_for, paper_model_time, plan_report
from .errors import ClusterError, PlanError, ShardingError
from .graph import (
    COMPUTE,
    Channel,
    Compute,
    DataParallel,
    Dep,
    GradReduce,
    Lane,
    Op,
    StepGraph,
    TransferOp,
    reshard_graph,
)
from .lowering import Boundary, MicrobatchBoundaries, lower
from .mesh import DeviceMesh
from .partition import Layer, PartitionError, PartitionPlan, SearchBudget, StagePlan, partition
from .plan import ReshardPlan, Transfer
from .planner import STRATEGIES, PlanCache, PlanOptions, plan_resharding
from .regions import Region
from .schedules import (
    ALL_SCHEDULES,
    SCHEDULES,
    Action,
    Schedule,
    compute_only_time,
    make_schedule,
)
from .sharding import P, Replicate, Shard, Sharding, ShardingSpec
from .simulator import simulate
from .state_reshard import (
    StateOptions,
    StateReshardPlan,
    StateTensor,
    plan_state_resharding,
    state_graph,
    state_lower_bound,
)
from .timeline import Span, Timeline
from .validate import ProgramError, validate


def lower_bound(shape, dtype, src: Sharding, dst: Sharding, cluster: Cluster) -> float:
    """Seconds no resharding plan can beat on ``cluster`` (see :func:`cost.lower_bound_for`)."""
    return lower_bound_for(shape, dtype, src, dst, cluster)


__all__ = [
    "ALL_SCHEDULES",
    "BALANCES",
    "COMPUTE",
    "SCHEDULES",
    "STRATEGIES",
    "Action",
    "AutoChoice",
    "Boundary",
    "Channel",
    "Cluster",
    "ClusterError",
    "Compute",
    "CostModel",
    "DataParallel",
    "Dep",
    "DeviceMesh",
    "GradReduce",
    "Lane",
    "Layer",
    "MicrobatchBoundaries",
    "Op",
    "P",
    "PartitionError",
    "PartitionPlan",
    "PlanCache",
    "PlanError",
    "PlanOptions",
    "ProgramError",
    "Region",
    "Replicate",
    "ReshardPlan",
    "Schedule",
    "SearchBudget",
    "Shard",
    "Sharding",
    "ShardingError",
    "ShardingSpec",
    "Span",
    "StagePlan",
    "StateOptions",
    "StateReshardPlan",
    "StateTensor",
    "StepGraph",
    "Timeline",
    "Transfer",
    "TransferOp",
    "auto_schedule",
    "compute_only_time",
    "estimate",
    "lower",
    "lower_bound",
    "make_schedule",
    "paper_model_time",
    "partition",
    "plan_report",
    "plan_resharding",
    "plan_state_resharding",
    "reshard_graph",
    "simulate",
    "state_graph",
    "state_lower_bound",
    "validate",
]
