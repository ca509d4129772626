"""Reading an Nsight Systems SQLite export: which GPU work was compute, which communication, on
which device, and how much communication nothing hid.

Tables, per the "SQLite Export Schema Reference" of Nsight Systems (read by column name; a
table missing from a capture — they are created lazily — is read as empty):

- ``StringIds(id, value)``: interned strings;
- ``NVTX_EVENTS``: ranges — ``eventType`` 59 push/pop, 60 start/end — with ``start``,
  ``end``, ``globalTid`` (the thread), ``text`` inline or ``textId`` into ``StringIds``, and
  ``domainId``; a row of ``eventType`` 75 creates a domain (its name in ``text``, its id in
  ``domainId``);
- ``CUPTI_ACTIVITY_KIND_RUNTIME``: CUDA API calls — ``start``, ``globalTid``,
  ``correlationId``;
- ``CUPTI_ACTIVITY_KIND_KERNEL`` / ``_MEMCPY`` / ``_MEMSET``: GPU work — ``start``, ``end``,
  ``deviceId``, ``correlationId`` (joining it to its launch call); kernels name themselves by
  ``shortName`` or ``demangledName`` (ids into ``StringIds``).

**Attribution**: a piece of GPU work belongs to the innermost range of the ``overlap`` domain,
on the thread that launched it, that encloses its launch call. The runtime's range messages
name the device (``... on device 5``) and the op: a compute op starts with its kind
(``F s1 mb3 ...``), communication names a resharding (``reshard ...``, ``grad ...``). Ranges
of other domains are ignored. Work inside no ``overlap`` range is communication when it is an
NCCL kernel (its name starts with ``nccl``), compute otherwise, on its CUDA device id.
"""

from __future__ import annotations

import bisect
import re
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

NVTX_PUSH_POP, NVTX_START_END, NVTX_DOMAIN_CREATE = 59, 60, 75
DOMAIN = "overlap"
_DEVICE = re.compile(r"\bon device (\d+)\b")
_COMPUTE = re.compile(r"^[FBIW] s\d+")
_GPU_TABLES = ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
               "CUPTI_ACTIVITY_KIND_MEMSET")


@dataclass(frozen=True)
class GpuWork:
    """One piece of GPU work: where, when (seconds), compute or communication, and why (the
    range it belongs to, or its kernel name)."""

    device: int
    start: float
    end: float
    category: str  # "compute" or "comm"
    label: str


