"""Reading a PyTorch profiler (Kineto) Chrome trace the way :mod:`scheduler.nsys` reads an
Nsight Systems export: GPU work (``kernel``, ``gpu_memcpy``, ``gpu_memset`` events) joined to
its launch (the ``cuda_runtime`` event with the same ``args.correlation``) and attributed to
the innermost ``user_annotation`` range (``torch.profiler.record_function``) on the launching
thread whose message is one of the runtime's ranges (``F s1 mb3 on device 5``, ``reshard ...``);
work inside none is communication when it is an NCCL kernel, compute otherwise, on its CUDA
device (``args.device``). Times are microseconds in the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .nsys import GpuWork, _classify, _innermost

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
OUR_RANGE = ("F s", "B s", "I s", "W s", "reshard ", "grad ")


def is_kineto(data: Any) -> bool:
    """Whether parsed trace JSON is a PyTorch profiler trace (it has CUDA runtime or GPU work
    events, which our own traces never have)."""
    events = data.get("traceEvents") if isinstance(data, dict) else None
    return isinstance(events, list) and any(
        isinstance(e, dict) and e.get("cat") in (*GPU_CATEGORIES, "cuda_runtime")
        for e in events)


def read_kineto(path: str | Path) -> list[GpuWork]:
    """Every piece of GPU work of the trace, attributed (see module doc)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON trace ({exc})") from None
    if not is_kineto(data):
        raise ValueError(f"{path}: not a PyTorch profiler trace (no GPU work in it)")
    return kineto_work(data)


def kineto_work(data: dict[str, Any]) -> list[GpuWork]:
    """:func:`read_kineto` of a trace already parsed (one that :func:`is_kineto`)."""
    events = [e for e in data["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    ranges: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    launches: dict[Any, tuple[tuple[Any, Any], float]] = {}
    for e in events:
        cat, where = e.get("cat"), (e.get("pid"), e.get("tid"))
        if cat == "user_annotation" and str(e.get("name", "")).startswith(OUR_RANGE):
            ranges.setdefault(where, []).append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
        elif cat == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (where, e["ts"])
    for rs in ranges.values():
        rs.sort()
    work = []
    for e in events:
        if e.get("cat") not in GPU_CATEGORIES:
            continue
        args = e.get("args", {})
        launch = launches.get(args.get("correlation"))
        label = _innermost(ranges.get(launch[0], []), launch[1]) if launch else None
        start = e["ts"] * 1e-6
        work.append(_classify(label, str(e.get("name", "")), int(args.get("device", 0)), start,
                              start + e.get("dur", 0) * 1e-6))
    return work
