"""Under a launcher with 2 processes (``mpiexec -n 2``, ``torchrun --nproc-per-node 2``):
``TorchPipeline(stage_fn, ..., rt=rt)`` builds for real only this rank's stages (the others
on the meta device), hands the optimizer only their parameters, and trains them as plain
single-process torch trains the same model (built by the same factory under the same
seeds), with the whole model's gradient clipped as plain torch clips it (every rank's part
counted once: ``pipe.clip_grad_norm_``). Stage 1 is tensor-parallel across both ranks.
Prints "rank r: ok" when all of that holds."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn

import overlap
from overlap.torch import ColwiseParallel, RowwiseParallel, TorchPipeline
from scheduler import Cluster, DeviceMesh

SEED = 7
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}
built: list[int] = []  # the stages this process built for real


def stage_fn(s: int) -> nn.Module:
    if not torch.empty(0).is_meta:
        built.append(s)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


def reference_stage(s: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + s)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


def main() -> int:
    torch.set_num_threads(1)
    # Stage 0 on rank 0's device, stage 1 across both ranks, stage 2 on rank 1's.
    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2], ("tp",)), DeviceMesh([3], ("tp",))]
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    with overlap.Runtime(Cluster.local(4), timeout=30) as rt:
        rank = rt.world.rank
        pipe = TorchPipeline(stage_fn, meshes, lambda y: y.pow(2).mean(), rt=rt,
                             plans=[None, PLAN, None], seed=SEED)
        mine = {0: [0, 1], 1: [1, 2]}[rank]
        assert built == mine, (rank, built)
        assert [st.index for st in pipe.local_stages] == mine
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        assert len(opt.param_groups[0]["params"]) == 4 + 4, "own stage + own shard"
        losses = pipe.train_step_sync(rt, x, num_microbatches=2, schedule="1f1b")
        norm = pipe.clip_grad_norm_(0.01)  # (every rank: a collective)
        opt.step()
    reference = nn.Sequential(*(reference_stage(s) for s in range(3)))
    ref_losses = []
    for xm in x.chunk(2):
        loss = reference(xm).pow(2).mean()
        (loss * 0.5).backward()  # (the mean over the 2 microbatches: the pipeline's default)
        ref_losses.append(loss.item())
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    assert float(ref_norm) > 0.01, float(ref_norm)  # (it clips)
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    torch.testing.assert_close(norm, ref_norm)
    own = 0 if rank == 0 else 2
    for key, value in reference[own].state_dict().items():
        torch.testing.assert_close(pipe.stage_state_dict(own)[key], value)
    print(f"rank {rank}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
