"""Train a 4-stage PyTorch MLP with the overlap runtime (CPU backend), checked against torch.

Each stage is ``Linear(1024, 1024) -> ReLU -> Linear(1024, 1024)`` on its own device; a batch
of 256 is split into 8 microbatches and run with the eager-1f1b schedule; the user's own
``torch.optim.SGD`` steps the stages' parameters. Every step's losses and, at the end, every
parameter are compared with the same model trained in plain single-process torch (same seeds,
``loss.backward()`` per microbatch) and must agree to 1e-5 in float32; the script exits
non-zero if they do not. It writes a Perfetto trace of the last step and prints the overlap
report.

Under ``mpiexec -n 4`` (or 2) each process drives some stages' devices and trains only their
parameters: each compares its own stages with the reference, and the processes agree on the
worst difference (``MPI.MAX``), so all of them pass or fail together.

    pip install torch==2.13.0 && pip install -e '.[torch]'
    python examples/torch_pipeline.py
    mpiexec -n 4 python examples/torch_pipeline.py      # the 'mpi' extra
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

# One BLAS thread per virtual device: each device's compute stream is a thread.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import overlap
from overlap.torch import TorchPipeline
from scheduler import Cluster, DeviceMesh

TOL = 1e-5


def stage(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--schedule", default="eager-1f1b")
    ap.add_argument("--trace-dir", default="traces")
    args = ap.parse_args(argv)
    # Four device threads share the cores: one intra-op thread each (as BLAS above).
    torch.set_num_threads(1)

    torch.manual_seed(0)
    modules = [stage(args.width) for _ in range(4)]
    reference = nn.Sequential(*(copy.deepcopy(m) for m in modules))  # same initial weights
    cluster = Cluster.local(4)  # 4 virtual devices on this machine
    meshes = [DeviceMesh([d], ("gpu",)) for d in range(4)]  # one device per stage
    pipe = TorchPipeline(modules, meshes, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)

    data = torch.Generator().manual_seed(1)
    worst = 0.0
    with overlap.Runtime(cluster) as rt:
        rank = rt.world.rank
        say = print if rank == 0 else (lambda *a, **k: None)  # one process speaks
        say(f"torch pipeline: 4 stages of Linear({args.width}, {args.width}) -> ReLU -> "
            f"Linear, batch {args.batch} in {args.microbatches} microbatches, "
            f"{args.schedule}, {args.steps} SGD steps, float32, CPU backend")
        for step in range(args.steps):
            x = torch.randn(args.batch, args.width, generator=data)
            y = torch.randn(args.batch, args.width, generator=data)
            opt.zero_grad()
            t0 = time.perf_counter()
            losses = pipe.train_step_sync(rt, x, y, num_microbatches=args.microbatches,
                                          schedule=args.schedule)
            ms = (time.perf_counter() - t0) * 1e3
            opt.step()

            ref_opt.zero_grad()
            ref_losses = []
            for xm, ym in zip(x.chunk(args.microbatches), y.chunk(args.microbatches)):
                loss = nn.functional.mse_loss(reference(xm), ym)
                loss.backward()  # accumulates over microbatches, as the pipeline does
                ref_losses.append(loss.item())
            ref_opt.step()

            diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
            worst = max(worst, diff)
            stats = rt.last_step  # the runtime's figures of the step, from its trace
            say(f"  step {step}: mean loss {sum(losses) / len(losses):.6f}  ({ms:.1f} ms, "
                f"bubble {stats.bubble:.0%}, exposed communication {stats.exposed_comm:.1%};"
                f" largest loss difference from torch {diff:.2g})")
        tl = rt.timeline()
        suffix = f".rank{rank}" if rt.world.distributed else ""  # one trace per rank
        trace = rt.write_trace(Path(args.trace_dir) / f"torch-{args.schedule}{suffix}.json")
        # This process's stages: the ones whose devices it drives (all of them, alone).
        mine = [s for s, mesh in enumerate(meshes)
                if all(rt.backend.is_local(d) for d in mesh.device_ids)]
        distributed = rt.world.distributed

    for s in mine:
        for p, q in zip(modules[s].parameters(), reference[s].parameters()):
            worst = max(worst, float((p.detach() - q.detach()).abs().max()))
    if distributed:  # every process's verdict is the worst of all of them
        from mpi4py import MPI

        worst = MPI.COMM_WORLD.allreduce(worst, op=MPI.MAX)
    if worst > TOL:
        say(f"FAILED: the pipeline differs from plain torch by {worst:.3g} > {TOL}")
        return 1
    say(f"losses of every step and all parameters after {args.steps} steps match plain "
          f"torch (largest difference {worst:.3g} <= {TOL})")
    say(f"\noverlap report ({args.schedule}, last step"
        f"{', this rank' if distributed else ''}):")
    say(tl.report())
    say(f"\ntrace: {trace} (open in https://ui.perfetto.dev, or: overlap trace report {trace})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
