"""``TorchPipeline``: ``nn.Module`` stages as the runtime's SPMD stage functions.

The pipeline holds the modules (built, replicated or sharded by a plan), checks a step's
arguments, finds its boundaries by a shape probe and runs it on a runtime; the stage
functions themselves — forward, backward, the split backward's ``I`` and ``W``, a
data-parallel stage's gradient reduction — are :mod:`overlap.torch.stage_functions`', each
step's values for them one immutable ``StepInputs``. Parameter gradients accumulate in
``.grad`` over the step's microbatches — by default their mean, each backward starting from
``loss / num_microbatches`` (torch's schedules' ``scale_grads=True``), or with
``scale_grads=False`` their sum, as repeated ``loss.backward()`` calls would — and the
user's optimizer and ``zero_grad`` work unchanged.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scheduler import (
    Boundary,
    Cluster,
    DeviceMesh,
    MicrobatchBoundaries,
    PlanOptions,
    Schedule,
    Sharding,
)
from scheduler.errors import check_seconds
from scheduler.lowering import Boundaries, BoundaryGroup

from ..errors import OverlapRuntimeError, StageTimeout
from ..pipeline import Stage
from ..runtime import Runtime, resolve_schedule
from .bounded import call_within
from .checkpoint import LoadResult, load, stage_state
from .checkpoint_files import load_checkpoint, save_checkpoint
from .checks import check_count, check_index, check_meshes, check_modules, module_device_dtype
from .clip import clip_grad_norm_, total_norm
from .compiled import CompileBounds, shapes_of
from .crossing import Crossing
from .data_parallel import BatchSplit
from .optimizer_state import load_optimizer_state, optimizer_state
from .parallel import Replicate, TensorParallel, parallelize, spec_of
from .report import BoundaryReport, report_boundary
from .stage_functions import StageFunctions, StepInputs, loss_of
from .stages import META, LocalStage, StageFn, build_stages, check_seed
from .state_reshard import TensorLayout, pipeline_shards, pipeline_state_layout
from .tensors import as_array, numpy_dtype
from .threads import check_threads, default_threads

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
            at the start. A stage returns a tensor, or a tuple or flat dict of them — each
            tensor a boundary of its own, the next stage called with them as positional or
            keyword arguments (:mod:`overlap.torch.crossing`); the last stage returns one
            tensor. Or a **factory**
            ``stage_fn(stage_index) -> nn.Module`` (the stage's one module, replicated or
            sharded here): with ``rt=`` each process builds for real only the stages it
            runs, and the others on the meta device, for their shapes
            (:mod:`overlap.torch.stages`).
        meshes: each stage's device mesh: disjoint, except that stages of one rank of a
            schedule with several stages per rank (``interleaved-1f1b``, ``zbv``) share it.
        loss_fn: ``loss_fn(output, target)`` (or ``loss_fn(output)`` when a step gets no
            targets) on the last stage's output; returns the microbatch's scalar loss.
        plans: per stage, a tensor-parallel plan (``{"mlp.fc1": ColwiseParallel(), ...}``,
            :mod:`overlap.torch.parallel`) or None. A stage with a plan takes ONE full module,
            of which every device of its mesh gets its shard; its boundary layouts follow from
            the plan, and every boundary is planned by the resharding planner.
        axis: the mesh axis plans split over (default: each mesh's only axis); on a 2-d mesh
            the other axis replicates.
        num_threads: torch's intra-op threads in every stage function (they run on the
            runtime's stream threads, where the caller's ``torch.set_num_threads`` does not
            reach). Default: the calling thread's setting, or, with several ranks on a host
            and no ``OMP_NUM_THREADS``, the host's cores per rank (see
            :mod:`overlap.torch.threads`).
        rt: the runtime the pipeline will train on, so that a multi-process job builds
            (with a factory) and hands the optimizer (:meth:`parameters`) only this
            process's stages; on the CUDA backend a factory's modules go to their GPUs.
        seed: with a factory, stage ``s`` is built under ``torch.manual_seed(seed + s)``
            on a forked RNG — the same on every process (default ``torch.initial_seed()``:
            seed torch alike on every process, or pass it).
        compile_timeout: where a stage module is compiled (``torch.compile``), the bound of
            a step on shapes it has not run yet — and of its shape probe — instead of the
            runtime's ``timeout``: a first compile is not a hang (:mod:`overlap.torch.compiled`).
        data_parallel: the name of a mesh axis that splits each microbatch's batch
            (dimension 0) over its devices, in every stage whose mesh has it
            (:mod:`overlap.torch.data_parallel`): each device runs its stage on its slice,
            and after the step's last backward of the stage the replicas' gradients are
            averaged over the axis, on a stream of their own while the other stages compute.
            Default None: no axis splits the batch.

    Intra-stage parallelism: a stage without a plan is **replicated** — every device of its
    mesh runs the whole stage on the whole microbatch (layouts ``P()``), or, along the
    ``data_parallel`` axis, on its part of it. A stage with a plan is **tensor-parallel**:
    each device runs its shard, with the plan's collectives (and, on a 2-d mesh, its part of
    the batch along ``data_parallel``). Either way every device's parameters get the exact
    gradient of the whole batch in their own ``.grad`` — give the optimizer
    :meth:`parameters` and replicas stay identical. :meth:`stage_state_dict` gathers a stage
    back into its full module's names.
    """

    def __init__(self, modules: Sequence[nn.Module | Sequence[nn.Module]] | StageFn,
                 meshes: Sequence[DeviceMesh], loss_fn: LossFn, *,
                 plans: Sequence[Any] | None = None, axis: str | None = None,
                 num_threads: int | None = None, rt: Runtime | None = None,
                 seed: int | None = None, compile_timeout: float = 600.0,
                 data_parallel: str | None = None) -> None:
        self.num_threads = check_threads(num_threads)
        check_seconds("compile_timeout", compile_timeout)
        self.meshes = check_meshes(meshes)
        self.data_parallel = BatchSplit.of(data_parallel, self.meshes, axis)
        # What each stage hands the next (:mod:`overlap.torch.crossing`), found by the probe,
        # and which tensors of a tuple data_parallel splits as batch-major ((stage, key)).
        self._crossings: dict[int, Crossing] = {}
        self._batch_major: dict[tuple[int, Any], bool] = {}
        # Devices this process drives (None: all of them, one process).
        self._local: frozenset[int] | None = self._local_of(rt)
        self._built_for = self._local
        self._runtime: Runtime | None = rt  # (the last step's: state_dict gathers through it)
        if callable(modules) and not isinstance(modules, nn.Module):
            modules = self._build(modules, plans, rt, check_seed(seed))
        elif seed is not None:
            if not isinstance(modules, Sequence) or isinstance(modules, (str, bytes)):
                raise TypeError(f"modules: expected a stage_fn (stage -> nn.Module) or a "
                                f"sequence with one entry per stage, got "
                                f"{type(modules).__name__}")
            raise ValueError("seed: seeds the stages a stage_fn builds; modules given "
                             "already built take none")
        self.tp: tuple[TensorParallel | None, ...] = self._parallelize(modules, plans, axis)
        self._meta_away()
        self.modules = check_modules(modules, self.meshes,
                                     [None if t is None else t.modules for t in self.tp])
        # A step on shapes compiled modules have not run is bounded by compile_timeout.
        self._compile = CompileBounds(compile_timeout, self.modules)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn: expected a callable (output, target) -> scalar loss "
                            f"tensor, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self._device_dtype = [[module_device_dtype(m, f"modules[{s}][{k}]")
                               for k, m in enumerate(reps)]
                              for s, reps in enumerate(self.modules)]
        self._fns = StageFunctions(self.meshes, self.modules, self.tp, loss_fn,
                                   self.data_parallel, self._crossings, self._batch_major)
        self.stages: tuple[Stage, ...] = self._fns.stages("train")
        self.eval_stages: tuple[Stage, ...] = self._fns.stages("eval")
        self.split_stages: tuple[Stage, ...] = self._fns.stages("split")
        self._busy = threading.Lock()  # one step at a time: targets belong to the step
        self._boundaries: dict[Any, tuple[BoundaryGroup, ...]] = {}
        self._probing = ("modules[0]", 0)  # what the shape probe runs now, and its stage
        self._probe_lost: str | None = None  # a probe left running past the timeout

    def _parallelize(self, modules: Any, plans: Sequence[Any] | None, axis: str | None
                     ) -> tuple[TensorParallel | None, ...]:
        p = len(self.meshes)
        if plans is None:
            if axis is not None:
                raise ValueError(f"axis: {axis!r} names the axis tensor-parallel plans split "
                                 "over, and no plans= were given")
            return (None,) * p
        if isinstance(plans, Mapping) or not isinstance(plans, Sequence):
            raise TypeError(f"plans: expected one plan (a dict) or None per stage, got "
                            f"{type(plans).__name__}")
        if len(plans) != p:
            raise ValueError(f"plans: {len(plans)} entries, but meshes has {p} stages")
        if not isinstance(modules, Sequence) or len(modules) != p:
            return (None,) * p  # (check_modules names the problem)
        out: list[TensorParallel | None] = []
        for s, plan in enumerate(plans):
            if plan is None:
                out.append(None)
                continue
            if not isinstance(modules[s], nn.Module):
                raise TypeError(f"modules[{s}]: a stage with a plan takes one full nn.Module "
                                f"(its shards are made from it), got {type(modules[s]).__name__}")
            try:
                out.append(parallelize(modules[s], self.meshes[s], plan, axis=axis))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"plans[{s}]: {exc}") from None
        last = out[-1]
        if last is not None and not isinstance(last.output_layout, Replicate):
            raise ValueError(f"plans[{p - 1}]: the last stage's output is {last.output_layout!r}; "
                             "loss_fn needs the whole output on every device — gather it "
                             "(ColwiseParallel(output_layouts=Replicate()) on the head)")
        return tuple(out)

    def _local_of(self, rt: Runtime | None) -> frozenset[int] | None:
        if rt is None:
            return None
        _check_runtime(rt)
        self._check_in_cluster(rt)
        return frozenset(rt.local_devices) if rt.world.distributed else None

    def _check_in_cluster(self, rt: Runtime) -> None:
        top = max(d for mesh in self.meshes for d in mesh.device_ids)
        if top >= rt.cluster.num_devices:
            raise ValueError(f"meshes: device {top} is outside the runtime's cluster "
                             f"(devices 0..{rt.cluster.num_devices - 1})")

    def _writers(self) -> tuple[Runtime | None, tuple[int, ...] | None, int]:
        """(the runtime, device -> rank where processes split the stages, this rank): who
        writes which stage of a checkpoint (:mod:`overlap.torch.checkpoint`)."""
        rt = self._runtime
        owners = None if self._local is None or rt is None else rt.backend.placement.owners
        return rt, owners, 0 if rt is None else rt.world.rank

    def _build(self, stage_fn: StageFn, plans: Any, rt: Runtime | None, seed: int
               ) -> list[Any]:
        """Each stage from ``stage_fn`` (:mod:`overlap.torch.stages`): for real where this
        process runs it — on its GPU on the CUDA backend — on the meta device elsewhere."""
        planned = [False] * len(self.meshes)
        if isinstance(plans, Sequence) and not isinstance(plans, Mapping) \
                and len(plans) == len(self.meshes):
            planned = [p is not None for p in plans]  # (_parallelize checks the rest)
        cuda = rt is not None and rt.backend.name == "cuda"

        def device_of(d: int) -> torch.device | None:
            return torch.device("cuda", rt.backend.physical(d)) if cuda else None  # type: ignore[union-attr]
        return build_stages(stage_fn, self.meshes, planned, self._local, seed, device_of)

    def _meta_away(self) -> None:
        """Shards of devices another process drives keep their shapes only."""
        if self._local is None:
            return
        for tp in self.tp:
            if tp is not None:
                for k, d in enumerate(tp.mesh.device_ids):
                    if d not in self._local:
                        tp.modules[k].to(META)

    # ---- what a training loop uses --------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of this process's devices' modules (each replica's and shard's
        own), for the optimizer: every device's in one process."""
        for st in self.local_stages:
            for m in st.modules:
                yield from m.parameters()

    def get_total_norm(self, norm_type: float = 2.0, error_if_nonfinite: bool = False
                       ) -> torch.Tensor:
        """The norm of the whole model's gradient — every parameter once, over every stage
        and process — as ``torch.nn.utils.get_total_norm`` gives it on the plain model
        (``torch.nn.utils.clip_grad_norm_(pipe.parameters(), ...)`` would count each
        replica again and see only this process's stages). A float32 scalar tensor.
        Under a launcher every process calls it (:mod:`overlap.torch.clip`)."""
        return total_norm(self, norm_type, error_if_nonfinite)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the whole model's gradient to a total norm of ``max_norm`` as
        ``torch.nn.utils.clip_grad_norm_`` clips the plain model's: the norm of every
        parameter once (:meth:`get_total_norm`), and every gradient of this process's
        parameters — each replica and shard — scaled by ``max_norm / (norm + 1e-6)`` when
        that is below 1. Returns the total norm before clipping. Call it between
        :meth:`train_step` and the optimizer's ``step``; under a launcher, on every
        process."""
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    @property
    def local_stages(self) -> tuple[LocalStage, ...]:
        """The stages this process runs, with its devices of each and their modules (every
        stage in one process). Known from construction when built with ``rt=``, else after
        the first step of a multi-process runtime (every stage until then)."""
        out = []
        for s, mesh in enumerate(self.meshes):
            ks = [k for k, d in enumerate(mesh.device_ids)
                  if self._local is None or d in self._local]
            if ks:
                out.append(LocalStage(s, tuple(mesh.device_ids[k] for k in ks),
                                      tuple(self.modules[s][k] for k in ks)))
        return tuple(out)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights (copies) under the plain model's names — ``"<stage>.<name>"``, as
        ``nn.Sequential(*stage_modules).state_dict()`` has them — of the stages this process
        writes: each stage is written by the process that drives its first device, its
        tensor-parallel shards gathered (across processes through the runtime's resharding:
        then call it on every process together, while the runtime is open). Save it with
        ``torch.save`` per process; the union of the processes' files is the whole model's
        ``state_dict``, which loads into any placement or plan (:meth:`load_state_dict`) and
        into plain torch."""
        out: dict[str, torch.Tensor] = {}
        rt, owners, rank = self._writers()
        for s in range(len(self.meshes)):
            part = stage_state(self, s, rt, owners, rank)
            out.update({f"{s}.{k}": v for k, v in (part or {}).items()})
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True
                        ) -> LoadResult:
        """Load weights named as :meth:`state_dict` names them (from this pipeline, another
        placement or plan, or the plain model's ``nn.Sequential(*stages).state_dict()``) into
        every device of this process's stages: split for tensor-parallel shards, copied
        into every replica. Keys of stages this process does not run are ignored. With
        ``strict`` a missing or unexpected key raises ``KeyError`` naming them; a wrong
        shape or a non-tensor always raises. Nothing is changed when anything raises."""
        return load(self, state_dict, strict, None if self._local is None else set(self._local))

    def save_checkpoint(self, directory: str | os.PathLike[str],
                        optimizer: torch.optim.Optimizer | None = None,
                        extra: dict[str, Any] | None = None) -> Path:
        """Save the model (and ``optimizer``'s state, and ``extra``: plain data such as the
        step) to ``directory``, one file per process plus a manifest; under a launcher every
        process calls it together, and when it returns the checkpoint is complete on every
        process. :meth:`load_checkpoint` reads it back on any number of processes
        (:mod:`overlap.torch.checkpoint_files`; plain torch: ``read_checkpoint``)."""
        return save_checkpoint(self, directory, optimizer, extra)

    def load_checkpoint(self, directory: str | os.PathLike[str],
                        optimizer: torch.optim.Optimizer | None = None,
                        strict: bool = True) -> dict[str, Any] | None:
        """Load what :meth:`save_checkpoint` wrote — by any number of processes, another
        placement or plan — into this process's stages (and ``optimizer``); returns the
        ``extra`` saved. A refused checkpoint (named) changes nothing."""
        return load_checkpoint(self, directory, optimizer, strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state (made over :meth:`parameters`) under the plain model's
        parameter names, in ``torch.distributed.checkpoint``'s layout — ``{"state": {name:
        {...}}, "param_groups": [{..., "params": [names]}]}`` — per-element state of a
        tensor-parallel parameter gathered like it; each stage written by the process that
        :meth:`state_dict` writes it from (collective in the same way)
        (:mod:`overlap.torch.optimizer_state`)."""
        return optimizer_state(self, optimizer, *self._writers())

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                  state_dict: Mapping[str, Any]) -> None:
        """Set ``optimizer``'s state from :meth:`optimizer_state_dict`'s (of this pipeline, of
        another placement or plan, or the union of several processes'): every parameter of
        ``optimizer`` named there gets its block, each group its saved hyperparameters. A
        parameter not named keeps its state; a wrong shape raises before anything changes."""
        load_optimizer_state(self, optimizer, state_dict)

    def stage_state_dict(self, stage: int) -> dict[str, torch.Tensor]:
        """Stage ``stage``'s parameters and buffers under its full module's names (copies):
        a tensor-parallel stage's shards gathered, a replicated stage's first replica."""
        check_index(stage, len(self.meshes), "stage")
        if self._local is not None:
            away = [d for d in self.meshes[stage].device_ids if d not in self._local]
            if away:
                raise ValueError(f"stage: stage {stage}'s devices {away} are driven by other "
                                 "processes, whose parameters this one does not have; call it "
                                 "where all of the stage's devices are local")
        tp = self.tp[stage]
        if tp is not None:
            return tp.state_dict()
        return {k: v.detach().clone() for k, v in self.modules[stage][0].state_dict().items()}

    def state_layout(self) -> dict[str, TensorLayout]:
        """The training layout of :meth:`state_dict`'s tensors (see ``state_reshard``)."""
        return pipeline_state_layout(self)

    def local_shards(self) -> dict[str, dict[int, torch.Tensor]]:
        """This process's devices' state tensors, by name and device (no copies)."""
        return pipeline_shards(self)

    def layouts(self, stage: int) -> tuple[Any, Any]:
        """Stage ``stage``'s (input, output) layouts over its mesh axis: ``Replicate()`` or
        ``Shard(dim)`` (a stage without a plan: replicated both ways)."""
        check_index(stage, len(self.meshes), "stage")
        tp = self.tp[stage]
        return (Replicate(), Replicate()) if tp is None else (tp.input_layout, tp.output_layout)

    @property
    def input_sharding(self) -> Sharding:
        """How stage 0 receives a microbatch (a layout on a negative dimension needs the
        microbatch's rank: :meth:`prepare` resolves it)."""
        return self._sharding(0, "input", None)

    def _sharding(self, s: int, side: str, rank: int | None, element: int = 0,
                  batch_split: bool = True) -> Sharding:
        """Stage ``s``'s layout of a tensor crossing its ``side``: the plan's for the first
        tensor of a boundary (replicated for the others), the batch (dimension 0) split
        over ``data_parallel`` where ``batch_split``."""
        layout = self.layouts(s)[0 if side == "input" else 1] if element == 0 else Replicate()
        tp = self.tp[s]
        axis = tp.axis if tp is not None else self.meshes[s].axis_names[0]
        name = f"plans[{s}]" if tp is not None else f"modules[{s}]"
        spec = spec_of(layout, rank, axis, f"{name} {side} layout")
        if not batch_split:
            return Sharding(self.meshes[s], spec)
        return Sharding(self.meshes[s], self.data_parallel.spec(s, spec, f"{name} {side} layout"))

    async def train_step(self, rt: Runtime, inputs: torch.Tensor | None = None,
                         targets: torch.Tensor | None = None, *,
                         num_microbatches: int | None = None,
                         microbatches: Sequence[Any] | None = None,
                         schedule: str | Schedule = "eager-1f1b",
                         options: PlanOptions | None = None,
                         max_activations: int | Sequence[int] | None = None,
                         scale_grads: bool = True, return_outputs: bool = False) -> Any:
        """One step: split ``inputs`` (and ``targets``) into ``num_microbatches`` along dim 0,
        run forward and backward of each on ``rt``; return the per-microbatch losses
        (``schedule``, ``options`` and ``max_activations`` as for
        :meth:`overlap.Runtime.train_step`).

        Gradients are *added* to ``.grad`` (call ``zero_grad`` between steps, as in torch):
        by default their mean over the microbatches — the gradient of the batch's mean loss,
        what ``torch.distributed.pipelining``'s schedules give by default (``scale_grads=True``
        there too): each microbatch's backward starts from ``loss / num_microbatches``; the
        losses returned are not scaled. ``scale_grads=False`` gives their sum, as repeated
        ``loss.backward()`` calls would. After a failed step ``.grad`` holds a partial sum —
        zero it before the next one.

        ``microbatches=[(x0, y0), (x1, y1), ...]`` (or ``[x0, x1, ...]`` without targets)
        gives the microbatches already split — torch's ``arg_mbs`` / ``target_mbs`` — each
        of its own shape (sequences of different lengths): each distinct shape's boundaries
        are found and planned once (:class:`scheduler.MicrobatchBoundaries`); instead of
        ``inputs``, ``targets`` and ``num_microbatches``.

        ``return_outputs=True`` returns ``(losses, outputs)``: ``outputs`` the last stage's
        output of each microbatch (detached, in microbatch order, on the device it was
        computed on) in the process that drives the last stage's first device, None in the
        others — as torch's ``schedule.step`` returns outputs on the last stage only.
        """
        if not isinstance(return_outputs, bool):
            raise TypeError(f"return_outputs: expected a bool, got {return_outputs!r}")
        if not isinstance(scale_grads, bool):
            raise TypeError(f"scale_grads: expected a bool (True: the mean over microbatches, "
                            f"False: their sum), got {scale_grads!r}")
        mbs, tgts, boundaries = self.prepare(rt, inputs, targets, num_microbatches, microbatches)
        # ("auto" gets the fused backward: it then chooses among unsplit schedules.)
        split = schedule != "auto" and bool(
            resolve_schedule(schedule, len(self.meshes), len(mbs)).kinds & {"I", "W"})
        return await self._run(rt, self.split_stages if split else self.stages, boundaries,
                               mbs, tgts, 1.0 / len(mbs) if scale_grads else None,
                               return_outputs, schedule=schedule, options=options,
                               max_activations=max_activations)

    async def _run(self, rt: Runtime, stages: Sequence[Stage], boundaries: Boundaries,
                   mbs: list[Any], tgts: list[Any] | None, loss_scale: float | None,
                   return_outputs: bool, **step: Any) -> Any:
        """One runtime step of ``stages`` with this step's targets, loss scale and output
        collection set for the stage functions (one step at a time per pipeline)."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("TorchPipeline: a step is already running on this pipeline")
        try:
            train = stages is not self.eval_stages
            self._fns.step = StepInputs(
                tgts, loss_scale, {} if return_outputs else None,
                self.num_threads or default_threads(rt.world),
                self._carried_grads() if train else {})
            shapes = shapes_of("train" if train else "eval", mbs)
            bound = await self._compile.step_bound(rt, shapes)
            try:
                losses = await rt.train_step(stages, boundaries, mbs,
                                             input_sharding=self._sharding(0, "input",
                                                                           mbs[0].ndim),
                                             timeout=bound, **step)
            except Exception as exc:
                self._compile.explain(exc)
                raise
            self._compile.ran(shapes)
            return self._result(rt, losses, len(mbs)) if return_outputs else losses
        finally:
            self._fns.step = StepInputs()
            self._busy.release()

    def _carried_grads(self) -> dict[int, dict[nn.Parameter, torch.Tensor]]:
        """What the parameters of this process's data-parallel devices hold in ``.grad``
        before a step (copies; none where every gradient is None, as after ``zero_grad``):
        the reduction sums only the step's part (:mod:`overlap.torch.data_parallel`)."""
        out: dict[int, dict[nn.Parameter, torch.Tensor]] = {}
        for st in self.local_stages:
            if self.data_parallel.degree(st.index) == 1:
                continue
            for d, m in zip(st.devices, st.modules):
                held = {p: p.grad.detach().clone() for p in m.parameters()
                        if p.requires_grad and p.grad is not None}
                if held:
                    out[d] = held
        return out

    async def eval_step(self, rt: Runtime, inputs: torch.Tensor | None = None,
                        targets: torch.Tensor | None = None, *,
                        num_microbatches: int | None = None,
                        microbatches: Sequence[Any] | None = None,
                        schedule: str | Schedule = "gpipe",
                        options: PlanOptions | None = None,
                        return_outputs: bool = False) -> Any:
        """Forward only, under ``torch.no_grad``: each microbatch through every stage in
        ``schedule``'s forward order (:meth:`scheduler.Schedule.forward_order`; every
        schedule of one stage per rank has the same one, and ``"auto"`` means ``"gpipe"``),
        no backward, no activation kept, no ``.grad`` touched. Returns the per-microbatch
        losses (``loss_fn`` as in :meth:`train_step`), or with ``return_outputs=True``
        ``(losses, outputs)`` as :meth:`train_step` does. Modules stay in the mode you set
        (``module.eval()`` for dropout and batch norm, as in torch)."""
        if not isinstance(return_outputs, bool):
            raise TypeError(f"return_outputs: expected a bool, got {return_outputs!r}")
        mbs, tgts, boundaries = self.prepare(rt, inputs, targets, num_microbatches, microbatches)
        order = resolve_schedule("gpipe" if schedule == "auto" else schedule, len(self.meshes),
                          len(mbs)).forward_order()
        return await self._run(rt, self.eval_stages, boundaries, mbs, tgts, None,
                               return_outputs, schedule=order, options=options)

    def eval_step_sync(self, rt: Runtime, inputs: torch.Tensor | None = None,
                       targets: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """:meth:`eval_step` for synchronous callers (on the runtime's kept event loop)."""
        _check_runtime(rt)
        return rt.run_sync(self.eval_step(rt, inputs, targets, **kwargs),
                           "TorchPipeline.eval_step_sync")

    def _result(self, rt: Runtime, losses: list[float], m: int) -> tuple[Any, Any]:
        """(losses, the last stage's outputs in microbatch order where its first device is
        this process's, else None)."""
        outs = self._fns.step.outputs
        assert outs is not None
        here = rt.backend.is_local(self.meshes[-1].device_ids[0])
        return losses, [outs[i] for i in range(m)] if here else None

    def train_step_sync(self, rt: Runtime, inputs: torch.Tensor | None = None,
                        targets: torch.Tensor | None = None, **kwargs: Any) -> list[float]:
        """:meth:`train_step` for synchronous callers (on the runtime's kept event loop)."""
        _check_runtime(rt)
        return rt.run_sync(self.train_step(rt, inputs, targets, **kwargs),
                           "TorchPipeline.train_step_sync")

    # ---- checks and boundaries ------------------------------------------------------------

    def prepare(self, rt: Runtime, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                num_microbatches: int | None, microbatches: Sequence[Any] | None = None
                ) -> tuple[list[Any], list[Any] | None, Boundaries]:
        """Check a step's arguments and make its microbatches (views, no copies) and
        boundaries — :class:`scheduler.MicrobatchBoundaries` where the microbatches' shapes
        differ; raises before anything is launched."""
        _check_runtime(rt)
        if microbatches is not None:
            if inputs is not None or targets is not None or num_microbatches is not None:
                raise ValueError("microbatches: give the step's microbatches already split, or "
                                 "inputs (and targets) with num_microbatches — not both")
            xs, tgts = split_given(microbatches)
        else:
            xs, tgts = self._split(inputs, targets, num_microbatches)
        cuda = rt.backend.name == "cuda"
        self._check_placement(rt, cuda)
        local = frozenset(rt.local_devices) if rt.world.distributed else None
        if self._built_for is not None and local != self._built_for:
            raise ValueError(f"rt: this pipeline was built (rt=) for a process driving devices "
                             f"{sorted(self._built_for)}; this runtime's process drives "
                             f"{sorted(local or range(rt.cluster.num_devices))}")
        self._local = local
        self._runtime = rt
        want = "cuda" if cuda else "cpu"
        where = "microbatches" if microbatches is not None else "inputs"
        for x in xs:
            if x.device.type != want:
                raise ValueError(f"{where}: on {x.device}, the runtime's {rt.backend.name} "
                                 f"backend needs them on {want}")
        mbs = [as_array(x, rt.backend.xp) for x in xs]
        rows = [self._boundaries_within(rt, i, x, None if tgts is None else tgts[i])
                for i, x in enumerate(xs)]
        bounds: Boundaries = list(rows[0]) if len(set(rows)) == 1 else \
            MicrobatchBoundaries(tuple(rows))
        return mbs, tgts, bounds

    def _split(self, inputs: Any, targets: Any, num_microbatches: Any
               ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if num_microbatches is None:
            raise ValueError("num_microbatches: how many microbatches to split inputs into "
                             "(or pass microbatches=[(x0, y0), ...] already split)")
        m = check_count(num_microbatches, "num_microbatches")
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(f"inputs: expected a torch.Tensor, got {type(inputs).__name__}")
        check_tensor(inputs, "inputs")
        if inputs.dim() < 1 or inputs.shape[0] % m:
            raise ValueError(f"inputs: batch dimension of shape {tuple(inputs.shape)} does not "
                             f"split into num_microbatches={m} equal microbatches")
        if targets is not None:
            if not isinstance(targets, torch.Tensor):
                raise TypeError(f"targets: expected a torch.Tensor or None, got "
                                f"{type(targets).__name__}")
            check_tensor(targets, "targets")
            if targets.dim() < 1 or targets.shape[0] != inputs.shape[0]:
                raise ValueError(f"targets: shape {tuple(targets.shape)} does not match the "
                                 f"batch of inputs {tuple(inputs.shape)} along dim 0")
        xs = list(inputs.detach().chunk(m))
        return xs, (list(targets.detach().chunk(m)) if targets is not None else None)

    def boundaries(self, microbatch: torch.Tensor,
                   target: torch.Tensor | None = None) -> tuple[Boundary, ...]:
        """Each stage's output per microbatch: shape, dtype and the two layouts (the
        producer's output layout over its mesh, the consumer's input layout over its own;
        ``P()`` for replicated stages), found by running the (full) stage modules once
        without autograd on ``microbatch`` (cached per shape)."""
        key = _probe_key(microbatch, target)
        if key not in self._boundaries:
            self._boundaries[key] = self._probe(microbatch, target)
        return self._boundaries[key]

    def _boundaries_within(self, rt: Runtime, i: int, microbatch: torch.Tensor,
                           target: torch.Tensor | None) -> tuple[Boundary, ...]:
        """:meth:`boundaries` for a step: a probe (user code's first run on a new shape)
        is bounded by the runtime's ``timeout`` like any op — past it, StageTimeout naming
        the module; its thread is left running, so this pipeline refuses further steps."""
        key = _probe_key(microbatch, target)
        if key in self._boundaries:
            return self._boundaries[key]
        if self._probe_lost is not None:
            raise OverlapRuntimeError(self._probe_lost)
        timeout = self._compile.probe_bound(rt)
        start = time.perf_counter()
        done, found = call_within(lambda: self._probe(microbatch, target), timeout,
                                  "overlap shape probe")
        if done:
            assert found is not None
            self._boundaries[key] = found
            return found
        (what, s), seconds = self._probing, time.perf_counter() - start
        self._probe_lost = (f"this pipeline's shape probe is still running {what} (abandoned "
                            f"past the timeout, {timeout:g} s): its modules may be in use — "
                            "make a new TorchPipeline (and Runtime)")
        err = StageTimeout(
            f"{what} never finished its first run on microbatch {i} "
            f"{tuple(microbatch.shape)} {microbatch.dtype} (the shape probe, on the caller's "
            f"process before the step): it has run {seconds:.1f} s (timeout {timeout:g} s). "
            "Its thread is abandoned and this pipeline refuses further steps",
            op=f"{what} (shape probe)", device=self.meshes[s].device_ids[0],
            stream="compute", stage=s, microbatch=i, phase="F", seconds=seconds)
        self._compile.explain(err)
        raise err

    def boundary_report(self, cluster: Cluster | Runtime, microbatch: torch.Tensor,
                        target: torch.Tensor | None = None,
                        options: PlanOptions | None = None) -> tuple[BoundaryReport, ...]:
        """Every boundary for ``microbatch`` (see :meth:`boundaries`), both directions,
        planned on ``cluster`` (or a runtime's) with ``options``: the plan's estimate, the
        lower bound, their ratio (:class:`overlap.torch.report.BoundaryReport`)."""
        if isinstance(cluster, Runtime):
            cluster = cluster.cluster
        if not isinstance(cluster, Cluster):
            raise TypeError(f"cluster: expected a scheduler.Cluster or an overlap.Runtime, got "
                            f"{type(cluster).__name__}")
        return tuple(row for i, b in enumerate(self.boundaries(microbatch, target))
                     for row in report_boundary(i, b, cluster, options))

    def _check_placement(self, rt: Runtime, cuda: bool) -> None:
        self._check_in_cluster(rt)
        if cuda:
            self._check_own_gpus(rt)
            self._place_shards(rt)
        for s, mesh in enumerate(self.meshes):
            for k, d in enumerate(mesh.device_ids):
                dev, _ = self._device_dtype[s][k]
                if dev is None or not rt.backend.is_local(d):  # (another process runs it)
                    continue
                want = torch.device("cuda", rt.backend.physical(d)) if cuda else \
                    torch.device("cpu")
                if dev == META:
                    raise ValueError(f"modules[{s}][{k}]: on the meta device (shapes only), "
                                     f"but device {d} runs it here; pass a stage_fn instead "
                                     "(built for real where its stage runs, on meta "
                                     "elsewhere)")
                if dev != want:
                    raise ValueError(f"modules[{s}][{k}]: on {dev}, but device {d} of the "
                                     f"runtime's {rt.backend.name} backend is {want}")

    def _place_shards(self, rt: Runtime) -> None:
        """Tensor-parallel shards (the adapter's own modules, made on the full module's
        device) move to their device's GPU. ``Module.to`` keeps the Parameter objects, so an
        optimizer made over :meth:`parameters` before still holds them."""
        for s, tp in enumerate(self.tp):
            if tp is None:
                continue
            for k, d in enumerate(tp.mesh.device_ids):
                want = torch.device("cuda", rt.backend.physical(d))
                if rt.backend.is_local(d) and self._device_dtype[s][k][0] != want:
                    tp.modules[k].to(want)
                    self._device_dtype[s][k] = module_device_dtype(tp.modules[k],
                                                                   f"modules[{s}][{k}]")

    def _check_own_gpus(self, rt: Runtime) -> None:
        """On CUDA torch runs every backward of one GPU on that GPU's one autograd thread: a
        device of a tensor-parallel stage, waiting there in a collective, would hold up every
        other device of its GPU, and two groups sharing GPUs could wait on each other. So
        such a device has its GPU to itself (one process per GPU always does)."""
        on: dict[int, set[int]] = {}
        for mesh in self.meshes:
            for d in mesh.device_ids:
                on.setdefault(rt.backend.physical(d), set()).add(d)
        for s, tp in enumerate(self.tp):
            if tp is None or tp.degree == 1:
                continue
            for d in tp.mesh.device_ids:
                gpu = rt.backend.physical(d)
                if len(on[gpu]) > 1:
                    raise ValueError(
                        f"plans[{s}]: device {d} of this tensor-parallel stage shares GPU {gpu} "
                        f"with devices {sorted(on[gpu] - {d})}; torch runs all backward work "
                        "of one GPU on one thread, where their collectives would wait on "
                        "each other — give each device of a tensor-parallel stage its own GPU")

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

    def _run_probe(self, x: torch.Tensor, target: torch.Tensor | None
                   ) -> tuple[BoundaryGroup, ...]:
        p = len(self.modules)
        out: list[BoundaryGroup] = []
        _, dt0 = self._device_dtype[0][0]
        if x.is_floating_point() and dt0 is not None and x.dtype != dt0:
            raise ValueError(f"inputs: dtype {x.dtype}, but modules[0] has {dt0} parameters")
        self._fits(x, 0, "input", "inputs: a microbatch")
        batch = x.shape[0] if x.dim() else None
        xs, came = [x], Crossing("tensor")  # (what crossed into the stage, and how)
        with torch.no_grad():
            for s, reps in enumerate(self.modules):
                tp = self.tp[s]
                dev = self._device_dtype[s][0][0] if tp is None else \
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
                        self._probe_loss(y, target)
                    break
                crossing = Crossing.of(y, f"{name} forward")
                known = self._crossings.setdefault(s, crossing)
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
        _, nxt = self._device_dtype[s + 1][0]
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
            split = e == 0 or self._batch_major.setdefault(
                (s, key), y.dim() > 0 and y.shape[0] == batch)
            group.append(Boundary(tuple(y.shape), str(npd),
                                  self._fits(y, s, "output", what, e, split),
                                  self._fits(y, s + 1, "input", what, e, split)))
        return tuple(group) if crossing.grouped else group[0]

    def _fits(self, y: torch.Tensor, s: int, side: str, what: str, element: int = 0,
              batch_split: bool = True) -> Sharding:
        """Stage s's ``side`` layout for ``y``, checked to split it evenly."""
        sharding = self._sharding(s, side, y.dim(), element, batch_split)
        for dim, entry in enumerate(sharding.spec.padded(y.dim())):
            if entry is None:
                continue
            k = self.meshes[s].axis_sizes[entry]
            if y.shape[dim] % k and entry == self.data_parallel.axis and dim == 0:
                raise ValueError(f"data_parallel: {what} has a batch of {y.shape[0]}, which does "
                                 f"not split over stage {s}'s axis {entry!r} of size {k}; "
                                 "give microbatches whose size it divides")
            if y.shape[dim] % k:
                owner = f"plans[{s}]" if self.tp[s] is not None else f"modules[{s}]"
                layout = self.layouts(s)[0 if side == "input" else 1]
                raise ValueError(f"{owner}: stage {s}'s {side} layout {layout!r} splits "
                                 f"dimension {dim} of {what} ({y.shape[dim]}) over mesh axis "
                                 f"{entry!r} of size {k}, which does not divide it")
        return sharding

    def _probe_loss(self, y: torch.Tensor, target: torch.Tensor | None) -> None:
        self._probing = ("loss_fn", len(self.meshes) - 1)
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

    # ---- the stage functions --------------------------------------------------------------

def check_tensor(t: torch.Tensor, name: str) -> None:
    """A step's tensor: dense and strided (its memory crosses without a copy), and not an
    empty batch (every loss would be the mean of nothing: NaN)."""
    if t.layout != torch.strided:
        raise TypeError(f"{name}: a {t.layout} tensor; give a dense one (.to_dense())")
    if t.dim() >= 1 and t.shape[0] == 0:
        raise ValueError(f"{name}: an empty batch (shape {tuple(t.shape)}); a step needs at "
                         "least one sample per microbatch")


def split_given(microbatches: Any) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """``microbatches``: a list of input tensors, or of ``(input, target)`` pairs (torch's
    ``arg_mbs`` / ``target_mbs``), each of its own shape; checked, detached."""
    if isinstance(microbatches, (torch.Tensor, str, bytes, Mapping)) or \
            not isinstance(microbatches, Sequence) or not microbatches:
        raise TypeError("microbatches: expected a non-empty list of input tensors or of "
                        f"(input, target) pairs, got {type(microbatches).__name__}")
    paired = not isinstance(microbatches[0], torch.Tensor)
    xs: list[torch.Tensor] = []
    ts: list[torch.Tensor] = []
    for i, item in enumerate(microbatches):
        pair = item if paired else (item, None)
        if (not paired and not isinstance(item, torch.Tensor)) or (paired and (
                not isinstance(item, (tuple, list)) or len(item) != 2)):
            kind = "an (input, target) pair" if paired else "a tensor"
            raise TypeError(f"microbatches[{i}]: expected {kind} like microbatches[0], got "
                            f"{type(item).__name__}")
        x, t = pair
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise TypeError(f"microbatches[{i}]: the input must be a tensor of at least one "
                            f"dimension, got {type(x).__name__}")
        check_tensor(x, f"microbatches[{i}]")
        if isinstance(t, torch.Tensor):
            check_tensor(t, f"microbatches[{i}] target")
        if paired:
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != x.shape[0]:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"microbatches[{i}]: its target must be a tensor with the "
                                 f"input's {x.shape[0]} rows along dim 0, got {got}")
            ts.append(t.detach())
        xs.append(x.detach())
    first = xs[0]
    for i, x in enumerate(xs):
        if x.dtype != first.dtype or x.dim() != first.dim():
            raise ValueError(f"microbatches[{i}]: {x.dim()}-d {x.dtype}, microbatches[0] is "
                             f"{first.dim()}-d {first.dtype}; only the sizes may differ")
    return xs, (ts if paired else None)


def replicate(module: nn.Module, n: int) -> list[nn.Module]:
    """``module`` and ``n - 1`` deep copies: the modules of a replicated stage."""
    check_count(n, "n")
    return [module, *(copy.deepcopy(module) for _ in range(n - 1))]


def _probe_key(x: torch.Tensor, target: torch.Tensor | None) -> tuple[Any, ...]:
    """What a probe's result depends on: the microbatch's and the target's shapes and dtypes."""
    return (tuple(x.shape), x.dtype, None if target is None else (tuple(target.shape),
                                                                   target.dtype))


__all__ = ["LossFn", "TorchPipeline", "replicate"]

