"""Automatic partitioning against hand-made uniform pipelines (not a test).

For each model, ``scheduler.partition`` against the best of {uniform split × every uniform TP
degree × every schedule} — every TP degree all the layers support, every number of stages
``p`` that is a power of two or uses all the devices (``p·t <= devices``, ``p <= layers``),
layers split as evenly as possible (the first stages take one more), stage ``s`` on devices
``s·t .. (s+1)·t − 1``, and every schedule: gpipe, 1f1b, eager-1f1b, zb-h1 (split backward),
interleaved-1f1b (two uniform chunks per rank, ``m`` a multiple of ``p``) and zbv (split
backward, two chunks per rank in a V) — each simulated by the project's simulator with the
same boundary planning, and skipped where it does not fit memory. Every ratio is computed in
this run; planning time is ``partition``'s wall time on this machine.

Models (compute from FLOPs at a stated device rate, like ``benchmarks/schedule_sim.py``;
tensor-parallel layers pay their all-reduces as the cost model's lower bound):

- GPT-3-like: hidden 8192, sequence 1024, 96 layers (the first with the token embedding, the
  last with the LM head), fp16, Megatron tensor parallelism (TP 1, 2, 4: two all-reduces of
  the activation per block each way), selective activation recomputation; 16 × p3.8xlarge
  (64 V100-16GB), 64 microbatches, 16 GiB per device.
- U-Transformer-like: 16 layers, an encoder of 4 resolutions (128² to 16² tokens, 256 to 2048
  channels) and a decoder mirroring it, global attention (so the full-resolution layers cost
  2.7× the others), the skip tensors crossing every cut they span (a cut's tensor is 64 MiB
  near the ends, 240 MiB in the middle), batch-sharded outputs needed whole by the next
  stage; 2 × p3.8xlarge (8 GPUs), 16 microbatches.
- heterogeneous: 32 layers of random compute (log-uniform 20×), output sizes, parameters and
  TP degrees (seeded), split backward; 2 × DGX H100 (16 GPUs), 32 microbatches, 80 GiB.

    python benchmarks/partition.py [--model gpt3|utransformer|hetero]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler import (
    Boundary,
    Cluster,
    DeviceMesh,
    Layer,
    P,
    PlanCache,
    Sharding,
    lower,
    make_schedule,
    partition,
    simulate,
)
from scheduler.cli.common import machine_line

V100_FLOPS = 125e12 * 0.30  # fp16 tensor-core peak, 30 % end to end (as schedule_sim.py)
H100_FLOPS = 989e12 * 0.40  # bf16 dense peak, 40 %
GIB = 1 << 30


@dataclass(frozen=True)
class Model:
    name: str
    layers: tuple[Layer, ...]
    cluster: Cluster
    microbatches: int
    memory: float | None


def gpt3_like() -> Model:
    h, s, vocab = 8192, 1024, 50257
    cluster = Cluster.preset("p3.8xlarge", 16)
    block_flops = 24 * h * h * (1 + s / (6 * h)) * s  # Megatron-LM's count, one sequence
    block_params = 12 * h * h * 4  # fp16 weights and gradients
    act = 34 * s * h  # selective recomputation (Korthikanti et al.), one sequence
    layers = []
    for i in range(96):
        flops, params = block_flops, block_params
        if i == 0:
            params += vocab * h * 4  # the token embedding
        if i == 95:
            flops += 2 * s * h * vocab  # the LM head
            params += vocab * h * 4
        layers.append(Layer.from_flops(flops, (s, h), "float16", params, act,
                                       cluster=cluster, device_flops=V100_FLOPS,
                                       degrees=(1, 2, 4), collectives=2,
                                       collective_bytes=s * h * 2, name=f"block{i}"))
    return Model("GPT-3-like", tuple(layers), cluster, 64, 16 * GIB)


def u_transformer_like() -> Model:
    cluster = Cluster.preset("p3.8xlarge", 2)
    level_bytes = [8 * (128 >> k) ** 2 * (256 << k) * 2 for k in range(4)]  # 64 .. 8 MiB
    levels = [k // 2 for k in range(8)] + [3 - k // 2 for k in range(8)]
    layers = []
    for i, k in enumerate(levels):
        # skip tensors alive across the cut after layer i: level j's (made by encoder layer
        # 2j+1, read by decoder layer 14 − 2j), unless it is this layer's own output
        skips = sum(level_bytes[j] for j in range(4) if 2 * j + 1 < i < 14 - 2 * j)
        elements = (level_bytes[k] + skips) // 2
        c, tokens = 256 << k, (128 >> k) ** 2
        flops = 1.2e12 + 8 * 4 * tokens * tokens * c  # + global attention (QKᵀ, AV)
        layers.append(Layer.from_flops(
            flops, (8, elements // 8), "float16", 12 * c * c * 4, 10 * level_bytes[k],
            cluster=cluster, device_flops=V100_FLOPS, degrees=(1, 2, 4), collectives=2,
            collective_bytes=level_bytes[k], output_spec=P("tp"), input_spec=P(),
            name=f"{'enc' if i < 8 else 'dec'}{k}"))
    return Model("U-Transformer-like", tuple(layers), cluster, 16, 16 * GIB)


def heterogeneous(seed: int = 7) -> Model:
    rng = random.Random(seed)
    cluster = Cluster.preset("dgx-h100", 2)
    layers = []
    for i in range(32):
        flops = 2e11 * 20 ** rng.random() * 8
        width = rng.choice((4096, 8192, 16384))
        degrees = (1, *tuple(t for t in (2, 4, 8) if rng.random() < 0.8))
        layers.append(Layer.from_flops(
            flops, (2048, width), "bfloat16", int(rng.uniform(0.2, 3) * GIB),
            int(rng.uniform(0.2, 2) * GIB), cluster=cluster, device_flops=H100_FLOPS,
            degrees=degrees, collectives=2, collective_bytes=2048 * width * 2, split=True,
            name=f"layer{i}"))
    return Model("heterogeneous", tuple(layers), cluster, 32, 80 * GIB)


# ---- the baseline: uniform splits ---------------------------------------------------------


def uniform_counts(layers: int, stages: int) -> list[int]:
    return [layers // stages + (s < layers % stages) for s in range(stages)]


def uniform_trials(model: Model, cache: PlanCache):
    """(label, schedule name, seconds) of every uniform pipeline that fits memory."""
    L, N = len(model.layers), model.cluster.num_devices
    common = set.intersection(*(set(x.degrees) for x in model.layers))
    for t in sorted(common):
        most = min(L, N // t)
        counts = sorted({p for p in (2 ** k for k in range(12)) if p <= most} | {most})
        for p in counts:
            yield from _uniform(model, t, p, cache)


def _uniform(model: Model, t: int, p: int, cache: PlanCache):
    split = all(x.split for x in model.layers)
    names = ["gpipe", "1f1b", "eager-1f1b"] + (["zb-h1"] if split else [])
    for name in names:
        yield _run(model, t, p, 1, name, cache)
    if 2 * p <= len(model.layers) and p > 1 and model.microbatches % p == 0:
        yield _run(model, t, p, 2, "interleaved-1f1b", cache)
    if 2 * p <= len(model.layers) and split:
        yield _run(model, t, p, 2, "zbv", cache)


def _run(model: Model, t: int, ranks: int, v: int, name: str, cache: PlanCache):
    L, m = len(model.layers), model.microbatches
    sched = make_schedule(name, ranks * v, m, stages_per_rank=None if v == 1 else v)
    counts = uniform_counts(L, ranks * v)
    edges = [sum(counts[:s]) for s in range(ranks * v + 1)]
    rank_mesh = [DeviceMesh(list(range(r * t, (r + 1) * t)), ("tp",)) for r in range(ranks)]
    meshes = [rank_mesh[sched.rank_of(s)] for s in range(ranks * v)]
    label = f"uniform TP{t} × {ranks} ranks{' × 2 chunks' if v == 2 else ''}"
    if not _fits(model, sched, edges, t):
        return label, name, math.inf
    layers = model.layers
    boundaries = [Boundary(layers[b - 1].output_shape, layers[b - 1].dtype,
                           Sharding(meshes[s], layers[b - 1].output_spec),
                           Sharding(meshes[s + 1], layers[b].input_spec))
                  for s, b in enumerate(edges[1:-1])]
    costs = {}
    for s in range(ranks * v):
        part = layers[edges[s]:edges[s + 1]]
        for kind, attr in (("F", "forward"), ("B", "backward"), ("I", "input_grad"),
                           ("W", "weight_grad")):
            if getattr(part[0], attr) is not None:
                costs[(s, kind)] = sum(getattr(x, attr)[t] for x in part)
    graph = lower(meshes, boundaries, sched, model.cluster, cache=cache)
    return label, name, simulate(graph, model.cluster, costs).iteration_time


def _fits(model: Model, sched, edges: list[int], t: int) -> bool:
    if model.memory is None:
        return True
    for r in range(sched.num_ranks):
        total = 0.0
        for s in sched.stages_of(r):
            part = model.layers[edges[s]:edges[s + 1]]
            total += (sum(x.params_bytes for x in part) + sched.peak_activations(s) *
                      sum(x.activation_bytes for x in part)) / t
        if total > model.memory:
            return False
    return True


# ---- the table ----------------------------------------------------------------------------


def layout(stages) -> str:
    """``0-5@4 6-11@4 …`` (runs of equal stages folded: ``16 × 6@4``)."""
    parts = [(len(st.layers), st.tp) for st in stages]
    if len(set(parts)) == 1 and len(parts) > 3:
        return f"{len(parts)} × {parts[0][0]}@{parts[0][1]}"
    return " ".join(f"{st.layers.start}-{st.layers.stop - 1}@{st.tp}" for st in stages)


def plan_timed(model: Model, rounds: int):
    """The plan and the median of ``rounds`` planning times (each from scratch)."""
    times, plan = [], None
    for _ in range(rounds):
        t0 = time.perf_counter()
        plan = partition(model.layers, model.cluster, model.microbatches,
                         memory_per_device=model.memory)
        times.append(time.perf_counter() - t0)
    return plan, statistics.median(times), times


def compare(model: Model, rounds: int) -> dict:
    plan, planning, times = plan_timed(model, rounds)
    cache = PlanCache(model.cluster)
    trials = list(uniform_trials(model, cache))
    label, name, base = min(trials, key=lambda x: x[2])
    return {"model": model, "plan": plan, "planning": planning, "times": times,
            "uniform": (label, name, base), "tried": len(trials),
            "fit": sum(math.isfinite(x[2]) for x in trials)}


def table(rows: list[dict]) -> str:
    head = ("| model | layers × devices (hosts) | partition: stages (layers@TP) | schedule | "
            "simulated s | best uniform | schedule | simulated s | uniform ÷ partition | "
            "planning s |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        m, plan = r["model"], r["plan"]
        label, name, base = r["uniform"]
        lines.append(
            f"| {m.name} | {len(m.layers)} × {m.cluster.num_devices} ({m.cluster.num_hosts}) | "
            f"{layout(plan.stages)} | {plan.schedule.name} | {plan.iteration_time:.3f} | "
            f"{label} | {name} | {base:.3f} | **{base / plan.iteration_time:.3f}** | "
            f"{r['planning']:.2f} |")
    return "\n".join(lines)


def details(r: dict) -> str:
    m, plan = r["model"], r["plan"]
    s = plan.search
    return (f"{m.name}: {m.microbatches} microbatches, memory "
            f"{'none' if m.memory is None else f'{m.memory / GIB:.0f} GiB'} per device; "
            f"search {s['runs']} DP runs, {s['cells'] / 1e6:.1f} M cells, gap {s['gap']:.3g}; "
            f"{len(s['finalists'])} finalist schedules simulated; estimate "
            f"{plan.estimate:.3f} s vs simulated {plan.iteration_time:.3f} s; bubble "
            f"{plan.bubble:.1%}, exposed communication {plan.exposed_comm:.1%}; uniform "
            f"pipelines: {r['fit']} of {r['tried']} fit memory; planning times "
            f"{', '.join(f'{t:.2f}' for t in r['times'])} s")


GOALS = {"gpt3": ("96 layers on 64 GPUs", 10.0), "utransformer": ("16 layers on 8 GPUs", 1.0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt3", "utransformer", "hetero"), action="append")
    ap.add_argument("--rounds", type=int, default=3, help="planning runs timed per model")
    args = ap.parse_args(argv)
    chosen = args.model or ["gpt3", "utransformer", "hetero"]
    builders = {"gpt3": gpt3_like, "utransformer": u_transformer_like, "hetero": heterogeneous}
    print(machine_line())
    rows = [compare(builders[key](), args.rounds) for key in chosen]
    print(table(rows))
    print()
    for r in rows:
        print(details(r))
    for key, r in zip(chosen, rows):
        if key in GOALS:
            what, goal = GOALS[key]
            print(f"planning time, {what}: {r['planning']:.2f} s (median of {args.rounds}; "
                  f"goal <= {goal:g} s: {'met' if r['planning'] <= goal else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
