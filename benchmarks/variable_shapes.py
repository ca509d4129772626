"""Variable-shape microbatches against padding to the longest (a benchmark, not a test); every
ratio from this run.

1. ``--part step`` — a 4-stage torch pipeline (position-wise MLP blocks of width ``--width``,
   CPU backend, eager-1f1b) on 8 microbatches whose sequence lengths are long-tailed between
   32 and 1024 (``examples/gpt_pipeline.py``'s ``lengths``), drawn anew every step from a
   fixed set of ``--shapes`` lengths: each microbatch at its own length
   (``train_step(microbatches=...)``) against every microbatch padded to the step's longest.
   Median step time, the bytes the boundaries carry per step (both directions) and the peak
   activation bytes the schedule keeps (per stage, the boundary bytes of microbatches between
   F and B, most over the step, summed over stages: the cost model's count, not measured).
2. ``--part plan`` — planning and lowering a step graph (the toy's 4 meshes and layouts) with
   8 and 64 distinct shapes against one shape: cold (a new plan cache) and warm (every shape
   planned before), and the runtime's own step on tiny microbatches (its per-step overhead)
   with 8 distinct shapes already seen against one fixed shape. Goal: the per-shape planning
   is paid once — a step with shapes seen before costs no more than a fixed-shape step
   (within 5 %).

    python benchmarks/variable_shapes.py [--part step|plan]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from scheduler import (  # noqa: E402
    Cluster,
    MicrobatchBoundaries,
    PlanCache,
    lower,
    make_schedule,
)
from scheduler.cli.common import line_buffered_stdout, machine_line  # noqa: E402

MICROBATCHES = 8


def _gpt_lengths():
    spec = importlib.util.spec_from_file_location("gpt_pipeline", ROOT / "examples" /
                                                  "gpt_pipeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.lengths


# ---- 1. a step, variable against padded ------------------------------------------------------

def _peak_bytes(sched, rows_bytes: list[list[int]]) -> int:
    """Sum over stages of the most boundary bytes kept between a microbatch's F and B."""
    total = 0
    for r in range(sched.num_ranks):
        for s in sched.stages_of(r):
            live, peak = 0, 0
            for a in sched.actions[r]:
                if sched.stage_of(r, a) != s:
                    continue
                if a.kind == "F":
                    live += rows_bytes[a.microbatch][s]
                elif a.kind in ("B", "W"):
                    live -= rows_bytes[a.microbatch][s]
                peak = max(peak, live)
            total += peak
    return total


