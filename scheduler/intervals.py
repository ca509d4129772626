"""The times of a captured event, checked: what every trace reader accepts as an interval."""

from __future__ import annotations

import math

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


__all__ = ["MAX_SECONDS", "check_interval"]
