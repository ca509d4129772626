"""NCCL across processes, one GPU each (:class:`NcclTransport`).

Communicators are made when a call first needs them, in the same order on every rank, by
:func:`~.nccl_bootstrap.bootstrap_nccl` (the lowest member rank makes the unique id and sends
it to the others over MPI, or over the links of a job started by torchrun): one per channel
and one per stage-collective group, as in one process (:mod:`overlap.backends.devices.nccl_groups`).
NCCL matches point-to-point operations by their order per pair of ranks; with one device per
rank each communicator is used by one thread per rank in the channel's order, so orders
match. The NCCL calls sit behind :class:`NcclLinks` (open, send_many, recv, all_reduce,
all_gather), which the tests replace with the same operations over MPI on a stand-in GPU.

NCCL calls of one GPU are issued one at a time, held only while a call enqueues. When a
call's scope is cancelled every NCCL communicator is aborted; none is made again: a
multi-process runtime does not go on after a failure (its calls are refused; a fresh
``Runtime`` makes new communicators). Sums reduce in NCCL's order: not bit for bit with one
process.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import CollectiveAborted, OverlapRuntimeError
from ...scope import CancelScope
from ..devices.bound import Bound, Bounded, bound_of
from ..devices.nccl_groups import Aborter, nccl_bytes, nccl_dtype
from ..devices.routes import Route
from .nccl_bootstrap import bootstrap_nccl

if TYPE_CHECKING:
    from ...world import World
    from ..devices.backend import Backend
    from .distributed import Distributed


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
        self._aborter = Aborter(self._links.abort)

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
        self.kind.hold(buffer)

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
        self.kind.hold(buffer)

    def all_gather(self, group: tuple[int, ...], device: int, buffer: Any, out: Any,
                   desc: str, namespace: str, tag: int | None, scope: CancelScope) -> None:
        self._aborter.watch(scope)
        scope.check(f"all_gather[{desc}]")
        self._members_of((namespace, group), group, f"all_gather[{desc}]")
        self._links.all_gather((namespace, group), buffer, out, self.kind.current_native())
        self.kind.hold(buffer, out)

    def receives_strided(self, group: Sequence[int]) -> bool:
        """Across processes a broadcast is NCCL's: contiguous buffers only."""
        return False

    def forget(self) -> None:
        """After a failed call: nothing to drop — the communicators were aborted, and a
        multi-process runtime refuses its later calls (see module doc)."""

    def close(self) -> None:
        self._links.close()


__all__ = ["NcclLinks", "NcclTransport"]
