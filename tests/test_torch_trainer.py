"""What a torch trainer expects of the adapter: gradient scaling as torch's schedules do it,
and a local cluster that names no cloud machine. Expected values from plain torch."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 "
                                            "(the 'torch' extra) to test overlap.torch")

from torch import nn  # noqa: E402
from torch_reference import assert_grads_match, reference_losses  # noqa: E402

from overlap import Runtime  # noqa: E402
from overlap.torch import ColwiseParallel, RowwiseParallel, TorchPipeline  # noqa: E402
from scheduler import Cluster, DeviceMesh  # noqa: E402


def _stages():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).double()
            for _ in range(3)]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
@pytest.mark.parametrize("scale", [False, True])
def test_scale_grads_gives_the_mean_over_microbatches_as_torch_does(schedule, scale):
    modules = _stages()
    reference = copy.deepcopy(modules)
    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2], ("tp",)), DeviceMesh([3], ("tp",))]
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    pipe = TorchPipeline(modules, meshes, nn.functional.mse_loss, plans=[None, plan, None])
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    with Runtime(Cluster.local(4), timeout=20) as rt:
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=4, schedule=schedule,
                                      scale_grads=scale)
    want = reference_losses(reference, x.chunk(4), nn.functional.mse_loss, y.chunk(4),
                            scale=1 / 4 if scale else 1.0)
    assert losses == pytest.approx(want, rel=1e-12)  # the losses themselves are not scaled
    assert_grads_match(pipe, reference, rtol=1e-12, atol=1e-14)


def test_scale_grads_must_be_a_bool():
    pipe = TorchPipeline(_stages()[:1], [DeviceMesh([0], ("tp",))], nn.functional.mse_loss)
    with Runtime(Cluster.local(1), timeout=20) as rt, \
            pytest.raises(TypeError, match=r"scale_grads: expected a bool"):
        pipe.train_step_sync(rt, torch.randn(2, 6, dtype=torch.float64),
                             torch.randn(2, 6, dtype=torch.float64), num_microbatches=1,
                             scale_grads="mean")


def test_a_local_cluster_is_one_host_of_n_devices():
    c = Cluster.local(6)
    assert (c.num_hosts, c.num_devices) == (1, 6)
    assert {c.host_of(d) for d in range(6)} == {0}
    for bad, error in ((0, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match=r"num_devices"):
            Cluster.local(bad)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_return_outputs_gives_the_last_stages_output_per_microbatch(schedule):
    modules = _stages()
    reference = copy.deepcopy(modules)
    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1], ("tp",)), DeviceMesh([2, 3], ("tp",))]
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}  # replicated out: the whole output
    pipe = TorchPipeline(modules, meshes, nn.functional.mse_loss, plans=[None, None, plan])
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    with Runtime(Cluster.local(4), timeout=20) as rt:
        losses, outputs = pipe.train_step_sync(rt, x, y, num_microbatches=4,
                                               schedule=schedule, return_outputs=True)
        plain = pipe.train_step_sync(rt, x, y, num_microbatches=4, schedule=schedule)
    assert plain == losses  # (the same step again: return_outputs changes nothing else)
    assert len(outputs) == 4
    for xm, out in zip(x.chunk(4), outputs):
        h = xm
        for m in reference:
            h = m(h)
        assert not out.requires_grad
        torch.testing.assert_close(out, h.detach(), rtol=1e-12, atol=1e-14)


def test_return_outputs_must_be_a_bool():
    pipe = TorchPipeline(_stages()[:1], [DeviceMesh([0], ("tp",))], nn.functional.mse_loss)
    with Runtime(Cluster.local(1), timeout=20) as rt, \
            pytest.raises(TypeError, match=r"return_outputs: expected a bool"):
        pipe.train_step_sync(rt, torch.randn(2, 6, dtype=torch.float64),
                             torch.randn(2, 6, dtype=torch.float64), num_microbatches=1,
                             return_outputs=1)
