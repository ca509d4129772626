"""The runtime's API: launches resharding plans and pipeline steps — step graphs — on a
backend, from asyncio (``await rt.reshard(...)``, ``await rt.train_step(...)``; the ``*_sync``
methods wrap them). :class:`Runtime` holds the API and the lifecycle and delegates: each call
runs once through :mod:`overlap.call`, derived values are kept by
:mod:`overlap.step_graph_cache`, what ran is measured by :mod:`overlap.measurements`, and the
``*_sync`` methods run on :mod:`overlap.sync_loop`'s loop. A failed call leaves a one-process
runtime usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import weakref
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np

from scheduler import (
    Boundaries,
    Cluster,
    PlanOptions,
    ReshardPlan,
    Schedule,
    Sharding,
    StateReshardPlan,
    StepGraph,
    Timeline,
)

from .call_gate import refuse_reentry
from .pipeline import Stage
from .reshard_call import reshard
from .runtime_parts import close_parts, collected, make_parts
from .state_reshard import reshard_state
from .stats import StepHookHandle, StepStats
from .step_call import train_step
from .step_graph_cache import (  # (public here too, where they were first)
    agreement_digest,
    check_given_graph,
    check_graph,
    data_parallel_of,
    resolve_schedule,
)
from .sync_loop import run
from .world import Placement, World

T = TypeVar("T")


class Runtime:
    """Executes resharding plans and pipeline training steps on a backend.

    Args:
        cluster: the cluster the plans were made for; devices are its device ids.
        backend: ``"cpu"`` (virtual devices in this process) or ``"cuda"`` (virtual devices
            on the visible GPUs, round-robin; several share a GPU through loopback copies).
        emulate_links: make every transfer take at least the cost model's time for it on
            ``cluster`` (so a 10 Gbps cluster can be played on one machine); ``"signal"``:
            at least its latency only (the paper's 1-byte-message upper bound).
        compute_time: ``(stage, kind) -> seconds`` each stage compute takes at least (compute
            emulation, for the same purpose; the user function still runs for real).
        timeout: seconds a collective or wait may block before it raises, naming who is
            missing, and a stage op may run before it is named as hung (``StageTimeout``).
        world: this process's place in a multi-process job; by default what the launcher
            says (``overlap.world.detect_world``: ``mpiexec``/``srun``, ``torchrun``, or a
            ``torch.distributed`` group the caller made; else one process).
        placement: which rank drives which device (several processes only); by default equal
            contiguous blocks of device ids (``Placement.blocks``).
        profile_steps: the training steps a profiler should record (counting from 0), as a
            ``range`` or ``"A:B"``: the runtime starts the profiler (``cudaProfilerStart``)
            before step A and stops it after step B-1, for ``nsys profile
            --capture-range=cudaProfilerApi``. Default: ``$OVERLAP_PROFILE_STEPS`` (set by
            ``overlap profile --steps``), else no window. See also :meth:`capture`.
        hang_tracebacks: ``True`` (standard error) or an open file: if the runtime's watch
            cannot run for ``timeout`` past its next tick — an op holds Python's
            interpreter lock, freezing every other thread — a C-level timer
            (:mod:`faulthandler`) writes every thread's traceback there. Off by default:
            that timer is one per process (arming it replaces one set elsewhere, e.g.
            pytest's ``faulthandler_timeout``).

    In a multi-process job every process makes the same calls with the same arguments; each
    runs only its own devices' parts (see docs/howto/processes.md).
    """

    def __init__(self, cluster: Cluster, backend: str = "cpu", *,
                 emulate_links: bool | str = False,
                 compute_time: Callable[[int, str], float] | None = None,
                 timeout: float = 30.0, world: World | None = None,
                 placement: Placement | None = None,
                 profile_steps: range | str | None = None,
                 hang_tracebacks: bool | IO[str] = False) -> None:
        parts = make_parts(cluster, backend, emulate_links=emulate_links,
                           compute_time=compute_time, timeout=timeout, world=world,
                           placement=placement, profile_steps=profile_steps,
                           hang_tracebacks=hang_tracebacks)
        self._parts = parts
        self.cluster, self.world, self.backend = cluster, parts.world, parts.backend
        self.compute_time, self.scope = compute_time, parts.scope
        self.plans = parts.graphs.plans  # each boundary planned once per options
        self.local_devices: tuple[int, ...] = tuple(
            d for d in range(cluster.num_devices) if self.backend.is_local(d))
        # Dropped without close(): end the threads anyway, and say so (as files and event
        # loops do). The callback holds the scope, the backend and the loop, never the
        # runtime — nor does anything a stream thread holds.
        self._finalizer = weakref.finalize(self, collected, parts.scope, parts.backend,
                                           parts.sync, f"{self.backend.name} backend, "
                                           f"{cluster.num_devices} devices")

    # ---- resharding ----------------------------------------------------------------------

    async def reshard(self, plan: ReshardPlan, shards: Mapping[int, np.ndarray], *,
                      out: Mapping[int, np.ndarray] | None = None,
                      stream: str = "comm", trace: bool = False) -> dict[int, np.ndarray]:
        """Move a tensor from ``plan.src`` to ``plan.dst`` layout.

        ``shards[d]`` is source device d's region of the tensor (every source device, its
        exact region shape, the plan's dtype — checked before anything starts). Returns
        destination device -> its region: new arrays, or the arrays of ``out`` (destination
        device -> an array of its region's shape and the plan's dtype, not overlapping any
        shard), which a loop that reshards every step passes to skip allocating them.
        ``trace``: record when each transfer ran (:meth:`timeline` then shows this call; off
        by default — on a GPU every op then records two timed CUDA events).
        """
        return await reshard(self._parts, plan, shards, out=out, stream=stream, trace=trace)

    def reshard_sync(self, plan: ReshardPlan, shards: Mapping[int, np.ndarray], *,
                     out: Mapping[int, np.ndarray] | None = None,
                     trace: bool = False) -> dict[int, np.ndarray]:
        """:meth:`reshard` for synchronous callers (not from inside a running event loop)."""
        return self.run_sync(self.reshard(plan, shards, out=out, trace=trace), "reshard_sync")

    async def reshard_state(self, plan: StateReshardPlan,
                            shards: Mapping[str, Mapping[int, np.ndarray]], *,
                            out: Mapping[str, Mapping[int, np.ndarray]] | None = None,
                            trace: bool = False) -> dict[str, dict[int, np.ndarray]]:
        """Move every tensor of a whole-state plan (:func:`scheduler.plan_state_resharding`)
        in one call: ``shards[name][d]`` as :meth:`reshard` takes ``shards`` (this process's
        source devices only); returns name -> destination device -> its region (this
        process's devices), into the arrays of ``out[name]`` where given
        (:mod:`overlap.state_reshard`)."""
        return await reshard_state(self._parts, plan, shards, out=out, trace=trace)

    def reshard_state_sync(self, plan: StateReshardPlan,
                           shards: Mapping[str, Mapping[int, np.ndarray]], *,
                           out: Mapping[str, Mapping[int, np.ndarray]] | None = None,
                           trace: bool = False) -> dict[str, dict[int, np.ndarray]]:
        """:meth:`reshard_state` for synchronous callers."""
        return self.run_sync(self.reshard_state(plan, shards, out=out, trace=trace),
                             "reshard_state_sync")

    def run_sync(self, coro: Coroutine[Any, Any, T], what: str = "run_sync") -> T:
        """Run ``coro`` (a call of this runtime's async API, or code awaiting one) on the event
        loop the ``*_sync`` methods keep between calls; ``what`` names the caller in errors."""
        try:
            self._parts.calls.check_open()  # before a loop is made for a call that cannot run
            refuse_reentry(what, self.backend)
        except BaseException:
            coro.close()
            raise
        return self._parts.sync.run(coro, what)

    @property
    def sync_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the ``*_sync`` methods run on, kept between calls (None: none made
        yet, or the runtime closed)."""
        return self._parts.sync.loop

    # ---- pipeline training ---------------------------------------------------------------

    async def train_step(
        self,
        stages: Sequence[Stage],
        boundaries: Boundaries,
        microbatches: Sequence[np.ndarray],
        *,
        input_sharding: Sharding,
        schedule: str | Schedule | None = None,
        options: PlanOptions | None = None,
        graph: StepGraph | None = None,
        max_activations: int | Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> list[float]:
        """Run one training step (forward and backward of every microbatch); return the losses.

        ``boundaries[s]`` is the activation stage ``s`` hands to ``s + 1`` (shape and dtype per
        microbatch, producer and consumer layouts); ``input_sharding`` is how stage 0 holds each
        microbatch. Stage functions accumulate parameter gradients themselves (see
        :mod:`overlap.pipeline`). ``schedule``: a name of ``scheduler.ALL_SCHEDULES`` (default
        ``"eager-1f1b"``), ``"auto"`` (:func:`scheduler.auto_schedule` with ``compute_time``
        or the last step's measured compute times, chosen once per configuration, within
        ``max_activations`` microbatches kept per stage when given), or a
        :class:`~scheduler.Schedule`; ``options``: how boundaries are planned. The step graph
        is lowered off the event loop and cached per configuration; or pass ``graph``,
        lowered by the caller (``scheduler.lower``: the very graph one simulated), instead of
        ``schedule`` and ``options``. ``timeout``: this step's bound (every wait and op of
        it) instead of the runtime's; under a launcher, the same on every process.
        """
        return await train_step(self._parts, stages, boundaries, microbatches,
                                input_sharding=input_sharding, schedule=schedule,
                                options=options, graph=graph, max_activations=max_activations,
                                timeout=timeout)

    def train_step_sync(self, *args: Any, **kwargs: Any) -> list[float]:
        """:meth:`train_step` for synchronous callers."""
        return self.run_sync(self.train_step(*args, **kwargs), "train_step_sync")

    # ---- measuring -----------------------------------------------------------------------

    def timeline(self) -> Timeline:
        """What the last traced call — a :meth:`train_step`, or a :meth:`reshard` with
        ``trace=True`` — ran where and when (measured), as a Timeline: the simulator's type,
        with the same op ids, so measured and simulated steps share metrics and traces and
        compare op by op. In a multi-process job: this process's devices (each process
        writes its own trace)."""
        return self._parts.measure.timeline()

    def register_step_hook(self, hook: Callable[[StepStats], Any]) -> StepHookHandle:
        """Call ``hook(stats)`` after every successful :meth:`train_step`, with the step's
        :attr:`last_step` — a logger in one line (``rt.register_step_hook(lambda s:
        writer.add_scalar("bubble", s.bubble, s.step))``). Hooks run in the order registered,
        on the caller's event loop thread, before the step returns; one that raises makes the
        step's call raise (its gradients are in place). Returns a handle whose ``remove()``
        unregisters it, as torch's hooks do."""
        return self._parts.measure.register_step_hook(hook)

    @property
    def last_step(self) -> StepStats | None:
        """The last successful :meth:`train_step`'s figures (:class:`overlap.StepStats`: wall
        time, bubble, exposed communication, compute per stage, peak activations), from the
        runtime's own trace, made on first access; None before any step or after a failed
        one. In a multi-process job: this process's devices."""
        return self._parts.measure.last_step

    def write_trace(self, path: str | Path) -> Path:
        """Write the last call's measured timeline as Chrome/Perfetto JSON."""
        return self.timeline().to_chrome_trace(path)

    @property
    def profile_steps(self) -> range | None:
        """The training steps the profiler records (``profile_steps``, else
        ``$OVERLAP_PROFILE_STEPS``); None: no window."""
        return self._parts.measure.profiler.window

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record what runs inside the block with the profiler (``cudaProfilerStart`` /
        ``Stop``: ``nsys profile --capture-range=cudaProfilerApi`` records only this) — for
        windows that are not whole training steps (``profile_steps``). A no-op on the CPU
        backend."""
        self._parts.calls.check_open()
        with self._parts.measure.profiler.capture():
            yield

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """End every thread the runtime started: idle ones are joined; one stuck in an op
        that never returns is abandoned once that op has run ``timeout`` seconds (a daemon;
        it runs nothing more). Returns within ``timeout`` + a fraction of a second, whatever
        the stage functions do (across processes up to two seconds more: telling the peers
        it left, and the progress engine's last messages). Idempotent. Not from inside a
        stage function (refused: the call it runs in closes nothing)."""
        refuse_reentry("close", self.backend)
        # A multi-process runtime that failed: closed with no exception in flight, the
        # failure was handled and the job may go on (with a fresh Runtime); closed while one
        # propagates (a ``finally``), the exit guards still end the job.
        self._close(handled=sys.exc_info()[1] is None)

    def _close(self, error: BaseException | None = None, handled: bool = False) -> None:
        """Once (see ``close_parts``: ``error`` is the exception leaving a ``with`` block)."""
        if not self._parts.calls.closed:
            self._finalizer.detach()
            close_parts(self._parts, error, handled)

    async def aclose(self) -> None:
        """:meth:`close`, off the event loop."""
        refuse_reentry("aclose", self.backend)
        await asyncio.to_thread(self._close, None, sys.exc_info()[1] is None)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, tp: object, error: BaseException | None, tb: object) -> None:
        refuse_reentry("close", self.backend)
        self._close(error, handled=error is None)

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, tp: object, error: BaseException | None, tb: object) -> None:
        refuse_reentry("close", self.backend)
        await asyncio.to_thread(self._close, error, error is None)


__all__ = ["Runtime", "agreement_digest", "check_given_graph", "check_graph",
           "data_parallel_of", "resolve_schedule", "run"]
