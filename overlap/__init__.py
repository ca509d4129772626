"""overlap — pipeline-parallel runtime with cross-mesh resharding and eager-1F1B.

The planner/compiler lives in the pure-Python ``scheduler`` package; ``overlap`` is the
runtime that interprets its plans (see docs/architecture.md for what exists today). Optional
dependencies (cupy, nvtx, uvloop, mpi4py, matplotlib, torch) are imported lazily, so
``import overlap`` works without any of them.
"""

from __future__ import annotations

from scheduler import (
    Cluster,
    DeviceMesh,
    ReshardPlan,
    Sharding,
    ShardingSpec,
    Transfer,
    lower_bound,
    plan_resharding,
)

from .errors import (
    CallMismatch,
    CollectiveAborted,
    CollectiveMismatch,
    CollectiveTimeout,
    DeviceFault,
    DeviceThreadLost,
    DeviceTimeout,
    OverlapRuntimeError,
    RankFailed,
    StageTimeout,
    StreamError,
)
from .pipeline import GradSync, Stage, StageContext
from .runtime import Runtime, run
from .stats import StepHookHandle, StepStats

__version__ = "0.1.0"

__all__ = [
    "CallMismatch",
    "Cluster",
    "CollectiveAborted",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "DeviceFault",
    "DeviceMesh",
    "DeviceThreadLost",
    "DeviceTimeout",
    "GradSync",
    "OverlapRuntimeError",
    "RankFailed",
    "ReshardPlan",
    "Runtime",
    "Sharding",
    "ShardingSpec",
    "Stage",
    "StageContext",
    "StageTimeout",
    "StepHookHandle",
    "StepStats",
    "StreamError",
    "Transfer",
    "__version__",
    "lower_bound",
    "plan_resharding",
    "run",
]
