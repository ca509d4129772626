"""Named error types. Each is a ``ValueError`` so callers can catch the broad class."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


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


def check_seconds(name: str, value: object) -> float:
    """``value`` as float if it is a finite number of seconds > 0 (not a bool); else
    TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected seconds (a number), got {value!r} "
                        f"({type(value).__name__})")
    if not 0 < value < float("inf"):
        raise ValueError(f"{name}: expected finite seconds > 0, got {value!r}")
    return float(value)


def load_json(text: str | bytes, what: str, build: Callable[[Any], T]) -> T:
    """``build(json.loads(text))``, turning what a malformed document raises (bad JSON, a
    missing field, a field of the wrong type) into a ValueError naming ``what`` and the
    field."""
    try:
        return build(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: not valid JSON ({exc})") from None
    except KeyError as exc:
        raise ValueError(f"{what}: missing field {exc}") from None
    except (TypeError, IndexError, AttributeError, OverflowError) as exc:
        raise ValueError(f"{what}: malformed ({type(exc).__name__}: {exc})") from None
    except RecursionError:
        raise ValueError(f"{what}: nested too deep") from None
