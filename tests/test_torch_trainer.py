"""What a torch trainer expects of the adapter: gradient scaling as torch's schedules do it,
and a local cluster that names no cloud machine. Expected values from plain torch."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 "
                                            "(the 'torch' extra) to test overlap.torch")

from launchers import LAUNCHERS, launch  # noqa: E402
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


def test_the_default_is_the_mean_as_torchs_schedules_default():
    import inspect

    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    ours = inspect.signature(TorchPipeline.train_step).parameters["scale_grads"].default
    for schedule in (Schedule1F1B, ScheduleGPipe):
        assert inspect.signature(schedule).parameters["scale_grads"].default is ours is True
    modules = _stages()
    reference = copy.deepcopy(modules)
    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1], ("tp",)), DeviceMesh([2], ("tp",))]
    pipe = TorchPipeline(modules, meshes, nn.functional.mse_loss)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    with Runtime(Cluster.local(3), timeout=20) as rt:
        pipe.train_step_sync(rt, x, y, num_microbatches=4)
    # The gradient of the batch's mean loss, as plain torch gives it on the whole batch.
    for m in reference:
        m.zero_grad()
    h = x
    for m in reference:
        h = m(h)
    torch.stack([nn.functional.mse_loss(a, b) for a, b in zip(h.chunk(4), y.chunk(4))]
                ).mean().backward()
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


# ---- each process builds only what it runs ----------------------------------------------

def _factory_stage(s: int) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).double()


def _seeded(s: int, seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + s)
        return _factory_stage(s)


@pytest.mark.parametrize("with_rt", [False, True])
def test_a_stage_factory_builds_each_stage_once_seeded_as_plain_torch(with_rt):
    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2], ("tp",)), DeviceMesh([3], ("tp",))]
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    calls: list[int] = []

    def stage_fn(s):
        calls.append(s)
        return _factory_stage(s)

    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    before = torch.get_rng_state()
    with Runtime(Cluster.local(4), timeout=20) as rt:
        pipe = TorchPipeline(stage_fn, meshes, nn.functional.mse_loss, seed=11,
                             plans=[plan, None, None], rt=rt if with_rt else None)
        assert torch.equal(torch.get_rng_state(), before), "the caller's RNG was touched"
        assert calls == [0, 1, 2]  # one process: every stage, each built once
        assert [(st.index, st.devices) for st in pipe.local_stages] == \
            [(0, (0,)), (1, (1, 2)), (2, (3,))]
        # The replicated stage's two devices hold copies, not one module twice.
        a, b = pipe.local_stages[1].modules
        assert a is not b and torch.equal(a[0].weight, b[0].weight)
        assert len(list(pipe.parameters())) == 4 + 2 * 4 + 4
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule="1f1b")
    reference = [_seeded(s, 11) for s in range(3)]
    want = reference_losses(reference, x.chunk(2), nn.functional.mse_loss, y.chunk(2))
    assert losses == pytest.approx(want, rel=1e-12)
    assert_grads_match(pipe, reference, rtol=1e-12, atol=1e-14)


def test_a_stage_factory_default_seed_is_torchs_initial_seed():
    torch.manual_seed(5)
    mesh = [DeviceMesh([0], ("tp",))]
    pipe = TorchPipeline(_factory_stage, mesh, nn.functional.mse_loss)
    assert torch.equal(pipe.modules[0][0][0].weight, _seeded(0, 5)[0].weight)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(modules=lambda s: "not a module"), TypeError, r"stage_fn\(0\): expected an nn.Module"),
    (dict(seed=-1), ValueError, r"seed: expected an int >= 0"),
    (dict(seed=1.5), ValueError, r"seed: expected an int >= 0"),
    (dict(modules=[_factory_stage(0)], seed=3), ValueError, r"seed: seeds the stages a "
                                                             r"stage_fn builds"),
    (dict(rt="runtime"), TypeError, r"rt: expected an overlap.Runtime"),
])
def test_bad_factory_arguments_are_named(kwargs, error, match):
    args = dict(modules=_factory_stage, meshes=[DeviceMesh([0], ("tp",))],
                loss_fn=nn.functional.mse_loss)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        TorchPipeline(args.pop("modules"), args.pop("meshes"), args.pop("loss_fn"), **args)


def test_a_factory_built_elsewhere_is_built_on_meta_and_must_make_no_real_tensors():
    from overlap.torch.stages import build_stages, is_meta

    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1], ("tp",))]
    out = build_stages(_factory_stage, meshes, [False, False], frozenset({0}), 0,
                       lambda d: None)
    assert not is_meta(out[0][0]) and is_meta(out[1][0])  # device 1 is another process's

    def explicit(s):
        m = _factory_stage(s)
        m.register_buffer("table", torch.zeros(3, device="cpu"))
        return m
    with pytest.raises(ValueError, match=r"stage_fn\(1\): built under torch.device\('meta'\)"):
        build_stages(explicit, meshes, [False, False], frozenset({0}), 0, lambda d: None)


def test_runtime_outside_the_meshes_is_named_at_construction():
    with Runtime(Cluster.local(2), timeout=20) as rt, \
            pytest.raises(ValueError, match=r"meshes: device 3 is outside the runtime"):
        TorchPipeline(_factory_stage, [DeviceMesh([3], ("tp",))], nn.functional.mse_loss,
                      rt=rt)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_under_a_launcher_each_rank_builds_and_trains_only_its_stages(launcher):
    job = Path(__file__).parent / "mpi_jobs" / "stage_factory.py"
    done = launch(launcher, 2, job)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rank 0: ok" in done.stdout and "rank 1: ok" in done.stdout


# ---- evaluation: forward only -------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "auto", "interleaved-1f1b"])
def test_eval_step_runs_forward_only_as_plain_torch_under_no_grad(schedule):
    torch.manual_seed(0)
    interleaved = schedule == "interleaved-1f1b"
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    if interleaved:  # 4 stages on 2 ranks: stage s on the mesh of rank s % 2
        rank_meshes = [DeviceMesh([0, 1], ("tp",)), DeviceMesh([2, 3], ("tp",))]
        meshes, plans = [rank_meshes[s % 2] for s in range(4)], [plan] * 4
    else:
        meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2], ("tp",)), DeviceMesh([3], ("tp",))]
        plans = [None, plan, None]
    modules = [nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).double()
               for _ in meshes]
    reference = copy.deepcopy(modules)
    pipe = TorchPipeline(modules, meshes, nn.functional.mse_loss, plans=plans)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    with Runtime(Cluster.local(4), timeout=20) as rt:
        losses, outputs = pipe.eval_step_sync(rt, x, y, num_microbatches=4, schedule=schedule,
                                              return_outputs=True)
        assert pipe.eval_step_sync(rt, x, y, num_microbatches=4, schedule=schedule) == losses
        stats = rt.last_step
    assert all(p.grad is None for p in pipe.parameters())  # no backward ran
    assert stats.seconds > 0
    with torch.no_grad():
        for i, (xm, ym) in enumerate(zip(x.chunk(4), y.chunk(4))):
            h = xm
            for m in reference:
                h = m(h)
            assert not outputs[i].requires_grad
            torch.testing.assert_close(outputs[i], h, rtol=1e-12, atol=1e-14)
            assert losses[i] == pytest.approx(nn.functional.mse_loss(h, ym).item(), rel=1e-12)


def test_eval_between_train_steps_changes_no_gradient_and_no_weight():
    modules = _stages()
    meshes = [DeviceMesh([d], ("tp",)) for d in range(3)]
    pipe = TorchPipeline(modules, meshes, nn.functional.mse_loss)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    with Runtime(Cluster.local(3), timeout=20) as rt:
        pipe.train_step_sync(rt, x, y, num_microbatches=2)
        grads = [p.grad.clone() for p in pipe.parameters()]
        weights = [p.detach().clone() for p in pipe.parameters()]
        pipe.eval_step_sync(rt, x, y, num_microbatches=4)
        again = pipe.train_step_sync(rt, x, y, num_microbatches=2)
    for p, g, w in zip(pipe.parameters(), grads, weights):
        assert torch.equal(p.detach(), w)
        torch.testing.assert_close(p.grad, 2 * g)  # the second train step added its own
    assert len(again) == 2


@pytest.mark.parametrize("kwargs, error, match", [
    ({"return_outputs": "yes"}, TypeError, r"return_outputs: expected a bool"),
    ({"schedule": "nope"}, ValueError, r"nope"),
    ({"num_microbatches": 3}, ValueError, r"num_microbatches=3"),
])
def test_bad_eval_step_arguments_are_named(kwargs, error, match):
    pipe = TorchPipeline(_stages()[:1], [DeviceMesh([0], ("tp",))], nn.functional.mse_loss)
    args = {"num_microbatches": 2, **kwargs}
    with Runtime(Cluster.local(1), timeout=20) as rt, pytest.raises(error, match=match):
        pipe.eval_step_sync(rt, torch.randn(4, 6, dtype=torch.float64),
                            torch.randn(4, 6, dtype=torch.float64), **args)


def test_a_meta_module_where_its_stage_runs_is_named():
    with torch.device("meta"):
        meta = _factory_stage(0)
    pipe = TorchPipeline([meta], [DeviceMesh([0], ("tp",))], nn.functional.mse_loss)
    with Runtime(Cluster.local(1), timeout=20) as rt, \
            pytest.raises(ValueError, match=r"modules\[0\]\[0\]: on the meta device .* pass a "
                                            r"stage_fn"):
        pipe.train_step_sync(rt, torch.randn(2, 6, dtype=torch.float64),
                             torch.randn(2, 6, dtype=torch.float64), num_microbatches=1)


# ---- microbatches of different lengths ----------------------------------------------------

class _Token(nn.Module):
    """Position-wise: works on any sequence length (dim 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 6)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved-1f1b", "auto"])
