"""Executing a :class:`~scheduler.ReshardPlan` on a backend's streams.

Every transfer becomes, on each device taking part, one operation on that device's comm stream
(launched in plan order, so every participant launches the plan's collectives in the same
order): the sender packs its region into a contiguous staging buffer (from its source shard,
or from its destination buffer when it received the region earlier in the plan), a broadcast
moves it, and each receiver unpacks it into its destination buffer. A local copy is a strided
copy on the device. A standalone resharding runs as its step graph through the same launcher
as a training step (:mod:`overlap.launch`), so ``Transfer.after`` is an event wait on the
sender's stream in both.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from scheduler import Op, Region, ReshardPlan, StepGraph, Transfer, contains, region_shape

from .backends import Route
from .launch import launch
from .waits import sleep

if TYPE_CHECKING:
    from .backends import Backend, Event, OpReport
    from .scope import CancelScope


# Every call of a plan binds its parts again with the same regions: the slices and shapes
# are looked up (~0.1 µs) instead of built (~0.3-1 µs each, a few a part). The caches keep
# only regions (tuples of ints), bounded.
@functools.lru_cache(maxsize=1 << 14)
def _local(outer: Region, inner: Region) -> tuple[slice, ...]:
    """Slices of ``inner`` inside a buffer that holds ``outer`` (and ``...``: indexing a 0-d
    array with ``()`` gives a scalar, with ``(...,)`` a view)."""
    return (*(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer)), Ellipsis)


@functools.lru_cache(maxsize=1 << 14)
def _within(outer: Region, inner: Region) -> tuple[slice, ...] | None:
    """:func:`_local` where ``outer`` contains ``inner``; None where it does not."""
    return _local(outer, inner) if contains(outer, inner) else None


_shape = functools.lru_cache(maxsize=1 << 14)(region_shape)


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
                 array_types: tuple[type, ...] = (np.ndarray,),
                 is_local: Callable[[int], bool] | None = None) -> None:
    """Raise ValueError/TypeError naming the device unless ``shards`` fit the plan's source.

    ``array_types``: what counts as an array (the CUDA backend adds ``cupy.ndarray``);
    ``is_local``: the source devices this process must hold (all of them by default)."""
    if not isinstance(shards, Mapping):
        raise TypeError(f"shards: expected a mapping device -> ndarray, got "
                        f"{type(shards).__name__}")
    want = plan.src.device_regions(plan.shape)
    extra = sorted(set(shards) - set(want))
    if extra:
        raise ValueError(f"shards: devices {extra} are not in the plan's source mesh "
                         f"(devices {sorted(want)})")
    if is_local is not None:
        remote = [d for d in sorted(shards) if not is_local(d)]
        if remote:
            raise ValueError(f"shards: devices {remote} belong to other processes; pass only "
                             "this process's source shards")
        want = {d: r for d, r in want.items() if is_local(d)}
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


def shards_match(expected: Mapping[int, tuple[int, ...]], shards: Any, dtype: np.dtype,
                 array_types: tuple[type, ...]) -> bool:
    """Whether ``shards`` is a dict of exactly the ``expected`` devices, each an array of
    its shape and ``dtype`` — what :func:`check_shards` accepts, told in one pass; False
    leaves the naming of what is wrong (or a mapping of another kind) to it."""
    if type(shards) is not dict or len(shards) != len(expected):
        return False
    for d, shape in expected.items():
        a = shards.get(d)
        if not isinstance(a, array_types) or a.shape != shape or a.dtype != dtype:
            return False
    return True


def overlaps_itself(a: Any) -> bool:
    """Whether two indices of ``a`` may address one element (conservative: dimensions laid
    out so that each step steps over everything the smaller ones span are never refused)."""
    dims = sorted((abs(st), n) for n, st in zip(a.shape, a.strides) if n > 1)
    if any(n == 0 for n in a.shape):
        return False
    span = a.itemsize  # bytes the dimensions so far cover
    for stride, n in dims:
        if stride < span:
            return True
        span = stride * (n - 1) + span
    return False


def check_outs(plan: ReshardPlan, out: Mapping[int, np.ndarray],
               shards: Mapping[int, np.ndarray], array_types: tuple[type, ...],
               is_local: Callable[[int], bool], xp=np) -> None:
    """Raise naming the device unless ``out`` holds a writable array of the right shape and
    dtype for every destination device this process drives, none overlapping a shard."""
    if not isinstance(out, Mapping):
        raise TypeError(f"out: expected a mapping device -> ndarray, got {type(out).__name__}")
    want = {d: r for d, r in plan.dst.device_regions(plan.shape).items() if is_local(d)}
    extra = sorted(set(out) - set(want))
    if extra:
        raise ValueError(f"out: devices {extra} are not destination devices of this process "
                         f"(devices {sorted(want)})")
    missing = sorted(set(want) - set(out))
    if missing:
        raise ValueError(f"out: no array for destination devices {missing}")
    dtype = np.dtype(plan.dtype)
    overlap = getattr(xp, "may_share_memory", np.may_share_memory)
    for d, region in want.items():
        a = out[d]
        if not isinstance(a, array_types):
            raise TypeError(f"out[{d}]: expected an array, got {type(a).__name__}")
        if a.shape != region_shape(region) or a.dtype != dtype:
            raise ValueError(f"out[{d}]: got {a.shape} {a.dtype}, the plan's destination "
                             f"region {list(region)} needs {region_shape(region)} {dtype}")
        # numpy arrays may be read-only; CuPy's Flags has no such field (c_contiguous,
        # f_contiguous, owndata): device memory is always writable.
        if not getattr(a.flags, "writeable", True):
            raise ValueError(f"out[{d}]: the array is read-only")
        if overlaps_itself(a):
            raise ValueError(f"out[{d}]: its strides {tuple(a.strides)} make elements share "
                             "memory (a broadcast or as_strided view): writes would land on "
                             "each other; give an array that owns one element per index")
        for e, s in shards.items():
            if overlap(a, s):
                raise ValueError(f"out[{d}]: overlaps shards[{e}] (a transfer would read what "
                                 "another writes)")
        for e, b in out.items():
            if e < d and overlap(a, b):
                raise ValueError(f"out[{d}]: overlaps out[{e}]")


def reshard_channels(graph: StepGraph, plan: ReshardPlan) -> dict[str, tuple[int, ...]]:
    """The communicators a standalone resharding's transfers use: one per comm stream of its
    graph (a lane's own), over both layouts' devices."""
    devices = tuple(sorted({*plan.src.mesh.device_ids, *plan.dst.mesh.device_ids}))
    return {name: devices for name in graph.comm_streams.get(None, ())}


def launch_reshard(
    backend: Backend,
    plan: ReshardPlan,
    shards: Mapping[int, np.ndarray],
    outs: Mapping[int, np.ndarray],
    graph: StepGraph,
    routes: Mapping[tuple[int, int], Route],
    regions: tuple[Mapping[int, Region], Mapping[int, Region]],
    *,
    scope: CancelScope,
    report: OpReport | None = None,
    tag_base: int = 0,
) -> list[Event]:
    """Launch this process's part of every transfer of ``plan`` (non-blocking), for
    ``scope``; returns the lanes' end events.

    The plan runs as its step graph (:func:`scheduler.reshard_graph`), launched like a
    training step's; ``routes``: each (op, device)'s resolved part (:func:`resolve`);
    ``regions``: the plan's source and destination regions. ``outs[d]`` is device d's
    destination buffer (its destination region's shape), written as transfers land.
    Transfer ``i`` is named ``tag_base + i`` across processes (every process passes the
    same base). ``report``: the call's (:func:`overlap.launch.launch`)."""
    src, dst = regions
    dtype = np.dtype(plan.dtype)

    def bind(op: Op, device: int) -> Callable[[], None]:
        return transfer_op(backend, routes[(op.id, device)], op.body.transfer,  # type: ignore[union-attr]
                           src, dst, shards, outs, dtype, tag_base + op.id, scope)

    return launch(backend, graph, bind, scope, report)


def resolve(backend: Backend, graph: StepGraph, desc: Callable[[Op], str]
            ) -> dict[tuple[int, int], Route]:
    """Every transfer part this process runs in ``graph``, resolved once (a route each, by
    (op id, device)): who it moves between, on which communicator, and — across processes —
    the transport's own place for it (its chain, piece size). ``desc(op)`` names the op in
    errors and messages."""
    routes = {}
    for op in graph.ops:
        body = op.body
        if not hasattr(body, "transfer"):
            continue
        t: Transfer = body.transfer  # type: ignore[union-attr]
        for d in op.devices:
            if backend.is_local(d):
                routes[(op.id, d)] = backend.route((t.sender, *t.receivers), d, t.sender,
                                                   desc(op), op.stream, t.nbytes)
    return routes


def transfer_op(backend: Backend, route: Route, t: Transfer, src: Mapping[int, Region],
                dst: Mapping[int, Region], shards: Mapping[int, Any],
                outs: Mapping[int, Any], dtype: np.dtype, tag: int, scope: CancelScope
                ) -> Callable[[], None]:
    """Device ``route.device``'s part of transfer ``t``, as a callable for its stream: a
    local copy, or its part of a broadcast (the sender packs its region into a contiguous
    buffer when it is strided; a receiver lands it in place, or stages and unpacks)."""
    device, region = route.device, t.region
    shape = _shape(region)

    def holding(d: int) -> Any:
        """Device d's view of the region: from its source shard, else from what it received."""
        where = _within(src[d], region) if d in src else None
        if where is not None:
            return shards[d][where]
        return outs[d][_local(dst[d], region)]

    if route.local_copy:
        nbytes = math.prod(shape) * dtype.itemsize  # (numpy's dispatch: ~3 µs)
        link_time = backend.link_time

        def local_copy() -> None:
            start = time.perf_counter()
            outs[device][_local(dst[device], region)] = holding(device)
            if link_time is not None:  # emulated: at least the model's copy time
                left = start + link_time(device, (device,), nbytes) - time.perf_counter()
                if left > 0:
                    sleep(left, scope, route.what)

        return local_copy

    xp = backend.xp  # numpy on the CPU backend, cupy on CUDA

    def part() -> Any:  # (the device work it left in flight, if any: see Backend.transfer)
        if device == route.root:
            buf = holding(device)  # pack (free when contiguous; ascontiguousarray would
            if not buf.flags.c_contiguous:  # make a 0-d region 1-d)
                buf = buf.copy(order="C")
            return backend.transfer(route, buf, tag, scope)
        view = outs[device][_local(dst[device], region)]
        if view.flags.c_contiguous or route.strided:
            return backend.transfer(route, view, tag, scope)  # in place
        buf = xp.empty(shape, dtype)
        work = backend.transfer(route, buf, tag, scope)
        if work is not None:  # (the unpack reads what lands: host work after the device's)
            work.block(scope, route.what)
        view[...] = buf  # unpack
        return None

    return part
