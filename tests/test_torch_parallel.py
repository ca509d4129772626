"""Tensor-parallel torch stages (overlap.torch.parallel): numerics against plain torch, the
boundary layouts the plans imply, and a named error for every bad plan.

Expected values come from plain single-process torch on copies of the same full modules
(``loss.backward()`` per microbatch), never from the runtime.
"""

from __future__ import annotations

import copy
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 "
                                            "(the 'torch' extra) to test overlap.torch")

from launchers import LAUNCHERS, launch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch_reference import Block, assert_grads_match, reference_losses  # noqa: E402

from overlap import Runtime  # noqa: E402
from overlap.torch import (  # noqa: E402
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    TorchPipeline,
    parallelize,
)
from scheduler import Cluster, DeviceMesh, P, Sharding  # noqa: E402

CLUSTER = Cluster.preset("p3.8xlarge", 3)
TIMEOUT = 30.0


MEGATRON = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
SEQUENCE = {"ln": SequenceParallel(), "fc1": ColwiseParallel(input_layouts=Shard(1)),
            "fc2": RowwiseParallel(output_layouts=Shard(1))}


def _sum_loss(y):
    return y.pow(2).mean()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("plan", [MEGATRON, SEQUENCE], ids=["megatron", "sequence"])
def test_tensor_parallel_stages_match_plain_torch(plan, schedule):
    # TP 1, 2, 4 and a 2x2 mesh (tp split, dp replicating): the planner reshards between.
    torch.manual_seed(0)
    meshes = [DeviceMesh([[0]], ("dp", "tp")), DeviceMesh([[1, 2]], ("dp", "tp")),
              DeviceMesh([[4, 5, 6, 7]], ("dp", "tp")), DeviceMesh([[8, 9], [10, 11]],
                                                                    ("dp", "tp"))]
    modules = [Block().double() for _ in meshes]
    reference = copy.deepcopy(modules)
    last = {**plan, "": PrepareModuleOutput(Shard(1), Replicate())} if plan is SEQUENCE else plan
    pipe = TorchPipeline(modules, meshes, _sum_loss, plans=[plan, plan, plan, last], axis="tp")
    x = torch.randn(8, 4, 8, dtype=torch.float64)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = pipe.train_step_sync(rt, x, num_microbatches=4, schedule=schedule)
    want = reference_losses(reference, x.chunk(4), _sum_loss)
    assert losses == pytest.approx(want, rel=1e-12)
    assert_grads_match(pipe, reference, rtol=1e-10, atol=1e-10)
    # The gathered state is the full module's, under its names.
    for s in range(len(meshes)):
        state = pipe.stage_state_dict(s)
        assert list(state) == list(reference[s].state_dict())
        for key, value in reference[s].state_dict().items():
            torch.testing.assert_close(state[key], value)


def test_boundary_layouts_follow_the_plans():
    meshes = [DeviceMesh([0, 1], ("tp",)), DeviceMesh([[4, 5], [6, 7]], ("dp", "tp")),
              DeviceMesh([8, 9, 10, 11], ("tp",))]
    modules = [Block() for _ in meshes]
    pipe = TorchPipeline(modules, meshes, _sum_loss, plans=[SEQUENCE, MEGATRON, {
        "": PrepareModuleInputOutput(Shard(1), Replicate(), Replicate(), Replicate()),
        **MEGATRON}], axis="tp")
    x = torch.randn(2, 4, 8)
    b0, b1 = pipe.boundaries(x)
    assert b0.producer == Sharding(meshes[0], P(None, "tp"))  # sequence-sharded out
    assert b0.consumer == Sharding(meshes[1], P())  # row-parallel last: replicated
    assert b1.producer == Sharding(meshes[1], P())
    assert b1.consumer == Sharding(meshes[2], P(None, "tp"))  # declared on the root
    assert pipe.input_sharding == Sharding(meshes[0], P(None, "tp"))
    rows = pipe.boundary_report(CLUSTER, x)
    assert [(r.boundary, r.direction) for r in rows] == [(0, "fwd"), (0, "bwd"), (1, "fwd"),
                                                         (1, "bwd")]
    for r in rows:
        assert r.bound_seconds > 0 and r.plan_seconds >= r.bound_seconds * (1 - 1e-9)
        assert r.ratio >= 1 - 1e-9 and r.transfers > 0 and "ratio" in str(r)


