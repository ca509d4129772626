"""A 2-stage pipeline whose first stage spins in pure Python on every one of its devices (for
the GIL tests and ``benchmarks/fault_detection.py``)."""

from __future__ import annotations

import threading

import numpy as np

import overlap
from overlap import StageTimeout
from scheduler import Boundary, Cluster, DeviceMesh, P, Sharding


def spinning_step(n: int, timeout: float, release: threading.Event) -> StageTimeout:
    """Run a step whose stage 0 (``n`` devices) spins in microbatch 1's forward until
    ``release``; returns the StageTimeout that names it (the runtime is closed)."""
    cluster = Cluster.local(2 * n)
    first = DeviceMesh([list(range(n))], ("host", "gpu"))
    second = DeviceMesh([list(range(n, 2 * n))], ("host", "gpu"))

    def spin(ctx, x):
        if ctx.microbatch == 1:
            while not release.is_set():  # pure Python: takes the GIL back every 5 ms
                pass
        return x

    def loss(ctx, x):
        return float(x.sum())

    def backward(ctx, dy):
        return np.zeros((4, 8)) if ctx.stage == 1 else None

    stages = [overlap.Stage(first, spin, backward), overlap.Stage(second, loss, backward)]
    boundary = Boundary((4, 8), "float64", Sharding(first, P()), Sharding(second, P()))
    with overlap.Runtime(cluster, timeout=timeout) as rt:
        try:
            rt.train_step_sync(stages, [boundary], [np.ones((4, 8))] * 3,
                               input_sharding=Sharding(first, P()))
        except StageTimeout as exc:
            return exc
        finally:
            release.set()  # (close() then need not wait for the spinning ops)
    raise AssertionError("the spinning stage was not named")
