"""End-to-end pipeline simulation benchmark (not a test): schedules × resharding strategies.

Two paper-like setups on p3.8xlarge clusters (one stage = one host = 4 V100), compute times
from FLOPs at a stated device rate, simulated with the project's cost model:

- GPT-3-like: hidden 8192, sequence 1024, 96 layers over 16 stages (6 per stage), microbatch
  of one sequence, fp16; inside a stage tensor parallelism leaves the activation replicated on
  the 4 GPUs, and the next stage needs it replicated too.
- U-Transformer-like: 2 stages, large skip activations (8 × 128 × 128 × 256 fp16 = 64 MiB per
  microbatch) sharded by batch over the producer's GPUs and needed whole by every GPU of the
  consumer: resharding heavy.

Rows: send_recv + 1f1b (the Alpa baseline), broadcast + 1f1b, broadcast + eager-1f1b, and
signal (eager-1f1b with every transfer costing only its latency: the paper's upper bound).
Every ratio is computed in this run. Also: the simulator's wall time for 64 stages × 256
microbatches next to a bare ``heapq`` event loop over the same number of events (each op's
start and end) in the same run.

    python benchmarks/schedule_sim.py
"""

from __future__ import annotations

import heapq
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler import (
    Boundary,
    Cluster,
    P,
    PlanCache,
    PlanOptions,
    Sharding,
    auto_schedule,
    estimate,
    lower,
    make_schedule,
    plan_resharding,
    simulate,
)
from scheduler.cli.common import line_buffered_stdout, machine_line

# V100: 125 TFLOP/s fp16 tensor-core peak; we assume 30 % of it end to end.
GPU_FLOPS = 125e12 * 0.30
GPUS_PER_STAGE = 4


@dataclass(frozen=True)
class Setup:
    name: str
    stages: int
    microbatches: int
    shape: tuple[int, ...]
    producer: P
    consumer: P
    fwd_flops: float  # per stage per microbatch
    dtype: str = "float16"

    @property
    def fwd_s(self) -> float:
        return self.fwd_flops / (GPU_FLOPS * GPUS_PER_STAGE)

    @property
    def bwd_s(self) -> float:
        return 2 * self.fwd_s


def gpt3_like() -> Setup:
    h, s, layers_per_stage = 8192, 1024, 6
    per_token_layer = 24 * h * h * (1 + s / (6 * h))  # Megatron-LM's FLOP count
    return Setup("GPT-3-like", 16, 64, (s, h), P(), P(),
                 fwd_flops=per_token_layer * s * layers_per_stage)


def u_transformer_like() -> Setup:
    return Setup("U-Transformer-like", 2, 16, (8, 128, 128, 256), P("gpu"), P(),
                 fwd_flops=1.2e13)


def pipeline(setup: Setup):
    cluster = Cluster.preset("p3.8xlarge", setup.stages)
    stages = [cluster.mesh([h]) for h in range(setup.stages)]
    boundaries = [
        Boundary(setup.shape, setup.dtype, Sharding(stages[s], setup.producer),
                 Sharding(stages[s + 1], setup.consumer))
        for s in range(setup.stages - 1)
    ]
    return cluster, stages, boundaries


def run_setup(setup: Setup) -> tuple[str, bool]:
    cluster, stages, boundaries = pipeline(setup)
    costs = {"F": setup.fwd_s, "B": setup.bwd_s}
    cache = PlanCache(cluster)
    rows = []
    for label, strategy, sched, signal in (
        ("send_recv + 1f1b", "send_recv", "1f1b", False),
        ("broadcast + 1f1b", "broadcast", "1f1b", False),
        ("broadcast + eager-1f1b", "broadcast", "eager-1f1b", False),
        ("signal (eager-1f1b)", "broadcast", "eager-1f1b", True),
    ):
        schedule = make_schedule(sched, setup.stages, setup.microbatches)
        graph = lower(stages, boundaries, schedule, cluster, PlanOptions(strategy=strategy),
                      cache=cache)
        t0 = time.perf_counter()
        tl = simulate(graph, cluster, costs, signal=signal)
        rows.append((label, tl, time.perf_counter() - t0))
    xfer = {
        strategy: estimate(plan_resharding(setup.shape, setup.dtype, boundaries[0].producer,
                                           boundaries[0].consumer, cluster,
                                           PlanOptions(strategy=strategy)), cluster)
        for strategy in ("send_recv", "broadcast")
    }
    base = rows[0][1].iteration_time
    signal_t = rows[-1][1].iteration_time
    lines = [
        f"== {setup.name}: {setup.stages} stages × {setup.microbatches} microbatches, "
        f"boundary {setup.shape} {setup.dtype} {setup.producer!r} -> {setup.consumer!r} ==",
        f"per microbatch: F {setup.fwd_s * 1e3:.1f} ms, B {setup.bwd_s * 1e3:.1f} ms; "
        f"activation transfer {xfer['broadcast'] * 1e3:.1f} ms (broadcast), "
        f"{xfer['send_recv'] * 1e3:.1f} ms (send_recv)",
        f"{'row':<24}{'iteration s':>12}{'/ signal':>10}{'waited comm':>14}{'bubble':>9}"
        f"{'throughput vs send_recv+1f1b':>31}{'sim s':>8}",
    ]
    for label, tl, secs in rows:
        lines.append(
            f"{label:<24}{tl.iteration_time:>12.3f}{tl.iteration_time / signal_t:>10.3f}"
            f"{tl.transfer_wait_fraction:>14.1%}{tl.bubble_fraction:>9.1%}"
            f"{base / tl.iteration_time - 1:>+31.1%}{secs:>8.2f}"
        )
    eager = rows[2][1].iteration_time
    applies = xfer["broadcast"] <= setup.fwd_s
    ok = eager <= 1.05 * signal_t
    lines.append(
        f"target broadcast+eager-1f1b <= 1.05 × signal when transfer <= compute "
        f"({'applies' if applies else 'does not apply'}): {eager / signal_t:.3f} -> "
        f"{'met' if ok else 'NOT met'}"
    )
    return "\n".join(lines), ok or not applies


