"""``overlap trace report``: the figures of one trace or of several (one per rank), of any
source — ours (runtime or simulator), an Nsight Systems capture, a PyTorch profiler trace —
with one definition of exposed communication (:mod:`scheduler.exposure`).

Several files are the ranks of one job (:func:`in_rank_order`): each device must be in one
file only (each process traces its own devices); the report is one per-device table with a
rank column, the unattributed work of each rank's GPUs, each GPU's time as Holistic Trace
Analysis breaks it down (:mod:`scheduler.traces.gpu_time`), and a per-rank breakdown (each file's
steps, iteration time and bubble: ranks' clocks are not compared).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..exposure import Figures, device_table, parse_name
from ..timeline import Timeline
from .capture import (
    Capture,
    check_trace_bytes,
    device_figures,
    step_figures,
    timeline_work,
    unattributed_figures,
)
from .gpu_time import GpuTime, gpu_times

SOURCES = {"overlap": "a trace of overlap's runtime or simulator",
           "nsys": "an Nsight Systems capture", "kineto": "a PyTorch profiler trace"}


@dataclass(frozen=True)
class Trace:
    """One file read: its work (attributed), our own Timeline when it is one of ours, which
    kind of source it is (a key of :data:`SOURCES`), and the rank of the job's process that
    wrote it when the file says (a PyTorch trace's ``distributedInfo.rank``)."""

    path: Path
    capture: Capture
    timeline: Timeline | None
    source: str
    rank: int | None = None


@dataclass(frozen=True)
class FileReport:
    """One file's figures: per device (and the stages it ran), per GPU its unattributed
    work, its steps (``steps``, ``iteration_ms``, ``bubble_pct``; None without step
    ranges), per GPU all its time (:class:`~scheduler.traces.gpu_time.GpuTime`), and its rank."""

    path: Path
    source: str
    devices: dict[int, Figures]
    stages: dict[int, tuple[int, ...]]
    unattributed: dict[int, Figures]
    steps: dict[str, float] | None
    gpus: dict[int, GpuTime] = field(default_factory=dict)
    rank: int = 0


def read_trace(path: Path) -> Trace:
    """The file at ``path`` read by the reader of its kind (ValueError naming it)."""
    from .kineto import distributed_rank, is_kineto, kineto_work
    from .nsys import is_sqlite, read_sqlite

    if path.suffix == ".nsys-rep":
        return Trace(path, read_sqlite(_exported(path)), None, "nsys")
    if is_sqlite(path):
        return Trace(path, read_sqlite(path), None, "nsys")
    try:
        check_trace_bytes(path)
    except ValueError as exc:
        raise ValueError(f"file: {exc}") from None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"file: {path} is not a trace written by overlap: "
                         f"{type(exc).__name__}: {exc}") from None
    if is_kineto(data):
        try:
            return Trace(path, kineto_work(data), None, "kineto", distributed_rank(data))
        except ValueError as exc:
            raise ValueError(f"file: {path}: {exc}") from None
    try:
        tl = Timeline.from_chrome_json(data, path)
    except ValueError as exc:  # (named after this command's argument)
        raise ValueError(f"file: {str(exc).removeprefix('path: ')}") from None
    return Trace(path, Capture(tuple(timeline_work(tl))), tl, "overlap")


def in_rank_order(traces: Sequence[Trace]) -> list[tuple[int, Trace]]:
    """Each trace with its rank, in rank order: by the rank each names (a PyTorch trace's
    ``distributedInfo.rank``, as Holistic Trace Analysis orders them) when every one names
    its own, else in the order given, numbered from 0. ValueError naming both files when
    two name the same rank."""
    if any(t.rank is None for t in traces):
        return list(enumerate(traces))
    seen: dict[int, Path] = {}
    for t in traces:
        if t.rank in seen:
            raise ValueError(f"file: {seen[t.rank]} and {t.path} are both rank {t.rank} (their "
                             "distributedInfo.rank): give one file per rank")
        seen[t.rank] = t.path  # type: ignore[index]
    return sorted(((t.rank, t) for t in traces), key=lambda kt: kt[0])  # type: ignore[misc]


