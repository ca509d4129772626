"""Tensor-parallel pipelines (not a test): mixed layouts against equal ones, measured and
simulated; every ratio from this run.

1. ``--part example`` — the GPT of ``examples/gpt_pipeline.py`` on this machine (CPU backend):
   per schedule, the mixed meshes (TP 1, 2, 4 and a 2×2 mesh) against TP 2 everywhere, run in
   alternating rounds: median step time, the runtime trace's compute waits for transfers,
   and the bytes the boundaries' plans deliver per step (both directions, every microbatch).
2. ``--part sim`` — a GPT-3-like model (hidden 8192, sequence 2048, 96 layers, bfloat16) on
   DGX H100 hosts, 16 stages of TP degrees 8, 4, 2, 2 (layers in proportion, so every stage
   computes as long), Megatron sequence parallelism at the boundaries (``Shard(seq)`` over
   each stage's TP axis) and without it (replicated: every device of the next stage needs the
   whole activation, where broadcasts pay): broadcast against send_recv resharding,
   eager-1f1b and auto against 1f1b, with ``scheduler.simulate`` (compute from FLOPs at a
   stated rate).

    python benchmarks/gpt_tp.py                 # both
    python benchmarks/gpt_tp.py --part sim
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scheduler import (  # noqa: E402
    Boundary,
    Cluster,
    DeviceMesh,
    P,
    PlanCache,
    PlanOptions,
    Sharding,
    auto_schedule,
    lower,
    lower_bound,
    make_schedule,
    plan_resharding,
    simulate,
)
from scheduler.cli.common import line_buffered_stdout, machine_line  # noqa: E402
from scheduler.cost import CostModel  # noqa: E402

# ---- 1. the example on this machine -------------------------------------------------------


def _example():
    spec = importlib.util.spec_from_file_location("gpt_pipeline", ROOT / "examples" /
                                                  "gpt_pipeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def example_table(rounds: int, steps: int) -> str:
    import torch

    import overlap
    from overlap.torch import TorchPipeline

    ex = _example()
    torch.set_num_threads(1)
    layers, width, heads, seq, vocab, batch, m = 8, 64, 4, 32, 256, 16, 4
    configs = {"mixed 1,2,4,2x2": "1,2,4,2x2", "equal 2,2,2,2": "2,2,2,2"}
    schedules = ("gpipe", "1f1b", "eager-1f1b", "zb-h1")
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    moved: dict[tuple[str, str], int] = {}
    data = torch.Generator().manual_seed(1)
    stream = ex.tokens(data, batch, seq, vocab)
    x, y = stream[:, :-1], stream[:, 1:]
    for _ in range(rounds):
        for sched_name in schedules:
            for label, text in configs.items():
                sched = make_schedule(sched_name, 4, m)
                cluster, meshes = ex.meshes_for(ex.parse_meshes(text), 1, "loop")
                torch.manual_seed(0)
                per = layers // 4
                stages = [ex.GPTStage(vocab, seq, width, heads, per, s == 0, s == 3)
                          for s in range(4)]
                plans = [ex.stage_plan(st, False) for st in stages]
                pipe = TorchPipeline(stages, meshes, ex.lm_loss, plans=plans, axis="tp")
                with overlap.Runtime(cluster) as rt:
                    pipe.train_step_sync(rt, x, y, num_microbatches=m, schedule=sched)  # warm
                    times = []
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        pipe.train_step_sync(rt, x, y, num_microbatches=m, schedule=sched)
                        times.append(time.perf_counter() - t0)
                    exposed = rt.timeline().transfer_wait_fraction
                    rows = pipe.boundary_report(rt, x[:batch // m], y[:batch // m])
                moved[(sched_name, label)] = sum(r.bytes for r in rows) * m
                results.setdefault((sched_name, label), []).append(
                    (statistics.median(times), exposed))
    lines = [f"== GPT example ({layers} blocks, width {width}, seq {seq}, batch {batch} in "
             f"{m} microbatches, float32, CPU backend): {rounds} alternating rounds × "
             f"{steps} steps, medians ==",
             f"{'schedule':<12}{'meshes':<18}{'step ms':>9}{'waited':>9}{'KiB/step':>10}"
             f"{'step / equal':>14}"]
    for sched_name in schedules:
        equal = statistics.median(t for t, _ in results[(sched_name, "equal 2,2,2,2")])
        for label in configs:
            rs = results[(sched_name, label)]
            t = statistics.median(v for v, _ in rs)
            e = statistics.median(v for _, v in rs)
            lines.append(f"{sched_name:<12}{label:<18}{t * 1e3:>9.1f}{e:>9.1%}"
                         f"{moved[(sched_name, label)] / 1024:>10.0f}{t / equal:>14.2f}")
    return "\n".join(lines)


# ---- 2. GPT-3-like in simulation ---------------------------------------------------------

H100_FLOPS = 989e12 * 0.40  # bf16 dense peak, 40 % of it end to end (assumed)
DEGREES = (8, 4, 2, 2)  # one group of stages: two DGX hosts


def gpt3_mixed(spec: P, stages: int = 16):
    """Meshes, boundaries (``spec`` on both sides: ``P("tp")`` sequence-parallel, ``P()``
    replicated) and per-stage compute seconds of the mixed-TP GPT-3-like model."""
    h, s, layers = 8192, 2048, 96
    groups = stages // len(DEGREES)
    cluster = Cluster.preset("dgx-h100", 2 * groups)
    meshes, per_layer = [], 24 * h * h * s * (1 + s / (6 * h))  # Megatron's FLOPs per layer
    gpus = sum(DEGREES) * groups
    for g in range(groups):
        base = 16 * g
        start = 0
        for d in DEGREES:
            meshes.append(DeviceMesh([list(range(base + start, base + start + d))], ("dp", "tp")))
            start += d
    fwd = [per_layer * layers * (meshes[k].size / gpus) / (H100_FLOPS * meshes[k].size)
           for k in range(stages)]
    boundaries = [Boundary((s, h), "bfloat16", Sharding(meshes[k], spec),
                           Sharding(meshes[k + 1], spec)) for k in range(stages - 1)]
    return cluster, meshes, boundaries, fwd


def sim_table(spec: P, microbatches: int = 64) -> str:
    cluster, meshes, boundaries, fwd = gpt3_mixed(spec)
    p = len(meshes)
    costs = {(k, kind): fwd[k] * mult for k in range(p) for kind, mult in (("F", 1), ("B", 2))}
    cache = PlanCache(cluster)
    model = CostModel(cluster)
    lines = [f"== GPT-3-like, mixed TP {DEGREES} × {p // len(DEGREES)} on dgx-h100 "
             f"({cluster.num_hosts} hosts), {p} stages × {microbatches} microbatches, boundary "
             f"{boundaries[0].shape} bfloat16 {spec!r} -> {spec!r}; F {fwd[0] * 1e3:.1f} ms "
             f"per stage ==", "boundaries (forward), plan / bound:"]
    for k in range(len(DEGREES)):
        b = boundaries[k]
        parts = []
        for strategy in ("send_recv", "broadcast", "local_allgather"):
            plan = plan_resharding(b.shape, b.dtype, b.producer, b.consumer, cluster,
                                   PlanOptions(strategy=strategy))
            bound = lower_bound(b.shape, b.dtype, b.producer, b.consumer, cluster)
            parts.append(f"{strategy} {model.plan_time(plan) * 1e3:.2f} ms "
                         f"({model.plan_time(plan) / bound:.2f}×)")
        lines.append(f"  TP{meshes[k].size} -> TP{meshes[k + 1].size}: bound "
                     f"{lower_bound(b.shape, b.dtype, b.producer, b.consumer, cluster) * 1e3:.2f}"
                     f" ms; " + ", ".join(parts))
    rows = []
    for strategy in ("send_recv", "broadcast"):
        options = PlanOptions(strategy=strategy)
        for name in ("1f1b", "eager-1f1b", "auto"):
            if name == "auto":
                choice = auto_schedule(meshes, boundaries, microbatches, cluster, costs, options,
                                       cache=cache)
                graph, label = choice.graph, choice.schedule.name
            else:
                graph = lower(meshes, boundaries, make_schedule(name, p, microbatches), cluster,
                              options, cache=cache)
                label = name
            tl = simulate(graph, cluster, costs)
            rows.append((strategy, label, tl))
    signal = simulate(lower(meshes, boundaries, make_schedule("eager-1f1b", p, microbatches),
                            cluster, PlanOptions(), cache=cache), cluster, costs, signal=True)
    base = rows[0][2].iteration_time
    lines.append(f"{'strategy':<11}{'schedule':<26}{'iteration s':>12}{'waited':>9}"
                 f"{'bubble':>8}{'/ send_recv+1f1b':>18}{'/ signal':>10}")
    for strategy, label, tl in rows:
        lines.append(f"{strategy:<11}{label:<26}{tl.iteration_time:>12.3f}"
                     f"{tl.transfer_wait_fraction:>9.2%}{tl.bubble_fraction:>8.1%}"
                     f"{tl.iteration_time / base:>18.3f}"
                     f"{tl.iteration_time / signal.iteration_time:>10.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    line_buffered_stdout()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("example", "sim", "all"), default="all")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    print(machine_line())
    if args.part in ("sim", "all"):
        print(sim_table(P("tp")))  # Megatron with sequence parallelism: blocks of the sequence
        print(sim_table(P()))  # without: every device of the next stage needs all of it
    if args.part in ("example", "all"):
        print(example_table(args.rounds, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
