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
4. asyncio completion: polling ``Event.done`` with backoff vs a waiter thread in
   ``synchronize()``, µs of latency per awaited event;
5. a 4-stage pipeline on one GPU (4 virtual stages), matmul compute sized so a microbatch's
   compute ≈ 2 × its transfer: step time for signal (1-element boundaries, same compute),
   1f1b and eager-1f1b, and exposed communication from the CUDA-event trace — **target:
   eager-1f1b ≤ 1.05 × signal**; the eager-1f1b trace goes to ``$OUT/gpu_pipeline.json``.

It prints a short table last.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
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


def run_tests() -> str:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs",
                           "tests/test_cuda_backend.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    log(proc.stdout[-3000:] + proc.stderr[-2000:])
    last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return f"{'ok' if proc.returncode == 0 else 'FAILED'}: {last}"


def bandwidth(cp) -> dict[str, float]:
    from overlap import Runtime
    from scheduler import Cluster, DeviceMesh, P, Sharding, plan_resharding

    n = 256 * 2**20  # float32 elements: 1 GiB
    src = cp.arange(n, dtype=cp.float32)
    dst = cp.empty_like(src)
    peak = 2 * src.nbytes / timed(cp, lambda: dst.__setitem__(Ellipsis, src))  # read + write
    # The backend: a broadcast of the same GiB between virtual devices 0 and 1 (one GPU).
    cluster = Cluster(2, 1, nic_gbps=400.0)
    a, b = DeviceMesh([[0]], ("host", "gpu")), DeviceMesh([[1]], ("host", "gpu"))
    plan = plan_resharding((n,), "float32", Sharding(a, P()), Sharding(b, P()), cluster)
    with Runtime(cluster, backend="cuda") as rt:
        shards = {0: src}
        rt.reshard_sync(plan, shards)  # warm-up: threads, streams, pools
        times = []
        for _ in range(5):
            cp.cuda.Device(0).synchronize()
            t0 = time.perf_counter()
            out = rt.reshard_sync(plan, shards)
            times.append(time.perf_counter() - t0)
        assert bool((out[1][:1000] == src[:1000]).all())
    # A transfer reads the root's buffer and writes the receiver's: 2 × bytes of traffic,
    # measured end to end (host launch and completion included).
    transfer = 2 * src.nbytes / statistics.median(times)
    # Pack / unpack: a strided half of a 2-d array to a contiguous buffer and back.
    m = cp.arange(8192 * 8192, dtype=cp.float32).reshape(8192, 8192)
    region = m[:, 1024:5120]
    packed = cp.empty(region.shape, cp.float32)
    pack = 2 * region.nbytes / timed(cp, lambda: packed.__setitem__(Ellipsis, region))
    unpack = 2 * region.nbytes / timed(cp, lambda: region.__setitem__(Ellipsis, packed))
    return {"peak": peak, "transfer": transfer, "pack": pack, "unpack": unpack}


def completion_latency(cp) -> dict[str, float]:
    """µs from a tiny kernel's end to the awaiting coroutine resuming: poll vs thread."""
    from overlap.backends.cuda import CudaEvent

    x = cp.zeros(1, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)

    async def poll_once() -> float:
        with stream:
            cp.add(x, 1, out=x)
            ev = cp.cuda.Event()
            ev.record(stream)
        w = CudaEvent("poll")
        w.cuda_event = ev
        w._complete()
        t0 = time.perf_counter()
        await w.wait()
        return time.perf_counter() - t0

    async def thread_once() -> float:
        with stream:
            cp.add(x, 1, out=x)
            ev = cp.cuda.Event()
            ev.record(stream)
        t0 = time.perf_counter()
        await asyncio.to_thread(ev.synchronize)
        return time.perf_counter() - t0

    async def many(fn) -> float:
        return statistics.median([await fn() for _ in range(200)])

    return {"poll": asyncio.run(many(poll_once)) * 1e6,
            "thread": asyncio.run(many(thread_once)) * 1e6}


