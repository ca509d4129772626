"""Who runs which devices: the process world (rank, size) and the device → rank placement.

The same script runs as one process (today's default: every device is local) or as N
processes under an MPI launcher — ``mpiexec -n N``, ``mpirun``, Slurm's ``srun --mpi=pmix``
(or ``pmi2``) — or under ``torchrun --nproc-per-node N`` (multi-node too).
:func:`detect_world` reads where it was started:

1. **MPI**: a launcher variable is set (``PMI_RANK``/``PMI_SIZE`` — MPICH's hydra, Intel MPI,
   ``srun --mpi=pmi2``; ``PMIX_RANK`` — PMIx launchers, Open MPI 5, ``srun --mpi=pmix``;
   ``OMPI_COMM_WORLD_RANK`` — Open MPI; ``MV2_COMM_WORLD_RANK`` — MVAPICH). Rank and size
   come from ``MPI.COMM_WORLD`` (mpi4py); the local rank from a shared-memory split of it.
2. **torchrun** (its variables, when no MPI launcher variable is set): ``RANK``,
   ``WORLD_SIZE``, ``LOCAL_RANK`` (``LOCAL_WORLD_SIZE``). The processes join through
   ``torch.distributed``'s rendezvous (``MASTER_ADDR``/``MASTER_PORT``) and talk over links
   (:mod:`overlap.backends.job.host_links`): no MPI is needed.
3. **A process group the caller made** (no launcher variable, ``torch`` already imported and
   ``torch.distributed.is_initialized()``): processes started another way — Ray actors, a
   job scheduler's workers, ``multiprocessing`` — that called
   ``dist.init_process_group(backend, init_method="tcp://host:port", rank=r, world_size=n)``
   themselves. Rank and size are the default group's; the local rank and size come from the
   host names, gathered over that group (so detecting such a world is a collective: every
   process of the group calls it). The ranks link over TCP as under torchrun, listening on
   the address that routes to the group's store (see
   :func:`overlap.bootstrap.reachable_address`). ``torch`` is never imported to
   detect a world: a script that made no group gets none of this.
4. Otherwise a world of one process.

``OVERLAP_WORLD=single`` forces a one-process world (e.g. a helper script started by an MPI
job that must not join it).

Placement: by default each rank owns an equal contiguous block of the cluster's devices —
one device per process when the job has as many processes as devices, or a host's GPUs per
process when it has one process per host (device ids are host-major). ``Placement.explicit``
takes any map.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MPI_LAUNCHER_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
SOURCES = ("single", "mpi", "torchrun", "process_group")
# The sources whose processes join through torch.distributed and link over TCP (no MPI).
TORCH_SOURCES = ("torchrun", "process_group")


@dataclass(frozen=True)
class World:
    """This process's place in the job. ``source``: "single", "mpi", "torchrun" (the
    torchrun-style variables) or "process_group" (a ``torch.distributed`` default group the
    caller initialized)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    source: str = "single"

    def __post_init__(self) -> None:
        for name in ("rank", "size", "local_rank", "local_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}: expected an int, got {v!r}")
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank/size: need 0 <= rank < size, got rank {self.rank} of "
                             f"{self.size}")
        if self.local_size < 1 or not 0 <= self.local_rank < self.local_size:
            raise ValueError(f"local_rank/local_size: need 0 <= local_rank < local_size, got "
                             f"{self.local_rank} of {self.local_size}")
        if self.source not in SOURCES:
            raise ValueError(f"source: expected one of {SOURCES}, got {self.source!r}")

    @property
    def distributed(self) -> bool:
        """Whether the job has more than one process."""
        return self.size > 1


def _env_int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an integer, got {raw!r}") \
            from None


