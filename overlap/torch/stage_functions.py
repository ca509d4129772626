"""The SPMD stage functions of a :class:`~overlap.torch.TorchPipeline`'s stages.

Forward runs the device's module on its input (a tensor sharing the runtime's buffer, or the
tensors of a tuple boundary) with autograd recording, keeps the inputs and outputs in
``ctx.saved`` and hands the outputs back without a copy; the last stage applies ``loss_fn``
and returns the loss. Backward calls ``torch.autograd.backward`` from the outputs with their
incoming gradients (the loss's on the last stage) and returns the inputs' ``.grad``. The split
backward's ``I`` and ``W`` (:mod:`overlap.torch.split_backward`) and a data-parallel stage's
gradient reduction (:mod:`overlap.torch.data_parallel`) are here too.

What a step's functions read besides their arguments — its targets, loss scale, outputs
collected, intra-op threads, the gradients held before it — is one immutable
:class:`StepInputs`, a value bound into the stage functions made for that step
(:meth:`StageFunctions.stages`): each step runs its own ``Stage`` objects, so nothing of a
step is left on the pipeline for the stream threads to read, and nothing needs resetting
after it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from scheduler import DeviceMesh

from ..errors import OverlapRuntimeError
from ..pipeline import Stage, StageContext
from .crossing import Crossing
from .data_parallel import BatchSplit
from .parallel import TensorParallel
from .shard_errors import shard_failure
from .split_backward import (
    Weights,
    plain_split_input,
    stage_backward_input,
    stage_backward_weight,
)
from .tensors import from_torch, op_stream, to_torch
from .threads import run_with

LossFn = Callable[..., torch.Tensor]
_ONE = Crossing("tensor")  # (a boundary of one tensor)


@dataclass(frozen=True)
class StepInputs:
    """One step's values for its stage functions: the targets per microbatch, the loss
    scale (1 / microbatches with ``scale_grads``; None: 1), the dict the last stage's outputs
    are collected in (with ``return_outputs``), the intra-op threads, and per device of a
    data-parallel stage what its parameters held in ``.grad`` before the step."""

    targets: Sequence[torch.Tensor] | None = None
    loss_scale: float | None = None
    outputs: dict[int, torch.Tensor] | None = None
    threads: int = 1
    carried: Mapping[int, Mapping[nn.Parameter, torch.Tensor]] = field(default_factory=dict)


def loss_of(loss_fn: LossFn, y: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """``loss_fn`` on the last stage's output (and its target, moved to the output's
    device)."""
    if target is None:
        return loss_fn(y)
    return loss_fn(y, target.to(y.device, non_blocking=True))


class StageFunctions:
    """Every stage's forward, backward, split backward and gradient reduction (see module
    doc), over the pipeline's modules; ``crossings`` and ``batch_major`` are the pipeline's
    shape probe's findings (filled before a step runs)."""

    def __init__(self, meshes: Sequence[DeviceMesh], modules: Sequence[Sequence[nn.Module]],
                 tp: Sequence[TensorParallel | None], loss_fn: LossFn,
                 data_parallel: BatchSplit, crossings: Mapping[int, Crossing],
                 batch_major: Mapping[tuple[int, Any], bool]) -> None:
        self.meshes, self.tp, self.loss_fn = tuple(meshes), tuple(tp), loss_fn
        self.data_parallel = data_parallel
        self._crossings, self._batch_major = crossings, batch_major
        self._by_device = [dict(zip(mesh.device_ids, reps))
                           for mesh, reps in zip(self.meshes, modules)]
        # Each tensor-parallel device's collectives read the op's context (parallel.py).
        self._comms = [{} if t is None else dict(zip(t.mesh.device_ids, t.comms))
                       for t in self.tp]
        # torch's ExternalStream of each runtime CUDA stream (tensors.op_stream), made once.
        self._torch_streams: dict[tuple[int, int], Any] = {}
        # Each device's module's parameters and their gradient accumulators (split_backward).
        self._weights: dict[int, Weights] = {}
        # What each data-parallel stage's reduction moves, counted once (as the step graph
        # has it): a step's stages are made per step, their parameters not recounted.
        self._grad_bytes = [data_parallel.grad_bytes(s, m) for s, m in enumerate(self._by_device)]

    def stages(self, kind: str, step: StepInputs | None = None) -> tuple[Stage, ...]:
        """The runtime's stages for one step's ``step`` values (default: no targets, no
        loss scale, no outputs collected, one thread): ``"train"`` (the fused backward),
        ``"split"`` (``I`` and ``W``), ``"eval"`` (forward only: no graph recorded, nothing
        kept)."""
        step = StepInputs() if step is None else step
        out = []
        for s, mesh in enumerate(self.meshes):
            if kind == "eval":
                out.append(Stage(mesh, self._forward(s, step, train=False), _no_backward))
                continue
            sync = self.data_parallel.grad_sync(s, self._by_device[s],
                                                functools.partial(self._reduce_in, step),
                                                lambda d: step.carried.get(d, {}),
                                                self._grad_bytes[s])
            if kind == "split":
                out.append(Stage(mesh, self._forward(s, step), self._backward_input(s, step),
                                 self._backward_weight(s, step), sync))
            else:
                out.append(Stage(mesh, self._forward(s, step), self._backward(s, step),
                                 data_parallel=sync))
        return tuple(out)

    @contextlib.contextmanager
    def _entered(self, s: int, ctx: StageContext) -> Iterator[None]:
        """The op's context for the stage's tensor-parallel collectives (comm.py)."""
        comm = self._comms[s].get(ctx.device)
        if comm is None:
            yield
            return
        comm.ctx = ctx
        try:
            yield
        finally:
            comm.ctx = None

    @contextlib.contextmanager
    def _reduce_in(self, step: StepInputs, ctx: StageContext) -> Iterator[None]:
        """Where a data-parallel stage's gradient reduction runs its torch work: the op's
        stream and intra-op threads, as a stage function's."""
        run_with(step.threads)
        with op_stream(ctx, self._torch_streams):
            yield

    def _forward(self, s: int, step: StepInputs, train: bool = True
                 ) -> Callable[[StageContext, Any], Any]:
        last = s == len(self.meshes) - 1
        modules = self._by_device[s]
        grad_mode = torch.enable_grad if train else torch.no_grad
        crossings = self._crossings  # (filled by the shape probe, before any step)

        def forward(ctx: StageContext, x: Any) -> Any:
            run_with(step.threads)  # (intra-op threads are per thread too: module doc)
            came = crossings.get(s - 1, _ONE)
            # (grad mode is per thread in torch)
            with op_stream(ctx, self._torch_streams), grad_mode(), self._entered(s, ctx):
                xts = [to_torch(a, ctx) for a in (x if came.grouped else (x,))]
                if s > 0 and train:
                    for t in xts:
                        if t.is_floating_point():
                            t.requires_grad_(True)  # its .grad is what backward returns
                try:
                    y = came.call(modules[ctx.device], xts)
                except Exception as exc:  # (a shard's shape error says what to do)
                    tp = self.tp[s]
                    if tp is None or isinstance(exc, OverlapRuntimeError):
                        raise
                    raise shard_failure(tp, s, ctx.device, exc) from exc
                if train:
                    ctx.saved["x"] = xts
                if last:
                    split = self.data_parallel
                    loss = loss_of(self.loss_fn, y, None if step.targets is None
                                   else split.part(s, ctx, step.targets[ctx.microbatch]))
                    scale = split.loss_scale(s, step.loss_scale)
                    if train:
                        ctx.saved["out"] = [loss if scale is None else loss * scale]
                    if step.outputs is not None:
                        whole = split.gathered(s, ctx, y.detach())  # (the batch's parts)
                        if ctx.device == ctx.mesh.device_ids[0]:
                            step.outputs[ctx.microbatch] = whole  # (one device's: the
                            # last stage's output is replicated over the rest of its mesh)
                    # The microbatch's loss: the mean of its parts' (float() after the step:
                    # no device sync here).
                    return split.mean(s, ctx, loss.detach())
                goes = crossings.get(s, _ONE)
                ys = goes.tensors(y, f"modules[{s}] forward")
                if goes.grouped and self.data_parallel.degree(s) > 1:
                    self._check_batch_major(s, goes, ys, xts[0])
                if train:
                    ctx.saved["out"] = ys
                arrays = tuple(from_torch(t.detach(), ctx) for t in ys)
                return arrays if goes.grouped else arrays[0]
        return forward

    def _check_batch_major(self, s: int, goes: Crossing, ys: list[torch.Tensor],
                           first: torch.Tensor) -> None:
        """A tuple's tensors data_parallel splits as the batch hold this device's samples."""
        local = first.shape[0] if first.dim() else None
        for key, y in zip(goes.tensor_keys[1:], ys[1:]):
            if self._batch_major.get((s, key)) and (y.dim() == 0 or y.shape[0] != local):
                raise ValueError(
                    f"modules[{s}] forward: entry {key!r} has dimension 0 of size "
                    f"{y.shape[0] if y.dim() else 'none'}, but data_parallel splits it as the "
                    f"batch (its size was the microbatch's when the pipeline first saw it) and "
                    f"this device holds {local} samples; a tensor whose first dimension is not "
                    "the batch needs a leading dimension of 1 (it then stays whole on every "
                    "device)")

    def _backward(self, s: int, step: StepInputs) -> Callable[[StageContext, Any], Any]:
        def backward(ctx: StageContext, dy: Any) -> Any:
            run_with(step.threads)
            xts, outs = ctx.saved.pop("x"), ctx.saved.pop("out")
            with op_stream(ctx, self._torch_streams), self._entered(s, ctx):
                ys, grads = self._pairs(s, ctx, outs, dy)
                if ys:
                    torch.autograd.backward(ys, grads)
                return self._input_grads(s, ctx, xts)
        return backward

    def _pairs(self, s: int, ctx: StageContext, outs: list[torch.Tensor], dy: Any
               ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The outputs a backward starts from, with their incoming gradients (the loss: none;
        a tensor of a boundary without a gradient — an integer one — or that needs none is
        left out)."""
        if dy is None:  # (the last stage: its loss)
            return [o for o in outs if o.requires_grad], [None] * sum(o.requires_grad
                                                                     for o in outs)
        dys = dy if self._crossings.get(s, _ONE).grouped else (dy,)
        pairs = [(o, to_torch(g, ctx)) for o, g in zip(outs, dys)
                 if g is not None and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _input_grads(self, s: int, ctx: StageContext, xts: list[torch.Tensor]) -> Any:
        """What a backward returns: each floating-point input's gradient (zeros where the
        output does not depend on it), None for the others; a tuple for a boundary of
        several tensors."""
        if s == 0:
            return None
        dxs = tuple(from_torch(t.grad if t.grad is not None else torch.zeros_like(t), ctx)
                    if t.is_floating_point() else None for t in xts)
        return dxs if self._crossings.get(s - 1, _ONE).grouped else dxs[0]

    def _backward_input(self, s: int, step: StepInputs
                        ) -> Callable[[StageContext, Any], Any]:
        """``I``: the input's gradient only, keeping for ``W`` the gradients that reach the
        parameterized layers (:mod:`overlap.torch.split_backward`; stage 0's input needs
        none: its ``I`` leaves everything to ``W``). A stage with several tensors in or out
        splits plainly: ``I`` one walk for the inputs' gradients, ``W`` one for the
        parameters'."""
        modules = self._by_device[s]

        def backward_input(ctx: StageContext, dy: Any) -> Any:
            run_with(step.threads)
            xts, outs = ctx.saved.pop("x"), ctx.saved.pop("out")
            with op_stream(ctx, self._torch_streams), self._entered(s, ctx):
                weights = Weights.of(modules[ctx.device].parameters(),
                                     self._weights.get(ctx.device))
                self._weights[ctx.device] = weights
                ys, grads = self._pairs(s, ctx, outs, dy)
                if len(ys) == 1 and len(xts) == 1:
                    dx, ctx.saved["weights"] = stage_backward_input(
                        ys[0], grads[0], xts[0] if s > 0 else None, weights)
                    if s > 0 and dx is not None:
                        xts[0].grad = dx
                else:
                    ctx.saved["weights"] = plain_split_input(ys, grads,
                                                             xts if s > 0 else [], weights)
                return self._input_grads(s, ctx, xts)
        return backward_input

    def _backward_weight(self, s: int, step: StepInputs) -> Callable[[StageContext], None]:
        """``W``: the parameters' gradients, added to their ``.grad``; frees the graph."""
        def backward_weight(ctx: StageContext) -> None:
            run_with(step.threads)
            pending = ctx.saved.pop("weights")
            with op_stream(ctx, self._torch_streams), self._entered(s, ctx):
                stage_backward_weight(pending)
        return backward_weight


def _no_backward(ctx: StageContext, dy: Any) -> Any:
    raise RuntimeError("an evaluation step has no backward (its schedule is forward-only)")


__all__ = ["StageFunctions", "StepInputs", "loss_of"]
