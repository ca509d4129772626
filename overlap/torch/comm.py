"""Autograd-aware collectives over one mesh axis, for tensor-parallel stage modules.

A tensor-parallel shard module runs inside a stage function, on its device's compute stream;
its collectives go through that op's :class:`overlap.StageContext` (``ctx.all_reduce``,
``ctx.all_gather``: the runtime's stage collectives, on the CPU and CUDA backends alike).
The context changes with every op, so each device has a :class:`AxisComm` whose ``ctx`` the
pipeline sets at the start of each stage function (one op runs at a time on a device's
compute stream, so one slot per device is enough).

Every tensor that flows between modules holds *exact* gradients: a replicated tensor's
gradient is the full one on every device, a sharded tensor's is its shard's. Each parallel
style therefore reduces the partial gradients it creates where it creates them, and each
conversion is a pair (forward, backward):

================  =================  ======================================================
forward           backward           where
================  =================  ======================================================
identity          all-reduce         replicated input of a column-parallel module
all-reduce        identity           row-parallel output, replicated
all-gather        reduce-scatter     sequence-sharded input of a column-parallel module
reduce-scatter    all-gather         row-parallel output, sequence-sharded
all-gather        split              a sharded output made replicated (``output_layouts``)
split             all-gather         a replicated input made sharded
================  =================  ======================================================

Column-parallel modules that read one tensor within one op share its conversion
(:meth:`AxisComm.shared`): autograd sums their gradients first, and the sum is reduced once.

A reduce-scatter is an all-reduce of which each device keeps its block (the runtime has no
reduce-scatter collective: it moves twice the bytes one would).

On a CPU tensor torch runs the backward on the calling thread (the stage's stream thread),
so a backward collective waits where the forward's did. On CUDA torch runs every backward of
one GPU on that GPU's one autograd thread: a device waiting there in a collective holds up
every other device of its GPU, so ``TorchPipeline`` refuses a tensor-parallel device that
shares its GPU with another device (one process per GPU never does).
"""

from __future__ import annotations

from typing import Any

import torch

from ..pipeline import StageContext
from .tensors import from_torch, to_torch


class AxisComm:
    """The collectives of one device over its line along one mesh axis (see module doc)."""

    def __init__(self, device: int, axis: str, group: tuple[int, ...]) -> None:
        self.device, self.axis = device, axis
        self.group = group  # the line's devices in mesh order (shard k is group[k]'s)
        self.size = len(group)
        self.index = group.index(device)
        # Rows of an all-gather come in device-id order; shards are in mesh order.
        self._rows = [sorted(group).index(d) for d in group]
        self._ctx: StageContext | None = None
        self._made: dict[tuple[int, object], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def ctx(self) -> StageContext | None:
        return self._ctx

    @ctx.setter
    def ctx(self, ctx: StageContext | None) -> None:
        """The op's context (None between ops); what :meth:`shared` made dies with it."""
        self._ctx = ctx
        self._made.clear()

    def shared(self, x: torch.Tensor, key: object, make: Any) -> torch.Tensor:
        """``make()`` once per input tensor and conversion within one op: column-parallel
        q, k and v reading one replicated input then share one conversion, whose backward
        reduces their summed gradient once (Megatron's one all-reduce) instead of three."""
        k = (id(x), key)
        hit = self._made.get(k)
        if hit is not None and hit[0] is x:
            return hit[1]
        y = make()
        if self._ctx is not None:  # (kept only inside an op: the slot is cleared after it)
            self._made[k] = (x, y)
        return y

    def _context(self, what: str) -> StageContext:
        if self.ctx is None:
            raise RuntimeError(f"{what}: a tensor-parallel module runs only inside a pipeline "
                               "stage function (TorchPipeline sets its context); call the full "
                               "module for single-device use")
        return self.ctx

    def run(self, op: str, t: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        if op == "identity" or self.size == 1:
            return t
        if op == "split":
            return self._block(t, dim, what)
        ctx = self._context(what)
        arr = from_torch(t.detach().contiguous(), ctx)
        if op in ("all_reduce", "reduce_scatter"):
            total = to_torch(ctx.all_reduce(arr, self.axis), ctx)
            return total if op == "all_reduce" else self._block(total, dim, what)
        assert op == "all_gather"
        rows = to_torch(ctx.all_gather(arr, self.axis), ctx)
        return torch.cat([rows[r] for r in self._rows], dim=dim)

    def _block(self, t: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        if t.shape[dim] % self.size:
            raise ValueError(f"{what}: dimension {dim} of {tuple(t.shape)} does not split over "
                             f"mesh axis {self.axis!r} of size {self.size}")
        return t.chunk(self.size, dim)[self.index].contiguous()


class _Convert(torch.autograd.Function):
    """One conversion: ``forward`` op on the way in, ``backward`` op on the gradient."""

    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, comm: AxisComm, fwd: str, bwd: str, dim: int,
                what: str) -> torch.Tensor:
        fctx.comm, fctx.bwd, fctx.dim, fctx.what = comm, bwd, dim, what
        y = comm.run(fwd, x, dim, what)
        return y.view_as(y) if y is x else y

    @staticmethod
    def backward(fctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return (fctx.comm.run(fctx.bwd, g, fctx.dim, f"{fctx.what} (backward)"),
                None, None, None, None, None)


def convert(x: torch.Tensor, comm: AxisComm, fwd: str, bwd: str, dim: int = -1,
            what: str = "") -> torch.Tensor:
    """``x`` through ``fwd`` (its gradient through ``bwd``); see the module doc's table."""
    if comm.size == 1 or (fwd == bwd == "identity"):
        return x
    return _Convert.apply(x, comm, fwd, bwd, dim % x.dim(), what)


def reduce_grad(comm: AxisComm, what: str) -> Any:
    """A tensor hook summing a replicated parameter's gradient over the axis (a parameter of
    a sequence-parallel module sees only its sequence block)."""
    def hook(g: torch.Tensor) -> torch.Tensor:
        return comm.run("all_reduce", g, 0, f"{what} (gradient)")
    return hook


__all__ = ["AxisComm", "convert", "reduce_grad"]
