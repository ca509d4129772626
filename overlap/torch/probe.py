"""The shape probe: a :class:`~overlap.torch.TorchPipeline`'s boundaries, found by running it.

Every process needs each boundary's shape, dtype and two layouts before a step — they are
part of the step graph all processes agree on — so the pipeline runs its (full) stage modules
once, without autograd, on a microbatch of each new shape (and its target: the loss is checked
too), on the caller's thread. What a stage hands the next (:mod:`overlap.torch.crossing`) and
which tensors of a tuple ``data_parallel`` splits as the batch are learnt here and kept for
the stage functions. The probe leaves no trace: buffers (batch norm's running statistics) and
the global RNG (dropout) are put back as they were.

The probe runs user code for the first time on a shape, so a step bounds it by the runtime's
``timeout`` (``compile_timeout`` for compiled stages, :mod:`overlap.torch.compiled`) like any
op: past it the step fails with a ``StageTimeout`` naming the module, the probe's thread is
abandoned (it may still be using the modules) and the pipeline refuses further steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from scheduler import Boundaries, Boundary, BoundaryGroup, MicrobatchBoundaries, Sharding

from ..errors import OverlapRuntimeError, StageTimeout
from ..runtime import Runtime
from .bounded import call_within
from .checks import DeviceDtype, module_device_dtype
from .compiled import CompileBounds
from .crossing import Crossing
from .layouts import StageLayouts
from .stage_functions import LossFn, loss_of
from .stages import META
from .tensors import numpy_dtype


class ShapeProbe:
    """A pipeline's boundaries per microbatch shape (see module doc). ``device_dtype[s][k]``
    is where device ``k`` of stage ``s`` keeps its module, and its dtype (a list the pipeline
    updates when it moves shards to their GPUs)."""

    def __init__(self, modules: Sequence[Sequence[nn.Module]], layouts: StageLayouts,
                 device_dtype: Sequence[Sequence[DeviceDtype]], loss_fn: LossFn,
                 compile_bounds: CompileBounds) -> None:
        self.modules, self.layouts, self.loss_fn = modules, layouts, loss_fn
        self.device_dtype = device_dtype
        self.compile = compile_bounds
        # What each stage hands the next, and which tensors of a tuple data_parallel splits
        # as batch-major ((stage, key)): found here, read by the stage functions.
        self.crossings: dict[int, Crossing] = {}
        self.batch_major: dict[tuple[int, Any], bool] = {}
        self._found: dict[Any, tuple[BoundaryGroup, ...]] = {}
        self._probing = ("modules[0]", 0)  # what the probe runs now, and its stage
        self._lost: str | None = None  # a probe left running past the timeout

    def boundaries(self, x: torch.Tensor, target: torch.Tensor | None
                   ) -> tuple[BoundaryGroup, ...]:
        """The boundaries for microbatches like ``x`` (cached per shape), unbounded."""
        key = _probe_key(x, target)
        if key not in self._found:
            self._found[key] = self._probe(x, target)
        return self._found[key]

    def for_step(self, rt: Runtime, xs: Sequence[torch.Tensor],
                 targets: Sequence[torch.Tensor] | None) -> Boundaries:
        """A step's boundaries on ``rt`` for microbatches ``xs`` (and their ``targets``):
        :class:`scheduler.MicrobatchBoundaries` where their shapes differ; each new shape's
        probe bounded as the step's ops are (see module doc)."""
        rows = [self.within(rt, i, x, None if targets is None else targets[i])
                for i, x in enumerate(xs)]
        return list(rows[0]) if len(set(rows)) == 1 else MicrobatchBoundaries(tuple(rows))

    def within(self, rt: Runtime, i: int, x: torch.Tensor, target: torch.Tensor | None
               ) -> tuple[BoundaryGroup, ...]:
        """:meth:`boundaries` for microbatch ``i`` of a step on ``rt``, bounded as its ops
        are (see module doc)."""
        key = _probe_key(x, target)
        if key in self._found:
            return self._found[key]
        if self._lost is not None:
            raise OverlapRuntimeError(self._lost)
        timeout = self.compile.probe_bound(rt)
        start = time.perf_counter()
        done, found = call_within(lambda: self._probe(x, target), timeout,
                                  "overlap shape probe")
        if done:
            assert found is not None
            self._found[key] = found
            return found
        (what, s), seconds = self._probing, time.perf_counter() - start
        self._lost = (f"this pipeline's shape probe is still running {what} (abandoned "
                      f"past the timeout, {timeout:g} s): its modules may be in use — "
                      "make a new TorchPipeline (and Runtime)")
        err = StageTimeout(
            f"{what} never finished its first run on microbatch {i} "
            f"{tuple(x.shape)} {x.dtype} (the shape probe, on the caller's "
            f"process before the step): it has run {seconds:.1f} s (timeout {timeout:g} s). "
            "Its thread is abandoned and this pipeline refuses further steps",
            op=f"{what} (shape probe)", device=self.layouts.meshes[s].device_ids[0],
            stream="compute", stage=s, microbatch=i, phase="F", seconds=seconds)
        self.compile.explain(err)
        raise err

    def _probe(self, x: torch.Tensor, target: torch.Tensor | None
               ) -> tuple[BoundaryGroup, ...]:
        buffers = [(b, b.detach().clone()) for reps in self.modules for b in reps[0].buffers()]
        rng = torch.get_rng_state()
        try:
            return self._run(x, target)
        finally:
            torch.set_rng_state(rng)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

    def _run(self, x: torch.Tensor, target: torch.Tensor | None) -> tuple[BoundaryGroup, ...]:
        p = len(self.modules)
        out: list[BoundaryGroup] = []
        _, dt0 = self.device_dtype[0][0]
        if x.is_floating_point() and dt0 is not None and x.dtype != dt0:
            raise ValueError(f"inputs: dtype {x.dtype}, but modules[0] has {dt0} parameters")
        self._fits(x, 0, "input", "inputs: a microbatch")
        batch = x.shape[0] if x.dim() else None
        xs, came = [x], Crossing("tensor")  # (what crossed into the stage, and how)
        with torch.no_grad():
            for s, reps in enumerate(self.modules):
                tp = self.layouts.tp[s]
                dev = self.device_dtype[s][0][0] if tp is None else \
                    module_device_dtype(tp.module, f"modules[{s}]")[0]  # (the full module's)
                name = f"modules[{s}]"
                self._probing = (name, s)
                if dev is not None and dev != META:  # (after a stage run elsewhere: zeros)
                    xs = [torch.zeros_like(t, device=dev) if t.is_meta else t for t in xs]
                try:
                    y = came.call(reps[0] if tp is None else tp.module,
                                  [t if dev is None else t.to(dev) for t in xs])
                except Exception as exc:
                    shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in xs)
                    raise ValueError(f"{name}: forward failed on a microbatch of shape "
                                     f"{shapes}: {exc}") from exc
                if s == p - 1:
                    if not isinstance(y, torch.Tensor):
                        raise TypeError(f"{name}: forward returned {type(y).__name__}; the last "
                                        "stage must return one tensor (loss_fn reads it)")
                    if not y.is_meta:  # (the last stage's own processes check its loss)
                        self._check_loss(y, target)
                    break
                crossing = Crossing.of(y, f"{name} forward")
                known = self.crossings.setdefault(s, crossing)
                if known != crossing:
                    raise ValueError(f"{name}: forward returned a {crossing.kind} with "
                                     f"{list(crossing.keys)} on this microbatch shape, a "
                                     f"{known.kind} with {list(known.keys)} on another: a "
                                     "stage hands on the same structure for every shape")
                tensors = crossing.tensors(y, f"{name} forward")
                out.append(self._boundary_group(s, crossing, tensors, batch))
                xs, came = tensors, crossing
        return tuple(out)

    def _boundary_group(self, s: int, crossing: Crossing, tensors: list[torch.Tensor],
                        batch: int | None) -> BoundaryGroup:
        """Boundary ``s`` from the tensors stage ``s`` hands on: one Boundary, or one per
        tensor of a tuple or dict (see :mod:`overlap.torch.crossing`)."""
        name = f"modules[{s}]"
        _, nxt = self.device_dtype[s + 1][0]
        group = []
        for e, (key, y) in enumerate(zip(crossing.tensor_keys, tensors)):
            npd = numpy_dtype(y.dtype)
            entry = f" entry {key!r}" if crossing.grouped else ""
            if npd is None or (not crossing.grouped and not y.is_floating_point()):
                raise ValueError(f"{name}: output{entry} dtype {y.dtype}; a boundary must be a "
                                 f"floating dtype (float16/32/64, bfloat16, float8: gradients "
                                 f"cross it)" + ("" if npd is None else "; return it in a tuple "
                                                 "with the activations to pass it on without "
                                                 "a gradient"))
            if y.is_floating_point() and nxt is not None and y.dtype != nxt and e == 0:
                raise ValueError(f"modules[{s + 1}]: its parameters are {nxt}, but boundary "
                                 f"{s} (modules[{s}]'s output{entry}) is {y.dtype}")
            what = f"boundary {s}{entry} ({tuple(y.shape)} {y.dtype})"
            # (a tensor of a tuple splits over data_parallel where its dimension 0 is the
            # batch — decided on the first shape seen, kept for every later one: positions
            # of shape (1, seq) are the same for every sample and stay whole)
            split = e == 0 or self.batch_major.setdefault(
                (s, key), y.dim() > 0 and y.shape[0] == batch)
            group.append(Boundary(tuple(y.shape), str(npd),
                                  self._fits(y, s, "output", what, e, split),
                                  self._fits(y, s + 1, "input", what, e, split)))
        return tuple(group) if crossing.grouped else group[0]

    def _fits(self, y: torch.Tensor, s: int, side: str, what: str, element: int = 0,
              batch_split: bool = True) -> Sharding:
        """Stage s's ``side`` layout for ``y``, checked to split it evenly."""
        layouts = self.layouts
        sharding = layouts.sharding(s, side, y.dim(), element, batch_split)
        for dim, entry in enumerate(sharding.spec.padded(y.dim())):
            if entry is None:
                continue
            k = layouts.meshes[s].axis_sizes[entry]
            if y.shape[dim] % k and entry == layouts.data_parallel.axis and dim == 0:
                raise ValueError(f"data_parallel: {what} has a batch of {y.shape[0]}, which does "
                                 f"not split over stage {s}'s axis {entry!r} of size {k}; "
                                 "give microbatches whose size it divides")
            if y.shape[dim] % k:
                layout = layouts.layouts(s)[0 if side == "input" else 1]
                raise ValueError(f"{layouts.owner(s)}: stage {s}'s {side} layout {layout!r} "
                                 f"splits dimension {dim} of {what} ({y.shape[dim]}) over mesh "
                                 f"axis {entry!r} of size {k}, which does not divide it")
        return sharding

    def _check_loss(self, y: torch.Tensor, target: torch.Tensor | None) -> None:
        self._probing = ("loss_fn", len(self.modules) - 1)
        try:
            loss = loss_of(self.loss_fn, y, target)
        except Exception as exc:
            given = "without targets" if target is None else \
                f"and target {tuple(target.shape)} {target.dtype}"
            raise ValueError(f"loss_fn: failed on the last stage's output {tuple(y.shape)} "
                             f"{given}: {exc}") from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn: returned {what}; it must return a scalar tensor (the "
                             f"microbatch's loss)")


def _probe_key(x: torch.Tensor, target: torch.Tensor | None) -> tuple[Any, ...]:
    """What a probe's result depends on: the microbatch's and the target's shapes and dtypes."""
    return (tuple(x.shape), x.dtype, None if target is None else (tuple(target.shape),
                                                                   target.dtype))


__all__ = ["ShapeProbe"]
