"""The CPU device kind: virtual devices in this process that behave like CUDA devices.

A device is a set of streams (:mod:`~overlap.backends.devices.streams`: a thread each) whose ops run
their host code directly; memory is numpy's; an event is done as soon as its stream got there
(the host *is* the device). Bytes really move — a broadcast copies the root's buffer into every
receiver's — and the stream and collective rules are CUDA's and NCCL's, so ordering bugs show
up here: that is how everything is tested.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...polling import POLL_FIRST_S
from .host_memory import keep_freed_host_memory
from .local import LocalTransport

if TYPE_CHECKING:
    from ...scope import CancelScope
    from .backend import Backend
    from .streams import Event, Stream


class CpuDevices:
    """The CPU device kind (see module doc): what a :class:`~overlap.backends.Backend` asks
    of its devices, with nothing to enqueue anywhere."""

    name = "cpu"
    xp = np  # the array module stage functions and transfers use
    # An event completes when its stream's work up to it is done (the host ran it).
    events_end_work = True
    # How long a stream's thread looks again for its next item or event before it sleeps
    # (overlap.polling): here the host is the device, and a wake-up costs more than a look.
    poll_s = POLL_FIRST_S

    def __init__(self) -> None:
        # The devices' memory is the process's heap: keep what is freed for the next step,
        # as a GPU's caching allocator does (.host_memory).
        keep_freed_host_memory()

    def transport(self, backend: Backend) -> LocalTransport:
        """The transport of collectives among this process's devices."""
        return LocalTransport(backend)

    # ---- a stream's items ----------------------------------------------------------------

    def attach(self, stream: Stream) -> None:
        """A stream's thread starts (nothing to make on the CPU)."""

    def run(self, stream: Stream, fn: Callable[[], Any]) -> Any:
        """Run an op's host code; what it returns may be device work left in flight (a
        transfer's messages: :class:`~.streams.DeviceWork`)."""
        return fn()

    def mark(self, stream: Stream) -> float:
        return time.perf_counter()

    def record(self, stream: Stream, event: Event) -> None:
        """The stream reached a record (nothing to enqueue on the CPU)."""

    def waited(self, stream: Stream, event: Event, scope: CancelScope, what: str) -> None:
        """The stream's thread waited for ``event`` to be reached; the host is the device, so
        it also waits for the device work recorded before it (messages still on the wire)."""
        if event.native is not None:
            event.native.block(scope, what)

    # ---- collectives' data movement (the in-process transport's) -------------------------

    def arrive(self) -> None:
        """A participant's contribution is ready (the host wrote it: nothing to mark)."""

    def loopback(self, arrivals: dict[int, tuple[Any, Any]],
                 work: Callable[[dict[int, Any]], None]) -> None:
        work({d: payload for d, (_, payload) in arrivals.items()})

    def joined(self, done: Any) -> None:
        """A participant's stream goes on after the collective's data movement (done)."""

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def receives_strided(self, group: Sequence[int]) -> bool:
        """A broadcast may land in a strided view of the destination (one copy, in place)."""
        return True

    # ---- around a call -------------------------------------------------------------------

    def caller_events(self, backend: Backend) -> list[Event]:
        """Events a call's lanes wait for first: none — the caller's work is done when it
        calls."""
        return []

    def release_to_caller(self, ends: Sequence[Event]) -> None:
        """After a call: the caller's later work follows it (done already on the CPU)."""

    def join_ends(self, backend: Backend, ends: Sequence[Event]) -> list[Event]:
        """The events themselves: each is done once launched, or once its wire work is."""
        return list(ends)

    def hold(self, *buffers: Any) -> None:
        """Keep ``buffers`` alive until the device ran what the calling op launched: it has,
        on the CPU."""

    def current_stream(self) -> None:
        """The native stream of the calling op (None: CPU streams are threads)."""
        return None

    def start_trace(self, backend: Backend) -> float:
        return time.perf_counter()

    def span_seconds(self, clock: float, mark: float) -> float:
        return mark - clock

    def profiler(self, on: bool, gpus: Sequence[int]) -> None:
        """Nothing: no GPU profiler records CPU work."""

    def physical(self, device: int) -> int:
        return device

    def close(self, streams: Sequence[Stream]) -> None:
        """Nothing held for the streams on the CPU."""


__all__ = ["CpuDevices"]
