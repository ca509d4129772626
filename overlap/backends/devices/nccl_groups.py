"""NCCL among one process's distinct GPUs (:class:`NcclGroups`), and what NCCL across
processes shares with it: a reduction's and a dtype's NCCL names, and the abort of a set of
communicators when a call's scope is cancelled (:class:`Aborter`).

**Communicators — a bounded number.** One per channel (a pipeline boundary in one direction
spans both stage meshes; a standalone resharding its two layouts' devices; a lane's stream
has its own), in which a broadcast is the root's grouped sends to its receivers — so a
pipeline of p stages needs 2 (p − 1) of them, whatever its plans' device sets — plus one per
stage-collective group. Alpa creates one per distinct device set instead.

In one process: ``ncclCommInitAll`` over the group's GPUs, each device's communicator used by
that device's stream threads; the participants first match launch positions on the host (a
rendezvous: mismatches and missing peers are named). Across processes (one device per
process) the job package's :mod:`overlap.backends.job.nccl` makes and drives them.

NCCL calls of one GPU are issued one at a time (NCCL documents concurrent calls on one
device from several threads as unsafe; a GPU's channel threads and compute thread are
several threads), held only while a call enqueues. When a call's scope is cancelled every
NCCL communicator is aborted (a receiver whose sender failed would spin in its kernel
otherwise); in one process the next collective makes new ones.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from scheduler import NARROW_FLOATS

from ...scope import CancelScope

if TYPE_CHECKING:
    from .backend import Backend


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


class Aborter:
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
        self._aborter = Aborter(self.abort)

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
        self.kind.hold(buffer)

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
        self.kind.hold(buffer)

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


__all__ = ["Aborter", "NcclGroups", "nccl_bytes", "nccl_dtype", "nccl_op"]
