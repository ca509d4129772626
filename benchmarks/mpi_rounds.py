"""MPI benchmark (not a test): a call's rounds among three or four ranks, all-to-all or
through a hub, in one run.

    mpiexec -n 4 python benchmarks/mpi_rounds.py      # (started that way if run plainly)

A multi-process call gathers its members' rows (the agreement: each member's digest, and
whether its work had ended) over host links. Up to ``DIRECT_MEMBERS`` members send their
row to every other member (one hop, m (m - 1) messages); more gather through one member, the
hub (two hops, 2 (m - 1) messages). This script times calls of several shapes both ways, in
turns (one of each per round, so the shared machine's load drifts over both alike): the
hub is had by setting ``DIRECT_MEMBERS`` to 2 for the calls of that variant, on every rank.

Each sample: every rank makes the calls between two barriers that sleep (a rank outside a
call goes through its calls at once and sleeps); wall per call, the slowest rank's; medians
of ``REPS`` rounds. Tensors are float64, 16 bytes a transfer, host h on rank h mod 4.
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

from overlap.backends import distributed
from overlap.world import Placement, detect_world
from scheduler import Cluster
from scheduler.cli_common import machine_line

REPS = 7
CALLS = 300
VARIANTS = {"hub": 2, "all-to-all": distributed.DIRECT_MEMBERS}


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
        "2 members, one transfer (the same path both ways)":
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
        "rounds, one of each variant per round")
    times: dict[tuple[str, str], list[float]] = {}
    with runtime(cluster, world, placement, links=True) as rt:
        for name, plan in shapes(cluster).items():
            full = np.arange(float(np.prod(plan.shape))).reshape(plan.shape)
            shards = {d: full[tuple(slice(a, b) for a, b in r)].copy()
                      for d, r in plan.src.device_regions(plan.shape).items()
                      if rt.backend.is_local(d)}
            for direct in VARIANTS.values():  # (warm-up: first use of each)
                distributed.DIRECT_MEMBERS = direct
                time_calls(rt, plan, shards, comm)
            for _ in range(REPS):
                for variant, direct in VARIANTS.items():
                    distributed.DIRECT_MEMBERS = direct
                    took = comm.allreduce(time_calls(rt, plan, shards, comm), op=MPI.MAX)
                    times.setdefault((name, variant), []).append(took)
    distributed.DIRECT_MEMBERS = VARIANTS["all-to-all"]
    say(f"\n{'call':<52} {'hub':>9} {'all-to-all':>11} {'ratio':>6}")
    for name in shapes(cluster):
        hub = statistics.median(times[(name, "hub")])
        direct = statistics.median(times[(name, "all-to-all")])
        say(f"{name:<52} {hub * 1e6:7.1f}us {direct * 1e6:9.1f}us {direct / hub:6.2f}")
    say("ratio: all-to-all / hub (below 1: all-to-all faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
