"""overlap vs torch.distributed.pipelining on one CPU machine (a benchmark, not a test).

The same model, batch and microbatches on both sides: 4 stages of ``Linear(W, W) -> ReLU ->
Linear(W, W)`` (float32, W = 1024), batch 256 in 8 microbatches, MSE loss, ``torch.optim.SGD``
step included in every measured step.

- torch: ``PipelineStage`` per stage on 4 gloo processes (``torch.multiprocessing.spawn``,
  127.0.0.1), ``Schedule1F1B`` and ``ScheduleGPipe`` (gradients the mean over microbatches,
  both sides' default). A step is timed on rank 0 between two barriers.
- overlap: ``TorchPipeline`` on ``Runtime(cluster)`` with the CPU backend — 4 virtual devices,
  one per stage, each a thread of this one process — schedules 1f1b and eager-1f1b.
- overlap under ``mpiexec -n 4`` (when mpi4py and mpiexec are installed: the ``mpi`` extra):
  the same script's model, one stage per process; rank 0's step times. Activations and
  gradients go over host links (Unix sockets between the ranks of a host, the default) and,
  in the row "MPI data", over MPI (``OVERLAP_HOST_LINKS=0``); MPI carries the control.
- overlap under ``torchrun --standalone --nproc-per-node 4``: the same, joined by
  torch.distributed's rendezvous, every byte (control included) over links, no MPI.

Both sides get the same core budget (the whole machine) and the same torch intra-op threads
per stage (``--threads``, default 1: 4 stage workers on 2 cores are already oversubscribed).
Each row is the median ms/step over ``--steps`` steps after ``--warmup`` steps, in each of
``--rounds`` rounds (rows interleaved per round against drift on a shared machine); the ratio
is ours / theirs per matching schedule (target <= 1.0). Step 0's losses are compared between
the two sides (they must agree: same seeds, same model).

    python benchmarks/vs_torch_pipelining.py [--threads 1] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from scheduler import Cluster
from scheduler.cli.common import line_buffered_stdout, machine_line

STAGES = 4
CORES = os.cpu_count() or 1


def make_stages(width: int) -> list[nn.Module]:
    torch.manual_seed(0)  # both sides build the same 4 stages
    return [nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
            for _ in range(STAGES)]


def make_batches(n: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
            for _ in range(n)]


# ---- torch.distributed.pipelining ----------------------------------------------------------


def _torch_worker(rank: int, cfg: dict, out_path: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    try:
        module = make_stages(cfg["width"])[rank]
        stage = PipelineStage(module, rank, STAGES, torch.device("cpu"))
        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[cfg["schedule"]]
        sched = cls(stage, n_microbatches=cfg["microbatches"], loss_fn=nn.functional.mse_loss)
        opt = torch.optim.SGD(module.parameters(), lr=cfg["lr"])
        batches = make_batches(cfg["warmup"] + cfg["steps"], cfg["batch"], cfg["width"])
        times, cpu, first_losses = [], [], []
        for k, (x, y) in enumerate(batches):
            losses: list[torch.Tensor] = []
            opt.zero_grad()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if rank == 0:
                sched.step(x)
            elif rank == STAGES - 1:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
            opt.step()
            dist.barrier()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            if k == 0 and rank == STAGES - 1:
                first_losses = [float(v.detach()) for v in losses]
        Path(f"{out_path}.cpu{rank}").write_text(json.dumps(cpu[cfg["warmup"]:]))
        if rank == STAGES - 1:
            Path(out_path + ".losses").write_text(json.dumps(first_losses))
        if rank == 0:
            Path(out_path).write_text(json.dumps(times[cfg["warmup"]:]))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch(schedule: str, cfg: dict) -> tuple[list[float], list[float], list[float]]:
    """(seconds per step, CPU seconds per step summed over the 4 processes, step-0 losses)"""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.spawn(_torch_worker, args=({**cfg, "schedule": schedule}, out), nprocs=STAGES,
                 join=True)
        cpu = [sum(c) for c in zip(*(json.loads(Path(f"{out}.cpu{r}").read_text())
                                      for r in range(STAGES)))]
        return (json.loads(Path(out).read_text()), cpu,
                json.loads(Path(out + ".losses").read_text()))


# ---- overlap --------------------------------------------------------------------------------


def run_overlap(schedule: str, cfg: dict) -> tuple[list[float], list[float], list[float]]:
    import overlap
    from overlap.torch import TorchPipeline

    torch.set_num_threads(cfg["threads"])
    cluster = Cluster.preset("p3.8xlarge", num_hosts=STAGES)
    meshes = [cluster.mesh([h], gpus=1) for h in range(STAGES)]
    pipe = TorchPipeline(make_stages(cfg["width"]), meshes, nn.functional.mse_loss)
    opt = torch.optim.SGD(pipe.parameters(), lr=cfg["lr"])
    times, cpu, first_losses = [], [], []
    with overlap.Runtime(cluster) as rt:
        for k, (x, y) in enumerate(make_batches(cfg["warmup"] + cfg["steps"], cfg["batch"],
                                                cfg["width"])):
            opt.zero_grad()
            t0, c0 = time.perf_counter(), time.process_time()
            losses = pipe.train_step_sync(rt, x, y, num_microbatches=cfg["microbatches"],
                                          schedule=schedule)
            opt.step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)  # every thread of the process
            if k == 0:
                first_losses = losses
    return times[cfg["warmup"]:], cpu[cfg["warmup"]:], first_losses


def _mpiexec() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or \
        shutil.which("mpiexec")


def run_overlap_mpi(schedule: str, cfg: dict, launcher: str = "mpiexec"
                    ) -> tuple[list[float], list[float], list[float]]:
    """overlap on 4 processes (this script's ``--mpi-worker`` mode under ``launcher``,
    mpiexec or torchrun): rank 0's step times, CPU seconds per step summed over the ranks,
    step-0 losses. Under mpiexec the data between ranks goes over host links (Unix sockets),
    or over MPI with ``cfg["links"]`` False; under torchrun over links."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA_", "RANK",
                                "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_"))}
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["OVERLAP_HOST_LINKS"] = "1" if cfg.get("links", True) else "0"
    start = [_mpiexec(), "-n", str(STAGES), sys.executable] if launcher == "mpiexec" else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(STAGES)]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        subprocess.run([*start, __file__,  # type: ignore[list-item]
                        "--mpi-worker", json.dumps({**cfg, "schedule": schedule}), out],
                       env=env, check=True, timeout=1800, capture_output=True)
        cpu = [sum(c) for c in zip(*(json.loads(Path(f"{out}.cpu{r}").read_text())
                                      for r in range(STAGES)))]
        return (json.loads(Path(out).read_text()), cpu,
                json.loads(Path(out + ".losses").read_text()))


