"""Where a :class:`~overlap.torch.TorchPipeline`'s tensors live on each stage's mesh.

A stage without a plan is replicated both ways (``Replicate()``); a tensor-parallel stage
takes and gives its plan's layouts over its axis. Along ``data_parallel`` the batch
(dimension 0) is split on top of either (:mod:`overlap.torch.data_parallel`). The shape probe
(:mod:`overlap.torch.probe`) turns these into each boundary's two shardings, and a step's
input sharding is stage 0's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scheduler import DeviceMesh, Sharding

from .data_parallel import BatchSplit
from .parallel import Replicate, TensorParallel, spec_of


@dataclass(frozen=True)
class StageLayouts:
    """Each stage's mesh, tensor-parallel plan (None: replicated) and batch split."""

    meshes: tuple[DeviceMesh, ...]
    tp: tuple[TensorParallel | None, ...]
    data_parallel: BatchSplit

    def layouts(self, s: int) -> tuple[Any, Any]:
        """Stage ``s``'s (input, output) layouts over its mesh axis."""
        tp = self.tp[s]
        return (Replicate(), Replicate()) if tp is None else (tp.input_layout, tp.output_layout)

    def owner(self, s: int) -> str:
        """The argument a bad layout of stage ``s`` is named after."""
        return f"plans[{s}]" if self.tp[s] is not None else f"modules[{s}]"

    def sharding(self, s: int, side: str, rank: int | None, element: int = 0,
                 batch_split: bool = True) -> Sharding:
        """Stage ``s``'s layout of a tensor crossing its ``side`` (``"input"`` or
        ``"output"``): the plan's for the first tensor of a boundary (replicated for the
        others), the batch (dimension 0) split over ``data_parallel`` where ``batch_split``.
        ``rank``: the tensor's number of dimensions (None where the layout needs none)."""
        layout = self.layouts(s)[0 if side == "input" else 1] if element == 0 else Replicate()
        tp = self.tp[s]
        axis = tp.axis if tp is not None else self.meshes[s].axis_names[0]
        what = f"{self.owner(s)} {side} layout"
        spec = spec_of(layout, rank, axis, what)
        if not batch_split:
            return Sharding(self.meshes[s], spec)
        return Sharding(self.meshes[s], self.data_parallel.spec(s, spec, what))


__all__ = ["StageLayouts"]
