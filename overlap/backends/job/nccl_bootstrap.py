"""NCCL communicators across processes, bootstrapped over MPI (or the links of a job that
torchrun started: the same two calls, :class:`~.host_links.LinksComm`).

NCCL needs every member of a communicator to call ``ncclCommInitRank(n, id, rank)`` with the
same 128-byte unique id, made by one member (``ncclGetUniqueId``). Between processes that id
travels over MPI: the lowest member rank makes it and sends it to the other members
(point-to-point, so only members take part), polled with the caller's backoff and bounded by
its timeout. Every member must create its communicators in the same order (the runtime
declares channels in program order on every rank), and each rank drives one GPU.

``nccl`` is ``cupy.cuda.nccl`` (or a stand-in with the same two calls, in tests). The id is a
tuple of 128 signed chars in CuPy 13 and 128 ``bytes`` in CuPy ≥ 14 (which also takes an
optional ``NcclConfig``); both travel (:func:`to_wire`) and arrive as the type they left.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...errors import CollectiveTimeout
from .engine import Backoff

ID_TAG = 0x4E43  # "NC": the tag of unique-id messages on the bootstrap communicator


def bootstrap_nccl(comm: Any, members: Sequence[int], rank: int, nccl: Any, *,
                   timeout: float = 30.0, pause: Callable[[int], None] | None = None) -> Any:
    """This rank's NCCL communicator over ``members`` (MPI ranks of ``comm``, in NCCL rank
    order). Raises ``ValueError`` if this rank is not a member, ``CollectiveTimeout`` naming
    the root if its id never arrives."""
    members = [int(m) for m in members]
    if len(set(members)) != len(members) or not members:
        raise ValueError(f"members: expected distinct ranks, got {members}")
    if rank not in members:
        raise ValueError(f"members: rank {rank} is not one of {members}")
    pause = pause or (lambda attempt: time.sleep(Backoff().delay(attempt)))
    root = members[0]
    if rank == root:
        wire = to_wire(nccl.get_unique_id())
        reqs = [comm.Isend(wire, dest=m, tag=ID_TAG) for m in members[1:]]
    else:
        wire = np.empty(_id_len(nccl) + 1, dtype=np.int64)
        reqs = [comm.Irecv(wire, source=root, tag=ID_TAG)]
    started = time.perf_counter()
    attempt = 0
    while not all(r.Test() for r in reqs):
        if time.perf_counter() - started > timeout:
            for r in reqs:
                if rank != root:
                    r.Cancel()
            raise CollectiveTimeout(
                f"NCCL bootstrap over ranks {members}: rank {rank} waited {timeout:g} s for the "
                f"unique id from rank {root}" if rank != root else
                f"NCCL bootstrap over ranks {members}: ranks {members[1:]} never took the id",
                op="nccl bootstrap", devices=(), missing=())
        pause(attempt)
        attempt += 1
    return nccl.NcclCommunicator(len(members), from_wire(wire), members.index(rank))


def to_wire(uid: bytes | tuple[int, ...]) -> np.ndarray:
    """An NCCL unique id as it travels: its bytes (0..255), then 1 if it was ``bytes`` (CuPy
    ≥ 14: ``get_unique_id()`` returns bytes, ``NcclCommunicator`` takes bytes) or 0 if a tuple
    of signed chars (CuPy 13). Every rank runs the same CuPy, so the receivers rebuild the
    root's type."""
    if isinstance(uid, (bytes, bytearray)):
        values, kind = np.frombuffer(bytes(uid), np.uint8).astype(np.int64), 1
    else:
        values, kind = np.asarray(uid, dtype=np.int64) & 0xFF, 0
    return np.concatenate([values, [kind]])


def from_wire(wire: np.ndarray) -> bytes | tuple[int, ...]:
    """The id :func:`to_wire` sent, of the type the sender's CuPy uses."""
    values = [int(v) & 0xFF for v in wire[:-1]]
    if int(wire[-1]) == 1:
        return bytes(values)
    return tuple(v - 256 if v > 127 else v for v in values)


def _id_len(nccl: Any) -> int:
    """Bytes in an NCCL unique id (128 in every NCCL release)."""
    return int(getattr(nccl, "NCCL_UNIQUE_ID_BYTES", 128))
