"""A CuPy stand-in on numpy, for running the CUDA backend's host logic without a GPU.

Modelled on CuPy 14.2 (cupy/cupy ``v14.2.0``: ``cupy/_core/core.pyx`` ndarray and
``__array_ufunc__``/``__array_function__``, ``cupy/_core/flags.pyx``, ``cupy/cuda/stream.pyx``,
``cupy/cuda/device.pyx``), and kept to its surface by ``tests/test_fake_cupy.py``, which
compares it with the real library where that is installed. Where it models CuPy:

- **Arrays** are their own type (a numpy subclass): numpy ufuncs and functions on them
  dispatch to "CuPy" (NEP 13/18, as CuPy does), and **mixing them with numpy arrays raises**
  ``TypeError: Unsupported type <class 'numpy.ndarray'>`` as in CuPy; results are device
  arrays (a reduction gives a 0-d array, not a scalar); ``.get()`` / ``asnumpy`` copy to the
  host; ``asarray(numpy)`` copies to the device. ``flags`` has CuPy's three fields
  (``c_contiguous``, ``f_contiguous``, ``owndata``) — no ``writeable``. Each array belongs to
  the device that was current when it was made (``.device.id``).
- **Devices**: ``Device(i)`` as a context manager makes ``i`` current (per thread);
  ``runtime.getDeviceCount()`` says how many (``DEVICES``).
- **Streams and events**: a stream belongs to the device current at its creation; an event
  records only on a stream of its own device (CUDA refuses others); a recorded event
  completes ``EVENT_LATENCY_S`` later (device work finishes after the host launched it), or
  never once ``sticky_error`` is set (a device fault: ``Event.done`` stays False, as CuPy's
  ``eventQuery`` returns the error unchecked, and ``synchronize()`` raises it), or never while
  ``hung`` is set (a kernel that never ends: ``synchronize()`` blocks until it is cleared).
  ``Event.block`` is kept: a non-blocking event's ``synchronize()`` spins a core in CUDA.

Where it is kinder than CuPy, tests prove nothing: ``numpy.asarray(device_array)`` works here
(a subclass cannot refuse it; CuPy raises), kernels run at once on the host, and memory is
shared between "devices".
"""

from __future__ import annotations

import threading
import time
import types
from typing import Any, NamedTuple

import numpy as np
from numpy import add, float32, float64  # noqa: F401  (dtypes and the ufunc the backend names)

__version__ = "14.2.0-fake"
DEVICES = 1  # what runtime.getDeviceCount() says
EVENT_LATENCY_S = 1e-3  # how long after its record an event completes
sticky_error = False  # a device fault: no event completes any more
hung = threading.Event()  # set: events recorded from now on never complete (an endless kernel)
_local = threading.local()
launches: list[str] = []  # what was enqueued where, for assertions
waits: list[tuple[int, int]] = []  # (waiting stream, stream the event was recorded on)


def _current_device() -> int:
    return getattr(_local, "device", 0)


# ---- arrays ------------------------------------------------------------------------------------


class Flags(NamedTuple):
    """CuPy's ``Flags``: these three fields only."""

    c_contiguous: bool
    f_contiguous: bool
    owndata: bool


class _Memory(NamedTuple):
    ptr: int


def _refuse_numpy(values: Any) -> None:
    for v in values:
        if isinstance(v, (list, tuple)):
            _refuse_numpy(v)
        elif isinstance(v, np.ndarray) and not isinstance(v, ndarray):
            raise TypeError(f"Unsupported type {type(v)}")


def _host(v: Any) -> Any:
    if isinstance(v, ndarray):
        return v.view(np.ndarray)
    if isinstance(v, (list, tuple)):
        return type(v)(_host(x) for x in v)
    return v


def _device(v: Any, gpu: int) -> Any:
    if isinstance(v, np.ndarray):
        out = v.view(ndarray)
        out._gpu = gpu
        return out
    if isinstance(v, np.generic):
        return _device(np.asarray(v), gpu)
    if isinstance(v, tuple):
        return tuple(_device(x, gpu) for x in v)
    return v


