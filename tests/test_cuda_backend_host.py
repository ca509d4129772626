"""The CUDA backend's host logic, run on a numpy stand-in for CuPy (tests/fake_cupy.py).

Real GPUs run tests/test_cuda_backend.py (via benchmarks/gpu_check.py); this file runs
everywhere and checks that the backend's threads, event hooks (a stream only waits on events
already recorded), loopback collectives and trace marks compute the right results.
"""

from __future__ import annotations

import sys

import fake_cupy
import numpy as np
import pytest
from toy import ToyMLP, reference_step

from overlap import Runtime, StreamError
from scheduler import (
    SCHEDULES,
    STRATEGIES,
    Cluster,
    P,
    PlanOptions,
    Sharding,
    lower,
    make_schedule,
    plan_resharding,
)


@pytest.fixture(autouse=True)
def fake_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    fake_cupy.launches.clear()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reshard_through_the_cuda_backend(strategy):
    cluster = Cluster.preset("p3.8xlarge", 3)
    src = Sharding(cluster.mesh([0, 1]), P("host", "gpu"))
    dst = Sharding(cluster.mesh([1, 2]), P(None, ("host", "gpu"), None))
    shape = (12, 16, 5)
    glob = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    plan = plan_resharding(shape, "float64", src, dst, cluster, PlanOptions(strategy=strategy))
    with Runtime(cluster, backend="cuda") as rt:
        assert rt.backend.name == "cuda"
        shards = {d: glob[tuple(slice(a, b) for a, b in r)].copy()
                  for d, r in src.device_regions(shape).items()}
        out = rt.reshard_sync(plan, shards)
    for d, r in dst.device_regions(shape).items():
        np.testing.assert_array_equal(out[d], glob[tuple(slice(a, b) for a, b in r)])
    assert any(x.startswith("wait") for x in fake_cupy.launches)  # device-side waits used


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_toy_pipeline_through_the_cuda_backend(schedule, monkeypatch):
    from overlap.backends import cuda

    device_waits = []
    real_wait = cuda.CudaStream._wait_for

    def counting_wait(self, event):
        real_wait(self, event)
        if getattr(event, "cuda_event", None) is not None:
            device_waits.append(event.label)

    monkeypatch.setattr(cuda.CudaStream, "_wait_for", counting_wait)
    cluster = Cluster.preset("p3.8xlarge", 4)
    model = ToyMLP.build(cluster, hidden=8, batch=4)
    mbs = [np.random.default_rng(i).standard_normal((4, 8)) for i in range(3)]
    graph = lower(model.meshes, model.boundaries(), make_schedule(schedule, 4, len(mbs)),
                  cluster)
    with Runtime(cluster, backend="cuda") as rt:
        losses = rt.train_step_sync(model.stages(), model.boundaries(), mbs,
                                    input_sharding=model.input_sharding(), graph=graph)
        tl = rt.timeline()  # from (GPU, event) trace marks
    ref_losses, ref_grads = reference_step(model.full_weights, mbs)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-10)
    model.check_against(model.full_weights, ref_grads)
    assert len(tl.spans) > 0 and tl.iteration_time >= 0
    # Every wait of the step graph became a device-side wait on a recorded CUDA event (the
    # fake asserts the event was recorded before the wait was enqueued).
    assert len(device_waits) == sum(len(op.waits) for op in graph.ops) > 0


def test_failure_through_the_cuda_backend_names_the_op():
    cluster = Cluster.preset("p3.8xlarge", 4)
    model = ToyMLP.build(cluster, hidden=8, batch=4)
    stages = model.stages()
    good = stages[1].backward

    def bad(ctx, dy):
        if ctx.microbatch == 0 and ctx.device == 5:
            raise KeyError("injected")
        return good(ctx, dy)

    broken = list(stages)
    broken[1] = type(stages[1])(stages[1].mesh, stages[1].forward, bad)
    mbs = [np.ones((4, 8)) for _ in range(2)]
    with Runtime(cluster, backend="cuda", timeout=30) as rt:
        with pytest.raises(StreamError, match="B s1 mb0 on device 5"):
            rt.train_step_sync(broken, model.boundaries(), mbs,
                               input_sharding=model.input_sharding())
        losses = rt.train_step_sync(stages, model.boundaries(), mbs,
                                    input_sharding=model.input_sharding())
    assert np.allclose(losses, reference_step(model.full_weights, mbs)[0])
