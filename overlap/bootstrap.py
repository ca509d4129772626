"""What a multi-process backend needs once, at setup, from whatever launched the job: a few
collectives over small values (every rank calls them from its main thread, in the same
order) and the name of the host this rank runs on.

The values travel as JSON bytes (a length round, then the padded bytes), never pickled: what
a peer sends is parsed as data, not run.

- :class:`MpiBootstrap` — ``mpiexec`` / ``srun``: over ``MPI.COMM_WORLD``.
- :class:`TorchBootstrap` — ``torchrun``, or a process group the caller initialized: over a
  gloo group of ``torch.distributed``, whose rendezvous (``MASTER_ADDR``/``MASTER_PORT``,
  torchrun's agent store, or the caller's ``init_method``) joins the processes. Its host is
  torchrun's node (``GROUP_RANK``, one agent per node): containers on different nodes may
  share a host name, and the ranks of one agent always share a host.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any, Protocol

import numpy as np


class Bootstrap(Protocol):
    rank: int
    size: int

    def allgather(self, value: Any) -> list[Any]: ...

    def bcast(self, value: Any, root: int = 0) -> Any: ...

    def all_true(self, ok: bool) -> bool: ...

    def host(self) -> str: ...


MAX_VALUE_BYTES = 1 << 16  # a setup value is a host name, an address, a token


def encode_value(value: Any) -> np.ndarray:
    """A setup value as bytes (JSON: plain data, never a pickle), at most
    :data:`MAX_VALUE_BYTES`."""
    data = json.dumps(value).encode()
    if len(data) > MAX_VALUE_BYTES:
        raise ValueError(f"a setup value of {len(data)} bytes (at most {MAX_VALUE_BYTES})")
    return np.frombuffer(data, np.uint8)


def decode_values(rows: np.ndarray, lengths: np.ndarray) -> list[Any]:
    """The values of :func:`encode_value` rows (each row's first ``lengths[r]`` bytes);
    ValueError on anything that is not one."""
    out = []
    for r, n in enumerate(lengths):
        if not 0 <= n <= MAX_VALUE_BYTES:
            raise ValueError(f"rank {r} sent a setup value of {n} bytes")
        out.append(json.loads(rows[r, :n].tobytes()))
    return out


class MpiBootstrap:
    """Setup collectives over an MPI communicator (buffers: nothing is pickled)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def allgather(self, value: Any) -> list[Any]:
        mine = encode_value(value)
        lengths = np.zeros(self.size, np.int64)
        self.comm.Allgather(np.array([mine.size], np.int64), lengths)
        rows = np.zeros((self.size, max(int(lengths.max()), 1)), np.uint8)
        padded = np.zeros(rows.shape[1], np.uint8)
        padded[:mine.size] = mine
        self.comm.Allgather(padded, rows)
        return decode_values(rows, lengths)

    def bcast(self, value: Any, root: int = 0) -> Any:
        return self.allgather(value if self.rank == root else None)[root]

    def all_true(self, ok: bool) -> bool:
        return all(self.allgather(bool(ok)))

    def host(self) -> str:
        from mpi4py import MPI

        return str(MPI.Get_processor_name())


class TorchBootstrap:
    """Setup collectives over ``torch.distributed`` (a gloo group: the default group when
    overlap initializes it, a new one beside a group the script made itself)."""

    def __init__(self, rank: int, size: int, timeout: float) -> None:
        try:
            import torch.distributed as dist
        except ImportError:
            raise RuntimeError("the job was started by torchrun (RANK and WORLD_SIZE are "
                               "set, no MPI launcher's variable), and overlap joins such a "
                               "job through torch.distributed: pip install -e '.[torch]'"
                               ) from None
        from datetime import timedelta

        self.dist = dist
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this torch build")
        if not dist.is_initialized():
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise RuntimeError(f"environment: RANK and WORLD_SIZE are set but not "
                                   f"{missing[0]}; start the job with torchrun (which sets "
                                   "them), or set MASTER_ADDR and MASTER_PORT")
            dist.init_process_group("gloo", rank=rank, world_size=size,
                                    timeout=timedelta(seconds=max(timeout, 30.0)))
        if (dist.get_rank(), dist.get_world_size()) != (rank, size):
            raise ValueError(f"world: rank {rank} of {size} does not match torch.distributed "
                             f"(rank {dist.get_rank()} of {dist.get_world_size()})")
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.rank, self.size = rank, size

    def allgather(self, value: Any) -> list[Any]:
        import torch

        mine = encode_value(value)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.dist.all_gather(lengths, torch.tensor([mine.size], dtype=torch.int64),
                            group=self.group)
        width = max(max(int(t) for t in lengths), 1)
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[:mine.size] = torch.from_numpy(mine.copy())
        rows = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.size)]
        self.dist.all_gather(rows, padded, group=self.group)
        return decode_values(np.stack([t.numpy() for t in rows]),
                       np.array([int(t) for t in lengths], np.int64))

    def bcast(self, value: Any, root: int = 0) -> Any:
        return self.allgather(value if self.rank == root else None)[root]

    def all_true(self, ok: bool) -> bool:
        return all(self.allgather(bool(ok)))

    def host(self) -> str:
        node = os.environ.get("GROUP_RANK")
        return f"torchrun node {node}" if node is not None else socket.gethostname()


def reachable_address() -> str:
    """An address of this host its peers can reach: the one this host would use to reach
    the rendezvous host — ``MASTER_ADDR`` (torchrun, ``init_method="env://"``), else the host
    of the default process group's TCP store (a group the caller made with
    ``init_method="tcp://host:port"``, as Ray's actors do: no variable names it) — else the
    host name's. (The host name's address is often a loopback alias such as Debian's
    127.0.1.1, which no other host reaches; the route to the store is one every rank of the
    group already uses.)"""
    for target in (os.environ.get("MASTER_ADDR"), _store_host()):
        if target:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect((target, 9))  # (no packet is sent: it only picks the route)
                    return str(s.getsockname()[0])
            except OSError:
                pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _store_host() -> str | None:
    """The host of the default process group's TCP store, when ``torch.distributed`` is
    imported and initialized with one (None otherwise: a file store, no group). torch
    exposes the store only through ``distributed_c10d._get_default_store``; a torch without
    it gives None and the host name's address is used."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    while hasattr(store, "underlying_store"):  # (PrefixStore wraps the real one)
        store = store.underlying_store
    host = getattr(store, "host", None)
    return host if isinstance(host, str) and host else None


__all__ = ["Bootstrap", "MpiBootstrap", "TorchBootstrap", "reachable_address"]
