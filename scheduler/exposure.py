"""Exposed communication: one definition for every trace ``overlap`` reads — its own (runtime
or simulator), Nsight Systems exports, PyTorch profiler traces.

Per device, from the intervals its compute and its communication (every channel and lane)
ran in:

- **compute**: time at least one compute op ran on it (the union of its compute);
- **communication**: time at least one transfer ran on it (the union of its communication);
- **exposed**: communication time during which no compute ran on that device
  (communication minus compute);
- **overlap %**: 100 × (1 − exposed / communication), the share of communication hidden
  under compute (undefined without communication);
- **waited for transfers**: time the compute stream sat idle just before a compute op while
  a transfer bringing that op's input ran on this device. It is part of the exposed time
  (compute idle, a transfer running) — the part the step paid for; the rest of the exposed
  time ran while compute had nothing to do anyway (a bubble).

So ``0 ≤ waited ≤ exposed ≤ communication`` on every device. A compute op's inputs are the
step graph's data edges in our own traces; in a profiler's trace they are read from the
runtime's range names: ``F s2 mb3`` takes ``reshard s1→s2 mb3 #k``, ``B s2 mb3`` (or ``I``)
``grad s3→s2 mb3 #k``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .intervals import Interval, length, minus, union

DEFINITION = (
    "exposed = a device's communication time during which no compute ran on it; overlap % = "
    "100 x (1 - exposed / communication); waited = time its compute stream sat idle before a "
    "compute op while a transfer bringing that op's input ran on the device (part of "
    "exposed: 0 <= waited <= exposed <= communication)")


@dataclass(frozen=True)
class Figures:
    """One device's figures (seconds); ``waited`` is None where the source cannot tell."""

    compute: float
    comm: float
    exposed: float
    waited: float | None = None

    @property
    def overlap(self) -> float | None:
        """Share of the communication hidden under compute; None without communication."""
        return 1.0 - self.exposed / self.comm if self.comm > 0 else None

    def as_json(self) -> dict[str, Any]:
        overlap = self.overlap
        return {"compute_ms": self.compute * 1e3, "comm_ms": self.comm * 1e3,
                "exposed_comm_ms": self.exposed * 1e3,
                "overlap_pct": None if overlap is None else 100.0 * overlap,
                "waited_for_transfer_ms": None if self.waited is None else self.waited * 1e3}


def figures_of(compute: Iterable[Interval], comm: Iterable[Interval],
               waited: float | None = None) -> Figures:
    """:class:`Figures` of one device from its compute and communication intervals."""
    cu, co = union(compute), union(comm)
    return Figures(length(cu), length(co), minus(co, cu), waited)


class OpName(NamedTuple):
    """What a span's or range's name says: a compute (``kind`` F/B/I/W) or a transfer
    (``kind`` "fwd"/"bwd", from stage ``src`` to stage ``stage``) of ``microbatch``."""

    kind: str
    stage: int
    microbatch: int
    src: int = -1


_COMPUTE = re.compile(r"^([FBIW]) s(\d+) mb(\d+)")
_TRANSFER = re.compile(r"^(reshard|grad) s(\d+)(?:→|->)s(\d+) mb(\d+)")


def parse_name(name: str) -> OpName | None:
    """The op a runtime range or span name names (see :class:`OpName`); None otherwise."""
    m = _COMPUTE.match(name)
    if m is not None:
        return OpName(m.group(1), int(m.group(2)), int(m.group(3)))
    m = _TRANSFER.match(name)
    if m is not None:
        kind = "fwd" if m.group(1) == "reshard" else "bwd"
        return OpName(kind, int(m.group(3)), int(m.group(4)), int(m.group(2)))
    return None


def input_key(op: OpName) -> tuple[str, int, int] | None:
    """The transfers a compute waits for, as the key :func:`transfer_key` gives them."""
    if op.kind == "F":
        return ("fwd", op.stage, op.microbatch)
    if op.kind in ("B", "I"):
        return ("bwd", op.stage, op.microbatch)
    return None


def transfer_key(op: OpName) -> tuple[str, int, int]:
    return (op.kind, op.stage, op.microbatch)


def waits(computes: Sequence[tuple[float, float, Sequence[Interval]]]) -> list[Interval]:
    """When a compute stream sat idle before its ops while their inputs moved: ``computes``
    is each op's (start, end, union of its input transfers' intervals on this device), in
    any order; the result is sorted and disjoint."""
    out: list[Interval] = []
    prev_end = -math.inf
    for start, end, inputs in sorted(computes, key=lambda c: c[0]):
        out += [(max(a, prev_end), min(b, start)) for a, b in inputs
                if a < start and b > prev_end and min(b, start) > max(a, prev_end)]
        prev_end = max(prev_end, end)
    return union(out)


def waited(computes: Sequence[tuple[float, float, Sequence[Interval]]]) -> float:
    """Seconds of :func:`waits`."""
    return length(waits(computes))


def waits_by_name(work: Iterable[tuple[str, str, float, float]]) -> list[Interval]:
    """:func:`waits` of one device's work given as (category, name, start, end), each
    compute's inputs found by name (see module doc). Consecutive compute work of one name is
    one op (its kernels); the same name later again is the op of a later step."""
    ops: list[tuple[str, float, float]] = []
    moves: dict[tuple[str, int, int], list[Interval]] = {}
    for category, name, start, end in sorted(work, key=lambda w: w[2]):
        op = parse_name(name)
        if op is None:
            continue
        if category != "compute":
            if op.kind in ("fwd", "bwd"):
                moves.setdefault(transfer_key(op), []).append((start, end))
        elif ops and ops[-1][0] == name:
            ops[-1] = (name, ops[-1][1], max(ops[-1][2], end))
        else:
            ops.append((name, start, end))
    unions = {key: union(v) for key, v in moves.items()}
    computes = []
    for name, start, end in ops:
        key = input_key(parse_name(name))  # type: ignore[arg-type]
        computes.append((start, end, unions.get(key, []) if key else []))
    return waits(computes)


def waited_by_name(work: Iterable[tuple[str, str, float, float]]) -> float:
    """Seconds of :func:`waits_by_name`."""
    return length(waits_by_name(work))


COLUMNS = ("compute ms", "comm ms", "exposed ms", "overlap %", "waited for transfers ms")


def device_table(rows: Sequence[tuple[Any, ...]], keys: Sequence[str]) -> str:
    """The one per-device table of a report: each row's ``keys`` columns (text), then its
    :class:`Figures` (last item) under :data:`COLUMNS`; "-" where a figure is undefined."""
    head = [*keys, *COLUMNS]
    body = []
    for *key, f in rows:
        overlap = f.overlap
        body.append([*map(str, key), f"{f.compute * 1e3:.3f}", f"{f.comm * 1e3:.3f}",
                     f"{f.exposed * 1e3:.3f}", "-" if overlap is None else f"{overlap:.1%}",
                     "-" if f.waited is None else f"{f.waited * 1e3:.3f}"])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(row, widths))
                     for row in (head, *body))


__all__ = [
    "COLUMNS",
    "DEFINITION",
    "Figures",
    "OpName",
    "device_table",
    "figures_of",
    "input_key",
    "parse_name",
    "transfer_key",
    "waited",
    "waited_by_name",
]