def file_report(trace: Trace, rank: int = 0) -> FileReport:
    """The figures of one file read, reported as rank ``rank``."""
    tl = trace.timeline
    if tl is not None:  # ours: the waits along the step graph's data edges
        return FileReport(trace.path, trace.source, {d: tl.figures(d) for d in tl.devices},
                          {d: (tl.stage_of[d],) for d in tl.devices},
                          {}, {"steps": 1, "iteration_ms": tl.iteration_time * 1e3,
                               "bubble_pct": 100.0 * tl.bubble_fraction}, rank=rank)
    work = trace.capture.work
    stages: dict[int, set[int]] = {}
    for w in work:
        op = parse_name(w.label) if w.device is not None else None
        if op is not None and w.category == "compute":
            stages.setdefault(w.device, set()).add(op.stage)  # type: ignore[arg-type]
    return FileReport(trace.path, trace.source, device_figures(work),
                      {d: tuple(sorted(s)) for d, s in stages.items()},
                      unattributed_figures(work), step_figures(trace.capture),
                      gpu_times(work), rank)


def check_ranks(reports: Sequence[FileReport]) -> None:
    """ValueError naming the files when a device is in two of them (one file per rank)."""
    seen: dict[int, Path] = {}
    for r in reports:
        for d in r.devices:
            if d in seen:
                raise ValueError(f"file: device {d} is in both {seen[d]} and {r.path}: give "
                                 "one file per rank, each holding its own devices")
            seen[d] = r.path


def merged_steps(reports: Sequence[FileReport]) -> dict[str, float] | None:
    """The job's steps from its ranks': the fewest steps, the longest iteration, the bubble
    averaged over every device (None when no rank has step ranges)."""
    timed = [r for r in reports if r.steps is not None]
    if not timed:
        return None
    if len(timed) == 1:
        return timed[0].steps
    weights = [max(1, len(r.devices)) for r in timed]
    return {"steps": min(r.steps["steps"] for r in timed),  # type: ignore[index]
            "iteration_ms": max(r.steps["iteration_ms"] for r in timed),  # type: ignore[index]
            "bubble_pct": sum(w * r.steps["bubble_pct"]  # type: ignore[index]
                              for w, r in zip(weights, timed)) / sum(weights)}


def report_json(reports: Sequence[FileReport]) -> dict[str, Any]:
    """The JSON of ``overlap trace report --json`` (see the command's help)."""
    from ..exposure import DEFINITION

    out: dict[str, Any] = {"definition": DEFINITION, "devices": {}, "unattributed": [],
                           "gpus": []}
    for r in reports:
        for d, f in r.devices.items():
            out["devices"][str(d)] = {**f.as_json(), "stages": list(r.stages.get(d, ())),
                                      "rank": r.rank}
        out["unattributed"] += [{"rank": r.rank, "gpu": g, **f.as_json()}
                                for g, f in r.unattributed.items()]
        out["gpus"] += [{"rank": r.rank, "gpu": g, **t.as_json()} for g, t in r.gpus.items()]
    out.update(merged_steps(reports) or {})
    out["ranks"] = [{"rank": r.rank, "file": str(r.path), "source": r.source,
                     "devices": sorted(r.devices), **(r.steps or {})} for r in reports]
    return out


