"""The torch adapter (overlap.torch): nn.Module stages on the CPU runtime.

Expected values come from plain single-process torch on copies of the same modules (the same
microbatches, ``(loss / m).backward()`` per microbatch: the mean over the m microbatches, the
pipeline's default), never from the runtime. Skipped, with the
reason, where torch is not installed; CI installs the ``torch`` extra.
"""

from __future__ import annotations

import copy
import re
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 "
                                            "(the 'torch' extra) to test overlap.torch")

from torch import nn  # noqa: E402

from overlap import Runtime, StreamError  # noqa: E402
from overlap.errors import CollectiveTimeout, OverlapRuntimeError, StageTimeout  # noqa: E402
from overlap.pipeline import Stage  # noqa: E402
from overlap.torch import TorchPipeline, replicate  # noqa: E402
from scheduler import SCHEDULES, Cluster, DeviceMesh  # noqa: E402

CLUSTER = Cluster.preset("p3.8xlarge", 4)
# One device; 2 replicas; one device; 2 replicas (the last stage replicated too).
MESHES = (CLUSTER.mesh([0], gpus=1), CLUSTER.mesh([1], gpus=2), CLUSTER.mesh([2], gpus=1),
          CLUSTER.mesh([3], gpus=2))
WIDTHS = (6, 8, 5, 7, 4)  # in, stage outputs
TIMEOUT = 20.0


def _stage(s: int, dtype: torch.dtype) -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTHS[s], WIDTHS[s + 1]), nn.Tanh()).to(dtype)


def _pipe(dtype: torch.dtype = torch.float64, seed: int = 0,
          loss_fn=nn.functional.mse_loss) -> tuple[TorchPipeline, nn.Module]:
    """The pipeline and a single-process reference holding copies of the same weights."""
    torch.manual_seed(seed)
    stages = [_stage(s, dtype) for s in range(len(MESHES))]
    ref = nn.Sequential(*(copy.deepcopy(m) for m in stages))
    modules = [replicate(m, len(mesh.device_ids)) for m, mesh in zip(stages, MESHES)]
    return TorchPipeline(modules, MESHES, loss_fn), ref


def _batch(n: int, dtype: torch.dtype = torch.float64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, WIDTHS[0], generator=g, dtype=dtype),
            torch.randn(n, WIDTHS[-1], generator=g, dtype=dtype))


def _reference(ref: nn.Module, x, y, m: int, loss_fn=nn.functional.mse_loss) -> list[float]:
    losses = []
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        loss = loss_fn(ref(xm), ym)
        (loss * (1.0 / m)).backward()  # (as the pipeline scales it: the mean, by default)
        losses.append(loss.item())
    return losses


def _assert_grads(pipe: TorchPipeline, ref: nn.Module, atol: float) -> None:
    """Every replica of every stage holds the reference's full parameter gradient."""
    for s, reps in enumerate(pipe.modules):
        want = list(ref[s].parameters())
        for k, m in enumerate(reps):
            for (name, p), w in zip(m.named_parameters(), want):
                assert p.grad is not None, f"modules[{s}][{k}].{name} got no gradient"
                torch.testing.assert_close(p.grad, w.grad, rtol=0, atol=atol,
                                           msg=f"gradient of modules[{s}][{k}].{name}")


# ---- numerics -----------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 3, 6])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_losses_and_gradients_match_plain_torch(schedule, m):
    pipe, ref = _pipe()
    x, y = _batch(2 * m)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=m, schedule=schedule)
    want = _reference(ref, x, y, m)
    np.testing.assert_allclose(losses, want, rtol=0, atol=1e-12)
    _assert_grads(pipe, ref, atol=1e-12)


@pytest.mark.parametrize("m", [1, 3, 6])
def test_the_split_backward_matches_plain_torch(m):
    # zb-h1: I computes the input's gradient with the graph kept, W the parameters' after.
    pipe, ref = _pipe()
    x, y = _batch(2 * m)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=m, schedule="zb-h1")
        kinds = {s.kind for s in rt.timeline().spans if s.stream == "compute"}
    assert kinds == {"F", "I", "W"}
    np.testing.assert_allclose(losses, _reference(ref, x, y, m), rtol=0, atol=1e-12)
    _assert_grads(pipe, ref, atol=1e-12)


