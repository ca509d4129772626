"""Regions: half-open boxes of a global tensor, ``((start, stop), ...)`` one pair per dim."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

Region = tuple[tuple[int, int], ...]


def volume(region: Region) -> int:
    return math.prod(max(0, b - a) for a, b in region)


def region_shape(region: Region) -> tuple[int, ...]:
    """The box's extent along each dim (the shape of an array that holds it)."""
    return tuple(b - a for a, b in region)


def is_empty(region: Region) -> bool:
    return any(b <= a for a, b in region)


def intersect(a: Region, b: Region) -> Region | None:
    """The common box of ``a`` and ``b``, or None when they do not overlap."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return None if is_empty(out) else out


def contains(outer: Region, inner: Region) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


_NOTHING: Region = ((0, 0),)  # an empty box standing for "no part of a 0-d region"


def split_region(region: Region, weights: Sequence[float]) -> list[Region]:
    """Cut ``region`` along its longest dim into consecutive pieces sized by ``weights``.

    Cut points are rounded to whole elements, so the boxes tile ``region`` exactly. Returns
    one box per weight, in order; a weight too small for a whole element gets an empty box,
    which callers skip with :func:`is_empty`.
    """
    if not region:  # a 0-d tensor: one element, indivisible — all of it to the heaviest
        best = max(range(len(weights)), key=lambda i: weights[i])
        return [region if i == best else _NOTHING for i in range(len(weights))]
    dim = max(range(len(region)), key=lambda d: region[d][1] - region[d][0])
    start, stop = region[dim]
    total = float(sum(weights))
    cuts = [start]
    acc = 0.0
    for w in weights[:-1]:
        acc += w
        cuts.append(start + round((stop - start) * acc / total))
    cuts.append(stop)
    return [(*region[:dim], (lo, hi), *region[dim + 1 :]) for lo, hi in pairwise(cuts)]


def fmt_region(region: Region) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"
