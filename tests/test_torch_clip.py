"""Gradient norms and clipping over a pipeline (``TorchPipeline.get_total_norm`` and
``clip_grad_norm_``) against plain torch's on the same model and batch: every parameter
counted once — replicas once, tensor-parallel shards together — and every copy clipped."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 "
                                            "(the 'torch' extra) to test overlap.torch")

from torch_reference import Block, assert_grads_match, reference_losses  # noqa: E402

from overlap import Runtime  # noqa: E402
from overlap.torch import ColwiseParallel, RowwiseParallel, TorchPipeline  # noqa: E402
from scheduler import Cluster, DeviceMesh  # noqa: E402

CLUSTER = Cluster.preset("p3.8xlarge", 3)


def _loss(y):
    return y.pow(2).mean()


def stepped(schedule: str = "1f1b"):
    """A pipeline (one device; 2 replicas; tensor-parallel over 2 on a 2x2 mesh; one device)
    and plain torch, after the same step: (pipe, reference modules)."""
    torch.manual_seed(0)
    meshes = [DeviceMesh([[0]], ("dp", "tp")), DeviceMesh([[1], [2]], ("dp", "tp")),
              DeviceMesh([[4, 5], [6, 7]], ("dp", "tp")), DeviceMesh([[8]], ("dp", "tp"))]
    full = [Block().double() for _ in meshes]
    reference = copy.deepcopy(full)
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    modules = [full[0], [full[1], copy.deepcopy(full[1])], full[2], full[3]]
    pipe = TorchPipeline(modules, meshes, _loss, plans=[None, None, plan, None], axis="tp")
    x = torch.randn(8, 4, 8, dtype=torch.float64)
    with Runtime(CLUSTER, timeout=30) as rt:
        pipe.train_step_sync(rt, x, num_microbatches=4, schedule=schedule)
    reference_losses(reference, x.chunk(4), _loss)
    return pipe, reference


def _params(reference):
    return [p for m in reference for p in m.parameters()]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_the_total_norm_is_plain_torchs_on_the_whole_model(norm_type):
    pipe, reference = stepped()
    want = torch.nn.utils.get_total_norm([p.grad for p in _params(reference)], norm_type)
    got = pipe.get_total_norm(norm_type)
    assert got.dtype == torch.float64 and got.dim() == 0  # (float64 gradients)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    # What torch's helper makes of the pipeline's parameters counts every replica again.
    naive = torch.nn.utils.get_total_norm([p.grad for p in pipe.parameters()], norm_type)
    if not math.isinf(norm_type):
        assert float(naive) > float(want) * 1.01


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_clipping_scales_every_copy_as_plain_torch_scales_the_model(schedule):
    pipe, reference = stepped(schedule)
    want = torch.nn.utils.clip_grad_norm_(_params(reference), max_norm=0.05)
    got = pipe.clip_grad_norm_(0.05)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert float(want) > 0.05  # (it did clip)
    assert_grads_match(pipe, reference, rtol=1e-10, atol=1e-14)
    # The model's norm is now max_norm (less the 1e-6 torch adds to the divisor).
    assert float(pipe.get_total_norm()) == pytest.approx(0.05, rel=1e-4)


def test_bfloat16_gradients_get_a_float32_norm():
    torch.manual_seed(0)
    meshes = [DeviceMesh([[0]], ("dp", "tp")), DeviceMesh([[1], [2]], ("dp", "tp"))]
    full = [Block().to(torch.bfloat16) for _ in meshes]
    reference = copy.deepcopy(full)
    pipe = TorchPipeline([full[0], [full[1], copy.deepcopy(full[1])]], meshes, _loss)
    x = torch.randn(8, 4, 8, dtype=torch.bfloat16)
    with Runtime(CLUSTER, timeout=30) as rt:
        pipe.train_step_sync(rt, x, num_microbatches=2)
    reference_losses(reference, x.chunk(2), _loss)
    want = torch.nn.utils.get_total_norm([p.grad.float() for p in _params(reference)])
    got = pipe.get_total_norm()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)


def test_a_norm_below_max_norm_leaves_the_gradients_alone():
    pipe, _ = stepped()
    before = [p.grad.clone() for p in pipe.parameters()]
    total = pipe.clip_grad_norm_(1e6)
    assert float(total) > 0
    for b, p in zip(before, pipe.parameters()):
        assert torch.equal(p.grad, b)


def test_a_nonfinite_norm_is_an_error_when_asked_and_changes_nothing():
    pipe, _ = stepped()
    p0 = next(pipe.parameters())
    p0.grad[0] = float("inf")
    before = [p.grad.clone() for p in pipe.parameters()]
    with pytest.raises(RuntimeError, match=r"non-finite.*error_if_nonfinite=False"):
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    for b, p in zip(before, pipe.parameters()):
        assert torch.equal(p.grad, b)
    assert math.isinf(float(pipe.get_total_norm()))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_norm": -1.0}, r"max_norm: expected a number >= 0"),
    ({"max_norm": "1"}, r"max_norm: expected a number >= 0"),
    ({"max_norm": 1.0, "norm_type": 0}, r"norm_type: expected a number > 0 or inf"),
    ({"max_norm": 1.0, "norm_type": True}, r"norm_type: expected a number > 0 or inf"),
])
def test_bad_arguments_are_named_before_any_gradient_changes(kwargs, match):
    pipe, _ = stepped()
    before = [p.grad.clone() for p in pipe.parameters()]
    with pytest.raises(ValueError, match=match):
        pipe.clip_grad_norm_(**kwargs)
    for b, p in zip(before, pipe.parameters()):
        assert torch.equal(p.grad, b)


def test_parameters_without_gradients_are_left_out_as_torch_does():
    pipe, reference = stepped()
    for m in (pipe.modules[0][0], reference[0]):
        for p in m.parameters():
            p.grad = None
    want = torch.nn.utils.get_total_norm([p.grad for p in _params(reference)
                                          if p.grad is not None])
    torch.testing.assert_close(pipe.get_total_norm(), want, rtol=1e-12, atol=0)
