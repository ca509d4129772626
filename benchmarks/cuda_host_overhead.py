"""The CUDA device kind's host cost per op against the CPU backend's (not a test).

On this machine the CUDA kind runs on the CuPy stand-in (``tests/fake_cupy.py``) with device
work free (events complete as they are recorded): what is left is the host's — the launch
path from the event loop through the stream threads, records, waits, DLPack-free buffers —
which on a GPU sits between a stage's kernel launches. Both backends run the same 4-stage
pipeline of no-op stage functions (each returns its input), alternating step by step.

Per op: the step's seconds over its ops, medians. Also per step: the threads the process
has (``threading.active_count``), and the voluntary context switches of the process (a
thread that blocked: each is a sleep and a wake-up).

    python benchmarks/cuda_host_overhead.py            # goal: cuda / cpu <= 1.0
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def use_stand_in(latency_s: float = 0.0) -> Any:
    import fake_cupy

    sys.modules["cupy"] = fake_cupy
    sys.modules["cupy.cuda"] = fake_cupy.cuda
    sys.modules["cupy.cuda.nccl"] = fake_cupy.nccl
    # 0: device work is free, only the host's cost is left; more: every event completes
    # that long after its record, as a GPU that runs behind the host.
    fake_cupy.EVENT_LATENCY_S = latency_s
    return fake_cupy


def runner(backend: str, stages: int, microbatches: int, rows: int, schedule: str,
           poll_s: float | None = None) -> Any:
    """(step(), runtime, ops per step) of a pipeline of no-op stages on ``backend``."""
    from overlap import Runtime, Stage
    from scheduler import Boundary, Cluster, DeviceMesh, P, Sharding

    cluster = Cluster(stages, 1, nic_gbps=400.0)
    meshes = [DeviceMesh([[d]], ("host", "gpu")) for d in range(stages)]
    rt = Runtime(cluster, backend=backend)
    if poll_s is not None:  # (an A/B of the device kind's look-before-sleeping budget)
        rt.backend.devices.poll_s = poll_s
    xp = rt.backend.xp
    shape = (rows, 8)
    grad = xp.zeros(shape, xp.float32)

    def forward(s: int) -> Any:
        last = s == stages - 1
        return lambda ctx, x: (x.ravel()[:1].sum() * 0) if last else x

    def backward(s: int) -> Any:
        return lambda ctx, dy: None if s == 0 else (grad if dy is None else dy)

    st = [Stage(m, forward(s), backward(s)) for s, m in enumerate(meshes)]
    bounds = [Boundary(shape, "float32", Sharding(meshes[s], P()), Sharding(meshes[s + 1], P()))
              for s in range(stages - 1)]
    mbs = [xp.zeros(shape, xp.float32) for _ in range(microbatches)]

    def step() -> None:
        rt.train_step_sync(st, bounds, mbs, input_sharding=Sharding(meshes[0], P()),
                           schedule=schedule)

    step()  # warm: plans, graph, threads
    return step, rt, len(rt.timeline().spans) if rt.last_step is not None else 0


def measure(steps: int, stages: int, microbatches: int, schedule: str,
            variants: dict[str, tuple[str, float | None]]) -> dict[str, Any]:
    """Each variant (name: (backend, poll budget or None for the kind's)), alternating."""
    out: dict[str, Any] = {}
    runs = {}
    threads: dict[str, int] = {}
    for name, (backend, poll) in variants.items():
        before = threading.active_count()
        runs[name] = runner(backend, stages, microbatches, 4, schedule, poll)
        threads[name] = threading.active_count() - before
    times: dict[str, list[float]] = {b: [] for b in runs}
    switches: dict[str, list[int]] = {b: [] for b in runs}
    cpu: dict[str, list[float]] = {b: [] for b in runs}
    try:
        for _ in range(steps):
            for b, (step, _, ops) in runs.items():
                before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                times[b].append((time.perf_counter() - t0) / max(ops, 1))
                cpu[b].append((time.process_time() - c0) / max(ops, 1))
                switches[b].append(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before)
        for b, (_, _, ops) in runs.items():
            out[b] = {"op_us": statistics.median(times[b]) * 1e6, "ops": ops,
                      "cpu_us": statistics.median(cpu[b]) * 1e6,
                      "switches": statistics.median(switches[b]), "threads": threads[b]}
    finally:
        for _, rt, _ in runs.values():
            rt.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--latency-ms", type=float, default=0.0,
                    help="each event completes this long after its record (a GPU behind "
                         "the host); default 0: device work free")
    ap.add_argument("--poll-us", type=float, action="append", default=[],
                    help="also the CUDA kind with this look-before-sleeping budget (µs)")
    args = ap.parse_args(argv)
    from scheduler.cli.common import line_buffered_stdout, machine_line

    line_buffered_stdout()
    use_stand_in(args.latency_ms * 1e-3)
    print(f"{machine_line()}; CuPy stand-in, events complete {args.latency_ms:g} ms after "
          f"their record; {time.strftime('%Y-%m-%d %H:%M')}")
    variants: dict[str, tuple[str, float | None]] = {"cpu": ("cpu", None),
                                                      "cuda": ("cuda", None)}
    for us in args.poll_us:
        variants[f"cuda, look {us:g} µs"] = ("cuda", us * 1e-6)
    r = measure(args.steps, args.stages, args.microbatches, args.schedule, variants)
    print(f"{args.stages} stages x {args.microbatches} microbatches, {args.schedule}, "
          f"{r['cpu']['ops']} ops per step; medians of {args.steps} steps, alternating")
    print(f"{'variant':<20} {'host µs/op':>11} {'/ cpu':>7} {'CPU µs/op':>10} {'/ cpu':>7} "
          f"{'sleeps/step':>12} {'threads':>8}")
    for name in variants:
        print(f"{name:<20} {r[name]['op_us']:>11.1f} {r[name]['op_us'] / r['cpu']['op_us']:>7.2f}"
              f" {r[name]['cpu_us']:>10.1f} {r[name]['cpu_us'] / r['cpu']['cpu_us']:>7.2f}"
              f" {r[name]['switches']:>12.0f} {r[name]['threads']:>8}")
    ratio = r["cuda"]["op_us"] / r["cpu"]["op_us"]
    print(f"cuda / cpu host cost per op: {ratio:.2f} x (goal <= 1.0: "
          f"{'met' if ratio <= 1.0 else 'NOT met'}); sleeps: voluntary context switches of "
          "the process during a step; threads: what each runtime started")
    return 0


if __name__ == "__main__":
    sys.exit(main())
