"""``Runtime.last_step``: a training step's figures from the runtime's own trace.

The trace is recorded for every step anyway (it is what ``timeline()`` reads); the figures
are made from it when asked, once per step, so keeping them on costs nothing per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler import Timeline


@dataclass(frozen=True)
class StepStats:
    """One step, as this process measured it.

    Attributes:
        step: the step's index in this runtime (0 for the first).
        seconds: the call's wall time, from launch to its end on this process.
        iteration_time: the measured timeline's span (first op start to last op end).
        bubble: mean over this process's devices of the share of the iteration their
            compute stream was idle.
        exposed_comm: mean over those devices of the share of the iteration they
            communicated while computing nothing (``Timeline.exposed_comm``: the definition
            ``overlap trace report`` uses for every trace).
        compute: per stage of this process, seconds of compute (F, B, I, W) of one device
            (the mean over the stage's devices here).
        peak_activations: per stage of this process, most microbatches whose forward had
            run and whose backward had not (the schedule's own count, measured).
        transfer_wait: mean over those devices of the share of the iteration their compute
            stream sat idle while a transfer bringing its next op's input ran (part of
            ``exposed_comm``: what the step paid for communication).
    """

    step: int
    seconds: float
    iteration_time: float
    bubble: float
    exposed_comm: float
    compute: Mapping[int, float] = field(default_factory=dict)
    peak_activations: Mapping[int, int] = field(default_factory=dict)
    transfer_wait: float = 0.0

    def __str__(self) -> str:
        compute = ", ".join(f"s{s} {t * 1e3:.1f}" for s, t in sorted(self.compute.items()))
        return (f"step {self.step}: {self.seconds * 1e3:.1f} ms, bubble {self.bubble:.1%}, "
                f"exposed communication {self.exposed_comm:.1%} (compute waited for "
                f"transfers {self.transfer_wait:.1%}); compute ms per stage: "
                f"{compute}")


def step_stats(step: int, seconds: float, tl: Timeline) -> StepStats:
    """The figures of one step from its measured timeline."""
    per_device: dict[tuple[int, int], float] = {}
    for sp in tl.spans:
        if sp.stream == "compute" and sp.stage >= 0:
            key = (sp.stage, sp.device)
            per_device[key] = per_device.get(key, 0.0) + (sp.end - sp.start)
    stages = sorted({s for s, _ in per_device})
    compute = {}
    for s in stages:
        times = [t for (st, _), t in per_device.items() if st == s]
        compute[s] = sum(times) / len(times)
    return StepStats(step, seconds, tl.iteration_time, tl.bubble_fraction,
                     tl.exposed_comm_fraction, compute,
                     {s: tl.peak_activations(s) for s in stages}, tl.transfer_wait_fraction)


class StepHookHandle:
    """What :meth:`overlap.Runtime.register_step_hook` returns: ``remove()`` unregisters."""

    def __init__(self, hooks: StepHooks, key: int) -> None:
        self._hooks, self._key = hooks, key

    def remove(self) -> None:
        """Unregister the hook (again: nothing happens)."""
        self._hooks.hooks.pop(self._key, None)


class StepHooks:
    """A runtime's step hooks, in registration order."""

    def __init__(self) -> None:
        self.hooks: dict[int, Callable[[StepStats], Any]] = {}
        self._next = 0

    def add(self, hook: Callable[[StepStats], Any]) -> StepHookHandle:
        if not callable(hook):
            raise TypeError(f"hook: expected a callable (StepStats) -> None, got "
                            f"{type(hook).__name__}")
        self._next += 1
        self.hooks[self._next] = hook
        return StepHookHandle(self, self._next)

    def run(self, rt: Any) -> None:
        if not self.hooks:
            return  # (no figures made: nobody asked)
        stats = rt.last_step
        for hook in list(self.hooks.values()):
            hook(stats)


__all__ = ["StepHookHandle", "StepHooks", "StepStats", "step_stats"]
