"""A toy 4-stage tanh MLP for pipeline-runtime tests, and its float64 numpy reference.

Stage ``s`` computes ``y = tanh(x @ W[s])``; the last stage's loss is ``0.5 * sum(y**2)``. The
stages sit on meshes of different shapes and layouts, so every boundary needs real multicasts
and layout changes (cluster: ``p3.8xlarge`` × 4 hosts, stage ``s`` on host ``s``):

- stage 0: one device (0), replicated.
- stage 1: devices 4, 5 (axis "gpu"), column-parallel: device j holds the column block j of
  W[1] and outputs its column block of y (layout ``P(None, "gpu")``); the input gradient is the
  all-reduce of the partial ones.
- stage 2: devices [[8, 9], [10, 11]] (axes "a", "b"), data-parallel over "a" and replicated
  over "b": input/output layout ``P("a", None)``; the weight gradient is all-reduced over "a";
  the forward also all-gathers its input rows over "a" (recorded in ``seen_inputs``, to check
  the gather order and the data delivered).
- stage 3: devices 12, 13 (axis "gpu"), row-parallel: input layout ``P(None, "gpu")``; device j
  multiplies its input column block by row block j of W[3], all-reduces the partial
  pre-activation, then tanh; each device computes the (same) loss.

Blocks follow the documented ceil-division split rule, computed here independently of the
library (:func:`split`). The reference (``reference``: ``reference_step`` of examples/toy.py) is a
plain float64 numpy forward and
backward that knows nothing about meshes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
from toy import reference_step as reference  # noqa: F401  (the float64 reference, re-exported)

from overlap.pipeline import Stage, StageContext
from scheduler import Boundary, Cluster, DeviceMesh, P, Sharding

CLUSTER = Cluster.preset("p3.8xlarge", 4)

Hook = Callable[[StageContext], None]


def split(n: int, k: int, i: int) -> slice:
    """Block ``i`` of ``k`` of a dimension of size ``n`` (ceil division, as documented)."""
    c = -(-n // k)
    return slice(min(i * c, n), min((i + 1) * c, n))


def reference_inputs(weights: Sequence[np.ndarray], x: np.ndarray, stage: int) -> np.ndarray:
    """The full input of ``stage`` for microbatch ``x``."""
    a = np.asarray(x, np.float64)
    for w in weights[:stage]:
        a = np.tanh(a @ w)
    return a


class ToyMLP:
    """The 4-stage toy pipeline; records per-device gradients, calls and gathered inputs.

    ``hook(ctx)``, if set, runs at the start of every stage function call (fault injection).
    ``shape_bug = (stage, microbatch, phase, device)`` makes that call return a result one
    column short.
    """

    def __init__(self, batch: int = 6, dims: Sequence[int] = (5, 7, 6, 9, 4), seed: int = 0,
                 dtype: str = "float64") -> None:
        assert len(dims) == 5 and batch % 2 == 0  # stage 2 all-gathers equal row blocks
        self.batch, self.dims = batch, tuple(dims)
        rng = np.random.default_rng(seed)
        self.weights = [rng.standard_normal((dims[s], dims[s + 1])) * 0.6 for s in range(4)]
        self.meshes = [
            DeviceMesh([[0]], ("host", "gpu")),
            DeviceMesh([[4, 5]], ("host", "gpu")),
            DeviceMesh([[8, 9], [10, 11]], ("a", "b")),
            DeviceMesh([[12, 13]], ("host", "gpu")),
        ]
        m = self.meshes
        layouts = [  # (producer spec on stage s, consumer spec on stage s + 1)
            (P(), P()),
            (P(None, "gpu"), P("a", None)),
            (P("a", None), P(None, "gpu")),
        ]
        self.boundaries = [
            Boundary((batch, dims[s + 1]), dtype, Sharding(m[s], prod), Sharding(m[s + 1], cons))
            for s, (prod, cons) in enumerate(layouts)
        ]
        self.input_sharding = Sharding(m[0], P())
        self.hook: Hook | None = None
        self.shape_bug: tuple[int, int, str, int] | None = None
        self._lock = threading.Lock()
        self.reset()
        self.stages = [
            Stage(m[0], self._f0, self._b0),
            Stage(m[1], self._f1, self._b1),
            Stage(m[2], self._f2, self._b2),
            Stage(m[3], self._f3, self._b3),
        ]

    # ---- bookkeeping ---------------------------------------------------------------------

    def reset(self) -> None:
        self.grads: dict[tuple[int, int], np.ndarray] = {}
        self.calls: list[tuple[int, int, int, str]] = []  # (stage, device, microbatch, phase)
        self.seen_inputs: dict[tuple[int, int], np.ndarray] = {}  # (device, mb) -> stage-2 input
        self.bad_ctx: list[str] = []

    def microbatches(self, m: int, seed: int = 1) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        return [rng.standard_normal((self.batch, self.dims[0])) for _ in range(m)]

    def expected_grads(self, ref: Sequence[np.ndarray]) -> dict[tuple[int, int], np.ndarray]:
        """(stage, device) -> the block of the reference gradient that device must hold."""
        d2, d3 = self.dims[2], self.dims[3]
        out = {(0, 0): ref[0]}
        for j, d in enumerate((4, 5)):
            out[(1, d)] = ref[1][:, split(d2, 2, j)]
        for d in (8, 9, 10, 11):
            out[(2, d)] = ref[2]
        for j, d in enumerate((12, 13)):
            out[(3, d)] = ref[3][split(d3, 2, j), :]
        return out

    def _enter(self, ctx: StageContext, stage: int, phase: str) -> None:
        with self._lock:
            self.calls.append((ctx.stage, ctx.device, ctx.microbatch, ctx.phase))
            if (ctx.stage, ctx.phase, ctx.mesh) != (stage, phase, self.meshes[stage]):
                self.bad_ctx.append(f"{stage}{phase} got {ctx!r}")
        if self.hook is not None:
            self.hook(ctx)

    def _accumulate(self, ctx: StageContext, g: np.ndarray) -> None:
        key = (ctx.stage, ctx.device)  # only this device's compute thread touches the key
        self.grads[key] = self.grads.get(key, 0.0) + g

    def _out(self, ctx: StageContext, value: np.ndarray) -> np.ndarray:
        if self.shape_bug == (ctx.stage, ctx.microbatch, ctx.phase, ctx.device):
            return value[:, :-1]
        return value

    # ---- stage 0: one device -------------------------------------------------------------

    def _f0(self, ctx, x):
        self._enter(ctx, 0, "F")
        y = np.tanh(x @ self.weights[0])
        ctx.saved.update(x=x, y=y)
        return self._out(ctx, y)

    def _b0(self, ctx, dy):
        self._enter(ctx, 0, "B")
        x, y = ctx.saved["x"], ctx.saved["y"]
        dz = dy * (1.0 - y * y)
        self._accumulate(ctx, x.T @ dz)
        return None  # ignored on stage 0

    # ---- stage 1: column-parallel over "gpu" ---------------------------------------------

    def _w1(self, ctx):
        return self.weights[1][:, split(self.dims[2], 2, ctx.coords["gpu"])]

    def _f1(self, ctx, x):
        self._enter(ctx, 1, "F")
        y = np.tanh(x @ self._w1(ctx))
        ctx.saved.update(x=x, y=y)
        return self._out(ctx, y)

    def _b1(self, ctx, dy):
        self._enter(ctx, 1, "B")
        x, y = ctx.saved["x"], ctx.saved["y"]
        dz = dy * (1.0 - y * y)
        self._accumulate(ctx, x.T @ dz)
        return self._out(ctx, ctx.all_reduce(dz @ self._w1(ctx).T, axis="gpu"))

    # ---- stage 2: data-parallel over "a", replicated over "b" ----------------------------

    def _f2(self, ctx, x):
        self._enter(ctx, 2, "F")
        gathered = ctx.all_gather(x, axis="a")  # rows of both "a" blocks, in device order
        self.seen_inputs[(ctx.device, ctx.microbatch)] = gathered.reshape(-1, x.shape[1])
        y = np.tanh(x @ self.weights[2])
        ctx.saved.update(x=x, y=y)
        return self._out(ctx, y)

    def _b2(self, ctx, dy):
        self._enter(ctx, 2, "B")
        x, y = ctx.saved["x"], ctx.saved["y"]
        dz = dy * (1.0 - y * y)
        self._accumulate(ctx, ctx.all_reduce(x.T @ dz, axis="a"))
        return self._out(ctx, dz @ self.weights[2].T)

    # ---- stage 3: row-parallel over "gpu", computes the loss -----------------------------

    def _w3(self, ctx):
        return self.weights[3][split(self.dims[3], 2, ctx.coords["gpu"]), :]

    def _f3(self, ctx, x):
        self._enter(ctx, 3, "F")
        z = ctx.all_reduce(x @ self._w3(ctx))
        y = np.tanh(z)
        ctx.saved.update(x=x, y=y)
        return 0.5 * float(np.sum(y * y))

    def _b3(self, ctx, dy):
        self._enter(ctx, 3, "B")
        assert dy is None
        x, y = ctx.saved["x"], ctx.saved["y"]
        dz = y * (1.0 - y * y)
        self._accumulate(ctx, x.T @ dz)
        return self._out(ctx, dz @ self._w3(ctx).T)
