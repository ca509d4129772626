"""Backends: where streams, events and collectives live.

``cpu`` (virtual devices in this process; the default and how everything is tested) and
``cuda`` (the same structure on CuPy streams, events and NCCL; imported only when asked for, so
``import overlap`` never needs CuPy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..world import Placement, World
from .cpu import Busy, CpuBackend, CpuEvent, CpuStream, TraceRecord

if TYPE_CHECKING:
    from .distributed import Distributed

BACKENDS = ("cpu", "cuda")


class Event(Protocol):
    """Recorded on a stream; done when the stream gets there (or failed with its error)."""

    def done(self) -> bool: ...
    async def wait(self) -> None: ...
    def add_done_callback(self, cb: Callable[[Any], None]) -> None: ...


class Stream(Protocol):
    """A FIFO of device work (CUDA stream semantics)."""

    device: int
    name: str

    def launch(self, label: str, fn: Callable[[], Any], *, category: str = "compute",
               op: int | None = None, stepped: bool = False) -> None: ...
    def record(self, label: str = "", *, event: Any = None) -> Event: ...
    def wait_event(self, event: Any) -> None: ...


class Backend(Protocol):
    """What the runtime needs from a backend — the type it declares and uses. Collectives are
    called from stream work and match participants by launch position on a communicator per
    (namespace, device group), as NCCL does; ``timeout`` bounds every blocking wait.

    ``placement``/``rank``: which process drives which device (None in one process);
    ``dist``: a multi-process flavour's messaging layer (agreement, shared values, failure
    notices: :class:`~overlap.backends.distributed.Distributed`), composed with the backend;
    None in one process."""

    name: str
    xp: Any  # the array module: numpy or cupy
    num_devices: int
    timeout: float
    trace: list[TraceRecord] | None
    on_failure: Callable[[BaseException], None] | None
    placement: Placement | None
    rank: int
    dist: Distributed | None
    events_end_work: bool  # an event completes when its work is done (not just launched)

    def stream(self, device: int, name: str = "compute") -> Stream: ...
    def streams(self) -> list[Any]: ...
    def broadcast(self, devices: Sequence[int], device: int, root: int, buffer: np.ndarray,
                  desc: str, namespace: str = "", tag: int | None = None) -> None: ...
    def all_reduce(self, devices: Sequence[int], device: int, buffer: np.ndarray, desc: str,
                   op: Callable[[np.ndarray, np.ndarray], np.ndarray] = ...,
                   namespace: str = "", tag: int | None = None) -> None: ...
    def all_gather(self, devices: Sequence[int], device: int, buffer: np.ndarray,
                   out: np.ndarray, desc: str, namespace: str = "",
                   tag: int | None = None) -> None: ...
    def steps_broadcast(self, devices: Sequence[int], device: int) -> bool: ...
    def broadcast_steps(self, devices: Sequence[int], device: int, root: int, buffer: Any,
                        desc: str, namespace: str = "",
                        tag: int | None = None) -> Iterator[float]: ...
    def new_event(self, label: str = "") -> Any: ...
    def caller_events(self) -> list[Any]: ...
    def release_to_caller(self, ends: Sequence[Any]) -> None: ...
    def hold(self, *buffers: Any) -> None: ...
    def declare_group(self, namespace: str, devices: Sequence[int]) -> None: ...
    def declare_subgroups(self, namespace: str, groups: Sequence[Sequence[int]]) -> None: ...
    def is_local(self, device: int) -> bool: ...
    def start_trace(self) -> None: ...
    def profiler(self, on: bool) -> None: ...
    def span_seconds(self, mark: Any) -> float: ...
    def current_stream(self) -> Any: ...
    def abort(self, reason: str) -> None: ...
    @property
    def abort_reason(self) -> str | None: ...
    def note_failure(self, exc: BaseException) -> None: ...
    def quiesce(self, timeout: float | None = None) -> bool: ...
    def busy(self) -> list[Busy]: ...
    def op_since(self, b: Busy) -> float: ...
    def stop(self, until: Callable[[Busy], float]) -> list[Busy]: ...
    def stop_hung(self, grace: float = ...) -> list[Busy]: ...
    def abandon(self, stuck: Sequence[Busy], reason: str) -> None: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...
    @property
    def failures(self) -> list[BaseException]: ...


def make_backend(name: str, num_devices: int, *, timeout: float = 30.0,
                 link_time: Callable[[int, Sequence[int], int], float] | None = None,
                 world: World | None = None, placement: Placement | None = None) -> Backend:
    """A backend of ``name``; with a multi-process ``world``, its MPI flavour (this process
    drives the devices ``placement`` gives its rank)."""
    if name not in BACKENDS:
        raise ValueError(f"backend: unknown {name!r}; available: {BACKENDS}")
    if world is not None and world.distributed:
        if name == "cuda":
            from .cuda_mpi import CudaMpiBackend

            return CudaMpiBackend(num_devices, world=world, placement=placement,
                                  timeout=timeout)
        from .mpi import MpiBackend

        return MpiBackend(num_devices, world=world, placement=placement, timeout=timeout)
    if name == "cpu":
        return CpuBackend(num_devices, timeout=timeout, link_time=link_time)
    if name == "cuda":
        from .cuda import CudaBackend

        return CudaBackend(num_devices, timeout=timeout, link_time=link_time)
    raise ValueError(f"backend: unknown {name!r}; available: {BACKENDS}")


__all__ = ["BACKENDS", "Backend", "Busy", "CpuBackend", "CpuEvent", "CpuStream", "Event", "Stream",
           "TraceRecord", "make_backend"]
