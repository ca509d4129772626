"""Under a launcher with 2 processes: ``python tp_checkpoint.py OUT``. A 3-stage pipeline whose
middle stage is tensor-parallel across both ranks trains two AdamW steps; then every rank
saves ``pipe.state_dict()`` and ``pipe.optimizer_state_dict(opt)`` (collective: stage 1's
shards and moments are gathered through the runtime) to ``OUT/rank<r>.pt``. The test merges
the files and loads them elsewhere (one process, another plan; plain torch)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn

import overlap
from overlap.torch import ColwiseParallel, RowwiseParallel, TorchPipeline
from scheduler import Cluster, DeviceMesh

SEED = 3
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def stage_fn(s: int) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2], ("tp",)), DeviceMesh([3], ("tp",))]
    with overlap.Runtime(Cluster.local(4), timeout=30) as rt:
        pipe = TorchPipeline(stage_fn, meshes, nn.functional.mse_loss, rt=rt, seed=SEED,
                             plans=[None, PLAN, None])
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        for step in range(2):
            x, y = batch(step)
            opt.zero_grad()
            pipe.train_step_sync(rt, x, y, num_microbatches=2, scale_grads=True)
            opt.step()
        # Every rank, together: stage 1's halves meet on rank 0 (its first device's).
        saved = {"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(opt)}
        torch.save(saved, out / f"rank{rt.world.rank}.pt")
        print(f"rank {rt.world.rank}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
