"""The CUDA backend: the CPU backend's structure, with GPU streams, events and NCCL underneath.

Each (device, stream) keeps its host worker thread, as on the CPU backend — that is what lets
SPMD stage functions of several devices, driven by one process, call collectives without
deadlocking the host. But an op's host code now runs with the device's **non-blocking
``cupy.cuda.Stream``** current, so every kernel it launches (user compute, pack/unpack copies,
transfers) is enqueued on that GPU stream and the host thread moves on at once:

- ``record`` enqueues a CUDA event on the GPU stream; ``wait_event`` makes the host thread
  wait only until the other stream has *enqueued* its record, then enqueues a device-side
  ``stream.wait_event`` — the host never waits for the GPU in the launch path.
- Completion reaches asyncio through waiter threads that sleep in ``synchronize()`` on
  blocking-sync events and wake the loop (``cuda_waiters``): no polling, no spinning core.
  Polling with backoff under uvloop's 1 ms timers saw completions up to ~1.5 ms late on an
  H200; ``benchmarks/gpu_check.py`` measures the three ways.
- Virtual devices map to physical GPUs round-robin (``device % num_gpus``). A collective whose
  participants share one GPU (every collective on a one-GPU machine) becomes device-to-device
  copies on the stream of the last participant to arrive ("loopback"), ordered by events
  against every participant's stream. Participants on distinct GPUs use NCCL
  (``cupy.cuda.nccl``) with a **bounded number of communicators**: one per declared channel
  (``declare_group``: a pipeline boundary in one direction spans both stage meshes; a
  standalone resharding spans its source and destination meshes), in which a broadcast is
  grouped send/recv from the root to its receivers — so a pipeline of p stages needs
  2 (p − 1) of them, whatever its plans' device sets — plus one per mesh (or mesh-axis) group
  that stage functions all-reduce over. Alpa creates one per distinct device set instead.
  Each (device, channel) communicator is used by that device's one channel thread only.
  Groups mixing shared and distinct GPUs use peer copies.
- CuPy has no ``record_stream``: every buffer a collective reads or writes is kept alive, with
  the event that ends its use, until that event has completed.

The one-GPU (loopback) path has run on an H200 (``benchmarks/gpu_check.py``, 2026-11-30); the
NCCL path has not run on multi-GPU hardware (docs/architecture.md says so too).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import (
    CollectiveAborted,
    CollectiveMismatch,
    DeviceFault,
    DeviceTimeout,
    OverlapRuntimeError,
)
from ..world import Placement
from .cpu import CpuBackend, CpuEvent, CpuStream
from .cuda_waiters import WAITERS

ABORT_CHECK_S = 0.01  # how often a host wait for the GPU looks at abort and timeout


def _cupy():
    try:
        import cupy
    except ImportError:
        raise OverlapRuntimeError(
            "backend 'cuda' needs CuPy: pip install 'overlap[cuda12]' (or [cuda13])"
        ) from None
    return cupy


def gpu_count() -> int:
    """Visible CUDA devices (0 without CuPy or without a GPU)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


class CudaEvent(CpuEvent):
    """A CUDA event: first *launched* (recorded on its stream by the host thread), then
    *done* when the GPU passes it."""

    __slots__ = ("backend", "cuda_event")

    def __init__(self, label: str = "", backend: CudaBackend | None = None) -> None:
        super().__init__(label)
        self.cuda_event: Any = None
        self.backend = backend  # its timeout and abort flag bound the wait

    def launched(self) -> bool:
        return self._done.is_set()

    def done(self) -> bool:
        if not self._done.is_set():
            return False
        return self.cuda_event is None or bool(self.cuda_event.done)

    async def wait(self) -> None:
        """Until the GPU passes the event — bounded: after a device fault the event may never
        complete, so a wait longer than the backend's ``timeout`` (from the call) or an abort
        raises, naming the event. A waiter thread sleeps in ``synchronize()`` and
        wakes the loop (see ``cuda_waiters``); abort and timeout are checked every
        ``ABORT_CHECK_S`` meanwhile."""
        await super().wait()  # launched (or failed)
        ev = self.cuda_event
        if ev is None or ev.done:
            return
        backend = self.backend
        timeout = backend.timeout if backend is not None else 30.0
        deadline = time.perf_counter() + timeout
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        WAITERS.watch(ev, loop, done)
        try:
            while True:
                left = deadline - time.perf_counter()
                await asyncio.wait((done,), timeout=max(0.0, min(ABORT_CHECK_S, left)))
                if not done.done() and ev.done:  # (waiter threads may all be stuck elsewhere)
                    return
                if done.done():
                    if done.exception() is not None:  # CUDA's sticky error, from synchronize
                        raise DeviceFault(f"the device failed before reaching {self.label}: "
                                          f"{done.exception()}",
                                          event=self.label) from done.exception()
                    return
                if backend is not None and backend.abort_reason is not None:
                    raise CollectiveAborted(f"waiting for the device to reach {self.label}: "
                                            f"aborted ({backend.abort_reason})")
                if time.perf_counter() >= deadline:
                    raise DeviceTimeout(
                        f"the device never reached {self.label}: its work was launched "
                        f"{timeout:g} s ago (timeout) and has not completed — a kernel that "
                        "never ends, or a device fault (after one, CUDA reports no event "
                        "complete any more)", event=self.label)
        finally:
            done.cancel()  # given up: the waiter thread's late answer is dropped