def test_vocabulary_parallel_embedding_and_gathered_head_match_plain_torch():
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.head = nn.Embedding(12, 8), nn.Linear(8, 12, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.tok(ids)))

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    torch.manual_seed(1)
    for embed in (RowwiseParallel(), ColwiseParallel(output_layouts=Replicate())):
        model = LM().double()
        reference = [copy.deepcopy(model)]
        plan = {"tok": embed, "head": ColwiseParallel(output_layouts=Replicate())}
        pipe = TorchPipeline([model], [DeviceMesh([0, 1, 2, 3], ("tp",))], loss_fn,
                             plans=[plan])
        ids = torch.randint(12, (4, 5))
        target = torch.randint(12, (4, 5))
        with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
            losses = pipe.train_step_sync(rt, ids, target, num_microbatches=2,
                                          schedule="1f1b")
        want = reference_losses(reference, ids.chunk(2), loss_fn, target.chunk(2))
        assert losses == pytest.approx(want, rel=1e-12)
        assert_grads_match(pipe, reference, rtol=1e-10, atol=1e-10)


def test_heads_are_split_per_shard():
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 4
            self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            b, t, _ = x.shape
            q = self.q(x).view(b, t, self.num_heads, -1).softmax(-1)
            return self.o(q.reshape(b, t, -1))

    torch.manual_seed(2)
    model = Attn().double()
    reference = [copy.deepcopy(model)]
    tp = parallelize(model, DeviceMesh([0, 1], ("tp",)), {"q": ColwiseParallel(),
                                                          "o": RowwiseParallel()})
    assert [m.num_heads for m in tp.modules] == [2, 2] and model.num_heads == 4
    pipe = TorchPipeline([model], [DeviceMesh([0, 1], ("tp",))], _sum_loss,
                         plans=[{"q": ColwiseParallel(), "o": RowwiseParallel()}])
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = pipe.train_step_sync(rt, x, num_microbatches=1, schedule="gpipe")
    assert losses == pytest.approx(reference_losses(reference, [x], _sum_loss), rel=1e-12)
    assert_grads_match(pipe, reference, rtol=1e-10, atol=1e-10)


def test_bfloat16_tensor_parallel_step_matches_plain_torch_in_bfloat16():
    torch.manual_seed(3)
    meshes = [DeviceMesh([0, 1], ("tp",)), DeviceMesh([4, 5, 6, 7], ("tp",))]
    modules = [Block().to(torch.bfloat16) for _ in meshes]
    reference = copy.deepcopy(modules)
    pipe = TorchPipeline(modules, meshes, _sum_loss, plans=[MEGATRON, MEGATRON])
    x = torch.randn(4, 4, 8).to(torch.bfloat16)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        (b,) = pipe.boundaries(x[:2])
        assert b.dtype == "bfloat16"
        losses = pipe.train_step_sync(rt, x, num_microbatches=2, schedule="1f1b")
    want = reference_losses(reference, x.chunk(2), _sum_loss)
    assert losses == pytest.approx(want, rel=2 ** -6)
    # The sums over the axis round in another order than one matmul: a few bf16 ulps.
    for reps in pipe.modules:
        for module in reps:
            for p in module.parameters():
                assert p.grad.dtype == torch.bfloat16
    assert_grads_match(pipe, reference, rtol=2 ** -4, atol=2 ** -4)


# ---- named errors, before anything runs ---------------------------------------------------


