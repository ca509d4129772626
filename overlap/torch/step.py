"""One step of a :class:`~overlap.torch.TorchPipeline` on a runtime.

A step's values — its targets, loss scale, the dict its outputs are collected in, the
intra-op threads, what data-parallel devices held in ``.grad`` before it — make one immutable
:class:`~overlap.torch.stage_functions.StepInputs`, and the step runs stage functions made
for that value (:meth:`~overlap.torch.stage_functions.StageFunctions.stages`): nothing of a
step is left on the pipeline for the stream threads to read. Steps of one pipeline still run
one at a time — they share the modules, whose ``.grad`` each accumulates into — and a second
one started while one runs is refused. A step on shapes compiled stages have not run yet is
bounded by ``compile_timeout`` (:mod:`overlap.torch.compiled`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from scheduler import Boundaries, Schedule

from ..runtime import Runtime, resolve_schedule
from .compiled import CompileBounds, shapes_of
from .data_parallel import carried_grads
from .layouts import StageLayouts
from .stage_functions import StageFunctions, StepInputs
from .stages import LocalStage
from .threads import default_threads


def train_kind(schedule: str | Schedule, p: int, m: int) -> str:
    """The stages a training step of ``schedule`` (``p`` stages, ``m`` microbatches) runs:
    ``"split"`` (``I`` and ``W``) where it splits the backward, else ``"train"`` — ``"auto"``
    among them: it then chooses among unsplit schedules."""
    split = schedule != "auto" and bool(resolve_schedule(schedule, p, m).kinds & {"I", "W"})
    return "split" if split else "train"


def forward_order(schedule: str | Schedule, p: int, m: int) -> Schedule:
    """An evaluation step's schedule: ``schedule``'s forward order (``"auto"``: gpipe's)."""
    return resolve_schedule("gpipe" if schedule == "auto" else schedule, p, m).forward_order()


class PipelineSteps:
    """Runs a pipeline's steps (see module doc); ``num_threads`` None: each step's caller's
    default (:func:`overlap.torch.threads.default_threads`)."""

    def __init__(self, fns: StageFunctions, layouts: StageLayouts,
                 compile_bounds: CompileBounds, num_threads: int | None) -> None:
        self._fns, self._layouts, self._compile = fns, layouts, compile_bounds
        self._num_threads = num_threads
        self._busy = threading.Lock()

    async def run(self, rt: Runtime, kind: str, boundaries: Boundaries, mbs: list[Any],
                  values: StepInputs, here: Sequence[LocalStage], **step: Any) -> Any:
        """One runtime step of ``kind`` (``"train"``, ``"split"`` or ``"eval"``) over
        ``mbs`` with ``values``' targets, loss scale and outputs (the threads and, training,
        the gradients ``here`` — this process's stages — hold before it added); ``step``:
        :meth:`overlap.Runtime.train_step`'s schedule arguments. Returns the losses, or with
        outputs collected ``(losses, outputs)`` (outputs None where the last stage's first
        device is another process's)."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("TorchPipeline: a step is already running on this pipeline")
        try:
            carried = carried_grads(self._layouts.data_parallel, here) if kind != "eval" else {}
            values = StepInputs(values.targets, values.loss_scale, values.outputs,
                                self._num_threads or default_threads(rt.world), carried)
            shapes = shapes_of("eval" if kind == "eval" else "train", mbs)
            bound = await self._compile.step_bound(rt, shapes)
            try:
                losses = await rt.train_step(
                    self._fns.stages(kind, values), boundaries, mbs, timeout=bound,
                    input_sharding=self._layouts.sharding(0, "input", mbs[0].ndim), **step)
            except Exception as exc:
                self._compile.explain(exc)
                raise
            self._compile.ran(shapes)
            if values.outputs is None:
                return losses
            last = self._layouts.meshes[-1].device_ids[0]
            return losses, [values.outputs[i] for i in range(len(mbs))] \
                if rt.backend.is_local(last) else None
        finally:
            self._busy.release()


__all__ = ["PipelineSteps", "forward_order", "train_kind"]
