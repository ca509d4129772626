"""``overlap trace plot``: a picture of one or more traces (one per rank) of any source.

One row per device stream: the compute stream, then one per comm channel (``fwd0``: the
activations of stage 0 → 1, ``bwd0``: their gradients back, ``fwd0.1``: lane 1 of ``fwd0``;
from a profiler's trace, the channel is read from the range names and lanes are not known).
Each op is a bar of its own, coloured by kind (F, B, I, W, activation, gradient), edged so
that back-to-back ops stay apart, labelled with its kind and microbatch (``F3``; ``3`` on a
comm row) where the label fits. The time a compute stream waited for a transfer bringing
its input (:mod:`scheduler.exposure`) is hatched on its row. Unattributed GPU work (inside
none of the runtime's ranges) has rows of its own per GPU. Several files are drawn one
under the other, their rows prefixed ``r<rank>``; our own traces each start at 0 (every
process times its own step), profilers' captures share their clock.

The file written is exactly the one named; its suffix says the format: ``.png``, ``.svg``
or ``.pdf`` (any other suffix, or none, is refused before anything is read).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..exposure import parse_name, waits_by_name
from .capture import GpuWork

FORMATS = (".png", ".svg", ".pdf")
COLORS = {"F": "tab:blue", "B": "tab:green", "I": "tab:olive", "W": "tab:cyan",
          "fwd": "tab:orange", "bwd": "tab:red", "comm": "tab:purple",
          "compute": "tab:gray", "other": "silver", "memory": "tan", "sync": "dimgray"}
NAMES = {"F": "F (forward)", "B": "B (backward)", "I": "I (input gradient)",
         "W": "W (weight gradient)", "fwd": "activation transfer", "bwd": "gradient transfer",
         "comm": "other transfer", "compute": "compute (unattributed)",
         "other": "communication (unattributed)", "memory": "memcpy, memset (unattributed)",
         "sync": "synchronization, other GPU work (unattributed)"}
# An unattributed piece of work's category -> its bars' kind (a key of COLORS).
_UNATTRIBUTED = {"compute": "compute", "comm": "other", "memory": "memory", "other": "sync"}
WAIT = "compute waiting for a transfer"
_RANK = re.compile(r"^r\d+ ")
_CHANNEL = re.compile(r"^(fwd|bwd)(\d+)(?:\.(\d+))?$")


class Bar(NamedTuple):
    start: float  # seconds
    end: float
    kind: str  # a key of COLORS
    label: str  # "F3", "3", or ""


@dataclass(frozen=True)
class Row:
    """One horizontal track: its name, its ops, and when it waited for a transfer."""

    name: str
    bars: tuple[Bar, ...]
    waits: tuple[tuple[float, float], ...] = ()


def check_output(path: Path, argument: str = "-o") -> Path:
    """``path`` if its suffix is a format the plot writes, else ValueError naming
    ``argument`` and the formats."""
    if path.suffix.lower() not in FORMATS:
        what = f"suffix {path.suffix!r}" if path.suffix else "no suffix"
        raise ValueError(f"{argument}: {path} has {what}: name a {', '.join(FORMATS[:-1])} "
                         f"or {FORMATS[-1]} file (the suffix is the format written)")
    return path


def timeline_rows(tl: Any) -> list[Row]:
    """The rows of one of our own timelines: per device its compute stream (waits marked),
    then each comm stream (one per channel and lane)."""
    rows = []
    for d in tl.devices:
        spans = tl.spans_of(d)
        for stream in sorted(tl.streams(d), key=stream_order):
            bars = tuple(Bar(s.start, s.end, s.kind if s.kind in COLORS else "comm",
                             _label(s.kind, s.microbatch, stream == "compute"))
                         for s in spans if s.stream == stream)
            waits = tuple(tl.transfer_waits(d)) if stream == "compute" else ()
            rows.append(Row(f"d{d} {stream}", bars, waits))
    return rows


def capture_rows(work: Sequence[GpuWork]) -> list[Row]:
    """The rows of a profiler's capture: per device its compute and one per channel (read
    from the range names); then per GPU its unattributed compute, communication, memory and
    other work."""
    rows = []
    devices = sorted({w.device for w in work if w.device is not None})
    for d in devices:
        mine = [w for w in work if w.device == d]
        streams: dict[str, list[Bar]] = {"compute": []}
        for w in sorted(mine, key=lambda w: w.start):
            stream, bar = _capture_bar(w)
            bars = streams.setdefault(stream, [])
            if bars and bars[-1].label == bar.label and bars[-1].kind == bar.kind \
                    and w.category == "compute":  # one op's kernels: one bar
                bars[-1] = bars[-1]._replace(end=max(bars[-1].end, bar.end))
            else:
                bars.append(bar)
        waits = tuple(waits_by_name((w.category, w.label, w.start, w.end) for w in mine))
        for stream in sorted(streams, key=stream_order):
            rows.append(Row(f"d{d} {stream}", tuple(streams[stream]),
                            waits if stream == "compute" else ()))
    for g in sorted({w.gpu for w in work if w.device is None}):
        for category, kind in _UNATTRIBUTED.items():
            bars = tuple(Bar(w.start, w.end, kind, "") for w in work
                         if w.device is None and w.gpu == g and w.category == category)
            if bars:
                rows.append(Row(f"GPU {g} unattributed {category}", bars))
    return rows


def stream_order(stream: str) -> tuple[int, int, int, str]:
    """Rows of a device: compute, then the activation channels by boundary (each with its
    lanes), then the gradient channels, then anything else."""
    m = _CHANNEL.match(stream)
    if stream == "compute":
        return (0, 0, 0, "")
    if m is None:
        return (3, 0, 0, stream)
    return (1 if m.group(1) == "fwd" else 2, int(m.group(2)), int(m.group(3) or 0), "")


def _capture_bar(w: GpuWork) -> tuple[str, Bar]:
    op = parse_name(w.label)
    if w.category == "compute":
        kind = op.kind if op is not None else "compute"
        return "compute", Bar(w.start, w.end, kind, _label(kind, op.microbatch, True)
                              if op is not None else "")
    if op is None or op.kind not in ("fwd", "bwd"):
        return "comm", Bar(w.start, w.end, "comm", "")
    boundary = op.src if op.kind == "fwd" else op.stage  # (fwd<b>: b → b+1; bwd<b>: back)
    return f"{op.kind}{boundary}", Bar(w.start, w.end, op.kind, str(op.microbatch))


def _label(kind: str, microbatch: int, compute: bool) -> str:
    if microbatch < 0:
        return ""
    return f"{kind}{microbatch}" if compute else str(microbatch)


def shifted(rows: Sequence[Row], t0: float, prefix: str) -> list[Row]:
    """``rows`` with times from ``t0`` and names prefixed (one rank's rows in a picture of
    several)."""
    return [Row(prefix + r.name, tuple(b._replace(start=b.start - t0, end=b.end - t0)
                                       for b in r.bars),
                tuple((a - t0, b - t0) for a, b in r.waits)) for r in rows]


def traces_rows(traces: Sequence[Any], ranks: Sequence[int] | None = None) -> list[Row]:
    """The rows of every trace read (:class:`scheduler.traces.report.Trace`), one under the
    other: one as is, several prefixed ``r<rank>`` (``ranks``, default 0, 1, ... in the
    order given). Our own traces keep their times (each from its own start); profilers'
    captures share one clock, from its earliest work."""
    captures = [t.capture.work for t in traces if t.timeline is None]
    t0 = min((w.start for work in captures for w in work), default=0.0)
    rows: list[Row] = []
    for k, t in zip(range(len(traces)) if ranks is None else ranks, traces):
        mine = (timeline_rows(t.timeline) if t.timeline is not None else
                capture_rows(t.capture.work))
        rows += shifted(mine, 0.0 if t.timeline is not None else t0,
                        f"r{k} " if len(traces) > 1 else "")
    return rows


def figure(rows: Sequence[Row], title: str = "") -> Any:
    """The matplotlib figure of ``rows`` (top to bottom, named by the y axis's labels), times
    in ms, with a legend of what it shows."""
    plt = pyplot("overlap trace plot")
    from matplotlib.patches import Patch

    end = max((b.end for r in rows for b in r.bars), default=1e-3) * 1e3
    fig, ax = plt.subplots(figsize=(14, 1.6 + 0.26 * max(1, len(rows))))
    ax.set_xlim(0, end * 1.01)
    px_per_ms = 14 * 0.8 * 120 / (end * 1.01)  # (about: the axes' share of the width)
    kinds: set[str] = set()
    for y, row in enumerate(rows):
        _draw_row(ax, y, row, px_per_ms)
        kinds |= {b.kind for b in row.bars}
    ax.set_yticks(range(len(rows)), [r.name for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    _separate_devices(ax, rows)
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=8)
    handles = [Patch(facecolor=COLORS[k], edgecolor="white", label=NAMES[k])
               for k in COLORS if k in kinds]
    if any(r.waits for r in rows):
        handles.append(Patch(facecolor="none", edgecolor="black", hatch="////", label=WAIT))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7,
              frameon=False)
    return fig


def _draw_row(ax: Any, y: int, row: Row, px_per_ms: float) -> None:
    if row.bars:
        ax.broken_barh([(b.start * 1e3, (b.end - b.start) * 1e3) for b in row.bars],
                       (y - 0.4, 0.8), facecolors=[COLORS[b.kind] for b in row.bars],
                       edgecolors="white", linewidth=0.8)
    if row.waits:
        ax.broken_barh([(a * 1e3, (b - a) * 1e3) for a, b in row.waits], (y - 0.4, 0.8),
                       facecolors="none", edgecolors="black", hatch="////", linewidth=0.5)
    for b in row.bars:  # a label where it fits (~5 px a character at 6 pt)
        width = (b.end - b.start) * 1e3
        if b.label and width * px_per_ms >= 5 * len(b.label) + 3:
            ax.text((b.start + b.end) / 2 * 1e3, y, b.label, ha="center", va="center",
                    fontsize=6, color="white", clip_on=True)


def _separate_devices(ax: Any, rows: Sequence[Row]) -> None:
    """A thin line between devices (rows named alike up to their last word), a dark one
    between ranks (``r<k> ...``)."""
    for y in range(1, len(rows)):
        this, last = rows[y].name, rows[y - 1].name
        if _RANK.match(this) and this.split(" ", 1)[0] != last.split(" ", 1)[0]:
            ax.axhline(y - 0.5, color="0.2", linewidth=1.2)
        elif this.rsplit(" ", 1)[0] != last.rsplit(" ", 1)[0]:
            ax.axhline(y - 0.5, color="0.8", linewidth=0.6)


def plot_rows(rows: Sequence[Row], path: str | Path, title: str = "") -> Path:
    """Write the picture of ``rows`` to exactly ``path`` (format from its suffix)."""
    path = check_output(Path(path), "path")
    fig = figure(rows, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    plt = pyplot("overlap trace plot")
    try:
        fig.tight_layout()
        fig.savefig(path, dpi=120, format=path.suffix[1:].lower())
    finally:
        plt.close(fig)
    return path


def pyplot(what: str) -> Any:
    """matplotlib's pyplot, headless (ImportError naming ``what`` without the viz extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(f"{what} needs matplotlib: pip install -e '.[viz]' (from the "
                          "repository, as the README installs overlap)") from None
    return plt