def part_step(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    import overlap
    from overlap.torch import TorchPipeline
    from scheduler import DeviceMesh

    torch.set_num_threads(1)
    lengths = _gpt_lengths()
    gen = torch.Generator().manual_seed(0)
    pool = sorted(set(lengths(gen, args.shapes * 4, 1024, 32)))[:args.shapes]
    w = args.width

    def stage(s: int) -> nn.Module:
        return nn.Sequential(nn.Linear(w, 2 * w), nn.ReLU(), nn.Linear(2 * w, w))

    meshes = [DeviceMesh([d], ("gpu",)) for d in range(4)]
    steps = [[pool[int(i)] for i in torch.randint(len(pool), (MICROBATCHES,), generator=gen)]
             for _ in range(args.warmup + args.steps)]
    rows = {"variable": [], "padded": []}
    bytes_moved, peak = {}, {}
    sched = make_schedule("eager-1f1b", 4, MICROBATCHES)
    with overlap.Runtime(Cluster.local(4)) as rt:
        pipe = TorchPipeline(stage, meshes, nn.functional.mse_loss, rt=rt, seed=0)
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        for k, lens in enumerate(steps):
            for variant in ("variable", "padded") if k % 2 else ("padded", "variable"):
                use = lens if variant == "variable" else [max(lens)] * len(lens)
                mbs = [(torch.randn(1, n, w), torch.randn(1, n, w)) for n in use]
                opt.zero_grad()
                t0 = time.perf_counter()
                pipe.train_step_sync(rt, microbatches=mbs, schedule="eager-1f1b")
                if k >= args.warmup:
                    rows[variant].append(time.perf_counter() - t0)
                opt.step()
                per = [[n * w * 4] * 4 for n in use]  # each stage's output (and input) bytes
                bytes_moved.setdefault(variant, []).append(2 * 3 * sum(n * w * 4 for n in use))
                peak.setdefault(variant, []).append(_peak_bytes(sched, per))
    print(f"== variable-length microbatches against padding: 4 stages of Linear({w}, {2 * w}) "
          f"-> ReLU -> Linear, {MICROBATCHES} microbatches of lengths long-tailed in 32..1024 "
          f"({len(pool)} distinct), eager-1f1b, CPU backend, float32 ==")
    print(f"{machine_line()}; medians of {args.steps} steps after {args.warmup}, variants "
          "alternating within each step")
    print(f"{'variant':<10} {'ms/step':>9} {'MiB moved':>10} {'peak act MiB':>13}   ratio")
    base = statistics.median(rows["padded"])
    for v in ("padded", "variable"):
        t = statistics.median(rows[v])
        print(f"{v:<10} {t * 1e3:>9.1f} {statistics.median(bytes_moved[v]) / 2**20:>10.2f} "
              f"{statistics.median(peak[v]) / 2**20:>13.2f}   {t / base:.3f} of padded")


# ---- 2. planning and the runtime's per-step cost ---------------------------------------------

def _toy_bounds(model, rows: list[int]) -> MicrobatchBoundaries:
    return MicrobatchBoundaries(tuple(
        tuple(dataclasses.replace(b, shape=(n, model.hidden)) for b in model.boundaries())
        for n in rows))


def _timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _planning(model, cluster: Cluster, m: int) -> tuple[float, float, float]:
    """Lowering with m distinct shapes cold and warm, and with one shape warm (seconds)."""
    sched = make_schedule("1f1b", 4, m)
    varied = _toy_bounds(model, [1 + k for k in range(m)])
    cold = _timed(lambda: lower(model.meshes, varied, sched, cluster,
                                cache=PlanCache(cluster)), 3)
    cache = PlanCache(cluster)
    lower(model.meshes, varied, sched, cluster, cache=cache)
    warm = _timed(lambda: lower(model.meshes, varied, sched, cluster, cache=cache), 5)
    fixed = model.boundaries()
    lower(model.meshes, fixed, sched, cluster, cache=cache)
    one = _timed(lambda: lower(model.meshes, fixed, sched, cluster, cache=cache), 5)
    return cold, warm, one


def part_plan(args: argparse.Namespace) -> None:
    from toy import ToyMLP

    import overlap

    cluster = Cluster.preset("p3.8xlarge", 4)
    model = ToyMLP.build(cluster, hidden=8, batch=8)
    print("== planning and lowering with many shapes (the toy's 4 meshes, 3 boundaries, "
          "1f1b) ==")
    print(machine_line())
    print(f"{'microbatches':>12} {'shapes':>7} {'cold ms':>9} {'warm ms':>9} "
          f"{'one shape ms':>13} {'warm / one':>11}")
    for m in (8, 64):
        cold, warm, one = _planning(model, cluster, m)
        print(f"{m:>12} {m:>7} {cold * 1e3:>9.1f} {warm * 1e3:>9.1f} {one * 1e3:>13.1f} "
              f"{warm / one:>11.2f}")
    # The runtime's step on tiny microbatches: its host-side cost per step. Small shapes plan
    # into more transfers than large ones, so the fixed-shape side runs each of the same 8
    # shapes in turn (the same ops on average): the difference is what varying costs.
    rng = np.random.default_rng(0)
    rows = [1, 2, 3, 4, 5, 6, 7, 8]
    data = {n: rng.standard_normal((n, 8)) for n in rows}
    varied = _toy_bounds(model, rows)
    fixed = {n: _toy_bounds(model, [n] * len(rows)) for n in rows}  # one shape each
    samples: dict[str, list[float]] = {"8 shapes, seen": [], "1 shape": []}
    with overlap.Runtime(cluster) as rt:
        def step(bounds, use) -> float:
            model.zero_grad()
            t0 = time.perf_counter()
            rt.train_step_sync(model.stages(), bounds, [data[n] for n in use],
                               input_sharding=model.input_sharding(), schedule="1f1b")
            return time.perf_counter() - t0
        for n in rows:  # warm: every shape planned, every graph lowered
            step(varied, rows)
            step(fixed[n], [n] * len(rows))
        for k in range(args.rounds * 8):
            n = rows[k % len(rows)]
            pair = (("8 shapes, seen", varied, rows), ("1 shape", fixed[n], [n] * len(rows)))
            for label, bounds, use in (pair if k % 2 else pair[::-1]):
                samples[label].append(step(bounds, use))
    one = statistics.mean(samples["1 shape"])
    print(f"\n== the runtime's step, tiny microbatches (its per-step cost), {len(rows)} "
          f"microbatches: 8 shapes at once against each of them alone, "
          f"{len(samples['1 shape'])} alternating steps each, means ==")
    for label, v in samples.items():
        print(f"{label:<16} {statistics.mean(v) * 1e3:8.2f} ms/step   "
              f"{statistics.mean(v) / one:.3f} of one shape")
    ratio = statistics.mean(samples["8 shapes, seen"]) / one
    print(f"goal: shapes seen before cost no more than one shape (<= 1.05): {ratio:.3f} -> "
          f"{'met' if ratio <= 1.05 else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    line_buffered_stdout()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("step", "plan", "both"), default="both")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--shapes", type=int, default=8, help="distinct lengths to draw from")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.part in ("step", "both"):
        part_step(args)
    if args.part in ("plan", "both"):
        print()
        part_plan(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
