"""Checking a resharding plan by box arithmetic: time and memory in proportion to its
transfers, never to the number of cells its regions cut the tensor into.

A plan is correct when every sender holds what it sends (from the source layout, or from
what earlier transfers brought it) and every destination device receives exactly its
destination region, each element once. Both follow from the boxes alone:

- **holding**: a sender's own source region plus the boxes it received, which are disjoint
  in a correct plan, so the volume of the region they cover is a sum;
- **exact delivery**, by corners: a box's indicator function is the signed sum of the
  orthant indicators at its 2^k corners (k: the dimensions it is cut in), so boxes tile a
  region exactly — every element once, none outside — iff the signed corners of the boxes
  and of the region, minus, cancel everywhere. Linear in the boxes, exact, no grid.

Only on a failure does the check look for a witness to name (two transfers that deliver
the same element; the first box nobody delivers): quadratic at worst, so it is bounded too.
Every step spends from one budget of :data:`MAX_CHECK_WORK` box operations; a plan that
would need more is refused with :class:`PlanError`, never checked for minutes.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence

from .errors import PlanError
from .regions import Region, contains, fmt_region, intersect, volume

MAX_CHECK_WORK = 1 << 22  # box operations a plan's check may spend (a few seconds at most)

Received = Sequence[tuple[int, int, Region]]  # (transfer index, lane, region), in order


class Budget:
    """The box operations a check may still spend."""

    def __init__(self, units: int = MAX_CHECK_WORK) -> None:
        self.left = units

    def spend(self, units: int) -> None:
        self.left -= units
        if self.left < 0:
            raise PlanError(f"the plan's regions are too many or too finely cut to check "
                            f"within {MAX_CHECK_WORK} box operations (a plan this fragmented "
                            "is not one the planner makes)")


def holds(own: Region | None, got: Received, region: Region, budget: Budget) -> bool:
    """Whether a device holding ``own`` (its source region, or None) and the boxes ``got``
    holds all of ``region``. Exact when the boxes are disjoint (a plan where they overlap
    is refused by :func:`check_delivered`)."""
    if own is not None and contains(own, region):
        return True
    budget.spend(1 + len(got))
    own_part = intersect(own, region) if own is not None else None
    have = volume(own_part) if own_part is not None else 0
    for _, _, box in got:
        part = intersect(region, box)
        if part is None:
            continue
        have += volume(part)
        both = intersect(part, own_part) if own_part is not None else None
        if both is not None:
            have -= volume(both)
    return have >= volume(region)


def check_delivered(device: int, region: Region, got: Received, budget: Budget) -> None:
    """Raise :class:`PlanError` unless the boxes ``got`` (each inside ``region``) deliver
    every element of ``region`` exactly once."""
    if _tiles(region, [box for _, _, box in got], budget):
        return
    head = (f"device {device}: destination region {fmt_region(region)} not delivered "
            "exactly once")
    twice = _first_overlap(got, budget)
    if twice is not None:
        i, j, box = twice
        raise PlanError(f"{head} (delivered more than once: transfers {i} and {j} both "
                        f"deliver {fmt_region(box)})")
    missing = volume(region) - sum(volume(box) for _, _, box in got)
    first = _first_missing(region, [box for _, _, box in got], budget)
    raise PlanError(f"{head} ({missing} element(s) missing; first missing: "
                    f"{fmt_region(first) if first is not None else '?'})")


def _tiles(region: Region, boxes: Sequence[Region], budget: Budget) -> bool:
    """Whether ``boxes`` tile ``region`` exactly (signed corners cancel). Dimensions no box
    cuts (each spans the region's extent there) are left out: they add nothing."""
    boxes = [box for box in boxes if volume(box)]  # (an empty box covers nothing)
    if not volume(region):
        return not boxes
    cut = [d for d in range(len(region)) if any(box[d] != region[d] for box in boxes)]
    budget.spend((len(boxes) + 1) << min(len(cut), 62))
    weights: defaultdict[tuple[int, ...], int] = defaultdict(int)
    for box, sign in itertools.chain(((b, 1) for b in boxes), ((region, -1),)):
        for upper in itertools.product((0, 1), repeat=len(cut)):
            corner = tuple(box[d][u] for d, u in zip(cut, upper))
            weights[corner] += -sign if sum(upper) % 2 else sign
    return not any(weights.values())


def _first_overlap(got: Received, budget: Budget) -> tuple[int, int, Region] | None:
    """Two transfers delivering the same element, and the box they share (None: none)."""
    budget.spend(len(got) * len(got) // 2)
    for (i, _, a), (j, _, b) in itertools.combinations(got, 2):
        both = intersect(a, b)
        if both is not None:
            return i, j, both
    return None


def _first_missing(region: Region, boxes: Sequence[Region], budget: Budget) -> Region | None:
    """A box of ``region`` that none of the disjoint ``boxes`` covers (None: all covered).
    Cuts ``region`` around the first box that meets it into slabs and goes on in the first
    slab the others do not fill — one slab a round, one box fewer each round."""
    while True:
        budget.spend(len(boxes) * (2 * len(region) + 1))
        inside = [b for b in boxes if intersect(b, region) is not None]
        if not inside:
            return region if volume(region) else None
        first, boxes = inside[0], inside[1:]
        for slab in _slabs(region, first):
            covered = sum(volume(part) for b in boxes
                          if (part := intersect(b, slab)) is not None)
            if covered < volume(slab):
                region = slab
                break
        else:
            return None


def _slabs(region: Region, box: Region) -> list[Region]:
    """``region`` less ``box``, as disjoint boxes: below and above it in each dimension, the
    dimensions before narrowed to the box's extent."""
    out = []
    current = list(region)
    for d, ((lo, hi), (blo, bhi)) in enumerate(zip(region, box)):
        blo, bhi = max(lo, blo), min(hi, bhi)
        if blo > lo:
            out.append((*current[:d], (lo, blo), *current[d + 1:]))
        if bhi < hi:
            out.append((*current[:d], (bhi, hi), *current[d + 1:]))
        current[d] = (blo, bhi)
    return out


__all__ = ["MAX_CHECK_WORK", "Budget", "check_delivered", "holds"]
