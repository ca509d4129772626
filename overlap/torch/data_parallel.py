"""Data parallelism inside a stage's mesh: ``TorchPipeline(..., data_parallel="dp")``.

A mesh axis named ``data_parallel`` splits each microbatch's batch (dimension 0) over its
devices, in every stage whose mesh has that axis — what Megatron-core, torchtitan and Alpa
do with the axis of a stage mesh no tensor-parallel plan splits:

- **layouts**: each boundary's layout on such a mesh is the stage's own (replicated, or its
  plan's over the tensor-parallel axis) with dimension 0 split over the axis — ``P("dp")``,
  ``P("dp", None, "tp")`` — so the resharding planner moves activations between a batch-split
  layout on one mesh and whatever the next mesh's layout is; stage 0 receives its slice of
  every microbatch the same way;
- **the loss**: each device of the last stage applies ``loss_fn`` to its slice (and its slice
  of the targets); the microbatch's loss reported is the mean of the slices' (equal slices: the
  whole microbatch's mean, for a loss that averages over the batch, as torch's losses do by
  default);
- **gradients**: the last stage's backward starts from each slice's loss divided by the
  number of slices — the slice's share of the microbatch's mean loss — so the gradient each
  device sends back is exactly the whole loss's gradient for its slice (every earlier stage,
  batch-split or not, computes exact gradients), and each device's parameter gradients are
  its slice's share — exact for a loss that averages over the batch (torch's default
  reduction; with ``reduction="sum"`` they are 1/k of it); after the step's last backward of
  the stage on a device the step's part is summed over its line of the axis (what ``.grad``
  held before the step is kept as it is: gradients add up over steps as without data
  parallelism) — the whole batch's gradient, what ``DistributedDataParallel``'s
  average gives — by a :class:`overlap.GradSync` the runtime runs as a step-graph op on the
  stage's own stream (``dp<s>``), while the device's compute stream and the other stages go
  on. One all-reduce per parameter dtype (a flat bucket). A parameter no slice used gets a
  zero gradient rather than None. Buffers (batch norm's running
  statistics) stay each replica's own, as with ``DistributedDataParallel(broadcast_buffers=
  False)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scheduler import DeviceMesh, P, ShardingSpec, reduce_line

from ..pipeline import GradSync, StageContext
from .tensors import from_torch, to_torch

Enter = Callable[[StageContext], contextlib.AbstractContextManager[None]]


@dataclass(frozen=True)
class BatchSplit:
    """The ``data_parallel`` axis (None: none) and its size in each stage's mesh (1 where the
    mesh lacks it)."""

    axis: str | None
    meshes: tuple[DeviceMesh, ...]

    @classmethod
    def of(cls, data_parallel: object, meshes: Sequence[DeviceMesh], tp_axis: str | None
           ) -> BatchSplit:
        """``data_parallel`` checked against the meshes and the plans' ``axis``."""
        if data_parallel is None:
            return cls(None, tuple(meshes))
        if not isinstance(data_parallel, str) or not data_parallel:
            raise TypeError(f"data_parallel: expected the name of a mesh axis (or None), got "
                            f"{data_parallel!r}")
        if not any(data_parallel in m.axis_names for m in meshes):
            axes = sorted({a for m in meshes for a in m.axis_names})
            raise ValueError(f"data_parallel: no stage's mesh has an axis {data_parallel!r} "
                             f"(their axes: {axes})")
        if data_parallel == tp_axis:
            raise ValueError(f"data_parallel: {data_parallel!r} is the axis tensor-parallel "
                             "plans split over (axis=); the batch splits over another axis "
                             "of the mesh")
        return cls(data_parallel, tuple(meshes))

    def degree(self, s: int) -> int:
        """How many parts stage ``s`` splits each microbatch into."""
        mesh = self.meshes[s]
        return 1 if self.axis is None or self.axis not in mesh.axis_names \
            else mesh.axis_sizes[self.axis]

    def index(self, s: int, device: int) -> int:
        """Which part of each microbatch ``device`` of stage ``s`` runs."""
        mesh = self.meshes[s]
        return mesh.coords()[device][mesh.axis_index(self.axis)] if self.degree(s) > 1 else 0

    def spec(self, s: int, spec: ShardingSpec, what: str) -> ShardingSpec:
        """Stage ``s``'s layout ``spec`` with the batch (dimension 0) split over the axis."""
        if self.axis is None or self.axis not in self.meshes[s].axis_names:
            return spec
        entries = list(spec.entries)
        if entries and entries[0] is not None:
            raise ValueError(f"{what}: {spec!r} shards dimension 0, the batch, which "
                             f"data_parallel={self.axis!r} splits; shard another dimension")
        return P(self.axis, *entries[1:])

    # ---- on the last stage ----------------------------------------------------------------

    def part(self, s: int, ctx: StageContext, t: torch.Tensor) -> torch.Tensor:
        """This device's slice of the microbatch's ``t`` (its targets)."""
        k = self.degree(s)
        if k == 1:
            return t
        n = t.shape[0] // k
        return t.narrow(0, self.index(s, ctx.device) * n, n)

    def loss_scale(self, s: int, scale: float | None) -> float | None:
        """What the last stage's backward multiplies its slice's loss by: ``scale`` (the
        microbatches' mean, None: 1) over the number of slices."""
        k = self.degree(s)
        return scale if k == 1 else (1.0 if scale is None else scale) / k

    def mean(self, s: int, ctx: StageContext, loss: torch.Tensor) -> torch.Tensor:
        """The mean of the slices' losses, on every device of the line (a collective)."""
        k = self.degree(s)
        if k == 1:
            return loss
        mine = loss.reshape(1).to(torch.promote_types(loss.dtype, torch.float32))
        total = to_torch(ctx.all_reduce(from_torch(mine, ctx), self.axis), ctx)
        return (total / k).reshape(())

    def gathered(self, s: int, ctx: StageContext, y: torch.Tensor) -> torch.Tensor:
        """The whole microbatch's output from the slices' (a collective)."""
        k = self.degree(s)
        if k == 1:
            return y
        parts = to_torch(ctx.all_gather(from_torch(y.contiguous(), ctx), self.axis), ctx)
        # (the parts come stacked in device-id order; the batch's slices go in the axis's)
        line = reduce_line(self.meshes[s], ctx.device, self.axis)
        order = [sorted(line).index(d) for d in line]
        return parts[order].reshape(k * y.shape[0], *y.shape[1:])

    # ---- after the backward ---------------------------------------------------------------

    def grad_bytes(self, s: int, modules: Mapping[int, nn.Module]) -> int:
        """What stage ``s``'s reduction moves per device: its trainable parameters' bytes
        (0 where it splits no batch)."""
        if self.degree(s) == 1:
            return 0
        first = next(iter(modules.values()))
        return sum(p.numel() * p.element_size() for p in first.parameters() if p.requires_grad)

    def grad_sync(self, s: int, modules: Mapping[int, nn.Module], enter: Enter,
                  carried: Callable[[int], Mapping[nn.Parameter, torch.Tensor]],
                  nbytes: int) -> GradSync | None:
        """Stage ``s``'s gradient reduction (None where it splits no batch). ``carried(d)``:
        what device ``d``'s parameters held in ``.grad`` before the step (the same on every
        replica): kept as it is, only the step's own part is summed — gradients add up over
        steps, as without data parallelism. ``nbytes``: :meth:`grad_bytes`, counted once."""
        k = self.degree(s)
        if k == 1:
            return None
        axis = self.axis
        assert axis is not None

        def reduce(ctx: StageContext) -> None:
            with enter(ctx), torch.no_grad():
                before = carried(ctx.device)
                for params in _by_dtype(modules[ctx.device]):
                    _sum(params, ctx, axis, before)
        return GradSync(axis, nbytes, reduce)


