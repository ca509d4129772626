"""Arrays for whole-state resharding tests (the one-process tests and the multi-process job
share them): each tensor's full value as random bytes, and a region as index slices."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from scheduler.dtypes import check_dtype


def box(region: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
    """A region's half-open bounds as index slices."""
    return tuple(slice(a, b) for a, b in region)


def full_tensors(tensors: Mapping[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random bytes for each tensor (a ``StateTensor``), viewed as its dtype."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in tensors.items():
        dt = check_dtype(t.dtype)
        raw = rng.integers(0, 256, math.prod(t.shape) * dt.itemsize, dtype=np.uint8)
        out[name] = raw.view(dt).reshape(t.shape)
    return out
