"""Under ``mpiexec -n 2``: a tensor-parallel stage whose devices span both ranks trains, and
``stage_state_dict`` refuses it on each rank (half its shards live elsewhere) while a stage
of this rank's own devices gathers to plain torch's; ``return_outputs`` gives the last
stage's outputs on its rank only. Exits 0 when all of that holds."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn

import overlap
from overlap.torch import ColwiseParallel, RowwiseParallel, TorchPipeline
from scheduler import Cluster, DeviceMesh

PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def reference_out(modules, x):
    with torch.no_grad():
        for m in modules:
            x = m(x)
    return x


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cluster = Cluster.preset("p3.8xlarge", 1)  # 4 devices: rank 0 has 0-1, rank 1 has 2-3
    # Stage 0 on rank 0's devices, stage 1 across both ranks, stage 2 on rank 1's.
    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2], ("tp",)), DeviceMesh([3], ("tp",))]
    modules = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)) for _ in meshes]
    reference = copy.deepcopy(modules)
    reference_initial = copy.deepcopy(modules)
    pipe = TorchPipeline(modules, meshes, lambda y: y.pow(2).mean(),
                         plans=[PLAN, PLAN, PLAN])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    x = torch.randn(4, 4)
    with overlap.Runtime(cluster, timeout=30) as rt:
        _, outputs = pipe.train_step_sync(rt, x, num_microbatches=2, schedule="1f1b",
                                          return_outputs=True)
        rank = rt.world.rank
    # The last stage (device 3) is rank 1's: its outputs there, None on rank 0.
    assert (outputs is None) == (rank == 0), (rank, outputs)
    opt.step()
    for xm in x.chunk(2):
        h = xm
        for m in reference:
            h = m(h)
        (h.pow(2).mean() * 0.5).backward()  # (the mean over the 2 microbatches: the default)
    torch.optim.SGD([p for m in reference for p in m.parameters()], lr=0.5).step()
    if outputs is not None:
        for xm, out in zip(x.chunk(2), outputs):
            torch.testing.assert_close(out, reference_out(reference_initial, xm))
    mine = 0 if rank == 0 else 2
    state = pipe.stage_state_dict(mine)
    assert list(state) == list(reference[mine].state_dict())
    for key, value in reference[mine].state_dict().items():
        torch.testing.assert_close(state[key], value)
    try:
        pipe.stage_state_dict(1)
    except ValueError as exc:
        assert "driven by other processes" in str(exc), exc
    else:
        raise AssertionError("stage_state_dict gathered a stage half on another process")
    # A whole-model checkpoint loads on every rank: its own stages, and its own shards of
    # the stage it shares (keys of the other rank's stage are that rank's).
    torch.manual_seed(1)
    fresh = nn.Sequential(*(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
                            for _ in meshes))
    assert pipe.load_state_dict(fresh.state_dict()) == ([], [])
    for key, value in fresh[mine].state_dict().items():
        torch.testing.assert_close(pipe.stage_state_dict(mine)[key], value)
    tp = pipe.tp[1]
    k = 0 if rank == 0 else 1  # device 1 is rank 0's, device 2 rank 1's
    for name, p in tp.modules[k].named_parameters():
        want = fresh[1].state_dict()[name]
        if name in tp.split:
            want = want.chunk(2, tp.split[name])[k]
        torch.testing.assert_close(p.detach(), want)
    print(f"rank {rank}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
