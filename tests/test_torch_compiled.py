"""Compiled stages (torch.compile): a first step that compiles is bounded by the pipeline's
compile_timeout, not the runtime's timeout; a timeout that fires anyway says what to raise;
and Runtime.train_step(timeout=...) bounds one step."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 "
                                            "(the 'torch' extra) to test overlap.torch")

from torch import nn  # noqa: E402
from torch_reference import reference_losses  # noqa: E402

from overlap import Runtime, Stage  # noqa: E402
from overlap.errors import StageTimeout  # noqa: E402
from overlap.torch import TorchPipeline  # noqa: E402
from scheduler import Boundary, Cluster, DeviceMesh, P, Sharding  # noqa: E402

MESHES = [DeviceMesh([0], ("tp",)), DeviceMesh([1], ("tp",))]


class Scaled(nn.Module):
    """A small block scaled by a constant of its own: inductor writes the constant into its
    kernels, so each instance compiles from scratch (no cache on disk or in the process
    makes its first compile quick)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
        self.scale = 1.0 + float(np.random.default_rng().integers(1, 2**30)) * 2.0 ** -31

    def forward(self, x):
        return self.body(x) * self.scale


def _modules():
    torch.manual_seed(0)
    return [Scaled() for _ in MESHES]


def test_a_first_step_that_compiles_is_not_a_hang():
    # The runtime names an op running past 1 s a hang; compiling the stage (forward and
    # backward, with inductor) takes longer than that on the first shape, and again (less)
    # on a new one. Every step trains as plain torch.
    modules = _modules()
    reference = copy.deepcopy(modules)
    compiled = [modules[0], torch.compile(modules[1])]
    pipe = TorchPipeline(compiled, MESHES, nn.functional.mse_loss, compile_timeout=600)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    with Runtime(Cluster.local(2), timeout=1.0) as rt:
        start = time.perf_counter()
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule="1f1b")
        first = time.perf_counter() - start
        want = reference_losses(reference, x.chunk(2), nn.functional.mse_loss, y.chunk(2))
        np.testing.assert_allclose(losses, want, rtol=1e-5)
        for mine, ref in zip(modules, reference):  # (the compiled one's parameters are its)
            for p, q in zip(mine.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        assert first > 1.0  # (it did compile for longer than the runtime's bound)
        pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule="1f1b")  # compiled
        pipe.train_step_sync(rt, x[:6], y[:6], num_microbatches=2, schedule="1f1b")  # new


def test_a_compile_past_its_bound_says_which_argument_to_raise():
    modules = _modules()
    stage = torch.compile(modules[1], dynamic=False)
    x, y = torch.randn(6, 6), torch.randn(6, 6)
    with torch.no_grad():  # (the no-grad forward compiled: the shape probe runs at once,
        stage(torch.randn(3, 6))  # the step's training forward and backward compile)
    pipe = TorchPipeline([modules[0], stage], MESHES, nn.functional.mse_loss,
                         compile_timeout=0.3)
    with Runtime(Cluster.local(2), timeout=0.3) as rt, \
            pytest.raises(StageTimeout, match=r"compiled with torch\.compile.*"
                          r"TorchPipeline\(compile_timeout=\.\.\.\), 0\.3 s") as info:
        pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule="1f1b")
    assert "shape probe" not in str(info.value)  # (the step's own op, named as a hang)


def test_an_uncompiled_pipeline_keeps_the_runtimes_bound_and_says_nothing_of_compiles():
    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 2:  # (the probe is call 1)
                time.sleep(0.8)
            return self.lin(x)

    pipe = TorchPipeline([Slow(), Slow()], MESHES, nn.functional.mse_loss, compile_timeout=60)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    with Runtime(Cluster.local(2), timeout=0.3) as rt, pytest.raises(StageTimeout) as info:
        pipe.train_step_sync(rt, x, y, num_microbatches=1, schedule="gpipe")
    assert "torch.compile" not in str(info.value)


def test_compile_timeout_is_checked_by_name():
    with pytest.raises(ValueError, match=r"compile_timeout"):
        TorchPipeline(_modules(), MESHES, nn.functional.mse_loss, compile_timeout=-1)


def _sleepy_stages(seconds: float):
    mesh = [DeviceMesh([[0]], ("host", "gpu")), DeviceMesh([[1]], ("host", "gpu"))]

    def fwd(s):
        def f(ctx, x):
            if s == 1:
                time.sleep(seconds)
                return float(x.sum())
            return x
        return f

    def bwd(s):
        return lambda ctx, dy: None if s == 0 else np.zeros((2, 3))

    stages = [Stage(m, fwd(s), bwd(s)) for s, m in enumerate(mesh)]
    bounds = [Boundary((2, 3), "float64", Sharding(mesh[0], P()), Sharding(mesh[1], P()))]
    return stages, bounds, Sharding(mesh[0], P())


def test_a_steps_own_timeout_bounds_that_step_alone():
    stages, bounds, inputs = _sleepy_stages(0.6)
    mbs = [np.ones((2, 3))]
    with Runtime(Cluster.local(2), timeout=0.3) as rt:
        losses = rt.train_step_sync(stages, bounds, mbs, input_sharding=inputs,
                                    schedule="gpipe", timeout=5.0)
        assert losses == [6.0]
        assert rt.backend.timeout == 0.3  # (the runtime's own again)
        with pytest.raises(ValueError, match=r"timeout"):
            rt.train_step_sync(stages, bounds, mbs, input_sharding=inputs, timeout=0)
        with pytest.raises(StageTimeout):
            rt.train_step_sync(stages, bounds, mbs, input_sharding=inputs, schedule="gpipe")
