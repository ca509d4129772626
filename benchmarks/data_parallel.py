"""Data parallelism inside the stage meshes against replicated stages (not a test).

The same GPT (``GPTStage`` modules of ``examples/gpt_pipeline.py``) on 8 virtual devices,
three ways, in one run, alternating step by step:

- **replicated** (without ``data_parallel``): 4 stages, each on a 2-device mesh whose
  second device runs the whole stage on the whole microbatch again;
- **dp 2**: the same 4 meshes with ``data_parallel="dp"``: each device runs its half of
  every microbatch, and the two replicas' gradients are summed after each stage's backward
  (a step-graph op on the stage's own stream);
- **8 stages**: the blocks cut in 8 one-device stages.

Each figure is the median step time per sample over ``--rounds`` rounds, after warm-up steps;
the ratio is against the replicated step (goal: dp 2 ≤ 0.6 ×). Gradients are set to None
before every step; no optimizer step (the same in all three). Every variant trains the same
model from the same weights.

    python benchmarks/data_parallel.py                       # CPU backend, float32
    python benchmarks/data_parallel.py --device cuda         # 8 virtual devices of GPUs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from vs_plain_torch import gpt_module  # noqa: E402  (the GPT example, loaded as a module)


def pipeline(gpt: Any, args: argparse.Namespace, stages: int, dp: bool, rt: Any) -> Any:
    """The GPT cut in ``stages`` stages over 8 devices (2 per stage when 4), replicas of one
    build per mesh; ``dp``: the meshes' ``dp`` axis splits the batch."""
    import torch

    from overlap.torch import TorchPipeline, replicate
    from scheduler import DeviceMesh

    per = [args.blocks // stages + (s < args.blocks % stages) for s in range(stages)]
    width = 8 // stages
    meshes = [DeviceMesh([[width * s + k] for k in range(width)], ("dp", "tp"))
              for s in range(stages)]
    modules = []
    for s in range(stages):
        torch.manual_seed(s)
        stage = gpt.GPTStage(args.vocab, args.seq, args.width, args.heads, per[s], s == 0,
                             s == stages - 1)
        if args.device == "cuda":
            stage = stage.to(torch.device("cuda", rt.backend.physical(meshes[s].device_ids[0])))
        modules.append(replicate(stage, width))
    if args.device == "cuda":  # (each replica on its own device's GPU)
        for s, reps in enumerate(modules):
            for m, d in zip(reps, meshes[s].device_ids):
                m.to(torch.device("cuda", rt.backend.physical(d)))
    return TorchPipeline(modules, meshes, gpt.lm_loss, data_parallel="dp" if dp else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    import overlap
    from scheduler import Cluster
    from scheduler.cli.common import line_buffered_stdout, machine_line

    line_buffered_stdout()
    if args.device == "cpu":
        torch.set_num_threads(1)  # (each stage thread: one core's worth)
    print(f"{machine_line()}, torch {torch.__version__}; GPT width {args.width}, seq "
          f"{args.seq}, {args.blocks} blocks, batch {args.batch} in {args.microbatches} "
          f"microbatches, {args.schedule}, {args.device}; {time.strftime('%Y-%m-%d %H:%M')}")
    gpt = gpt_module()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    if args.device == "cuda":
        x, y = x.cuda(), y.cuda()
    cluster = Cluster.local(8)
    backend = "cuda" if args.device == "cuda" else "cpu"
    with overlap.Runtime(cluster, backend=backend, timeout=300) as rt:
        variants = {"replicated (4 stages × 2)": pipeline(gpt, args, 4, False, rt),
                    "dp 2 (4 stages × dp 2)": pipeline(gpt, args, 4, True, rt),
                    "8 one-device stages": pipeline(gpt, args, 8, False, rt)}
        times: dict[str, list[float]] = {k: [] for k in variants}
        losses: dict[str, list[float]] = {}
        for r in range(args.warmup + args.rounds):
            for name, pipe in variants.items():
                for p in pipe.parameters():
                    p.grad = None
                if args.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = pipe.train_step_sync(rt, x, y, num_microbatches=args.microbatches,
                                           schedule=args.schedule)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                if r >= args.warmup:
                    times[name].append(time.perf_counter() - start)
                losses[name] = out
    base = statistics.median(times["replicated (4 stages × 2)"])
    print(f"{'variant':28} {'ms/step':>9} {'µs/sample':>10} {'× replicated':>13}  loss")
    for name, ts in times.items():
        t = statistics.median(ts)
        mean = sum(losses[name]) / len(losses[name])
        print(f"{name:28} {t * 1e3:9.1f} {t / args.batch * 1e6:10.0f} {t / base:13.3f}  "
              f"{mean:.4f}")
    dp = statistics.median(times["dp 2 (4 stages × dp 2)"]) / base
    print(f"goal: dp 2 ≤ 0.6 × replicated — {dp:.3f} ({'met' if dp <= 0.6 else 'not met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