def test_microbatches_of_different_lengths_train_as_plain_torch(schedule):
    torch.manual_seed(0)
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if schedule == "interleaved-1f1b":
        rank_meshes = [DeviceMesh([0, 1], ("tp",)), DeviceMesh([2, 3], ("tp",))]
        meshes, plans = [rank_meshes[s % 2] for s in range(4)], [plan] * 4
    else:
        meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2], ("tp",)), DeviceMesh([3], ("tp",))]
        plans = [None, plan, None]
    modules = [_Token().double() for _ in meshes]
    reference = copy.deepcopy(modules)
    pipe = TorchPipeline(modules, meshes, nn.functional.mse_loss, plans=plans)
    gen = torch.Generator().manual_seed(2)
    lengths = [5, 12, 3, 12] if schedule == "interleaved-1f1b" else [5, 12, 3, 12, 7, 1]
    mbs = [(torch.randn(2, n, 6, generator=gen, dtype=torch.float64),
            torch.randn(2, n, 6, generator=gen, dtype=torch.float64)) for n in lengths]
    costs = (lambda s, k: 1e-3) if schedule == "auto" else None
    with Runtime(Cluster.local(4), timeout=20, compute_time=costs) as rt:
        losses, outputs = pipe.train_step_sync(rt, microbatches=mbs, schedule=schedule,
                                               scale_grads=True, return_outputs=True)
        val = pipe.eval_step_sync(rt, microbatches=mbs, schedule=schedule)
    want = reference_losses(reference, [x for x, _ in mbs], nn.functional.mse_loss,
                            [y for _, y in mbs], scale=1 / len(mbs))
    assert losses == pytest.approx(want, rel=1e-12) and val == pytest.approx(want, rel=1e-12)
    assert [tuple(o.shape) for o in outputs] == [(2, n, 6) for n in lengths]
    assert_grads_match(pipe, reference, rtol=1e-12, atol=1e-14)


