"""The CUDA device kind: streams whose ops enqueue their work on CUDA streams (CuPy), events
that are CUDA events, device memory, NCCL between distinct GPUs.

Each (device, stream) keeps its host thread (:mod:`.streams`), as on the CPU — that is what
lets SPMD stage functions of several devices, driven by one process, call collectives. An op's
host code runs with its device's **non-blocking ``cupy.cuda.Stream``** current, so every
kernel it launches (user compute, pack/unpack copies, transfers) is enqueued there and the
host thread moves on at once:

- a record enqueues a CUDA event (blocking-sync: a host thread waiting for it sleeps); a wait
  makes the host thread wait only until the other stream has *enqueued* its record, then
  enqueues a device-side ``stream.wait_event`` — the host never waits for the GPU in the
  launch path;
- the event loop learns that the GPU passed an event from the **completion waiters**
  (:class:`CompletionWaiters`, a few daemon threads per backend that sleep in
  ``synchronize()``): polling with backoff under uvloop's 1 ms timers saw completions up to
  ~1.5 ms late on an H200. A wait is bounded: ``DeviceTimeout`` past the timeout (a kernel
  that never ends), ``DeviceFault`` at once when CUDA reports a sticky error;
- virtual devices map to GPUs round-robin (``device % num_gpus``; one GPU per process across
  processes). Collectives among devices that share a GPU are device-to-device copies on the
  last arriver's stream after every participant's ready event ("loopback", :mod:`.local`);
  among distinct GPUs, NCCL (:mod:`.nccl_groups`);
- CuPy has no ``record_stream``: every buffer a collective or an op touches is kept alive,
  with the event that ends its use, until that event has completed; CuPy's pool keeps freed
  blocks per stream, so closing gives back every stream's.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ...errors import CollectiveAborted, DeviceFault, DeviceTimeout, OverlapRuntimeError
from ...waits import OneShot, wait_on
from .bound import Bound, Bounded, bound_of
from .local import LocalTransport
from .streams import InFlight, current_stream

if TYPE_CHECKING:
    from ...scope import CancelScope
    from .backend import Backend
    from .streams import Event, Stream

WAITER_THREADS = 4  # several: one event that completes late does not delay the others'
MAX_WAITER_THREADS = 64  # spares, started while every thread is busy (stuck kernels)
LOOK_S = 0.01  # how often an awaited device event is looked at besides its waiter's answer


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise OverlapRuntimeError(
            "backend 'cuda' needs CuPy: pip install -e '.[cuda12]' (or '.[cuda13]') from the "
            "repository"
        ) from None
    return cupy


def gpu_count() -> int:
    """Visible CUDA devices (0 without CuPy or without a GPU)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


class CompletionWaiters:
    """``watch(event, done)``: ``done`` (a :class:`~overlap.waits.OneShot`) is finished —
    failed with the exception ``synchronize()`` raised: a device fault — once the GPU passed
    ``event``.

    Daemon threads of our own, not ``asyncio.to_thread``: a kernel that never ends keeps its
    waiter in ``synchronize()`` for good, and a stranded daemon can hang neither ``close()``
    nor the interpreter's exit, where an executor's threads are joined. ``threads`` wait at
    once; when every one is busy, a job starts one more (up to ``MAX_WAITER_THREADS``), so one
    stuck wait never delays another's answer."""

    def __init__(self, threads: int = WAITER_THREADS) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = threads
        self._started = 0
        self._idle = 0
        self._lock = threading.Lock()
        self._closed = False

    def watch(self, event: Any, done: OneShot) -> None:
        with self._lock:  # started on first use
            if self._closed:  # (its backend closed: no waiter would ever answer)
                raise CollectiveAborted(f"waiting for {event!r}: the backend is closed")
            want = self._threads if self._started < self._threads else self._started + 1
            if self._idle == 0 and self._started < min(want, MAX_WAITER_THREADS):
                self._started += 1
                self._idle += 1
                threading.Thread(target=self._serve, name=f"overlap-cuda-waiter-{self._started}",
                                 daemon=True).start()
            self._idle -= 1  # (a thread takes this job; negative: jobs are queued)
        self._jobs.put((event, done))

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            event, done = job
            error: BaseException | None = None
            try:
                event.synchronize()
            except BaseException as exc:  # a device fault: the awaiting coroutine raises it
                error = exc
            done.finish(error)  # (one given up on: nobody waits, nothing wakes)
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        """Idle waiters exit; one stuck behind an endless kernel stays (a daemon)."""
        with self._lock:
            n, self._closed = self._started, True
        for _ in range(n):
            self._jobs.put(None)


