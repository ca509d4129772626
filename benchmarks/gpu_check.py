"""One GPU check (not a test): the CUDA backend's tests and measurements, in a few minutes.

Run on the GPU machine from the repository root, without installing the project. Its Python
has CuPy, NumPy, uvloop and pytest but not nvtx or pytest-asyncio; fetch those as wheels here
first (on a machine with the package registry)::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl nvtx pytest-asyncio

then on the device (carry ``.whl``)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \\
      && PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py

What it does (each part logs to ``$OUT/gpu_check.log`` when ``OUT`` is set):

1. the GPU tests: ``pytest tests/test_cuda_backend.py`` (they skip everywhere else);
2. device-to-device copy bandwidth (the peak, measured with CUDA events in this run) and a
   loopback transfer through the backend between two virtual devices on the GPU — **target:
   transfers ≥ 80 % of the peak**;
3. pack/unpack of a non-contiguous region (CuPy strided copies), GB/s;
4. asyncio completion: how late the loop sees a 1 ms kernel end — the CUDA device kind's
   completion waiters (its threads sleeping in ``synchronize()`` on blocking-sync events:
   ``CudaDevices.device_wait``, what a call's wait for its lanes' ends runs) vs polling
   ``Event.done`` with backoff (what it did before) vs a host callback
   (``Stream.launch_host_func`` waking the loop), µs per awaited event, on the loop the
   runtime's ``*_sync`` calls run on here (``overlap.sync_loop.new_loop``);
5. a 4-stage pipeline on one GPU (4 virtual stages), compute made of one-thread kernels that
   run for a set time (so the four stages run side by side like four GPUs instead of
   competing for one's SMs), F = 16 × a microbatch's transfer (one memory carries all the
   transfers, and the host must launch ahead of the GPU), B = 2 × F: step time for signal
   (1-element boundaries, same compute), 1f1b and eager-1f1b, and exposed communication
   from the CUDA-event trace — **target: eager-1f1b ≤ 1.05 × signal**; the eager-1f1b
   trace goes to ``$OUT/gpu_pipeline.json``;
6. a 1f1b step of that pipeline recorded by the PyTorch profiler (``overlap.torch.profiler``):
   the exposed communication ``overlap trace report`` finds in its trace against the runtime's
   own CUDA-event trace of the same step — **target: within 10 %**; the runtime's trace of
   that step goes to ``$OUT/gpu_1f1b_events.json``, the profiler's to
   ``$OUT/gpu_torch_profile.json.gz``;
7. ``examples/gpt_pipeline.py`` in bfloat16 on the GPU (4 virtual stages, loopback): its
   self-check against plain torch on the same GPU, tokens/s and exposed communication;
8. the pipeline against plain torch (``benchmarks/vs_plain_torch.py``): GPT stages in
   bfloat16, 4 virtual stages of the one GPU at widths 256, 1024 and 4096 under 1f1b,
   eager-1f1b, gpipe and zb-h1, and a one-stage pipeline at widths 256 and 1024, each as a
   ratio to the same stages run as plain torch in the same run — **targets: one stage
   ≤ 1.05 ×; 4 stages ≤ 1.15 × at width 256, ≤ 1.05 × at 1024, ≤ 1.02 × at 4096**.

It prints a short table last. Each section runs on its own: one that fails or hangs (the
test run is bounded) is reported as such and the others still run; each section's result
is appended to ``$OUT/gpu_check.log`` as soon as it is known, so a late hang loses nothing
measured earlier. Device work is timed with CUDA events — a backend call between two events
recorded on the caller's stream (the runtime orders the caller's stream before and after its
calls), so host launch is not counted as transfer time.

``python benchmarks/gpu_check.py --self-test`` runs the whole script on this CPU machine on
the CuPy stand-in (tests/fake_cupy.py) with small sizes, so that a GPU run cannot die on a
script error (CI runs it; its numbers mean nothing).
"""

from __future__ import annotations

import asyncio
import functools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
SELF = False  # --self-test: on the CuPy stand-in
_log_lines: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)
    _log_lines.append(msg)
    if OUT is not None:
        (OUT / "gpu_check.log").write_text("\n".join(_log_lines) + "\n")