@pytest.mark.parametrize("schedule, m", [("interleaved-1f1b", 4), ("interleaved-1f1b", 8),
                                         ("zbv", 1), ("zbv", 3), ("zbv", 8)])
def test_several_modules_per_rank_match_plain_torch(schedule, m):
    # 8 stages on the 4 meshes: stage s on the mesh of the schedule's rank for it (loop for
    # interleaved-1f1b, a V for zbv, which also splits the backward).
    from scheduler import make_schedule

    sched = make_schedule(schedule, 8, m)
    widths = (6, 8, 5, 7, 6, 8, 5, 7, 4)
    torch.manual_seed(3)
    mods = [nn.Sequential(nn.Linear(widths[s], widths[s + 1]), nn.Tanh()).double()
            for s in range(8)]
    ref = nn.Sequential(*(copy.deepcopy(mod) for mod in mods))
    meshes = [MESHES[sched.rank_of(s)] for s in range(8)]
    pipe = TorchPipeline([replicate(mod, len(mesh.device_ids)) for mod, mesh in
                          zip(mods, meshes)], meshes, nn.functional.mse_loss)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2 * m, 6, generator=g, dtype=torch.float64)
    y = torch.randn(2 * m, 4, generator=g, dtype=torch.float64)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=m, schedule=sched)
    np.testing.assert_allclose(losses, _reference(ref, x, y, m), rtol=0, atol=1e-12)
    _assert_grads(pipe, ref, atol=1e-12)


def test_auto_after_a_measured_step_matches_plain_torch_within_its_cap():
    pipe, ref = _pipe()
    x, y = _batch(12)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        pipe.train_step_sync(rt, x, y, num_microbatches=6, schedule="1f1b")  # measured
        for mod in pipe.parameters():
            mod.grad = None
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=6, schedule="auto",
                                      max_activations=2)
        peaks = [rt.timeline().peak_activations(s) for s in range(4)]
    assert max(peaks) <= 2
    np.testing.assert_allclose(losses, _reference(ref, x, y, 6), rtol=0, atol=1e-12)
    _assert_grads(pipe, ref, atol=1e-12)


def test_a_shared_mesh_the_schedule_does_not_place_together_is_named():
    pipe, _ = _pipe()
    pipe2 = TorchPipeline([replicate(_stage(s, torch.float64), len(MESHES[s % 2].device_ids))
                           for s in range(4)], [MESHES[s % 2] for s in range(4)],
                          nn.functional.mse_loss)
    x, y = _batch(4)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt, pytest.raises(
            ValueError, match="stage 0 and stage 2, which run on different ranks"):
        pipe2.train_step_sync(rt, x, y, num_microbatches=2, schedule="1f1b")
    assert pipe  # (the 4-mesh pipeline is unaffected)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_float32_sgd_steps_track_plain_torch(schedule):
    """Several optimizer steps with the user's own SGD and zero_grad, in float32."""
    pipe, ref = _pipe(torch.float32, seed=3)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        for step in range(3):
            x, y = _batch(8, torch.float32, seed=10 + step)
            opt.zero_grad()
            ref_opt.zero_grad()
            losses = pipe.train_step_sync(rt, x, y, num_microbatches=4, schedule=schedule)
            np.testing.assert_allclose(losses, _reference(ref, x, y, 4), rtol=0, atol=1e-6)
            _assert_grads(pipe, ref, atol=1e-6)
            opt.step()
            ref_opt.step()
    for s, reps in enumerate(pipe.modules):
        for m in reps:  # replicas saw identical gradients, so they are still identical
            for p, w in zip(m.parameters(), ref[s].parameters()):
                torch.testing.assert_close(p.detach(), w.detach(), rtol=0, atol=1e-6)