def detect_world(env: Mapping[str, str] | None = None) -> World:
    """The world this process was started in (see module doc). Imports mpi4py (and so
    initializes MPI) only when an MPI launcher started the process."""
    env = os.environ if env is None else env
    forced = env.get("OVERLAP_WORLD", "")
    if forced not in ("", "single", "auto"):
        raise ValueError(f"environment variable OVERLAP_WORLD: expected 'single' or 'auto', "
                         f"got {forced!r}")
    if forced == "single":
        return World()
    launcher = [v for v in MPI_LAUNCHER_VARS if v in env]
    if launcher == ["PMIX_RANK"] and not ("PMIX_NAMESPACE" in env and any(
            k.startswith("PMIX_SERVER_URI") for k in env)):
        # A PMIx client finds its server only through these: without them MPI_Init aborts
        # the process with MPICH's own message, which names nothing the user set.
        raise RuntimeError("environment variable PMIX_RANK is set, but no PMIx launcher "
                           "started this process (no PMIX_NAMESPACE and PMIX_SERVER_URI*): "
                           "unset it, or launch with mpiexec / srun --mpi=pmix")
    if launcher:
        comm = mpi_world_comm(f"the process was started by an MPI launcher ({launcher[0]} "
                              "is set)")
        local = comm.Split_type(_mpi().COMM_TYPE_SHARED)
        try:
            return World(comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size(),
                         "mpi")
        finally:
            local.Free()
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        raise RuntimeError(
            "srun started this process without an MPI plugin (SLURM_PROCID is set, no PMI "
            "variable): launch with `srun --mpi=pmix ...` (or --mpi=pmi2)")
    if "WORLD_SIZE" in env or "RANK" in env:
        missing = [v for v in ("RANK", "WORLD_SIZE") if v not in env]
        if missing:
            raise ValueError(f"environment: {missing[0]} is not set but "
                             f"{'RANK' if missing[0] == 'WORLD_SIZE' else 'WORLD_SIZE'} is; "
                             "set both (torchrun-style) or neither")
        size = _env_int(env, "WORLD_SIZE")
        rank = _env_int(env, "RANK")
        local_rank = _env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        local_size = (_env_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env
                      else max(local_rank + 1, 1))
        return World(rank, size, local_rank, local_size, "torchrun")
    group = process_group_world()
    return World() if group is None else group


