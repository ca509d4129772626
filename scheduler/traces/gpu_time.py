"""What a GPU did, classed the way Holistic Trace Analysis (HTA, Meta's analyzer of PyTorch
profiler traces) classes it, so that a report of ours and HTA's agree on the same trace.

**Classes** of a piece of GPU work, by what the profiler recorded and its name:

- a memcpy or memset activity (Kineto's ``gpu_memcpy`` / ``gpu_memset`` events, Nsight's
  ``_MEMCPY`` / ``_MEMSET`` tables): ``memory``;
- a synchronization recorded on a stream (Kineto's ``cuda_sync`` events): ``other``;
- a kernel, by its name (case-sensitive; the patterns look at the name's first line only):

  - ``comm``: it starts with ``nccl`` and has ``Kernel`` after that (NCCL's kernels);
  - ``memory``: it starts with ``Memcpy``, ``Memset`` or ``dma``;
  - ``other``: it has ``Memcpy`` or ``Sync`` anywhere else;
  - ``compute``: every other kernel.

**Per GPU** (:class:`GpuTime`), from every piece of its work whatever range it belongs to:
``span`` from the first start to the last end; ``busy``, the time some work ran;
``compute``, the time some compute-class work ran; so ``idle = span - busy`` and
``non_compute = busy - compute`` (communication, memory and other work while no compute
ran) — HTA's temporal breakdown of a rank that drives one GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from ..intervals import Interval, length, union

CLASSES = ("compute", "comm", "memory", "other")
# What a source recorded a piece of GPU work as, before its name is read.
ACTIVITIES = ("kernel", "memcpy", "memset", "sync")


def gpu_class(name: str, activity: str = "kernel") -> str:
    """The class (one of :data:`CLASSES`) of GPU work ``name`` that the profiler recorded as
    ``activity`` (one of :data:`ACTIVITIES`); see the module doc for the rules."""
    if activity in ("memcpy", "memset"):
        return "memory"
    if activity == "sync":
        return "other"
    if activity != "kernel":
        raise ValueError(f"activity: expected one of {', '.join(ACTIVITIES)}, got {activity!r}")
    # HTA matches regular expressions whose "." stops at a line break: only the first line
    # of a (rarely) multi-line name is looked at.
    first = name.partition("\n")[0]
    if first.startswith("nccl") and "Kernel" in first[4:]:
        return "comm"
    if first.startswith(("Memcpy", "Memset", "dma")):
        return "memory"
    if "Memcpy" in first or "Sync" in first:
        return "other"
    return "compute"


class _Work(Protocol):
    gpu: int
    start: float
    end: float
    kind: str


@dataclass(frozen=True)
class GpuTime:
    """One GPU's time (seconds): ``span`` (first start to last end of its work), ``busy``
    (some work ran) and ``compute`` (some compute-class work ran)."""

    span: float
    busy: float
    compute: float

    @property
    def idle(self) -> float:
        """Time inside the span when none of the GPU's work ran."""
        return self.span - self.busy

    @property
    def non_compute(self) -> float:
        """Time some work ran but no compute: communication, memory and other work."""
        return self.busy - self.compute

    def as_json(self) -> dict[str, Any]:
        return {"span_ms": self.span * 1e3, "idle_ms": self.idle * 1e3,
                "compute_ms": self.compute * 1e3, "non_compute_ms": self.non_compute * 1e3}


def gpu_times(work: Iterable[_Work]) -> dict[int, GpuTime]:
    """Per GPU that ran some of ``work`` (its ``gpu`` >= 0; work of no GPU, as the CPU
    backend's, is left out), its :class:`GpuTime`, each piece counted by its own class
    (``kind``) whatever range it belongs to."""
    by_gpu: dict[int, list[tuple[Interval, bool]]] = {}
    for w in work:
        if w.gpu >= 0 and w.kind:
            by_gpu.setdefault(w.gpu, []).append(((w.start, w.end), w.kind == "compute"))
    out = {}
    for g, pieces in sorted(by_gpu.items()):
        everything = [iv for iv, _ in pieces]
        span = max(b for _, b in everything) - min(a for a, _ in everything)
        out[g] = GpuTime(span, length(union(everything)),
                         length(union(iv for iv, compute in pieces if compute)))
    return out


__all__ = ["ACTIVITIES", "CLASSES", "GpuTime", "gpu_class", "gpu_times"]
