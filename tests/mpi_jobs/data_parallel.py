"""Under a launcher with 4 processes (``mpiexec -n 4``, ``torchrun --nproc-per-node 4``), 2
devices each: a pipeline whose stages split the batch over their mesh's ``dp`` axis —
stage 0 on rank 0 (dp 2), stage 1 a 2×2 mesh across ranks 1 and 2 (dp over the ranks, TP
inside each), stage 2 on rank 3 (dp 2) — trains as plain single-process torch trains the
same model on the whole batch: losses, the clipped norm and every updated parameter.
Argument: the schedule. Prints "rank r: ok" when all of that holds."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn

import overlap
from overlap.torch import ColwiseParallel, RowwiseParallel, TorchPipeline
from scheduler import Cluster, DeviceMesh

SEED = 11
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def stage_fn(s: int) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def main() -> int:
    schedule = sys.argv[1] if len(sys.argv) > 1 else "1f1b"
    torch.set_num_threads(1)
    meshes = [DeviceMesh([[0], [1]], ("dp", "tp")), DeviceMesh([[2, 3], [4, 5]], ("dp", "tp")),
              DeviceMesh([[6], [7]], ("dp", "tp"))]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.randn(8, 4, generator=g, dtype=torch.float64)

    def loss_fn(out, target):
        return (out - target).pow(2).mean()

    with overlap.Runtime(Cluster.local(8), timeout=30) as rt:
        rank = rt.world.rank
        pipe = TorchPipeline(stage_fn, meshes, loss_fn, rt=rt, plans=[None, PLAN, None],
                             axis="tp", seed=SEED, data_parallel="dp")
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        losses, outputs = pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule=schedule,
                                               return_outputs=True)
        norm = pipe.clip_grad_norm_(0.01)
        opt.step()
        state = pipe.state_dict()  # (collective: every process)
    reference = []
    for s in range(3):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED + s)
            reference.append(stage_fn(s))
    model = nn.Sequential(*reference)
    ref_losses, ref_outputs = [], []
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        out = model(xm)
        loss = loss_fn(out, ym)
        (loss * 0.5).backward()
        ref_losses.append(loss.item())
        ref_outputs.append(out.detach())
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    torch.testing.assert_close(norm, ref_norm.to(norm.dtype))
    if rank == 3:  # (the last stage's first device: the outputs, each whole microbatch)
        for got, want in zip(outputs, ref_outputs):
            torch.testing.assert_close(got, want)
    else:
        assert outputs is None
    want = model.state_dict()
    for key, value in state.items():  # (the stages this process writes)
        torch.testing.assert_close(value, want[key], msg=lambda m, key=key: f"{key}: {m}")
    print(f"rank {rank}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