class ndarray(np.ndarray):
    """A device array (see module doc)."""

    _gpu = 0

    def __array_finalize__(self, obj: Any) -> None:
        self._gpu = getattr(obj, "_gpu", _current_device())

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        _refuse_numpy(inputs)
        if out is not None:
            _refuse_numpy(out)
            kwargs["out"] = tuple(_host(o) for o in out)
        result = getattr(ufunc, method)(*_host(inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _device(result, self._gpu)

    def __array_function__(self, func, types_, args, kwargs):
        _refuse_numpy(args)
        _refuse_numpy(tuple(kwargs.values()))
        result = func(*_host(args), **{k: _host(v) for k, v in kwargs.items()})
        return _device(result, self._gpu)

    @property
    def flags(self) -> Flags:  # type: ignore[override]
        f = super().flags
        return Flags(f.c_contiguous, f.f_contiguous, f.owndata)

    @property
    def device(self) -> Device:
        return Device(self._gpu)

    @property
    def data(self) -> _Memory:  # type: ignore[override]
        return _Memory(self.ctypes.data)

    def get(self, stream: Any = None) -> np.ndarray:
        return np.array(self.view(np.ndarray))

    def __setitem__(self, key: Any, value: Any) -> None:
        # CuPy copies a host value to the device first; device arrays of another device fail
        # in a kernel (here: allowed, memory is shared).
        np.ndarray.__setitem__(self.view(np.ndarray), key, _host(value))


def _new(a: np.ndarray) -> ndarray:
    return _device(np.ascontiguousarray(a) if a.ndim else np.array(a), _current_device())


def array(obj: Any, dtype: Any = None, copy: bool = True, order: str = "K") -> ndarray:
    return _new(np.array(_host(obj), dtype=dtype, copy=True, order=order))


def asarray(a: Any, dtype: Any = None, order: str | None = None) -> ndarray:
    if isinstance(a, ndarray) and (dtype is None or a.dtype == dtype):
        return a
    return _new(np.array(_host(a), dtype=dtype, order=order or "K"))


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray) and a.flags.c_contiguous and (dtype is None or a.dtype == dtype):
        return a
    return _new(np.ascontiguousarray(_host(a), dtype=dtype))


def asnumpy(a: Any, stream: Any = None) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return _new(np.empty(shape, dtype, order))


def empty_like(a: Any, dtype: Any = None) -> ndarray:
    return _new(np.empty_like(_host(a), dtype=dtype))


def zeros(shape: Any, dtype: Any = float) -> ndarray:
    return _new(np.zeros(shape, dtype))


def ones(shape: Any, dtype: Any = float) -> ndarray:
    return _new(np.ones(shape, dtype))


def arange(*args: Any, **kwargs: Any) -> ndarray:
    return _new(np.arange(*args, **kwargs))


def may_share_memory(a: Any, b: Any) -> bool:
    return bool(np.may_share_memory(_host(a), _host(b)))


# ---- devices, streams, events -------------------------------------------------------------------


class Device:
    id = 0  # (a class attribute too, as CuPy's readonly field is)

    def __init__(self, device: int | None = None) -> None:
        self.id = _current_device() if device is None else int(device)
        if not 0 <= self.id < DEVICES:
            raise RuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")

    def __enter__(self) -> Device:
        self._prev = _current_device()
        _local.device = self.id
        return self

    def __exit__(self, *exc: object) -> bool:
        _local.device = self._prev
        return False

    def use(self) -> None:
        _local.device = self.id

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)


