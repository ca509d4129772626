"""Stages compiled with ``torch.compile``: a compile is not a hang.

A compiled module compiles on its first call with a new shape (or a new grad mode: an
evaluation step compiles again), and recompiles when a guard fails — on the CPU a small
block's first forward and backward took 16 s here. The runtime's ``timeout`` bounds every op
to catch hangs in seconds, so such a first step would be named a hang (``StageTimeout``) and
its thread abandoned.

So a :class:`~overlap.torch.TorchPipeline` whose stage modules are compiled bounds a step
that runs shapes it has not run yet (per training or evaluation) — and the shape probe
before it — by ``compile_timeout`` instead (``Runtime.train_step(timeout=...)``: every wait
and op of that step); the steps after keep the runtime's bound. Under a launcher the
processes agree on the bound first (the largest any asks for), so a process whose stages do
not compile waits as long for one whose stages do. A timeout that fires anyway in a
compiled pipeline says that a compile may have been running and which argument to raise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from ..errors import CollectiveTimeout, DeviceThreadLost, StageTimeout
from ..runtime import Runtime
from ..world import max_over_ranks


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule of it runs compiled: ``torch.compile(m)``'s wrapper
    (it keeps the module as ``_orig_mod``) or ``m.compile()`` in place."""
    return any(hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
               for m in module.modules())


def shapes_of(kind: str, arrays: Iterable[Any]) -> frozenset[tuple[Any, ...]]:
    """What a compiled module compiles for: the grad mode (``kind``) and each microbatch's
    shape and dtype."""
    return frozenset((kind, tuple(a.shape), str(a.dtype)) for a in arrays)


class CompileBounds:
    """The bound of each step of one pipeline (see module doc)."""

    def __init__(self, compile_timeout: float, modules: Sequence[Sequence[nn.Module]]) -> None:
        self.compile_timeout = compile_timeout
        self.compiled = any(is_compiled(m) for reps in modules for m in reps)
        self._ran: set[tuple[Any, ...]] = set()

    def probe_bound(self, rt: Runtime) -> float:
        """The shape probe's bound (it compiles the modules' no-grad forward)."""
        timeout = rt.backend.timeout
        return max(timeout, self.compile_timeout) if self.compiled else timeout

    async def step_bound(self, rt: Runtime, shapes: frozenset[tuple[Any, ...]]
                         ) -> float | None:
        """This step's bound: None (the runtime's own) unless it runs new shapes; then
        ``compile_timeout`` where a stage compiles — the same on every process."""
        if shapes <= self._ran:
            return None
        timeout = rt.backend.timeout
        want = max(timeout, self.compile_timeout) if self.compiled else timeout
        if rt.world.distributed:  # (every process runs the same shapes: all ask together)
            want = await asyncio.to_thread(max_over_ranks, want, rt.world)
        return None if want == timeout else want

    def ran(self, shapes: frozenset[tuple[Any, ...]]) -> None:
        self._ran |= shapes

    def explain(self, exc: BaseException) -> None:
        """Add to a timeout of a compiled pipeline what may have happened and what to raise."""
        if not self.compiled or not isinstance(exc, (StageTimeout, CollectiveTimeout,
                                                     DeviceThreadLost)):
            return
        hint = (f"\n(This pipeline's stage modules are compiled with torch.compile: a compile "
                f"— a first run on a shape or grad mode, or a recompile after a guard failed — "
                f"may have been running. A step on new shapes is bounded by "
                f"TorchPipeline(compile_timeout=...), {self.compile_timeout:g} s; every other "
                f"step by Runtime(timeout=...).)")
        if exc.args and isinstance(exc.args[0], str) and hint not in exc.args[0]:
            exc.args = (exc.args[0] + hint, *exc.args[1:])


__all__ = ["CompileBounds", "is_compiled", "shapes_of"]