def _mpi_worker(cfg_json: str, out: str) -> None:
    from overlap.world import detect_world

    cfg = json.loads(cfg_json)
    times, cpu, losses = run_overlap(cfg["schedule"], cfg)
    rank = detect_world().rank
    Path(f"{out}.cpu{rank}").write_text(json.dumps(cpu))
    if rank == 0:
        Path(out).write_text(json.dumps(times))
        Path(out + ".losses").write_text(json.dumps(losses))


def run_single(cfg: dict, threads: int) -> list[float]:
    """Yardstick, not a contender: the 4 stages as one model in one process (no pipeline),
    ``threads`` intra-op threads, microbatches one after another. With one thread it is the
    step's compute work on one core."""
    torch.set_num_threads(threads)
    model = nn.Sequential(*make_stages(cfg["width"]))
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    times = []
    try:
        for x, y in make_batches(cfg["warmup"] + cfg["steps"], cfg["batch"], cfg["width"]):
            opt.zero_grad()
            t0 = time.perf_counter()
            for xm, ym in zip(x.chunk(cfg["microbatches"]), y.chunk(cfg["microbatches"])):
                nn.functional.mse_loss(model(xm), ym).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(cfg["threads"])
    return times[cfg["warmup"]:]


def _mem_gib() -> int:
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return round(kb / 2**20)


# ---- the table ------------------------------------------------------------------------------

ROWS = (("torch Schedule1F1B", "torch", "1f1b"), ("torch ScheduleGPipe", "torch", "gpipe"),
        ("overlap 1f1b", "overlap", "1f1b"), ("overlap eager-1f1b", "overlap", "eager-1f1b"))
MPI_ROWS = (("overlap mpi 1f1b", "overlap-mpi", "1f1b"),
            ("overlap mpi eager-1f1b", "overlap-mpi", "eager-1f1b"),
            ("mpi eager, MPI data", "overlap-mpi-data", "eager-1f1b"))
TORCHRUN_ROWS = (("overlap torchrun 1f1b", "overlap-torchrun", "1f1b"),
                 ("overlap torchrun eager", "overlap-torchrun", "eager-1f1b"))
RUNNERS = {"torch": run_torch, "overlap": run_overlap, "overlap-mpi": run_overlap_mpi,
           "overlap-mpi-data": lambda schedule, cfg: run_overlap_mpi(
               schedule, {**cfg, "links": False}),
           "overlap-torchrun": lambda schedule, cfg: run_overlap_mpi(schedule, cfg, "torchrun")}