def test_gradients_accumulate_over_microbatches_and_steps():
    """With ``scale_grads=False`` .grad is the sum over microbatches (not their mean, not
    the last one), and a second step without zero_grad adds to it — torch's own
    accumulation rule."""
    pipe, ref = _pipe()
    x, y = _batch(8)
    per_mb = []
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        ref.zero_grad()
        nn.functional.mse_loss(ref(xm), ym).backward()
        per_mb.append([p.grad.clone() for p in ref.parameters()])
    total = [sum(gs) for gs in zip(*per_mb)]
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        pipe.train_step_sync(rt, x, y, num_microbatches=4, schedule="1f1b", scale_grads=False)
        first = [p.grad.clone() for p in pipe.modules[0][0].parameters()]
        pipe.train_step_sync(rt, x, y, num_microbatches=4, schedule="eager-1f1b",
                             scale_grads=False)
    for got, want, last in zip(first, total, per_mb[-1]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert not torch.allclose(got, last)  # a sum, not the last microbatch's alone
    stage_params = [list(ref[s].parameters()) for s in range(len(MESHES))]
    k = 0
    for s, reps in enumerate(pipe.modules):
        n = len(stage_params[s])
        for m in reps:
            for p, want in zip(m.parameters(), total[k:k + n]):
                torch.testing.assert_close(p.grad, 2 * want, rtol=0, atol=1e-12)
        k += n


def test_loss_without_targets():
    pipe, ref = _pipe(loss_fn=lambda out: (out * out).sum())
    x, _ = _batch(6)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = pipe.train_step_sync(rt, x, num_microbatches=3, schedule="gpipe")
    want = []
    for xm in x.chunk(3):
        loss = (ref(xm) ** 2).sum()
        (loss * (1.0 / 3)).backward()
        want.append(loss.item())
    np.testing.assert_allclose(losses, want, rtol=0, atol=1e-12)
    _assert_grads(pipe, ref, atol=1e-12)


async def test_train_step_awaited():
    pipe, ref = _pipe()
    x, y = _batch(4)
    async with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = await pipe.train_step(rt, x, y, num_microbatches=2)
    np.testing.assert_allclose(losses, _reference(ref, x, y, 2), rtol=0, atol=1e-12)
    _assert_grads(pipe, ref, atol=1e-12)


# ---- zero copy ----------------------------------------------------------------------------


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_cpu_crossings_share_memory():
    """The module reads the runtime's buffer itself and the runtime sends the module's output
    tensor itself (and the input gradient tensor itself): no copies in either direction."""
    # (a loss without targets: the pipeline's own stages, as a caller hands them to
    # rt.train_step, need no step values)
    pipe, _ = _pipe(loss_fn=lambda out: out.square().mean())
    seen: dict[str, list] = {"in": [], "out": [], "x": [], "y": [], "dx": [], "xt": []}
    def hook(mod, args, out) -> None:  # returns None: the output stays the module's
        seen["in"].append(args[0])
        seen["out"].append(out)

    for reps in pipe.modules:
        for m in reps:
            m.register_forward_hook(hook)

    def wrap(st: Stage, s: int, last: bool) -> Stage:
        def f(ctx, x):
            y = st.forward(ctx, x)
            seen["x"].append(x)
            if not last:
                seen["y"].append(y)
            seen["xt"].append(ctx.saved["x"][0])  # (the tensors that crossed in)
            return y

        def b(ctx, dy):
            xt = ctx.saved["x"][0]
            dx = st.backward(ctx, dy)
            if s > 0:
                seen["dx"].append((dx, xt.grad))
            return dx
        return Stage(st.mesh, f, b)

    p = len(pipe.stages)
    stages = [wrap(st, s, s == p - 1) for s, st in enumerate(pipe.stages)]
    x, _ = _batch(6)
    mbs, boundaries = None, None
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        mbs, _, boundaries = pipe.prepare(rt, x, None, 3)
        rt.train_step_sync(stages, boundaries, mbs, input_sharding=pipe.input_sharding,
                           schedule="1f1b")
    # The microbatches the runtime gets are views of the caller's batch.
    assert all(np.shares_memory(mb, x.numpy()) for mb in mbs)
    # Each module's input tensor is the runtime's array, at the same address.
    calls = sum(len(r) for r in pipe.modules) * 3
    assert len(seen["x"]) == calls and len(seen["in"]) == calls + len(pipe.modules)  # + probe
    for arr, t in zip(seen["x"], seen["xt"]):
        assert t.data_ptr() == _addr(arr)
    # What the runtime sends is the module output's memory, not a copy of it.
    outs = {o.data_ptr() for o in seen["out"]}
    assert seen["y"] and all(_addr(a) in outs for a in seen["y"])
    # The returned input gradient is the .grad tensor's memory.
    assert seen["dx"] and all(np.shares_memory(dx, g.numpy()) for dx, g in seen["dx"])


# ---- faults -------------------------------------------------------------------------------


class InjectedFault(Exception):
    """Raised inside a module on purpose."""


class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, box):
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        box = ctx.box
        box["calls"] += 1
        if box["calls"] == box["on"]:
            box["raised"] = InjectedFault("boom in backward")
            raise box["raised"]
        return g, None


