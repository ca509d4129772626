"""Train a toy 4-stage numpy MLP with the overlap runtime on the CPU backend.

The stages sit on meshes of different shapes and shardings (see examples/toy.py), so the stage
boundaries need real multicasts. Two copies of the model train side by side, one per schedule
(1f1b, eager-1f1b), on the same microbatches, taking turns step by step. Every step checks
every loss, every device's gradients and weights against a single-device float64 reference
(to 1e-9 of the reference's magnitude: sums in another order differ in their last bits);
the loss falls. Then it compares the schedules — the median of the steps after the first (the
first plans the boundaries and lowers the step graph), next to how much the steps of one
schedule spread on this machine — writes a Perfetto trace of each schedule's last step into
traces/, and prints the overlap report.

    python examples/toy_pipeline.py                        # a few seconds, links at memory speed
    python examples/toy_pipeline.py --emulate p3.8xlarge   # links as slow as that cluster's
    mpiexec -n 4 python examples/toy_pipeline.py           # one process per host (4 devices)

Under ``mpiexec`` every process runs this same script and drives its own devices; each checks
its devices' gradients and weights, every process gets every loss, and each writes the trace
of its own devices (``toy-<schedule>.rank<r>.json``); rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# One BLAS thread per virtual device: each device's stream is a thread, and several
# multi-threaded BLAS calls at once oversubscribe the cores (8x slower on 2 cores).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toy import ToyMLP, reference_step

from overlap import Runtime
from overlap.world import detect_world
from scheduler import Cluster, estimate, plan_resharding
from scheduler.cli.common import output_dir, positive_float, positive_int

SCHEDULES = ("1f1b", "eager-1f1b")
RTOL = 1e-9  # of the reference's largest magnitude (float64 sums in another order)


@dataclass
class Run:
    """One schedule's model, its float64 reference weights, and what its steps measured."""

    model: ToyMLP
    ref_w: list[np.ndarray]
    losses: list[float] = field(default_factory=list)  # mean loss per row, per step
    seconds: list[float] = field(default_factory=list)
    exposed: list[float] = field(default_factory=list)
    bubble: list[float] = field(default_factory=list)
    trace: Path | None = None
    report: str = ""  # the overlap report of the last step


def emulated_compute(cluster: Cluster, model: ToyMLP, ratio: float):
    """Device time per microbatch: F = ``ratio`` × the slowest boundary transfer, B = 2F."""
    slowest = max(
        estimate(plan_resharding(b.shape, b.dtype, b.producer, b.consumer, cluster), cluster)
        for b in model.boundaries()
    )
    fwd = ratio * slowest
    return (lambda stage, kind: fwd if kind == "F" else 2 * fwd), fwd, slowest


def train_step(rt: Runtime, run: Run, schedule: str, mbs: list[np.ndarray], lr: float) -> None:
    """One SGD step of ``run``'s model, checked against the reference before the update."""
    run.model.zero_grad()
    losses = rt.train_step_sync(run.model.stages(), run.model.boundaries(), mbs,
                                input_sharding=run.model.input_sharding(), schedule=schedule)
    ref_losses, ref_grads = reference_step(run.ref_w, mbs)
    if not np.allclose(losses, ref_losses, rtol=RTOL, atol=0):
        raise AssertionError(f"{schedule} step {len(run.losses)}: losses differ from the "
                             "reference")
    run.model.check_against(run.ref_w, ref_grads, atol=0.0, rtol=RTOL, devices=rt.local_devices)
    # The pipeline's gradients are sums over the batch's rows: the step is lr × their mean.
    step = lr / (len(mbs) * mbs[0].shape[0])
    run.model.sgd(step)
    for w, g in zip(run.ref_w, ref_grads):
        w -= step * g
    stats = rt.last_step
    run.losses.append(float(np.mean(losses)) / mbs[0].shape[0])
    run.seconds.append(stats.seconds)
    run.exposed.append(stats.exposed_comm)
    run.bubble.append(stats.bubble)


def train(args: argparse.Namespace, cluster: Cluster, say: Callable[[str], None]
          ) -> dict[str, Run]:
    """Both schedules, taking turns step by step (a shared machine's load drifts over both)."""
    runs = {}
    for s in SCHEDULES:
        model = ToyMLP.build(cluster, hidden=args.hidden, batch=args.batch, seed=0)
        runs[s] = Run(model, [w.copy() for w in model.full_weights])
    compute_time = None
    if args.emulate:
        compute_time, _, _ = emulated_compute(cluster, runs["1f1b"].model, args.compute_ratio)
    rng = np.random.default_rng(1)
    with Runtime(cluster, emulate_links=args.emulate is not None,
                 compute_time=compute_time) as rt:
        suffix = f".rank{rt.world.rank}" if rt.world.distributed else ""
        for step in range(args.steps):
            mbs = [rng.standard_normal((args.batch, args.hidden))
                   for _ in range(args.microbatches)]
            for s, run in runs.items():
                train_step(rt, run, s, mbs, args.lr)
                if step == args.steps - 1:  # (timeline() covers the last call)
                    run.trace = rt.write_trace(Path(args.trace_dir) / f"toy-{s}{suffix}.json")
                    run.report = rt.timeline().report()
            say(f"  step {step}: mean loss per row {runs['1f1b'].losses[-1]:.6f}  "
                + "  ".join(f"{s} {r.seconds[-1] * 1e3:.1f} ms" for s, r in runs.items())
                + "  (losses, gradients, weights match the reference)")
    return runs


