"""Backends: where streams, events and collectives live.

``cpu`` (virtual devices in this process; the default and how everything is tested) is the only
backend today; ``cuda`` (CuPy streams and NCCL) follows the same interface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .cpu import CpuBackend, CpuEvent, CpuStream

BACKENDS = ("cpu",)


def make_backend(name: str, num_devices: int, *, timeout: float = 30.0,
                 link_time: Callable[[int, Sequence[int], int], float] | None = None
                 ) -> CpuBackend:
    if name == "cpu":
        return CpuBackend(num_devices, timeout=timeout, link_time=link_time)
    raise ValueError(f"backend: unknown {name!r}; available: {BACKENDS}")


__all__ = ["BACKENDS", "CpuBackend", "CpuEvent", "CpuStream", "make_backend"]
