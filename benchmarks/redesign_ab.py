"""Two checkouts of the runtime, measured in turns in one run: the same calls through the
public API only, so any two commits compare (issue 31's "same speed, old against new").

    git worktree add /tmp/old 59bd775          # the commit before the redesign
    python benchmarks/redesign_ab.py --old /tmp/old [--rounds 3]

Rows (each a median over its samples; every round runs every row once per variant, so the
shared machine's load drifts over all of them alike):

- ``step w64`` / ``step w1024``: a training step of ``TorchPipeline`` (4 stages of
  ``Linear(w, w) -> ReLU -> Linear(w, w)``, float32, batch 256 in 8 microbatches, eager-1f1b,
  SGD inside the step) under ``mpiexec -n 4``, one stage per process — the rows of
  ``vs_torch_pipelining.py``. The caller sets ``torch.set_num_threads(1)``, as that script
  does.
- ``tiny call``: a 16-byte resharding between rank 0's device and rank 1's, timed on those
  two ranks while the other two made their calls ahead and sleep (4 ranks).
- ``each more transfer``: 16 transfers of 16 B from rank 0's four devices to rank 1's, less
  the tiny call, over the 15 more (4 ranks, the other two asleep).
- ``per op (1 process)``: a training step of the toy pipeline (examples/toy.py) whose stage
  work is trivial, end to end, divided by the ops it runs: the host's cost per launched op.

Variants: ``old`` and ``new`` run in an environment like a new user's — none of the
variables that size thread pools (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``,
``OPENBLAS_NUM_THREADS``) is set; ``old, OMP=1`` is the old checkout with
``OMP_NUM_THREADS=1`` set by hand (how its earlier figures were taken: it isolates the
redesign's own cost from the torch thread fix of the same issue). The table says, per row,
new / old and new / (old, OMP=1); the goal is no row worse by more than 5 %.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROWS = ("step w64", "step w1024", "tiny call", "each more transfer", "per op (1 process)")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


# ---- workers (run inside the checkout being measured) --------------------------------------


def _barrier(comm, cap: float = 1e-3) -> None:
    """A barrier that sleeps while it waits (MPICH's blocking calls spin, and spinning ranks
    would take the cores from the ones measured)."""
    req = comm.Ibarrier()
    nap = 50e-6
    while not req.Test():
        time.sleep(nap)
        nap = min(2 * nap, cap)


def _members_alone(rt, comm, plan, shards, calls: int, reps: int = 5) -> float:
    """Seconds per call of ``plan`` on its members (the slowest), the other ranks idle: they
    make their calls first (a rank outside a call goes on without waiting) and sleep. (As
    mpi_reshard.py's, written again here: this script runs against any checkout, so it may
    use only the public API, not the helpers of the tree it measures.)"""
    from mpi4py import MPI

    owners = {rt.backend.placement.owners[d]
              for d in (*plan.src.mesh.device_ids, *plan.dst.mesh.device_ids)}
    member = comm.Get_rank() in owners
    times = []
    for _ in range(reps + 1):  # (the first: a warm-up)
        if not member:
            for _ in range(calls):
                rt.reshard_sync(plan, shards)
        _barrier(comm)
        t = time.perf_counter()
        if member:
            for _ in range(calls):
                rt.reshard_sync(plan, shards)
        times.append((time.perf_counter() - t) / calls)
        _barrier(comm, cap=20e-3)
    return comm.allreduce(statistics.median(times[1:]), op=MPI.MAX)


def worker_calls(out: Path) -> None:
    import numpy as np
    from mpi4py import MPI

    from overlap import Runtime
    from scheduler import Cluster, DeviceMesh, PlanOptions, Sharding, ShardingSpec
    from scheduler import plan_resharding as plan_of

    comm = MPI.COMM_WORLD
    cluster = Cluster.preset("p3.8xlarge", num_hosts=4)  # rank r: host r's devices
    with Runtime(cluster) as rt:
        a = Sharding(DeviceMesh([[0]], ("host", "gpu")), ShardingSpec())
        b = Sharding(DeviceMesh([[4]], ("host", "gpu")), ShardingSpec())
        tiny = plan_of((2,), "float64", a, b, cluster)
        tiny_shards = {0: np.ones(2)} if rt.backend.is_local(0) else {}
        # Every rank makes a first call together: its channel's communicator is made then,
        # by every rank (a collective the members could not join from the barrier).
        rt.reshard_sync(tiny, tiny_shards)
        alone = _members_alone(rt, comm, tiny, tiny_shards, calls=500)
        many = plan_of((4, 8), "float64",
                       Sharding(DeviceMesh([[0, 1, 2, 3]], ("host", "gpu")),
                                ShardingSpec(None, "gpu")),
                       Sharding(DeviceMesh([[4, 5, 6, 7]], ("host", "gpu")),
                                ShardingSpec("gpu")),
                       cluster, PlanOptions(strategy="send_recv", balance="none"))
        assert len(many.transfers) == 16
        shards = {d: np.full((4, 2), float(d)) for d in range(4) if rt.backend.is_local(d)}
        took = _members_alone(rt, comm, many, shards, calls=200)
    if comm.Get_rank() == 0:
        out.write_text(json.dumps({"tiny call": alone,
                                   "each more transfer": (took - alone) / 15}))


def worker_step(out: Path, width: int, steps: int, warmup: int) -> None:
    import torch
    from mpi4py import MPI
    from torch import nn

    import overlap
    from overlap.torch import TorchPipeline
    from scheduler import Cluster

    torch.set_num_threads(1)  # (as vs_torch_pipelining.py's caller does)
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
              for _ in range(4)]
    cluster = Cluster.preset("p3.8xlarge", num_hosts=4)
    meshes = [cluster.mesh([h], gpus=1) for h in range(4)]
    pipe = TorchPipeline(stages, meshes, nn.functional.mse_loss)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(256, width, generator=g), torch.randn(256, width, generator=g))
               for _ in range(warmup + steps)]
    times = []
    with overlap.Runtime(cluster) as rt:
        for x, y in batches:
            opt.zero_grad()
            t0 = time.perf_counter()
            pipe.train_step_sync(rt, x, y, num_microbatches=8, schedule="eager-1f1b")
            opt.step()
            times.append(time.perf_counter() - t0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        out.write_text(json.dumps({f"step w{width}": statistics.median(times[warmup:])}))


def worker_ops(out: Path) -> None:
    import numpy as np

    sys.path.insert(0, str(Path.cwd() / "examples"))
    from toy import ToyMLP

    from overlap import Runtime
    from scheduler import Cluster

    cluster = Cluster.preset("p3.8xlarge", 4)
    model = ToyMLP.build(cluster, hidden=4, batch=2)
    mbs = [np.zeros((2, 4)) for _ in range(16)]
    with Runtime(cluster) as rt:
        step = lambda: rt.train_step_sync(model.stages(), model.boundaries(), mbs,
                                          input_sharding=model.input_sharding())
        step()  # warm: plans, threads
        ops = len(rt.timeline().spans)
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    out.write_text(json.dumps({"per op (1 process)": statistics.median(times) / ops}))


# ---- the driver -----------------------------------------------------------------------------


def _env(tree: Path, omp: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in THREAD_VARS and not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_",
                                                         "HYDRA_"))}
    if omp:
        env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(tree)
    return env


def _run(tree: Path, omp: bool, worker: list[str], mpi: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, str(HERE), "--worker", *worker, str(out)]
        if mpi:
            mpiexec = Path(sys.executable).with_name("mpiexec")
            cmd = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", "4", *cmd]
        done = subprocess.run(cmd, cwd=tree, env=_env(tree, omp), capture_output=True,
                              text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(worker)} in {tree} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, help="a checkout of the runtime before")
    ap.add_argument("--new", type=Path, default=HERE.parents[1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        kind, *rest = args.worker
        out = Path(rest[-1])
        if kind == "calls":
            worker_calls(out)
        elif kind == "step":
            worker_step(out, int(rest[0]), int(rest[1]), int(rest[2]))
        else:
            worker_ops(out)
        return 0
    if args.old is None:
        ap.error("--old: a checkout to compare with is needed")
    variants = {"old": (args.old.resolve(), False), "new": (args.new.resolve(), False),
                "old, OMP=1": (args.old.resolve(), True)}
    jobs = [(["step", "64", str(args.steps), str(args.warmup)], True),
            (["step", "1024", str(args.steps), str(args.warmup)], True),
            (["calls"], True), (["ops"], False)]
    samples: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for worker, mpi in jobs:
            for name, (tree, omp) in variants.items():
                for row, v in _run(tree, omp, worker, mpi).items():
                    samples.setdefault((row, name), []).append(v)
        print(f"[round {r + 1} of {args.rounds} done]", file=sys.stderr, flush=True)
    import platform

    from scheduler.cli.common import machine_line

    print(f"== runtime before and after, in turns: {args.rounds} rounds ==")
    print(f"{machine_line()}; {platform.platform()}")
    print(f"old: {args.old}, new: {args.new}; thread variables unset except in 'old, OMP=1'")
    print(f"{'row':<22} {'old':>11} {'new':>11} {'old, OMP=1':>11} {'new/old':>8} "
          f"{'new/(old,OMP=1)':>16}")
    for row in ROWS:
        med = {name: statistics.median(samples[(row, name)]) for name in variants}
        unit, scale = ("ms", 1e3) if row.startswith("step") else ("us", 1e6)
        print(f"{row:<22} " + " ".join(f"{med[n] * scale:>8.1f} {unit}" for n in variants)
              + f" {med['new'] / med['old']:>8.3f} {med['new'] / med['old, OMP=1']:>16.3f}")
    print("goal: no row of new worse than the old by more than 5 % (new/(old,OMP=1) <= 1.05)")
    print("every sample, in round order (the spread the medians come from):")
    for row in ROWS:
        scale = 1e3 if row.startswith("step") else 1e6
        print(f"  {row:<20} " + "; ".join(
            f"{n}: " + " ".join(f"{v * scale:.1f}" for v in samples[(row, n)])
            for n in variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