def compare(runs: dict[str, Run], say: Callable[[str], None]) -> None:
    """The schedules side by side: medians of the measured steps, and the machine's noise."""
    first = 1 if len(runs["1f1b"].seconds) > 1 else 0  # step 0 plans and lowers: left out
    n = len(runs["1f1b"].seconds) - first
    say(f"\nschedule    median step ms (of {n})  spread ms      exposed comm  bubble   trace")
    spreads = []
    for s, r in runs.items():
        t = [x * 1e3 for x in r.seconds[first:]]
        med = statistics.median(t)
        spreads.append((max(t) - min(t)) / med)
        say(f"{s:<11} {med:>22.1f}  {min(t):6.1f}–{max(t):<6.1f}"
            f"{statistics.median(r.exposed[first:]):>14.1%}  "
            f"{statistics.median(r.bubble[first:]):>6.1%}   {r.trace}")
    ratio = statistics.median(runs["eager-1f1b"].seconds[first:]) / \
        statistics.median(runs["1f1b"].seconds[first:])
    noise = max(spreads)
    if n < 3:
        verdict = f"{n} measured step(s): too few to tell a difference from noise"
        spread = "noise: unknown; run --steps 5 or more to see it.\n"
    else:
        verdict = ("within the noise: on this machine the two cannot be told apart"
                   if abs(ratio - 1) <= noise / 2 else "faster" if ratio < 1 else "slower")
        spread = (f"noise: the {n} measured steps of one schedule spread over up to "
                  f"{noise:.0%} of their median here (the machine's other load, the "
                  "threads' scheduling).\n")
    say(f"eager-1f1b / 1f1b: {ratio:.2f} × ({verdict}).\n{spread}"
        "eager-1f1b sends each activation as soon as it is made, which pays when transfers "
        "take time: try --emulate p3.8xlarge.")


def even(text: str) -> int:
    value = positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"must be even (stages 1 and 3 split it over 2 "
                                         f"devices), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--emulate", metavar="PRESET", default=None,
                    choices=Cluster.preset_names(),
                    help="emulate the links of this cluster preset "
                         f"({', '.join(Cluster.preset_names())})")
    ap.add_argument("--compute-ratio", type=positive_float, default=2.0,
                    help="with --emulate: a microbatch's forward takes this many times its "
                         "slowest transfer (backward twice that)")
    ap.add_argument("--steps", type=positive_int, default=5,
                    help="SGD steps per schedule (the first is left out of the comparison)")
    ap.add_argument("--microbatches", type=positive_int, default=8,
                    help="microbatches per step")
    ap.add_argument("--batch", type=positive_int, default=2048, help="rows per microbatch")
    ap.add_argument("--hidden", type=even, default=16, help="width of every layer (even)")
    ap.add_argument("--lr", type=positive_float, default=0.3,
                    help="SGD learning rate, on the gradient's mean over the batch's rows")
    ap.add_argument("--trace-dir", type=output_dir, default="traces",
                    help="where the traces are written")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cluster = Cluster.preset(args.emulate or "p3.8xlarge", 4)
    rank = detect_world().rank

    def say(text: str) -> None:  # once per job: from the first process of a multi-process run
        if rank == 0:
            print(text, flush=True)

    say(f"toy pipeline: 4 stages, {args.microbatches} microbatches of {args.batch} × "
        f"{args.hidden} float64, {args.steps} SGD steps per schedule, links "
        f"{'emulated as ' + args.emulate if args.emulate else 'at memory speed'}")
    if args.emulate:
        _, fwd, slowest = emulated_compute(
            cluster, ToyMLP.build(cluster, hidden=args.hidden, batch=args.batch),
            args.compute_ratio)
        say(f"emulated device time per microbatch: F {fwd * 1e3:.2f} ms, B "
            f"{2 * fwd * 1e3:.2f} ms; slowest boundary transfer {slowest * 1e3:.2f} ms")
    runs = train(args, cluster, say)
    losses = runs["1f1b"].losses
    say(f"\nmean loss per row: {losses[0]:.4f} at step 0, {losses[-1]:.4f} at step "
        f"{len(losses) - 1} (the same for both schedules, as in the reference)")
    say("\noverlap report (eager-1f1b, last step):")
    say(runs["eager-1f1b"].report)
    compare(runs, say)
    say("\nview a trace: open https://ui.perfetto.dev and drop the file in; "
        "or run: overlap trace report " + str(runs["eager-1f1b"].trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
