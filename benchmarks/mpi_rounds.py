"""MPI benchmark (not a test): a call's rounds among two to four ranks, all-to-all over host
links.

    mpiexec -n 4 python benchmarks/mpi_rounds.py      # (started that way if run plainly)

A multi-process call gathers its members' rows over host links, in two rounds (the
agreement at admission: each member's digest and call number; the end of the call): every
member sends its row to every other member (one hop, m (m - 1) messages a round;
``overlap/backends/job/distributed.py``). This script times calls of several shapes.

Each sample: every rank makes the calls between two barriers that sleep (a rank outside a
call goes through its calls at once and sleeps); wall per call, the slowest rank's; medians
of ``REPS`` rounds. Tensors are float64, 16 bytes a transfer, host h on rank h mod 4.

Dropped with the runtime's redesign: the "hub" variant and the all-to-all / hub ratio. A
round used to gather through one member (two hops, 2 (m - 1) messages) above
``distributed.DIRECT_MEMBERS`` members, which the benchmark lowered to 2 to time the hub;
the rounds are now all-to-all whenever host links join every member (else one
``MPI_Iallgather``, or point to point over MPI), with no hub and no such knob.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
from mpi_reshard import as_mpi_job, barrier, rank0_print, ring_plan, runtime, send_recv_plan

from overlap.world import Placement, detect_world
from scheduler import Cluster
from scheduler.cli.common import line_buffered_stdout, machine_line

REPS = 7
CALLS = 300


def shapes(cluster: Cluster) -> dict[str, object]:
    """The calls measured: name -> plan (4 devices a host, host h on rank h mod 4)."""
    grid = np.arange(16).reshape(4, 4)
    return {
        "ring, 4 ranks (a send and a receive each)": ring_plan(cluster, 4),
        "ring, 3 ranks": ring_plan(cluster, 3),
        "4x4 transpose over 4 ranks (12 cross-rank)":
            send_recv_plan(cluster, (16, 16), grid, ("host", "gpu"), grid, ("gpu", "host")),
        "4 members, one local copy, no data between ranks":
            send_recv_plan(cluster, (2,), [[0], [4], [8], [12]], (), [[5]], ()),
        "2 members, one transfer":
            send_recv_plan(cluster, (2,), [[0]], (), [[4]], ()),
    }


def time_calls(rt, plan, shards, comm) -> float:
    """Seconds per call (this rank), ``CALLS`` calls between sleeping barriers."""
    barrier(comm)
    t = time.perf_counter()
    for _ in range(CALLS):
        rt.reshard_sync(plan, shards)
    took = (time.perf_counter() - t) / CALLS
    barrier(comm, cap=20e-3)
    return took


def main() -> int:
    line_buffered_stdout()
    world = detect_world()  # (started plainly: as the 4-process job)
    return run(world) if world.distributed else as_mpi_job(__file__)


def run(world) -> int:
    """This rank's part of the job; rank 0 prints the table."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    say, size = rank0_print(comm), comm.Get_size()
    if size != 4:
        say("mpi_rounds: run it on 4 ranks")
        return 2
    cluster = Cluster.preset("p3.8xlarge", 5)
    placement = Placement.explicit([(d // 4) % size for d in range(cluster.num_devices)],
                                   cluster.num_devices, size)
    say(f"mpi_rounds: {size} ranks; {machine_line()}; {time.strftime('%Y-%m-%d %H:%M')}")
    say(f"calls of 16 B transfers over host links; {CALLS} calls a sample, medians of {REPS} "
        "rounds")
    times: dict[str, list[float]] = {}
    with runtime(cluster, world, placement, links=True) as rt:
        for name, plan in shapes(cluster).items():
            full = np.arange(float(np.prod(plan.shape))).reshape(plan.shape)
            shards = {d: full[tuple(slice(a, b) for a, b in r)].copy()
                      for d, r in plan.src.device_regions(plan.shape).items()
                      if rt.backend.is_local(d)}
            time_calls(rt, plan, shards, comm)  # (warm-up: first use)
            for _ in range(REPS):
                took = comm.allreduce(time_calls(rt, plan, shards, comm), op=MPI.MAX)
                times.setdefault(name, []).append(took)
    say(f"\n{'call':<52} {'all-to-all':>11}")
    for name in shapes(cluster):
        say(f"{name:<52} {statistics.median(times[name]) * 1e6:9.1f}us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
