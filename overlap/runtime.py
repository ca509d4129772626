"""The runtime: launches resharding plans and pipeline steps — step graphs — on a backend, from
asyncio.

Async-first: ``await rt.reshard(plan, shards)`` and ``await rt.train_step(...)``; the
``*_sync`` methods wrap them for synchronous code. The event loop never blocks on device
work: completions arrive through events. On failure the runtime aborts all in-flight work,
waits until every stream has stopped, resets the backend and raises — it is usable again
afterwards.
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
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from scheduler import (
    Boundary,
    Cluster,
    CostModel,
    DeviceMesh,
    PlanCache,
    PlanOptions,
    ReshardPlan,
    Schedule,
    Sharding,
    Span,
    StepGraph,
    Timeline,
    TransferOp,
    auto_schedule,
    lower,
    make_schedule,
    reshard_graph,
)
from scheduler.auto import check_caps
from scheduler.errors import PlanError, check_seconds
from scheduler.lowering import channels, plan_mismatch
from scheduler.regions import Region, region_shape
from scheduler.timeline import span_meta
from scheduler.validate import validate

from .backends import Backend, make_backend
from .errors import (
    CallMismatch,
    CollectiveAborted,
    CollectiveTimeout,
    OverlapRuntimeError,
    RankFailed,
)
from .nvtx import range_end, range_start
from .pipeline import Stage, StepState, check_pipeline, check_split, launch_step
from .poll_first import PollFirstSelector
from .profiling import profile_window
from .reshard import BufferTable, check_outs, check_shards, launch_reshard, shards_match
from .watch import Recovery, name_hang, wait_all
from .world import Placement, World, detect_world

if TYPE_CHECKING:
    from .backends import Event
    from .backends.distributed import Agreement

T = TypeVar("T")
log = logging.getLogger("overlap")
_MEMO_SIZE = 64  # graphs, digests, plan inputs kept per runtime (least recently used dropped)
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
    whole run; 10 % of a tiny cross-process call, docs/benchmarks.md). There stock asyncio's
    loop: a Ctrl-C interrupts its wait as any system call (EINTR), and a whole training step
    takes as long on either (measured) — and its selector looks again briefly before it
    sleeps (:class:`~overlap.poll_first.PollFirstSelector`: a sleeping process wakes tens
    of microseconds late)."""
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


async def _agreed(check: Agreement, verdict: asyncio.Future[None] | None,
                  work_failed: bool) -> None:
    """The call's agreement, once its work has ended: awaited even when the work failed
    (bounded, while it can complete), because a mismatch — recorded as a failure, the root
    cause — is the explanation the user needs; raised unless the work failed (its failure is
    raised then). ``verdict``: the task that polled it alongside the work (MPI), if any."""
    check.hurry()
    if verdict is None:
        try:
            await check.wait()  # (its rows compared as they landed: at most a wait left)
        except Exception:
            if not work_failed:
                raise
        return
    if not verdict.done():
        await asyncio.wait([verdict])  # (failed work aborted the backend: this ends too)
    if work_failed:
        if not verdict.cancelled():
            verdict.exception()  # retrieved: the work's failure is the one raised
        return
    verdict.result()


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


def _shut_down(backend: Backend, sync: _SyncLoop) -> None:
    backend.close()
    sync.close()


def _collected(backend: Backend, sync: _SyncLoop, what: str) -> None:
    warnings.warn(f"unclosed overlap.Runtime ({what}): its threads are ended now; call "
                  "close(), or use `with overlap.Runtime(...) as rt:`", ResourceWarning,
                  stacklevel=2)
    _shut_down(backend, sync)


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


def _schedule(schedule: str | Schedule | None, num_stages: int, num_microbatches: int
              ) -> Schedule:
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


