"""Executing a :class:`~scheduler.ReshardPlan` on a backend's streams.

Every transfer becomes, on each device taking part, one operation on that device's comm stream
(launched in plan order, so every participant launches the plan's collectives in the same
order): the sender packs its region into a contiguous staging buffer (from its source shard,
or from its destination buffer when it received the region earlier in the plan), a broadcast
moves it, and each receiver unpacks it into its destination buffer. A local copy is a strided
copy on the device. ``Transfer.after`` becomes an event wait on the sender's stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import numpy as np

from scheduler import ReshardPlan
from scheduler.regions import Region, contains

from .backends.cpu import CpuBackend, CpuEvent


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(b - a for a, b in region)


def _local(outer: Region, inner: Region) -> tuple[slice, ...]:
    """Slices of ``inner`` inside a buffer that holds ``outer``."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


class BufferTable(dict):
    """device -> buffer, each made by ``make(device)`` on first access (on the stream thread
    that first touches it: the device's own memory on the CUDA backend)."""

    def __init__(self, make) -> None:
        super().__init__()
        self._make = make
        self._lock = threading.Lock()

    def __missing__(self, device: int):
        with self._lock:
            if device not in self:
                self[device] = self._make(device)
            return dict.__getitem__(self, device)


def check_shards(plan: ReshardPlan, shards: Mapping[int, np.ndarray],
                 array_types: tuple[type, ...] = (np.ndarray,)) -> None:
    """Raise ValueError/TypeError naming the device unless ``shards`` fit the plan's source.

    ``array_types``: what counts as an array (the CUDA backend adds ``cupy.ndarray``)."""
    if not isinstance(shards, Mapping):
        raise TypeError(f"shards: expected a mapping device -> ndarray, got "
                        f"{type(shards).__name__}")
    want = plan.src.device_regions(plan.shape)
    extra = sorted(set(shards) - set(want))
    if extra:
        raise ValueError(f"shards: devices {extra} are not in the plan's source mesh "
                         f"(devices {sorted(want)})")
    missing = sorted(set(want) - set(shards))
    if missing:
        raise ValueError(f"shards: no shard for source devices {missing}")
    dtype = np.dtype(plan.dtype)
    for d, region in want.items():
        a = shards[d]
        if not isinstance(a, array_types):
            kinds = " or ".join(dict.fromkeys(t.__module__.split(".")[0] for t in array_types))
            raise TypeError(f"shards[{d}]: expected a {kinds} array, got {type(a).__name__}")
        if a.shape != region_shape(region) or a.dtype != dtype:
            raise ValueError(
                f"shards[{d}]: got {a.shape} {a.dtype}, the plan's source region "
                f"{list(region)} needs {region_shape(region)} {dtype}"
            )


def launch_reshard(
    backend: CpuBackend,
    plan: ReshardPlan,
    shards: Mapping[int, np.ndarray],
    outs: Mapping[int, np.ndarray],
    *,
    stream: str = "comm",
    tag: str = "",
) -> list[CpuEvent]:
    """Launch every transfer of ``plan`` (non-blocking); returns events to await.

    ``outs[d]`` is device d's destination buffer (its destination region's shape); it is
    written as transfers land. The events complete when every participating stream is done.
    """
    src = plan.src.device_regions(plan.shape)
    dst = plan.dst.device_regions(plan.shape)
    backend.declare_group(stream, (*src, *dst))
    dtype = np.dtype(plan.dtype)
    done: list[CpuEvent] = []
    touched: set[int] = set()
    for i, t in enumerate(plan.transfers):
        desc = f"{tag}#{i}" if tag else f"#{i}"
        for d in t.devices:
            s = backend.stream(d, stream)
            touched.add(d)
            if d == t.sender:
                for j in t.after:
                    s.wait_event(done[j])
            s.launch(f"reshard {desc} on device {d}", transfer_op(
                backend, t.region, t.sender, t.receivers, d, src, dst, shards, outs, dtype, desc,
                stream,
            ), category="comm", meta=(0, 0, "fwd", f"reshard {desc}"))
        done.append(backend.stream(t.sender, stream).record(f"reshard {desc} sent"))
    return [backend.stream(d, stream).record(f"reshard {tag} done on device {d}")
            for d in sorted(touched)]


def transfer_op(backend, region, sender, receivers, device, src, dst, shards, outs, dtype,
                desc, namespace):
    """Device ``device``'s part of one transfer, as a callable for its stream."""
    shape = region_shape(region)

    def holding(d: int) -> np.ndarray:
        """Device d's view of the region: from its source shard, else from what it received."""
        if d in src and contains(src[d], region):
            return shards[d][_local(src[d], region)]
        return outs[d][_local(dst[d], region)]

    xp = backend.xp  # numpy on the CPU backend, cupy on CUDA

    if receivers == (sender,):
        def local_copy() -> None:
            start = time.perf_counter()
            outs[device][_local(dst[device], region)] = holding(device)
            if backend.link_time is not None:  # emulated: at least the model's copy time
                nbytes = int(np.prod(shape)) * dtype.itemsize
                left = start + backend.link_time(sender, (sender,), nbytes) - time.perf_counter()
                if left > 0:
                    time.sleep(left)
        return local_copy

    group = (sender, *receivers)

    def op() -> None:
        if device == sender:
            buf = xp.ascontiguousarray(holding(device))  # pack (free when contiguous)
            backend.broadcast(group, device, sender, buf, desc, namespace)
            return
        view = outs[device][_local(dst[device], region)]
        if view.flags.c_contiguous:
            backend.broadcast(group, device, sender, view, desc, namespace)  # in place
        else:
            buf = xp.empty(shape, dtype)
            backend.broadcast(group, device, sender, buf, desc, namespace)
            view[...] = buf  # unpack
    return op
