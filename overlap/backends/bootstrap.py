"""What a multi-process backend needs once, at setup, from whatever launched the job: a few
collectives over small Python values (every rank calls them from its main thread, in the
same order) and the name of the host this rank runs on.

- :class:`MpiBootstrap` — ``mpiexec`` / ``srun``: over ``MPI.COMM_WORLD``.
- :class:`TorchBootstrap` — ``torchrun``: over a gloo group of ``torch.distributed``,
  whose rendezvous (``MASTER_ADDR``/``MASTER_PORT``, or torchrun's agent store) joins the
  processes. Its host is torchrun's node (``GROUP_RANK``, one agent per node): containers on
  different nodes may share a host name, and the ranks of one agent always share a host.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Protocol


class Bootstrap(Protocol):
    rank: int
    size: int

    def allgather(self, value: Any) -> list[Any]: ...

    def bcast(self, value: Any, root: int = 0) -> Any: ...

    def all_true(self, ok: bool) -> bool: ...

    def host(self) -> str: ...


class MpiBootstrap:
    """Setup collectives over an MPI communicator."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def allgather(self, value: Any) -> list[Any]:
        return list(self.comm.allgather(value))

    def bcast(self, value: Any, root: int = 0) -> Any:
        return self.comm.bcast(value, root=root)

    def all_true(self, ok: bool) -> bool:
        from mpi4py import MPI

        return bool(self.comm.allreduce(int(ok), op=MPI.MIN))

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
                               "job through torch.distributed: pip install 'overlap[torch]'"
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
        out: list[Any] = [None] * self.size
        self.dist.all_gather_object(out, value, group=self.group)
        return out

    def bcast(self, value: Any, root: int = 0) -> Any:
        box = [value]
        self.dist.broadcast_object_list(box, src=root, group=self.group)
        return box[0]

    def all_true(self, ok: bool) -> bool:
        return all(self.allgather(bool(ok)))

    def host(self) -> str:
        node = os.environ.get("GROUP_RANK")
        return f"torchrun node {node}" if node is not None else socket.gethostname()


def reachable_address() -> str:
    """An address of this host its peers can reach: the one this host would use to reach
    the rendezvous host (``MASTER_ADDR``), else the host name's."""
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))  # (no packet is sent: it only picks the route)
                return str(s.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


__all__ = ["Bootstrap", "MpiBootstrap", "TorchBootstrap", "reachable_address"]