def report_text(reports: Sequence[FileReport]) -> str:
    """The text of ``overlap trace report``: per-rank lines (several files), then the one
    per-device table, then unattributed work, then what the columns mean."""
    many = len(reports) > 1
    lines = [f"{len(reports)} files, one per rank:" if many else ""]
    for r in reports:
        lines.append(("  rank " + str(r.rank) + ": " if many else "") + _file_line(r))
    devices = [(*((r.rank,) if many else ()), d, _stages(r.stages.get(d, ())), f)
               for r in reports for d, f in r.devices.items()]
    if devices:
        lines.append("per device:")
        lines.append(device_table(devices, ("rank", "device", "stage") if many else
                                  ("device", "stage")))
    gpus = [(*((r.rank,) if many else ()), g if g >= 0 else "-", f)
            for r in reports for g, f in r.unattributed.items()]
    if gpus:
        lines.append("unattributed (GPU work inside none of the runtime's ranges, per GPU; "
                     "counted on no device):")
        lines.append(device_table(gpus, ("rank", "GPU") if many else ("GPU",)))
    times = [(*((r.rank,) if many else ()), g, t) for r in reports for g, t in r.gpus.items()]
    if times:
        lines.append("per GPU, all its work (kernels classed as Holistic Trace Analysis "
                     "classes them):")
        lines.append(gpu_table(times, ("rank", "GPU") if many else ("GPU",)))
    if devices or gpus:
        lines.append("exposed: communication while the device computed nothing; overlap %: "
                     "the rest of it, hidden under compute;\nwaited: its compute stream idle "
                     "while a transfer bringing its next op's input ran (part of exposed).")
    if times:
        lines.append("span: a GPU's first start to its last end; idle: no work of it ran; "
                     "non-compute: some ran, none of it compute\n(communication, memcpy, "
                     "memset, synchronization).")
    return "\n".join(line for line in lines if line)


GPU_COLUMNS = ("span ms", "idle ms", "compute ms", "non-compute ms")


def gpu_table(rows: Sequence[tuple[Any, ...]], keys: Sequence[str]) -> str:
    """The per-GPU table: each row's ``keys`` columns, then its :class:`GpuTime` (last item)
    under :data:`GPU_COLUMNS`."""
    head = [*keys, *GPU_COLUMNS]
    body = [[*map(str, key), *(f"{v * 1e3:.3f}" for v in (t.span, t.idle, t.compute,
                                                          t.non_compute))]
            for *key, t in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(row, widths))
                     for row in (head, *body))


def _stages(stages: tuple[int, ...]) -> str:
    return ",".join(map(str, stages)) or "-"


def _file_line(r: FileReport) -> str:
    head = f"{r.path} ({SOURCES[r.source]})"
    if not r.devices and not r.unattributed and not r.gpus:
        return (f"{head}: no work in it — neither GPU work nor the runtime's ranges (Nsight: "
                "`nsys profile -t cuda,nvtx`; PyTorch: record with overlap.torch.profiler(), "
                "which records the runtime's threads)")
    if r.steps is None:
        return (f"{head}: no step ranges in it, so no iteration time or bubble (the runtime "
                "opens one per train_step)")
    n = int(r.steps["steps"])
    return (f"{head}: {n} step{'s' * (n != 1)}, iteration {r.steps['iteration_ms']:.3f} ms"
            f"{' (mean)' if n > 1 else ''}, bubble {r.steps['bubble_pct']:.1f}%")


def _exported(report: Path) -> Path:
    """The SQLite export of an ``.nsys-rep``: the one next to it when it is newer, else made
    with ``nsys`` when on PATH — next to it when no file has that name, else in a new
    temporary directory (a file the user did not name is never replaced)."""
    import shutil
    import subprocess
    import tempfile

    out = report.with_suffix(".sqlite")
    if out.is_file() and out.stat().st_mtime >= report.stat().st_mtime:
        return out
    if out.exists():  # (an older export, or anything else of that name: left alone)
        out = Path(tempfile.mkdtemp(prefix="overlap-nsys-")) / out.name
    nsys = shutil.which("nsys")
    if nsys is None:
        raise ValueError(f"{report}: a .nsys-rep is read through its SQLite export, and `nsys` "
                         f"is not on PATH here: run `nsys export --type sqlite {report}` "
                         "where Nsight Systems is installed (or capture with `nsys profile "
                         "--export sqlite`), then report the .sqlite")
    done = subprocess.run([nsys, "export", "--type", "sqlite", "--output", str(out),
                           str(report)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.is_file():
        raise ValueError(f"{report}: `nsys export` failed: {done.stderr.strip()[-500:]}")
    return out