def check_graph(graph: StepGraph, meshes: tuple[DeviceMesh, ...],
                boundaries: tuple[Boundary, ...], num_microbatches: int) -> None:
    """Raise ValueError naming ``graph`` unless it was lowered for these stage meshes,
    boundaries (every channel's plan moves its boundary's tensor between its layouts) and
    number of microbatches."""
    if not isinstance(graph, StepGraph):
        raise TypeError(f"graph: expected a StepGraph, got {type(graph).__name__}")
    if graph.schedule is None or graph.stages != meshes:
        raise ValueError("graph: lowered for other stage meshes (or not a pipeline's graph)")
    if graph.schedule.num_microbatches != num_microbatches:
        raise ValueError(f"graph: lowered for {graph.schedule.num_microbatches} microbatches, "
                         f"got {num_microbatches}")
    for channel, b, src, dst in channels(boundaries):
        plan = graph.plans.get(channel)
        mismatch = "it has none" if plan is None else plan_mismatch(plan, b, src, dst)
        if mismatch is not None:
            raise ValueError(f"graph: its plan for {channel} does not fit boundaries"
                             f"[{channel.boundary}]: {mismatch}")


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
            missing.
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

    In a multi-process job every process makes the same calls with the same arguments; each
    runs only its own devices' parts (see README, "Running on several processes and hosts").
    """

    def __init__(self, cluster: Cluster, backend: str = "cpu", *,
                 emulate_links: bool | str = False,
                 compute_time: Callable[[int, str], float] | None = None,
                 timeout: float = 30.0, world: World | None = None,
                 placement: Placement | None = None,
                 profile_steps: range | str | None = None) -> None:
        if not isinstance(cluster, Cluster):
            raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
        check_seconds("timeout", timeout)  # before any thread or process is started
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
            if world.source == "env":
                raise RuntimeError(
                    f"world: {world.size} processes described by torchrun-style variables "
                    "(RANK, WORLD_SIZE), but overlap's data plane between processes is MPI, "
                    "which needs its launcher: start the job with `mpiexec -n N` or `srun "
                    "--mpi=pmix` (README: Running on several processes and hosts)")
            if emulate_links:
                raise ValueError("emulate_links: link emulation plays a cluster inside one "
                                 "process; it is not available in a multi-process job")
            # (the backend checks that it covers the cluster, before any work)
            placement = placement or Placement.blocks(cluster.num_devices, world.size)
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
        self._calls = 0  # runtime calls so far; every process must make the same ones
        self._steps = 0  # training steps so far (they name their NVTX ranges)
        if world.distributed:
            # Shown by default: the README ties mpiexec's pids to ranks with this line. Through
            # logging when the user configured it, else straight to stderr.
            if log.hasHandlers():
                log.info("%s", self.backend.dist.describe())
            else:
                # One write (print writes the newline apart; ranks' lines would interleave).
                sys.stderr.write(f"overlap: {self.backend.dist.describe()}\n")
                sys.stderr.flush()
        self._closed = False
        self._sync = _SyncLoop()
        self.plans = PlanCache(cluster)  # each boundary planned once per options
        self._memo: OrderedDict[Any, Any] = OrderedDict()  # step graphs, plan digests
        self._last_trace: tuple[list[Any], StepGraph] | None = None
        self._recovery = Recovery(self.backend)
        # Dropped without close(): end the threads anyway, and say so (as files and event
        # loops do). The callback holds the backend and the loop, never the runtime.
        self._finalizer = weakref.finalize(self, _collected, self.backend, self._sync,
                                           f"{self.backend.name} backend, {cluster.num_devices}"
                                           " devices")
        # Structured concurrency: the first failure anywhere aborts everything in flight.
        backend = self.backend  # (not self: the backend must not keep the runtime alive)
        backend.on_failure = lambda exc: backend.abort_reason is None and backend.abort(
            f"{type(exc).__name__} on another stream: {exc}"
        )  # (the first failure's reason: the others follow from it)

    # ---- resharding ----------------------------------------------------------------------

    async def reshard(self, plan: ReshardPlan, shards: Mapping[int, np.ndarray], *,
                      out: Mapping[int, np.ndarray] | None = None,
                      stream: str = "comm") -> dict[int, np.ndarray]:
        """Move a tensor from ``plan.src`` to ``plan.dst`` layout.

        ``shards[d]`` is source device d's region of the tensor (every source device, its
        exact region shape, the plan's dtype — checked before anything starts). Returns
        destination device -> its region: new arrays, or the arrays of ``out`` (destination
        device -> an array of its region's shape and the plan's dtype, not overlapping any
        shard), which a loop that reshards every step passes to skip allocating them.
        """
        self._check_open()
        self._serve_links()
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
        graph = self._cached(("reshard", plan, stream),
                             lambda: plan.check() or reshard_graph(plan, stream))
        await self._recovery.ready()
        if self.world.distributed:
            digest, members = self._cached(("digest", plan), lambda: self._plan_check(plan))
            check = self._agree(digest, "reshard: the plan", members)
        else:
            check = None
        base, self._reshards = self._reshards * len(plan.transfers), self._reshards + 1
        # Each destination buffer is made on first use, by its device's stream (its memory).
        outs = BufferTable(lambda d: xp.empty(region_shape(regions[d]), dtype))
        if out is not None:
            outs.update(out)
        await self._gather(lambda: launch_reshard(self.backend, plan, shards, outs,
                                                  stream=stream, tag_base=base, graph=graph,
                                                  regions=(src, regions)),
                           what="reshard", check=check, graph=graph)
        # Devices that got nothing: empty regions. In a multi-process job, this process's.
        return {d: outs[d] for d in regions if self.backend.is_local(d)}

    def reshard_sync(self, plan: ReshardPlan, shards: Mapping[int, np.ndarray], *,
                     out: Mapping[int, np.ndarray] | None = None) -> dict[int, np.ndarray]:
        """:meth:`reshard` for synchronous callers (not from inside a running event loop)."""
        return self.run_sync(self.reshard(plan, shards, out=out), "reshard_sync")

    def run_sync(self, coro: Coroutine[Any, Any, T], what: str = "run_sync") -> T:
        """Run ``coro`` (a call of this runtime's async API, or code awaiting one) on the event
        loop the ``*_sync`` methods keep between calls; ``what`` names the caller in errors."""
        try:
            self._check_open()  # before a loop is made for a call that cannot run
        except BaseException:
            coro.close()
            raise
        return self._sync.run(coro, what)

    # ---- pipeline training ---------------------------------------------------------------

    async def train_step(
        self,
        stages: Sequence[Stage],
        boundaries: Sequence[Boundary],
        microbatches: Sequence[np.ndarray],
        *,
        input_sharding: Sharding,
        schedule: str | Schedule | None = None,
        options: PlanOptions | None = None,
        graph: StepGraph | None = None,
        max_activations: int | Sequence[int] | None = None,
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
        ``schedule`` and ``options``.
        """
        self._check_open()
        self._serve_links()
        check_pipeline(stages, boundaries, input_sharding, microbatches, self._array_types())
        if max_activations is not None and schedule != "auto":
            raise ValueError("max_activations: only schedule='auto' chooses under a cap; a "
                             "named schedule's peaks are fixed (Schedule.peak_activations)")
        graph, digest = await self._step_graph(stages, boundaries, len(microbatches), schedule,
                                               options, graph, max_activations)
        await self._recovery.ready()
        check = (self._agree(digest, "train_step: the step graph")
                 if self.world.distributed else None)
        self.backend.start_trace()
        state = StepState()
        index = self._steps
        self._steps += 1
        window = self._profile_window
        if window is not None and index == window.start:
            self._profiler(True)
        step_range = range_start(f"step {index}", "step")  # Nsight: one range a step
        try:
            await self._gather(lambda: launch_step(self.backend, graph, stages, boundaries,
                                                   input_sharding, microbatches,
                                                   self.compute_time, state),
                               what="train_step", check=check, graph=graph)
        finally:
            range_end(step_range)
            if window is not None and index == window.stop - 1:
                self._profiler(False)
            self._last_trace = (self.backend.trace or [], graph)
            self.backend.trace = None
        if not self.world.distributed:
            return [float(state.losses[i]) for i in range(len(microbatches))]
        # The last stage's first device computed the losses; every process returns them.
        first = stages[-1].mesh.device_ids[0]
        owner = self.backend.placement.owners[first]
        mine = np.array([float(state.losses[i]) for i in range(len(microbatches))]
                        if owner == self.world.rank else np.zeros(len(microbatches)))
        shared = await self._collective(self.backend.dist.share(mine, owner, "train_step: losses"),
                                        "train_step")
        return [float(v) for v in shared]

    async def _step_graph(self, stages: Sequence[Stage], boundaries: Sequence[Boundary],
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
            check_graph(graph, meshes, tuple(boundaries), num_microbatches)
            key: Any = ("given", id(graph))
        else:
            sched = _schedule(schedule, len(stages), num_microbatches)
            key = ("lowered", meshes, tuple(boundaries), sched, options or PlanOptions())
        chosen = graph.schedule if graph is not None else sched
        check_split(stages, chosen.kinds)  # type: ignore[union-attr]
        hit = self._memo.pop(key, None)
        if hit is None or (graph is not None and hit[0] is not graph):

            def make() -> tuple[StepGraph, bytes]:
                if graph is not None:
                    check_given_graph(graph)
                g = graph if graph is not None else lower(
                    meshes, boundaries, key[3], self.cluster, key[4], cache=self.plans)
                return g, (g.digest() if self.world.distributed else b"")

            hit = await asyncio.to_thread(make)
        self._remember(key, hit)
        return hit

    async def _auto_graph(self, stages: Sequence[Stage], meshes: tuple[DeviceMesh, ...],
                          boundaries: Sequence[Boundary], num_microbatches: int,
                          options: PlanOptions | None,
                          max_activations: int | Sequence[int] | None
                          ) -> tuple[StepGraph, bytes]:
        """``schedule="auto"``: :func:`scheduler.auto_schedule` over the step's stages with
        the runtime's compute costs, chosen once per pipeline, microbatch count and options
        (planned off the event loop, like a lowering), then reused."""
        cap = check_caps(max_activations, len(stages))  # bad caps named before any work
        key = ("auto", meshes, tuple(boundaries), num_microbatches, options or PlanOptions(),
               None if cap is None else tuple(cap))
        hit = self._memo.pop(key, None)
        if hit is None:
            costs = self._auto_costs(stages, meshes)

            def make() -> tuple[StepGraph, bytes]:
                choice = auto_schedule(meshes, boundaries, num_microbatches, self.cluster,
                                       costs, key[4], max_activations=cap, cache=self.plans)
                log.info("schedule 'auto' chose %s (%.3g s simulated)", choice.schedule.name,
                         choice.seconds)
                g = choice.graph
                return g, (g.digest() if self.world.distributed else b"")

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
        if self.world.distributed or self._last_trace is None:
            return None
        if self._last_trace[1].stages != meshes:
            return None
        spans: dict[tuple[int, str], list[float]] = {}
        for sp in self.timeline().spans:
            if sp.stream == "compute":
                spans.setdefault((sp.stage, sp.kind), []).append(sp.end - sp.start)
        table = {key: sum(v) / len(v) for key, v in spans.items()}
        for s in range(len(meshes)):
            if (s, "B") not in table and (s, "I") in table:
                table[(s, "B")] = table[(s, "I")] + table.get((s, "W"), 0.0)
        return table

    def timeline(self) -> Timeline:
        """What the last :meth:`train_step` ran where and when (measured), as a Timeline —
        the simulator's type, with the same op ids, so measured and simulated steps share
        metrics and traces and compare op by op. In a multi-process job: this process's
        devices (each process writes its own trace)."""
        if self._last_trace is None:
            raise OverlapRuntimeError("timeline: no train_step has run yet")
        records, graph = self._last_trace
        sec = self.backend.span_seconds
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

    def write_trace(self, path: str | Path) -> Path:
        """Write the last step's measured timeline as Chrome/Perfetto JSON."""
        return self.timeline().to_chrome_trace(path)

    def train_step_sync(self, *args: Any, **kwargs: Any) -> list[float]:
        """:meth:`train_step` for synchronous callers."""
        return self.run_sync(self.train_step(*args, **kwargs), "train_step_sync")

    # ---- internals -----------------------------------------------------------------------

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

    def _agree(self, digest: bytes, what: str,
               members: tuple[int, ...] | None = None) -> Agreement | None:
        """Check that every process of the call's ``members`` (default: every process) makes
        this call now, with the same ``digest`` (same plan or same step graph): compared on
        every call, with a call counter that every process keeps (member or not), so a
        process that skipped or added a call is named instead of silently matching another
        call's messages.

        Returns the check, for :meth:`_run_call` to post once it has launched the work (the
        check costs a round of messages, not a wait; the work's first data goes ahead of it);
        a mismatch stops the work at once. None where this process has no one to check with
        (it holds none of the call's devices, or all of them)."""
        self._calls += 1
        self.backend.dist.calls = self._calls
        self.backend.dist.busy = True  # (until the call's _gather ends: peers may ask)
        from .guard import report  # (imported here: ``python -m overlap.guard`` runs it)

        doing = f"{what} (call {self._calls})"
        report(doing)
        # The call's 32 bytes: the digest's first 24 (SHA-256 of the plan or graph) and the
        # call number (no second hash: each costs microseconds, every call, on every rank).
        call = digest[:24].ljust(24, b"\0") + self._calls.to_bytes(8, "little")
        return self.backend.dist.agree(call, doing, self._calls, members)

    def _serve_links(self) -> None:
        """The loop of each call — the ``*_sync`` calls' loop, or the caller's own — reads
        this process's host links itself while it runs (one thread woken a message instead
        of two; ``HostLinks.serve``). So a call's transfers move while its loop runs: an
        async caller that blocks its loop meanwhile stalls them, as any asyncio I/O."""
        links = self.backend.dist.links if self.world.distributed else None
        if links is not None:
            links.serve(asyncio.get_running_loop())

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

    async def _collective(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        """One of the runtime's own cross-process messages; failures end the job's work."""
        try:
            return await coro
        except BaseException as exc:
            root = self._root_cause(exc)
            self._fail_distributed(what, root)
            if root is not exc:
                raise root from root.__cause__
            raise

    def _fail_distributed(self, what: str, root: BaseException) -> None:
        dist = self.backend.dist
        if dist.broken is None and not isinstance(root, RankFailed):
            dist.announce_failure(what, root)
        self.backend.abort(f"{what} failed: {root}")

    async def _gather(self, launch: Callable[[], list[Event]], *, what: str,
                      check: Agreement | None = None, graph: StepGraph | None = None) -> None:
        """:meth:`_run_call`; then, in a multi-process job, this process is no longer inside
        a call (peers that wait for it past their timeout ask)."""
        try:
            await self._run_call(launch, what=what, check=check, graph=graph)
        finally:
            if self.world.distributed:
                self.backend.dist.busy = False

    async def _run_call(self, launch: Callable[[], list[Event]], *, what: str,
                        check: Agreement | None = None, graph: StepGraph | None = None) -> None:
        """``launch()`` the call's work, then wait for its end events all at once, watching
        for hung ops (:func:`~overlap.watch.wait_all`), and for the call's agreement
        ``check``, which runs alongside them; on failure, stop everything and recover
        (:class:`~overlap.watch.Recovery`)."""
        epoch = self._recovery.epoch
        try:
            events = launch()
        except BaseException as exc:  # e.g. Ctrl-C half-way: stop what was launched
            interrupted: BaseException | None = None
            if (check is not None and isinstance(exc, Exception)
                    and self.backend.abort_reason is not None):
                # Stopped by another failure (a peer's report, say, of a mismatch this rank
                # would find too as the rows land): the agreement explains it, if it can.
                try:  # (its wait posts the row first)
                    await _agreed(check, None, work_failed=True)
                except BaseException as again:  # (Ctrl-C meanwhile: raised once stopped)
                    interrupted = again
            root = exc if not isinstance(exc, Exception) else self._root_cause(exc)
            if self.world.distributed:
                self._fail_distributed(what, root)
            self._recovery.stop_now(f"{what} interrupted while launching", epoch)
            if interrupted is not None:
                raise interrupted from exc
            if root is not exc:  # (a wait there ended by a peer's failure: that failure)
                raise root from root.__cause__
            raise
        try:
            verdict = self._post_agreement(check, events)
            failed = True
            try:
                await wait_all(self.backend, events, graph)
                self.backend.release_to_caller(events)
                failed = False
            finally:
                if check is not None:
                    await _agreed(check, verdict, failed)
            if check is not None:
                # Every rank's work ended too: a rank whose part finished must not report
                # success while a peer's part failed (it learns of it here, by notice).
                await check.finish()
        except BaseException as exc:
            if check is not None:
                check.abandon()
            cancelled = not isinstance(exc, Exception)
            root = self._root_cause(exc)
            if self.world.distributed:
                if isinstance(root, (CollectiveTimeout, CollectiveAborted)) and not cancelled:
                    root = await self._peer_explanation(root, graph)
                # Tell the other processes; the job cannot continue.
                self._fail_distributed(what, root)
            reason = f"{what} failed: {root}" if not cancelled else f"{what} cancelled"
            hang = await self._recovery.settle(reason, graph, epoch, cancelled=cancelled)
            if hang is not None and isinstance(root, (CollectiveAborted, CollectiveTimeout,
                                                      RankFailed)):
                root = hang  # an op here that never finished explains what waited for it
            if root is not exc:
                raise root from root.__cause__
            raise

    def _post_agreement(self, check: Agreement | None, events: list[Event]
                        ) -> asyncio.Future[None] | None:
        """Post the call's agreement row, now that its work is launched — or, over host
        links on a backend whose events end with their work, as the work ends (saying so:
        no end-of-call round where every member's row does), at most ``ROW_WITHIN_S`` from
        now — and its end-of-call row as the work ends if the row went first
        (``Agreement.hurry_after``). Over MPI a task polls the round alongside the work,
        returned; host links compare its rows as the last one lands (nothing runs
        meanwhile: None)."""
        if check is None:
            return None
        ended = self.backend.events_end_work
        if not (ended and check.checked_early):
            check.post()
        check.hurry_after(events, ended)
        if check.checked_early:
            check.post_within(asyncio.get_running_loop())
            return None
        return asyncio.ensure_future(check.wait())

    async def _peer_explanation(self, timeout: BaseException, graph: StepGraph | None
                                ) -> BaseException:
        """A timeout waiting for a peer is often the consequence of a stage that hangs, here
        or on that peer — named when it has run ``timeout``, which may be a little after this
        wait gave up: wait briefly (at most 1 s) for the hang here or the peer's report."""
        backend, dist = self.backend, self.backend.dist
        deadline = asyncio.get_running_loop().time() + min(1.0, backend.timeout)
        while not isinstance(dist.broken, RankFailed):
            err = name_hang(backend, graph)
            if err is not None:
                return err
            if asyncio.get_running_loop().time() >= deadline:
                return timeout
            await asyncio.sleep(0.01)
        return dist.broken

    def _root_cause(self, exc: BaseException) -> BaseException:
        """The failure that explains the others: processes that made different calls (which
        makes work fail everywhere, in whatever order); else this process's first failure
        that is not a consequence of another (an abort, a timeout waiting for a peer, a peer
        that failed); else a peer's failure; else the first timeout."""
        failures = self.backend.failures
        for f in (exc, *failures):
            if isinstance(f, CallMismatch):
                return f
        for f in failures:
            if not isinstance(f, (CollectiveAborted, CollectiveTimeout, RankFailed)):
                return f
        for f in (exc, *failures):
            if isinstance(f, RankFailed):
                return f
        return next((f for f in failures if isinstance(f, CollectiveTimeout)), exc)

    def _array_types(self) -> tuple[type, ...]:
        xp = self.backend.xp
        return (np.ndarray,) if xp is np else (np.ndarray, xp.ndarray)

    def _check_open(self) -> None:
        if self._closed:
            raise OverlapRuntimeError("runtime is closed")
        self._recovery.check()
        broken = self.backend.dist.broken if self.backend.dist is not None else None
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
        the stage functions do. Idempotent."""
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
                self.backend.dist.close(error, handled)
            _shut_down(self.backend, self._sync)

    async def aclose(self) -> None:
        """:meth:`close`, off the event loop."""
        await asyncio.to_thread(self._close, None, sys.exc_info()[1] is None)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, tp: object, error: BaseException | None, tb: object) -> None:
        self._close(error, handled=error is None)

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(self, tp: object, error: BaseException | None, tb: object) -> None:
        await asyncio.to_thread(self._close, error, error is None)