class CudaStream(CpuStream):
    """A host worker thread feeding one non-blocking CUDA stream."""

    def __init__(self, backend: CudaBackend, device: int, name: str) -> None:
        super().__init__(backend, device, name)
        self.gpu = backend.physical(device)
        self.cuda_stream: Any = None  # created on the worker thread, under its device

    def _ensure(self) -> None:
        if self.cuda_stream is None:
            cp = _cupy()
            with cp.cuda.Device(self.gpu):
                self.cuda_stream = cp.cuda.Stream(non_blocking=True)

    def _execute(self, fn: Callable[[], Any]) -> None:
        cp = _cupy()
        self._ensure()
        with cp.cuda.Device(self.gpu), self.cuda_stream:
            self.backend._local.stream = self
            try:
                fn()
            finally:
                self.backend._local.stream = None

    def _mark(self) -> Any:
        cp = _cupy()
        self._ensure()
        with cp.cuda.Device(self.gpu):
            ev = cp.cuda.Event()
            ev.record(self.cuda_stream)
        return (self.gpu, ev)  # CuPy events do not know their device

    def _on_record(self, event: CpuEvent) -> None:
        if self._failed is None and isinstance(event, CudaEvent):
            cp = _cupy()
            self._ensure()
            with cp.cuda.Device(self.gpu):
                # For waits only: untimed (cheaper); blocking-sync, so a host thread waiting
                # for it sleeps instead of spinning (see cuda_waiters).
                ev = cp.cuda.Event(block=True, disable_timing=True)
                ev.record(self.cuda_stream)
            event.cuda_event = ev
        event._complete(self._failed)

    def _wait_for(self, event: CpuEvent) -> None:
        super()._wait_for(event)  # the host waits only for the record to be enqueued
        if isinstance(event, CudaEvent) and event.cuda_event is not None:
            self._ensure()
            with _cupy().cuda.Device(self.gpu):
                self.cuda_stream.wait_event(event.cuda_event)

    def record(self, label: str = "", *, event: CpuEvent | None = None) -> CpuEvent:
        return super().record(label, event=event if event is not None else CudaEvent(
            label or f"d{self.device}/{self.name}", self.backend))