class FaultyBackward(nn.Module):
    """Identity whose backward raises on its ``on``-th call."""

    def __init__(self, on: int) -> None:
        super().__init__()
        self.box = {"calls": 0, "on": on, "raised": None}

    def forward(self, x):
        return _Raise.apply(x, self.box)


class FaultyForward(nn.Module):
    def __init__(self, on: int) -> None:
        super().__init__()
        self.calls, self.on, self.raised = 0, on, None

    def forward(self, x):
        self.calls += 1
        if self.calls == self.on and torch.is_grad_enabled():  # not during the shape probe
            self.raised = InjectedFault("boom in forward")
            raise self.raised
        return x


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("phase", "stage", "replica"), [("B", 1, 1), ("B", 2, 0), ("F", 3, 1)])
def test_stage_raising_aborts_the_step_cleanly(schedule, phase, stage, replica):
    pipe, ref = _pipe()
    mod = pipe.modules[stage][replica]
    fault = FaultyBackward(on=2) if phase == "B" else FaultyForward(on=2)
    mod.append(fault)
    device = MESHES[stage].device_ids[replica]
    x, y = _batch(8)
    with Runtime(CLUSTER, timeout=30) as rt:
        with pytest.raises(StreamError) as info:
            pipe.train_step_sync(rt, x, y, num_microbatches=4, schedule=schedule)
        err = info.value
        assert not isinstance(err, CollectiveTimeout), err  # aborted, not timed out
        raised = fault.box["raised"] if phase == "B" else fault.raised
        assert raised is not None and err.__cause__ is raised
        assert err.device == device
        msg = str(err)
        assert re.search(rf"\bs{stage}\b", msg) and re.search(rf"\b{phase}\b", msg), msg
        assert re.search(rf"\bdevice {device}\b", msg), msg
        # The runtime is reusable; .grad holds a partial sum until zero_grad.
        del mod[-1]
        for p in pipe.parameters():
            p.grad = None
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=4, schedule=schedule)
    np.testing.assert_allclose(losses, _reference(ref, x, y, 4), rtol=0, atol=1e-12)
    _assert_grads(pipe, ref, atol=1e-12)


def test_a_weight_gradient_raising_in_w_fails_the_step_naming_w():
    # The split backward's W runs the engine from the kept gradients: a parameter hook that
    # raises there fails the step as W of that stage, and the runtime is reusable after.
    pipe, ref = _pipe()
    stage, replica = 2, 0
    weight = pipe.modules[stage][replica][0].weight
    calls, raised = [0], []

    def hook(g):
        calls[0] += 1
        if calls[0] == 2:
            raised.append(InjectedFault("boom in a weight's gradient"))
            raise raised[-1]
        return g

    handle = weight.register_hook(hook)
    device = MESHES[stage].device_ids[replica]
    x, y = _batch(8)
    schedule = "zb-h1"
    with Runtime(CLUSTER, timeout=30) as rt:
        with pytest.raises(StreamError) as info:
            pipe.train_step_sync(rt, x, y, num_microbatches=4, schedule=schedule)
        err = info.value
        assert raised and err.__cause__ is raised[0]
        assert err.device == device, err
        assert re.search(rf"\bs{stage}\b", str(err)) and re.search(r"\bW\b", str(err)), err
        handle.remove()
        for p in pipe.parameters():
            p.grad = None
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=4, schedule=schedule)
    np.testing.assert_allclose(losses, _reference(ref, x, y, 4), rtol=0, atol=1e-12)
    _assert_grads(pipe, ref, atol=1e-12)


# ---- bad arguments: named, before any work -------------------------------------------------


def _mods(dtype=torch.float64):
    torch.manual_seed(0)
    return [replicate(_stage(s, dtype), len(mesh.device_ids)) for s, mesh in enumerate(MESHES)]


class TupleOut(nn.Module):
    def forward(self, x):
        return x, x


class TextOut(nn.Module):
    def forward(self, x):
        return "activations"


