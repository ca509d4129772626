"""The CUDA backend: the same behaviour as the CPU backend, on a GPU.

Skipped, with the reason, where no CUDA device (or no CuPy) is present — CI and the
development machines. `benchmarks/gpu_check.py` runs this file on a GPU machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from toy import ToyMLP, reference_step

from overlap import OverlapRuntimeError, Runtime, StreamError
from overlap.backends.devices.cuda import gpu_count
from scheduler import (
    BALANCES,
    SCHEDULES,
    STRATEGIES,
    Cluster,
    P,
    PlanOptions,
    Sharding,
    plan_resharding,
)

ROOT = Path(__file__).resolve().parents[1]
needs_gpu = pytest.mark.skipif(gpu_count() < 1, reason="no CUDA device visible (or no CuPy): "
                               "the CUDA backend runs in benchmarks/gpu_check.py on a GPU machine")


def test_import_overlap_never_needs_cupy():
    # A child interpreter where importing cupy fails: overlap still imports and runs on CPU,
    # and asking for the CUDA backend is a clear error.
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def no_cupy(name, *a, **k):\n"
        "    if name == 'cupy' or name.startswith('cupy.'): raise ImportError('no cupy')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = no_cupy\n"
        "import overlap\n"
        "from scheduler import Cluster\n"
        "try:\n"
        "    overlap.Runtime(Cluster.preset('p3.8xlarge', 1), backend='cuda')\n"
        "except overlap.OverlapRuntimeError as e:\n"
        "    print('clear error:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "clear error:" in out.stdout and "cupy" in out.stdout.lower()


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="backend"):
        Runtime(Cluster.preset("p3.8xlarge", 1), backend="tpu")


@needs_gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("balance", ["none", "auto"])
def test_reshard_on_gpu_matches_numpy(strategy, balance):
    import cupy as cp

    assert balance in BALANCES
    cluster = Cluster.preset("p3.8xlarge", 3)
    src = Sharding(cluster.mesh([0, 1]), P("host", "gpu"))
    dst = Sharding(cluster.mesh([1, 2]), P(None, ("host", "gpu"), None))
    shape = (12, 16, 5)
    glob = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    plan = plan_resharding(shape, "float64", src, dst, cluster,
                           PlanOptions(strategy=strategy, balance=balance))
    with Runtime(cluster, backend="cuda") as rt:
        shards = {d: cp.asarray(glob[tuple(slice(a, b) for a, b in r)])
                  for d, r in src.device_regions(shape).items()}
        out = rt.reshard_sync(plan, shards)
    for d, r in dst.device_regions(shape).items():
        np.testing.assert_array_equal(cp.asnumpy(out[d]),
                                      glob[tuple(slice(a, b) for a, b in r)])


@needs_gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_toy_pipeline_on_gpu_matches_reference(schedule):
    import cupy as cp

    cluster = Cluster.preset("p3.8xlarge", 4)
    model = ToyMLP.build(cluster, hidden=16, batch=8)
    for key, w in model.weights.items():
        model.weights[key] = cp.asarray(w)
    rng = np.random.default_rng(0)
    mbs = [rng.standard_normal((8, 16)) for _ in range(4)]
    with Runtime(cluster, backend="cuda") as rt:
        losses = rt.train_step_sync(model.stages(), model.boundaries(), mbs,
                                    input_sharding=model.input_sharding(), schedule=schedule)
        tl = rt.timeline()
    ref_losses, ref_grads = reference_step(model.full_weights, mbs)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-10)
    model.weights = {k: cp.asnumpy(w) for k, w in model.weights.items()}
    model.grads = {k: cp.asnumpy(g) for k, g in model.grads.items()}
    model.check_against(model.full_weights, ref_grads)
    assert tl.iteration_time > 0
    # Activation memory follows the schedule (gpipe keeps every microbatch's), as on the CPU.
    cpu_model = ToyMLP.build(cluster, hidden=16, batch=8)
    with Runtime(cluster) as cpu:
        cpu.train_step_sync(cpu_model.stages(), cpu_model.boundaries(), mbs,
                            input_sharding=cpu_model.input_sharding(), schedule=schedule)
        expected = [cpu.timeline().peak_activations(s) for s in range(4)]
    assert [tl.peak_activations(s) for s in range(4)] == expected


@needs_gpu
def test_failure_on_gpu_names_the_op_and_recovers():
    import cupy as cp

    cluster = Cluster.preset("p3.8xlarge", 4)
    model = ToyMLP.build(cluster, hidden=8, batch=4)
    # Device weights: CuPy refuses ``x @ w`` with a numpy ``w``, which would fail the first op
    # instead of the planted fault.
    model.weights = {k: cp.asarray(w) for k, w in model.weights.items()}
    mbs = [np.ones((4, 8)) for _ in range(3)]
    stages = model.stages()
    good = stages[2].forward

    def bad(ctx, x):
        if ctx.microbatch == 1:
            raise ZeroDivisionError("injected")
        return good(ctx, x)

    broken = list(stages)
    broken[2] = type(stages[2])(stages[2].mesh, bad, stages[2].backward)
    with Runtime(cluster, backend="cuda", timeout=30) as rt:
        with pytest.raises(StreamError, match="F s2 mb1") as err:
            rt.train_step_sync(broken, model.boundaries(), mbs,
                               input_sharding=model.input_sharding())
        assert isinstance(err.value.__cause__, ZeroDivisionError)
        rt.train_step_sync(stages, model.boundaries(), mbs,
                           input_sharding=model.input_sharding())
    assert OverlapRuntimeError  # the base class is exported


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@needs_gpu
@pytest.mark.skipif(not _torch_cuda(), reason="torch with CUDA is not installed")
def test_torch_tensors_in_stage_functions_via_dlpack():
    import cupy as cp
    import torch

    cluster = Cluster.preset("p3.8xlarge", 2)
    m0, m1 = cluster.mesh([0]), cluster.mesh([1])
    seen_streams = []

    def fwd(s):
        def f(ctx, x):
            seen_streams.append(ctx.cuda_stream.ptr)
            with torch.cuda.stream(torch.cuda.ExternalStream(ctx.cuda_stream.ptr)):
                t = torch.from_dlpack(x)  # zero-copy view of the cupy array
                y = torch.tanh(t * 2.0)
            ctx.saved["y"] = y
            out = cp.from_dlpack(y)
            return out.sum() if s == 1 else out
        return f

    def bwd(s):
        def b(ctx, dy):
            y = ctx.saved["y"]
            with torch.cuda.stream(torch.cuda.ExternalStream(ctx.cuda_stream.ptr)):
                g = torch.ones_like(y) if dy is None else torch.from_dlpack(dy)
                dx = g * (1 - y * y) * 2.0
            return cp.from_dlpack(dx)
        return b

    from overlap import Stage
    from scheduler import Boundary

    stages = [Stage(m0, fwd(0), bwd(0)), Stage(m1, fwd(1), bwd(1))]
    bounds = [Boundary((8, 4), "float32", Sharding(m0, P()), Sharding(m1, P()))]
    mbs = [np.full((8, 4), 0.1 * i, np.float32) for i in range(3)]
    with Runtime(cluster, backend="cuda") as rt:
        losses = rt.train_step_sync(stages, bounds, mbs, input_sharding=Sharding(m0, P()))
    expect = [float(np.tanh(2 * np.tanh(2 * x)).sum()) for x in mbs]
    np.testing.assert_allclose(losses, expect, rtol=1e-5)
    assert all(ptr != 0 for ptr in seen_streams)  # never the legacy default stream
