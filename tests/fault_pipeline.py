"""A 3-stage tanh MLP with one planted fault, for the fault matrix (one process and MPI).

Stage ``s`` computes ``y = tanh(x @ W[s])`` on every device of its mesh (replicated); the last
stage's loss is ``0.5 * sum(y**2)``. Stage 0 is one device, stages 1 and 2 two devices each,
on three hosts, so every boundary is a real multicast. A :class:`Fault` makes the first device
of one stage misbehave in one (microbatch, phase): raise, hang (until ``release`` is set),
return the wrong shape, or the wrong dtype.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from overlap.pipeline import Stage, StageContext
from scheduler import Boundary, Cluster, DeviceMesh, P, Sharding

CLUSTER = Cluster.preset("p3.8xlarge", 3)
KINDS = ("raise", "hang", "shape", "dtype")
MICROBATCHES = 2
WIDTH = 4
BATCH = 3


class InjectedFault(Exception):
    pass


@dataclass(frozen=True)
class Fault:
    stage: int
    microbatch: int
    phase: str  # "F" or "B"
    kind: str  # one of KINDS

    def __str__(self) -> str:
        return f"{self.kind}@s{self.stage}{self.phase}{self.microbatch}"

    @property
    def harmless(self) -> bool:
        """Stage 0's backward result is ignored by contract: a wrong one is no error."""
        return self.stage == 0 and self.phase == "B" and self.kind in ("shape", "dtype")


def every_fault(microbatches: int = MICROBATCHES) -> Iterator[Fault]:
    for kind in KINDS:
        for stage in range(3):
            for mb in range(microbatches):
                for phase in "FB":
                    yield Fault(stage, mb, phase, kind)


class FaultyMLP:
    """The pipeline; ``fault`` (or None) is planted; gradients per (stage, device)."""

    def __init__(self, fault: Fault | None = None, seed: int = 0) -> None:
        g = CLUSTER.gpus_per_host
        self.meshes = (DeviceMesh([[0]], ("host", "gpu")),
                       DeviceMesh([[g, g + 1]], ("host", "gpu")),
                       DeviceMesh([[2 * g, 2 * g + 1]], ("host", "gpu")))
        rng = np.random.default_rng(seed)
        self.weights = [rng.standard_normal((WIDTH, WIDTH)) * 0.5 for _ in range(3)]
        self.fault = fault
        self.release = threading.Event()  # ends a planted hang
        self.grads: dict[tuple[int, int], np.ndarray] = {}
        self.boundaries = [Boundary((BATCH, WIDTH), "float64", Sharding(self.meshes[s], P()),
                                    Sharding(self.meshes[s + 1], P())) for s in range(2)]
        self.input_sharding = Sharding(self.meshes[0], P())
        self.stages = [Stage(m, self._forward(s), self._backward(s))
                       for s, m in enumerate(self.meshes)]

    def microbatches(self, m: int = MICROBATCHES) -> list[np.ndarray]:
        rng = np.random.default_rng(1)
        return [rng.standard_normal((BATCH, WIDTH)) for _ in range(m)]

    def _planted(self, ctx: StageContext) -> str | None:
        f = self.fault
        if f is None or ctx.device != self.meshes[ctx.stage].device_ids[0]:
            return None
        if (f.stage, f.microbatch, f.phase) != (ctx.stage, ctx.microbatch, ctx.phase):
            return None
        if f.kind == "raise":
            raise InjectedFault(f"planted in {f}")
        if f.kind == "hang":
            self.release.wait(60)
        return f.kind

    @staticmethod
    def _spoil(value, kind: str | None):
        if kind == "shape":
            return np.zeros((7,)) if np.ndim(value) == 0 else value[:, :-1]
        if kind == "dtype":
            return "a string" if np.ndim(value) == 0 else value.astype(np.complex128)
        return value

    def _forward(self, s: int):
        def forward(ctx: StageContext, x: np.ndarray):
            kind = self._planted(ctx)
            y = np.tanh(x @ self.weights[s])
            ctx.saved.update(x=x, y=y)
            out = 0.5 * float(np.sum(y * y)) if s == 2 else y
            return self._spoil(out, kind)
        return forward

    def _backward(self, s: int):
        def backward(ctx: StageContext, dy: np.ndarray | None):
            kind = self._planted(ctx)
            x, y = ctx.saved["x"], ctx.saved["y"]
            dz = (y if dy is None else dy) * (1.0 - y * y)
            key = (s, ctx.device)
            self.grads[key] = self.grads.get(key, 0.0) + x.T @ dz
            return self._spoil(dz @ self.weights[s].T, kind)
        return backward

    def step(self, rt, microbatches: list[np.ndarray] | None = None) -> list[float]:
        self.grads.clear()
        return rt.train_step_sync(self.stages, self.boundaries,
                                  microbatches or self.microbatches(),
                                  input_sharding=self.input_sharding)