def _bad_construction(what: str):
    mods = _mods()
    meshes, loss = list(MESHES), nn.functional.mse_loss
    if what == "not a module":
        mods[2] = [lambda x: x]
    elif what == "bare module for a 2-device mesh":
        mods[1] = mods[1][0]
    elif what == "too many modules for the mesh":
        mods[3] = [*mods[3], copy.deepcopy(mods[3][0])]
    elif what == "fewer stages than meshes":
        mods = mods[:3]
    elif what == "same module on two devices":
        mods[1] = [mods[1][0], mods[1][0]]
    elif what == "shared parameter across devices":
        mods[1][1][0].weight = mods[1][0][0].weight
    elif what == "replicas differ":
        mods[3] = [mods[3][0], _stage(3, torch.float64)]
    elif what == "missing loss_fn":
        loss = None
    elif what == "meshes not a sequence":
        meshes = MESHES[0]
    elif what == "overlapping meshes":  # partly: device 4 of meshes[1]'s [4, 5]
        meshes[2] = CLUSTER.mesh([1], gpus=1)
        mods[2] = _stage(2, torch.float64)
    elif what == "mesh not a DeviceMesh":
        meshes[1] = [4, 5]
    elif what == "module split over devices":
        mods[0] = [nn.Sequential(nn.Linear(6, 8).double(), nn.Linear(8, 8).double().to("meta"))]
    return mods, meshes, loss


BAD_CONSTRUCTION = [
    ("not a module", TypeError, r"modules\[2\]\[0\]"),
    ("bare module for a 2-device mesh", ValueError, r"modules\[1\].*2 devices"),
    ("too many modules for the mesh", ValueError, r"modules\[3\].*needs 2 modules"),
    ("fewer stages than meshes", ValueError, r"modules: 3 stages"),
    ("same module on two devices", ValueError, r"modules\[1\]\[1\].*same module"),
    ("shared parameter across devices", ValueError, r"modules\[1\]\[1\].*shared"),
    ("replicas differ", ValueError, r"modules\[3\]\[1\].*differs"),
    ("missing loss_fn", TypeError, r"loss_fn"),
    ("meshes not a sequence", TypeError, r"meshes"),
    ("overlapping meshes", ValueError, r"meshes\[2\].*device 4"),
    ("mesh not a DeviceMesh", TypeError, r"meshes\[1\]"),
    ("module split over devices", ValueError, r"modules\[0\]\[0\].*several devices"),
]


@pytest.mark.parametrize(("what", "exc", "match"), BAD_CONSTRUCTION,
                         ids=[b[0] for b in BAD_CONSTRUCTION])
def test_bad_construction_is_named(what, exc, match):
    mods, meshes, loss = _bad_construction(what)
    with pytest.raises(exc, match=match):
        TorchPipeline(mods, meshes, loss)


def _bad_step(what: str):
    """(pipeline, rt argument or None for the real runtime, inputs, targets, kwargs)."""
    mods = _mods()
    loss = nn.functional.mse_loss
    x, y = _batch(8)
    kw = {"num_microbatches": 4}
    rt = None
    if what == "rt not a Runtime":
        rt = "cpu"
    elif what == "inputs not a tensor":
        x = x.numpy()
    elif what == "batch does not split":
        kw["num_microbatches"] = 3
    elif what == "zero microbatches":
        kw["num_microbatches"] = 0
    elif what == "targets of another batch":
        y = y[:6]
    elif what == "inputs dtype differs from stage 0":
        x = x.float()
    elif what == "boundary dtype differs from the next stage":
        mods[2] = [_stage(2, torch.float32)]
    elif what == "module on another device":
        mods[3] = [m.to("meta") for m in mods[3]]
    elif what == "stage returns a string":
        mods[1] = [nn.Sequential(*m, TextOut()) for m in mods[1]]
    elif what == "last stage returns a tuple":
        mods[3] = [nn.Sequential(*m, TupleOut()) for m in mods[3]]
    elif what == "loss is not a scalar":
        loss = lambda out, tgt: (out - tgt) ** 2
    elif what == "targets missing for a two-argument loss":
        y = None
    elif what == "inputs of the wrong width":
        x = x[:, :5]
    elif what == "integer boundary":
        mods[0] = [nn.Sequential(*mods[0][0], _ToLong())]
    return TorchPipeline(mods, MESHES, loss), rt, x, y, kw


class _ToLong(nn.Module):
    def forward(self, x):
        return x.long()


