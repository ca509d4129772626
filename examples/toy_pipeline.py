"""Train a toy 4-stage numpy MLP with the overlap runtime on the CPU backend.

The stages sit on meshes of different shapes and shardings (see examples/toy.py), so the stage
boundaries need real multicasts. For each schedule (1f1b, eager-1f1b) it trains a few SGD steps
and checks every loss, every device's gradients and weights against a single-device float64
reference (to 1e-10), writes a Perfetto trace of the last step into traces/, and prints the
overlap report.

    python examples/toy_pipeline.py                        # fast, links at memory speed
    python examples/toy_pipeline.py --emulate p3.8xlarge   # links as slow as that cluster's
    mpiexec -n 4 python examples/toy_pipeline.py           # one process per host (4 devices)

Under ``mpiexec`` every process runs this same script and drives its own devices; each checks
its devices' gradients and weights, every process gets every loss, and each writes the trace
of its own devices (``toy-<schedule>.rank<r>.json``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# One BLAS thread per virtual device: each device's stream is a thread, and several
# multi-threaded BLAS calls at once oversubscribe the cores (8x slower on 2 cores).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toy import ToyMLP, reference_step

from overlap import Runtime
from overlap.world import detect_world
from scheduler import Cluster, estimate
from scheduler.cli_common import output_dir, positive_float, positive_int


def emulated_compute(cluster: Cluster, model: ToyMLP, ratio: float):
    """Device time per microbatch: F = ``ratio`` × the slowest boundary transfer, B = 2F."""
    from scheduler import plan_resharding

    slowest = max(
        estimate(plan_resharding(b.shape, b.dtype, b.producer, b.consumer, cluster), cluster)
        for b in model.boundaries()
    )
    fwd = ratio * slowest
    return (lambda stage, kind: fwd if kind == "F" else 2 * fwd), fwd, slowest


def train(schedule: str, args: argparse.Namespace, cluster: Cluster) -> dict:
    model = ToyMLP.build(cluster, hidden=args.hidden, batch=args.batch, seed=0)
    ref_w = [w.copy() for w in model.full_weights]
    rng = np.random.default_rng(1)
    report = {}
    compute_time = None
    if args.emulate:
        compute_time, _, _ = emulated_compute(cluster, model, args.compute_ratio)
    with Runtime(cluster, emulate_links=args.emulate is not None,
                 compute_time=compute_time) as rt:
        for step in range(args.steps):
            mbs = [rng.standard_normal((args.batch, args.hidden))
                   for _ in range(args.microbatches)]
            model.zero_grad()
            t0 = time.perf_counter()
            losses = rt.train_step_sync(model.stages(), model.boundaries(), mbs,
                                        input_sharding=model.input_sharding(),
                                        schedule=schedule)
            seconds = time.perf_counter() - t0
            ref_losses, ref_grads = reference_step(ref_w, mbs)
            if not np.allclose(losses, ref_losses, rtol=0, atol=1e-10):
                raise AssertionError(f"{schedule} step {step}: losses differ from the reference")
            model.check_against(ref_w, ref_grads, devices=rt.local_devices)  # before the update
            model.sgd(args.lr)
            for w, g in zip(ref_w, ref_grads):
                w -= args.lr * g
            say(f"  {schedule:<10} step {step}: mean loss {np.mean(losses):.6f}  "
                f"({seconds * 1e3:.1f} ms; losses and gradients match the reference)")
        tl = rt.timeline()
        suffix = f".rank{rt.world.rank}" if rt.world.distributed else ""
        trace = rt.write_trace(Path(args.trace_dir) / f"toy-{schedule}{suffix}.json")
        report = {"step_ms": seconds * 1e3, "exposed": tl.exposed_comm_fraction,
                  "bubble": tl.bubble_fraction, "trace": trace, "timeline": tl}
    return report


def say(text: str) -> None:
    """Print once per job: from the first process of a multi-process run."""
    if RANK == 0:
        print(text, flush=True)


RANK = 0


def main(argv: list[str] | None = None) -> int:
    global RANK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emulate", metavar="PRESET", default=None,
                    help="emulate the links of this cluster preset (e.g. p3.8xlarge)")
    ap.add_argument("--compute-ratio", type=positive_float, default=2.0,
                    help="with --emulate: a microbatch's forward takes this many times its "
                         "slowest transfer (backward twice that)")
    ap.add_argument("--steps", type=positive_int, default=3)
    ap.add_argument("--microbatches", type=positive_int, default=8)
    ap.add_argument("--batch", type=positive_int, default=16384)
    ap.add_argument("--hidden", type=positive_int, default=16)
    ap.add_argument("--lr", type=positive_float, default=1e-4)
    ap.add_argument("--trace-dir", type=output_dir, default="traces")
    args = ap.parse_args(argv)
    cluster = Cluster.preset(args.emulate or "p3.8xlarge", 4)
    RANK = detect_world().rank
    say(f"toy pipeline: 4 stages, {args.microbatches} microbatches of {args.batch} × "
          f"{args.hidden} float64, {args.steps} SGD steps, links "
          f"{'emulated as ' + args.emulate if args.emulate else 'at memory speed'}")
    if args.emulate:
        _, fwd, slowest = emulated_compute(
            cluster, ToyMLP.build(cluster, hidden=args.hidden, batch=args.batch),
            args.compute_ratio)
        say(f"emulated device time per microbatch: F {fwd * 1e3:.2f} ms, B "
              f"{2 * fwd * 1e3:.2f} ms; slowest boundary transfer {slowest * 1e3:.2f} ms")
    results = {s: train(s, args, cluster) for s in ("1f1b", "eager-1f1b")}
    say("\nschedule     last step ms  exposed comm  bubble   trace"
        + ("  (this rank's devices)" if RANK else ""))
    for s, r in results.items():
        say(f"{s:<12} {r['step_ms']:>12.1f}  {r['exposed']:>12.1%}  {r['bubble']:>6.1%}   "
              f"{r['trace']}")
    say("\noverlap report (eager-1f1b, last step):")
    say(results["eager-1f1b"]["timeline"].report())
    say("\nview a trace: open https://ui.perfetto.dev and drop the file in; "
          "or run: overlap trace report " + str(results["eager-1f1b"]["trace"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
