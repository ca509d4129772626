"""Backends: a device kind and transports, composed.

- **Device kinds** — ``cpu`` (virtual devices in this process: :mod:`.cpu`) and ``cuda`` (CuPy
  streams, events and memory: :mod:`.cuda`, imported only when asked for). A kind says how a
  stream's ops run, what a record and a wait enqueue, how bytes are copied and how trace
  marks are read; :mod:`.streams` holds the streams and events themselves, the same for both.
- **Transports** — how a collective's bytes move. Among this process's devices: the
  in-process rendezvous (:mod:`.local`, with the kind's copies; NCCL between distinct GPUs on
  CUDA, :mod:`.nccl`). Across processes: point-to-point wires progressed by the process's one
  engine (:mod:`.engine`; :mod:`.wire` over host links, :mod:`.host_links`, and MPI,
  :mod:`.mpi`) for the CPU kind, NCCL for CUDA. The control plane of a multi-process job
  (a call's rounds, failure notices, exit) is :mod:`.distributed`.

:class:`~.backend.Backend` is what the runtime launches on; :func:`make_backend` composes
it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from scheduler import check_seconds

from ..world import Placement, World
from .devices.backend import SETTLE_GRACE_S, Backend, Remote
from .devices.bound import Bound
from .devices.cpu import CpuDevices
from .devices.routes import Route
from .devices.streams import Busy, Event, OpReport, Stream, Trace, TraceRecord
from .job.engine import Backoff

BACKENDS = ("cpu", "cuda")


def make_backend(name: str, num_devices: int, *, timeout: float = 30.0,
                 link_time: Callable[[int, Sequence[int], int], float] | None = None,
                 world: World | None = None, placement: Placement | None = None,
                 host_links: bool | None = None, grace: float = 5.0,
                 poll: Backoff | None = None) -> Backend:
    """A backend of device kind ``name`` ("cpu" or "cuda"). With a multi-process ``world``
    it also has what joins it to the other processes (this process drives the devices
    ``placement`` gives its rank): the process's progress engine, host links between the
    ranks of a host (unless ``host_links`` is False or ``OVERLAP_HOST_LINKS=0``), the
    control plane, and the data plane — wires for the CPU kind, NCCL for CUDA (``poll``: how
    the engine polls pending MPI requests; default ``Backoff()``). Collective across
    processes: every rank calls it, from the main thread, in the same order."""
    if name not in BACKENDS:
        raise ValueError(f"backend: unknown {name!r}; available: {BACKENDS}")
    bound = Bound(check_seconds("timeout", timeout))  # (one, shared by every part that waits)
    if name == "cuda":
        from .devices.cuda import CudaDevices

        devices: Any = CudaDevices(timeout=bound)
    else:
        devices = CpuDevices()
    if world is None or not world.distributed:
        return Backend(devices, num_devices, timeout=bound, link_time=link_time)
    return _joined(devices, num_devices, world, placement or Placement.blocks(
        num_devices, world.size), bound, host_links, grace, poll)


def _joined(devices: Any, num_devices: int, world: World, placement: Placement,
            timeout: Bound, host_links: bool | None, grace: float,
            poll: Backoff | None) -> Backend:
    from ..world import TORCH_SOURCES, mpi_world_comm
    from .job.bootstrap import Bootstrap, MpiBootstrap, TorchBootstrap
    from .job.distributed import HOST_LINKS_ENV, Distributed, host_links_wanted
    from .job.engine import Engine
    from .job.host_links import HostLinks

    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
        raise ValueError(f"grace: expected seconds >= 0, got {grace!r}")
    placement.check_covers(num_devices)
    links_on = host_links_wanted(host_links)
    cuda = devices.name == "cuda"
    if cuda and len(placement.devices_of(world.rank)) != 1:
        raise ValueError(
            f"placement: backend 'cuda' across processes runs one device per process (one "
            f"process per GPU); rank {world.rank} owns {len(placement.devices_of(world.rank))} "
            "devices — launch as many processes as the cluster has devices")
    torchrun = world.source in TORCH_SOURCES  # (torchrun, or the caller's process group)
    if torchrun:
        if not links_on:
            how = ("started by torchrun" if world.source == "torchrun" else
                   "in a torch.distributed process group the caller made")
            raise ValueError(f"host_links: a job {how} moves every byte over links (it has "
                             f"no MPI); {HOST_LINKS_ENV}=0 / host_links=False need an MPI "
                             "launcher")
        comm: Any = None
        boot: Bootstrap = TorchBootstrap(world.rank, world.size, timeout.seconds)
    else:
        comm = mpi_world_comm("a multi-process world")
        if comm.Get_size() != world.size or comm.Get_rank() != world.rank:
            raise ValueError(f"world: rank {world.rank} of {world.size} does not match "
                             f"MPI.COMM_WORLD (rank {comm.Get_rank()} of {comm.Get_size()})")
        boot = MpiBootstrap(comm)
    backend = Backend(devices, num_devices, timeout=timeout, placement=placement,
                      rank=world.rank)
    engine = Engine(f"overlap-engine-r{world.rank}", poll)
    try:
        failures: list[str] = []
        links = HostLinks.connect(boot, engine, network=torchrun,
                                  failures=failures) if links_on else None
        if torchrun and links is None:
            raise RuntimeError(f"rank {world.rank}: could not link every pair of ranks of "
                               f"this {world.source} job (TCP between nodes, Unix sockets within "
                               f"one): {'; '.join(failures) or 'no reason given'}")
        dist = Distributed(world, placement, engine, comm, links, timeout=timeout,
                           grace=grace)
        backend.dist = dist
        if cuda:
            from .job.nccl import NcclTransport

            backend.remote = NcclTransport(backend, dist, world)
        else:
            from .job.mpi import MpiWire
            from .job.wire import WireTransport

            backend.remote = WireTransport(backend, dist, None if comm is None else
                                           MpiWire(comm, engine), links)
    except BaseException:
        engine.close()
        raise
    return backend


__all__ = ["BACKENDS", "SETTLE_GRACE_S", "Backend", "Backoff", "Busy", "CpuDevices", "Event",
           "OpReport", "Remote",
           "Route", "Stream", "Trace", "TraceRecord", "make_backend"]