BAD_STEP = [
    ("rt not a Runtime", TypeError, r"rt"),
    ("inputs not a tensor", TypeError, r"inputs"),
    ("batch does not split", ValueError, r"num_microbatches=3"),
    ("zero microbatches", ValueError, r"num_microbatches"),
    ("targets of another batch", ValueError, r"targets"),
    ("inputs dtype differs from stage 0", ValueError, r"inputs: dtype torch.float32"),
    ("boundary dtype differs from the next stage", ValueError,
     r"modules\[2\].*float32.*boundary 1.*float64"),
    ("module on another device", ValueError, r"modules\[3\]\[0\]: on the meta device.*device 12"),
    ("stage returns a string", TypeError, r"modules\[1\] forward: returned str; a stage "
                                          r"returns a tensor, or a tuple or dict of them"),
    ("last stage returns a tuple", TypeError, r"modules\[3\]: forward returned tuple; the last "
                                              r"stage must return one tensor"),
    ("loss is not a scalar", ValueError, r"loss_fn"),
    ("integer boundary", ValueError, r"modules\[0\].*int64"),
    ("targets missing for a two-argument loss", ValueError, r"loss_fn: .*without targets"),
    ("inputs of the wrong width", ValueError, r"modules\[0\]: forward failed .*\(2, 5\)"),
]


@pytest.mark.parametrize(("what", "exc", "match"), BAD_STEP, ids=[b[0] for b in BAD_STEP])
def test_bad_step_arguments_rejected_before_any_work(what, exc, match):
    pipe, bad_rt, x, y, kw = _bad_step(what)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        with pytest.raises(exc, match=match):
            pipe.train_step_sync(bad_rt if bad_rt is not None else rt, x, y, **kw)
        assert rt.backend.streams() == []  # nothing was launched
    assert all(p.grad is None for p in pipe.parameters())


def test_mesh_outside_the_runtime_cluster_is_named():
    pipe, _ = _pipe()
    x, y = _batch(4)
    with Runtime(Cluster.preset("p3.8xlarge", 2), timeout=TIMEOUT) as rt:
        with pytest.raises(ValueError, match=r"meshes: device 1[23] is outside"):
            pipe.train_step_sync(rt, x, y, num_microbatches=2)
        assert rt.backend.streams() == []


def test_replicate_counts():
    m = nn.Linear(2, 2)
    reps = replicate(m, 3)
    assert reps[0] is m and len({id(r) for r in reps}) == 3
    assert all(torch.equal(r.weight, m.weight) for r in reps)
    with pytest.raises(ValueError, match="n: expected a positive int"):
        replicate(m, 0)


def test_single_device_stages_from_a_bare_module_each():
    """A bare module stands for a one-device mesh; the 4-stage one-device-per-stage shape
    used by the example and the benchmark."""
    torch.manual_seed(0)
    meshes = [CLUSTER.mesh([h], gpus=1) for h in range(4)]
    mods = [nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).double()
            for _ in range(4)]
    ref = nn.Sequential(*(copy.deepcopy(m) for m in mods))
    pipe = TorchPipeline(mods, meshes, nn.functional.mse_loss)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 4, generator=g).double(), torch.randn(8, 4, generator=g).double()
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=4)
    np.testing.assert_allclose(losses, _reference(ref, x, y, 4), rtol=0, atol=1e-12)
    for m, r in zip(mods, ref):
        for p, w in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(p.grad, w.grad, rtol=0, atol=1e-12)
    assert isinstance(pipe.meshes[0], DeviceMesh)


def test_boundary_probe_leaves_no_trace():
    """Running statistics (BatchNorm) after a step are plain torch's after the same
    microbatches: the shape probe must not have updated them."""
    torch.manual_seed(0)
    meshes = [CLUSTER.mesh([h], gpus=1) for h in range(2)]
    mods = [nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU()).double(),
            nn.Sequential(nn.Linear(6, 3), nn.BatchNorm1d(3)).double()]
    ref = nn.Sequential(*(copy.deepcopy(m) for m in mods))
    pipe = TorchPipeline(mods, meshes, nn.functional.mse_loss)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, 4, generator=g, dtype=torch.float64)
    y = torch.randn(12, 3, generator=g, dtype=torch.float64)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=3, schedule="1f1b")
    want = _reference(ref, x, y, 3)
    np.testing.assert_allclose(losses, want, rtol=0, atol=1e-12)
    for m, r in zip(mods, ref):
        for (name, b), rb in zip(m.named_buffers(), r.buffers()):
            torch.testing.assert_close(b, rb, rtol=0, atol=1e-12, msg=name)