MESH2 = DeviceMesh([0, 1], ("tp",))


@pytest.mark.parametrize("plan, error, match", [
    ({"fc3": ColwiseParallel()}, ValueError, r"plan\['fc3'\]: Block has no submodule 'fc3'"),
    ({"ln": ColwiseParallel()}, TypeError, r"plan\['ln'\]: ColwiseParallel supports nn.Linear, "
                                           r"nn.Embedding; ln is LayerNorm"),
    ({"fc1": SequenceParallel()}, TypeError, r"plan\['fc1'\]: SequenceParallel supports"),
    ({"fc1": "colwise"}, TypeError, r"plan\['fc1'\]: expected a parallel style"),
    ({"": ColwiseParallel()}, ValueError, r"plan\[''\]: the root takes PrepareModuleInput"),
    ({1: ColwiseParallel()}, TypeError, r"plan: keys are submodule names"),
])
def test_bad_plans_are_named(plan, error, match):
    with pytest.raises(error, match=match):
        parallelize(Block(), MESH2, plan)


def test_a_dimension_that_does_not_split_is_named():
    with pytest.raises(ValueError, match=r"plan\['fc1'\]: out_features \(16\) does not split "
                                         r"over the mesh axis of size 3"):
        parallelize(Block(), DeviceMesh([0, 1, 2], ("tp",)), {"fc1": ColwiseParallel()})
    with pytest.raises(ValueError, match=r"plan\['fc2'\]: in_features \(16\) does not split"):
        parallelize(Block(), DeviceMesh([0, 1, 2], ("tp",)), {"fc2": RowwiseParallel()})


def test_heads_that_do_not_split_are_named():
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n_heads = 3
            self.q = nn.Linear(8, 8)

    with pytest.raises(ValueError, match=r"plan: the module.n_heads = 3 heads do not split over "
                                         r"the mesh axis of size 2"):
        parallelize(Attn(), MESH2, {"q": ColwiseParallel()})


@pytest.mark.parametrize("kwargs, error, match", [
    ({"mesh": DeviceMesh([[0, 1]], ("dp", "tp"))}, ValueError, r"axis: mesh .* has axes "
                                                               r"\('dp', 'tp'\); name the one"),
    ({"axis": "x"}, ValueError, r"axis: 'x' is not an axis of mesh"),
    ({"mesh": [0, 1]}, TypeError, r"mesh: expected a scheduler.DeviceMesh"),
    ({"plan": [("fc1", ColwiseParallel())]}, TypeError, r"plan: expected a dict"),
])
def test_bad_parallelize_arguments_are_named(kwargs, error, match):
    args = {"mesh": MESH2, "plan": MEGATRON, **kwargs}
    with pytest.raises(error, match=match):
        parallelize(Block(), args.pop("mesh"), args.pop("plan"), **args)


@pytest.mark.parametrize("style, match", [
    (lambda: ColwiseParallel(output_layouts=Shard(0)), r"ColwiseParallel.output_layouts"),
    (lambda: RowwiseParallel(input_layouts=Shard(1)), r"RowwiseParallel.input_layouts"),
    (lambda: ColwiseParallel(input_layouts="replicate"), r"expected Replicate\(\) or Shard"),
    (lambda: PrepareModuleInput((Shard(1), Shard(0))), r"only the first positional input"),
    (lambda: Shard(1.5), r"Shard: dim must be an int"),
])
def test_bad_styles_are_named(style, match):
    with pytest.raises((TypeError, ValueError), match=match):
        style()


