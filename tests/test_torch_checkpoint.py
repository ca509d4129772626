"""TorchPipeline.state_dict / load_state_dict: checkpoints under the plain model's names,
both ways between a pipeline and ``nn.Sequential(*stages)`` and between pipelines of other
plans, with named errors and nothing changed when a load is refused."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 "
                                            "(the 'torch' extra) to test overlap.torch")

from torch import nn  # noqa: E402

from overlap import Runtime  # noqa: E402
from overlap.torch import ColwiseParallel, RowwiseParallel, TorchPipeline  # noqa: E402
from scheduler import Cluster, DeviceMesh  # noqa: E402

PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6))
                           for _ in range(3))).double()


def _tp_pipe(model):
    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2], ("tp",)),
              DeviceMesh([4, 5, 6, 7], ("tp",))]
    return TorchPipeline([copy.deepcopy(m) for m in model], meshes, nn.functional.mse_loss,
                         plans=[None, PLAN, PLAN])


def _replicated_pipe(model):
    meshes = [DeviceMesh([0, 1], ("g",)), DeviceMesh([2], ("g",)), DeviceMesh([3, 4], ("g",))]
    stages = [copy.deepcopy(m) for m in model]
    return TorchPipeline([[stages[0], copy.deepcopy(stages[0])], stages[1],
                          [stages[2], copy.deepcopy(stages[2])]], meshes,
                         nn.functional.mse_loss)


def _train(pipe, x, y):
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with Runtime(Cluster.local(8), timeout=20) as rt:
        opt.zero_grad()
        pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule="1f1b")
        opt.step()


def test_a_trained_tensor_parallel_pipeline_saves_what_plain_torch_loads():
    model = _model(0)
    pipe = _tp_pipe(model)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    _train(pipe, x, y)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        nn.functional.mse_loss(ref(xm), ym).backward()
    opt.step()
    state = pipe.state_dict()
    assert list(state) == list(ref.state_dict())
    plain = _model(1)  # other weights, replaced by the load
    plain.load_state_dict(state)
    for a, b in zip(plain.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_plain_weights_load_into_any_pipeline_and_move_between_plans():
    source = _model(2)
    x = torch.randn(4, 6, dtype=torch.float64)
    want = source(x).detach()
    tp = _tp_pipe(_model(3))
    assert tp.load_state_dict(source.state_dict()) == ([], [])
    rep = _replicated_pipe(_model(4))
    rep.load_state_dict(tp.state_dict())  # tensor-parallel -> replicated, 2 copies each
    for pipe in (tp, rep):
        for reps in pipe.modules:  # every copy and shard got its values
            for m in reps:
                assert all(torch.isfinite(p).all() for p in m.parameters())
        again = _model(5)
        again.load_state_dict(pipe.state_dict())
        torch.testing.assert_close(again(x), want, rtol=1e-12, atol=1e-14)
    for k in range(2):
        for a, b in zip(rep.modules[2][k].parameters(), source[2].parameters()):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("edit, error, match", [
    (lambda s: s.pop("1.0.weight"), KeyError, r"missing keys \['1.0.weight'\]"),
    (lambda s: s.update({"3.0.weight": torch.zeros(8, 6)}), KeyError,
     r"unexpected keys \['3.0.weight'\]"),
    (lambda s: s.update({"1.0.bias": torch.zeros(9, dtype=torch.float64)}), ValueError,
     r"state_dict\['1.0.bias'\]: shape \(9,\), but stage 1's 0.bias is \(8,\)"),
    (lambda s: s.update({"2.2.bias": [0.0] * 6}), TypeError,
     r"state_dict\['2.2.bias'\]: expected a tensor, got list"),
])
def test_a_bad_checkpoint_is_named_and_changes_nothing(edit, error, match):
    pipe = _tp_pipe(_model(6))
    before = pipe.state_dict()
    state = _model(7).state_dict()
    edit(state)
    with pytest.raises(error, match=match):
        pipe.load_state_dict(state)
    after = pipe.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    with pytest.raises(TypeError, match=r"state_dict: expected a mapping"):
        pipe.load_state_dict([("0.0.weight", torch.zeros(8, 6))])


def test_strict_false_reports_missing_and_unexpected_keys():
    pipe = _tp_pipe(_model(8))
    state = _model(9).state_dict()
    del state["2.2.weight"]
    state["extra"] = torch.zeros(1)
    result = pipe.load_state_dict(state, strict=False)
    assert result.missing_keys == ["2.2.weight"] and result.unexpected_keys == ["extra"]
    torch.testing.assert_close(pipe.state_dict()["1.2.weight"], state["1.2.weight"])