def test_boundary_probe_draws_nothing_from_the_rng():
    """A dropout stage: finding the boundaries leaves torch's global generator untouched."""
    torch.manual_seed(0)
    meshes = [CLUSTER.mesh([h], gpus=1) for h in range(2)]
    mods = [nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5)), nn.Linear(6, 3)]
    pipe = TorchPipeline(mods, meshes, nn.functional.mse_loss)
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    torch.manual_seed(3)
    bounds = pipe.boundaries(x, y)
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(4))
    assert [b.shape for b in bounds] == [(4, 6)] and bounds[0].dtype == "float32"


def _cuda_ready() -> bool:
    from overlap.backends.devices.cuda import gpu_count

    return bool(torch.cuda.is_available()) and gpu_count() > 0


@pytest.mark.skipif(not _cuda_ready(), reason="no CUDA device with CUDA torch and CuPy: the "
                    "adapter's CUDA path (DLPack on the op's stream) runs on a GPU machine")
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cuda_backend_matches_plain_torch(schedule):
    pipe_cpu, ref = _pipe(torch.float32, seed=4)
    x, y = _batch(8, torch.float32)
    with Runtime(CLUSTER, backend="cuda", timeout=60) as rt:
        modules = [[m.to(f"cuda:{rt.backend.physical(d)}") for m, d in zip(reps, mesh.device_ids)]
                   for reps, mesh in zip(pipe_cpu.modules, MESHES)]
        pipe = TorchPipeline(modules, MESHES, nn.functional.mse_loss)
        losses = pipe.train_step_sync(rt, x.cuda(), y.cuda(), num_microbatches=4,
                                      schedule=schedule)
        torch.cuda.synchronize()
    np.testing.assert_allclose(losses, _reference(ref, x, y, 4), rtol=1e-4, atol=1e-5)
    for s, reps in enumerate(pipe.modules):
        for m in reps:
            for p, w in zip(m.parameters(), ref[s].parameters()):
                torch.testing.assert_close(p.grad.cpu(), w.grad, rtol=1e-4, atol=1e-5)


# ---- PyTorch profiler ---------------------------------------------------------------------


def test_the_pytorch_profiler_sees_every_op_and_step_as_a_record_function_range(tmp_path):
    import json
    import threading

    from overlap.torch import profiler
    from scheduler.traces.kineto import kineto_work

    pipe, _ = _pipe()
    x, y = _batch(6)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        pipe.train_step_sync(rt, x, y, num_microbatches=3)  # not recorded: no profiler yet
        with profiler() as prof:
            pipe.train_step_sync(rt, x, y, num_microbatches=3)
        pipe.train_step_sync(rt, x, y, num_microbatches=3)  # after it: not recorded
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    data = json.loads((tmp_path / "trace.json").read_text())
    ours = [e for e in data["traceEvents"] if e.get("cat") == "user_annotation"]
    names = [e["name"] for e in ours]
    assert names.count("step 1") == 1 and "step 0" not in names and "step 2" not in names
    # 6 devices (1 + 2 + 1 + 2) run an F and a B per microbatch, each on its stream thread
    compute = [e for e in ours if re.match(r"^[FB] s\d mb\d on device \d+$", e["name"])]
    assert len(compute) == 6 * 3 * 2
    assert "F s1 mb2 on device 4" in names and any(n.startswith("reshard s0->s1 mb") for n in names)
    assert "unknown" not in names  # (torch exports a non-ASCII name as "unknown")
    assert {e["tid"] for e in compute} - {threading.get_native_id()}, "recorded on stream threads"
    assert kineto_work(data).steps.keys() == {1}


def test_without_a_profiler_no_record_function_range_is_opened(monkeypatch):
    opened = []
    monkeypatch.setattr(torch.ops.profiler, "_record_function_enter_new",
                        lambda *a: opened.append(a))
    pipe, _ = _pipe()
    x, y = _batch(4)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        pipe.train_step_sync(rt, x, y, num_microbatches=2)
    assert opened == []


# ---- the intra-op threads stage functions run with ---------------------------------------------


