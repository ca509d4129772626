"""Named error types. Each is a ``ValueError`` so callers can catch the broad class."""

from __future__ import annotations


class ShardingError(ValueError):
    """A sharding spec that does not fit its mesh or tensor."""


class ClusterError(ValueError):
    """A mesh, sharding or plan that does not fit the cluster it is used with."""


class PlanError(ValueError):
    """A resharding plan that breaks an invariant (see ``ReshardPlan.check``)."""


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1 (not a bool); else TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name}: must be >= 1, got {value}")
    return value
