"""``TorchPipeline``: ``nn.Module`` stages as the runtime's SPMD stage functions.

Forward runs the device's module on its input (a tensor sharing the runtime's buffer) with
autograd recording, keeps the input and the output in ``ctx.saved`` and hands the output back
without a copy; the last stage applies ``loss_fn`` and returns the loss. Backward calls
``torch.autograd.backward`` with the incoming gradient (``loss.backward()`` on the last stage)
and returns the input's ``.grad``. Parameter gradients therefore accumulate in ``.grad`` over
the step's microbatches, exactly as repeated ``loss.backward()`` calls would, and the user's
optimizer and ``zero_grad`` work unchanged.

Schedules that split the backward (``zb-h1``, ``zbv``) get stages whose ``I`` computes only the
input's gradient (``torch.autograd.grad``, keeping the graph) and whose ``W`` then
accumulates the parameters' (``torch.autograd.backward(..., inputs=params)``), so the gradient
leaves for the previous stage before the weight gradient is computed. Autograd walks the
stage's graph twice for that, as torch's own split (without its hooks that keep the
intermediate gradients) would.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from scheduler import Boundary, DeviceMesh, P, PlanOptions, Schedule, Sharding

from ..pipeline import Stage, StageContext
from ..runtime import Runtime, _schedule
from .checks import check_count, check_meshes, check_modules, module_device_dtype
from .tensors import from_torch, numpy_dtype, op_stream, to_torch
from .threads import check_threads, default_threads, run_with

LossFn = Callable[..., torch.Tensor]


def _check_runtime(rt: Any) -> None:
    if not isinstance(rt, Runtime):
        raise TypeError(f"rt: expected an overlap.Runtime, got {type(rt).__name__}")


class TorchPipeline:
    """Pipeline stages made of torch modules, trained by an :class:`overlap.Runtime`.

    Args:
        modules: one entry per stage — an ``nn.Module`` for a one-device mesh, or a list of
            modules, one per device of the stage's mesh in ``mesh.device_ids`` order. Each
            device needs its own module object (replicas: ``copy.deepcopy``), identical
            at the start; the stage's output must be one tensor.
        meshes: each stage's device mesh: disjoint, except that stages of one rank of a
            schedule with several stages per rank (``interleaved-1f1b``, ``zbv``) share it.
        loss_fn: ``loss_fn(output, target)`` (or ``loss_fn(output)`` when a step gets no
            targets) on the last stage's output; returns the microbatch's scalar loss.
        num_threads: torch's intra-op threads in every stage function (they run on the
            runtime's stream threads, where the caller's ``torch.set_num_threads`` does not
            reach). Default: the calling thread's setting, or, with several ranks on a host
            and no ``OMP_NUM_THREADS``, the host's cores per rank (see
            :mod:`overlap.torch.threads`).

    Intra-stage parallelism: **replication**. Every device of a stage's mesh runs the whole
    stage on the whole microbatch (boundary layouts ``P()`` on both sides), and every replica
    gets the full gradient in its own ``.grad`` — give the optimizer :meth:`parameters` and the
    replicas stay identical. Tensor or data parallelism inside a stage is not done by this
    adapter (write an :class:`overlap.Stage` with ``ctx.all_reduce`` for that).
    """

    def __init__(self, modules: Sequence[nn.Module | Sequence[nn.Module]],
                 meshes: Sequence[DeviceMesh], loss_fn: LossFn, *,
                 num_threads: int | None = None) -> None:
        self.num_threads = check_threads(num_threads)
        self.meshes = check_meshes(meshes)
        self.modules = check_modules(modules, self.meshes)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn: expected a callable (output, target) -> scalar loss "
                            f"tensor, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self._device_dtype = [[module_device_dtype(m, f"modules[{s}][{k}]")
                               for k, m in enumerate(reps)]
                              for s, reps in enumerate(self.modules)]
        self._by_device = [dict(zip(mesh.device_ids, reps))
                           for mesh, reps in zip(self.meshes, self.modules)]
        self.stages: tuple[Stage, ...] = tuple(
            Stage(mesh, self._forward(s), self._backward(s)) for s, mesh in enumerate(self.meshes)
        )
        # For schedules with I and W: the same forwards, the backward in two.
        self.split_stages: tuple[Stage, ...] = tuple(
            Stage(mesh, self._forward(s), self._backward_input(s), self._backward_weight(s))
            for s, mesh in enumerate(self.meshes))
        self._targets: list[torch.Tensor] | None = None
        self._threads = 1  # intra-op threads of the step in flight (set by train_step)
        self._busy = threading.Lock()  # one step at a time: targets belong to the step
        self._boundaries: dict[Any, tuple[Boundary, ...]] = {}

    # ---- what a training loop uses --------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of every device's module (each replica's own), for the optimizer."""
        for reps in self.modules:
            for m in reps:
                yield from m.parameters()

    @property
    def input_sharding(self) -> Sharding:
        return Sharding(self.meshes[0], P())

    async def train_step(self, rt: Runtime, inputs: torch.Tensor,
                         targets: torch.Tensor | None = None, *, num_microbatches: int,
                         schedule: str | Schedule = "eager-1f1b",
                         options: PlanOptions | None = None,
                         max_activations: int | Sequence[int] | None = None) -> list[float]:
        """One step: split ``inputs`` (and ``targets``) into ``num_microbatches`` along dim 0,
        run forward and backward of each on ``rt``; return the per-microbatch losses
        (``schedule``, ``options`` and ``max_activations`` as for
        :meth:`overlap.Runtime.train_step`).

        Gradients are *added* to ``.grad`` (call ``zero_grad`` between steps, as in torch);
        after a failed step they hold a partial sum — zero them before the next one.
        """
        mbs, tgts, boundaries = self.prepare(rt, inputs, targets, num_microbatches)
        # ("auto" gets the fused backward: it then chooses among unsplit schedules.)
        split = schedule != "auto" and bool(
            _schedule(schedule, len(self.meshes), len(mbs)).kinds & {"I", "W"})
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("TorchPipeline: a step is already running on this pipeline")
        self._targets = tgts
        self._threads = self.num_threads or default_threads(rt.world)
        try:
            return await rt.train_step(self.split_stages if split else self.stages, boundaries,
                                       mbs,
                                       input_sharding=self.input_sharding, schedule=schedule,
                                       options=options, max_activations=max_activations)
        finally:
            self._targets = None
            self._busy.release()

    def train_step_sync(self, rt: Runtime, inputs: torch.Tensor,
                        targets: torch.Tensor | None = None, **kwargs: Any) -> list[float]:
        """:meth:`train_step` for synchronous callers (on the runtime's kept event loop)."""
        _check_runtime(rt)
        return rt.run_sync(self.train_step(rt, inputs, targets, **kwargs),
                           "TorchPipeline.train_step_sync")

    # ---- checks and boundaries ------------------------------------------------------------

    def prepare(self, rt: Runtime, inputs: torch.Tensor, targets: torch.Tensor | None,
                num_microbatches: int) -> tuple[list[Any], list[Any] | None, list[Boundary]]:
        """Check a step's arguments and make its microbatches (views, no copies) and
        boundaries; raises before anything is launched."""
        _check_runtime(rt)
        m = check_count(num_microbatches, "num_microbatches")
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(f"inputs: expected a torch.Tensor, got {type(inputs).__name__}")
        if inputs.dim() < 1 or inputs.shape[0] % m:
            raise ValueError(f"inputs: batch dimension of shape {tuple(inputs.shape)} does not "
                             f"split into num_microbatches={m} equal microbatches")
        if targets is not None:
            if not isinstance(targets, torch.Tensor):
                raise TypeError(f"targets: expected a torch.Tensor or None, got "
                                f"{type(targets).__name__}")
            if targets.dim() < 1 or targets.shape[0] != inputs.shape[0]:
                raise ValueError(f"targets: shape {tuple(targets.shape)} does not match the "
                                 f"batch of inputs {tuple(inputs.shape)} along dim 0")
        cuda = rt.backend.name == "cuda"
        self._check_placement(rt, cuda)
        want = torch.device("cuda") if cuda else torch.device("cpu")
        if inputs.device.type != want.type:
            raise ValueError(f"inputs: on {inputs.device}, the runtime's {rt.backend.name} "
                             f"backend needs them on {want.type}")
        xs = inputs.detach().chunk(m)
        mbs = [x.numpy() if not cuda else rt.backend.xp.from_dlpack(x) for x in xs]
        tgts = list(targets.detach().chunk(m)) if targets is not None else None
        return mbs, tgts, list(self.boundaries(xs[0], tgts[0] if tgts else None))

    def boundaries(self, microbatch: torch.Tensor,
                   target: torch.Tensor | None = None) -> tuple[Boundary, ...]:
        """Each stage's output per microbatch (shape, dtype; replicated layouts), found by
        running the stages once without autograd on ``microbatch`` (cached per shape)."""
        key = (tuple(microbatch.shape), microbatch.dtype,
               None if target is None else (tuple(target.shape), target.dtype))
        if key not in self._boundaries:
            self._boundaries[key] = self._probe(microbatch, target)
        return self._boundaries[key]

    def _check_placement(self, rt: Runtime, cuda: bool) -> None:
        top = max(d for mesh in self.meshes for d in mesh.device_ids)
        if top >= rt.cluster.num_devices:
            raise ValueError(f"meshes: device {top} is outside the runtime's cluster "
                             f"(devices 0..{rt.cluster.num_devices - 1})")
        for s, mesh in enumerate(self.meshes):
            for k, d in enumerate(mesh.device_ids):
                dev, _ = self._device_dtype[s][k]
                if dev is None:
                    continue
                want = torch.device("cuda", rt.backend.physical(d)) if cuda else \
                    torch.device("cpu")
                if dev != want:
                    raise ValueError(f"modules[{s}][{k}]: on {dev}, but device {d} of the "
                                     f"runtime's {rt.backend.name} backend is {want}")

    def _probe(self, x: torch.Tensor, target: torch.Tensor | None) -> tuple[Boundary, ...]:
        # The probe must leave no trace: buffers (BatchNorm's running statistics) and the
        # global RNG (dropout) are put back as they were.
        buffers = [(b, b.detach().clone()) for reps in self.modules for b in reps[0].buffers()]
        rng = torch.get_rng_state()
        try:
            return self._run_probe(x, target)
        finally:
            torch.set_rng_state(rng)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)

    def _run_probe(self, x: torch.Tensor, target: torch.Tensor | None) -> tuple[Boundary, ...]:
        p = len(self.modules)
        out: list[Boundary] = []
        _, dt0 = self._device_dtype[0][0]
        if x.is_floating_point() and dt0 is not None and x.dtype != dt0:
            raise ValueError(f"inputs: dtype {x.dtype}, but modules[0] has {dt0} parameters")
        with torch.no_grad():
            for s, reps in enumerate(self.modules):
                dev, _ = self._device_dtype[s][0]
                name = f"modules[{s}]"
                try:
                    y = reps[0](x if dev is None else x.to(dev))
                except Exception as exc:
                    raise ValueError(f"{name}: forward failed on a microbatch of shape "
                                     f"{tuple(x.shape)} {x.dtype}: {exc}") from exc
                if not isinstance(y, torch.Tensor):
                    raise TypeError(f"{name}: forward returned {type(y).__name__}; a stage must "
                                    f"return one tensor")
                if s == p - 1:
                    self._probe_loss(y, target)
                    break
                _, nxt = self._device_dtype[s + 1][0]
                npd = numpy_dtype(y.dtype)
                if not y.is_floating_point() or npd is None:
                    raise ValueError(f"{name}: output dtype {y.dtype}; a boundary must be a "
                                     f"floating dtype numpy knows (gradients cross it)")
                if nxt is not None and y.dtype != nxt:
                    raise ValueError(f"modules[{s + 1}]: its parameters are {nxt}, but boundary "
                                     f"{s} (modules[{s}]'s output) is {y.dtype}")
                out.append(Boundary(tuple(y.shape), str(npd),
                                    Sharding(self.meshes[s], P()),
                                    Sharding(self.meshes[s + 1], P())))
                x = y
        return tuple(out)

    def _probe_loss(self, y: torch.Tensor, target: torch.Tensor | None) -> None:
        try:
            loss = self._loss(y, target)
        except Exception as exc:
            given = "without targets" if target is None else \
                f"and target {tuple(target.shape)} {target.dtype}"
            raise ValueError(f"loss_fn: failed on the last stage's output {tuple(y.shape)} "
                             f"{given}: {exc}") from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn: returned {what}; it must return a scalar tensor (the "
                             f"microbatch's loss)")

    def _loss(self, y: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        if target is None:
            return self.loss_fn(y)
        return self.loss_fn(y, target.to(y.device, non_blocking=True))

    # ---- the stage functions --------------------------------------------------------------

    def _forward(self, s: int) -> Callable[[StageContext, Any], Any]:
        last = s == len(self.meshes) - 1
        modules = self._by_device[s]

        def forward(ctx: StageContext, x: Any) -> Any:
            run_with(self._threads)  # (intra-op threads are per thread too: module doc)
            with op_stream(ctx), torch.enable_grad():  # grad mode is per thread in torch
                xt = to_torch(x, ctx)
                if s > 0:
                    xt.requires_grad_(True)  # its .grad is what backward returns
                y = modules[ctx.device](xt)
                ctx.saved["x"] = xt
                if last:
                    loss = self._loss(y, None if self._targets is None
                                      else self._targets[ctx.microbatch])
                    ctx.saved["out"] = loss
                    return loss.detach()  # float() after the step: no device sync here
                ctx.saved["out"] = y
                return from_torch(y.detach(), ctx)
        return forward

    def _backward(self, s: int) -> Callable[[StageContext, Any], Any]:
        def backward(ctx: StageContext, dy: Any) -> Any:
            run_with(self._threads)
            xt, out = ctx.saved.pop("x"), ctx.saved.pop("out")
            with op_stream(ctx):
                if out.requires_grad:
                    grad = None if dy is None else to_torch(dy, ctx)
                    torch.autograd.backward(out, grad)
                if s == 0:
                    return None
                dx = xt.grad if xt.grad is not None else torch.zeros_like(xt)
                return from_torch(dx, ctx)
        return backward


    def _backward_input(self, s: int) -> Callable[[StageContext, Any], Any]:
        """``I``: the input's gradient only; the graph and the incoming gradient are kept
        for ``W`` (stage 0's input needs none: its ``I`` leaves everything to ``W``)."""
        def backward_input(ctx: StageContext, dy: Any) -> Any:
            run_with(self._threads)
            xt, out = ctx.saved["x"], ctx.saved["out"]
            with op_stream(ctx):
                grad = None if dy is None else to_torch(dy, ctx)
                ctx.saved["grad"] = grad
                if s == 0:
                    return None
                dx = None
                if out.requires_grad:
                    dx, = torch.autograd.grad(out, (xt,), grad, retain_graph=True,
                                              allow_unused=True)
                return from_torch(dx if dx is not None else torch.zeros_like(xt), ctx)
        return backward_input

    def _backward_weight(self, s: int) -> Callable[[StageContext], None]:
        """``W``: the parameters' gradients, added to their ``.grad``; frees the graph."""
        modules = self._by_device[s]

        def backward_weight(ctx: StageContext) -> None:
            run_with(self._threads)
            out, grad = ctx.saved.pop("out"), ctx.saved.pop("grad")
            ctx.saved.pop("x")
            params = [p for p in modules[ctx.device].parameters() if p.requires_grad]
            if params and out.requires_grad:
                with op_stream(ctx):
                    torch.autograd.backward(out, grad, inputs=params)
        return backward_weight


def replicate(module: nn.Module, n: int) -> list[nn.Module]:
    """``module`` and ``n - 1`` deep copies: the modules of a replicated stage."""
    check_count(n, "n")
    return [module, *(copy.deepcopy(module) for _ in range(n - 1))]


__all__ = ["LossFn", "TorchPipeline", "replicate"]
