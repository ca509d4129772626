"""Named error types. Each is a ``ValueError`` so callers can catch the broad class."""

from __future__ import annotations


class ShardingError(ValueError):
    """A sharding spec that does not fit its mesh or tensor."""


class ClusterError(ValueError):
    """A mesh, sharding or plan that does not fit the cluster it is used with."""


class PlanError(ValueError):
    """A resharding plan that breaks an invariant (see ``ReshardPlan.check``)."""
