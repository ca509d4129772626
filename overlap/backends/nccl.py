"""NCCL: collectives among distinct GPUs, in one process and across processes.

**Communicators — a bounded number.** One per channel (a pipeline boundary in one direction
spans both stage meshes; a standalone resharding its two layouts' devices; a lane's stream
has its own), in which a broadcast is the root's grouped sends to its receivers — so a
pipeline of p stages needs 2 (p − 1) of them, whatever its plans' device sets — plus one per
stage-collective group. Alpa creates one per distinct device set instead.

- In one process (:class:`NcclGroups`): ``ncclCommInitAll`` over the group's GPUs, each
  device's communicator used by that device's stream threads; the participants first match
  launch positions on the host (a rendezvous: mismatches and missing peers are named).
- Across processes (:class:`NcclTransport`, one device per process): communicators made when
  a call first needs them, in the same order on every rank, by
  :func:`~.nccl_bootstrap.bootstrap_nccl` (the lowest member rank makes the unique id and
  sends it to the others over MPI, or over the links of a job started by torchrun). NCCL
  matches point-to-point operations by their order per pair of ranks; with one device per
  rank each communicator is used by one thread per rank in the channel's order, so orders
  match. The NCCL calls sit behind :class:`NcclLinks` (open,
  send_many, recv, all_reduce, all_gather), which the tests replace with the same operations
  over MPI on a stand-in GPU.

NCCL calls of one GPU are issued one at a time (NCCL documents concurrent calls on one
device from several threads as unsafe; a GPU's channel threads and compute thread are
several threads), held only while a call enqueues. When a call's scope is cancelled every
NCCL communicator is aborted (a receiver whose sender failed would spin in its kernel
otherwise). In one process the next collective makes new ones (:class:`NcclGroups`); across
processes none is made again (:class:`NcclTransport`): a multi-process runtime does not go
on after a failure (its calls are refused; a fresh ``Runtime`` makes new communicators).
Sums reduce in NCCL's order: not bit for bit with one process.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from scheduler import NARROW_FLOATS

from ..errors import CollectiveAborted, OverlapRuntimeError
from ..scope import CancelScope
from .bound import Bound, Bounded, bound_of
from .nccl_bootstrap import bootstrap_nccl
from .routes import Route

if TYPE_CHECKING:
    from ..world import World
    from .backend import Backend
    from .distributed import Distributed


def nccl_op(op: Callable[[Any, Any], Any]) -> int:
    """NCCL's reduction for a numpy/CuPy ufunc (by name: ``cupy.add`` is not ``numpy.add``)."""
    from cupy.cuda import nccl

    table = {"add": nccl.NCCL_SUM, "multiply": nccl.NCCL_PROD, "maximum": nccl.NCCL_MAX,
             "minimum": nccl.NCCL_MIN}
    name = getattr(op, "__name__", None)
    if name not in table:
        raise TypeError(f"op: NCCL reduces with add, multiply, maximum or minimum, not {op!r}")
    return table[name]


def nccl_dtype(dtype: Any) -> int:
    """NCCL's type for a reduction or gather over ``dtype`` (TypeError where NCCL has none:
    float8, bool, complex). Point-to-point transfers move bytes (:func:`nccl_bytes`)."""
    from cupy.cuda import nccl

    table = {
        np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
        np.dtype(np.float64): nccl.NCCL_FLOAT64, NARROW_FLOATS["bfloat16"]: nccl.NCCL_BFLOAT16,
        np.dtype(np.int8): nccl.NCCL_INT8, np.dtype(np.uint8): nccl.NCCL_UINT8,
        np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.uint32): nccl.NCCL_UINT32,
        np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.uint64): nccl.NCCL_UINT64,
    }
    try:
        return table[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"dtype: NCCL reduces and gathers no {np.dtype(dtype)}") from None


def nccl_bytes(buf: Any) -> tuple[int, int]:
    """(count, NCCL type) that move ``buf``'s bytes whatever its dtype — a send and its
    receive agree on them, and every dtype a plan may carry (float8 too) crosses."""
    from cupy.cuda import nccl

    return buf.size * buf.itemsize, nccl.NCCL_UINT8


class _Aborter:
    """Aborts a set of communicators when a call's scope is cancelled (once per scope)."""

    def __init__(self, abort: Callable[[], None]) -> None:
        self._abort = abort
        self._seen: weakref.WeakSet[CancelScope] = weakref.WeakSet()
        self._lock = threading.Lock()

    def watch(self, scope: CancelScope) -> None:
        with self._lock:
            if scope in self._seen:
                return
            self._seen.add(scope)
        if scope.on_cancel(self._abort) is None:
            self._abort()


