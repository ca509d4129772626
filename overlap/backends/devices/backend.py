"""The backend: a device kind and its transports, composed — what the runtime launches on
(see :mod:`overlap.backends`)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from scheduler import check_seconds

from ...errors import CollectiveAborted, OverlapRuntimeError
from ...scope import CancelScope
from ...waits import OneShot, block_on
from ...world import Placement
from .bound import Bound, Bounded
from .collectives import Communicators
from .routes import Route
from .streams import Busy, Event, Stream, Trace

# After a call's scope is cancelled, how long a stream may take to reach the end of that
# call's work (its waits wake at once; a transfer's part ends at its next look) before it
# counts as stuck, unless it runs an op that may still be within its time bound.
SETTLE_GRACE_S = 0.25
# How long a compute op already past its time bound counts as maybe just returned (see
# Backend.stop_bound): a few of the interpreter's switch intervals (5 ms by default), time
# for a thread that returned from a C call holding the GIL, and waits for it now, to run.
RETURN_GRACE_S = 4 * sys.getswitchinterval()


class LocalCollectives(Protocol):
    """The transport of collectives among this process's devices (a device kind makes it:
    :meth:`DeviceKind.transport`) — :class:`~.local.LocalTransport`, or the CUDA kind's
    ``CudaLocal``. Its participants meet by launch position; no tag names a collective."""

    def prepare(self, channels: dict[str, tuple[int, ...]]) -> None: ...
    def broadcast(self, group: tuple[int, ...], device: int, root: int, buffer: Any,
                  desc: str, namespace: str, scope: CancelScope) -> None: ...
    def all_reduce(self, group: tuple[int, ...], device: int, buffer: Any, desc: str,
                   op: Callable[[Any, Any], Any], namespace: str,
                   scope: CancelScope) -> None: ...
    def all_gather(self, group: tuple[int, ...], device: int, buffer: Any, out: Any,
                   desc: str, namespace: str, scope: CancelScope) -> None: ...


@runtime_checkable
class DeviceKind(Protocol):
    """What a :class:`Backend` (and its streams and in-process transport) asks of its
    devices: :class:`~.cpu.CpuDevices` (the host is the device) and ``cuda.CudaDevices``
    (CuPy streams, events and memory). A kind holds no stream of its own: the backend's
    :class:`~.streams.Stream` threads call it for each item."""

    name: str  # "cpu" or "cuda": the backend's name
    xp: Any  # the array module stage functions and transfers use (numpy or cupy)
    events_end_work: bool  # an event completes when the work before it is done (not launched)
    poll_s: float  # how long a stream's thread looks again for work before it sleeps

    def transport(self, backend: Backend) -> LocalCollectives:
        """The transport of collectives among this process's devices, for ``backend``."""
        ...

    # ---- a stream's items (on the stream's thread) ---------------------------------------

    def attach(self, stream: Stream) -> None:
        """The stream's thread starts."""
        ...

    def run(self, stream: Stream, fn: Callable[[], Any]) -> Any:
        """Run an op's host code on ``stream``; may return device work left in flight."""
        ...

    def mark(self, stream: Stream) -> Any:
        """A trace mark now on ``stream`` (read later by :meth:`span_seconds`)."""
        ...

    def record(self, stream: Stream, event: Event) -> None:
        """The stream reached a record of ``event``: enqueue what marks it on the device."""
        ...

    def waited(self, stream: Stream, event: Event, scope: CancelScope, what: str) -> None:
        """The stream's thread saw ``event`` reached: make the device wait for it too."""
        ...

    # ---- collectives' data movement (the in-process transport's) -------------------------

    def arrive(self) -> Any:
        """A participant's contribution is ready (what its ready mark is, if any)."""
        ...

    def loopback(self, arrivals: dict[int, tuple[Any, Any]],
                 work: Callable[[dict[int, Any]], None]) -> Any:
        """The last arriver moves every participant's bytes (``work``); returns what the
        participants' streams then wait for (:meth:`joined`)."""
        ...

    def joined(self, done: Any) -> None:
        """A participant's stream goes on after the collective's data movement."""
        ...

    def copy(self, dst: Any, src: Any) -> None:
        """Copy ``src``'s elements into ``dst``."""
        ...

    def receives_strided(self, group: Sequence[int]) -> bool:
        """Whether a broadcast among ``group`` may land in a strided view."""
        ...

    # ---- around a call -------------------------------------------------------------------

    def caller_events(self, backend: Backend) -> list[Event]:
        """Events a call's lanes wait for first (the caller's own device work so far)."""
        ...

    def release_to_caller(self, ends: Sequence[Event]) -> None:
        """Order the caller's later device work after ``ends``."""
        ...

    def join_ends(self, backend: Backend, ends: Sequence[Event]) -> list[Event]:
        """Fewer events, done once every one of ``ends`` is."""
        ...

    def hold(self, *buffers: Any) -> None:
        """Keep ``buffers`` alive until the device ran what the calling op launched."""
        ...

    def current_stream(self) -> Any:
        """The native stream of the calling op (None where streams are threads)."""
        ...

    def physical(self, device: int) -> int:
        """The GPU a virtual device runs on (the device itself on the CPU)."""
        ...

    def start_trace(self, backend: Backend) -> Any:
        """A trace's clock: what :meth:`span_seconds` reads marks against."""
        ...

    def span_seconds(self, clock: Any, mark: Any) -> float:
        """A mark as seconds since ``clock`` (after the work completed)."""
        ...

    def profiler(self, on: bool, gpus: Sequence[int]) -> None:
        """Start or stop the device profiler's capture on ``gpus``."""
        ...

    def close(self, streams: Sequence[Stream]) -> None:
        """The backend closed: release what the kind holds for ``streams``."""
        ...


