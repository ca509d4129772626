"""scheduler — the planner/compiler of ``overlap``: no GPU, no asyncio.

Cluster, meshes and shardings; the cross-mesh resharding planner; the cost model and the
physical lower bound; pipeline schedules, their lowering to the step graph (typed ops on
device streams with explicit dependencies), the validator, the event kernel, the simulator
and timelines; automatic partitioning (``scheduler/partition/``). None of these reads or
writes a file; the I/O is in ``scheduler/cli/`` (the command line) and ``scheduler/traces/``
(the trace readers and reports), and at the edges the caller names: a timeline's trace file
and plot, ``Cluster.detect()``'s environment. See docs/architecture.md (the user guide:
docs/index.md).

The face also exports what the runtime (``overlap``) builds on — a step graph's channels and
streams, the lowering's boundaries, regions, the narrow dtypes, the timeline's span metadata
and the argument checks it shares — so that ``overlap`` imports no module of ``scheduler``
past this one (its subpackages ``partition``, ``traces`` and ``cli`` have faces of their
own).
"""

from __future__ import annotations

from .auto import AutoChoice, auto_schedule, check_caps
from .balance import BALANCES
from .cluster import Cluster
from .cost import CostModel, estimate, lower_bound_for, paper_model_time, plan_report
from .dtypes import NARROW_FLOATS, is_floating
from .errors import ClusterError, PlanError, ShardingError, check_seconds
from .graph import (
    COMPUTE,
    Channel,
    ChannelSets,
    Compute,
    DataParallel,
    Dep,
    GradReduce,
    Lane,
    Op,
    StepGraph,
    TransferOp,
    buffers_used,
    dp_stream,
    input_channel,
    output_channel,
    reduce_line,
    reduce_lines,
    reshard_graph,
)
from .lowering import (
    Boundaries,
    Boundary,
    BoundaryGroup,
    MicrobatchBoundaries,
    boundaries_key,
    channels,
    elements,
    lower,
    per_microbatch,
    plan_mismatch,
)
from .mesh import DeviceMesh
from .partition import Layer, PartitionError, PartitionPlan, SearchBudget, StagePlan, partition
from .plan import ReshardPlan, Transfer
from .planner import STRATEGIES, PlanCache, PlanOptions, plan_resharding
from .regions import Region, contains, region_shape
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
from .timeline import Span, Timeline, span_meta
from .validate import ProgramError, validate


def lower_bound(shape, dtype, src: Sharding, dst: Sharding, cluster: Cluster) -> float:
    """Seconds no resharding plan can beat on ``cluster`` (see :func:`cost.lower_bound_for`)."""
    return lower_bound_for(shape, dtype, src, dst, cluster)


__all__ = [
    "ALL_SCHEDULES",
    "BALANCES",
    "COMPUTE",
    "NARROW_FLOATS",
    "SCHEDULES",
    "STRATEGIES",
    "Action",
    "AutoChoice",
    "Boundaries",
    "Boundary",
    "BoundaryGroup",
    "Channel",
    "ChannelSets",
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
    "boundaries_key",
    "buffers_used",
    "channels",
    "check_caps",
    "check_seconds",
    "compute_only_time",
    "contains",
    "dp_stream",
    "elements",
    "estimate",
    "input_channel",
    "is_floating",
    "lower",
    "lower_bound",
    "make_schedule",
    "output_channel",
    "paper_model_time",
    "partition",
    "per_microbatch",
    "plan_mismatch",
    "plan_report",
    "plan_resharding",
    "plan_state_resharding",
    "reduce_line",
    "reduce_lines",
    "region_shape",
    "reshard_graph",
    "simulate",
    "span_meta",
    "state_graph",
    "state_lower_bound",
    "validate",
]