def carried_grads(split: BatchSplit, local_stages: Iterable[Any]
                  ) -> dict[int, dict[nn.Parameter, torch.Tensor]]:
    """What the parameters of this process's devices of data-parallel stages
    (``local_stages``: :class:`~overlap.torch.LocalStage`) hold in ``.grad`` before a step
    (copies; none where every gradient is None, as after ``zero_grad``): the reduction sums
    only the step's part."""
    out: dict[int, dict[nn.Parameter, torch.Tensor]] = {}
    for st in local_stages:
        if split.degree(st.index) == 1:
            continue
        for d, m in zip(st.devices, st.modules):
            held = {p: p.grad.detach().clone() for p in m.parameters()
                    if p.requires_grad and p.grad is not None}
            if held:
                out[d] = held
    return out


def _by_dtype(module: nn.Module) -> Iterator[list[nn.Parameter]]:
    """The module's trainable parameters, grouped by dtype in their order (one bucket each:
    the same buckets, in the same order, on every replica)."""
    groups: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in module.parameters():
        if p.requires_grad:
            groups.setdefault(p.dtype, []).append(p)
    yield from groups.values()


def _sum(params: list[nn.Parameter], ctx: StageContext, axis: str,
         before: Mapping[nn.Parameter, torch.Tensor]) -> None:
    """Every replica's gradients of ``params`` replaced by what they held ``before`` the
    step plus the sum over the line of the step's part."""
    def part(p: nn.Parameter) -> torch.Tensor:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        old = before.get(p)
        return (g if old is None else g - old).reshape(-1)

    flat = torch.cat([part(p) for p in params])
    summed = to_torch(ctx.all_reduce(from_torch(flat, ctx), axis), ctx)
    for p, g in zip(params, summed.split([p.numel() for p in params])):
        g = g.view_as(p)
        old = before.get(p)
        if old is not None:
            g = g + old
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)


__all__ = ["BatchSplit", "carried_grads"]