def pipeline(cp) -> dict[str, float]:
    from overlap import Runtime, Stage
    from scheduler import Boundary, Cluster, DeviceMesh, P, Sharding

    cluster = Cluster(4, 1, nic_gbps=400.0)  # 4 virtual stages, all on GPU 0
    meshes = [DeviceMesh([[d]], ("host", "gpu")) for d in range(4)]
    rows = 16384

    def transfer_seconds(cols: int) -> float:
        a = cp.zeros((rows, cols), cp.float32)
        b = cp.empty_like(a)
        return timed(cp, lambda: b.__setitem__(Ellipsis, a))

    cols = 4096  # 256 MiB activations
    t_xfer = transfer_seconds(cols)
    # Matmul size so that F ≈ 2 × transfer (B does two of them).
    n = 1024
    while True:
        w = cp.ones((n, n), cp.float32)
        t_mm = timed(cp, lambda w=w: w @ w)
        if t_mm >= 2 * t_xfer or n >= 16384:
            break
        n = int(n * 1.25)
    weights = {d: cp.ones((n, n), cp.float32) / n for d in range(4)}

    def fwd(s):
        def f(ctx, x):
            z = weights[ctx.device] @ weights[ctx.device]
            y = x + z[0, 0] * 0
            return y.sum() * 0 if s == 3 else y
        return f

    def bwd(s):
        def b(ctx, dy):
            z = weights[ctx.device] @ weights[ctx.device]
            z = z @ weights[ctx.device]
            return None if s == 0 else (ctx.saved.setdefault("g", z[0, 0] * 0)
                                        + (dy if dy is not None else 0))
        return b

    def run(schedule: str, boundary_cols: int, trace: Path | None = None) -> tuple[float, float]:
        shape = (rows, boundary_cols)
        stages = [Stage(m, fwd(s), bwd(s)) for s, m in enumerate(meshes)]
        bounds = [Boundary(shape, "float32", Sharding(meshes[s], P()),
                           Sharding(meshes[s + 1], P())) for s in range(3)]
        mbs = [cp.zeros(shape, cp.float32) for _ in range(16)]

        # The last stage's backward needs a gradient of the right shape to send back.
        def last_bwd(ctx, dy):
            z = weights[ctx.device] @ weights[ctx.device]
            z = z @ weights[ctx.device]
            return cp.zeros(shape, cp.float32) + z[0, 0] * 0

        stages[3] = Stage(meshes[3], fwd(3), last_bwd)
        with Runtime(cluster, backend="cuda") as rt:
            rt.train_step_sync(stages, bounds, mbs, input_sharding=Sharding(meshes[0], P()),
                               schedule=schedule)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                rt.train_step_sync(stages, bounds, mbs,
                                   input_sharding=Sharding(meshes[0], P()), schedule=schedule)
                times.append(time.perf_counter() - t0)
            tl = rt.timeline()
            if trace is not None:
                rt.write_trace(trace)
        return statistics.median(times), tl.exposed_comm_fraction

    signal, _ = run("eager-1f1b", 1)
    one, one_exp = run("1f1b", cols)
    eager, eager_exp = run("eager-1f1b", cols,
                           OUT / "gpu_pipeline.json" if OUT is not None else None)
    return {"transfer_ms": t_xfer * 1e3, "matmul_n": n, "matmul_ms": t_mm * 1e3,
            "signal": signal, "1f1b": one, "eager": eager, "1f1b_exposed": one_exp,
            "eager_exposed": eager_exp}


def main() -> int:
    try:
        import cupy as cp
    except ImportError:
        print("gpu_check: CuPy is not installed here; run it on the GPU machine")
        return 2
    from overlap.backends.cuda import gpu_count

    if gpu_count() < 1:
        print("gpu_check: no CUDA device visible")
        return 2
    if OUT is not None:
        OUT.mkdir(parents=True, exist_ok=True)
    props = cp.cuda.runtime.getDeviceProperties(0)
    log(f"device: {props['name'].decode()} ({gpu_count()} visible), CuPy {cp.__version__}, "
        f"Python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d')}")
    rows: list[tuple[str, str, str]] = []
    t0 = time.time()
    rows.append(("GPU tests", run_tests(), ""))
    log(f"[{time.time() - t0:.0f}s] tests done")
    bw = bandwidth(cp)
    ratio = bw["transfer"] / bw["peak"]
    rows.append(("D2D copy peak", f"{bw['peak'] / 1e9:.0f} GB/s", ""))
    rows.append(("loopback transfer", f"{bw['transfer'] / 1e9:.0f} GB/s",
                 f"{ratio:.0%} of peak (target >= 80%: {'met' if ratio >= 0.8 else 'NOT met'})"))
    rows.append(("pack / unpack", f"{bw['pack'] / 1e9:.0f} / {bw['unpack'] / 1e9:.0f} GB/s",
                 ""))
    log(f"[{time.time() - t0:.0f}s] bandwidth done: {bw}")
    lat = completion_latency(cp)
    rows.append(("await completion", f"poll {lat['poll']:.0f} µs, thread {lat['thread']:.0f} µs",
                 "the backend polls" + (" (the better here)" if lat["poll"] <= lat["thread"]
                                        else " (a thread was faster here)")))
    log(f"[{time.time() - t0:.0f}s] completion latency done: {lat}")
    pl = pipeline(cp)
    eager_ratio = pl["eager"] / pl["signal"]
    rows.append(("pipeline sizes", f"transfer {pl['transfer_ms']:.2f} ms",
                 f"matmul n={pl['matmul_n']} {pl['matmul_ms']:.2f} ms"))
    rows.append(("signal step", f"{pl['signal'] * 1e3:.1f} ms", ""))
    rows.append(("1f1b step", f"{pl['1f1b'] * 1e3:.1f} ms",
                 f"exposed comm {pl['1f1b_exposed']:.1%}"))
    rows.append(("eager-1f1b step", f"{pl['eager'] * 1e3:.1f} ms",
                 f"{eager_ratio:.3f} x signal (target <= 1.05: "
                 f"{'met' if eager_ratio <= 1.05 else 'NOT met'}), exposed "
                 f"{pl['eager_exposed']:.1%}"))
    log(f"[{time.time() - t0:.0f}s] pipeline done: {pl}")
    width = max(len(r[0]) for r in rows)
    log("\n== gpu_check ==")
    for name, value, note in rows:
        log(f"{name:<{width}}  {value:<28} {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