def read_sqlite(path: str | Path) -> list[GpuWork]:
    """Every kernel, memcpy and memset of the capture, attributed (see module doc).
    ValueError naming the file when it is not an Nsight Systems SQLite export."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if not is_sqlite(path):
        raise ValueError(f"{path}: not an SQLite file (an Nsight Systems capture exports "
                         "to one with `nsys export --type sqlite`)")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return _attribute(db)
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{path}: a corrupt or unreadable SQLite file ({exc})") from None


def _rows(db: sqlite3.Connection, table: str, columns: Sequence[str]) -> list[tuple]:
    """``columns`` of ``table`` (None for a column this version lacks); [] without it."""
    have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
    if not have:
        return []
    picked = ", ".join(c if c in have else "NULL" for c in columns)
    return list(db.execute(f"SELECT {picked} FROM {table}"))


def _attribute(db: sqlite3.Connection) -> list[GpuWork]:
    strings = dict(_rows(db, "StringIds", ("id", "value")))
    events = _rows(db, "NVTX_EVENTS", ("start", "end", "eventType", "globalTid", "text",
                                       "textId", "domainId"))
    domains = {dom for _, _, kind, _, text, tid, dom in events
               if kind == NVTX_DOMAIN_CREATE and (text or strings.get(tid)) == DOMAIN}
    # Per thread: our ranges, sorted by start, for the innermost-enclosing lookup.
    ranges: dict[int, list[tuple[int, int, str]]] = {}
    for start, end, kind, tid, text, text_id, dom in events:
        if kind in (NVTX_PUSH_POP, NVTX_START_END) and dom in domains and end is not None:
            ranges.setdefault(tid, []).append((start, end, text or strings.get(text_id, "")))
    for rs in ranges.values():
        rs.sort()
    launches = {corr: (tid, start) for start, tid, corr in
                _rows(db, "CUPTI_ACTIVITY_KIND_RUNTIME", ("start", "globalTid", "correlationId"))}
    work = []
    for table in _GPU_TABLES:
        for start, end, device, corr, short, demangled in _rows(
                db, table, ("start", "end", "deviceId", "correlationId", "shortName",
                            "demangledName")):
            name = strings.get(short) or strings.get(demangled) or table.rsplit("_", 1)[1].lower()
            launch = launches.get(corr)
            label = _innermost(ranges.get(launch[0], []), launch[1]) if launch else None
            work.append(_classify(label, name, int(device or 0), start * 1e-9, end * 1e-9))
    return work


def _innermost(ranges: list[tuple[int, int, str]], t: int) -> str | None:
    """The message of the latest-starting range that encloses ``t`` (the innermost)."""
    i = bisect.bisect_right(ranges, (t, float("inf"), ""))
    for start, end, text in reversed(ranges[:i]):
        if start <= t <= end:
            return text
    return None


def _classify(label: str | None, name: str, device: int, start: float, end: float) -> GpuWork:
    if label is not None:
        m = _DEVICE.search(label)
        category = "compute" if _COMPUTE.match(label) else "comm"
        return GpuWork(int(m.group(1)) if m else device, start, end, category, label)
    return GpuWork(device, start, end, "comm" if name.startswith("nccl") else "compute", name)


# ---- per-device figures ------------------------------------------------------------------------


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(keep: Sequence[tuple[float, float]], cut: Sequence[tuple[float, float]]) -> float:
    """Length of ``keep`` outside ``cut`` (both unions: sorted, disjoint)."""
    total, j = 0.0, 0
    for a, b in keep:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        pos, k = a, j
        while k < len(cut) and cut[k][0] < b:
            total += max(0.0, cut[k][0] - pos)
            pos = max(pos, cut[k][1])
            k += 1
        total += max(0.0, b - pos)
    return total


def device_figures(work: Iterable[GpuWork]) -> dict[int, dict[str, float]]:
    """Per device: ``compute_ms`` (union of its compute), ``comm_ms`` (union of its
    communication), ``exposed_comm_ms`` (communication while no compute ran there) and
    ``overlap_pct`` (100 × hidden / comm_ms; 0 without communication)."""
    by_device: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for w in work:
        by_device.setdefault(w.device, {"compute": [], "comm": []})[w.category].append(
            (w.start, w.end))
    out = {}
    for d, parts in sorted(by_device.items()):
        compute, comm = _union(parts["compute"]), _union(parts["comm"])
        comm_s, exposed = _length(comm), _minus(comm, compute)
        out[d] = {"compute_ms": _length(compute) * 1e3, "comm_ms": comm_s * 1e3,
                  "exposed_comm_ms": exposed * 1e3,
                  "overlap_pct": 100.0 * (comm_s - exposed) / comm_s if comm_s else 0.0}
    return out


def timeline_work(timeline: object) -> list[GpuWork]:
    """The spans of one of our own timelines (measured or simulated) as :class:`GpuWork`:
    the compute stream's are compute, every other stream's communication."""
    return [GpuWork(sp.device, sp.start, sp.end, "compute" if sp.stream == "compute" else "comm",
                    sp.name) for sp in timeline.spans]  # type: ignore[attr-defined]


def figures_text(figures: dict[int, dict[str, float]]) -> str:
    """The per-device table of :func:`device_figures`."""
    lines = ["device  compute ms  comm ms  exposed comm ms  overlap %"]
    for d, f in figures.items():
        lines.append(f"{d:>6}  {f['compute_ms']:>10.3f}  {f['comm_ms']:>7.3f}  "
                     f"{f['exposed_comm_ms']:>15.3f}  {f['overlap_pct']:>9.1f}")
    return "\n".join(lines)


def is_sqlite(path: str | Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def plot_work(work: Sequence[GpuWork], path: str | Path, title: str = "") -> Path:
    """A PNG with two tracks per device — compute and communication — from any source (needs
    matplotlib: the ``viz`` extra)."""
    from .timeline import pyplot, save_png

    plt = pyplot("overlap trace plot")
    devices = sorted({w.device for w in work})
    t0 = min((w.start for w in work), default=0.0)
    colors = {"compute": "tab:blue", "comm": "tab:orange"}
    fig, ax = plt.subplots(figsize=(12, max(2.0, 0.6 * len(devices))))
    for i, d in enumerate(devices):
        for k, (category, color) in enumerate(colors.items()):
            bars = [((w.start - t0) * 1e3, (w.end - w.start) * 1e3) for w in work
                    if w.device == d and w.category == category]
            if bars:
                ax.broken_barh(bars, (2 * i + k - 0.4, 0.8), facecolors=color)
    ax.set_yticks(range(2 * len(devices)),
                  [f"d{d} {c}" for d in devices for c in ("compute", "comm")], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=8)
    return save_png(plt, fig, path)
