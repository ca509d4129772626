"""The runtime: launches resharding plans and pipeline steps — step graphs — on a backend, from
asyncio.

Async-first: ``await rt.reshard(plan, shards)`` and ``await rt.train_step(...)``; the
``*_sync`` methods wrap them for synchronous code. The event loop never blocks on device
work: completions arrive through events. This module holds the API, the caches (plans,
graphs, resolved routes) and the lifecycle; each call runs as a scope
(:class:`~overlap.call.Call`: admit, launch, watch, finish, recover), which is also where the
multi-process protocol sits. A failed call leaves a one-process runtime usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import sys
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np

from scheduler import (
    Channel,
    Cluster,
    CostModel,
    DataParallel,
    DeviceMesh,
    PlanCache,
    PlanOptions,
    ReshardPlan,
    Schedule,
    Sharding,
    Span,
    StateReshardPlan,
    StepGraph,
    Timeline,
    TransferOp,
    auto_schedule,
    lower,
    make_schedule,
    reshard_graph,
    validate,
)
from scheduler.auto import check_caps
from scheduler.errors import PlanError, check_seconds
from scheduler.lowering import (
    Boundaries,
    boundaries_key,
    channels,
    per_microbatch,
    plan_mismatch,
)
from scheduler.regions import Region, region_shape
from scheduler.timeline import span_meta

from .backends import Backend, Trace, make_backend
from .call import Call, CallGate, refuse_reentry, settle_leftovers
from .errors import CollectiveAborted, DeviceThreadLost, OverlapRuntimeError, RankFailed
from .hang_dump import hang_dump
from .nvtx import range_end, range_start
from .pipeline import Stage, StepState, check_pipeline, check_split, launch_step, step_channels
from .polling import PollFirstSelector
from .profiling import profile_window
from .reshard import (
    BufferTable,
    check_outs,
    check_shards,
    launch_reshard,
    reshard_channels,
    resolve,
    shards_match,
)
from .scope import CancelScope
from .state_reshard import reshard_state
from .stats import StepHookHandle, StepHooks, StepStats, step_stats
from .world import Placement, World, detect_world

T = TypeVar("T")
log = logging.getLogger("overlap")
_MEMO_SIZE = 64  # graphs, digests, routes, plan inputs kept per runtime (least recent dropped)
_MISSING = object()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a new event loop (see ``_new_loop``), then close it."""
    loop = _SyncLoop()
    try:
        return loop.run(coro, "overlap.run")
    finally:
        loop.close()