class NcclGroups:
    """NCCL among one process's distinct GPUs (see module doc)."""

    def __init__(self, kind: Any) -> None:  # (the CUDA device kind)
        self.kind = kind
        self._lock = threading.Lock()
        self._comms: dict[tuple[str, tuple[int, ...]], dict[int, Any]] = {}
        self._declared: dict[str, tuple[int, ...]] = {}
        self._issue_locks: dict[int, threading.Lock] = {}  # per GPU: see issuing
        self._aborter = _Aborter(self.abort)

    def declare(self, namespace: str, devices: Sequence[int]) -> None:
        """Every device that collectives of ``namespace`` (a channel) may involve: one
        communicator spans them (a channel's group changed: a new one)."""
        group = tuple(sorted(set(devices)))
        with self._lock:
            old = self._declared.get(namespace)
            if old is not None and old != group:
                for c in self._comms.pop((namespace, old), {}).values():
                    c.destroy()
            self._declared[namespace] = group

    def _comm(self, namespace: str, group: tuple[int, ...], device: int, scope: CancelScope,
              what: str) -> tuple[Any, tuple[int, ...]]:
        """The communicator of ``device`` for this collective, and its ranks' devices: the
        declared channel's when it covers the group on distinct GPUs, else the group's own.

        Raises if ``scope`` is cancelled: the host rendezvous lets its last arriver through
        (and a waiter that sees it complete) even after a cancel, and the abort has cleared
        the communicators — new ones would carry a send or recv whose peer never comes, a
        kernel spinning for good. (Checked under the lock the abort takes.)"""
        physical = self.kind.physical
        with self._lock:
            if scope.cancelled:
                raise scope.aborted(f"{what} on device {device}")
            members = self._declared.get(namespace, group)
            if not set(group) <= set(members) or len({physical(d) for d in members}) < len(
                    members):
                members = group
            key = (namespace, members)
            if key not in self._comms:
                from cupy.cuda import nccl

                comms = nccl.NcclCommunicator.initAll([physical(d) for d in members])
                self._comms[key] = dict(zip(members, comms))
            return self._comms[key][device], members

    def issuing(self, device: int) -> threading.Lock:
        """The lock under which NCCL calls on ``device``'s GPU are issued (see module doc)."""
        gpu = self.kind.physical(device)
        with self._lock:
            lock = self._issue_locks.get(gpu)
            if lock is None:
                lock = self._issue_locks[gpu] = threading.Lock()
            return lock

    def broadcast(self, backend: Backend, group: tuple[int, ...], device: int, root: int,
                  buffer: Any, desc: str, namespace: str, scope: CancelScope) -> None:
        from cupy.cuda import nccl

        self._aborter.watch(scope)
        what = f"broadcast[{desc}] root {root}"
        # Match launch positions on the host first: mismatches and missing peers are named.
        backend.comms.get(namespace, group).run(device, what, None, lambda _: 0.0, scope)
        comm, ranks = self._comm(namespace, group, device, scope, what)
        stream = self.kind.current_native().ptr
        count, dtype = nccl_bytes(buffer)
        with self.issuing(device):
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
        self.kind.keep(self.kind.arrive(), buffer)

    def all_reduce(self, backend: Backend, group: tuple[int, ...], device: int, buffer: Any,
                   desc: str, op: Callable[[Any, Any], Any], namespace: str,
                   scope: CancelScope) -> None:
        reduction = nccl_op(op)  # before any rendezvous: an unknown op fails alone
        self._aborter.watch(scope)
        what = f"all_reduce[{desc}]"
        backend.comms.get(namespace, group).run(device, what, None, lambda _: 0.0, scope)
        comm, _ = self._comm(f"{namespace}:{group}", group, device, scope, what)
        with self.issuing(device):
            comm.allReduce(buffer.data.ptr, buffer.data.ptr, buffer.size,
                           nccl_dtype(buffer.dtype), reduction, self.kind.current_native().ptr)
        self.kind.keep(self.kind.arrive(), buffer)

    def abort(self) -> None:
        """Abort every communicator (best effort); the next collective makes new ones."""
        with self._lock:
            comms = [c for group in self._comms.values() for c in group.values()]
            self._comms.clear()
        for c in comms:
            with contextlib.suppress(Exception):
                c.abort()

    def destroy(self) -> None:
        with self._lock:
            comms = [c for group in self._comms.values() for c in group.values()]
            self._comms.clear()
        for c in comms:
            c.destroy()