def test_pre_split_microbatches_are_checked_before_any_work():
    pipe = TorchPipeline([_Token().double()], [DeviceMesh([0], ("tp",))],
                         nn.functional.mse_loss)
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    with Runtime(Cluster.local(1), timeout=20) as rt:
        for kwargs, error, match in [
            ({"microbatches": []}, TypeError, r"microbatches: expected a non-empty list"),
            ({"microbatches": [(x, x), x]}, TypeError, r"microbatches\[1\]: expected an "
                                                       r"\(input, target\) pair"),
            ({"microbatches": [(x, x[:1])]}, ValueError, r"microbatches\[0\]: its target must "
                                                         r"be a tensor with the input's 2 rows"),
            ({"microbatches": [x, x.float()]}, ValueError, r"microbatches\[1\]: 3-d "
                                                           r"torch.float32, microbatches\[0\]"),
            ({"microbatches": [x], "num_microbatches": 1}, ValueError,
             r"microbatches: give the step's microbatches already split, or inputs"),
            ({}, ValueError, r"num_microbatches: how many microbatches"),
        ]:
            with pytest.raises(error, match=match):
                pipe.train_step_sync(rt, **kwargs)
        assert all(p.grad is None for p in pipe.parameters())


def test_no_modules_with_a_seed_is_named_as_the_modules():
    from scheduler import DeviceMesh

    with pytest.raises(TypeError, match=r"modules: expected a stage_fn \(stage -> nn.Module\) "
                                        r"or a sequence with one entry per stage, got NoneType"):
        TorchPipeline(None, [DeviceMesh([0], ("x",))], lambda y: y.sum(), seed=1)
