"""``TorchPipeline``: ``nn.Module`` stages as the runtime's SPMD stage functions.

The pipeline builds its modules (:mod:`overlap.torch.stages`: a factory's where they run,
tensor-parallel plans sharded) and runs a step: its arguments made microbatches
(:mod:`overlap.torch.microbatches`), its modules checked against the runtime
(:mod:`overlap.torch.placement`), its boundaries found by a shape probe
(:mod:`overlap.torch.probe`, layouts from :mod:`overlap.torch.layouts`), then one runtime step
of the stage functions (:mod:`overlap.torch.stage_functions`) made for this step's values —
its targets, loss scale and outputs, one immutable ``StepInputs``. Parameter gradients
accumulate in ``.grad`` over the step's microbatches — by default their mean, each backward
starting from ``loss / num_microbatches`` (torch's schedules' ``scale_grads=True``), or with
``scale_grads=False`` their sum, as repeated ``loss.backward()`` calls would — and the user's
optimizer and ``zero_grad`` work unchanged. State dicts, optimizer state and checkpoints are
:mod:`overlap.torch.checkpoint`'s, :mod:`overlap.torch.optimizer_state`'s and
:mod:`overlap.torch.checkpoint_files`'; gradient norms :mod:`overlap.torch.clip`'s.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scheduler import (
    Boundaries,
    Boundary,
    Cluster,
    DeviceMesh,
    PlanOptions,
    Schedule,
    Sharding,
    check_seconds,
)

from ..runtime import Runtime
from .checkpoint import LoadResult, full_stage_state, load, pipeline_state, writers
from .checkpoint_files import load_checkpoint, save_checkpoint
from .checks import check_index, check_loss_fn, check_meshes, device_dtypes
from .clip import clip_grad_norm_, total_norm
from .compiled import CompileBounds
from .data_parallel import BatchSplit
from .layouts import StageLayouts
from .microbatches import check_devices, step_microbatches
from .optimizer_state import load_optimizer_state, optimizer_state
from .placement import attached, check_placement, check_runtime, gpu_of, local_devices
from .probe import ShapeProbe
from .report import BoundaryReport, cluster_of, report_boundaries
from .stage_functions import LossFn, StageFunctions, StepInputs
from .stages import LocalStage, StageFn, local_stages, replicate, stage_modules
from .state_reshard import TensorLayout, pipeline_shards, pipeline_state_layout
from .step import PipelineSteps, forward_order, train_kind
from .tensors import as_array
from .threads import check_threads


class TorchPipeline:
    """Pipeline stages made of torch modules, trained by an :class:`overlap.Runtime`.

    Args:
        modules: one entry per stage — an ``nn.Module`` for a one-device mesh, or a list of
            modules, one per device of the stage's mesh in ``mesh.device_ids`` order. Each device
            needs its own module object (replicas: ``copy.deepcopy``), identical at the start. A
            stage returns a tensor, or a tuple or flat dict of them — each tensor a boundary of its
            own, the next stage called with them as positional or keyword arguments
            (:mod:`overlap.torch.crossing`); the last stage returns one tensor. Or a **factory**
            ``stage_fn(stage_index) -> nn.Module`` (the stage's one module, replicated or sharded
            here): with ``rt=`` each process builds for real only the stages it runs, and the
            others on the meta device, for their shapes (:mod:`overlap.torch.stages`).
        meshes: each stage's device mesh: disjoint, except that stages of one rank of a schedule
            with several stages per rank (``interleaved-1f1b``, ``zbv``) share it.
        loss_fn: ``loss_fn(output, target)`` (or ``loss_fn(output)`` when a step gets no targets)
            on the last stage's output; returns the microbatch's scalar loss.
        plans: per stage, a tensor-parallel plan (``{"mlp.fc1": ColwiseParallel(), ...}``,
            :mod:`overlap.torch.parallel`) or None. A stage with a plan takes ONE full module, of
            which every device of its mesh gets its shard; its boundary layouts follow from the
            plan, and every boundary is planned by the resharding planner.
        axis: the mesh axis plans split over (default: each mesh's only axis); on a 2-d mesh the
            other axis replicates.
        num_threads: torch's intra-op threads in every stage function (they run on the runtime's
            stream threads, where the caller's ``torch.set_num_threads`` does not reach). Default:
            the calling thread's setting, or, with several ranks on a host and no
            ``OMP_NUM_THREADS``, the host's cores per rank (see :mod:`overlap.torch.threads`).
        rt: the runtime the pipeline will train on, so that a multi-process job builds (with a
            factory) and hands the optimizer (:meth:`parameters`) only this process's stages; on
            the CUDA backend a factory's modules go to their GPUs.
        seed: with a factory, stage ``s`` is built under ``torch.manual_seed(seed + s)`` on a
            forked RNG — the same on every process (default ``torch.initial_seed()``: seed torch
            alike on every process, or pass it).
        compile_timeout: where a stage module is compiled (``torch.compile``), the bound of a step
            on shapes it has not run yet — and of its shape probe — instead of the runtime's
            ``timeout``: a first compile is not a hang (:mod:`overlap.torch.compiled`).
        data_parallel: the name of a mesh axis that splits each microbatch's batch (dimension 0)
            over its devices, in every stage whose mesh has it
            (:mod:`overlap.torch.data_parallel`): each device runs its stage on its slice, and
            after the step's last backward of the stage the replicas' gradients are averaged over
            the axis, on a stream of their own while the other stages compute. Default None: no
            axis splits the batch.

    Intra-stage parallelism: a stage without a plan is **replicated** — every device of its mesh
    runs the whole stage on the whole microbatch (layouts ``P()``), or, along the ``data_parallel``
    axis, on its part of it. A stage with a plan is **tensor-parallel**: each device runs its
    shard, with the plan's collectives (and, on a 2-d mesh, its part of the batch along
    ``data_parallel``). Either way every device's parameters get the exact gradient of the whole
    batch in their own ``.grad`` — give the optimizer :meth:`parameters` and replicas stay
    identical. :meth:`stage_state_dict` gathers a stage back into its full module's names.
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
        # Devices this process drives (None: all of them, one process), and the runtime of
        # the last step (state_dict gathers through it).
        self._local: frozenset[int] | None = local_devices(rt, self.meshes)
        self._built_for, self._runtime = self._local, rt
        self.modules, self.tp = stage_modules(modules, self.meshes, plans, axis, self._local,
                                              seed, gpu_of(rt))
        # A step on shapes compiled modules have not run is bounded by compile_timeout.
        self._compile = CompileBounds(compile_timeout, self.modules)
        self.loss_fn = check_loss_fn(loss_fn)
        self._device_dtype = device_dtypes(self.modules)  # (moved to their GPUs: updated)
        self._layouts = StageLayouts(self.meshes, self.tp, self.data_parallel)
        self._probe = ShapeProbe(self.modules, self._layouts, self._device_dtype, loss_fn,
                                 self._compile)
        self._fns = StageFunctions(self.meshes, self.modules, self.tp, loss_fn,
                                   self.data_parallel, self._probe.crossings,
                                   self._probe.batch_major)
        # The stages without a step's values (no targets), for rt.train_step directly (a
        # step of this pipeline runs its own, made for its values).
        self.stages, self.eval_stages, self.split_stages = (
            self._fns.stages(kind) for kind in ("train", "eval", "split"))
        self._steps = PipelineSteps(self._fns, self._layouts, self._compile, self.num_threads)

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
        and process — as ``torch.nn.utils.get_total_norm`` gives it on the plain model; a
        float32 scalar tensor. Under a launcher every process calls it
        (:mod:`overlap.torch.clip`)."""
        return total_norm(self, norm_type, error_if_nonfinite)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the whole model's gradient to a total norm of ``max_norm`` as
        ``torch.nn.utils.clip_grad_norm_`` clips the plain model's (:meth:`get_total_norm`;
        every replica and shard here scaled alike); returns the norm before clipping. Call
        it between :meth:`train_step` and the optimizer's ``step``; under a launcher, on
        every process."""
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    @property
    def local_stages(self) -> tuple[LocalStage, ...]:
        """The stages this process runs, with its devices of each and their modules (every
        stage in one process). Known from construction when built with ``rt=``, else after
        the first step of a multi-process runtime (every stage until then)."""
        return local_stages(self.meshes, self.modules, self._local)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights (copies) under the plain model's names (``"<stage>.<name>"``, as
        ``nn.Sequential(*stage_modules).state_dict()``) of the stages whose first device this
        process drives (a collective across processes); their union loads into any placement,
        plan and plain torch (:mod:`overlap.torch.checkpoint`)."""
        return pipeline_state(self)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True
                        ) -> LoadResult:
        """Load weights named as :meth:`state_dict` names them (any placement or plan, or the
        plain model's) into this process's stages — split for shards, copied into every
        replica; other stages' keys are ignored. With ``strict`` a missing or unexpected key
        raises ``KeyError``; a wrong shape always raises, and then nothing is changed."""
        return load(self, state_dict, strict,
                    None if self._local is None else set(self._local))

    def save_checkpoint(self, directory: str | os.PathLike[str],
                        optimizer: torch.optim.Optimizer | None = None,
                        extra: dict[str, Any] | None = None) -> Path:
        """Save the model (and ``optimizer``'s state, and ``extra``: plain data such as the
        step) to ``directory``, one file per process plus a manifest; under a launcher every
        process calls it together (:mod:`overlap.torch.checkpoint_files`)."""
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
        parameter names, in ``torch.distributed.checkpoint``'s layout, each stage written
        as :meth:`state_dict` writes it (:mod:`overlap.torch.optimizer_state`)."""
        return optimizer_state(self, optimizer, *writers(self))

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                  state_dict: Mapping[str, Any]) -> None:
        """Set ``optimizer``'s state from :meth:`optimizer_state_dict`'s (any placement or
        plan, or the union of several processes'); a wrong shape raises before anything
        changes."""
        load_optimizer_state(self, optimizer, state_dict)

    def stage_state_dict(self, stage: int) -> dict[str, torch.Tensor]:
        """Stage ``stage``'s parameters and buffers under its full module's names (copies):
        a tensor-parallel stage's shards gathered, a replicated stage's first replica."""
        return full_stage_state(self, stage)

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
        return self._layouts.layouts(stage)

    @property
    def input_sharding(self) -> Sharding:
        """How stage 0 receives a microbatch (a layout on a negative dimension needs the
        microbatch's rank: :meth:`prepare` resolves it)."""
        return self._layouts.sharding(0, "input", None)

    async def train_step(self, rt: Runtime, inputs: torch.Tensor | None = None,
                         targets: torch.Tensor | None = None, *,
                         num_microbatches: int | None = None,
                         microbatches: Sequence[Any] | None = None,
                         schedule: str | Schedule = "eager-1f1b",
                         options: PlanOptions | None = None,
                         max_activations: int | Sequence[int] | None = None,
                         scale_grads: bool = True, return_outputs: bool = False) -> Any:
        """One step: split ``inputs`` (and ``targets``) into ``num_microbatches`` along dim 0, run
        forward and backward of each on ``rt``; return the per-microbatch losses (``schedule``,
        ``options`` and ``max_activations`` as for :meth:`overlap.Runtime.train_step`).

        Gradients are *added* to ``.grad`` (call ``zero_grad`` between steps, as in torch): by
        default their mean over the microbatches — the gradient of the batch's mean loss, what
        ``torch.distributed.pipelining``'s schedules give by default (``scale_grads=True`` there
        too): each microbatch's backward starts from ``loss / num_microbatches``; the losses
        returned are not scaled. ``scale_grads=False`` gives their sum, as repeated
        ``loss.backward()`` calls would. After a failed step ``.grad`` holds a partial sum — zero
        it before the next one.

        ``microbatches=[(x0, y0), (x1, y1), ...]`` (or ``[x0, x1, ...]`` without targets) gives the
        microbatches already split — torch's ``arg_mbs`` / ``target_mbs`` — each of its own shape
        (sequences of different lengths): each distinct shape's boundaries are found and planned
        once (:class:`scheduler.MicrobatchBoundaries`); instead of ``inputs``, ``targets`` and
        ``num_microbatches``.

        ``return_outputs=True`` returns ``(losses, outputs)``: ``outputs`` the last stage's output
        of each microbatch (detached, in microbatch order, on the device it was computed on) in the
        process that drives the last stage's first device, None in the others — as torch's
        ``schedule.step`` returns outputs on the last stage only.
        """
        if not isinstance(return_outputs, bool):
            raise TypeError(f"return_outputs: expected a bool, got {return_outputs!r}")
        if not isinstance(scale_grads, bool):
            raise TypeError(f"scale_grads: expected a bool (True: the mean over microbatches, "
                            f"False: their sum), got {scale_grads!r}")
        mbs, tgts, boundaries = self.prepare(rt, inputs, targets, num_microbatches, microbatches)
        kind = train_kind(schedule, len(self.meshes), len(mbs))
        values = StepInputs(tgts, 1.0 / len(mbs) if scale_grads else None,
                            {} if return_outputs else None)
        return await self._steps.run(rt, kind, boundaries, mbs, values, self.local_stages,
                                     schedule=schedule, options=options,
                                     max_activations=max_activations)

    async def eval_step(self, rt: Runtime, inputs: torch.Tensor | None = None,
                        targets: torch.Tensor | None = None, *,
                        num_microbatches: int | None = None,
                        microbatches: Sequence[Any] | None = None,
                        schedule: str | Schedule = "gpipe",
                        options: PlanOptions | None = None,
                        return_outputs: bool = False) -> Any:
        """Forward only, under ``torch.no_grad``: each microbatch through every stage in
        ``schedule``'s forward order (:meth:`scheduler.Schedule.forward_order`; every schedule of
        one stage per rank has the same one, and ``"auto"`` means ``"gpipe"``), no backward, no
        activation kept, no ``.grad`` touched. Returns the per-microbatch losses (``loss_fn`` as in
        :meth:`train_step`), or with ``return_outputs=True`` ``(losses, outputs)`` as
        :meth:`train_step` does. Modules stay in the mode you set (``module.eval()`` for dropout
        and batch norm, as in torch)."""
        if not isinstance(return_outputs, bool):
            raise TypeError(f"return_outputs: expected a bool, got {return_outputs!r}")
        mbs, tgts, boundaries = self.prepare(rt, inputs, targets, num_microbatches, microbatches)
        values = StepInputs(tgts, None, {} if return_outputs else None)
        return await self._steps.run(rt, "eval", boundaries, mbs, values, self.local_stages,
                                     schedule=forward_order(schedule, len(self.meshes), len(mbs)),
                                     options=options)

    def train_step_sync(self, rt: Runtime, inputs: torch.Tensor | None = None,
                        targets: torch.Tensor | None = None, **kwargs: Any) -> list[float]:
        """:meth:`train_step` for synchronous callers (on the runtime's kept event loop)."""
        check_runtime(rt)
        return rt.run_sync(self.train_step(rt, inputs, targets, **kwargs),
                           "TorchPipeline.train_step_sync")

    def eval_step_sync(self, rt: Runtime, inputs: torch.Tensor | None = None,
                       targets: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """:meth:`eval_step` for synchronous callers (on the runtime's kept event loop)."""
        check_runtime(rt)
        return rt.run_sync(self.eval_step(rt, inputs, targets, **kwargs),
                           "TorchPipeline.eval_step_sync")

    # ---- a step's arguments and boundaries ------------------------------------------------

    def prepare(self, rt: Runtime, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                num_microbatches: int | None, microbatches: Sequence[Any] | None = None
                ) -> tuple[list[Any], list[Any] | None, Boundaries]:
        """Check a step's arguments and make its microbatches (views, no copies) and
        boundaries — :class:`scheduler.MicrobatchBoundaries` where the microbatches' shapes
        differ; raises before anything is launched."""
        check_runtime(rt)
        xs, tgts = step_microbatches(inputs, targets, num_microbatches, microbatches)
        check_placement(rt, self.meshes, self.tp, self._device_dtype)
        self._local, self._runtime = attached(rt, self._built_for), rt
        check_devices(xs, rt.backend.name,
                      "microbatches" if microbatches is not None else "inputs")
        mbs = [as_array(x, rt.backend.xp) for x in xs]
        return mbs, tgts, self._probe.for_step(rt, xs, tgts)

    def boundaries(self, microbatch: torch.Tensor,
                   target: torch.Tensor | None = None) -> tuple[Boundary, ...]:
        """Each stage's output per microbatch: shape, dtype and the two layouts (the
        producer's output layout over its mesh, the consumer's input layout over its own;
        ``P()`` for replicated stages), found by running the (full) stage modules once
        without autograd on ``microbatch`` (cached per shape; :mod:`overlap.torch.probe`)."""
        return self._probe.boundaries(microbatch, target)

    def boundary_report(self, cluster: Cluster | Runtime, microbatch: torch.Tensor,
                        target: torch.Tensor | None = None,
                        options: PlanOptions | None = None) -> tuple[BoundaryReport, ...]:
        """Every boundary for ``microbatch`` (see :meth:`boundaries`), both directions,
        planned on ``cluster`` (or a runtime's) with ``options``: the plan's estimate, the
        lower bound, their ratio (:class:`overlap.torch.report.BoundaryReport`)."""
        cluster = cluster_of(cluster)  # (named before the probe runs)
        return report_boundaries(self.boundaries(microbatch, target), cluster, options)


__all__ = ["LossFn", "TorchPipeline", "replicate"]
