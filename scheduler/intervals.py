"""Intervals of time: the times of a captured event, checked (what every trace reader accepts
as an interval), and the arithmetic every report does on them (union, length, difference,
intersection), in one place so that every source's figures are computed alike."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Interval = tuple[float, float]

MAX_SECONDS = 1e12  # a timestamp beyond this (~31,700 years) is no capture's


def check_interval(start: object, end: object, what: str) -> tuple[float, float]:
    """An event's (start, end) in seconds, or ValueError naming ``what``: both finite real
    numbers within :data:`MAX_SECONDS`, the end not before the start — a report never prints
    a figure made of NaN, infinities or a negative duration."""
    for name, v in (("start", start), ("end", end)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{what}: its {name} is {v!r}, not a number")
        if not math.isfinite(v) or abs(v) > MAX_SECONDS:
            raise ValueError(f"{what}: its {name} is {v!r} s, not a time within a capture")
    if end < start:  # type: ignore[operator]
        raise ValueError(f"{what}: it ends ({end!r} s) before it starts ({start!r} s)")
    return float(start), float(end)  # type: ignore[arg-type]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals``: sorted, disjoint, touching ones joined."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(intervals: Sequence[Interval]) -> float:
    """Total length of disjoint ``intervals`` (a :func:`union`)."""
    return sum(b - a for a, b in intervals)


def difference(keep: Sequence[Interval], cut: Sequence[Interval]) -> list[Interval]:
    """The parts of ``keep`` outside ``cut`` (both unions: sorted, disjoint), in order."""
    out: list[Interval] = []
    j = 0
    for a, b in keep:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        pos, k = a, j
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > pos:
                out.append((pos, cut[k][0]))
            pos = max(pos, cut[k][1])
            k += 1
        if b > pos:
            out.append((pos, b))
    return out


def minus(keep: Sequence[Interval], cut: Sequence[Interval]) -> float:
    """Length of ``keep`` outside ``cut`` (both unions: sorted, disjoint)."""
    return length(difference(keep, cut))


def clipped(intervals: Sequence[Interval], start: float, end: float) -> float:
    """Length of the union ``intervals`` (sorted, disjoint) inside ``[start, end]``."""
    if end <= start:
        return 0.0
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals
               if a < end and b > start)


__all__ = ["MAX_SECONDS", "Interval", "check_interval", "clipped", "difference", "length", "minus",
           "union"]
