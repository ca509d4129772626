"""Intervals of time: the times of a captured event, checked (what every trace reader accepts
as an interval), and the arithmetic every report does on them (union, length, difference,
intersection), in one place so that every source's figures are computed alike."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Interval = tuple[float, float]

MAX_SECONDS = 1e12  # a timestamp beyond this (~31,700 years) is no capture's
MAX_EVENT_SECONDS = 1e6  # an event longer than this (~11.6 days) is no capture's either
MAX_ID = (1 << 63) - 1  # an id (device, process, thread, op) beyond int64 is none of ours


def check_id(value: object, what: str, name: str, *, lo: int = 0) -> int:
    """An event's id field (a device, a thread, an op): an int in ``lo``..:data:`MAX_ID` —
    not a bool (``true`` is no thread 1), a float or a string; ValueError naming ``what``
    and ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= MAX_ID:
        low = str(lo) if abs(lo) < 1 << 32 else "-(2**63-1)"
        raise ValueError(f"{what}: its {name} is {_short(value)}, not an integer in "
                         f"{low}..2**63-1")
    return value


def scaled_interval(start: object, duration: object, unit: float,
                    what: str) -> tuple[float, float]:
    """:func:`check_interval` of an event given as a start and a duration in ``unit``
    seconds (1e-6: microseconds), converted without overflow (an integer of 400 digits is
    named, not raised as OverflowError)."""
    begin = _number(start, what, "start")
    return check_interval(begin * unit, (begin + _number(duration, what, "duration")) * unit,
                          what)


def _number(value: object, what: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what}: its {name} is {_short(value)}, not a number")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{what}: its {name} is {_short(value)}, not a time within a "
                         "capture") from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


def check_interval(start: object, end: object, what: str) -> tuple[float, float]:
    """An event's (start, end) in seconds, or ValueError naming ``what``: both finite real
    numbers within :data:`MAX_SECONDS`, the end not before the start nor more than
    :data:`MAX_EVENT_SECONDS` after it — a report never prints a figure made of NaN,
    infinities, a negative duration or one no capture lasts."""
    a, b = _number(start, what, "start"), _number(end, what, "end")
    for name, v in (("start", a), ("end", b)):
        if not math.isfinite(v) or abs(v) > MAX_SECONDS:
            raise ValueError(f"{what}: its {name} is {v!r} s, not a time within a capture")
    if b < a:
        raise ValueError(f"{what}: it ends ({end!r} s) before it starts ({start!r} s)")
    if b - a > MAX_EVENT_SECONDS:
        raise ValueError(f"{what}: it lasts {b - a:.4g} s, longer than any capture "
                         f"(at most {MAX_EVENT_SECONDS:g} s)")
    return a, b


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


__all__ = ["MAX_EVENT_SECONDS", "MAX_ID", "MAX_SECONDS", "Interval", "check_id",
           "check_interval", "clipped", "difference", "length", "minus", "scaled_interval",
           "union"]