def print_header(args: argparse.Namespace, rows: tuple) -> None:
    """What runs, on what machine: printed before the first row starts."""
    print(f"== overlap vs torch.distributed.pipelining: {STAGES} stages of Linear({args.width}, "
          f"{args.width}) -> ReLU -> Linear, batch {args.batch} in {args.microbatches} "
          f"microbatches, float32, MSE + SGD ==")
    print(f"{machine_line()}, {_mem_gib()} GiB, no GPU (shared, noisy); torch "
          f"{torch.__version__}")
    print(f"torch: {STAGES} gloo processes x {args.threads} intra-op thread(s); overlap: 1 "
          f"process, {STAGES} device compute threads x {args.threads} intra-op thread(s) "
          f"(+ comm stream threads); same cores for both"
          + ("; overlap mpi: 4 processes under mpiexec, rank 0's times"
             if len(rows) > len(ROWS) + len(TORCHRUN_ROWS) else
             "; (mpiexec not found: no MPI rows)")
          + "; overlap torchrun: 4 processes under torchrun, rank 0's times", flush=True)


def main(argv: list[str] | None = None) -> int:
    line_buffered_stdout()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads per stage worker (both sides)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mpi-worker", nargs=2, metavar=("CFG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mpi_worker:
        _mpi_worker(*args.mpi_worker)
        return 0
    rows = ROWS + (MPI_ROWS if _mpiexec() else ()) + TORCHRUN_ROWS
    cfg = {"width": args.width, "batch": args.batch, "microbatches": args.microbatches,
           "threads": args.threads, "warmup": args.warmup, "steps": args.steps, "lr": 0.01}
    print_header(args, rows)
    samples: dict[str, list[float]] = {label: [] for label, _, _ in rows}
    cpus: dict[str, list[float]] = {label: [] for label, _, _ in rows}
    first: dict[str, list[float]] = {}
    for k in range(args.rounds):
        for label, side, schedule in rows:
            times, cpu, losses = RUNNERS[side](schedule, cfg)
            samples[label].extend(times)
            cpus[label].extend(cpu)
            first[label] = losses
            # A row as it finishes (the whole run takes minutes): this round's median.
            print(f"  round {k + 1}/{args.rounds}: {label:<22} "
                  f"{statistics.median(times) * 1e3:8.1f} ms/step", flush=True)
        for threads in sorted({1, CORES}):
            samples.setdefault(f"single {threads}", []).extend(run_single(cfg, threads))
    med = {label: statistics.median(v) * 1e3 for label, v in samples.items()}
    worst = max(abs(a - b) for label in first for a, b in zip(first[label],
                                                             first["torch Schedule1F1B"]))
    print(f"median ms/step over {args.rounds} rounds x {args.steps} steps after {args.warmup} "
          f"warm-up steps; step-0 losses agree across all rows to {worst:.2g}")
    print(f"{'row':<22} {'ms/step':>9} {'min':>8} {'max':>8} {'CPU ms':>8} {'cores busy':>10}"
          f"   ratio ours/theirs")
    theirs = {"1f1b": med["torch Schedule1F1B"], "eager-1f1b": med["torch Schedule1F1B"]}
    for label, side, schedule in rows:
        v = samples[label]
        ratio = ""
        if side != "torch":
            ratio = (f"{med[label] / theirs[schedule]:.3f} vs Schedule1F1B, "
                     f"{med[label] / med['torch ScheduleGPipe']:.3f} vs ScheduleGPipe")
        c = statistics.median(cpus[label]) * 1e3
        print(f"{label:<22} {med[label]:>9.1f} {min(v) * 1e3:>8.1f} {max(v) * 1e3:>8.1f} "
              f"{c:>8.1f} {c / med[label]:>10.2f}   {ratio}")
    for threads in sorted({1, CORES}):
        label = f"(no pipeline, {threads} thr)"
        print(f"{label:<22} {med[f'single {threads}']:>9.1f}   yardstick: the 4 stages as "
              f"one model in one process, {threads} intra-op thread(s), microbatches in turn")
    print(f"ideal on {CORES} cores: (no pipeline, 1 thr) / {CORES} = "
          f"{med['single 1'] / CORES:.1f} ms/step")
    best = min(med["overlap 1f1b"], med["overlap eager-1f1b"])
    best_theirs = min(med["torch Schedule1F1B"], med["torch ScheduleGPipe"])
    print(f"target ours/theirs <= 1.0 (best of ours vs best of theirs): {best / best_theirs:.3f}"
          f" -> {'met' if best <= best_theirs else 'NOT met'}")
    if len(rows) > len(ROWS):
        best_mpi = min(med["overlap mpi 1f1b"], med["overlap mpi eager-1f1b"])
        print(f"target multi-process ours/theirs <= 1.0 (issue 17): "
              f"{best_mpi / best_theirs:.3f} -> "
              f"{'met' if best_mpi <= best_theirs else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
