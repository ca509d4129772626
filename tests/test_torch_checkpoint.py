"""TorchPipeline.state_dict / load_state_dict: checkpoints under the plain model's names,
both ways between a pipeline and ``nn.Sequential(*stages)`` and between pipelines of other
plans, with named errors and nothing changed when a load is refused."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from launchers import LAUNCHERS, launch

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 "
                                            "(the 'torch' extra) to test overlap.torch")

from torch import nn  # noqa: E402

from overlap import Runtime  # noqa: E402
from overlap.torch import (  # noqa: E402
    ColwiseParallel,
    RowwiseParallel,
    TorchPipeline,
    read_checkpoint,
)
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
        (nn.functional.mse_loss(ref(xm), ym) * 0.5).backward()  # (the mean: the default)
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


# ---- optimizer state, and checkpoints saved by N processes loaded on M ----------------------

def _adam_steps(pipe_or_model, opt, batches, rt=None):
    for x, y in batches:
        opt.zero_grad()
        if rt is None:
            for xm, ym in zip(x.chunk(2), y.chunk(2)):
                (nn.functional.mse_loss(pipe_or_model(xm), ym) / 2).backward()
        else:
            pipe_or_model.train_step_sync(rt, x, y, num_microbatches=2, scale_grads=True)
        opt.step()


def test_optimizer_state_is_torchs_layout_and_continues_training_elsewhere():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = _model(0)
    reference = copy.deepcopy(model)
    pipe = _tp_pipe(model)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 6, generator=gen, dtype=torch.float64),
                torch.randn(8, 6, generator=gen, dtype=torch.float64)) for _ in range(3)]
    with Runtime(Cluster.local(8), timeout=20) as rt:
        _adam_steps(pipe, opt, batches[:2], rt)
        saved = pipe.optimizer_state_dict(opt)
    _adam_steps(reference, ref_opt, batches[:2])
    want = get_optimizer_state_dict(reference, ref_opt)
    assert saved["param_groups"] == want["param_groups"]
    assert list(saved["state"]) == list(want["state"])
    for name, entry in want["state"].items():
        assert set(saved["state"][name]) == set(entry)
        for key, value in entry.items():
            torch.testing.assert_close(saved["state"][name][key], value, rtol=1e-10, atol=1e-12)
    # Into another plan and placement: the third step there is plain torch's third step.
    other = _replicated_pipe(_model(9))
    other.load_state_dict(pipe.state_dict())
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)  # (lr comes from the file)
    other.load_optimizer_state_dict(other_opt, saved)
    assert other_opt.param_groups[0]["lr"] == 0.01
    with Runtime(Cluster.local(8), timeout=20) as rt:
        _adam_steps(other, other_opt, batches[2:], rt)
    _adam_steps(reference, ref_opt, batches[2:])
    for s in range(3):
        for key, value in reference[s].state_dict().items():
            torch.testing.assert_close(other.stage_state_dict(s)[key], value, rtol=1e-9,
                                       atol=1e-12)


def test_a_bad_optimizer_state_is_named_and_changes_nothing():
    pipe = _tp_pipe(_model(0))
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    with Runtime(Cluster.local(8), timeout=20) as rt:
        _adam_steps(pipe, opt, [(x, y)], rt)
    saved = pipe.optimizer_state_dict(opt)
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(saved)
    bad["state"]["2.2.weight"]["exp_avg"] = torch.zeros(3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\['2.2.weight'\]\['exp_avg'\]: shape \(3, 3\)"):
        pipe.load_optimizer_state_dict(opt, bad)
    with pytest.raises(ValueError, match=r"optimizer_state_dict: expected \{'state'"):
        pipe.load_optimizer_state_dict(opt, {"state": {}})
    with pytest.raises(TypeError, match=r"optimizer: expected a torch.optim.Optimizer"):
        pipe.optimizer_state_dict("adam")
    stranger = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer: it steps a parameter that is none"):
        pipe.optimizer_state_dict(stranger)
    after = opt.state_dict()
    for k, v in before["state"].items():
        for key, t in v.items():
            assert torch.equal(after["state"][k][key], t)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_checkpoint_of_two_processes_loads_on_one_and_into_plain_torch(tmp_path, launcher):
    """Saved by 2 processes (stage 1 tensor-parallel across them: gathered through the
    runtime), merged, and loaded by one process on another plan and into plain torch — both
    then take the same next step as plain torch trained all along."""
    import sys

    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from overlap.torch import build_stage

    jobs = Path(__file__).parent / "mpi_jobs"
    done = launch(launcher, 2, jobs / "tp_checkpoint.py", str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    sys.path.insert(0, str(jobs))
    import tp_checkpoint as job

    whole = read_checkpoint(tmp_path)  # the union of the two processes' files
    model, optim = whole["model"], whole["optim"]
    assert whole["extra"] == {"step": 2}
    assert sorted(p.name for p in tmp_path.glob("rank*.pt")) == ["rank0-of-2.pt",
                                                                 "rank1-of-2.pt"]
    reference = nn.Sequential(*(build_stage(job.stage_fn, s, job.SEED) for s in range(3)))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    batches = [job.batch(k) for k in range(3)]
    _adam_steps(reference, ref_opt, batches[:2])
    assert list(model) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model[key], value, rtol=1e-5, atol=1e-6)
    want = get_optimizer_state_dict(reference, ref_opt)["state"]
    assert set(optim["state"]) == set(want)
    for name, entry in want.items():
        for key, value in entry.items():
            torch.testing.assert_close(optim["state"][name][key], value, rtol=1e-5, atol=1e-6)
    # Plain torch resumes from it; so does one process with stage 1 over 4 devices.
    plain = nn.Sequential(*(job.stage_fn(s) for s in range(3)))
    plain.load_state_dict(model)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    set_optimizer_state_dict(plain, plain_opt, optim)
    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2, 3, 4], ("tp",)),
              DeviceMesh([5], ("tp",))]
    pipe = TorchPipeline(job.stage_fn, meshes, nn.functional.mse_loss, plans=[None, PLAN, None])
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    assert pipe.load_checkpoint(tmp_path, opt) == {"step": 2}
    with Runtime(Cluster.local(6), timeout=20) as rt:
        _adam_steps(pipe, opt, batches[2:], rt)
    _adam_steps(plain, plain_opt, batches[2:])
    _adam_steps(reference, ref_opt, batches[2:])
    for s in range(3):
        for key, value in reference[s].state_dict().items():
            torch.testing.assert_close(pipe.stage_state_dict(s)[key], value, rtol=1e-5,
                                       atol=1e-6)
            torch.testing.assert_close(plain[s].state_dict()[key], value, rtol=1e-5,
                                       atol=1e-6)
    # Saved by 2 processes, resumed by 4 (one device each), which save again: plain torch's.
    done = launch(launcher, 4, jobs / "tp_checkpoint.py", str(tmp_path), "resume")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    resumed = read_checkpoint(tmp_path / "resumed")
    assert resumed["extra"] == {"step": 3}
    assert list(resumed["model"]) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(resumed["model"][key], value, rtol=1e-5, atol=1e-6)


# ---- checkpoint directories: refused by name, nothing changed ------------------------------

def _saved(tmp_path):
    """A one-process TP pipeline after an AdamW step, saved with its optimizer to tmp_path;
    (pipe, opt)."""
    pipe = _tp_pipe(_model(0))
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    with Runtime(Cluster.local(8), timeout=20) as rt:
        _adam_steps(pipe, opt, [(x, y)], rt)
    path = pipe.save_checkpoint(tmp_path, opt, extra={"step": 1})
    assert path.name == "rank0-of-1.pt" and (tmp_path / "checkpoint.json").exists()
    return pipe, opt


def _snapshot(pipe, opt):
    return ({k: v.clone() for k, v in pipe.state_dict().items()},
            {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()})


def _assert_unchanged(pipe, opt, snap):
    model, state = snap
    for k, v in pipe.state_dict().items():
        assert torch.equal(v, model[k]), k
    assert {id(p) for p in opt.state} == set(state)
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k]), k


def test_a_checkpoint_loads_into_another_plan_with_its_optimizer(tmp_path):
    pipe, _ = _saved(tmp_path)
    other = _replicated_pipe(_model(5))
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    assert other.load_checkpoint(tmp_path, other_opt) == {"step": 1}
    for key, value in pipe.state_dict().items():
        torch.testing.assert_close(other.state_dict()[key], value)
    assert other_opt.param_groups[0]["lr"] == 0.01  # (the saved hyperparameters)


@pytest.mark.parametrize("damage, match", [
    ("no manifest", r"directory: .* has no checkpoint.json"),
    ("another save", r"is not of this checkpoint's save"),
    ("missing file", r"rank0-of-1.pt is missing"),
    ("not a directory", r"is not a directory"),
])
def test_a_damaged_checkpoint_is_named_and_changes_nothing(tmp_path, damage, match):
    _saved(tmp_path)
    target = tmp_path
    if damage == "no manifest":
        (tmp_path / "checkpoint.json").unlink()
    elif damage == "another save":  # a file of an earlier save, under this save's name
        part = torch.load(tmp_path / "rank0-of-1.pt", weights_only=True)
        part["save_id"] -= 1.0
        torch.save(part, tmp_path / "rank0-of-1.pt")
    elif damage == "missing file":
        (tmp_path / "rank0-of-1.pt").unlink()
    else:
        target = tmp_path / "checkpoint.json"
    pipe = _tp_pipe(_model(3))
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.5)
    snap = _snapshot(pipe, opt)
    with pytest.raises(ValueError, match=match):
        pipe.load_checkpoint(target, opt)
    _assert_unchanged(pipe, opt, snap)
    assert opt.param_groups[0]["lr"] == 0.5


def test_a_refused_model_puts_the_optimizer_back(tmp_path):
    # The optimizer's state loads first; the model's then fails (a stage of other widths):
    # the optimizer is as it was, state and hyperparameters.
    _saved(tmp_path)
    pipe = _tp_pipe(_model(3))
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.5)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    with Runtime(Cluster.local(8), timeout=20) as rt:
        _adam_steps(pipe, opt, [(x, y)], rt)
    whole = read_checkpoint(tmp_path)
    whole["model"]["2.0.weight"] = torch.zeros(3, 3, dtype=torch.float64)
    part = torch.load(tmp_path / "rank0-of-1.pt", weights_only=True)
    part["model"] = whole["model"]
    torch.save(part, tmp_path / "rank0-of-1.pt")
    snap = _snapshot(pipe, opt)
    with pytest.raises(ValueError):
        pipe.load_checkpoint(tmp_path, opt)
    _assert_unchanged(pipe, opt, snap)
    assert opt.param_groups[0]["lr"] == 0.5


def test_checkpoint_arguments_are_named(tmp_path):
    pipe = _tp_pipe(_model(0))
    with pytest.raises(TypeError, match=r"directory: expected a path"):
        pipe.save_checkpoint(3)
    with pytest.raises(TypeError, match=r"extra: expected a dict"):
        pipe.save_checkpoint(tmp_path, extra=[1])
    pipe.save_checkpoint(tmp_path)  # (no optimizer)
    with pytest.raises(ValueError, match=r"optimizer: the checkpoint .* without an optimizer"):
        pipe.load_checkpoint(tmp_path, torch.optim.SGD(pipe.parameters(), lr=0.1))
    assert pipe.load_checkpoint(tmp_path) is None