def timed(cp, fn, repeat: int = 5) -> float:
    """Median seconds of fn() on the current stream, measured with CUDA events."""
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return statistics.median(times)


SIZES = {"copy_elems": 1024 * 2**20, "pack_side": 8192, "rows": 16384, "cols": 16384,
         "microbatches": 16, "latency_rounds": 200, "latency_kernel_s": 1e-3,
         "test_timeout_s": 240}
SELF_TEST = {"copy_elems": 4096, "pack_side": 64, "rows": 64, "cols": 32, "microbatches": 4,
             "latency_rounds": 5, "latency_kernel_s": 1e-3, "test_timeout_s": 120}

# A kernel of one thread that runs for a given time (the GPU's global nanosecond timer): the
# pipeline's "compute". Four virtual stages share one GPU here; matmuls would compete for its
# SMs and bandwidth (on 2026-11-30 each ran ~2x slower beside the others), so a step measured
# the GPU's throughput, not the schedule. One-thread kernels run side by side like four GPUs.
SPIN_SRC = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
"""


def spinner(cp):
    """``spin(seconds)``: occupy the current stream for that long with one GPU thread (on the
    stand-in, nothing: there is no device to occupy)."""
    if SELF:
        return lambda seconds: None
    import numpy as np

    kernel = cp.RawKernel(SPIN_SRC, "spin")
    return lambda seconds: kernel((1,), (1,), (np.uint64(int(seconds * 1e9)),))


def run_tests() -> str:
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs",
                               "tests/test_cuda_backend.py"], cwd=ROOT, capture_output=True,
                              text=True, timeout=SIZES["test_timeout_s"])
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"")[-3000:]
        log(out.decode(errors="replace") if isinstance(out, bytes) else str(out))
        return f"FAILED: the tests did not finish within {SIZES['test_timeout_s']} s"
    log(proc.stdout[-3000:] + proc.stderr[-2000:])
    last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return f"{'ok' if proc.returncode == 0 else 'FAILED'}: {last}"


def device_timed(cp, call, repeat: int = 5) -> float:
    """Median seconds of the device work ``call()`` launches, between two CUDA events on the
    caller's stream (a runtime call orders the caller's stream before and after its work)."""
    call()  # warm-up: threads, streams, pools
    times = []
    stream = cp.cuda.get_current_stream()
    for _ in range(repeat):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        call()
        b.record(stream)
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return statistics.median(times)


def bandwidth(cp) -> dict[str, float]:
    from overlap import Runtime
    from scheduler import Cluster, DeviceMesh, P, Sharding, plan_resharding

    # float32 elements: 4 GiB, a 2 ms copy (the call's fixed overhead, reported apart, is
    # then a small part of it).
    n = SIZES["copy_elems"]
    src = cp.arange(n, dtype=cp.float32)
    dst = cp.empty_like(src)
    peak = 2 * src.nbytes / timed(cp, lambda: dst.__setitem__(Ellipsis, src))  # read + write
    # The backend: a broadcast of the same bytes between virtual devices 0 and 1 (one GPU).
    cluster = Cluster(2, 1, nic_gbps=400.0)
    a, b = DeviceMesh([[0]], ("host", "gpu")), DeviceMesh([[1]], ("host", "gpu"))
    plan = plan_resharding((n,), "float32", Sharding(a, P()), Sharding(b, P()), cluster)
    with Runtime(cluster, backend="cuda") as rt:
        shards = {0: src}
        out = {1: cp.empty_like(src)}  # reused: the call allocates nothing
        seconds = device_timed(cp, lambda: rt.reshard_sync(plan, shards, out=out))
        assert bool((out[1][:1000] == src[:1000]).all())
        # The call's fixed cost (launch, completion, return): the same call moving 4 bytes.
        tiny = plan_resharding((1,), "float32", Sharding(a, P()), Sharding(b, P()), cluster)
        one = {0: src[:1]}
        tiny_out = {1: cp.empty(1, cp.float32)}
        fixed = device_timed(cp, lambda: rt.reshard_sync(tiny, one, out=tiny_out))
    # A transfer reads the root's buffer and writes the receiver's: 2 × bytes of traffic,
    # timed on the device like the peak: end to end, and net of the call's fixed cost.
    transfer = 2 * src.nbytes / seconds
    net = 2 * src.nbytes / max(seconds - fixed, 1e-9)
    # Pack / unpack: a strided half of a 2-d array to a contiguous buffer and back.
    side = SIZES["pack_side"]
    m = cp.arange(side * side, dtype=cp.float32).reshape(side, side)
    region = m[:, side // 8:side // 8 + side // 2]
    packed = cp.empty(region.shape, cp.float32)
    pack = 2 * region.nbytes / timed(cp, lambda: packed.__setitem__(Ellipsis, region))
    unpack = 2 * region.nbytes / timed(cp, lambda: region.__setitem__(Ellipsis, packed))
    return {"peak": peak, "transfer": transfer, "net": net, "pack": pack, "unpack": unpack,
            "call_us": fixed * 1e6, "gib": src.nbytes / 2**30}


def completion_latency(cp) -> dict[str, Any]:
    """µs from the end of a ~1 ms kernel to the awaiting coroutine resuming (the wait's wall
    time less the kernel's own, from CUDA events): the CUDA device kind's completion waiters
    (``CudaDevices.device_wait`` on an event as a stream's record leaves it: what a call
    awaits for its lanes' ends) against polling ``Event.done`` with backoff (what it did
    before, under uvloop's 1 ms timers) and a host callback (``Stream.launch_host_func``).
    Also names the loop they ran on (``loop``)."""
    from overlap.backends import Event
    from overlap.backends.devices.cuda import CudaDevices
    from overlap.sync_loop import new_loop  # the loop the runtime's *_sync calls run on here

    spin = spinner(cp)
    stream = cp.cuda.Stream(non_blocking=True)
    kind = CudaDevices(timeout=30.0)  # its own completion waiters, as a backend's

    def launch() -> tuple[Any, Any]:
        with stream:
            a, b = cp.cuda.Event(), cp.cuda.Event(block=True)
            a.record(stream)
            spin(SIZES["latency_kernel_s"])
            b.record(stream)
        return a, b

    async def waiter() -> tuple[float, Any, Any]:
        a, b = launch()
        t0 = time.perf_counter()
        w = Event("latency")
        w.native = b  # (what the kind's record leaves on a stream's event)
        await kind.device_wait(w)
        return time.perf_counter() - t0, a, b

    async def poll() -> tuple[float, Any, Any]:
        a, b = launch()
        t0 = time.perf_counter()
        delay = 50e-6
        while not b.done:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2e-3)
        return time.perf_counter() - t0, a, b

    async def callback() -> tuple[float, Any, Any]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        a, b = launch()
        stream.launch_host_func(
            lambda _: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None)),
            None)
        t0 = time.perf_counter()
        await fut
        return time.perf_counter() - t0, a, b

    async def many(fn) -> float:
        late = []
        for _ in range(SIZES["latency_rounds"]):
            wall, a, b = await fn()
            b.synchronize()
            late.append(max(0.0, wall - cp.cuda.get_elapsed_time(a, b) / 1e3))
        return statistics.median(late)

    result: dict[str, Any] = {}
    try:
        for name, fn in (("waiter", waiter), ("poll", poll), ("callback", callback)):
            loop = new_loop()
            result["loop"] = type(loop).__name__
            try:
                result[name] = loop.run_until_complete(many(fn)) * 1e6
            finally:
                loop.close()
    finally:
        kind.close([])  # (its idle waiter threads exit)
    return result


@functools.cache  # sized once: the pipeline and profiler sections share it
def pipeline_runner(cp):
    """The 4-virtual-stage pipeline on GPU 0: ``run(schedule, boundary_cols, trace=None,
    profile=False) -> (seconds, Timeline, torch profiler or None)``, and its sizes (with
    the compute-only 1f1b step, (m + p − 1)(F + B): what a step costs with free transfers
    and no host overhead)."""
    from overlap import Runtime, Stage
    from scheduler import Boundary, Cluster, DeviceMesh, P, Sharding

    cluster = Cluster(4, 1, nic_gbps=400.0)  # 4 virtual stages, all on GPU 0
    meshes = [DeviceMesh([[d]], ("host", "gpu")) for d in range(4)]
    rows = SIZES["rows"]

    def transfer_seconds(cols: int) -> float:
        a = cp.zeros((rows, cols), cp.float32)
        b = cp.empty_like(a)
        return timed(cp, lambda: b.__setitem__(Ellipsis, a))

    t_xfer = transfer_seconds(SIZES["cols"])  # 1 GiB activations
    # F = 16 × transfer, B = 2 × F: one-thread kernels (see SPIN_SRC). On one GPU every
    # transfer shares its one memory: with F = 2 × transfer the copies of three boundaries
    # both ways (and stage 0's input copies) asked for more than its bandwidth, and each
    # took 2-6x its time alone; at 16x they ask for ~15 %, as independent links would. And
    # each op must outlast the host's cost of launching it (~0.5 ms an op with four stages'
    # threads; at F = 1.1 ms the signal step took 2.1x its compute: 2026-11-30), or the
    # step measures the host, and a stream's marks its lateness.
    t_f = 16 * t_xfer
    spin = spinner(cp)

    # The same compute whatever the boundary's size (the signal run must differ only in what
    # moves); activations and gradients pass through unchanged, and the last stage sends
    # back a gradient made once.
    def fwd(s):
        def f(ctx, x):
            spin(t_f)
            return x.ravel()[:1].sum() * 0 if s == 3 else x
        return f

    def bwd(s, grad):
        def b(ctx, dy):
            spin(2 * t_f)
            return None if s == 0 else (grad if dy is None else dy)
        return b

    def run(schedule: str, boundary_cols: int, trace: Path | None = None,
            profile: bool = False):
        shape = (rows, boundary_cols)
        grad = cp.zeros(shape, cp.float32)
        stages = [Stage(m, fwd(s), bwd(s, grad)) for s, m in enumerate(meshes)]
        bounds = [Boundary(shape, "float32", Sharding(meshes[s], P()),
                           Sharding(meshes[s + 1], P())) for s in range(3)]
        mbs = [cp.zeros(shape, cp.float32) for _ in range(SIZES["microbatches"])]

        def step():
            rt.train_step_sync(stages, bounds, mbs, input_sharding=Sharding(meshes[0], P()),
                               schedule=schedule)

        prof = None
        with Runtime(cluster, backend="cuda") as rt:
            seconds = device_timed(cp, step, repeat=3)
            pool = cp.get_default_memory_pool()
            if hasattr(pool, "total_bytes"):  # (not on the stand-in)
                log(f"  {schedule}, boundary {rows}x{boundary_cols}: CuPy pool "
                    f"{pool.used_bytes() / 2**30:.1f} GiB used, "
                    f"{pool.total_bytes() / 2**30:.1f} GiB held")
            if profile:  # one more step, recorded (every range a record_function)
                from overlap.torch import profiler

                with profiler() as prof:
                    step()
                    cp.cuda.Device(0).synchronize()
            tl = rt.timeline()
            if trace is not None:
                rt.write_trace(trace)
        return seconds, tl, prof

    m = SIZES["microbatches"]
    return run, {"transfer_ms": t_xfer * 1e3, "forward_ms": t_f * 1e3,
                 "ideal_1f1b_ms": (m + 3) * 3 * t_f * 1e3}


def pipeline(cp) -> dict[str, float]:
    run, sizes = pipeline_runner(cp)
    cols = SIZES["cols"]
    signal, _, _ = run("eager-1f1b", 1)
    one, one_tl, _ = run("1f1b", cols)
    eager, eager_tl, _ = run("eager-1f1b", cols,
                             OUT / "gpu_pipeline.json" if OUT is not None else None)
    return {**sizes, "signal": signal, "1f1b": one, "eager": eager,
            "1f1b_exposed": one_tl.exposed_comm_fraction,
            "eager_exposed": eager_tl.exposed_comm_fraction}


def profiler_vs_events(cp) -> dict[str, Any]:
    """One 1f1b step (communication partly exposed) recorded by the PyTorch profiler: the
    exposed communication ``overlap trace report`` finds in the profiler's trace against the
    runtime's own CUDA-event trace of the same step — target: within 10 %. A transfer is one
    copy kernel to the profiler, attributed to the device whose thread launched it; the
    runtime's trace shows it on both its devices, so their per-device figures differ by
    design. Both sides are put on the same footing — each transfer on its receiver, stage s
    being device s here — and the step's totals compared."""
    import importlib.util
    import json
    import tempfile

    if importlib.util.find_spec("torch") is None:
        return {"skipped": "PyTorch is not installed here (the GPU machine has it)"}
    from scheduler.traces.capture import device_figures, step_figures, timeline_work
    from scheduler.traces.kineto import kineto_work

    run, _ = pipeline_runner(cp)
    _, tl, prof = run("1f1b", SIZES["cols"], profile=True,
                      trace=OUT / "gpu_1f1b_events.json" if OUT is not None else None)
    path = Path(tempfile.mkdtemp()) / "gpu_torch_profile.json"  # (too big to bring back)
    prof.export_chrome_trace(str(path))
    if OUT is not None:  # compressed, to come back under the size limit
        import gzip

        (OUT / "gpu_torch_profile.json.gz").write_bytes(gzip.compress(path.read_bytes()))
    capture = kineto_work(json.loads(path.read_text()))
    ours = device_figures(at_receivers(timeline_work(tl), keep_only=True))
    theirs = device_figures(at_receivers(capture.work, keep_only=False))
    exposed = sum(f.exposed for f in theirs.values()) * 1e3
    want = sum(f.exposed for f in ours.values()) * 1e3
    steps = step_figures(capture) or {}
    return {"profiler_exposed_ms": exposed, "events_exposed_ms": want,
            "ratio": exposed / want if want else float("nan"),
            "profiler_devices": len(theirs), "profiler_iteration_ms":
            steps.get("iteration_ms", float("nan")), "events_iteration_ms":
            tl.iteration_time * 1e3, "work": len(capture.work)}


def gpt_example(cp) -> dict[str, Any]:
    """``examples/gpt_pipeline.py`` on the GPU in bfloat16: 4 virtual stages on one GPU
    (loopback transfers; tensor-parallel degree 1, since a tensor-parallel device needs a GPU
    of its own), 8 blocks of width 512, sequence 256; its self-check against plain torch's
    bfloat16 run on the same GPU, tokens/s and the exposed communication it reports."""
    import contextlib
    import importlib.util
    import io

    if importlib.util.find_spec("torch") is None:
        return {"skipped": "PyTorch is not installed here (the GPU machine has it)"}
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "torch has no CUDA here (the stand-in cannot run torch kernels)"}
    spec = importlib.util.spec_from_file_location("gpt_pipeline", ROOT / "examples" /
                                                  "gpt_pipeline.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    out = io.StringIO()
    trace_dir = str(OUT) if OUT is not None else "traces"
    with contextlib.redirect_stdout(out):
        rc = ex.main(["--backend", "cuda", "--dtype", "bfloat16", "--tp", "1,1,1,1",
                      "--layers", "8", "--width", "512", "--heads", "8", "--seq", "256",
                      "--vocab", "8192", "--batch", "32", "--microbatches", "8", "--steps", "4",
                      "--schedule", "1f1b", "--trace-dir", trace_dir])
    text = out.getvalue()
    log(text)
    verdict = [line for line in text.splitlines() if "match plain torch" in line or
               "FAILED" in line]
    if rc != 0 or not verdict:
        raise RuntimeError(f"the GPT example failed (rc {rc}): {text[-400:]}")
    return {"verdict": verdict[-1]}


# Goals of the pipeline against plain torch (section 8), by width: 4 stages, one stage.
VS_TORCH_GOALS = {256: 1.15, 1024: 1.05, 4096: 1.02}
ONE_STAGE_GOAL = 1.05


def vs_plain_torch(cp) -> dict[str, Any]:
    """Section 8: ``benchmarks/vs_plain_torch.py``'s GPU table (on the stand-in: its tiny
    rows on the CPU backend, so that the section's code runs)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return {"skipped": "PyTorch is not installed here (the GPU machine has it)"}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import vs_plain_torch as vs

    device, rows = ("cpu", vs.SELF_ROWS) if SELF else ("cuda", vs.GPU_ROWS)
    dtype = "float32" if SELF else "bfloat16"
    out = [vs.measure(size, scheds, device, dtype, rounds=2 if SELF else 4,
                      warmup=1 if SELF else 2, log=log) for size, scheds in rows]
    vs.table(out, log=log)
    return {"rows": out}


def vs_torch_rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    for r in result["rows"]:
        goal = ONE_STAGE_GOAL if r.size.stages == 1 else VS_TORCH_GOALS.get(r.size.width)
        worst = max(r.steps, key=r.ratio)
        met = "" if goal is None else (f" (target <= {goal}: "
                                       f"{'met' if r.ratio(worst) <= goal else 'NOT met'})")
        rows.append((f"vs torch w{r.size.width} x{r.size.stages}",
                     f"plain {r.plain * 1e3:.1f} ms",
                     ", ".join(f"{s} {r.ratio(s):.3f}" for s in r.steps) + met))
    return rows


def at_receivers(work: list, keep_only: bool) -> list:
    """Each transfer's work on its receiving stage's device (stage s is device s in this
    check's pipeline): the runtime's trace keeps only the receiver's span of it
    (``keep_only``), a profiler's single copy kernel moves there."""
    import dataclasses
    import re

    pair = re.compile(r"s(\d+)\s*(?:->|→)\s*s(\d+)")
    out = []
    for w in work:
        m = pair.search(w.label) if w.category == "comm" else None
        if m is None:
            out.append(w)
        elif not keep_only:
            out.append(dataclasses.replace(w, device=int(m.group(2))))
        elif w.device == int(m.group(2)):
            out.append(w)
    return out


def section(rows: list[tuple[str, str, str]], name: str, fn, started: float) -> object:
    """Run one section; a failure is a row, not the end of the check."""
    try:
        result = fn()
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        log(f"[{time.time() - started:.0f}s] {name} FAILED: {type(exc).__name__}: {exc}")
        rows.append((name, "FAILED", f"{type(exc).__name__}: {str(exc)[:120]}"))
        return None
    log(f"[{time.time() - started:.0f}s] {name} done: {result}")
    return result


def use_stand_in() -> None:
    """--self-test: the CuPy stand-in, small sizes."""
    global SELF
    sys.path.insert(0, str(ROOT / "tests"))
    import fake_cupy

    sys.modules["cupy"] = fake_cupy
    sys.modules["cupy.cuda"] = fake_cupy.cuda
    sys.modules["cupy.cuda.nccl"] = fake_cupy.nccl
    SIZES.update(SELF_TEST)
    SELF = True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--self-test"]):
        print(__doc__)
        return 2
    if args == ["--self-test"]:
        use_stand_in()
    try:
        import cupy as cp
    except ImportError:
        print("gpu_check: CuPy is not installed here; run it on the GPU machine")
        return 2
    from overlap.backends.devices.cuda import gpu_count

    if gpu_count() < 1:
        print("gpu_check: no CUDA device visible")
        return 2
    if OUT is not None:
        OUT.mkdir(parents=True, exist_ok=True)
    props = cp.cuda.runtime.getDeviceProperties(0)
    log(f"device: {props['name'].decode()} ({gpu_count()} visible), CuPy {cp.__version__}, "
        f"Python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d')}"
        + (" — SELF-TEST on the stand-in: the numbers mean nothing" if SELF else ""))
    rows: list[tuple[str, str, str]] = []
    t0 = time.time()
    tests = section(rows, "GPU tests", run_tests, t0)
    if tests is not None:
        rows.append(("GPU tests", str(tests), ""))
    bw = section(rows, "bandwidth", lambda: bandwidth(cp), t0)
    if bw is not None:
        ratio = bw["net"] / bw["peak"]
        rows.append(("D2D copy peak", f"{bw['peak'] / 1e9:.0f} GB/s", "CUDA events"))
        rows.append(("loopback transfer", f"{bw['net'] / 1e9:.0f} GB/s",
                     f"{ratio:.0%} of peak (target >= 80%: "
                     f"{'met' if ratio >= 0.8 else 'NOT met'}), net of the call's fixed cost; "
                     f"end to end {bw['transfer'] / bw['peak']:.0%} for one {bw['gib']:.0f} GiB "
                     "call"))
        rows.append(("call fixed cost", f"{bw['call_us']:.0f} µs",
                     "a 4-byte reshard_sync between 2 virtual devices, CUDA events"))
        rows.append(("pack / unpack", f"{bw['pack'] / 1e9:.0f} / {bw['unpack'] / 1e9:.0f} GB/s",
                     ""))
    lat = section(rows, "completion latency", lambda: completion_latency(cp), t0)
    if lat is not None:
        ways = ("waiter", "poll", "callback")
        best = min(ways, key=lat.get)
        rows.append(("completion seen", f"waiter {lat['waiter']:.0f} µs, poll "
                     f"{lat['poll']:.0f} µs, host callback {lat['callback']:.0f} µs",
                     f"after a 1 ms kernel ends, {lat['loop']}; the CUDA kind uses waiter "
                     f"threads; fastest here: {best}"))
    pl = section(rows, "pipeline", lambda: pipeline(cp), t0)
    if pl is not None:
        eager_ratio = pl["eager"] / pl["signal"]
        rows.append(("pipeline sizes", f"transfer {pl['transfer_ms']:.2f} ms",
                     f"F {pl['forward_ms']:.2f} ms, B 2F (one-thread kernels); compute-only "
                     f"1f1b step {pl['ideal_1f1b_ms']:.1f} ms"))
        rows.append(("signal step", f"{pl['signal'] * 1e3:.1f} ms",
                     f"same compute; {pl['signal'] * 1e3 / pl['ideal_1f1b_ms']:.2f} x the "
                     "compute-only step (host overhead above 1)"))
        rows.append(("1f1b step", f"{pl['1f1b'] * 1e3:.1f} ms",
                     f"exposed comm {pl['1f1b_exposed']:.1%}"))
        rows.append(("eager-1f1b step", f"{pl['eager'] * 1e3:.1f} ms",
                     f"{eager_ratio:.3f} x signal (target <= 1.05: "
                     f"{'met' if eager_ratio <= 1.05 else 'NOT met'}), exposed "
                     f"{pl['eager_exposed']:.1%}"))
    pv = section(rows, "profiler vs events", lambda: profiler_vs_events(cp), t0)
    if pv is not None and "skipped" in pv:
        rows.append(("torch profiler report", "skipped", pv["skipped"]))
    elif pv is not None:
        ok = abs(pv["ratio"] - 1) <= 0.10
        rows.append(("torch profiler report", f"exposed {pv['profiler_exposed_ms']:.2f} ms",
                     f"CUDA events {pv['events_exposed_ms']:.2f} ms: {pv['ratio']:.3f} x "
                     f"(target within 10%: {'met' if ok else 'NOT met'}); "
                     f"{pv['work']} pieces of GPU work, {pv['profiler_devices']} devices"))
    gpt = section(rows, "gpt example", lambda: gpt_example(cp), t0)
    if gpt is not None:
        rows.append(("GPT example (bf16)", "skipped" if "skipped" in gpt else "ok",
                     gpt.get("skipped") or gpt["verdict"][:160]))
    vs = section(rows, "pipeline vs plain torch", lambda: vs_plain_torch(cp), t0)
    if vs is not None and "skipped" in vs:
        rows.append(("pipeline vs plain torch", "skipped", vs["skipped"]))
    elif vs is not None:
        rows.extend(vs_torch_rows(vs))
    width = max(len(r[0]) for r in rows)
    log("\n== gpu_check ==")
    for name, value, note in rows:
        log(f"{name:<{width}}  {value:<28} {note}")
    return 1 if any(v == "FAILED" or str(v).startswith("FAILED") for _, v, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
