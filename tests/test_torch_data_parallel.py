"""``TorchPipeline(..., data_parallel="dp")``: each stage's mesh axis ``dp`` splits the batch;
losses, outputs, gradients and clipping equal plain torch's on the whole batch, with TP on the
other axis, every schedule kind, one process and four under both launchers.

Expected values come from plain single-process torch on copies of the same modules
(``loss.backward()`` per whole microbatch), never from the runtime.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 "
                                            "(the 'torch' extra) to test overlap.torch")

from launchers import LAUNCHERS, launch  # noqa: E402
from torch import nn  # noqa: E402
from torch_reference import Block, assert_grads_match, reference_losses  # noqa: E402

from overlap import Runtime  # noqa: E402
from overlap.torch import (  # noqa: E402
    ColwiseParallel,
    RowwiseParallel,
    Shard,
    TorchPipeline,
    replicate,
)
from scheduler import Cluster, DeviceMesh, P  # noqa: E402

CLUSTER = Cluster.preset("p3.8xlarge", 3)
MEGATRON = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
DP2 = DeviceMesh([[0], [1]], ("dp", "tp"))  # dp 2
DPTP = DeviceMesh([[2, 3], [4, 5]], ("dp", "tp"))  # dp 2 × tp 2
ONE = DeviceMesh([[6]], ("dp", "tp"))  # dp 1
DP2B = DeviceMesh([[8], [9]], ("dp", "tp"))


def _loss(y, t):
    return (y - t).pow(2).mean()


def _pipeline(meshes, plans, **kwargs):
    torch.manual_seed(0)
    full = [Block().double() for _ in meshes]
    reference = copy.deepcopy(full)
    given = [m if plan is not None else replicate(m, len(mesh.device_ids))
             for m, mesh, plan in zip(full, meshes, plans)]
    pipe = TorchPipeline(given, meshes, _loss, plans=plans, axis="tp", data_parallel="dp",
                         **kwargs)
    return pipe, reference


def _batch(n=16):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 4, 8, generator=g, dtype=torch.float64),
            torch.randn(n, 4, 8, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("schedule", ["1f1b", "eager-1f1b", "zb-h1", "gpipe"])
def test_batch_split_stages_match_plain_torch(schedule):
    # dp 2; dp 2 × tp 2; a one-device stage between; dp 2 × tp 2 last.
    meshes = [DP2, DPTP, ONE, DeviceMesh([[8, 9], [10, 11]], ("dp", "tp"))]
    plans = [None, MEGATRON, None, MEGATRON]
    pipe, reference = _pipeline(meshes, plans)
    x, y = _batch()
    with Runtime(CLUSTER, timeout=30) as rt:
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=4, schedule=schedule)
        reduced = {(s.device, s.stream) for s in rt.timeline().spans if s.kind == "dp"}
    want = reference_losses(reference, x.chunk(4), _loss, y.chunk(4))
    assert losses == pytest.approx(want, rel=1e-12)
    assert_grads_match(pipe, reference, rtol=1e-10, atol=1e-12)
    # Every device of a batch-split stage reduced on its stage's own stream; stage 2 (dp 1)
    # has nothing to reduce.
    assert reduced == {(d, f"dp{s}") for s in (0, 1, 3) for d in meshes[s].device_ids}


def test_interleaved_stages_match_plain_torch():
    meshes = [DP2, DPTP, DP2, DPTP]  # two stages per rank
    plans = [None, MEGATRON, None, MEGATRON]
    pipe, reference = _pipeline(meshes, plans)
    x, y = _batch()
    with Runtime(CLUSTER, timeout=30) as rt:
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=4,
                                      schedule="interleaved-1f1b")
    want = reference_losses(reference, x.chunk(4), _loss, y.chunk(4))
    assert losses == pytest.approx(want, rel=1e-12)
    assert_grads_match(pipe, reference, rtol=1e-10, atol=1e-12)


def test_each_device_runs_its_part_of_the_batch():
    seen: dict[int, list[int]] = {}

    class Record(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8).double()

        def forward(self, x):
            seen.setdefault(id(self), []).append(x.shape[0])
            return self.lin(x)

    meshes = [DeviceMesh([[0], [1], [2], [3]], ("dp", "tp")), DP2B]
    mods = [replicate(Record(), 4), replicate(Record(), 2)]
    pipe = TorchPipeline(mods, meshes, _loss, data_parallel="dp")
    x, y = _batch(8)
    with Runtime(CLUSTER, timeout=30) as rt:
        pipe.train_step_sync(rt, x[:, 0], y[:, 0], num_microbatches=2, schedule="1f1b")
    # 2 microbatches of 4: a quarter each on stage 0's devices, a half on stage 1's.
    assert [seen[id(m)][-2:] for m in mods[0]] == [[1, 1]] * 4
    assert [seen[id(m)][-2:] for m in mods[1]] == [[2, 2]] * 2
    assert pipe.input_sharding.spec == P("dp")


def test_outputs_eval_and_clipping_are_the_whole_batchs():
    meshes = [DP2, DPTP]
    plans = [None, MEGATRON]
    pipe, reference = _pipeline(meshes, plans)
    x, y = _batch(8)
    with Runtime(CLUSTER, timeout=30) as rt:
        losses, outputs = pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule="1f1b",
                                               return_outputs=True)
        norm = pipe.clip_grad_norm_(1e-3)
        evals, eval_outputs = pipe.eval_step_sync(rt, x, y, num_microbatches=2,
                                                  return_outputs=True)
    model = nn.Sequential(*reference)
    want_out = [model(xm).detach() for xm in x.chunk(2)]
    reference_losses(reference, x.chunk(2), _loss, y.chunk(2))
    want_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    for got, want in zip(outputs, want_out):
        torch.testing.assert_close(got, want)
    for got, want in zip(eval_outputs, want_out):  # (eval ran before any optimizer step)
        torch.testing.assert_close(got, want)
    assert evals == pytest.approx(losses, rel=1e-12)
    torch.testing.assert_close(norm, want_norm.to(norm.dtype))
    # Clipped alike on every replica: they stay identical.
    for a, b in zip(pipe.modules[0][0].parameters(), pipe.modules[0][1].parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_the_sum_over_microbatches_with_scale_grads_false():
    pipe, reference = _pipeline([DP2, DP2B], [None, None])
    x, y = _batch(8)
    with Runtime(CLUSTER, timeout=30) as rt:
        pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule="1f1b", scale_grads=False)
    reference_losses(reference, x.chunk(2), _loss, y.chunk(2), scale=1.0)
    assert_grads_match(pipe, reference, rtol=1e-10, atol=1e-12)


def test_bfloat16_batch_split_matches_plain_torch_in_bfloat16():
    torch.manual_seed(0)
    full = [Block(16).to(torch.bfloat16) for _ in range(2)]
    reference = copy.deepcopy(full)
    pipe = TorchPipeline([replicate(full[0], 2), full[1]], [DP2, DPTP], _loss,
                         plans=[None, MEGATRON], axis="tp", data_parallel="dp")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 4, 16, generator=g).to(torch.bfloat16)
    y = torch.randn(8, 4, 16, generator=g).to(torch.bfloat16)
    with Runtime(CLUSTER, timeout=30) as rt:
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule="1f1b")
    want = reference_losses(reference, x.chunk(2), _loss, y.chunk(2))
    assert losses == pytest.approx(want, rel=2e-2)
    assert_grads_match(pipe, reference, rtol=5e-2, atol=5e-2)


# ---- bad inputs, named before anything runs --------------------------------------------


@pytest.mark.parametrize("value, error, match", [
    (3, TypeError, r"data_parallel: expected the name of a mesh axis"),
    ("rows", ValueError, r"data_parallel: no stage's mesh has an axis 'rows'"),
    ("tp", ValueError, r"data_parallel: 'tp' is the axis tensor-parallel plans split over"),
])
def test_bad_data_parallel_is_named(value, error, match):
    with pytest.raises(error, match=match):
        TorchPipeline([Block(), replicate(Block(), 2)], [DPTP, DP2B], _loss,
                      plans=[MEGATRON, None], axis="tp", data_parallel=value)


def test_a_batch_that_does_not_split_is_named():
    pipe, _ = _pipeline([DP2, DP2B], [None, None])
    x, y = _batch(6)
    with Runtime(CLUSTER, timeout=30) as rt, \
            pytest.raises(ValueError, match=r"data_parallel: .* batch of 3, which does not "
                                            r"split over stage 0's axis 'dp' of size 2"):
        pipe.train_step_sync(rt, x, y, num_microbatches=2)


def test_a_plan_that_shards_the_batch_dimension_is_named():
    plan = {**MEGATRON, "fc2": RowwiseParallel(output_layouts=Shard(0))}
    torch.manual_seed(0)
    pipe = TorchPipeline([Block().double(), replicate(Block().double(), 2)], [DPTP, DP2B],
                         _loss, plans=[plan, None], axis="tp", data_parallel="dp")
    x, y = _batch(8)
    with Runtime(CLUSTER, timeout=30) as rt, \
            pytest.raises(ValueError, match=r"plans\[0\] output layout: .* shards dimension 0, "
                                            r"the batch, which data_parallel='dp' splits"):
        pipe.train_step_sync(rt, x, y, num_microbatches=2)


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_four_processes_match_plain_torch(launcher, schedule):
    done = launch(launcher, 4, Path(__file__).parent / "mpi_jobs" / "data_parallel.py",
                  schedule, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert all(f"rank {r}: ok" in done.stdout for r in range(4)), done.stdout[-2000:]


def test_gradients_add_up_over_steps_without_zero_grad():
    pipe, reference = _pipeline([DP2, DP2B], [None, None])
    x, y = _batch(8)
    with Runtime(CLUSTER, timeout=30) as rt:
        for _ in range(2):  # (no zero_grad between: .grad accumulates, as in torch)
            pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule="1f1b")
    for _ in range(2):
        reference_losses(reference, x.chunk(2), _loss, y.chunk(2))
    assert_grads_match(pipe, reference, rtol=1e-10, atol=1e-12)


def test_outputs_come_in_batch_order_whatever_the_device_ids():
    # The last mesh's dp axis runs over devices 3 then 2: part 0 of the batch is device 3's.
    meshes = [DP2, DeviceMesh([[3], [2]], ("dp", "tp"))]
    pipe, reference = _pipeline(meshes, [None, None])
    x, y = _batch(8)
    with Runtime(CLUSTER, timeout=30) as rt:
        _, outputs = pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule="1f1b",
                                          return_outputs=True)
    model = nn.Sequential(*reference)
    for got, xm in zip(outputs, x.chunk(2)):
        torch.testing.assert_close(got, model(xm).detach())