def process_group_world() -> World | None:
    """The world of a ``torch.distributed`` default process group this process already
    initialized (None when ``torch.distributed`` was never imported, or has no group): its
    rank and size, and the local rank and size among the ranks whose host name is this
    one's, gathered over the group (a collective: every rank of the group calls it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    from .bootstrap import TorchBootstrap

    rank, size = dist.get_rank(), dist.get_world_size()
    if size == 1:
        return World(source="process_group")
    boot = TorchBootstrap(rank, size, timeout=0.0)  # (the group's own timeout bounds it)
    hosts = boot.allgather(boot.host())
    mates = [r for r in range(size) if hosts[r] == hosts[rank]]
    return World(rank, size, mates.index(rank), len(mates), "process_group")


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def mpi_world_comm(why: str) -> Any:
    """``MPI.COMM_WORLD`` (initialized with MPI_THREAD_MULTIPLE: stream threads call MPI)."""
    try:
        import mpi4py
    except ImportError:
        raise RuntimeError(f"{why}, but mpi4py is not installed: pip install -e '.[mpi]' "
                           "from the repository (mpi4py and the mpich wheel)") from None
    mpi4py.rc.thread_level = "multiple"
    MPI = _mpi()
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("MPI was initialized without MPI_THREAD_MULTIPLE (before overlap "
                           "imported mpi4py?); overlap's streams call MPI from several threads")
    return MPI.COMM_WORLD


@dataclass(frozen=True)
class Placement:
    """Device → owning rank, for every device of the cluster."""

    owners: tuple[int, ...]

    @classmethod
    def blocks(cls, num_devices: int, size: int) -> Placement:
        """Equal contiguous blocks: rank r owns devices [r·k, (r+1)·k), k = devices / size."""
        if size > num_devices:
            raise ValueError(f"world: {size} processes for a cluster of {num_devices} devices; "
                             "at most one process per device")
        if num_devices % size:
            raise ValueError(
                f"world: {num_devices} devices do not split evenly over {size} processes; "
                "launch a divisor of the device count (e.g. one process per device or per "
                "host) or pass placement=Placement.explicit(...)")
        k = num_devices // size
        return cls(tuple(d // k for d in range(num_devices)))

    @classmethod
    def explicit(cls, owners: Mapping[int, int] | Sequence[int], num_devices: int,
                 size: int) -> Placement:
        """From ``owners[device] = rank`` (a mapping or a sequence) for every device."""
        table = dict(owners) if isinstance(owners, Mapping) else dict(enumerate(owners))
        missing = sorted(set(range(num_devices)) - set(table))
        if missing:
            raise ValueError(f"placement: devices {missing[:8]} have no rank")
        extra = sorted(set(table) - set(range(num_devices)))
        if extra:
            raise ValueError(f"placement: devices {extra[:8]} are not in the cluster "
                             f"(0..{num_devices - 1})")
        bad = {d: r for d, r in table.items()
               if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < size}
        if bad:
            d, r = min(bad.items())
            raise ValueError(f"placement: device {d} -> {r!r} is not a rank in 0..{size - 1}")
        idle = sorted(set(range(size)) - set(table.values()))
        if idle:
            raise ValueError(f"placement: ranks {idle[:8]} own no device")
        return cls(tuple(table[d] for d in range(num_devices)))

    def check_covers(self, num_devices: int) -> None:
        """Raise unless this placement maps exactly the cluster's ``num_devices`` devices."""
        if len(self.owners) != num_devices:
            raise ValueError(f"placement: covers {len(self.owners)} devices, the cluster has "
                             f"{num_devices}")

    def devices_of(self, rank: int) -> tuple[int, ...]:
        """The devices ``rank`` drives."""
        return tuple(d for d, r in enumerate(self.owners) if r == rank)

    def ranks_of(self, devices: Sequence[int]) -> tuple[int, ...]:
        """The distinct owners of ``devices``, in the order they first appear."""
        return tuple(dict.fromkeys(self.owners[d] for d in devices))


def max_over_ranks(value: float, world: World) -> float:
    """The largest ``value`` of every process of the job (collective: every process calls
    it, from its main thread, once its runtime is made), over the launcher's own channel —
    MPI's world, or ``torch.distributed`` under torchrun or in a caller's process group. For
    a job's verdict: every process passes or fails together."""
    if not world.distributed:
        return value
    if world.source == "mpi":
        MPI = _mpi()
        return float(MPI.COMM_WORLD.allreduce(value, op=MPI.MAX))
    import torch.distributed as dist

    every: list[Any] = [None] * world.size
    dist.all_gather_object(every, float(value))
    return max(every)


def sum_over_ranks(value: float, world: World) -> float:
    """The sum of ``value`` over every process of the job (collective, as
    :func:`max_over_ranks`; in rank order, so every process gets the same float)."""
    if not world.distributed:
        return value
    if world.source == "mpi":
        MPI = _mpi()
        every = MPI.COMM_WORLD.allgather(float(value))
    else:
        import torch.distributed as dist

        every = [None] * world.size
        dist.all_gather_object(every, float(value))
    return float(sum(every))


def describe(world: World, devices: Sequence[int]) -> str:
    """One line naming this process: rank, pid, host, devices (for logs and errors)."""
    span = _ranges(devices)
    return (f"rank {world.rank}/{world.size} (pid {os.getpid()} on {socket.gethostname()}): "
            f"devices {span}")


def _ranges(devices: Sequence[int]) -> str:
    ds = sorted(devices)
    out: list[str] = []
    i = 0
    while i < len(ds):
        j = i
        while j + 1 < len(ds) and ds[j + 1] == ds[j] + 1:
            j += 1
        out.append(str(ds[i]) if i == j else f"{ds[i]}-{ds[j]}")
        i = j + 1
    return ",".join(out) or "none"