class Stream:
    _count = 0
    ptr = 0  # (CuPy documents ``ptr`` and ``device_id`` as attributes of a stream)
    device_id = -1

    def __init__(self, null: bool = False, non_blocking: bool = False,
                 ptds: bool = False, priority: int | None = None) -> None:
        Stream._count += 1
        self.ptr = 0 if null else Stream._count
        # As CuPy 14: the null and per-thread default streams belong to no device (-1, which
        # ``Device(-1)`` refuses: seen on an H200); a created stream to the current one.
        self.device_id = -1 if null or ptds else _current_device()

    def _check_device(self) -> None:
        # As CuPy's check_stream_device_match: a stream is made current only while its
        # device is.
        if self.device_id >= 0 and self.device_id != _current_device():
            raise RuntimeError(f"The device that the stream is created on ({self.device_id})"
                               f" does not match with the current device "
                               f"({_current_device()})")

    def __enter__(self) -> Stream:
        self._check_device()
        self._prev = getattr(_local, "stream", None)
        _local.stream = self
        return self

    def __exit__(self, *exc: object) -> bool:
        _local.stream = self._prev
        return False

    def use(self) -> Stream:
        self._check_device()
        _local.stream = self
        return self

    def wait_event(self, event: Event) -> None:
        if not event.recorded:
            raise AssertionError("wait_event on an event that was never recorded")
        launches.append(f"wait {self.ptr}")
        waits.append((self.ptr, event.stream_ptr))

    def record(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    @property
    def done(self) -> bool:
        return not sticky_error

    def synchronize(self) -> None:
        pass

    def launch_host_func(self, callback: Any, arg: Any) -> None:
        """CuPy 14: ``callback(arg)`` on a CUDA thread once the stream gets there."""
        if not sticky_error:
            threading.Timer(EVENT_LATENCY_S, callback, (arg,)).start()


Stream.null = Stream(null=True)
Stream.ptds = Stream(ptds=True)
Stream.ptds.ptr = 2  # cudaStreamPerThread, as CuPy's


class ExternalStream(Stream):
    """A stream made elsewhere (torch's), by its pointer and device."""

    def __init__(self, ptr: int, device_id: int = -1) -> None:
        super().__init__()
        self.ptr = ptr
        self.device_id = _current_device() if device_id < 0 else device_id


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self.recorded = False
        self.stream_ptr = -1
        self.t = 0.0
        self.device_id = _current_device()
        self.timing = not disable_timing
        self.block = block
        self.stuck = False

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or get_current_stream()
        if stream.device_id >= 0 and stream.device_id != self.device_id:
            raise RuntimeError("cudaErrorInvalidResourceHandle: an event records only on a "
                               f"stream of its device ({self.device_id}), not of device "
                               f"{stream.device_id}")
        self.recorded = True
        self.stream_ptr = stream.ptr
        self.t = time.perf_counter()
        self.stuck = hung.is_set()

    @property
    def done(self) -> bool:
        if self.stuck and not hung.is_set():
            self.stuck = False  # the endless kernel was let go (tests clean up)
        return (self.recorded and not sticky_error and not self.stuck
                and time.perf_counter() >= self.t + EVENT_LATENCY_S)

    def synchronize(self) -> None:
        while not self.done:
            if sticky_error:
                raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was "
                                   "encountered")
            time.sleep(EVENT_LATENCY_S / 4)


def get_current_stream() -> Stream:
    return getattr(_local, "stream", None) or Stream.null


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    if not (start_event.timing and end_event.timing):
        raise RuntimeError("cudaErrorInvalidResourceHandle: timing disabled on an event")
    return (end_event.t - start_event.t) * 1e3


def _set_device(device: int) -> None:
    Device(device).use()


runtime = types.SimpleNamespace(
    getDeviceCount=lambda: DEVICES, memcpyPeerAsync=None,
    getDevice=_current_device, setDevice=_set_device,
    getDeviceProperties=lambda device: {"name": b"CuPy stand-in (numpy)"})
# cupy.cuda.profiler (cupy_backends/cuda/api/runtime: cudaProfilerStart/Stop, acting on the
# current device's context): records (call, current device).
profiler_calls: list[tuple[str, int]] = []
profiler = types.SimpleNamespace(
    start=lambda: profiler_calls.append(("start", _current_device())),
    stop=lambda: profiler_calls.append(("stop", _current_device())))


class MemoryPool:
    """CuPy's default pool keeps freed blocks per stream ("arena") and reuses a block only on
    its stream. The stand-in allocates from numpy; it records what is released: (GPU, stream
    pointer), or (GPU, None) for every arena."""

    def free_all_blocks(self, stream: Stream | None = None) -> None:
        pool_releases.append((_current_device(), None if stream is None else stream.ptr))


pool_releases: list[tuple[int, int | None]] = []
_pool = MemoryPool()


def get_default_memory_pool() -> MemoryPool:
    return _pool


cuda = types.SimpleNamespace(Device=Device, Stream=Stream, ExternalStream=ExternalStream,
                             Event=Event, runtime=runtime, profiler=profiler,
                             MemoryPool=MemoryPool,
                             get_current_stream=get_current_stream,
                             get_elapsed_time=get_elapsed_time)


