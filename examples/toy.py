"""A toy numpy MLP split into 4 pipeline stages on meshes of different shapes.

Every stage computes ``y = tanh(x @ W_s)``; the last one returns ``0.5 * sum(y**2)``. The
stages use different intra-stage parallelism, so their boundaries need real resharding:

====== ============ ==================================== =====================================
stage  mesh         parallelism                          output layout -> next stage's input
====== ============ ==================================== =====================================
0      1 GPU        replicated                           P() -> P(): one sender, 2 receivers
1      1 × 2        column-parallel (W split by columns) P(None, "gpu") -> P(): a multicast
2      2 × 2        replicated                           P() -> P(None, "gpu")
3      1 × 2        row-parallel (W split by rows)       loss
====== ============ ==================================== =====================================

Column-parallel backward all-reduces the input gradient, row-parallel forward all-reduces
the pre-activation (``ctx.all_reduce``, over the stage's mesh). Each device keeps its own copy
of its weights and accumulates its own gradients, as a real trainer's optimizer would see them.
:func:`reference_step` computes the same step on one "device" in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from overlap.pipeline import Stage, StageContext
from scheduler import Boundary, Cluster, DeviceMesh, P, Sharding


@dataclass
class ToyMLP:
    """Weights per (stage, device), gradients per (stage, device), and the pipeline's shape."""

    cluster: Cluster
    hidden: int
    batch: int
    meshes: tuple[DeviceMesh, ...]
    weights: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    grads: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    # ---- construction --------------------------------------------------------------------

    @classmethod
    def build(cls, cluster: Cluster, hidden: int = 64, batch: int = 16, seed: int = 0) -> ToyMLP:
        if cluster.num_hosts < 4 or cluster.gpus_per_host < 4:
            raise ValueError("cluster: the toy pipeline needs 4 hosts of >= 4 GPUs, got "
                             f"{cluster.num_hosts} × {cluster.gpus_per_host}")
        if hidden % 2:
            raise ValueError(f"hidden: must be even (split over 2 GPUs), got {hidden}")
        g = cluster.gpus_per_host
        meshes = (
            DeviceMesh([[0]], ("host", "gpu")),
            DeviceMesh([[g, g + 1]], ("host", "gpu")),
            DeviceMesh([[2 * g, 2 * g + 1], [2 * g + 2, 2 * g + 3]], ("row", "col")),
            DeviceMesh([[3 * g, 3 * g + 1]], ("host", "gpu")),
        )
        model = cls(cluster, hidden, batch, meshes)
        rng = np.random.default_rng(seed)
        full = [rng.standard_normal((hidden, hidden)) / np.sqrt(hidden) for _ in range(4)]
        model.full_weights = full
        for s, mesh in enumerate(meshes):
            for d in mesh.device_ids:
                model.weights[(s, d)] = model.shard(s, d, full[s]).copy()
        return model

    def _half(self, s: int, d: int) -> slice:
        j = self.meshes[s].device_ids.index(d)
        h = self.hidden // 2
        return slice(j * h, (j + 1) * h)

    def shard(self, s: int, d: int, w: np.ndarray) -> np.ndarray:
        """Device ``d``'s part of stage ``s``'s weight ``w`` (its tensor-parallel split)."""
        if s == 1:
            return w[:, self._half(s, d)]  # column-parallel
        if s == 3:
            return w[self._half(s, d), :]  # row-parallel
        return w

    # ---- the pipeline description --------------------------------------------------------

    def stages(self) -> list[Stage]:
        return [Stage(m, self._forward(s), self._backward(s)) for s, m in enumerate(self.meshes)]

    def split_stages(self) -> list[Stage]:
        """The same stages with the backward split in two — the input gradient, then the
        weight gradient — for schedules that run them apart (``zb-h1``)."""
        return [Stage(m, self._forward(s), self._backward(s, split=True),
                      self._backward_weight(s)) for s, m in enumerate(self.meshes)]

    def boundaries(self) -> list[Boundary]:
        shape = (self.batch, self.hidden)
        m = self.meshes
        return [
            Boundary(shape, "float64", Sharding(m[0], P()), Sharding(m[1], P())),
            Boundary(shape, "float64", Sharding(m[1], P(None, "gpu")), Sharding(m[2], P())),
            Boundary(shape, "float64", Sharding(m[2], P()), Sharding(m[3], P(None, "gpu"))),
        ]

    def input_sharding(self) -> Sharding:
        return Sharding(self.meshes[0], P())

    def _forward(self, s: int):
        def forward(ctx: StageContext, x: np.ndarray):
            w = self.weights[(s, ctx.device)]
            z = x @ w
            if s == 3:
                z = ctx.all_reduce(z)  # row-parallel: sum the partial products
            y = np.tanh(z)
            ctx.saved["x"], ctx.saved["y"] = x, y
            return 0.5 * float(np.sum(y * y)) if s == 3 else y
        return forward

    def _backward(self, s: int, split: bool = False):
        def backward(ctx: StageContext, dy: np.ndarray | None):
            x, y = ctx.saved["x"], ctx.saved["y"]
            dz = (y if dy is None else dy) * (1.0 - y * y)
            key = (s, ctx.device)
            if split:
                ctx.saved["dz"] = dz  # for the weight gradient, later
            else:
                self.grads[key] = self.grads.get(key, 0.0) + x.T @ dz
            dx = dz @ self.weights[key].T
            if s == 1:
                dx = ctx.all_reduce(dx)  # column-parallel: input gradient is a sum
            return dx
        return backward

    def _backward_weight(self, s: int):
        def backward_weight(ctx: StageContext) -> None:
            key = (s, ctx.device)
            self.grads[key] = self.grads.get(key, 0.0) + ctx.saved["x"].T @ ctx.saved.pop("dz")
        return backward_weight

    # ---- training ------------------------------------------------------------------------

    def zero_grad(self) -> None:
        self.grads.clear()

    def sgd(self, lr: float) -> None:
        for key, g in self.grads.items():
            self.weights[key] -= lr * g

    def check_against(self, ref_weights: list[np.ndarray], ref_grads: list[np.ndarray],
                      atol: float = 1e-10, devices: Sequence[int] | None = None, *,
                      rtol: float = 0.0) -> float:
        """Largest difference between every device's weights/gradients and the reference
        (of ``devices`` only: a process of a multi-process job has its own devices' only).
        Each array may differ by ``atol + rtol × its reference's largest magnitude``: sums
        in another order differ in their last bits, in proportion to the values."""
        worst = 0.0
        for (s, d), w in self.weights.items():
            if devices is not None and d not in devices:
                continue
            for mine, ref in ((w, self.shard(s, d, ref_weights[s])),
                              (self.grads[(s, d)], self.shard(s, d, ref_grads[s]))):
                diff = float(np.max(np.abs(mine - ref)))
                bound = atol + rtol * float(np.max(np.abs(ref)))
                if diff > bound:
                    raise AssertionError(f"pipeline differs from the reference by {diff:.3g} "
                                         f"> {bound:.3g} (stage {s}, device {d})")
                worst = max(worst, diff)
        return worst


def reference_step(weights: list[np.ndarray], microbatches: list[np.ndarray]
                   ) -> tuple[list[float], list[np.ndarray]]:
    """Per-microbatch losses and the summed weight gradients of the tanh MLP (any number of
    layers) on one device, float64 numpy — knowing nothing about meshes."""
    grads = [np.zeros_like(w) for w in weights]
    losses = []
    for x in microbatches:
        acts = [np.asarray(x, np.float64)]
        for w in weights:
            acts.append(np.tanh(acts[-1] @ w))
        losses.append(0.5 * float(np.sum(acts[-1] ** 2)))
        dy = acts[-1]
        for s in reversed(range(len(weights))):
            dz = dy * (1.0 - acts[s + 1] ** 2)
            grads[s] += acts[s].T @ dz
            dy = dz @ weights[s].T
    return losses, grads