def schedule_strategy_table(setup: Setup) -> str:
    """Each schedule × {send_recv, broadcast, signal}: iteration, bubble, the compute streams'
    waits for forward and backward transfers (shares of the iteration, mean over devices;
    ``Timeline.wait_fraction``), peak activations
    (largest stage). The split schedules take I = W = F (B = 2F); auto is chosen per
    strategy (its signal row: broadcast's choice with latency-only transfers)."""
    cluster, stages, boundaries = pipeline(setup)
    costs = {"F": setup.fwd_s, "B": setup.bwd_s, "I": setup.fwd_s, "W": setup.fwd_s}
    cache = PlanCache(cluster)
    p, m = setup.stages, setup.microbatches
    lines = [f"== {setup.name}: {p} stages × {m} microbatches; F {setup.fwd_s * 1e3:.1f} ms, "
             f"I = W = F ==",
             f"{'schedule':<28}{'strategy':<11}{'iteration s':>12}{'bubble':>8}"
             f"{'wait fwd':>10}{'wait bwd':>10}{'peak act.':>10}{'/ signal':>10}"]
    for name in ("1f1b", "eager-1f1b", "zb-h1", "auto"):
        signal_t = None
        for strategy in ("signal", "broadcast", "send_recv"):
            options = PlanOptions(strategy="broadcast" if strategy == "signal" else strategy)
            if name == "auto":
                choice = auto_schedule(stages, boundaries, m, cluster, costs, options,
                                       cache=cache)
                sched, graph = choice.schedule, choice.graph
            else:
                sched = make_schedule(name, p, m)
                graph = lower(stages, boundaries, sched, cluster, options, cache=cache)
            tl = simulate(graph, cluster, costs, signal=strategy == "signal")
            signal_t = signal_t or tl.iteration_time
            label = sched.name if name == "auto" else name
            peak = max(sched.peak_activations(s) for s in range(p))
            lines.append(f"{label:<28}{strategy:<11}{tl.iteration_time:>12.3f}"
                         f"{tl.bubble_fraction:>8.1%}{tl.wait_fraction('fwd'):>10.2%}"
                         f"{tl.wait_fraction('bwd'):>10.2%}{peak:>10}"
                         f"{tl.iteration_time / signal_t:>10.3f}")
    return "\n".join(lines)


def bare_loop(events: int, width: int) -> float:
    """Seconds for a bare ``heapq`` event loop: ``events`` times, pop the earliest (time,
    priority, count, payload) entry and push its successor, over a heap of ``width`` pending
    entries (as many as the simulated pipeline has lanes) — the least any event kernel does."""
    heap = [(i * 1e-6, 0, i, i) for i in range(width)]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    t0 = time.perf_counter()
    for count in range(width, width + events):
        t, _, _, payload = pop(heap)
        push(heap, (t + 1e-3, 0, count, payload))
    return time.perf_counter() - t0


