"""Backends: the process's devices and the multi-process job, composed.

Two packages, one built on the other:

- **The process's devices** (:mod:`.devices`) — a device kind (:class:`DeviceKind`: ``cpu``,
  virtual devices in this process, :mod:`.devices.cpu`; ``cuda``, CuPy streams, events and
  memory, :mod:`.devices.cuda`, imported only when asked for) says how a stream's ops run,
  what a record and a wait enqueue, how bytes are copied and how trace marks are read;
  :mod:`.devices.streams` holds the streams and events themselves, the same for both; the
  in-process rendezvous (:mod:`.devices.local`, with the kind's copies; NCCL between distinct
  GPUs on CUDA, :mod:`.devices.nccl_groups`) moves collectives among this process's devices.
  :class:`Backend` composes a kind with its transports. It never imports the job package.
- **The multi-process job** (:mod:`.job`) — what joins the devices to the other processes:
  a :class:`Transport` across processes (point-to-point wires progressed by the process's
  one engine — :mod:`.job.engine`; :mod:`.job.wire` over host links, :mod:`.job.host_links`,
  and MPI, :mod:`.job.mpi` — for the CPU kind, NCCL for CUDA, :mod:`.job.nccl`), the control
  plane (a call's rounds, failure notices: :mod:`.job.distributed`) and the guards of the
  process's exit (:mod:`.job.exit_guard`).

:func:`make_backend` composes them: every part is given to the :class:`Backend` when it is
made. The runtime reaches either package through the names exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from scheduler import check_seconds

from ..world import Placement, World
from .devices.backend import SETTLE_GRACE_S, Backend, DeviceKind, Transport, check_device_count
from .devices.bound import Bound
from .devices.cpu import CpuDevices
from .devices.routes import Route
from .devices.streams import Busy, Event, OpReport, Stream, Trace, TraceRecord, current_stream
from .job.distributed import CallRounds, Distributed, shape_table
from .job.engine import Backoff

if TYPE_CHECKING:
    from .job.engine import Engine
    from .job.host_links import HostLinks

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
    check_device_count(num_devices)
    bound = Bound(check_seconds("timeout", timeout))  # (one, shared by every part that waits)
    if name == "cuda":
        from .devices.cuda import CudaDevices

        devices: DeviceKind = CudaDevices(timeout=bound)
    else:
        devices = CpuDevices()
    if world is None or not world.distributed:
        return Backend(devices, num_devices, timeout=bound, link_time=link_time)
    return _joined(devices, num_devices, world, placement or Placement.blocks(
        num_devices, world.size), bound, host_links, grace, poll)


def _joined(devices: DeviceKind, num_devices: int, world: World, placement: Placement,
            timeout: Bound, host_links: bool | None, grace: float,
            poll: Backoff | None) -> Backend:
    from ..bootstrap import Bootstrap, MpiBootstrap, TorchBootstrap
    from ..world import TORCH_SOURCES, mpi_world_comm
    from .job.distributed import HOST_LINKS_ENV, host_links_wanted
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
        return Backend(devices, num_devices, timeout=timeout, placement=placement,
                       rank=world.rank, dist=dist,
                       transport=_data_plane(cuda, dist, world, comm, engine, links))
    except BaseException:
        engine.close()
        raise


def _data_plane(cuda: bool, dist: Distributed, world: World, comm: Any, engine: Engine,
                links: HostLinks | None) -> Callable[[Backend], Transport]:
    """What makes the backend's transport across processes (it needs the backend): NCCL
    for the CUDA kind; for the CPU kind wires — MPI's (none under torchrun) and the host
    links."""
    if cuda:
        from .job.nccl import NcclTransport

        return lambda backend: NcclTransport(backend, dist, world)
    from .job.mpi import MpiWire
    from .job.wire import WireTransport

    mpi = None if comm is None else MpiWire(comm, engine)
    return lambda backend: WireTransport(backend, dist, mpi, links)


__all__ = ["BACKENDS", "SETTLE_GRACE_S", "Backend", "Backoff", "Busy", "CallRounds", "CpuDevices",
           "DeviceKind", "Distributed", "Event", "OpReport", "Route", "Stream", "Trace",
           "TraceRecord", "Transport", "current_stream", "make_backend", "shape_table"]