def _omp_threads() -> int:
    """The OpenMP team size of the calling thread (what a BLAS call there would use) — read
    from the OpenMP runtime itself where it can be: ``torch.get_num_threads()`` first applies
    torch's own setting to a new thread, and would hide that nothing did before."""
    import ctypes

    try:
        return int(ctypes.CDLL(None).omp_get_max_threads())
    except (OSError, AttributeError):  # (no OpenMP symbol in this process)
        return torch.get_num_threads()


class _Threads(nn.Module):
    """A linear layer that notes, per thread, the intra-op threads it runs with."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.seen: dict[str, int] = {}

    def forward(self, x):
        import threading

        self.seen[threading.current_thread().name] = _omp_threads()
        return self.lin(x)


@pytest.mark.parametrize("asked", [None, 3])
def test_stage_functions_run_with_the_callers_intra_op_setting_or_the_one_asked(asked):
    """Stage functions run on the runtime's stream threads, where the caller's
    ``torch.set_num_threads`` does not reach by itself: each gets the caller's setting (or
    ``num_threads``), on its own thread."""
    mesh = [CLUSTER.mesh([h], gpus=1) for h in range(2)]
    modules = [_Threads(), _Threads()]
    pipe = TorchPipeline(modules, mesh, nn.functional.mse_loss, num_threads=asked)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
        with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
            pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule="gpipe")
        assert torch.get_num_threads() == 1  # (the caller's own setting is left alone)
    finally:
        torch.set_num_threads(before)
    want = 1 if asked is None else asked
    for m in modules:
        stream_threads = {t: n for t, n in m.seen.items() if t.startswith("overlap-")}
        assert stream_threads and set(stream_threads.values()) == {want}, m.seen


def test_several_ranks_on_a_host_share_its_cores_unless_omp_num_threads_says(monkeypatch):
    from overlap.torch import threads
    from overlap.world import World

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "host_cores", lambda: 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert threads.default_threads(World()) == 16  # one process: the caller's
    assert threads.default_threads(World(1, 4, 1, 4, "mpi")) == 4  # 16 cores / 4 local ranks
    assert threads.default_threads(World(5, 8, 1, 32, "mpi")) == 1  # at least one
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert threads.default_threads(World(1, 4, 1, 4, "mpi")) == 2  # never more than asked
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert threads.default_threads(World(1, 4, 1, 4, "mpi")) == 3  # the user's variable wins


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-2, ValueError), (1.5, TypeError),
                                      (True, TypeError), ("2", TypeError)])
def test_a_bad_thread_count_is_named_before_anything_runs(bad, exc):
    with pytest.raises(exc, match="num_threads"):
        TorchPipeline([nn.Linear(2, 2)], [CLUSTER.mesh([0], gpus=1)], nn.functional.mse_loss,
                      num_threads=bad)


_RELEASE = threading.Event()  # (module-level: replicate() deep-copies a module's attributes)


class _Hangs(nn.Module):
    """A stage whose forward blocks until ``_RELEASE`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _stage(1, torch.float64)

    def forward(self, x):
        _RELEASE.wait(60.0)
        return self.inner(x)


def test_a_stage_that_hangs_in_the_shape_probe_is_a_stage_timeout_naming_it():
    """The probe (each stage's first run on a new shape, before the step) is user code like
    any op: bounded by the runtime's timeout, named, and the pipeline refuses further steps
    while its thread may still be running the modules."""
    stages = [_stage(s, torch.float64) for s in range(len(MESHES))]
    stages[1] = _Hangs()
    _RELEASE.clear()
    modules = [replicate(m, len(mesh.device_ids)) for m, mesh in zip(stages, MESHES)]
    pipe = TorchPipeline(modules, MESHES, nn.functional.mse_loss)
    x, y = _batch(8)
    with Runtime(CLUSTER, timeout=0.3) as rt:
        start = time.perf_counter()
        with pytest.raises(StageTimeout, match=r"modules\[1\] never finished its first run on "
                                               r"microbatch 0 \(2, 6\)") as err:
            pipe.train_step_sync(rt, x, y, num_microbatches=4)
        assert time.perf_counter() - start < 0.3 + 5.0  # (bounded: not the 60 s wait)
        assert (err.value.stage, err.value.microbatch, err.value.phase) == (1, 0, "F")
        assert err.value.device == MESHES[1].device_ids[0]
        _RELEASE.set()
        with pytest.raises(OverlapRuntimeError, match="shape probe is still running "
                                                      r"modules\[1\]"):
            pipe.train_step_sync(rt, x, y, num_microbatches=4)