class NcclLinks(Bounded):
    """This rank's NCCL communicators across processes, keyed by channel (or (namespace,
    group)): the NCCL calls :class:`NcclTransport` makes."""

    def __init__(self, comm: Any, rank: int, *, timeout: float | Bound) -> None:
        self._boot = comm  # an MPI communicator of every rank: carries the unique ids
        self.rank = rank
        self.bound = bound_of(timeout)
        self._comms: dict[Any, Any] = {}
        # This process's one GPU: NCCL calls on it from several threads (channel threads, the
        # compute thread) at once are unsafe; each call only enqueues, so holding this while
        # it does blocks nobody for long.
        self._issue = threading.Lock()

    @staticmethod
    def _nccl() -> Any:
        from cupy.cuda import nccl

        return nccl

    def open(self, key: Any, members: Sequence[int]) -> None:
        """(Re)create the communicator ``key`` over ``members`` (world ranks, NCCL order)."""
        old = self._comms.pop(key, None)
        if old is not None:
            old.destroy()
        self._comms[key] = bootstrap_nccl(self._boot, members, self.rank, self._nccl(),
                                          timeout=self.timeout)

    def _comm(self, key: Any) -> Any:
        """The communicator ``key``; after :meth:`abort` (a call's scope was cancelled) a
        call of that call's that got past its own check fails as aborted — a consequence,
        not a ``KeyError`` that would pass for the call's root cause."""
        comm = self._comms.get(key)
        if comm is None:
            raise CollectiveAborted(f"NCCL communicator {key!r}: aborted (the call was "
                                    "cancelled), or never opened")
        return comm

    def send_many(self, key: Any, buf: Any, peers: Sequence[int], stream: Any) -> None:
        nccl = self._nccl()
        comm = self._comm(key)
        with self._issue:
            nccl.groupStart()
            try:
                for p in peers:
                    comm.send(buf.data.ptr, *nccl_bytes(buf), p, stream.ptr)
            finally:
                nccl.groupEnd()

    def recv(self, key: Any, buf: Any, peer: int, stream: Any) -> None:
        comm = self._comm(key)
        with self._issue:
            comm.recv(buf.data.ptr, *nccl_bytes(buf), peer, stream.ptr)

    def all_reduce(self, key: Any, buf: Any, stream: Any) -> None:
        nccl = self._nccl()
        comm = self._comm(key)
        with self._issue:
            comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, nccl_dtype(buf.dtype),
                           nccl.NCCL_SUM, stream.ptr)

    def all_gather(self, key: Any, buf: Any, out: Any, stream: Any) -> None:
        comm = self._comm(key)
        with self._issue:
            comm.allGather(buf.data.ptr, out.data.ptr, buf.size, nccl_dtype(buf.dtype),
                           stream.ptr)

    def abort(self) -> None:
        comms, self._comms = list(self._comms.values()), {}
        for c in comms:
            with contextlib.suppress(Exception):
                c.abort()

    def close(self) -> None:
        comms, self._comms = list(self._comms.values()), {}
        for c in comms:
            c.destroy()