def test_pipeline_plan_errors_are_named():
    meshes = [MESH2, DeviceMesh([2, 3], ("tp",))]
    with pytest.raises(ValueError, match=r"plans: 1 entries, but meshes has 2 stages"):
        TorchPipeline([Block(), Block()], meshes, _sum_loss, plans=[MEGATRON])
    with pytest.raises(ValueError, match=r"axis: 'tp' names the axis tensor-parallel plans "
                                         r"split over, and no plans= were given"):
        TorchPipeline([Block(), Block()], meshes, _sum_loss, axis="tp")
    with pytest.raises(TypeError, match=r"plans: expected one plan \(a dict\) or None per"):
        TorchPipeline([Block(), Block()], meshes, _sum_loss, plans=MEGATRON)
    with pytest.raises(TypeError, match=r"modules\[1\]: a stage with a plan takes one full "
                                        r"nn.Module"):
        TorchPipeline([Block(), [Block(), Block()]], meshes, _sum_loss,
                      plans=[MEGATRON, MEGATRON])
    with pytest.raises(ValueError, match=r"plans\[1\]: plan\['fc9'\]: Block has no submodule"):
        TorchPipeline([Block(), Block()], meshes, _sum_loss, plans=[None, {"fc9":
                                                                           RowwiseParallel()}])
    # The loss needs the whole output: a last stage that leaves it sharded is refused.
    with pytest.raises(ValueError, match=r"plans\[1\]: the last stage's output is Shard\(dim=1\); "
                                         r"loss_fn needs the whole output"):
        TorchPipeline([Block(), Block()], meshes, _sum_loss, plans=[MEGATRON, SEQUENCE])


def test_a_layout_that_does_not_fit_the_boundary_is_named():
    # Stage 0 hands on Shard(1) over 2 devices; a sequence of 3 does not split.
    meshes = [MESH2, DeviceMesh([2, 3], ("tp",))]
    pipe = TorchPipeline([Block(), Block()], meshes, _sum_loss, plans=[SEQUENCE, {
        "": PrepareModuleInput(Shard(1), Replicate()), **MEGATRON}])
    with pytest.raises(ValueError, match=r"plans\[0\]: stage 0's input layout "
                                         r"Shard\(dim=1\) splits dimension 1 of inputs: a "
                                         r"microbatch \(3\) over mesh axis 'tp' of size 2"):
        pipe.boundaries(torch.randn(2, 3, 8))
    # A layout on a dimension the tensor lacks.
    pipe = TorchPipeline([Block(), Block()], meshes, _sum_loss, plans=[
        {"": PrepareModuleOutput(Shard(5), Shard(5))}, MEGATRON])
    with pytest.raises(ValueError, match=r"plans\[0\] output layout: Shard\(dim=5\) names no "
                                         r"dimension of a rank-3 tensor"):
        pipe.boundaries(torch.randn(2, 4, 8))


def test_a_tensor_parallel_module_outside_a_pipeline_says_so():
    tp = parallelize(Block(), MESH2, MEGATRON)
    with pytest.raises(RuntimeError, match=r"fc2 output: a tensor-parallel module runs only "
                                           r"inside a pipeline stage function"):
        tp.modules[0](torch.randn(1, 2, 8))


def test_a_tensor_parallel_device_sharing_a_gpu_is_refused(monkeypatch):
    # The CUDA backend on the CuPy stand-in (one GPU): every virtual device on GPU 0.
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import fake_cupy

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake_cupy.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", fake_cupy.nccl)
    cluster = Cluster.preset("p3.8xlarge", 1)
    pipe = TorchPipeline([Block(), Block()], [MESH2, DeviceMesh([2], ("tp",))], _sum_loss,
                         plans=[MEGATRON, None])
    match = r"plans\[0\]: device 0 of this tensor-parallel stage shares GPU 0 with devices \[1, 2\]"
    with Runtime(cluster, backend="cuda", timeout=TIMEOUT) as rt, \
            pytest.raises(ValueError, match=match):
        pipe.train_step_sync(rt, torch.randn(2, 2, 8), num_microbatches=1)


