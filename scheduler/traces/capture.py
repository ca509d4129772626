"""GPU work from any profiler, attributed to the runtime's ranges, and the figures that say
how much communication was hidden — the same for Nsight Systems exports
(:mod:`scheduler.traces.nsys`), PyTorch profiler traces (:mod:`scheduler.traces.kineto`) and our own
timelines.

**Attribution**: a piece of GPU work belongs to the innermost range of the runtime (the
``overlap`` NVTX domain; ``record_function`` ranges in a PyTorch trace) on the thread that
launched it, that encloses its launch call. The range messages name the device (``... on
device 5``) and the op: a compute op starts with its kind (``F s1 mb3 ...``), communication
names a resharding (``reshard ...``, ``grad ...``). Work inside no range is **unattributed**:
reported per GPU apart from every device (several of the runtime's devices may share one GPU;
none is guessed), of the class the work itself has (:func:`scheduler.traces.gpu_time.gpu_class`, as
Holistic Trace Analysis classes it: compute, comm — an NCCL kernel —, memory — memcpy,
memset —, other — a synchronization); only its compute and comm enter the figures. A
synchronization is never attributed: it is a wait, not work an op launched. A trace without
GPU work (the CPU backend's, under the PyTorch profiler) is read from the ranges themselves:
each is the work of its op on its device.

**Figures** per device: :mod:`scheduler.exposure` (one definition for every source).

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

from ..exposure import Figures, figures_of, waited_by_name
from ..intervals import check_interval, length, minus, union
from .gpu_time import gpu_class

_DEVICE = re.compile(r"\bon device (\d+)\b")
_COMPUTE = re.compile(r"^[FBIW] s\d+")
STEP = re.compile(r"^(?:step |ProfilerStep#)(\d+)$")
# The capture window's environment variable: ``overlap profile --steps`` sets it, the runtime
# reads it (overlap.profiling).
PROFILE_STEPS_ENV = "OVERLAP_PROFILE_STEPS"
_WINDOW = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")
# A JSON trace is parsed whole: one of 64 MiB takes ~0.5 GB and ~10 s of CPU to report here
# (2 cores); a bigger one is refused before it is read.
MAX_TRACE_BYTES = 64 << 20


def check_trace_bytes(path: Path) -> None:
    """ValueError naming ``path`` when its JSON trace is over :data:`MAX_TRACE_BYTES`."""
    size = path.stat().st_size
    if size > MAX_TRACE_BYTES:
        raise ValueError(f"{path} is {size} bytes; a JSON trace is at most {MAX_TRACE_BYTES} "
                         f"({MAX_TRACE_BYTES >> 20} MiB): capture fewer steps (overlap profile "
                         "--steps A:B)")


@dataclass(frozen=True)
class GpuWork:
    """One piece of GPU work: where, when (seconds), what it counts as, and why (the range
    it belongs to, or its kernel name). ``device`` is the runtime's device it is attributed
    to, None when it is unattributed (inside none of the runtime's ranges); ``gpu`` the CUDA
    device that ran it (-1: none, work of the CPU backend). ``category`` is what the report
    counts it as: compute or comm for attributed work (its range says which), its ``kind``
    for unattributed work; ``kind`` is the class of the work itself
    (:func:`~scheduler.traces.gpu_time.gpu_class`: compute, comm, memory, other; "" for work no
    GPU ran)."""

    device: int | None
    start: float
    end: float
    category: str  # "compute", "comm"; unattributed also "memory", "other"
    label: str
    gpu: int = -1
    kind: str = ""


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


def classify(label: str | None, name: str, gpu: int, start: float, end: float,
             what: str = "an event", activity: str = "kernel") -> GpuWork:
    """The work ``name`` that GPU ``gpu`` ran from ``start`` to ``end``, recorded as
    ``activity`` (see :data:`~scheduler.traces.gpu_time.ACTIVITIES`), launched inside the runtime's
    range ``label`` (None: inside none — unattributed)."""
    start, end = check_interval(start, end, what)
    kind = gpu_class(name, activity)
    # The range decides for what an op launched — the runtime's transfers are copy kernels,
    # communication by their range — but a synchronization is no op's work, only a wait.
    if label is not None and activity != "sync":
        return _range_work(label, start, end, gpu, kind)
    return GpuWork(None, start, end, kind, name, gpu, kind)


def range_work(label: str, start: float, end: float) -> GpuWork:
    """A range of the runtime taken as its op's work, where no GPU ran any (the CPU
    backend's): compute or communication by its name, on the device it names."""
    return _range_work(label, *check_interval(start, end, repr(label)), -1, "")


def _range_work(label: str, start: float, end: float, gpu: int, kind: str) -> GpuWork:
    m = _DEVICE.search(label)
    category = "compute" if _COMPUTE.match(label) else "comm"
    return GpuWork(int(m.group(1)) if m else None, start, end, category, label, gpu, kind)


# ---- per-device figures ------------------------------------------------------------------------


def device_figures(work: Iterable[GpuWork]) -> dict[int, Figures]:
    """Per device the work is attributed to, its :class:`~scheduler.exposure.Figures`: the
    waits for transfers found by the runtime's range names."""
    by_device: dict[int, list[GpuWork]] = {}
    for w in work:
        if w.device is not None and w.category in ("compute", "comm"):
            by_device.setdefault(w.device, []).append(w)
    return {d: _figures(ws, waited_by_name((w.category, w.label, w.start, w.end)
                                           for w in ws))
            for d, ws in sorted(by_device.items())}


def unattributed_figures(work: Iterable[GpuWork]) -> dict[int, Figures]:
    """Per GPU with unattributed compute or communication, their figures (no waits: no op
    is known there); its memory and other work is in no figure (see
    :func:`~scheduler.traces.gpu_time.gpu_times` for all of a GPU's time)."""
    by_gpu: dict[int, list[GpuWork]] = {}
    for w in work:
        if w.device is None and w.category in ("compute", "comm"):
            by_gpu.setdefault(w.gpu, []).append(w)
    return {g: _figures(ws, None) for g, ws in sorted(by_gpu.items())}


def _figures(work: Sequence[GpuWork], waited: float | None) -> Figures:
    return figures_of([(w.start, w.end) for w in work if w.category == "compute"],
                      [(w.start, w.end) for w in work if w.category == "comm"], waited)


def timeline_work(timeline: object) -> list[GpuWork]:
    """The spans of one of our own timelines (measured or simulated) as :class:`GpuWork`:
    the compute stream's are compute, every other stream's communication."""
    return [GpuWork(sp.device, sp.start, sp.end, "compute" if sp.stream == "compute" else "comm",
                    sp.name) for sp in timeline.spans]  # type: ignore[attr-defined]


def step_figures(capture: Capture) -> dict[str, float] | None:
    """``steps``, ``iteration_ms`` (their mean length) and ``bubble_pct`` (100 × the share of
    the step windows each device's compute was idle, averaged over the devices that computed
    in them); None when the capture has no step ranges."""
    windows = union(capture.steps.values())
    if not windows:
        return None
    total = length(windows)
    by_device: dict[object, list[tuple[float, float]]] = {}
    for w in capture.work:
        if w.category == "compute":  # (unattributed work: per GPU)
            key = w.device if w.device is not None else ("gpu", w.gpu)
            by_device.setdefault(key, []).append((w.start, w.end))
    idle = [minus(windows, union(iv)) for iv in by_device.values()]
    idle = [i for i in idle if i < total]  # only devices that computed inside a step
    lengths = [b - a for a, b in capture.steps.values()]
    return {"steps": len(lengths), "iteration_ms": sum(lengths) / len(lengths) * 1e3,
            "bubble_pct": 100.0 * sum(idle) / (total * len(idle)) if idle else 0.0}