class NcclTransport:
    """Collectives across processes on CUDA, one device per process (see module doc): the
    multi-process CUDA backend's ``remote``."""

    # What makes the links; the tests put a stand-in here (NCCL's operations over MPI).
    links_class: Any = NcclLinks

    def __init__(self, backend: Backend, dist: Distributed, world: World) -> None:
        kind = backend.devices
        kind.pinned = world.local_rank % kind.num_gpus  # this process's one GPU
        assert backend.placement is not None
        self.backend = backend
        self.kind = kind
        self.placement = backend.placement
        self.rank = backend.rank
        self._links = self.links_class(dist.bootstrap_comm(), world.rank,
                                       timeout=backend.bound)
        self._members: dict[Any, tuple[int, ...]] = {}
        self._aborter = _Aborter(self._links.abort)

    def spans(self, group: Sequence[int]) -> bool:
        return self.placement.ranks_of(tuple(group)) != (self.rank,)

    def prepared(self, channels: dict[str, tuple[int, ...]],
                 groups: Sequence[tuple[str, tuple[int, ...]]]) -> bool:
        """Whether every one of these channels and groups has its communicator already."""
        owners = self.placement.ranks_of
        return (all(self._members.get(n) == tuple(sorted(set(owners(d))))
                    for n, d in channels.items())
                and all((n, tuple(sorted(set(g)))) in self._members for n, g in groups))

    def prepare(self, channels: dict[str, tuple[int, ...]],
                groups: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        """Open each new channel's communicator over its ranks, and each new stage group's
        (every rank, same order; ``ncclCommInitRank`` binds the current device, so this
        process's GPU is made current)."""
        for namespace, devices in channels.items():
            members = tuple(sorted(set(self.placement.ranks_of(devices))))
            if self._members.get(namespace) != members:
                self._members[namespace] = members
                if self.rank in members and len(members) > 1:
                    self._open(namespace, members)
        for namespace, g in groups:
            group = tuple(sorted(set(g)))
            key = (namespace, group)
            if key in self._members:
                continue
            members = tuple(self.placement.owners[d] for d in group)  # NCCL rank = device order
            self._members[key] = members
            if self.rank in members and len(members) > 1:
                self._open(key, members)

    def _open(self, key: Any, members: tuple[int, ...]) -> None:
        with self.kind.xp.cuda.Device(self.kind.pinned):
            self._links.open(key, members)

    def _members_of(self, key: Any, group: tuple[int, ...], what: str) -> tuple[int, ...]:
        members = self._members.get(key)
        ranks = set(self.placement.ranks_of(group))
        if members is None or not ranks <= set(members):
            raise OverlapRuntimeError(f"{what}: devices {list(group)} span processes but no "
                                      f"communicator covering them was prepared ({key!r})")
        return members

    def hop(self, order: tuple[int, ...], device: int, root: int, namespace: str,
            nbytes: int) -> tuple[int, ...]:
        return order

    def transfer(self, route: Route, buffer: Any, tag: int, scope: CancelScope) -> None:
        self.broadcast(route.order, route.device, route.root, buffer, route.desc,
                       route.namespace, tag, scope)

    def broadcast(self, order: tuple[int, ...], device: int, root: int, buffer: Any,
                  desc: str, namespace: str, tag: int | None, scope: CancelScope) -> None:
        self._aborter.watch(scope)
        group = tuple(sorted(set(order)))
        what = f"broadcast[{desc}] root {root}"
        scope.check(what)  # (cancelled: the links were aborted; a peer may never come)
        members = self._members_of(namespace, group, what)
        stream = self.kind.current_native()
        owner = self.placement.owners
        if device == root:
            receivers = dict.fromkeys(owner[d] for d in order if d != root)
            self._links.send_many(namespace, buffer, [members.index(r) for r in receivers],
                                  stream)
        else:
            self._links.recv(namespace, buffer, members.index(owner[root]), stream)
        self.kind.keep(self.kind.arrive(), buffer)

    def all_reduce(self, group: tuple[int, ...], device: int, buffer: Any, desc: str,
                   op: Callable[[Any, Any], Any], namespace: str, tag: int | None,
                   scope: CancelScope) -> None:
        if op is not np.add and getattr(op, "__name__", None) != "add":
            raise OverlapRuntimeError(f"all_reduce[{desc}]: across processes only the sum "
                                      "runs (NCCL_SUM)")
        self._aborter.watch(scope)
        scope.check(f"all_reduce[{desc}]")
        self._members_of((namespace, group), group, f"all_reduce[{desc}]")
        self._links.all_reduce((namespace, group), buffer, self.kind.current_native())
        self.kind.keep(self.kind.arrive(), buffer)

    def all_gather(self, group: tuple[int, ...], device: int, buffer: Any, out: Any,
                   desc: str, namespace: str, tag: int | None, scope: CancelScope) -> None:
        self._aborter.watch(scope)
        scope.check(f"all_gather[{desc}]")
        self._members_of((namespace, group), group, f"all_gather[{desc}]")
        self._links.all_gather((namespace, group), buffer, out, self.kind.current_native())
        self.kind.keep(self.kind.arrive(), buffer, out)

    def receives_strided(self, group: Sequence[int]) -> bool:
        """Across processes a broadcast is NCCL's: contiguous buffers only."""
        return False

    def close(self) -> None:
        self._links.close()


__all__ = ["NcclGroups", "NcclLinks", "NcclTransport", "nccl_bytes", "nccl_dtype", "nccl_op"]