def test_stage_index_is_checked():
    pipe = TorchPipeline([Block()], [MESH2], _sum_loss, plans=[MEGATRON])
    with pytest.raises(ValueError, match=r"stage: expected an int in 0..0, got 1"):
        pipe.stage_state_dict(1)
    with pytest.raises(TypeError, match=r"cluster: expected a scheduler.Cluster or an "
                                        r"overlap.Runtime"):
        pipe.boundary_report("dgx", torch.randn(1, 2, 8))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_state_dict_of_a_stage_across_processes_is_refused_under_a_launcher(launcher):
    from pathlib import Path

    done = launch(launcher, 2, Path(__file__).parent / "mpi_jobs" / "tp_state_dict.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rank 0: ok" in done.stdout and "rank 1: ok" in done.stdout


def test_projections_of_one_input_reduce_its_gradient_once(monkeypatch):
    # q, k and v column-parallel on one replicated input: one all-reduce of the input's
    # gradient per microbatch and device (Megatron's), not three — same numerics.
    from overlap.pipeline import StageContext

    class QKV(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(8, 8) for _ in range(3))
            self.o = nn.Linear(8, 8)

        def forward(self, x):
            return self.o(self.q(x) * self.k(x) + self.v(x))

    calls: list[str] = []
    real = StageContext.all_reduce

    def counted(self, x, axis=None):
        calls.append(self.phase)
        return real(self, x, axis)

    monkeypatch.setattr(StageContext, "all_reduce", counted)
    torch.manual_seed(4)
    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2], ("tp",))]
    modules = [nn.Linear(8, 8).double(), QKV().double()]
    reference = copy.deepcopy(modules)
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel()}
    pipe = TorchPipeline(modules, meshes, _sum_loss, plans=[None, plan])
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = pipe.train_step_sync(rt, x, num_microbatches=2, schedule="1f1b")
    assert losses == pytest.approx(reference_losses(reference, x.chunk(2), _sum_loss), rel=1e-12)
    assert_grads_match(pipe, reference, rtol=1e-10, atol=1e-10)
    # Per microbatch and device: forward one (o's sum), backward one (the shared input's).
    assert calls.count("F") == 2 * 2 and calls.count("B") == 2 * 2


class NanoAttention(nn.Module):
    """nanoGPT's causal self-attention: one fused q/k/v Linear, sizes kept as attributes."""

    def __init__(self, n_embd: int = 8, n_head: int = 2) -> None:
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class NanoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = NanoAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


def test_a_shard_that_reshapes_with_the_full_sizes_says_which_module_and_sizes():
    # nanoGPT's attention splits its fused projection by the full n_embd: in a shard of a
    # column-parallel c_attn that fails with a bare shape error; the step's error names the
    # module, the split projections and the sizes it keeps, per shard.
    from overlap.errors import StreamError
    from overlap.torch.shard_errors import ShardForwardError

    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2], ("tp",))]
    plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel()}
    pipe = TorchPipeline([NanoBlock().double(), NanoBlock().double()], meshes, _sum_loss,
                         plans=[None, plan])
    assert [m.attn.n_head for m in pipe.tp[1].modules] == [1, 1]  # (n_head divided per shard)
    x = torch.randn(4, 4, 8, dtype=torch.float64)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt, pytest.raises(StreamError) as info:
        pipe.train_step_sync(rt, x, num_microbatches=2, schedule="1f1b")
    cause = info.value.__cause__
    assert isinstance(cause, ShardForwardError), info.value
    assert isinstance(cause.__cause__, ValueError)  # (the shard's own error, kept as the cause)
    msg = str(cause)
    assert msg.startswith("plans[1]: attn (NanoAttention) failed in its tensor-parallel shard")
    assert "attn.c_attn" in msg and "1/2 of their output features" in msg
    assert "attn.n_embd = 8 (per shard 4)" in msg
    assert "attn.n_head = 1 (divided per shard already)" in msg
    assert "attn.c_attn project to 3 × their input (a fused q/k/v)" in msg
