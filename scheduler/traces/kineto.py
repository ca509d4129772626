"""Reading a PyTorch profiler (Kineto) Chrome trace into a
:class:`~scheduler.traces.capture.Capture`, as :mod:`scheduler.traces.nsys` reads an Nsight
Systems export.

GPU work (``kernel``, ``gpu_memcpy``, ``gpu_memset`` events, and ``cuda_sync`` events on a
stream: ``args.stream`` >= 0; a context's or an event's synchronization has none, and is the
host's wait) is joined to its launch (the ``cuda_runtime`` or ``cuda_driver`` event with the
same ``args.correlation``) and attributed to the innermost ``user_annotation`` range
(``torch.profiler.record_function``) on the launching thread whose message is one of the
runtime's ranges (``F s1 mb3 on device 5``, ``reshard ...``); work inside none is
unattributed (reported per CUDA device, ``args.device``), as is every synchronization (a
wait, not an op's work). Each is classed as :mod:`scheduler.traces.gpu_time` says (memcpy and
memset: memory; a synchronization: other; a kernel by its name).
A trace without GPU work — the CPU backend's — is read from those ranges themselves: each is
its op's work on its device. Steps: ``user_annotation`` ranges ``step N``
(the runtime's, through the torch adapter) or ``ProfilerStep#N`` (``prof.step()``). Times are
microseconds in the file. A trace of one rank of a job names it in ``distributedInfo.rank``
(:func:`distributed_rank`).

The runtime's ops run on its stream threads: record with ``overlap.torch.profiler()`` (every
thread), or the trace holds the caller's thread only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..intervals import MAX_ID, check_id, scaled_interval
from .capture import STEP, Capture, check_trace_bytes, classify, innermost, range_work, step_windows

# Kineto's category of GPU work -> what it recorded (scheduler.traces.gpu_time.ACTIVITIES).
ACTIVITY = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset",
            "cuda_sync": "sync"}
GPU_CATEGORIES = tuple(ACTIVITY)
# Launch calls: the runtime API's, and the driver API's (CuPy launches its kernels with
# cuLaunchKernel; recent Kineto versions record those as "cuda_driver").
LAUNCHES = ("cuda_runtime", "cuda_driver")
OUR_RANGE = ("F s", "B s", "I s", "W s", "reshard ", "grad ")


# Event categories of the PyTorch profiler, none of which our own traces use (theirs are
# "compute" and "comm"): a trace without GPU work still has its CPU ops and ranges.
CATEGORIES = frozenset((*GPU_CATEGORIES, *LAUNCHES, "cpu_op", "user_annotation",
                        "python_function", "cpu_instant_event", "gpu_user_annotation", "Trace"))


def is_kineto(data: Any) -> bool:
    """Whether parsed trace JSON is a PyTorch profiler trace: it has the profiler's
    ``schemaVersion`` or events of its categories (with or without GPU work)."""
    events = data.get("traceEvents") if isinstance(data, dict) else None
    return isinstance(events, list) and ("schemaVersion" in data or any(
        isinstance(e, dict) and e.get("cat") in CATEGORIES for e in events))


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def distributed_rank(data: dict[str, Any]) -> int | None:
    """The rank of the job's process that wrote the trace (``distributedInfo.rank``, as
    ``torch.distributed`` sets it), None when the trace does not say; ValueError when it
    says something that is no rank."""
    info = data.get("distributedInfo")
    if info is None:
        return None
    if not isinstance(info, dict):
        raise ValueError(f"its distributedInfo is {info!r}, not an object")
    rank = info.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ValueError(f"its distributedInfo.rank is {rank!r}, not a rank (an integer >= 0)")
    return rank


def _on_a_stream(e: dict[str, Any]) -> bool:
    """Whether a GPU event ran on a stream: every kernel, memcpy and memset; a
    synchronization only when it names one (a context's or an event's has stream -1)."""
    if e.get("cat") != "cuda_sync":
        return True
    stream = e.get("args", {}).get("stream")
    return _is_number(stream) and stream >= 0


def _check_event(e: dict[str, Any], what: str) -> None:
    """ValueError naming ``what`` and the field: its times (microseconds: numbers within a
    capture, :func:`~scheduler.intervals.scaled_interval`), its process and thread (an
    integer — not a bool, ``true`` is no thread 1 — or a name), and the ids in its args
    (``device``, ``correlation``, ``stream``: integers)."""
    scaled_interval(e.get("ts"), e.get("dur", 0), 1e-6, what)
    for key in ("pid", "tid"):
        v = e.get(key)
        if v is not None and not isinstance(v, str):
            check_id(v, what, key, lo=-MAX_ID)
    args = e.get("args", {})
    for key in ("device", "correlation", "stream"):
        if key in args:
            check_id(args[key], what, f"args.{key}", lo=-1)


def read_kineto(path: str | Path) -> Capture:
    """Every piece of GPU work of the trace, attributed, and its steps (see module doc)."""
    try:
        check_trace_bytes(Path(path))
    except OSError as exc:
        raise ValueError(f"{path}: not a readable JSON trace ({type(exc).__name__})") from None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not a readable JSON trace ({type(exc).__name__})") from None
    if not is_kineto(data):
        raise ValueError(f"{path}: not a PyTorch profiler trace (none of its events)")
    return kineto_work(data)


def kineto_work(data: dict[str, Any]) -> Capture:
    """:func:`read_kineto` of a trace already parsed (one that :func:`is_kineto`);
    ValueError naming the first malformed event."""
    events = [e for e in data["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    for k, e in enumerate(events):
        what = f"traceEvents: event {k} ({str(e.get('name', ''))[:60]!r})"
        if not isinstance(e.get("args", {}), dict):
            raise ValueError(f"{what}: its args are {e['args']!r}, not an object")
        _check_event(e, what)
    ranges: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    launches: dict[Any, tuple[tuple[Any, Any], float]] = {}
    steps = []
    for e in events:
        cat, where, name = e.get("cat"), (e.get("pid"), e.get("tid")), str(e.get("name", ""))
        if cat == "user_annotation" and STEP.match(name):
            steps.append((name, e["ts"] * 1e-6, (e["ts"] + e.get("dur", 0)) * 1e-6))
        elif cat == "user_annotation" and name.startswith(OUR_RANGE):
            ranges.setdefault(where, []).append((e["ts"], e["ts"] + e.get("dur", 0), name))
        elif cat in LAUNCHES and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (where, e["ts"])
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES and _on_a_stream(e)]
    if not gpu:  # the CPU backend's: the ranges are the work
        work = [range_work(name, a * 1e-6, b * 1e-6)
                for rs in ranges.values() for a, b, name in rs]
        return Capture(tuple(work), step_windows(steps))
    for rs in ranges.values():
        rs.sort()
    work = []
    for e in gpu:
        args = e.get("args", {})
        launch = launches.get(args.get("correlation"))
        label = innermost(ranges.get(launch[0], []), launch[1]) if launch else None
        start = e["ts"] * 1e-6
        work.append(classify(label, str(e.get("name", "")), int(args.get("device", 0)), start,
                             start + e.get("dur", 0) * 1e-6, activity=ACTIVITY[e["cat"]]))
    return Capture(tuple(work), step_windows(steps))
