"""Train a 4-stage PyTorch MLP with the overlap runtime (CPU backend), checked against torch.

Each stage is ``Linear(1024, 1024) -> ReLU -> Linear(1024, 1024)`` on its own device; a batch
of 256 is split into 8 microbatches and run with the eager-1f1b schedule; the user's own
``torch.optim.SGD`` steps the stages' parameters. Every step's losses and, at the end, every
parameter are compared with the same model trained in plain single-process torch (same seeds,
``(loss / microbatches).backward()`` per microbatch: the mean, the pipeline's default as
torch's schedules') and must agree to 1e-5 in float32; the script exits
non-zero if they do not. It writes a Perfetto trace of the last step and prints the overlap
report.

Each stage is built by a factory (``stage_fn(s)``), for real only on the process that runs
it. Under ``torchrun --nproc-per-node 4`` or ``mpiexec -n 4`` (or 2) each process builds,
drives and trains only its stages: each compares its own stages with the reference (built
with the same seeds), and the processes agree on the worst difference, so all of them pass
or fail together.

    pip install torch==2.13.0 && pip install -e '.[torch]'
    python examples/torch_pipeline.py
    torchrun --standalone --nproc-per-node 4 examples/torch_pipeline.py
    mpiexec -n 4 python examples/torch_pipeline.py      # the 'mpi' extra
"""

from __future__ import annotations

import argparse
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
from overlap.torch import TorchPipeline, build_stage
from overlap.world import max_over_ranks
from scheduler import Cluster, DeviceMesh
from scheduler.cli.common import output_dir, positive_float, positive_int

TOL = 1e-5


def stage(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=positive_int, default=3)
    ap.add_argument("--batch", type=positive_int, default=256)
    ap.add_argument("--microbatches", type=positive_int, default=8)
    ap.add_argument("--width", type=positive_int, default=1024)
    ap.add_argument("--lr", type=positive_float, default=0.05)
    ap.add_argument("--schedule", default="eager-1f1b")
    ap.add_argument("--trace-dir", type=output_dir, default="traces")
    args = ap.parse_args(argv)
    # Four device threads share the cores: one intra-op thread each (as BLAS above).
    torch.set_num_threads(1)

    cluster = Cluster.local(4)  # 4 virtual devices on this machine
    meshes = [DeviceMesh([d], ("gpu",)) for d in range(4)]  # one device per stage

    def stage_fn(s: int) -> nn.Module:
        return stage(args.width)

    # Plain torch, every stage, with the pipeline's initial weights (stage s: seed 0 + s).
    reference = nn.Sequential(*(build_stage(stage_fn, s, seed=0) for s in range(4)))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)

    data = torch.Generator().manual_seed(1)
    worst = 0.0
    with overlap.Runtime(cluster) as rt:
        # This process's stages only are built (the others: shapes, on the meta device).
        pipe = TorchPipeline(stage_fn, meshes, loss_fn=nn.functional.mse_loss, rt=rt, seed=0)
        opt = torch.optim.SGD(pipe.parameters(), lr=args.lr)
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
                # The mean over the microbatches, as the pipeline's gradients are by default.
                (loss * (1.0 / args.microbatches)).backward()
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
        distributed = rt.world.distributed
        for st in pipe.local_stages:  # this process's stages against plain torch's
            for p, q in zip(st.modules[0].parameters(), reference[st.index].parameters()):
                worst = max(worst, float((p.detach() - q.detach()).abs().max()))
        worst = max_over_ranks(worst, rt.world)  # every process's verdict: the worst of all
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