class CudaDevices(Bounded):
    """The CUDA device kind (see module doc).

    Args:
        timeout: how long a wait for the device may last (``DeviceTimeout`` past it).
        num_gpus: GPUs to use (default: every visible one).
    """

    name = "cuda"
    events_end_work = False  # (an event completes when launched; the GPU passes it later)
    # A stream's thread sleeps at once when it has nothing to do (streams.Stream._next),
    # not looking again first as the CPU kind's do: here its ops only enqueue, and a dozen
    # threads looking again take the interpreter lock from the stage threads that launch
    # kernels (the stand-in: 110.7 -> 88.9 µs of host per op; docs/benchmarks.md).
    poll_s = 0.0

    def __init__(self, *, timeout: float | Bound = 30.0, num_gpus: int | None = None) -> None:
        cp = _cupy()
        available = gpu_count()
        if available < 1:
            raise OverlapRuntimeError("backend 'cuda': no CUDA device is visible")
        if num_gpus is not None and not 1 <= num_gpus <= available:
            raise ValueError(f"num_gpus: {num_gpus} not in 1..{available} visible GPUs")
        self.xp = cp
        self.bound = bound_of(timeout)  # (the backend's, when it makes the kind)
        self.num_gpus = num_gpus or available
        self.pinned: int | None = None  # across processes: this process's one GPU
        self.waiters = CompletionWaiters()
        self._local = threading.local()  # .stream: the op's stream on this thread
        # Per CUDA stream, in record order: (event, buffers kept alive until it completes).
        self._keepalive: dict[int, collections.deque[tuple[Any, tuple[Any, ...]]]] = {}
        self._keep_lock = threading.Lock()
        self.nccl: Any = None  # the in-process NCCL groups (made with the transport)
        self._join_streams: dict[int, Any] = {}  # per GPU: where a call's ends are joined
        self._distinct: dict[tuple[Any, ...], bool] = {}  # (see distinct_gpus)

    def physical(self, device: int) -> int:
        return self.pinned if self.pinned is not None else device % self.num_gpus

    def transport(self, backend: Backend) -> CudaLocal:
        from .nccl_groups import NcclGroups

        self.nccl = NcclGroups(self)
        return CudaLocal(backend, self.nccl)

    # ---- a stream's items ----------------------------------------------------------------

    def attach(self, stream: Stream) -> None:
        """(The stream's thread, once.) Its GPU and its CUDA stream are made current for the
        thread's life: the items it runs then make no device or stream current each (two
        context managers per op, and an event's record under its device, were most of the
        kind's host cost per op on the stand-in)."""
        # (The GPU first: CuPy refuses to make current a stream of another device.)
        self.xp.cuda.Device(self.physical(stream.device)).use()
        self._native(stream).use()
        local = self._local  # (this thread runs this stream's items alone, for good)
        local.stream, local.held = stream, []

    def _native(self, stream: Stream) -> Any:
        if stream.native is None:
            cp = self.xp
            with cp.cuda.Device(self.physical(stream.device)):
                stream.native = cp.cuda.Stream(non_blocking=True)
        return stream.native

    def run(self, stream: Stream, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException:
            with contextlib.suppress(Exception):  # (the op's own failure is the one named)
                self._restore(stream)
            raise
        self._restore(stream)

    def _restore(self, stream: Stream) -> None:
        """The stream's GPU and CUDA stream current again on its thread, had user code
        changed them and not changed them back (``Device(i).use()``): one look each."""
        cp = self.xp
        gpu = self.physical(stream.device)
        if cp.cuda.runtime.getDevice() != gpu:
            cp.cuda.runtime.setDevice(gpu)
        if cp.cuda.get_current_stream() is not stream.native:
            stream.native.use()

    def mark(self, stream: Stream) -> tuple[int, Any]:
        cp = self.xp
        gpu = self.physical(stream.device)
        if current_stream() is stream:  # (its thread: its GPU current)
            ev = cp.cuda.Event()
            ev.record(stream.native)
        else:  # (a wire completion's callback: another thread, maybe another GPU current)
            with cp.cuda.Device(gpu):
                ev = cp.cuda.Event()
                ev.record(self._native(stream))
        return (gpu, ev)  # CuPy events do not know their device

    def record(self, stream: Stream, event: Event) -> None:
        """(The stream's thread.) For waits only: untimed (cheaper); blocking-sync, so a host
        thread waiting for it sleeps instead of spinning."""
        ev = self.xp.cuda.Event(block=True, disable_timing=True)
        ev.record(stream.native)
        self._ride(stream, ev)
        event.native = ev
        event.device_wait = self.device_wait

    def waited(self, stream: Stream, event: Event, scope: CancelScope | None = None,
               what: str = "") -> None:
        """(The stream's thread.) After the host wait (the other stream enqueued its
        record): the device-side wait (CUDA waits on an unrecorded event are no-ops, so the
        order matters)."""
        if event.native is not None:
            stream.native.wait_event(event.native)

    async def device_wait(self, event: Event) -> None:
        """Until the GPU passed ``event`` — bounded: after a device fault it may never
        complete, so past ``timeout`` this raises ``DeviceTimeout``; a sticky CUDA error
        from ``synchronize()`` raises ``DeviceFault`` at once. A waiter thread sleeps in
        ``synchronize()`` and wakes the loop; ``Event.done`` is also looked at every 10 ms
        (waiter threads may all be stuck elsewhere)."""
        ev = event.native
        if ev is None or ev.done:
            return
        deadline = time.perf_counter() + self.timeout
        passed = OneShot()
        self.waiters.watch(ev, passed)

        def look() -> bool:
            if ev.done:
                passed.finish()
            elif time.perf_counter() >= deadline:
                raise DeviceTimeout(
                    f"the device never reached {event.label}: its work was launched "
                    f"{self.timeout:g} s ago (timeout) and has not completed — a kernel "
                    "that never ends, or a device fault (after one, CUDA reports no event "
                    "complete any more)", event=event.label)
            return True

        # (Given up on, by the timeout or a cancel: the waiter thread's late answer is lost.)
        await wait_on(passed, None, f"the device reaching {event.label}", LOOK_S, look)
        if passed.error is not None:  # CUDA's sticky error, from synchronize
            raise DeviceFault(f"the device failed before reaching {event.label}: "
                              f"{passed.error}", event=event.label) from passed.error

    # ---- collectives' data movement (the loopback) ----------------------------------------

    def arrive(self) -> Any:
        """An event on the calling op's stream marking its contribution as ready."""
        stream = self._local.stream
        ev = self.xp.cuda.Event(disable_timing=True)
        ev.record(stream.native)
        return ev

    def loopback(self, arrivals: dict[int, tuple[Any, Any]],
                 work: Callable[[dict[int, Any]], None]) -> tuple[Any, Any, int]:
        """Run ``work`` on the last arriver's stream after every participant's ready event;
        return the event that marks it done (participants then wait for it), when a trace
        is recorded the one that marks its start (else None), and their GPU."""
        cp = self.xp
        me = self._local.stream
        native = self._native(me)
        for ev, _ in arrivals.values():
            native.wait_event(ev)
        timed = me.tracing
        start = None
        if timed:
            start = cp.cuda.Event()
            start.record(native)
        work({d: payload for d, (_, payload) in arrivals.items()})
        done = cp.cuda.Event(disable_timing=not timed)
        done.record(native)
        self._keep(me, done, (p for _, p in arrivals.values()))
        return done, start, self.physical(me.device)

    def joined(self, landed: tuple[Any, Any, int]) -> None:
        """The calling participant's stream waits for the collective's device work. When a
        trace is recorded, a transfer's span is that work's own (its start and end events):
        this participant's stream reached the op earlier (nothing moved until the last
        participant's host thread arrived) and may record its end mark later."""
        done, start, gpu = landed
        stream = self._local.stream
        self._native(stream).wait_event(done)
        if start is not None:  # (the events are the last arriver's GPU's, maybe not ours)
            stream.data_span = ((gpu, start), (gpu, done))

    def copy(self, dst: Any, src: Any) -> None:
        """dst[...] = src on the current stream, across GPUs if need be (peer copy)."""
        cp = self.xp
        dst_gpu = getattr(getattr(dst, "device", None), "id", 0)
        src_gpu = getattr(getattr(src, "device", None), "id", 0)
        if dst_gpu == src_gpu:
            dst[...] = src
        else:
            cp.cuda.runtime.memcpyPeerAsync(dst.data.ptr, dst.device.id, src.data.ptr,
                                            src.device.id, src.nbytes,
                                            cp.cuda.get_current_stream().ptr)

    def distinct_gpus(self, group: Sequence[int]) -> bool:
        key = (self.pinned, tuple(group))  # (asked per transfer: answered once per group)
        known = self._distinct.get(key)
        if known is None:
            known = self._distinct[key] = (len({self.physical(d) for d in group}) == len(group)
                                           and len(group) > 1)
        return known

    def receives_strided(self, group: Sequence[int]) -> bool:
        """On one GPU a broadcast is a strided device copy; NCCL needs contiguous buffers."""
        return not self.distinct_gpus(tuple(sorted(set(group))))

    # ---- buffers in flight ---------------------------------------------------------------

    def let_go(self) -> None:
        """Let go of every stream's kept buffers whose event has completed."""
        with self._keep_lock:
            for kept in self._keepalive.values():
                left = [k for k in kept if not k[0].done]
                kept.clear()
                kept.extend(left)

    def _keep(self, stream: Stream, event: Any, buffers: Any) -> None:
        """Keep ``buffers`` alive until ``event`` (recorded on ``stream``) completes — CuPy
        has no record_stream — and let go of that stream's earlier ones whose event has.
        One stream's events complete in the order they were recorded, so only its oldest
        are looked at: a host running a step ahead of the GPU keeps hundreds, and looking at
        all of them on every op cost a CUDA query each."""
        with self._keep_lock:
            kept = self._keepalive.setdefault(id(stream), collections.deque())
            while kept and kept[0][0].done:
                kept.popleft()
            kept.append((event, tuple(buffers)))

    def hold(self, *buffers: Any) -> None:
        """Keep ``buffers`` alive until the calling op's stream has run its work so far:
        they ride on the next record of that stream (one another stream waits for, at the
        latest its lane's end), which the device passes after this op's work — no event of
        their own: one per op, and keeping it, were the kind's largest host cost per op on
        the stand-in."""
        held = getattr(self._local, "held", None)
        if held is None:  # (not a stream's thread: no record here ever lets them go)
            held = self._local.held = []
        held.extend(buffers)

    def _ride(self, stream: Stream, event: Any) -> None:
        """(``stream``'s thread, ``event`` just recorded on it.) What its ops held so far is
        kept until ``event`` completes."""
        held = getattr(self._local, "held", None)
        if held:
            self._keep(stream, event, held)
            held.clear()

    def current_native(self) -> Any:
        """The calling op's CUDA stream."""
        return self._native(self._local.stream)

    # ---- around a call -------------------------------------------------------------------

    def caller_streams(self) -> list[Any]:
        """The calling thread's current CUDA streams: CuPy's, and torch's when torch has
        initialised CUDA (as a CuPy ``ExternalStream``) — where the caller's own work (inputs
        made with ``cp.asarray``, an optimizer step) may still be running."""
        cp = self.xp
        streams = [cp.cuda.get_current_stream()]
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            ts = torch.cuda.current_stream()
            streams.append(cp.cuda.ExternalStream(ts.cuda_stream, ts.device.index))
        return streams

    def caller_events(self, backend: Backend) -> list[Event]:
        """An event recorded now on each of the caller's streams: every lane waits for them
        first."""
        cp = self.xp
        events = []
        for s in self.caller_streams():
            # The default streams' ``device_id`` is -1 (no device: the current one's).
            with cp.cuda.Device(s.device_id if s.device_id >= 0 else None):
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(s)
            wrapped = backend.new_event("the caller's stream")
            wrapped.native = ev
            wrapped.device_wait = self.device_wait
            wrapped.finish()  # recorded already: streams may wait for it at once
            events.append(wrapped)
        return events

    def release_to_caller(self, ends: Sequence[Event]) -> None:
        """The caller's streams wait (on the GPU) for every lane's end. The call's device
        work is done: what was kept alive for it is let go now, not at the next call's
        first keep (a host that ran ahead of the GPU held a whole step's buffers)."""
        for s in self.caller_streams():
            for ev in ends:
                if ev.native is not None:
                    s.wait_event(ev.native)
        self.let_go()

    def join_ends(self, backend: Backend, ends: Sequence[Event]) -> list[Event]:
        """One event, recorded on a stream of the kind's own after it waited (on the GPU)
        for the CUDA events of ``ends``: a call waits for one completion — one waiter
        thread, one wake-up of the loop — not one per lane. Ends done already, or whose
        work is another transport's (wire work in flight), are kept as they are."""
        cuda = [e for e in ends if e.native is not None and not isinstance(e.native, InFlight)
                and not e.native.done]
        rest = [e for e in ends if e not in cuda and not e.done()]
        if len(cuda) <= 1:
            return cuda + rest
        cp = self.xp
        gpu = cp.cuda.Device().id  # (the caller's current GPU: its stream and event go there)
        stream = self._join_streams.get(gpu)
        if stream is None:
            stream = self._join_streams[gpu] = cp.cuda.Stream(non_blocking=True)
        for e in cuda:
            stream.wait_event(e.native)
        ev = cp.cuda.Event(block=True, disable_timing=True)
        ev.record(stream)
        end = backend.new_event("the end of every lane (" + ", ".join(e.label for e in cuda)
                                + ")")
        end.native = ev
        end.device_wait = self.device_wait
        end.finish()
        return [end, *rest]

    def current_stream(self) -> Any:
        s = getattr(self._local, "stream", None)
        return None if s is None else s.native

    def start_trace(self, backend: Backend) -> dict[int, Any]:
        """Trace marks are CUDA events; times are measured from a reference event per GPU
        this process drives (touching another would make a CUDA context on it)."""
        cp = self.xp
        refs = {}
        gpus = sorted({self.physical(d) for d in range(backend.num_devices)
                       if backend.is_local(d)})
        for g in gpus:
            with cp.cuda.Device(g):
                ev = cp.cuda.Event()
                ev.record(cp.cuda.Stream.null)
                refs[g] = ev
        return refs

    def span_seconds(self, refs: dict[int, Any], mark: tuple[int, Any]) -> float:
        gpu, event = mark
        event.synchronize()
        return self.xp.cuda.get_elapsed_time(refs[gpu], event) / 1e3

    def profiler(self, on: bool, gpus: Sequence[int]) -> None:
        """``cudaProfilerStart``/``Stop`` on each GPU this process drives (the call acts on
        the current device's context; repeating it is harmless)."""
        cp = self.xp
        for g in gpus:
            with cp.cuda.Device(g):
                (cp.cuda.profiler.start if on else cp.cuda.profiler.stop)()

    def close(self, streams: Sequence[Stream]) -> None:
        """Destroy the in-process NCCL communicators, let go of every buffer kept, and give
        back the memory CuPy's pool cached for these streams: the pool keeps freed blocks
        per stream and reuses them only on that stream, so every closed runtime would
        otherwise strand its peak (on an H200, four runtimes in a row ran out of 141 GB)."""
        if self.nccl is not None:
            self.nccl.destroy()
        with self._keep_lock:
            self._keepalive.clear()
        self.waiters.close()
        cp = self.xp
        pool = cp.get_default_memory_pool()
        for s in streams:
            if s.native is not None:  # (made on the stream's first op)
                with cp.cuda.Device(self.physical(s.device)):
                    pool.free_all_blocks(stream=s.native)


class CudaLocal(LocalTransport):
    """Collectives among this process's devices on CUDA: the loopback where participants
    share a GPU (or mix shared and distinct: peer copies), NCCL where each is on a GPU of
    its own."""

    def __init__(self, backend: Backend, nccl: Any) -> None:
        super().__init__(backend)
        self.nccl = nccl

    def prepare(self, channels: dict[str, tuple[int, ...]]) -> None:
        """Each channel's devices: one NCCL communicator spans those on distinct GPUs."""
        for namespace, devices in channels.items():
            self.nccl.declare(namespace, devices)

    def broadcast(self, group: tuple[int, ...], device: int, root: int, buffer: Any,
                  desc: str, namespace: str, scope: CancelScope) -> None:
        if self.kind.distinct_gpus(group):
            self.nccl.broadcast(self.backend, group, device, root, buffer, desc, namespace,
                                scope)
            return
        super().broadcast(group, device, root, buffer, desc, namespace, scope)

    def all_reduce(self, group: tuple[int, ...], device: int, buffer: Any, desc: str,
                   op: Callable[[Any, Any], Any], namespace: str, scope: CancelScope) -> None:
        if self.kind.distinct_gpus(group):
            self.nccl.all_reduce(self.backend, group, device, buffer, desc, op, namespace,
                                 scope)
            return
        super().all_reduce(group, device, buffer, desc, op, namespace, scope)


__all__ = ["CompletionWaiters", "CudaDevices", "CudaLocal", "gpu_count"]