def _new_loop() -> asyncio.AbstractEventLoop:
    """The loop for synchronous calls made on this thread: uvloop's, but on the main thread,
    where uvloop arms its signal wake-up at every run (a socket pair, ``set_wakeup_fd``, a
    watch on it, then all undone: ~12 µs each call of every process, twice stock asyncio's
    whole run). There stock asyncio's loop: a Ctrl-C interrupts its wait as any system call
    (EINTR), and a whole training step takes as long on either (measured) — and its
    selector looks again briefly before it sleeps (:mod:`overlap.polling`)."""
    if threading.current_thread() is threading.main_thread():
        return asyncio.SelectorEventLoop(PollFirstSelector())
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _cancel_pending(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on ``loop`` and let it finish, so nothing runs on later."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


class _SyncLoop:
    """The event loop a runtime's ``*_sync`` methods run on, kept between calls: a new loop
    per call (``asyncio.run``) also makes and joins a new thread pool each time — about 0.4 ms
    a call on one process, 2.5 ms with four processes sharing two cores."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        # Calls from several threads take turns (one loop runs one call at a time; a second
        # thread running the same loop would fail, or cancel the first call).
        self._turn = threading.Lock()

    def run(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise RuntimeError(f"{what}: called from inside a running event loop; await the "
                               "async method instead")
        with self._turn:
            return self._run(coro)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None or self._loop.is_closed():
            self._loop = _new_loop()
        loop = self._loop
        task = loop.create_task(coro)
        try:
            return loop.run_until_complete(task)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: nothing of this call may run on during a later one.
            _cancel_pending(loop)
            raise

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the ``*_sync`` calls run on (None: none made yet, or closed)."""
        return self._loop

    def close(self) -> None:
        with self._turn:
            self._close()

    def _close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return

        def shut() -> None:
            _cancel_pending(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            shut()
            return
        # Closed from async code: another loop runs on this thread, so finish ours elsewhere.
        t = threading.Thread(target=shut, name="overlap-sync-loop-close")
        t.start()
        t.join()


def _shut_down(scope: CancelScope, backend: Backend, sync: _SyncLoop) -> None:
    scope.cancel(CollectiveAborted("the runtime closed"))
    backend.close()
    sync.close()


def _collected(scope: CancelScope, backend: Backend, sync: _SyncLoop, what: str) -> None:
    warnings.warn(f"unclosed overlap.Runtime ({what}): its threads are ended now; call "
                  "close(), or use `with overlap.Runtime(...) as rt:`", ResourceWarning,
                  stacklevel=2)
    _shut_down(scope, backend, sync)


def _blocks(cluster: Cluster, world: World) -> Placement:
    """The default placement, its error naming a caller's process group as the world (its
    size is the caller's choice, not a launcher's flag)."""
    try:
        return Placement.blocks(cluster.num_devices, world.size)
    except ValueError as exc:
        if world.source != "process_group":
            raise
        raise ValueError(f"{exc} (this world is the torch.distributed default process group "
                         f"the caller initialized: world_size={world.size}, rank "
                         f"{world.rank}; make the group with a divisor of the cluster's "
                         f"{cluster.num_devices} devices)") from None


def _link_time(cluster: Cluster, emulate: bool | str
               ) -> Callable[[int, Sequence[int], int], float] | None:
    """Link emulation: each transfer lasts at least the cost model's time for it alone
    (``"signal"``: its latency only), from the same functions the simulator costs it with."""
    model = CostModel(cluster)
    if emulate == "signal":
        return lambda root, receivers, nbytes: model.latency_of(root, tuple(receivers))
    if emulate:
        return lambda root, receivers, nbytes: model.alone_seconds(root, tuple(receivers),
                                                                   nbytes)
    return None


def resolve_schedule(schedule: str | Schedule | None, num_stages: int,
                     num_microbatches: int) -> Schedule:
    """The step's schedule: ``schedule`` itself (checked against the step's stages and
    microbatches), or the one named (default ``"eager-1f1b"``)."""
    if isinstance(schedule, Schedule):
        if (schedule.num_stages, schedule.num_microbatches) != (num_stages, num_microbatches):
            raise ValueError(f"schedule: built for {schedule.num_stages} stages × "
                             f"{schedule.num_microbatches} microbatches; this step has "
                             f"{num_stages} × {num_microbatches}")
        return schedule
    if schedule is not None and not isinstance(schedule, str):
        raise TypeError(f"schedule: expected a name or a Schedule, got {type(schedule).__name__}")
    return _named_schedule(schedule or "eager-1f1b", num_stages, num_microbatches)


@functools.lru_cache(maxsize=64)
def _named_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """A step by name makes (and checks) its schedule once per size, not every call: that
    was ~0.06 s a step at 64 stages × 256 microbatches. (A bad name raises every time:
    errors are not cached.)"""
    return make_schedule(name, num_stages, num_microbatches)


def data_parallel_of(stages: Sequence[Stage]) -> dict[int, DataParallel]:
    """The stages' gradient reductions, as the lowering takes them."""
    return {s: DataParallel(st.data_parallel.axis, st.data_parallel.nbytes)
            for s, st in enumerate(stages) if st.data_parallel is not None}


def check_graph(graph: StepGraph, meshes: tuple[DeviceMesh, ...],
                boundaries: Boundaries, num_microbatches: int,
                data_parallel: Mapping[int, DataParallel] | None = None) -> None:
    """Raise ValueError naming ``graph`` unless it was lowered for these stage meshes,
    boundaries (every channel's plan moves its boundary's tensor between its layouts),
    number of microbatches and data-parallel stages."""
    if not isinstance(graph, StepGraph):
        raise TypeError(f"graph: expected a StepGraph, got {type(graph).__name__}")
    if graph.schedule is None or graph.stages != meshes:
        raise ValueError("graph: lowered for other stage meshes (or not a pipeline's graph)")
    if graph.schedule.num_microbatches != num_microbatches:
        raise ValueError(f"graph: lowered for {graph.schedule.num_microbatches} microbatches, "
                         f"got {num_microbatches}")
    want = dict(data_parallel or {})
    if dict(graph.data_parallel) != want:
        raise ValueError(f"graph: lowered with data-parallel stages {dict(graph.data_parallel)}, "
                         f"the stages have {want} (lower(..., data_parallel=...))")
    per = per_microbatch(boundaries, num_microbatches)
    rows = range(1) if all(k is None or not isinstance(k, tuple) for k in graph.plans) \
        and len(set(per)) == 1 else range(num_microbatches)
    for i in rows:
        for channel, b, src, dst in channels(per[i]):
            try:
                plan: ReshardPlan | None = graph.plan_for(channel, i)
            except KeyError:
                plan = None
            mismatch = "it has none" if plan is None else plan_mismatch(plan, b, src, dst)
            if mismatch is not None:
                raise ValueError(f"graph: its plan for {channel} (microbatch {i}) does not fit "
                                 f"boundaries[{channel.boundary}]: {mismatch}")


def agreement_digest(graph: StepGraph) -> bytes:
    """What a step's agreement compares across processes: the graph's digest, then the
    number of microbatches and each one's first-boundary shape (a mismatch of counts is
    named by both counts, one of shapes by microbatch)."""
    from .backends.distributed import shape_table

    m = graph.schedule.num_microbatches if graph.schedule is not None else 0
    first = Channel("fwd", 0)
    shapes = [graph.plan_for(first, i).shape for i in range(m)] if len(graph.stages) > 1 \
        else []
    return graph.digest() + shape_table(shapes, m)


def check_given_graph(graph: StepGraph) -> None:
    """A graph the runtime did not lower may be broken (edited JSON, another tool): its plans
    must be correct and the graph must validate (every transfer present, data dependencies
    kept, no deadlock) — once per graph, before it first runs."""
    for channel, plan in graph.plans.items():
        try:
            plan.check()
        except PlanError as exc:
            raise PlanError(f"graph: its plan for {channel}: {exc}") from None
    validate(graph)


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
            says (``overlap.world.detect_world``: one process unless started by ``mpiexec``
            or ``srun``).
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
        if not isinstance(cluster, Cluster):
            raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
        check_seconds("timeout", timeout)  # before any thread or process is started
        self._hang_dump = hang_dump(hang_tracebacks, timeout)
        self._profile_window = profile_window(profile_steps)
        self._capturing = False
        if world is not None and not isinstance(world, World):
            raise TypeError(f"world: expected an overlap.world.World, got "
                            f"{type(world).__name__}")
        if placement is not None and not isinstance(placement, Placement):
            raise TypeError(f"placement: expected an overlap.world.Placement, got "
                            f"{type(placement).__name__}")
        world = detect_world() if world is None else world
        if world.distributed:
            if emulate_links:
                raise ValueError("emulate_links: link emulation plays a cluster inside one "
                                 "process; it is not available in a multi-process job")
            # (the backend checks that it covers the cluster, before any work)
            placement = placement or _blocks(cluster, world)
        elif placement is not None and set(placement.owners) != {0}:
            raise ValueError("placement: a one-process world owns every device")
        self.world = world
        self.cluster = cluster
        if compute_time is not None and not callable(compute_time):
            raise TypeError("compute_time: expected a callable (stage, kind) -> seconds")
        self.compute_time = compute_time
        if emulate_links not in (False, True, "signal"):
            raise ValueError(f"emulate_links: expected True, False or 'signal', got "
                             f"{emulate_links!r}")
        self.backend: Backend = make_backend(backend, cluster.num_devices, timeout=timeout,
                                             link_time=_link_time(cluster, emulate_links),
                                             world=world, placement=placement)
        self.local_devices: tuple[int, ...] = tuple(
            d for d in range(cluster.num_devices) if self.backend.is_local(d))
        self._reshards = 0  # standalone reshardings so far: names their messages across ranks
        self._steps = 0  # training steps so far (they name their NVTX ranges)
        if world.distributed:
            # At DEBUG: every runtime of every rank would otherwise print it (a script that
            # makes many runtimes printed little else). The guard names a killed rank itself.
            log.debug("%s", self.backend.dist.describe())
        self._closed = False
        self._sync = _SyncLoop()
        self._gate = CallGate()
        # The runtime's own scope: the parent of every call's. Closing the runtime cancels it;
        # across processes a peer's failure does (the job cannot go on).
        self.scope = CancelScope("the runtime")
        if self.backend.dist is not None:
            self.backend.dist.scope = self.scope
        self._lost: DeviceThreadLost | None = None
        self._unsettled = False  # an interrupted call left work for the next call to settle
        self.plans = PlanCache(cluster)  # each boundary planned once per options
        self._memo: OrderedDict[Any, Any] = OrderedDict()  # step graphs, plan digests
        # The last call's trace and graph (``timeline()``), and the last training step's
        # (``auto`` takes its measured compute times).
        self._last_trace: tuple[Any, StepGraph] | None = None
        self._last_step: tuple[Any, StepGraph] | None = None
        self._stats: tuple[Any, ...] | StepStats | None = None  # (see last_step)
        self._step_hooks = StepHooks()
        # Dropped without close(): end the threads anyway, and say so (as files and event
        # loops do). The callback holds the scope, the backend and the loop, never the
        # runtime — nor does anything a stream thread holds.
        self._finalizer = weakref.finalize(self, _collected, self.scope, self.backend,
                                           self._sync, f"{self.backend.name} backend, "
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
        self._check_open()
        if not isinstance(plan, ReshardPlan):
            raise TypeError(f"plan: expected a ReshardPlan, got {type(plan).__name__}")
        # What a plan asks of every call, worked out at its first (checks that raise keep
        # nothing): a plan a loop passes again costs a lookup, not a walk of its meshes.
        src, regions, expected = self._cached(("reshard inputs", plan),
                                              lambda: self._reshard_inputs(plan))
        dtype = np.dtype(plan.dtype)
        if not shards_match(expected, shards, dtype, self._array_types()):
            check_shards(plan, shards, self._array_types(),  # (names what is wrong)
                         self.backend.is_local if self.world.distributed else None)
        xp = self.backend.xp
        if out is not None:
            check_outs(plan, out, shards, self._array_types(), self.backend.is_local, xp)
        # A plan this runtime did not make may be broken (edited JSON, another tool): checked
        # once, with its graph, before anything moves, so that no destination keeps
        # uninitialised memory.
        graph = self._cached(("reshard", plan, stream), lambda: self._reshard_graph(plan, stream))
        digest, members = (self._cached(("digest", plan), lambda: self._plan_check(plan))
                           if self.world.distributed else (b"", None))
        # Each destination buffer is made on first use, by its device's stream (its memory).
        outs = BufferTable(lambda d: xp.empty(region_shape(regions[d]), dtype))
        if out is not None:
            outs.update(out)
        backend = self.backend

        def go(scope: CancelScope) -> list[Any]:
            base, self._reshards = self._reshards * len(plan.transfers), self._reshards + 1
            routes = self._routes(graph, lambda op: f"#{op.id}")
            return launch_reshard(backend, plan, shards, outs, graph, routes, (src, regions),
                                  scope=scope, tag_base=base)

        recorded = self.backend.start_trace() if trace else None
        try:
            await self._call("reshard", graph, go, subject="the plan",
                             channels=(reshard_channels(graph, plan), []), digest=digest,
                             members=members, trace=recorded)
        finally:
            if recorded is not None:
                self._last_trace = (recorded, graph)
        # Devices that got nothing: empty regions. In a multi-process job, this process's.
        return {d: outs[d] for d in regions if self.backend.is_local(d)}

    def _reshard_graph(self, plan: ReshardPlan, stream: str) -> StepGraph:
        plan.check()
        return reshard_graph(plan, stream)

    def _routes(self, graph: StepGraph, name: Callable[[Any], str]) -> Any:
        """Each transfer op's part on each local device, resolved once per graph — at its
        first launch, once the call prepared the channels it spans (a route resolved before
        would have to be resolved again at every transfer)."""
        return self._cached(("routes", id(graph)), lambda: (graph, resolve(
            self.backend, graph, name)))[1]

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
        return await reshard_state(self, plan, shards, out=out, trace=trace)

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
            self._check_open()  # before a loop is made for a call that cannot run
            refuse_reentry(what, self.backend)
        except BaseException:
            coro.close()
            raise
        return self._sync.run(coro, what)

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
        self._check_open()
        _check_bound(timeout)
        check_pipeline(stages, boundaries, input_sharding, microbatches, self._array_types())
        if max_activations is not None and schedule != "auto":
            raise ValueError("max_activations: only schedule='auto' chooses under a cap; a "
                             "named schedule's peaks are fixed (Schedule.peak_activations)")
        graph, digest = await self._step_graph(stages, boundaries, len(microbatches), schedule,
                                               options, graph, max_activations)
        state = StepState()
        m = len(microbatches)
        backend, compute_time = self.backend, self.compute_time
        # The last stage's first device computes the losses; across processes its owner's
        # end-of-call row carries them to every other process.
        first = stages[-1].mesh.device_ids[0]

        def losses() -> bytes:
            if not backend.is_local(first):
                return bytes(8 * m)
            return np.array([float(state.losses[i]) for i in range(m)], np.float64).tobytes()

        def go(scope: CancelScope) -> list[Any]:
            routes = self._routes(graph, lambda op: str(op.body))
            return launch_step(backend, graph, stages, boundaries, input_sharding, microbatches,
                               routes=routes, scope=scope, compute_time=compute_time,
                               state=state)

        index = self._steps
        self._steps += 1
        window = self._profile_window
        if window is not None and index == window.start:
            self._profiler(True)
        step_range = range_start(f"step {index}", "step")  # Nsight: one range a step
        trace = self.backend.start_trace()
        began = time.perf_counter()
        self._stats = None  # (a failed step has none)
        try:
            table = await self._call("train_step", graph, go, subject="the step graph",
                                     channels=step_channels(graph, boundaries, stages),
                                     digest=digest, trace=trace,
                                     payload=losses if self.world.distributed else None,
                                     timeout=timeout)
        finally:
            range_end(step_range)
            if window is not None and index == window.stop - 1:
                self._profiler(False)
            self._last_trace = self._last_step = (trace, graph)
        self._stats = (index, time.perf_counter() - began, trace, graph)
        self._step_hooks.run(self)
        if not self.world.distributed:
            return [float(state.losses[i]) for i in range(m)]
        owner = self.backend.placement.owners[first]  # type: ignore[union-attr]
        return [float(v) for v in np.frombuffer(table[owner], np.float64)]

    async def _step_graph(self, stages: Sequence[Stage], boundaries: Boundaries,
                          num_microbatches: int, schedule: str | Schedule | None,
                          options: PlanOptions | None, graph: StepGraph | None,
                          max_activations: int | Sequence[int] | None = None
                          ) -> tuple[StepGraph, bytes]:
        """The step's graph and its digest: the caller's (checked), or lowered — and planned
        — in a worker thread (seconds of planning never block the event loop), cached."""
        meshes = tuple(st.mesh for st in stages)
        if graph is None and options is not None and not isinstance(options, PlanOptions):
            raise TypeError(f"options: expected a PlanOptions, got {type(options).__name__}")
        if schedule == "auto" and graph is None:
            return await self._auto_graph(stages, meshes, boundaries, num_microbatches,
                                          options, max_activations)
        if graph is not None:
            if schedule is not None or options is not None:
                raise ValueError("graph: give a step graph, or a schedule and options to "
                                 "lower one, not both")
            check_graph(graph, meshes, boundaries, num_microbatches, data_parallel_of(stages))
            key: Any = ("given", id(graph))
        else:
            sched = resolve_schedule(schedule, len(stages), num_microbatches)
            key = ("lowered", meshes, boundaries_key(boundaries), sched,
                   options or PlanOptions(), tuple(sorted(data_parallel_of(stages).items())))
        chosen = graph.schedule if graph is not None else sched
        check_split(stages, chosen.kinds)  # type: ignore[union-attr]
        hit = self._memo.pop(key, None)
        if hit is None or (graph is not None and hit[0] is not graph):

            def make() -> tuple[StepGraph, bytes]:
                if graph is not None:
                    check_given_graph(graph)
                g = graph if graph is not None else lower(
                    meshes, boundaries, key[3], self.cluster, key[4], cache=self.plans,
                    data_parallel=dict(key[5]))
                return g, (agreement_digest(g) if self.world.distributed else b"")

            hit = await asyncio.to_thread(make)
        self._remember(key, hit)
        return hit

    async def _auto_graph(self, stages: Sequence[Stage], meshes: tuple[DeviceMesh, ...],
                          boundaries: Boundaries, num_microbatches: int,
                          options: PlanOptions | None,
                          max_activations: int | Sequence[int] | None
                          ) -> tuple[StepGraph, bytes]:
        """``schedule="auto"``: :func:`scheduler.auto_schedule` over the step's stages with
        the runtime's compute costs, chosen once per pipeline, microbatch count and options
        (planned off the event loop, like a lowering), then reused."""
        cap = check_caps(max_activations, len(stages))  # bad caps named before any work
        dp = data_parallel_of(stages)
        key = ("auto", meshes, boundaries_key(boundaries), num_microbatches,
               options or PlanOptions(),
               None if cap is None else tuple(cap), tuple(sorted(dp.items())))
        hit = self._memo.pop(key, None)
        if hit is None:
            costs = self._auto_costs(stages, meshes)

            def make() -> tuple[StepGraph, bytes]:
                choice = auto_schedule(meshes, boundaries, num_microbatches, self.cluster,
                                       costs, key[4], max_activations=cap, cache=self.plans,
                                       data_parallel=dp)
                log.info("schedule 'auto' chose %s (%.3g s simulated)", choice.schedule.name,
                         choice.seconds)
                g = choice.graph
                return g, (agreement_digest(g) if self.world.distributed else b"")

            hit = await asyncio.to_thread(make)
        self._remember(key, hit)
        return hit

    def _auto_costs(self, stages: Sequence[Stage], meshes: tuple[DeviceMesh, ...]
                    ) -> Callable[[int, str], float]:
        """Seconds per (stage, kind) for ``auto``: ``compute_time`` when given, else the last
        step's measured means (one process only: processes measure different devices and
        must choose alike). The backward is split only where every stage can and I/W costs
        are known."""
        split = all(st.backward_weight is not None for st in stages)
        table: dict[tuple[int, str], float] | None = None
        if self.compute_time is None:
            table = self._measured_costs(meshes)
            if table is None:
                raise ValueError(
                    "schedule: 'auto' chooses from compute costs; give Runtime(compute_time="
                    "...), or run a step of this pipeline with another schedule first (its "
                    "measured times are used; one process only), or pass "
                    "scheduler.auto_schedule(...).schedule")
        fn = self.compute_time

        def cost(stage: int, kind: str) -> float:
            if kind in ("I", "W") and not split:
                raise KeyError(kind)  # (auto_schedule then keeps the full backward)
            return fn(stage, kind) if table is None else table[(stage, kind)]
        return cost

    def _measured_costs(self, meshes: tuple[DeviceMesh, ...]
                        ) -> dict[tuple[int, str], float] | None:
        if self.world.distributed or self._last_step is None:
            return None
        if self._last_step[1].stages != meshes:
            return None
        spans: dict[tuple[int, str], list[float]] = {}
        for sp in self._timeline(*self._last_step).spans:
            if sp.stream == "compute":
                spans.setdefault((sp.stage, sp.kind), []).append(sp.end - sp.start)
        table = {key: sum(v) / len(v) for key, v in spans.items()}
        for s in range(len(meshes)):
            if (s, "B") not in table and (s, "I") in table:
                table[(s, "B")] = table[(s, "I")] + table.get((s, "W"), 0.0)
        return table

    def timeline(self) -> Timeline:
        """What the last traced call — a :meth:`train_step`, or a :meth:`reshard` with
        ``trace=True`` — ran where and when (measured), as a Timeline: the simulator's type,
        with the same op ids, so measured and simulated steps share metrics and traces and
        compare op by op. In a multi-process job: this process's devices (each process
        writes its own trace)."""
        if self._last_trace is None:
            raise OverlapRuntimeError("timeline: no traced call has run yet (a train_step, or a "
                                      "reshard with trace=True)")
        return self._timeline(*self._last_trace)

    def _timeline(self, trace: Trace, graph: StepGraph) -> Timeline:
        records = trace.records
        sec = functools.partial(self.backend.span_seconds, trace)
        # A transfer moves nothing before its last participant reaches it: a receiver that
        # got there first was waiting for its producer (a bubble, not communication), as the
        # simulator's transfers start when sender and receivers are ready. Each participant's
        # span starts at the latest arrival this process saw.
        # (Only this process's participants are seen: across processes a transfer's spans
        # start where this process's part of it did.)
        timed = [(r, sec(r.start), sec(r.end)) for r in records]
        arrived: dict[int, float] = {}
        for r, start, _ in timed:
            if isinstance(graph.ops[r.op].body, TransferOp):
                arrived[r.op] = max(arrived.get(r.op, -math.inf), start)
        spans = []
        for r, start, end in timed:
            name, stage, mb, kind = span_meta(graph.ops[r.op].body)
            start = min(end, max(start, arrived.get(r.op, -math.inf)))
            spans.append(Span(r.device, r.stream, name, start, end, stage, mb, kind, r.op))
        spans.sort(key=lambda s: (s.device, s.start))
        # A process of a multi-process job measured its own devices only.
        stage_of = {d: graph.stage_of(d) for d in graph.devices if self.backend.is_local(d)}
        return Timeline(tuple(spans), len(graph.stages), tuple(sorted(stage_of)), stage_of,
                        graph.data_inputs)

    def register_step_hook(self, hook: Callable[[StepStats], Any]) -> StepHookHandle:
        """Call ``hook(stats)`` after every successful :meth:`train_step`, with the step's
        :attr:`last_step` — a logger in one line (``rt.register_step_hook(lambda s:
        writer.add_scalar("bubble", s.bubble, s.step))``). Hooks run in the order registered,
        on the caller's event loop thread, before the step returns; one that raises makes the
        step's call raise (its gradients are in place). Returns a handle whose ``remove()``
        unregisters it, as torch's hooks do."""
        return self._step_hooks.add(hook)

    @property
    def last_step(self) -> StepStats | None:
        """The last successful :meth:`train_step`'s figures (:class:`overlap.StepStats`: wall
        time, bubble, exposed communication, compute per stage, peak activations), from the
        runtime's own trace, made on first access; None before any step or after a failed
        one. In a multi-process job: this process's devices."""
        if self._stats is None or isinstance(self._stats, StepStats):
            return self._stats
        index, seconds, trace, graph = self._stats
        self._stats = step_stats(index, seconds, self._timeline(trace, graph))
        return self._stats

    def write_trace(self, path: str | Path) -> Path:
        """Write the last call's measured timeline as Chrome/Perfetto JSON."""
        return self.timeline().to_chrome_trace(path)

    def train_step_sync(self, *args: Any, **kwargs: Any) -> list[float]:
        """:meth:`train_step` for synchronous callers."""
        return self.run_sync(self.train_step(*args, **kwargs), "train_step_sync")

    # ---- calls ---------------------------------------------------------------------------

    async def _call(self, what: str, graph: StepGraph, launch: Callable[[CancelScope], Any],
                    *, channels: Any, subject: str = "", digest: bytes = b"",
                    members: tuple[int, ...] | None = None,
                    payload: Callable[[], bytes] | None = None, trace: Trace | None = None,
                    timeout: float | None = None) -> Any:
        """Run one call as a scope (:class:`~overlap.call.Call`), one at a time, recording
        its ops into ``trace`` if given, bounded by ``timeout`` instead of the runtime's when
        given (every wait of the backend reads its one ``Bound``). Returns the end-of-call
        table across processes."""
        refuse_reentry(what, self.backend)
        async with self._gate:
            self._check_open()
            if self._unsettled:  # an interrupted call's streams: settled before this one
                stuck = await settle_leftovers(self.backend)
                self._unsettled = False
                if stuck:
                    call = Call(self.backend, self.scope, what, graph, None)
                    call._abandon(stuck)
                    self._lost = call.lost
                    self._check_open()
            call = Call(self.backend, self.scope, what, graph, self.backend.dist, trace=trace,
                        dump=self._hang_dump)
            bound = self.backend.bound
            usual = bound.seconds
            if timeout is not None:
                bound.seconds = timeout
            try:
                table = await call.run(launch, channels=channels, digest=digest,
                                       members=members, payload=payload, subject=subject)
            finally:
                bound.seconds = usual
                self._unsettled = call.unsettled
                if call.lost is not None:
                    self._lost = call.lost
                # Nothing the streams still hold (an abandoned op's scope) may keep this
                # call's exceptions — and through their tracebacks this runtime — alive.
                call.scope.forget_failures()
            return table

    def _reshard_inputs(self, plan: ReshardPlan) -> tuple[
            dict[int, Region], dict[int, Region], dict[int, tuple[int, ...]]]:
        """A plan's source and destination regions and the shards a call must pass (source
        device -> its region's shape: this process's devices), once its devices are known to
        be in the runtime's cluster (else ValueError, naming the device)."""
        top = max((*plan.src.mesh.device_ids, *plan.dst.mesh.device_ids), default=-1)
        if top >= self.cluster.num_devices:
            raise ValueError(f"plan: device {top} is outside the runtime's cluster "
                             f"(devices 0..{self.cluster.num_devices - 1})")
        mine = self.backend.is_local if self.world.distributed else (lambda _: True)
        src = plan.src.device_regions(plan.shape)
        return src, plan.dst.device_regions(plan.shape), {
            d: region_shape(r) for d, r in src.items() if mine(d)}

    def _plan_check(self, plan: ReshardPlan) -> tuple[bytes, tuple[int, ...]]:
        """What a resharding call's agreement compares (a SHA-256 of the plan), and among
        whom: the ranks holding a device of either layout — the others have no part in it."""
        placement = self.backend.placement
        assert placement is not None  # (a multi-process backend's)
        owners = placement.ranks_of((*plan.src.mesh.device_ids, *plan.dst.mesh.device_ids))
        return hashlib.sha256(plan.to_json().encode()).digest(), tuple(sorted(owners))

    def _cached(self, key: Any, make: Callable[[], T]) -> T:
        """``make()``, kept for ``key`` with the runtime's other derived values (graphs,
        digests); the least recently used dropped past a bound."""
        value = self._memo.pop(key, _MISSING)
        if value is _MISSING:
            value = make()
        self._remember(key, value)
        return value  # type: ignore[return-value]

    def _remember(self, key: Any, value: Any) -> None:
        self._memo[key] = value  # most recently used last
        while len(self._memo) > _MEMO_SIZE:
            self._memo.popitem(last=False)

    def _array_types(self) -> tuple[type, ...]:
        xp = self.backend.xp
        return (np.ndarray,) if xp is np else (np.ndarray, xp.ndarray)

    def _check_open(self) -> None:
        if self._closed:
            raise OverlapRuntimeError("runtime is closed")
        if self._lost is not None:
            raise self._lost
        dist = self.backend.dist
        broken = dist.broken if dist is not None else None
        if broken is not None:
            if isinstance(broken, RankFailed):
                raise broken
            raise OverlapRuntimeError(f"this process's runtime failed earlier ({broken}); a "
                                      "multi-process job cannot continue after a failure")

    # ---- profiling -----------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record what runs inside the block with the profiler (``cudaProfilerStart`` /
        ``Stop``: ``nsys profile --capture-range=cudaProfilerApi`` records only this) — for
        windows that are not whole training steps (``profile_steps``). A no-op on the CPU
        backend."""
        self._check_open()
        self._profiler(True)
        try:
            yield
        finally:
            self._profiler(False)

    def _profiler(self, on: bool) -> None:
        if on != self._capturing:
            self._capturing = on
            self.backend.profiler(on)

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
        """``error``: the exception leaving a ``with`` block (a multi-process job then tells
        the other ranks this one failed, not that it left)."""
        if not self._closed:
            self._closed = True
            self._finalizer.detach()
            with contextlib.suppress(Exception):  # a window left open ends with the runtime
                self._profiler(False)
            if self.backend.dist is not None:
                self.backend.dist.leave(error, handled)
            _shut_down(self.scope, self.backend, self._sync)

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


def _check_bound(timeout: float | None) -> None:
    """A call's own bound: None (the runtime's) or seconds > 0 (ValueError naming it)."""
    if timeout is not None:
        check_seconds("timeout", timeout)