class CudaBackend(CpuBackend):
    """Virtual devices on CUDA GPUs (see module doc)."""

    name = "cuda"
    events_end_work = False  # (an event completes when launched; the GPU passes it later)
    stream_class = CudaStream

    def __init__(self, num_devices: int, *, timeout: float = 30.0,
                 link_time: Callable[[int, Sequence[int], int], float] | None = None,
                 num_gpus: int | None = None, placement: Placement | None = None,
                 rank: int = 0) -> None:
        cp = _cupy()
        available = gpu_count()
        if available < 1:
            raise OverlapRuntimeError("backend 'cuda': no CUDA device is visible")
        if num_gpus is not None and not 1 <= num_gpus <= available:
            raise ValueError(f"num_gpus: {num_gpus} not in 1..{available} visible GPUs")
        super().__init__(num_devices, timeout=timeout, link_time=link_time, placement=placement,
                         rank=rank)
        self.xp = cp
        self.num_gpus = num_gpus or available
        self._local = threading.local()
        self._nccl: dict[tuple[str, tuple[int, ...]], dict[int, Any]] = {}
        self._declared: dict[str, tuple[int, ...]] = {}
        self._keepalive: list[tuple[Any, tuple[Any, ...]]] = []
        self._keep_lock = threading.Lock()
        self._issue_locks: dict[int, threading.Lock] = {}  # per GPU: see _issuing

    def physical(self, device: int) -> int:
        return device % self.num_gpus

    def receives_strided(self, group: Sequence[int]) -> bool:
        """On one GPU a broadcast is a strided device copy; NCCL needs contiguous buffers."""
        return not self._distinct_gpus(tuple(sorted(set(group))))

    def new_event(self, label: str = "") -> CudaEvent:
        return CudaEvent(label, self)

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

    def caller_events(self) -> list[CudaEvent]:
        """An event recorded now on each of the caller's streams (see CpuBackend)."""
        cp = self.xp
        events = []
        for s in self.caller_streams():
            # The default streams' ``device_id`` is -1 (no device: the current one's).
            with cp.cuda.Device(s.device_id if s.device_id >= 0 else None):
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(s)
            wrapped = CudaEvent("the caller's stream", self)
            wrapped.cuda_event = ev
            wrapped._complete()  # recorded already: streams may wait for it at once
            events.append(wrapped)
        return events

    def release_to_caller(self, ends: Sequence[CpuEvent]) -> None:
        """The caller's streams wait (on the GPU) for every lane's end. The call's device
        work is done: what was kept alive for it is let go now, not at the next call's
        first ``_keep`` (a host that ran ahead of the GPU held a whole step's buffers)."""
        for s in self.caller_streams():
            for ev in ends:
                if isinstance(ev, CudaEvent) and ev.cuda_event is not None:
                    s.wait_event(ev.cuda_event)
        self._keep(None)

    def declare_group(self, namespace: str, devices: Sequence[int]) -> None:
        group = tuple(sorted(set(devices)))
        with self._lock:
            old = self._declared.get(namespace)
            if old is not None and old != group:
                # A channel's communicator spans fixed devices; a new group needs a new one.
                for c in self._nccl.pop((namespace, old), {}).values():
                    c.destroy()
            self._declared[namespace] = group

    def start_trace(self) -> None:
        """Trace marks are CUDA events; times are measured from a reference event per GPU."""
        cp = self.xp
        self._refs = {}
        for g in self._local_gpus():
            with cp.cuda.Device(g):
                ev = cp.cuda.Event()
                ev.record(cp.cuda.Stream.null)
                self._refs[g] = ev
        self.trace = []

    def profiler(self, on: bool) -> None:
        """``cudaProfilerStart``/``Stop`` on each GPU this process drives (the call acts on the
        current device's context; repeating it is harmless)."""
        cp = self.xp
        for g in self._local_gpus():
            with cp.cuda.Device(g):
                (cp.cuda.profiler.start if on else cp.cuda.profiler.stop)()

    def _local_gpus(self) -> list[int]:
        # Only the GPUs this process drives: touching another makes a CUDA context on it (every
        # rank of a node would make one on every GPU).
        return sorted({self.physical(d) for d in range(self.num_devices) if self.is_local(d)})

    def span_seconds(self, mark: Any) -> float:
        gpu, event = mark
        event.synchronize()
        return self.xp.cuda.get_elapsed_time(self._refs[gpu], event) / 1e3

    def current_stream(self) -> Any:
        s = getattr(self._local, "stream", None)
        return None if s is None else s.cuda_stream

    # ---- buffers in flight ---------------------------------------------------------------

    def _keep(self, event: Any, *buffers: Any) -> None:
        """Keep ``buffers`` alive until ``event`` completes (CuPy has no record_stream), and
        let go of those whose event has (``event`` None: only that)."""
        with self._keep_lock:
            self._keepalive = [(e, b) for e, b in self._keepalive if not e.done]
            if event is not None:
                self._keepalive.append((event, buffers))

    def hold(self, *buffers: Any) -> None:
        """Keep ``buffers`` alive until the calling op's stream has run its work so far."""
        self._keep(self._arrive(), *buffers)

    # ---- collectives ---------------------------------------------------------------------

    def _arrive(self) -> Any:
        """An event on the calling op's stream marking its contribution as ready."""
        cp = self.xp
        stream = self._local.stream
        ev = cp.cuda.Event(disable_timing=True)
        ev.record(stream.cuda_stream)
        return ev

    def _finish(self, landed: tuple[Any, Any, int]) -> None:
        """The calling participant's stream waits for the collective's device work. When a
        trace is recorded, the op's span is that work's own (its start and end events):
        this participant's stream reached the op earlier (nothing moved until the last
        participant's host thread arrived) and may record its end mark later (a busy host)."""
        done, start, gpu = landed
        stream = self._local.stream
        stream.cuda_stream.wait_event(done)
        if start is not None:  # (the events are the last arriver's GPU's, maybe not ours)
            stream.data_span = ((gpu, start), (gpu, done))

    def _loopback(self, arrivals: dict[int, tuple[Any, Any]],
                  work: Callable[[dict[int, Any]], None]) -> tuple[Any, Any, int]:
        """Run ``work`` on the last arriver's stream after every participant's ready event;
        return the event that marks it done (participants then wait for it), when a trace
        is recorded the one that marks its start (else None), and their GPU."""
        cp = self.xp
        me = self._local.stream
        stream = me.cuda_stream
        for ev, _ in arrivals.values():
            stream.wait_event(ev)
        timed = self.trace is not None  # timing events cost: only for a trace
        start = None
        if timed:
            start = cp.cuda.Event()
            start.record(stream)
        work({d: payload for d, (_, payload) in arrivals.items()})
        done = cp.cuda.Event(disable_timing=not timed)
        done.record(stream)
        self._keep(done, *(p for _, p in arrivals.values()))
        return done, start, me.gpu

    def _copy(self, dst: Any, src: Any) -> None:
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

    def _distinct_gpus(self, group: tuple[int, ...]) -> bool:
        return len({self.physical(d) for d in group}) == len(group) and len(group) > 1

    def broadcast(self, devices: Sequence[int], device: int, root: int, buffer: Any,
                  desc: str, namespace: str = "", tag: int | None = None) -> None:
        group = tuple(sorted(set(devices)))
        if self._distinct_gpus(group):
            self._nccl_broadcast(group, device, root, buffer, desc, namespace)
            return

        def combine(arrivals: dict[int, tuple[Any, Any]]) -> tuple[float, Any]:
            src = arrivals[root][1]
            for d, (_, b) in arrivals.items():
                if d != root and (b.shape != src.shape or b.dtype != src.dtype):
                    raise CollectiveMismatch(f"{desc}: device {d} buffer {b.shape} {b.dtype} "
                                             f"!= root {root} buffer {src.shape} {src.dtype}")

            def work(bufs: dict[int, Any]) -> None:
                for d, b in bufs.items():
                    if d != root:
                        self._copy(b, bufs[root])

            landed = self._loopback(arrivals, work)
            seconds = (0.0 if self.link_time is None else
                       self.link_time(root, [d for d in group if d != root], src.nbytes))
            return seconds, landed

        done = self.communicator(group, namespace).run(
            device, f"broadcast[{desc}] root {root}", (self._arrive(), buffer), combine)
        self._finish(done)

    def all_reduce(self, devices: Sequence[int], device: int, buffer: Any, desc: str,
                   op: Callable[[Any, Any], Any] = np.add, namespace: str = "",
                   tag: int | None = None) -> None:
        group = tuple(sorted(set(devices)))
        if self._distinct_gpus(group):
            self._nccl_all_reduce(group, device, buffer, desc, namespace, op)
            return

        def combine(arrivals: dict[int, tuple[Any, Any]]) -> tuple[float, Any]:
            def work(bufs: dict[int, Any]) -> None:
                total = bufs[group[0]].copy()
                for d in group[1:]:
                    total = op(total, bufs[d])
                for b in bufs.values():
                    self._copy(b, total)

            return 0.0, self._loopback(arrivals, work)

        done = self.communicator(group, namespace).run(
            device, f"all_reduce[{desc}]", (self._arrive(), buffer), combine)
        self._finish(done)

    def all_gather(self, devices: Sequence[int], device: int, buffer: Any, out: Any,
                   desc: str, namespace: str = "", tag: int | None = None) -> None:
        group = tuple(sorted(set(devices)))

        def combine(arrivals: dict[int, tuple[Any, Any]]) -> tuple[float, Any]:
            def work(pairs: dict[int, Any]) -> None:
                for _, o in pairs.values():
                    for k, d in enumerate(group):
                        self._copy(o[k], pairs[d][0])

            return 0.0, self._loopback(arrivals, work)

        done = self.communicator(group, namespace).run(
            device, f"all_gather[{desc}]", (self._arrive(), (buffer, out)), combine)
        self._finish(done)

    # ---- NCCL (participants on distinct GPUs) --------------------------------------------

    def _nccl_comm(self, namespace: str, group: tuple[int, ...], device: int
                   ) -> tuple[Any, tuple[int, ...]]:
        """The communicator of ``device`` for this collective, and its ranks' devices: the
        declared channel's when it covers the group on distinct GPUs, else the group's own."""
        with self._lock:
            members = self._declared.get(namespace, group)
            if not set(group) <= set(members) or len(
                    {self.physical(d) for d in members}) < len(members):
                members = group
            key = (namespace, members)
            if key not in self._nccl:
                from cupy.cuda import nccl

                comms = nccl.NcclCommunicator.initAll([self.physical(d) for d in members])
                self._nccl[key] = dict(zip(members, comms))
            return self._nccl[key][device], members

    def _nccl_broadcast(self, group, device, root, buffer, desc, namespace) -> None:
        from cupy.cuda import nccl

        # Match launch positions on the host first: mismatches and missing peers are named.
        self.communicator(group, namespace).run(device, f"broadcast[{desc}] root {root}",
                                                None, lambda _: 0.0)
        comm, ranks = self._nccl_comm(namespace, group, device)
        stream = self._local.stream.cuda_stream.ptr
        count, dtype = buffer.size, _nccl_dtype(buffer.dtype)
        with self._issuing(device):
            if device == root:
                nccl.groupStart()
                try:  # a failed send must still end the group, or NCCL stays in it
                    for d in group:
                        if d != root:
                            comm.send(buffer.data.ptr, count, dtype, ranks.index(d), stream)
                finally:
                    nccl.groupEnd()
            else:
                comm.recv(buffer.data.ptr, count, dtype, ranks.index(root), stream)
        self._keep(self._arrive(), buffer)

    def _issuing(self, device: int) -> threading.Lock:
        """The lock under which NCCL calls on ``device``'s GPU are issued: NCCL calls on one
        device from several threads at once (its channel threads and compute thread, each on
        its own communicator) are unsafe. Held only while a call enqueues (NCCL returns
        without waiting for the GPU), so no thread waits on another's transfer."""
        gpu = self.physical(device)
        with self._lock:
            lock = self._issue_locks.get(gpu)
            if lock is None:
                lock = self._issue_locks[gpu] = threading.Lock()
            return lock

    def _nccl_all_reduce(self, group, device, buffer, desc, namespace, op=np.add) -> None:
        reduction = _nccl_op(op)  # before any rendezvous: an unknown op fails alone
        self.communicator(group, namespace).run(device, f"all_reduce[{desc}]", None,
                                                lambda _: 0.0)
        comm, _ = self._nccl_comm(f"{namespace}:{group}", group, device)
        with self._issuing(device):
            comm.allReduce(buffer.data.ptr, buffer.data.ptr, buffer.size,
                           _nccl_dtype(buffer.dtype), reduction,
                           self._local.stream.cuda_stream.ptr)
        self._keep(self._arrive(), buffer)

    def abort(self, reason: str) -> None:
        """Wake every host wait (see CpuBackend.abort) and abort every NCCL communicator: a
        transfer whose peer failed would otherwise leave its kernel spinning on the GPU.
        Aborted communicators are dropped; the next collective makes new ones."""
        super().abort(reason)
        with self._lock:
            comms = [c for group in self._nccl.values() for c in group.values()]
            self._nccl.clear()
        for c in comms:
            with contextlib.suppress(Exception):  # aborting is best effort
                c.abort()

    def close(self) -> None:
        super().close()
        with self._lock:
            comms = [c for group in self._nccl.values() for c in group.values()]
            self._nccl.clear()
        for c in comms:
            c.destroy()
        self._keepalive.clear()
        self._release_pool()

    def _release_pool(self) -> None:
        """Give back the memory CuPy's pool cached for this backend's streams. The pool keeps
        freed blocks per stream and reuses them only on that stream, so every closed runtime
        would otherwise strand its peak (on an H200, four runtimes in a row ran out of
        141 GB). Only free blocks go; ``cudaFree`` waits for the device first."""
        cp = self.xp
        pool = cp.get_default_memory_pool()
        for s in self.streams():
            if s.cuda_stream is not None:  # (made on the stream's first op)
                with cp.cuda.Device(s.gpu):
                    pool.free_all_blocks(stream=s.cuda_stream)


def _nccl_op(op: Callable[[Any, Any], Any]) -> int:
    """NCCL's reduction for a numpy/CuPy ufunc (by name: ``cupy.add`` is not ``numpy.add``)."""
    from cupy.cuda import nccl

    table = {"add": nccl.NCCL_SUM, "multiply": nccl.NCCL_PROD, "maximum": nccl.NCCL_MAX,
             "minimum": nccl.NCCL_MIN}
    name = getattr(op, "__name__", None)
    if name not in table:
        raise TypeError(f"op: NCCL reduces with add, multiply, maximum or minimum, not {op!r}")
    return table[name]


def _nccl_dtype(dtype: Any) -> int:
    from cupy.cuda import nccl

    table = {
        np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
        np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int32): nccl.NCCL_INT32,
        np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.int8): nccl.NCCL_INT8,
        np.dtype(np.uint8): nccl.NCCL_UINT8,
    }
    try:
        return table[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"dtype: NCCL has no {np.dtype(dtype)}") from None
