"""Under a launcher: ``python tp_checkpoint.py OUT`` (2 processes). A 3-stage pipeline whose
middle stage is tensor-parallel across both ranks trains two AdamW steps; then every rank
saves with ``pipe.save_checkpoint(OUT, opt)`` (collective: stage 1's shards and moments are
gathered through the runtime), and loads it straight back (no barrier of its own).
``python tp_checkpoint.py OUT resume`` (any number of processes, 4 here): loads OUT into the
same model on this job's placement, takes the third step and saves to ``OUT/resumed``. The
test reads both back and compares with plain torch."""

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
    resume = sys.argv[2:] == ["resume"]
    torch.set_num_threads(1)
    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2], ("tp",)), DeviceMesh([3], ("tp",))]
    with overlap.Runtime(Cluster.local(4), timeout=30) as rt:
        pipe = TorchPipeline(stage_fn, meshes, nn.functional.mse_loss, rt=rt,
                             seed=SEED + 50 if resume else SEED, plans=[None, PLAN, None])
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        steps = range(2)
        if resume:  # (other initial weights: the checkpoint replaces them)
            extra = pipe.load_checkpoint(out, opt)
            assert extra == {"step": 2}, extra
            steps = range(2, 3)
        for step in steps:
            x, y = batch(step)
            opt.zero_grad()
            pipe.train_step_sync(rt, x, y, num_microbatches=2)
            opt.step()
        # Every rank, together: stage 1's halves meet on rank 0 (its first device's).
        pipe.save_checkpoint(out / "resumed" if resume else out, opt,
                             extra={"step": steps[-1] + 1})
        if not resume:  # read back at once, every rank: complete when save returned
            before = {k: v.clone() for k, v in pipe.state_dict().items()}
            assert pipe.load_checkpoint(out, opt) == {"step": 2}
            for k, v in pipe.state_dict().items():
                assert torch.equal(v, before[k]), k
        print(f"rank {rt.world.rank}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
