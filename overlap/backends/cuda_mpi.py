"""The CUDA backend across processes: one process per GPU, NCCL between them.

Each rank drives exactly one device (``mpiexec -n <GPUs>``; the GPU is the rank's local rank
modulo the visible GPUs). Everything inside the process is the CUDA backend's (a host thread
per stream feeding a CUDA stream, events, keep-alive). Collectives that span ranks are NCCL
operations enqueued on the calling op's CUDA stream:

- **Communicators** — a bounded number, as in one process: one per channel namespace over the
  ranks of its devices (``declare_group``), one per stage-collective group that spans ranks
  (``declare_subgroups``). They are made on the main thread when first declared, in the same
  order on every rank, by :func:`~overlap.backends.nccl_bootstrap.bootstrap_nccl` (the lowest
  member makes the NCCL unique id and sends it to the others over MPI).
- **Order, not tags.** NCCL matches point-to-point operations by their order per pair of
  ranks. With one device per rank, each communicator is used by one thread of each rank (the
  device's channel stream, or its compute stream), which runs the channel's transfers in the
  channel's order — the same order on every rank — so the orders match.
- A broadcast is the root's grouped sends to each receiving rank; all-reduce (sum) and
  all-gather are NCCL's. Sums reduce in NCCL's order, so results may differ from one process
  in the last bits (the CPU data plane keeps device order and is bit-for-bit).

The NCCL calls sit behind a small interface (:class:`NcclLinks`: open, send_many, recv,
all_reduce, all_gather) so the backend's logic runs on a machine without GPUs: the tests run
it on a numpy stand-in for CuPy with links that move the bytes over MPI. **No multi-process
run on GPUs has happened yet** — that needs two GPUs, and the check machine has one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import OverlapRuntimeError
from ..world import Placement, World
from .cuda import CudaBackend, _nccl_dtype
from .distributed import Backoff, Distributed
from .nccl_bootstrap import bootstrap_nccl


class NcclLinks:
    """This rank's NCCL communicators, keyed by channel (or (namespace, group))."""

    def __init__(self, comm: Any, rank: int, *, timeout: float, poll: Backoff) -> None:
        self._boot = comm  # an MPI communicator of every rank: carries the unique ids
        self.rank = rank
        self.timeout = timeout
        self.poll = poll
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
                                          timeout=self.timeout, pause=self.poll.pause)

    def send_many(self, key: Any, buf: Any, peers: Sequence[int], stream: Any) -> None:
        nccl = self._nccl()
        comm = self._comms[key]
        with self._issue:
            nccl.groupStart()
            try:
                for p in peers:
                    comm.send(buf.data.ptr, buf.size, _nccl_dtype(buf.dtype), p, stream.ptr)
            finally:
                nccl.groupEnd()

    def recv(self, key: Any, buf: Any, peer: int, stream: Any) -> None:
        with self._issue:
            self._comms[key].recv(buf.data.ptr, buf.size, _nccl_dtype(buf.dtype), peer,
                                  stream.ptr)

    def all_reduce(self, key: Any, buf: Any, stream: Any) -> None:
        nccl = self._nccl()
        with self._issue:
            self._comms[key].allReduce(buf.data.ptr, buf.data.ptr, buf.size,
                                       _nccl_dtype(buf.dtype), nccl.NCCL_SUM, stream.ptr)

    def all_gather(self, key: Any, buf: Any, out: Any, stream: Any) -> None:
        with self._issue:
            self._comms[key].allGather(buf.data.ptr, out.data.ptr, buf.size,
                                       _nccl_dtype(buf.dtype), stream.ptr)

    def close(self) -> None:
        comms, self._comms = list(self._comms.values()), {}
        for c in comms:
            c.destroy()