# ---- NCCL (cupy.cuda.nccl, CuPy 14.2: cupy_backends/cuda/libs/nccl.pyx) ------------------------
# Records what the backend asks of it (no bytes move): which reduction, which group calls,
# which communicators were aborted or destroyed.

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_API = 14  # the CuPy major version whose unique-id and constructor API this models
nccl_calls: list[tuple] = []
_group_depth = [0]
NCCL_CALL_S = 2e-3  # how long an NCCL call takes to issue here
concurrent_issue: list[tuple[str, int]] = []  # calls that overlapped another on its device
_issuing: dict[int, int] = {}
_issuing_lock = threading.Lock()


class NcclError(RuntimeError):
    pass


class NcclCommunicator:
    fail_sends = False  # a send raises (to test that a group still ends)

    def __init__(self, ndev: int, commId: Any, rank: int, config: Any = None) -> None:
        want = bytes if NCCL_API >= 14 else tuple
        if not isinstance(commId, want) or (NCCL_API < 14 and config is not None):
            raise TypeError(f"commId: CuPy {NCCL_API} takes {want.__name__}"
                            f"{'' if NCCL_API >= 14 else ' and no config'}, got "
                            f"{type(commId).__name__}")
        self._size, self._rank, self._device = ndev, rank, _current_device()
        self.aborted = self.destroyed = False

    @classmethod
    def initAll(cls, devices: Any) -> list[NcclCommunicator]:
        devices = list(devices)
        if len(set(devices)) != len(devices):  # one rank per GPU in a communicator
            raise NcclError("NCCL_ERROR_INVALID_USAGE: duplicate GPU in one communicator "
                            f"({devices})")
        comms = []
        for r, d in enumerate(devices):
            with Device(d):
                comms.append(cls(len(devices), get_unique_id(), r))
        return comms

    def _use(self, what: str, *args: Any) -> None:
        if self.aborted or self.destroyed:
            raise NcclError(f"{what}: communicator was aborted or destroyed")
        nccl_calls.append((what, self._rank, *args))
        # NCCL: calls on one device from several threads at once are unsafe. Each call here
        # takes a moment, and overlapping ones on one device are recorded.
        with _issuing_lock:
            _issuing[self._device] = _issuing.get(self._device, 0) + 1
            if _issuing[self._device] > 1:
                concurrent_issue.append((what, self._device))
        time.sleep(NCCL_CALL_S)
        with _issuing_lock:
            _issuing[self._device] -= 1

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        if NcclCommunicator.fail_sends:
            raise NcclError("ncclSend: unhandled system error")
        self._use("send", peer)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._use("recv", peer)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int,
                  op: int, stream: int) -> None:
        self._use("allReduce", op)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,
                  stream: int) -> None:
        self._use("allGather")

    def abort(self) -> None:
        self.aborted = True
        nccl_calls.append(("abort", self._rank))

    def destroy(self) -> None:
        self.destroyed = True

    def device_id(self) -> int:
        return self._device

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def groupStart() -> None:
    _group_depth[0] += 1
    nccl_calls.append(("groupStart",))


def groupEnd() -> None:
    _group_depth[0] -= 1
    nccl_calls.append(("groupEnd",))


def get_unique_id() -> bytes | tuple[int, ...]:
    """CuPy 14: 128 bytes; CuPy 13: a tuple of 128 signed chars (``NCCL_API``)."""
    raw = bytes(range(128))
    return raw if NCCL_API >= 14 else tuple(b - 256 if b > 127 else b for b in raw)


nccl = types.ModuleType("cupy.cuda.nccl")
for _name in ("NCCL_SUM", "NCCL_PROD", "NCCL_MAX", "NCCL_MIN", "NCCL_AVG", "NCCL_FLOAT16",
              "NCCL_FLOAT32", "NCCL_FLOAT64", "NCCL_BFLOAT16", "NCCL_INT8", "NCCL_UINT8",
              "NCCL_INT32", "NCCL_UINT32", "NCCL_INT64", "NCCL_UINT64", "NcclCommunicator",
              "NcclError", "groupStart", "groupEnd", "get_unique_id"):
    setattr(nccl, _name, globals()[_name])
cuda.nccl = nccl
