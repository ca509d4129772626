"""Several stages per rank — interleaved-1f1b (loop placement) and zbv (a V, the backward
split) — lowered, validated, simulated and trained on the CPU runtime; numerics against plain
float64 numpy (examples/toy.py's reference, which knows nothing about ranks or meshes)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from toy import reference_step

from overlap import Runtime, Stage
from scheduler import (
    Boundary,
    Cluster,
    DeviceMesh,
    P,
    Sharding,
    lower,
    make_schedule,
    simulate,
    validate,
)

CLUSTER = Cluster.preset("p3.8xlarge", 4)
HIDDEN, BATCH = 6, 3


class Layers:
    """A tanh MLP of ``p`` layers, stage s = layer s on its rank's mesh (weights replicated
    on the mesh's devices); gradients summed per (stage, device)."""

    def __init__(self, schedule_name: str, p: int, m: int, mesh_of_rank) -> None:
        self.schedule = make_schedule(schedule_name, p, m)
        rng = np.random.default_rng(p * 100 + m)
        self.weights = [rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)
                        for _ in range(p)]
        self.meshes = [mesh_of_rank(self.schedule.rank_of(s)) for s in range(p)]
        self.grads: dict[tuple[int, int], np.ndarray] = {}
        self.split = "I" in self.schedule.kinds

    def stages(self) -> list[Stage]:
        p = len(self.weights)

        def fwd(s):
            def f(ctx, x):
                y = np.tanh(x @ self.weights[s])
                ctx.saved.update(x=x, y=y)
                return 0.5 * float(np.sum(y * y)) if s == p - 1 else y
            return f

        def bwd(s):
            def b(ctx, dy):
                y = ctx.saved["y"]
                dz = (y if dy is None else dy) * (1.0 - y * y)
                if self.split:
                    ctx.saved["dz"] = dz
                else:
                    self._add(s, ctx.device, ctx.saved["x"].T @ dz)
                return dz @ self.weights[s].T
            return b

        def wgt(s):
            def w(ctx):
                self._add(s, ctx.device, ctx.saved["x"].T @ ctx.saved.pop("dz"))
            return w

        return [Stage(m, fwd(s), bwd(s), wgt(s) if self.split else None)
                for s, m in enumerate(self.meshes)]

    def _add(self, s: int, d: int, g: np.ndarray) -> None:
        self.grads[(s, d)] = self.grads.get((s, d), 0.0) + g

    def boundaries(self) -> list[Boundary]:
        shape = (BATCH, HIDDEN)
        return [Boundary(shape, "float64", Sharding(a, P()), Sharding(b, P()))
                for a, b in itertools.pairwise(self.meshes)]


def one_device(rank: int) -> DeviceMesh:
    return DeviceMesh([[4 * rank]], ("host", "gpu"))


def two_devices(rank: int) -> DeviceMesh:  # data replicated over two GPUs of a host
    return DeviceMesh([[4 * rank, 4 * rank + 1]], ("host", "gpu"))


@pytest.mark.parametrize("name, p, m", [
    ("interleaved-1f1b", 4, 2), ("interleaved-1f1b", 4, 4), ("interleaved-1f1b", 8, 4),
    ("interleaved-1f1b", 8, 8), ("zbv", 2, 1), ("zbv", 4, 1), ("zbv", 4, 3), ("zbv", 4, 6),
    ("zbv", 8, 4), ("zbv", 8, 9)])
@pytest.mark.parametrize("mesh_of_rank", [one_device, two_devices])
def test_several_stages_per_rank_train_like_plain_numpy(name, p, m, mesh_of_rank):
    model = Layers(name, p, m, mesh_of_rank)
    mbs = [np.random.default_rng(i).standard_normal((BATCH, HIDDEN)) for i in range(m)]
    with Runtime(CLUSTER, timeout=20) as rt:
        losses = rt.train_step_sync(model.stages(), model.boundaries(), mbs,
                                    input_sharding=Sharding(model.meshes[0], P()),
                                    schedule=name)
        tl = rt.timeline()
    ref_losses, ref_grads = reference_step(model.weights, mbs)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-10)
    for s, mesh in enumerate(model.meshes):
        for d in mesh.device_ids:
            np.testing.assert_allclose(model.grads[(s, d)], ref_grads[s], rtol=0, atol=1e-10)
    # The measured timeline keeps each stage's activations apart on a shared device.
    for s in range(p):
        assert tl.peak_activations(s) == model.schedule.peak_activations(s)


@pytest.mark.parametrize("name, p, m", [("interleaved-1f1b", 8, 8), ("zbv", 8, 8)])
def test_several_stages_per_rank_lower_validate_and_simulate(name, p, m):
    model = Layers(name, p, m, one_device)
    graph = lower(model.meshes, model.boundaries(), model.schedule, CLUSTER)
    validate(graph)
    # Each rank's device runs its stages' computes in its rank's list order.
    for r in range(model.schedule.num_ranks):
        d = model.meshes[model.schedule.stages_of(r)[0]].device_ids[0]
        ran = [(graph.ops[i].body.kind, graph.ops[i].body.microbatch, graph.ops[i].body.stage)
               for i in graph.program(d)["compute"]]
        assert ran == [(a.kind, a.microbatch, a.stage) for a in model.schedule.actions[r]]
    if name == "zbv":  # the V's turn (stage p/2 - 1 to p/2) stays on one rank: a local copy
        turn = [op for op in graph.ops
                if str(getattr(op.body, "channel", "")) == f"fwd{p // 2 - 1}"]
        assert turn and all(op.body.transfer.receivers == (op.body.transfer.sender,)
                            for op in turn)
    costs = {"F": 1e-3, "B": 2e-3, "I": 1e-3, "W": 1e-3}
    tl = simulate(graph, CLUSTER, costs)
    assert tl.iteration_time > 0
    for s in range(p):
        assert tl.peak_activations(s) == model.schedule.peak_activations(s)


@pytest.mark.parametrize("meshes, match", [
    # interleaved-1f1b over 2 ranks: stage 2 runs on rank 0 with stage 0, so same mesh.
    ([one_device(0), one_device(1), one_device(2), one_device(1)],
     r"stages\[2\]: interleaved-1f1b runs stage 2 on rank 0 with stage 0"),
    # Different ranks sharing a device.
    ([one_device(0), two_devices(0), one_device(0), two_devices(0)],
     r"device 0 is in stage 0 and stage 1, which run on different ranks"),
])
def test_meshes_must_follow_the_schedules_placement(meshes, match):
    sched = make_schedule("interleaved-1f1b", 4, 2)
    bounds = [Boundary((BATCH, HIDDEN), "float64", Sharding(a, P()), Sharding(b, P()))
              for a, b in itertools.pairwise(meshes)]
    with pytest.raises(ValueError, match=match):
        lower(meshes, bounds, sched, CLUSTER)
