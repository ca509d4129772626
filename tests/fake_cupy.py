"""A CuPy stand-in on numpy, for running the CUDA backend's host logic without a GPU.

Streams are context managers that only track the current stream; events complete at once
and carry a host timestamp; arrays are numpy arrays. It checks what the backend's *host* code
does (threads, event hooks, loopback collectives, buffer keep-alive, trace marks) — not what
a GPU does asynchronously, which only benchmarks/gpu_check.py on a GPU can.
"""

from __future__ import annotations

import threading
import time
import types

import numpy as np
from numpy import (  # noqa: F401  (the array API the backend and tests use)
    add,
    arange,
    array,
    asarray,
    ascontiguousarray,
    empty,
    empty_like,
    float32,
    float64,
    ndarray,
    ones,
    zeros,
)

__version__ = "fake"
_local = threading.local()
launches: list[str] = []  # what was enqueued where, for assertions


def asnumpy(a):
    return np.asarray(a)


class Device:
    def __init__(self, gpu: int = 0) -> None:
        self.id = gpu

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self) -> None:
        pass


class Stream:
    _count = 0

    def __init__(self, non_blocking: bool = False, null: bool = False) -> None:
        Stream._count += 1
        self.ptr = 0 if null else Stream._count

    def __enter__(self):
        self._prev = getattr(_local, "stream", None)
        _local.stream = self
        return self

    def __exit__(self, *exc):
        _local.stream = self._prev
        return False

    def wait_event(self, event) -> None:
        if not event.recorded:
            raise AssertionError("wait_event on an event that was never recorded")
        launches.append(f"wait {self.ptr}")


Stream.null = Stream(null=True)


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self.recorded = False
        self.t = 0.0

    def record(self, stream=None) -> None:
        self.recorded = True
        self.t = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.recorded

    def synchronize(self) -> None:
        pass


def get_current_stream():
    return getattr(_local, "stream", None) or Stream.null


def get_elapsed_time(a: Event, b: Event) -> float:
    return (b.t - a.t) * 1e3


runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, memcpyPeerAsync=None)
cuda = types.SimpleNamespace(Device=Device, Stream=Stream, Event=Event, runtime=runtime,
                             get_current_stream=get_current_stream,
                             get_elapsed_time=get_elapsed_time)
