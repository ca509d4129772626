"""GPU work from any profiler, attributed to the runtime's ranges, and the figures that say
how much communication was hidden — the same for Nsight Systems exports
(:mod:`scheduler.nsys`), PyTorch profiler traces (:mod:`scheduler.kineto`) and our own
timelines.

**Attribution**: a piece of GPU work belongs to the innermost range of the runtime (the
``overlap`` NVTX domain; ``record_function`` ranges in a PyTorch trace) on the thread that
launched it, that encloses its launch call. The range messages name the device (``... on
device 5``) and the op: a compute op starts with its kind (``F s1 mb3 ...``), communication
names a resharding (``reshard ...``, ``grad ...``). Work inside no range is communication when
it is an NCCL kernel (its name starts with ``nccl``), compute otherwise, on its CUDA device id.

**Steps**: the runtime opens one range per training step (``step N``, from its launch until
every op of it has completed — on the GPU too); a PyTorch trace's ``ProfilerStep#N`` ranges
count as well. A step's window runs from the earliest start to the latest end of its ranges
(several threads or processes may each have one); its iteration time is the window's length
and its bubble the share of it each device's compute was idle.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .intervals import check_interval

_DEVICE = re.compile(r"\bon device (\d+)\b")
_COMPUTE = re.compile(r"^[FBIW] s\d+")
STEP = re.compile(r"^(?:step |ProfilerStep#)(\d+)$")
# The capture window's environment variable: ``overlap profile --steps`` sets it, the runtime
# reads it (overlap.profiling).
PROFILE_STEPS_ENV = "OVERLAP_PROFILE_STEPS"
_WINDOW = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")


@dataclass(frozen=True)
class GpuWork:
    """One piece of GPU work: where, when (seconds), compute or communication, and why (the
    range it belongs to, or its kernel name)."""

    device: int
    start: float
    end: float
    category: str  # "compute" or "comm"
    label: str


def steps_window(steps: range | str, what: str) -> range:
    """A capture window — consecutive steps counted from 0 — from a ``range`` or ``"A:B"``
    (steps A to B-1) or ``"A"``; ValueError/TypeError naming ``what`` otherwise."""
    if isinstance(steps, str):
        m = _WINDOW.match(steps)
        if m is None:
            raise ValueError(f"{what}: expected 'A:B' (steps A to B-1, counting from 0) or "
                             f"'A', got {steps!r}")
        start = int(m.group(1))
        steps = range(start, int(m.group(2)) if m.group(2) is not None else start + 1)
    if not isinstance(steps, range):
        raise TypeError(f"{what}: expected a range of step numbers or 'A:B', got "
                        f"{type(steps).__name__}")
    if steps.step != 1 or steps.start < 0 or len(steps) == 0:
        raise ValueError(f"{what}: expected consecutive steps from 0 up, got {steps!r} (one "
                         "capture is one contiguous window)")
    return steps


@dataclass(frozen=True)
class Capture:
    """What a profile holds: its GPU work, and each step's window (step number -> (start,
    end) seconds), empty when the source has no step ranges."""

    work: tuple[GpuWork, ...]
    steps: Mapping[int, tuple[float, float]] = field(default_factory=dict)


def step_windows(ranges: Iterable[tuple[str, float, float]]) -> dict[int, tuple[float, float]]:
    """Step number -> its window, from (message, start, end) of every range that names a
    step (see :data:`STEP`; the runtime's ``step N`` when there are any, else torch's
    ``ProfilerStep#N``, which number steps their own way); other ranges are ignored."""
    kinds: dict[str, dict[int, tuple[float, float]]] = {"step ": {}, "ProfilerStep#": {}}
    for message, start, end in ranges:
        m = STEP.match(message)
        if m is not None:
            steps = kinds["step " if message.startswith("step ") else "ProfilerStep#"]
            n = int(m.group(1))
            a, b = steps.get(n, (start, end))
            steps[n] = (min(a, start), max(b, end))
    return dict(sorted((kinds["step "] or kinds["ProfilerStep#"]).items()))


def innermost(ranges: list[tuple[int, int, str]], t: int) -> str | None:
    """The message of the innermost range of ``ranges`` (sorted) that encloses ``t``: the
    latest-starting one, and of those starting together the shortest."""
    i = bisect.bisect_right(ranges, (t, float("inf"), ""))
    best = None
    for start, end, text in reversed(ranges[:i]):
        if best is not None and start < best[0]:
            break
        if start <= t <= end and (best is None or end <= best[1]):
            best = (start, end, text)
    return None if best is None else best[2]


def classify(label: str | None, name: str, device: int, start: float, end: float,
             what: str = "an event") -> GpuWork:
    start, end = check_interval(start, end, what)
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


def step_figures(capture: Capture) -> dict[str, float] | None:
    """``steps``, ``iteration_ms`` (their mean length) and ``bubble_pct`` (100 × the share of
    the step windows each device's compute was idle, averaged over the devices that computed
    in them); None when the capture has no step ranges."""
    windows = _union(capture.steps.values())
    if not windows:
        return None
    total = _length(windows)
    by_device: dict[int, list[tuple[float, float]]] = {}
    for w in capture.work:
        if w.category == "compute":
            by_device.setdefault(w.device, []).append((w.start, w.end))
    idle = [_minus(windows, _union(iv)) for iv in by_device.values()]
    idle = [i for i in idle if i < total]  # only devices that computed inside a step
    lengths = [b - a for a, b in capture.steps.values()]
    return {"steps": len(lengths), "iteration_ms": sum(lengths) / len(lengths) * 1e3,
            "bubble_pct": 100.0 * sum(idle) / (total * len(idle)) if idle else 0.0}


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