@runtime_checkable
class Transport(Protocol):
    """A transport for collectives whose participants span processes (the job package's
    ``WireTransport`` over wires for the CPU kind, ``NcclTransport`` for CUDA), given to
    a :class:`Backend` when it is made. Each collective names itself by ``tag`` (a
    transfer's op id) as well as by its channel (``namespace``)."""

    def spans(self, group: Sequence[int]) -> bool:
        """Whether ``group``'s devices live in more than one process (else: in-process)."""
        ...

    def prepared(self, channels: dict[str, tuple[int, ...]],
                 groups: Sequence[tuple[str, tuple[int, ...]]]) -> bool:
        """Whether every communicator :meth:`prepare` would make exists already."""
        ...

    def prepare(self, channels: dict[str, tuple[int, ...]],
                groups: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        """Make the missing communicators, in the same order on every process (collective)."""
        ...

    def broadcast(self, order: tuple[int, ...], device: int, root: int, buffer: Any,
                  desc: str, namespace: str, tag: int | None, scope: CancelScope) -> None:
        ...

    def all_reduce(self, group: tuple[int, ...], device: int, buffer: Any, desc: str,
                   op: Callable[[Any, Any], Any], namespace: str, tag: int | None,
                   scope: CancelScope) -> None:
        ...

    def all_gather(self, group: tuple[int, ...], device: int, buffer: Any, out: Any,
                   desc: str, namespace: str, tag: int | None, scope: CancelScope) -> None:
        ...

    def receives_strided(self, group: Sequence[int]) -> bool:
        """Whether a broadcast among ``group`` may land in a strided view."""
        ...

    def hop(self, order: tuple[int, ...], device: int, root: int, namespace: str,
            nbytes: int) -> Any:
        """``device``'s part of a broadcast along ``order``, resolved once (a route's hop)."""
        ...

    def transfer(self, route: Route, buffer: Any, tag: int, scope: CancelScope) -> Any:
        """Run a route's part; returns the device work it left in flight, or None."""
        ...

    def forget(self) -> None:
        """After a failed call, once its work settled: what it left part-way is dropped."""
        ...

    def close(self) -> None:
        ...


def check_device_count(num_devices: int) -> int:
    """``num_devices`` if it is an int >= 1 (ValueError naming the argument otherwise)."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices: expected an int >= 1, got {num_devices!r}")
    return num_devices


class Backend(Bounded):
    """A device kind and its transports (see module doc): streams, events, collectives, the
    trace clock, and the end of a call's work.

    Args:
        devices: the device kind (:class:`DeviceKind`: :class:`~.cpu.CpuDevices`,
            ``cuda.CudaDevices``).
        num_devices: device ids are ``0..num_devices-1``.
        timeout: seconds a collective's rendezvous (or a wait on the wire) may wait for a
            participant before it raises, naming who never came.
        link_time: ``(root, receivers, nbytes) -> seconds`` a broadcast lasts at least (link
            emulation, one process); None: as fast as the copies.
        placement, rank: which process drives which device (several processes); None: this
            process drives every device.
        dist: the control plane of a multi-process job (the job package's ``Distributed``);
            the backend only closes it, last.
        transport: the transport of collectives that span processes (a :class:`Transport`),
            or a factory that makes it for this backend (``WireTransport`` and
            ``NcclTransport`` need the backend: its placement, its kind, its communicators),
            called once everything else is in place; None: one process.
    """

    def __init__(self, devices: DeviceKind, num_devices: int, *,
                 timeout: float | Bound = 30.0,
                 link_time: Callable[[int, Sequence[int], int], float] | None = None,
                 placement: Placement | None = None, rank: int = 0, dist: Any = None,
                 transport: Transport | Callable[[Backend], Transport] | None = None) -> None:
        check_device_count(num_devices)
        if not isinstance(devices, DeviceKind):
            raise TypeError(f"devices: expected a device kind (CpuDevices, CudaDevices: every "
                            f"member of DeviceKind), got {devices!r}")
        if transport is not None and not callable(transport) and not isinstance(
                transport, Transport):
            raise TypeError(f"transport: expected a Transport or a callable that makes one "
                            f"for the backend, got {transport!r}")
        if not isinstance(timeout, Bound):
            timeout = Bound(check_seconds("timeout", timeout))
        # Every wait of the backend reads it (``bound``): a call may widen it for itself.
        self.bound = timeout
        self.devices = devices
        self.name: str = devices.name
        self.xp: Any = devices.xp  # the array module: numpy or cupy
        self.events_end_work: bool = devices.events_end_work
        self.num_devices = num_devices
        self.link_time = link_time
        self.placement = placement
        self.rank = rank
        self._owned = frozenset(placement.devices_of(rank)) if placement is not None else None
        self.comms = Communicators(self.bound)
        self.local: LocalCollectives = devices.transport(self)
        # The control plane of a multi-process job (typed by the job package, which this one
        # never imports: the runtime's call reads it, the backend only closes it).
        self.dist: Any = dist
        self._streams: dict[tuple[int, str], Stream] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.lost: list[Busy] = []  # ops whose stream threads were abandoned, stuck in them
        # Last: a factory reads the backend it joins (all of the above). (A transport itself
        # is not callable.)
        self.remote: Transport | None = transport(self) if callable(transport) else transport

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, {self.num_devices} devices)"

    # ---- streams and events --------------------------------------------------------------

    def stream(self, device: int, name: str = "compute") -> Stream:
        if isinstance(device, bool) or not isinstance(device, int) or not (
                0 <= device < self.num_devices):
            raise ValueError(f"device: {device!r} is not in 0..{self.num_devices - 1}")
        if not self.is_local(device):
            assert self.placement is not None
            raise ValueError(f"device: {device} is owned by rank "
                             f"{self.placement.owners[device]}, not by this process (rank "
                             f"{self.rank})")
        key = (device, name)
        stream = self._streams.get(key)
        if stream is not None:
            return stream
        with self._lock:
            if self._closed:
                raise OverlapRuntimeError("backend is closed")
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = Stream(self, device, name)
            return stream

    def streams(self) -> list[Stream]:
        with self._lock:
            return list(self._streams.values())

    def new_event(self, label: str = "") -> Event:
        """An event to record later (``stream.record(event=...)``) that streams may already
        be told to wait for."""
        return Event(label)

    def is_local(self, device: int) -> bool:
        """Whether this process drives ``device`` (every device, in a one-process run)."""
        if self._owned is None:
            return 0 <= device < self.num_devices
        return device in self._owned

    # ---- collectives (called from stream work) -------------------------------------------

    def broadcast(self, devices: Sequence[int], device: int, root: int, buffer: Any,
                  desc: str, namespace: str = "", tag: int | None = None, *,
                  scope: CancelScope) -> None:
        """The root's ``buffer`` is copied into every other participant's ``buffer``.
        ``devices``: the participants, root included, receivers in the order a chain across
        processes takes them (a plan's); ``tag`` names the collective across processes (a
        transfer's op id; one process matches by launch position and ignores it)."""
        order = tuple(dict.fromkeys((root, *devices)))
        if self.remote is not None and self.remote.spans(order):
            self.remote.broadcast(order, device, root, buffer, desc, namespace, tag, scope)
            return
        self.local.broadcast(tuple(sorted(order)), device, root, buffer, desc, namespace,
                             scope)

    def all_reduce(self, devices: Sequence[int], device: int, buffer: Any, desc: str,
                   op: Callable[[Any, Any], Any] = np.add, namespace: str = "",
                   tag: int | None = None, *, scope: CancelScope) -> None:
        """Every participant's ``buffer`` becomes the reduction of all of them (in place)."""
        group = tuple(sorted(set(devices)))
        if self.remote is not None and self.remote.spans(group):
            self.remote.all_reduce(group, device, buffer, desc, op, namespace, tag, scope)
            return
        self.local.all_reduce(group, device, buffer, desc, op, namespace, scope)

    def all_gather(self, devices: Sequence[int], device: int, buffer: Any, out: Any,
                   desc: str, namespace: str = "", tag: int | None = None, *,
                   scope: CancelScope) -> None:
        """``out`` (on every participant) = the participants' buffers stacked in device
        order."""
        group = tuple(sorted(set(devices)))
        if self.remote is not None and self.remote.spans(group):
            self.remote.all_gather(group, device, buffer, out, desc, namespace, tag, scope)
            return
        self.local.all_gather(group, device, buffer, out, desc, namespace, scope)

    def route(self, order: Sequence[int], device: int, root: int, desc: str, namespace: str,
              nbytes: int) -> Route:
        """``device``'s part of a broadcast from ``root`` to the rest of ``order`` (the
        receivers in chain order), resolved once (see :mod:`.routes`)."""
        order = tuple(dict.fromkeys((root, *order)))
        hop = None
        if self.remote is not None and self.remote.spans(order):
            hop = self.remote.hop(order, device, root, namespace, nbytes)
        return Route(desc, namespace, root, order, device, nbytes,
                     self.receives_strided(order), hop)

    def transfer(self, route: Route, buffer: Any, tag: int, scope: CancelScope) -> Any:
        """Run ``route``'s part with ``buffer`` (the root's data, or where a receiver's
        lands); ``tag`` names the transfer across processes. Returns the device work it left
        in flight (across processes, a part whose messages are posted and nothing else is
        left to do: :class:`~.streams.DeviceWork`), or None once it is done."""
        if route.hop is not None:
            return self.remote.transfer(route, buffer, tag, scope)  # type: ignore[union-attr]
        self.local.broadcast(route.group, route.device, route.root, buffer, route.desc,
                             route.namespace, scope)
        return None

    def receives_strided(self, group: Sequence[int]) -> bool:
        """Whether a broadcast among ``group`` may land in a strided view of the destination
        (one copy, in place); where the transport needs contiguous memory (NCCL), receivers
        stage and unpack."""
        if self.remote is not None and self.remote.spans(group):
            return self.remote.receives_strided(group)
        return self.devices.receives_strided(group)

    async def prepare(self, channels: dict[str, tuple[int, ...]],
                      groups: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        """Before a call launches: every communicator its collectives need across processes
        — each channel's (``channels``: namespace -> its devices) and each stage-collective
        group's — made where missing, in the same order on every process (collective;
        off the event loop)."""
        self.local.prepare(channels)
        if self.remote is not None and not self.remote.prepared(channels, groups):
            await asyncio.to_thread(self.remote.prepare, channels, groups)

    # ---- around a call -------------------------------------------------------------------

    def caller_events(self) -> list[Event]:
        """Events a call's lanes wait for first: the caller's own device work so far (CUDA:
        its current CuPy and torch streams; none on the CPU)."""
        return self.devices.caller_events(self)

    def release_to_caller(self, ends: Sequence[Event]) -> None:
        """After a call: order the caller's later device work after the call's."""
        self.devices.release_to_caller(ends)

    def join_ends(self, ends: Sequence[Event]) -> list[Event]:
        """Events done once every one of ``ends`` (launched already) is done on its device:
        fewer to wait for (CUDA: one, after device-side waits for all; the CPU: ``ends``)."""
        return self.devices.join_ends(self, ends)

    def hold(self, *buffers: Any) -> None:
        """Called by an op done with ``buffers``: keep them alive until the device ran what
        the op launched (CUDA: CuPy's pool would hand the block to a later allocation)."""
        self.devices.hold(*buffers)

    def current_stream(self) -> Any:
        """The native stream of the calling op (CUDA: a CuPy stream; None on the CPU)."""
        return self.devices.current_stream()

    def physical(self, device: int) -> int:
        """The GPU a virtual device runs on (CUDA; the device itself on the CPU)."""
        return self.devices.physical(device)

    def start_trace(self) -> Trace:
        """A trace for one call's ops (the call hands it to its streams: ``OpReport.trace``)."""
        return Trace(self.devices.start_trace(self))

    def span_seconds(self, trace: Trace, mark: Any) -> float:
        """A trace mark as seconds since the trace started (after the work completed)."""
        return self.devices.span_seconds(trace.clock, mark)

    def profiler(self, on: bool) -> None:
        """Start or stop the device profiler's capture (CUDA: ``cudaProfilerStart/Stop`` on
        this process's GPUs); nothing on the CPU."""
        gpus = sorted({self.physical(d) for d in range(self.num_devices) if self.is_local(d)})
        self.devices.profiler(on, gpus)

    # ---- the end of a call's work --------------------------------------------------------

    def busy(self) -> list[Busy]:
        """What every stream still doing something is doing (empty: all idle)."""
        return [b for b in (s.busy() for s in self.streams()) if b is not None]

    def settle(self, until: Callable[[Busy], float]) -> list[Busy]:
        """Block until every stream has got through the work launched on it so far (work of
        a cancelled scope is skipped, its waits end at once), or until each stream still
        busy is past ``until(its Busy)`` (a perf_counter time); returns those (empty: all
        settled)."""
        probe = CancelScope("settling the streams")
        marks = [(s, s.record("settled", scope=probe)) for s in self.streams()
                 if s.thread is not None and s.lost is None]
        while True:
            pending = [(s, ev) for s, ev in marks if not ev.launched()]
            if not pending:
                return []
            now = time.perf_counter()
            stuck, wake_at = [], now + SETTLE_GRACE_S
            for s, _ in pending:
                b = s.busy()
                if b is None:
                    continue  # (between two items: it goes on)
                bound = until(b)
                if now >= bound:
                    stuck.append(b)
                else:
                    wake_at = min(wake_at, bound)
            if len(stuck) == len(pending):
                return stuck
            one = OneShot()  # (the first of them to get there)
            for _, ev in pending:
                if not ev.add_callback(one.finish):
                    one.finish()
            block_on(one, None, "settling the streams", max(1e-3, wake_at - now))

    def stop_bound(self, b: Busy, start: float) -> float:
        """When a stream still busy with ``b`` after its work was cancelled at ``start``
        counts as stuck (for :meth:`settle`): a wait or a transfer sees the cancellation at
        once — it gets the grace; a compute op (user code, which nothing can interrupt) may
        run until it has run ``timeout`` — it may be slow, not hung — and one past that
        is stuck after :data:`RETURN_GRACE_S`."""
        if b.waiting or b.category != "compute":
            return max(start, b.since) + SETTLE_GRACE_S
        hung = b.since + self.timeout
        # (One past its bound gets a moment: if it held the interpreter lock it may have
        # returned just now, its thread not yet run again to say so.)
        return max(hung, start + (RETURN_GRACE_S if hung <= start else SETTLE_GRACE_S))

    def forget(self) -> None:
        """After a failed call, once its work settled: the rendezvous it left part-way are
        dropped (launch positions start again at the next call, on every device)."""
        self.comms.forget()
        if self.remote is not None:
            self.remote.forget()

    def abandon(self, stuck: Sequence[Busy], reason: str) -> None:
        """Give up the threads of ``stuck`` streams: each is a daemon stuck in its op, which
        runs nothing more once the op returns; its stream refuses work."""
        for b in stuck:
            with self._lock:
                stream = self._streams.pop((b.device, b.stream), None)
            if stream is not None:
                stream.abandon(reason)
                self.lost.append(b)

    def close(self) -> None:
        """Stop every stream thread once it got through its queue (the caller cancelled the
        work first: its waits end at once); an op still running gets until it has run
        ``timeout`` seconds, then its thread is abandoned. Returns within ``timeout`` + a
        fraction of a second, whatever the ops do. Then the transports close."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        closed = CollectiveAborted("the backend closed")
        for b in self.busy():  # what runs now is cancelled: its waits end at once
            if b.scope is not None:
                b.scope.cancel(closed)
        start = time.perf_counter()
        stuck = self.settle(lambda b: self.stop_bound(b, start))
        self.abandon(stuck, "backend closed while this stream's thread was stuck in "
                     + ", ".join(b.label for b in stuck))
        threads = [t for t in (s.close() for s in self.streams()) if t is not None]
        for t in threads:
            t.join(SETTLE_GRACE_S)  # idle: they exit at once
        self.devices.close(self.streams())
        if self.remote is not None:
            self.remote.close()
        if self.dist is not None:
            self.dist.close()



__all__ = ["SETTLE_GRACE_S", "Backend", "DeviceKind", "LocalCollectives", "Transport",
           "check_device_count"]