class CudaMpiBackend(CudaBackend):
    """One device of an MPI job on this process's GPU (see module doc)."""

    def __init__(self, num_devices: int, *, world: World, placement: Placement,
                 timeout: float = 30.0, poll: Backoff | None = None,
                 links: Callable[..., Any] | None = None,
                 host_links: bool | None = None) -> None:
        """``host_links``: the runtime's own rounds over Unix sockets between the ranks of
        a host (see ``Distributed``); the data is NCCL's either way."""
        placement.check_covers(num_devices)
        mine = placement.devices_of(world.rank)
        if len(mine) != 1:
            raise ValueError(
                f"placement: backend 'cuda' across processes runs one device per process (one "
                f"process per GPU); rank {world.rank} owns {len(mine)} devices — launch as "
                "many processes as the cluster has devices")
        super().__init__(num_devices, timeout=timeout, placement=placement, rank=world.rank)
        self.dist = Distributed(self, world, placement, poll=poll, host_links=host_links)
        self._gpu = world.local_rank % self.num_gpus
        self._links = (links or NcclLinks)(self.dist.comm.Dup(), world.rank, timeout=timeout,
                                           poll=self.dist.poll)
        self._members: dict[Any, tuple[int, ...]] = {}

    def physical(self, device: int) -> int:
        return self._gpu  # this process's one device is on its GPU

    def receives_strided(self, group: Sequence[int]) -> bool:
        """Across processes a broadcast is NCCL's: contiguous buffers only."""
        return not self._spans(tuple(sorted(set(group))))

    # ---- communicators (main thread, the same order on every rank) ------------------------

    def declare_group(self, namespace: str, devices: Sequence[int]) -> None:
        members = tuple(sorted(set(self.placement.ranks_of(devices))))
        if self._members.get(namespace) == members:
            return
        self._members[namespace] = members
        if self.rank in members and len(members) > 1:
            self._open(namespace, members)

    def declare_subgroups(self, namespace: str, groups: Sequence[Sequence[int]]) -> None:
        for g in groups:
            group = tuple(sorted(set(g)))
            key = (namespace, group)
            if key in self._members:
                continue
            members = tuple(self.placement.owners[d] for d in group)  # NCCL rank = device order
            self._members[key] = members
            if self.rank in members and len(members) > 1:
                self._open(key, members)

    def _open(self, key: Any, members: tuple[int, ...]) -> None:
        # ncclCommInitRank binds the communicator to the *current* device: on the main thread
        # that is GPU 0 unless made otherwise, and every rank of a node would share it.
        with self.xp.cuda.Device(self._gpu):
            self._links.open(key, members)

    def _spans(self, group: tuple[int, ...]) -> bool:
        return self.placement.ranks_of(group) != (self.rank,)

    def _members_of(self, key: Any, group: tuple[int, ...], what: str) -> tuple[int, ...]:
        members = self._members.get(key)
        ranks = set(self.placement.ranks_of(group))
        if members is None or not ranks <= set(members):
            raise OverlapRuntimeError(f"{what}: devices {list(group)} span processes but no "
                                      f"communicator covering them was declared ({key!r})")
        return members

    # ---- collectives (on the calling op's stream) -----------------------------------------

    def broadcast(self, devices: Sequence[int], device: int, root: int, buffer: Any,
                  desc: str, namespace: str = "", tag: int | None = None) -> None:
        group = tuple(sorted(set(devices) | {root}))
        if not self._spans(group):
            return super().broadcast(devices, device, root, buffer, desc, namespace, tag)
        what = f"broadcast[{desc}] root {root}"
        members = self._members_of(namespace, group, what)
        stream = self._local.stream.cuda_stream
        owner = self.placement.owners
        if device == root:
            receivers = dict.fromkeys(owner[d] for d in devices if d != root)
            self._links.send_many(namespace, buffer, [members.index(r) for r in receivers],
                                  stream)
        else:
            self._links.recv(namespace, buffer, members.index(owner[root]), stream)
        self._keep(self._arrive(), buffer)
        return None

    def all_reduce(self, devices: Sequence[int], device: int, buffer: Any, desc: str,
                   op: Callable[[Any, Any], Any] = np.add, namespace: str = "",
                   tag: int | None = None) -> None:
        group = tuple(sorted(set(devices)))
        if not self._spans(group):
            return super().all_reduce(devices, device, buffer, desc, op, namespace, tag)
        if op is not np.add:
            raise OverlapRuntimeError(f"all_reduce[{desc}]: across processes only the sum "
                                      "runs (NCCL_SUM)")
        self._members_of((namespace, group), group, f"all_reduce[{desc}]")
        self._links.all_reduce((namespace, group), buffer, self._local.stream.cuda_stream)
        self._keep(self._arrive(), buffer)
        return None

    def all_gather(self, devices: Sequence[int], device: int, buffer: Any, out: Any,
                   desc: str, namespace: str = "", tag: int | None = None) -> None:
        group = tuple(sorted(set(devices)))
        if not self._spans(group):
            return super().all_gather(devices, device, buffer, out, desc, namespace, tag)
        self._members_of((namespace, group), group, f"all_gather[{desc}]")
        self._links.all_gather((namespace, group), buffer, out, self._local.stream.cuda_stream)
        self._keep(self._arrive(), buffer, out)
        return None

    def close(self) -> None:
        super().close()
        self._links.close()


__all__ = ["CudaMpiBackend", "NcclLinks"]