def sim_speed(stages: int = 64, microbatches: int = 256, rounds: int = 3) -> str:
    cluster = Cluster.preset("p3.8xlarge", stages)
    meshes = [cluster.mesh([h]) for h in range(stages)]
    boundaries = [Boundary((1024, 8192), "float16", Sharding(meshes[s], P(None, "gpu")),
                           Sharding(meshes[s + 1], P(None, "gpu")))
                  for s in range(stages - 1)]
    t0 = time.perf_counter()
    graph = lower(meshes, boundaries, make_schedule("eager-1f1b", stages, microbatches),
                  cluster)
    lowered = time.perf_counter() - t0
    events = 2 * len(graph.ops)  # every op starts and ends
    sims, bares, metrics = [], [], []
    for _ in range(rounds):  # in turns, so the shared machine's load drifts over both
        t0 = time.perf_counter()
        tl = simulate(graph, cluster, {"F": 0.010, "B": 0.020})
        tl.iteration_time  # noqa: B018 - what a caller asks first
        sims.append(time.perf_counter() - t0)
        bares.append(bare_loop(events, len(graph.lanes)))
        t0 = time.perf_counter()
        tl.bubble_fraction, tl.exposed_comm_fraction  # noqa: B018 - spans, then metrics
        metrics.append(time.perf_counter() - t0)
    sim, bare, spans = (statistics.median(x) for x in (sims, bares, metrics))
    ratio = sim / bare
    return (f"== simulator speed: {stages} stages × {microbatches} microbatches (eager-1f1b, "
            f"{len(graph.devices)} devices, {len(graph.ops)} ops, {len(tl.spans)} spans) ==\n"
            f"lower {lowered:.2f} s (plans 126 reshardings, builds the graph)\n"
            f"simulate {sim:.2f} s (median of {rounds}) vs a bare heapq loop over the same "
            f"{events} events {bare:.2f} s: {ratio:.1f}x (target <= 4x: "
            f"{'met' if ratio <= 4 else 'NOT met'})\n"
            f"then the spans and every metric, on first use: {spans:.2f} s more")


def compute_only_table() -> str:
    """Each schedule run with free communication, F = I = W = 1 (B = 2): bubble (idle
    time per rank) and peak activations, against 1f1b in the same run."""
    from scheduler import compute_only_time, make_schedule

    unit = {"F": 1.0, "I": 1.0, "W": 1.0}
    lines = ["compute-only schedules, F = I = W = 1 (B = 2), free communication",
             f"{'p':>3} {'m':>4} {'schedule':<18} {'makespan':>9} {'bubble/rank':>12} "
             f"{'vs 1f1b':>8} {'peak act.':>10}"]
    for p, m in ((4, 8), (4, 32), (8, 16), (8, 64)):
        base = compute_only_time(make_schedule("1f1b", p, m), unit)[0] - 3 * m
        for name in ("1f1b", "eager-1f1b", "zb-h1"):
            sched = make_schedule(name, p, m)
            span = compute_only_time(sched, unit)[0]
            peak = max(sched.peak_activations(s) for s in range(p))
            lines.append(f"{p:>3} {m:>4} {name:<18} {span:>9.0f} {span - 3 * m:>12.0f} "
                         f"{(span - 3 * m) / base:>8.2f} {peak:>10}")
        # interleaved: 2 stages per rank, each half the work of a 1f1b stage
        sched = make_schedule("interleaved-1f1b", 2 * p, m)
        span = compute_only_time(sched, {"F": 0.5, "B": 1.0})[0]
        peak = max(sched.peak_rank_activations(r) for r in range(p)) / 2  # half-size stages
        lines.append(f"{p:>3} {m:>4} {'interleaved-1f1b':<18} {span:>9.1f} "
                     f"{span - 3 * m:>12.1f} {(span - 3 * m) / base:>8.2f} {peak:>10}")
        # zbv: 2 half-size stages per rank in a V, the backward split
        sched = make_schedule("zbv", 2 * p, m)
        span = compute_only_time(sched, {"F": 0.5, "I": 0.5, "W": 0.5})[0]
        peak = max(sched.peak_rank_activations(r) for r in range(p)) / 2
        lines.append(f"{p:>3} {m:>4} {'zbv':<18} {span:>9.1f} "
                     f"{span - 3 * m:>12.1f} {(span - 3 * m) / base:>8.2f} {peak:>10}")
    return "\n".join(lines)


def main() -> int:
    line_buffered_stdout()
    print(machine_line())
    print(compute_only_table())
    print()
    print(f"compute: {GPU_FLOPS / 1e12:.1f} TFLOP/s per V100 (30 % of fp16 peak), "
          f"{GPUS_PER_STAGE} GPUs per stage\n")
    for setup in (gpt3_like(), u_transformer_like()):
        text, _ = run_setup(setup)
        print(text)
        print()
    for setup in (gpt3_like(), u_transformer_like()):
        print(schedule_strategy_table(setup))
        print()
    print(sim_speed())
    return 0


if __name__ == "__main__":
    sys.exit(main())
