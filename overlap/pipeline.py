"""Pipeline training steps: user stage functions run by the lowered per-device programs.

The user describes each stage by its mesh and two SPMD functions, called once per device of
the mesh for every microbatch:

- ``forward(ctx, x) -> y``: ``x`` is this device's shard of the stage input (the previous
  stage's output in this stage's input layout; for stage 0, its shard of the microbatch);
  ``y`` is its shard of the output in the boundary's producer layout. The last stage returns
  the microbatch loss (a scalar) instead.
- ``backward(ctx, dy) -> dx``: ``dy`` is this device's shard of the output gradient (``None`` on
  the last stage); returns its shard of the input gradient (ignored on stage 0, may be None).

Where a boundary carries several tensors (``boundaries[s]`` a tuple of ``Boundary``), the
functions on its two sides take and return tuples with one entry per tensor, in order; a
gradient's entry for a tensor that has no gradient channel (an integer one) is None, and
what a backward returns there is ignored.
  Parameter gradients are the user's to accumulate (e.g. in a dict keyed by ``ctx.device``),
  ready for the user's optimizer after the step.

A stage may split its backward in two, for schedules that run the weight gradient apart
(``zb-h1``'s ``I`` and ``W``): ``Stage(mesh, forward, backward, backward_weight)`` — then
``backward`` computes only the input gradient (keeping in ``ctx.saved`` what the weight
gradient needs) and ``backward_weight(ctx) -> None`` accumulates the parameter gradients. A
full backward ``B`` of such a stage calls one, then the other.

A stage may be **data-parallel** over an axis of its mesh (``Stage(..., data_parallel=
GradSync(axis, nbytes, reduce))``): each line of devices along the axis holds replicas fed
different parts of each microbatch (its input layout splits the batch over the axis), and
once a device has run the stage's last backward of the step, ``reduce(ctx)`` runs there on
the stage's own stream ``dp<s>`` — a :class:`~scheduler.GradReduce` op of the step graph,
overlapping the compute stream and every other stage — to combine the replicas' gradients
with ``ctx.all_reduce(x, axis)`` (through that stream's communicators).

``ctx`` (:class:`StageContext`) names the device, stage, microbatch and mesh, carries
``ctx.saved`` — a dict shared by the F and B of the same (stage, device, microbatch) — and
offers mesh collectives (``ctx.all_reduce``, ``ctx.all_gather``) that run on the device's
compute stream.

The runtime lowers the schedule to its step graph (``scheduler.lower``) and launches every
op of it at once through the one launcher (:mod:`overlap.launch`; the host never waits on a
device to decide what to launch), then awaits the end. Each op is bound here to what it does:
a compute runs the stage function on its device's input and leaves its output where the
transfers of its channel read it; a transfer moves its region from its sender's buffer into
its receivers'.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from scheduler import (
    Boundaries,
    BoundaryGroup,
    Channel,
    ChannelSets,
    Compute,
    DataParallel,
    DeviceMesh,
    GradReduce,
    MicrobatchBoundaries,
    Op,
    Sharding,
    StepGraph,
    buffers_used,
    channels,
    dp_stream,
    elements,
    input_channel,
    is_floating,
    output_channel,
    per_microbatch,
    reduce_line,
    reduce_lines,
    region_shape,
)

from .launch import launch
from .reshard import transfer_op
from .scope import CancelScope
from .waits import sleep

if TYPE_CHECKING:
    from .backends import Backend, Event, OpReport, Route

Forward = Callable[["StageContext", np.ndarray], Any]
Backward = Callable[["StageContext", "np.ndarray | None"], "np.ndarray | None"]


BackwardWeight = Callable[["StageContext"], None]


@dataclass(frozen=True)
class GradSync:
    """A stage data-parallel over mesh axis ``axis`` (see module doc): ``reduce(ctx)`` combines
    one device's parameter gradients — ``nbytes`` of them, what the simulator and ``auto``
    cost — with the other replicas of its line, after the step's last backward there."""

    axis: str
    nbytes: int
    reduce: Callable[[StageContext], None]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its mesh and its SPMD forward and backward functions (and the
    weight-gradient half of a split backward, and a data-parallel stage's gradient
    reduction; see module doc)."""

    mesh: DeviceMesh
    forward: Forward
    backward: Backward
    backward_weight: BackwardWeight | None = None
    data_parallel: GradSync | None = None


@dataclass(frozen=True)
class StageContext:
    """What a stage function knows about where it runs (see module doc)."""

    device: int
    stage: int
    microbatch: int  # (-1 in a gradient reduction: it belongs to the whole step)
    phase: str  # "F", "B", "I", "W", or "R" (a data-parallel stage's gradient reduction)
    mesh: DeviceMesh
    saved: dict[str, Any]
    _backend: Backend = field(repr=False)
    _scope: CancelScope = field(repr=False)
    # The communicators its collectives use: the compute stream's, or the dp stream's.
    _namespace: str = field(default="compute", repr=False)

    @property
    def coords(self) -> dict[str, int]:
        """This device's index along each mesh axis."""
        idx = self.mesh.coords()[self.device]
        return dict(zip(self.mesh.axis_names, idx))

    def _group(self, axis: str | None) -> tuple[int, ...]:
        return self.mesh.device_ids if axis is None else axis_line(self.mesh, self.device, axis)

    @property
    def xp(self) -> Any:
        """The array module of this device's arrays: numpy (CPU backend) or cupy (CUDA)."""
        return self._backend.xp

    @property
    def cuda_stream(self) -> Any:
        """The CUDA stream this op runs on (CUDA backend; None on the CPU). For torch:
        ``torch.cuda.ExternalStream(ctx.cuda_stream.ptr)``, tensors via DLPack."""
        return self._backend.current_stream()

    def all_reduce(self, x: np.ndarray, axis: str | None = None) -> np.ndarray:
        """Sum of ``x`` over the mesh (or one mesh axis); every participant gets it."""
        buf = self.xp.array(x, copy=True)
        self._backend.all_reduce(self._group(axis), self.device, buf,
                                 f"all_reduce s{self.stage} mb{self.microbatch} {self.phase}",
                                 namespace=self._namespace, scope=self._scope)
        return buf

    def all_gather(self, x: np.ndarray, axis: str | None = None) -> np.ndarray:
        """``x`` of every participant, stacked in device order along a new first axis."""
        group = self._group(axis)
        xp = self.xp
        buf = xp.ascontiguousarray(x)
        out = xp.empty((len(group), *buf.shape), buf.dtype)
        self._backend.all_gather(group, self.device, buf, out,
                                 f"all_gather s{self.stage} mb{self.microbatch} {self.phase}",
                                 namespace=self._namespace, scope=self._scope)
        return out


Slot = tuple[Channel, int, int]  # (channel, microbatch, device): one device's boundary buffer


@dataclass
class StepState:
    """Buffers of one step: per (channel, microbatch, device) what a device sends and what
    it receives; the losses; the (stage, device, microbatch) dicts F and B share."""

    sends: dict[Slot, np.ndarray] = field(default_factory=dict)
    recvs: dict[Slot, np.ndarray] = field(default_factory=dict)
    losses: dict[int, Any] = field(default_factory=dict)  # as returned (may live on a GPU)
    saved: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)


def check_pipeline(stages: Sequence[Stage], boundaries: Boundaries,
                   input_sharding: Sharding, microbatches: Sequence[np.ndarray],
                   array_types: tuple[type, ...] = (np.ndarray,)) -> None:
    if not stages:
        raise ValueError("stages: need at least one stage")
    for s, st in enumerate(stages):
        if not isinstance(st, Stage):
            raise TypeError(f"stages[{s}]: expected a Stage, got {type(st).__name__}")
        if not callable(st.forward) or not callable(st.backward):
            raise TypeError(f"stages[{s}]: forward and backward must be callables")
        if st.backward_weight is not None and not callable(st.backward_weight):
            raise TypeError(f"stages[{s}]: backward_weight must be a callable or None")
        dp = st.data_parallel
        if dp is not None:
            if not isinstance(dp, GradSync) or not callable(dp.reduce):
                raise TypeError(f"stages[{s}]: data_parallel must be a GradSync(axis, nbytes, "
                                f"reduce) or None, got {dp!r}")
            DataParallel(dp.axis, dp.nbytes)  # (checks both)
            if dp.axis not in st.mesh.axis_names:
                raise ValueError(f"stages[{s}]: data_parallel axis {dp.axis!r} is not an axis "
                                 f"of its mesh {st.mesh!r}")
    if not isinstance(input_sharding, Sharding):
        raise TypeError(f"input_sharding: expected a Sharding, got "
                        f"{type(input_sharding).__name__}")
    if input_sharding.mesh != stages[0].mesh:
        raise ValueError(f"input_sharding: its mesh {input_sharding.mesh!r} is not stage 0's "
                         f"mesh {stages[0].mesh!r}")
    indexable = hasattr(type(microbatches), "__len__") and hasattr(type(microbatches),
                                                                     "__getitem__")
    if not indexable or isinstance(microbatches, (str, bytes, Mapping)):
        raise TypeError(f"microbatches: expected a sequence (list or tuple) of arrays, got "
                        f"{type(microbatches).__name__}")
    if len(microbatches) < 1:
        raise ValueError("microbatches: need at least one")
    # Shapes may differ by microbatch only where the boundaries do (MicrobatchBoundaries).
    variable = isinstance(boundaries, MicrobatchBoundaries)
    if variable:
        per_microbatch(boundaries, len(microbatches))  # (one row per microbatch)
    shape0 = np.shape(microbatches[0])
    for i, mb in enumerate(microbatches):
        if not isinstance(mb, array_types):
            raise TypeError(f"microbatches[{i}]: expected a numpy (or, on CUDA, cupy) array, "
                            f"got {type(mb).__name__}")
        if mb.shape != shape0 and not variable:
            raise ValueError(f"microbatches[{i}]: shape {mb.shape} != microbatches[0] {shape0} "
                             "(microbatches of different shapes need MicrobatchBoundaries)")
        if mb.ndim != len(shape0):
            raise ValueError(f"microbatches[{i}]: {mb.ndim} dimensions, microbatches[0] has "
                             f"{len(shape0)}")
    for shape in dict.fromkeys(np.shape(mb) for mb in microbatches):
        input_sharding.device_regions(shape)  # spec fits the input (and splits it)


def step_channels(graph: StepGraph, boundaries: Boundaries, stages: Sequence[Stage]
                  ) -> tuple[dict[str, tuple[int, ...]], list[tuple[str, tuple[int, ...]]]]:
    """The communicators a step's collectives use, in one order on every process: one per
    channel stream (a channel's, and one per lane above 0 of its plan) over both stage
    meshes, the groups stage collectives may use (every mesh and every mesh axis line), and
    each data-parallel stage's lines on its ``dp<s>`` stream."""
    chans: dict[str, tuple[int, ...]] = {}
    first = boundaries.per[0] if isinstance(boundaries, MicrobatchBoundaries) else boundaries
    for channel, b, _, _ in channels(first):
        devices = tuple(sorted({*b.producer.mesh.device_ids, *b.consumer.mesh.device_ids}))
        for name in graph.comm_streams.get(channel, (str(channel),)):
            chans[name] = devices
    groups = sorted({g for st in stages for g in mesh_groups(st.mesh)})
    reduced = [(dp_stream(s), tuple(sorted(line))) for s, dp in graph.data_parallel.items()
               for line in reduce_lines(graph.stages[s], dp.axis)]
    return chans, [("compute", g) for g in groups] + sorted(reduced)


def launch_step(
    backend: Backend,
    graph: StepGraph,
    stages: Sequence[Stage],
    boundaries: Boundaries,
    input_sharding: Sharding,
    microbatches: Sequence[np.ndarray],
    *,
    routes: Mapping[tuple[int, int], Route],
    scope: CancelScope,
    report: OpReport | None = None,
    compute_time: Callable[[int, str], float] | None = None,
    state: StepState | None = None,
) -> list[Event]:
    """Launch this process's part of one step of ``graph`` for ``scope``, into ``state``
    (buffers and losses; a new one by default); returns the end events. ``routes``: the
    graph's transfer parts, resolved (``reshard.resolve``); ``report``: the call's
    (:func:`overlap.launch.launch`); ``compute_time(stage, kind)``: seconds each compute
    must take at least (compute emulation: the stream stays busy, as a GPU kernel of that
    length would keep it)."""
    state = StepState() if state is None else state
    binder = _Binder(backend, state, stages,
                     per_microbatch(boundaries, len(microbatches)), microbatches,
                     input_sharding, compute_time, graph.buffer_users, routes, scope,
                     graph.channel_sets)
    return launch(backend, graph, binder, scope, report)


class _Binder:
    """``(op, device) -> callable``: what each op of the step does on each device."""

    def __init__(self, backend: Backend, state: StepState, stages: Sequence[Stage],
                 boundaries: tuple[tuple[BoundaryGroup, ...], ...],
                 microbatches: Sequence[np.ndarray], input_sharding: Sharding,
                 compute_time: Callable[[int, str], float] | None,
                 users: Mapping[tuple[object, int, int], int],
                 routes: Mapping[tuple[int, int], Route], scope: CancelScope,
                 sets: ChannelSets) -> None:
        self.backend, self.state, self.stages = backend, state, stages
        self.sets = sets
        self.routes, self.scope = routes, scope
        self.boundaries, self.microbatches = boundaries, microbatches
        self.compute_time = compute_time
        # Users left of each per-device buffer (StepGraph.buffer_users): at 0 it is dropped.
        self._users = dict(users)
        self._users_lock = threading.Lock()
        # Regions of every boundary's layouts, per device, for each microbatch (each distinct
        # shape's once); buffers per (channel, microbatch).
        regions: dict[Any, Any] = {}

        def of(sharding: Sharding, shape: tuple[int, ...]) -> Any:
            key = (sharding, tuple(shape))
            if key not in regions:
                regions[key] = sharding.device_regions(shape)
            return regions[key]
        # Per microbatch, each channel's (source regions, destination regions, dtype).
        self.moves: list[dict[Channel, tuple[Any, Any, np.dtype]]] = [
            {ch: (of(src, b.shape), of(dst, b.shape), np.dtype(b.dtype))
             for ch, b, src, dst in channels(row)} for row in boundaries]
        self.in_regions = [of(input_sharding, np.shape(mb)) for mb in microbatches]
        self._buffers: dict[tuple[Channel, int], tuple[Any, ...]] = {}
        self._make_lock = threading.Lock()  # a receive buffer is made once (see _Lazy)

    def __call__(self, op: Op, device: int) -> Callable[[], Any]:
        run = self._bind(op, device)
        keys = buffers_used(op.body, len(self.stages), self.sets)

        def then_release() -> Any:
            issued = run()  # (device work left in flight: its buffers stay alive with it)
            self._release(keys, device)
            return issued
        return then_release

    def _release(self, keys: tuple[tuple[object, int], ...], d: int) -> None:
        """An op is done on device d with these buffers (``buffers_used``): each is kept
        until the device has run the op's work, and dropped after its last user — a step
        holds only the microbatches in flight, as its schedule intends, not all of them."""
        state, held = self.state, []
        with self._users_lock:
            for what, i in keys:
                key = (what, i, d)
                self._users[key] -= 1
                last = self._users[key] == 0
                if not isinstance(what, Channel):  # ("saved", stage)
                    if last:
                        held += state.saved.pop((what[1], d, i), {}).values()  # type: ignore[index]
                    continue
                table: dict[Slot, Any]
                for table in (state.sends, state.recvs):  # (key is the slot: channel, i, d)
                    buf = table.pop(key, None) if last else table.get(key)
                    if buf is not None:
                        held.append(buf)
        if held:
            self.backend.hold(*held)

    def _bind(self, op: Op, device: int) -> Callable[[], Any]:
        body = op.body
        if isinstance(body, GradReduce):
            return self._reduce(body, device)
        if isinstance(body, Compute):
            seconds = self.compute_time(body.stage, body.kind) if self.compute_time else 0.0
            return _emulated(self._compute(body, device), seconds, self.scope, str(body))
        channel = body.channel
        assert channel is not None  # a pipeline's transfers all belong to a channel
        src, dst, dtype, shards, outs = self._buffers_of(channel, body.microbatch)
        return transfer_op(self.backend, self.routes[(op.id, device)], body.transfer, src, dst,
                           shards, outs, dtype, op.id, self.scope)

    def _buffers_of(self, channel: Channel, microbatch: int) -> tuple[Any, ...]:
        """What every transfer of one (channel, microbatch) reads and writes — the regions per
        device, the dtype, the senders' buffers and the receivers' (made on first use, on the
        stream's thread: the device's memory) — kept for the step."""
        key = (channel, microbatch)
        buffers = self._buffers.get(key)
        if buffers is None:
            src, dst, dtype = self.moves[microbatch][channel]
            outs = _Lazy(self.state.recvs, key,
                         lambda d: self.backend.xp.empty(region_shape(dst[d]), dtype),
                         self._make_lock)
            # (setdefault: one value even when two threads got here first at once)
            buffers = self._buffers.setdefault(
                key, (src, dst, dtype, _Lazy(self.state.sends, key), outs))
        return buffers

    def _group(self, channel: Channel | None, i: int) -> tuple[Channel, ...] | None:
        """Where a boundary of several tensors is read or written: its channels in this
        direction by element, None for the gradient of one that has none (an integer tensor);
        None altogether for a boundary of one tensor."""
        if channel is None or not isinstance(self.boundaries[i][channel.boundary], tuple):
            return None
        n = len(elements(self.boundaries[i][channel.boundary]))
        have = {ch.element: ch for ch in self.sets.get((channel.direction, channel.boundary),
                                                         ())}
        return tuple(have.get(e) for e in range(n))  # type: ignore[misc]

    def _compute(self, c: Compute, d: int) -> Callable[[], None]:
        s, i = c.stage, c.microbatch
        p = len(self.stages)
        into, out = input_channel(s, c.kind, p), output_channel(s, c.kind, p)
        in_group, out_group = self._group(into, i), self._group(out, i)
        stage, state, xp = self.stages[s], self.state, self.backend.xp
        what = f"stage {s} {PHASES[c.kind]} (mb {i}, device {d})"

        def read(ch: Channel | None) -> Any:
            return None if ch is None else self._buffers_of(ch, i)[4][d]

        def body() -> None:
            ctx = StageContext(d, s, i, c.kind, stage.mesh,
                               state.saved.setdefault((s, d, i), {}), self.backend, self.scope)
            # The input: what the channel brought this device (its buffer is made here when
            # its region is empty: nothing arrives), or stage 0's own copy of the microbatch;
            # a tuple over a boundary of several tensors (None: a gradient it has not).
            x = read(into) if in_group is None else tuple(read(ch) for ch in in_group)
            if c.kind == "F":
                if into is None:  # each device gets its own copy, in its own memory
                    region = self.in_regions[i][d]
                    x = xp.array(self.microbatches[i][tuple(slice(a, z) for a, z in region)],
                                 copy=True)
                y = stage.forward(ctx, x)
            elif c.kind == "W":
                y = stage.backward_weight(ctx)  # type: ignore[misc]  (checked: split stages)
            else:
                y = stage.backward(ctx, x)
                if c.kind == "B" and stage.backward_weight is not None:
                    stage.backward_weight(ctx)
            if out is not None and out_group is None:
                self._deliver(out, i, d, y, what)
            elif out is not None:
                self._deliver_group(out_group, i, d, y, what)
            elif c.kind == "F":
                check_loss(y, what)
                if d == stage.mesh.device_ids[0]:
                    state.losses[i] = y  # float() after the step: no device sync here
        return body

    def _reduce(self, r: GradReduce, d: int) -> Callable[[], None]:
        stage = self.stages[r.stage]
        sync = stage.data_parallel
        assert sync is not None  # (the runtime lowers reductions from the stages' own)

        def body() -> None:
            ctx = StageContext(d, r.stage, -1, "R", stage.mesh, {}, self.backend, self.scope,
                               dp_stream(r.stage))
            sync.reduce(ctx)
        return body

    def _deliver_group(self, group: tuple[Channel | None, ...], i: int, d: int, value: Any,
                       what: str) -> None:
        """A stage function's output across a boundary of several tensors: a tuple (or list)
        with one entry per tensor (a gradient's entry for a tensor that has none — an integer
        one — is ignored)."""
        if not isinstance(value, (tuple, list)) or len(value) != len(group):
            got = f"{len(value)} values" if isinstance(value, (tuple, list)) else \
                type(value).__name__
            raise ValueError(f"{what} returned {got}; this boundary carries {len(group)} "
                             "tensors: return a tuple of as many arrays")
        for ch, v in zip(group, value):
            if ch is not None:
                self._deliver(ch, i, d, v, what)

    def _deliver(self, channel: Channel, i: int, d: int, value: Any, what: str) -> None:
        src, _, dtype, _, _ = self._buffers_of(channel, i)
        want = region_shape(src[d])
        arr = self.backend.xp.asarray(value)
        if arr.shape != want or arr.dtype != dtype:
            raise ValueError(f"{what} returned {arr.shape} {arr.dtype}; this device's region of "
                             f"the boundary needs {want} {dtype}")
        self.state.sends[(channel, i, d)] = arr


PHASES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


def check_split(stages: Sequence[Stage], kinds: frozenset[str]) -> None:
    """A schedule with I/W needs every stage to split its backward."""
    if kinds & {"I", "W"}:
        for s, st in enumerate(stages):
            if st.backward_weight is None:
                raise ValueError(f"stages[{s}]: the schedule splits the backward (I and W), "
                                 "and this stage has no backward_weight (see "
                                 "overlap.pipeline: backward then computes only the input "
                                 "gradient)")


def check_loss(value: Any, what: str) -> None:
    """Raise naming ``what`` (stage, microbatch, device) unless ``value`` is a real scalar: a
    number, or a 0-d or size-1 array of a real dtype (numpy, cupy, torch) — checked where it
    is produced, without reading it (no device sync)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} returned a bool as the loss; the last stage's forward must "
                        "return a real scalar (a number or a 0-d/size-1 array)")
    if isinstance(value, (int, float, np.integer, np.floating)):
        return
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"{what} returned {type(value).__name__} as the loss; the last "
                        "stage's forward must return a real scalar (a number or a 0-d/size-1 "
                        "array)")
    if int(np.prod(tuple(shape), dtype=np.int64)) != 1:
        raise ValueError(f"{what} returned a loss of shape {tuple(shape)}; the last stage's "
                         "forward must return a real scalar (a 0-d or size-1 array)")
    try:
        dt = np.dtype(dtype)
        kind = "f" if is_floating(dt) else dt.kind
    except TypeError:  # another library's dtype (torch.float32, ...): read its name
        name = str(dtype).rsplit(".", 1)[-1]
        kind = "b" if name == "bool" else "c" if name.startswith("complex") else "f"
    if kind not in "iuf":
        raise TypeError(f"{what} returned a loss of dtype {dtype}; the last stage's forward "
                        "must return a real number (integer or floating point)")


def _emulated(fn: Callable[[], None], seconds: float, scope: CancelScope, what: str
              ) -> Callable[[], None]:
    """``fn``, taking at least ``seconds`` (emulated device time: the stream stays busy, as
    a kernel of that length would keep it; a cancelled call ends the wait)."""
    if seconds <= 0:
        return fn

    def run() -> None:
        start = time.perf_counter()
        fn()
        left = start + seconds - time.perf_counter()
        if left > 0:
            sleep(left, scope, what)
    return run


class _Lazy(Mapping):
    """device -> buffer of one (channel, microbatch), read when the transfer runs (after the
    compute); with ``make``, a missing buffer is created on first use — under ``lock``: the
    lanes of a channel are threads of their own, and two of one device may ask first at once
    (a second buffer would lose what landed in the first)."""

    def __init__(self, table: dict[Slot, Any], key: tuple[Channel, int],
                 make: Callable[[int], Any] | None = None,
                 lock: threading.Lock | None = None) -> None:
        self.table, self.key, self.make = table, key, make
        self.lock = lock or threading.Lock()

    def __getitem__(self, d: int) -> Any:
        key = (*self.key, d)
        if key not in self.table and self.make is not None:
            with self.lock:
                if key not in self.table:
                    self.table[key] = self.make(d)
        return self.table[key]

    def __iter__(self):
        return (d for (c, i, d) in self.table if (c, i) == self.key)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def axis_line(mesh: DeviceMesh, device: int, axis: str) -> tuple[int, ...]:
    """The devices of ``mesh`` that differ from ``device`` only along ``axis``, in the order of
    their index along it (``device`` included): the group of an axis collective — the same
    line a data-parallel stage's gradient reduction runs over
    (:func:`scheduler.graph.reduce_line`)."""
    return reduce_line(mesh, device, axis)


def mesh_groups(mesh: DeviceMesh) -> list[tuple[int, ...]]:
    """The device groups ``StageContext`` collectives use on ``mesh``: the whole mesh and, per
    axis, every line of devices along it."""
    groups = {tuple(sorted(mesh.device_ids))}
    coords = mesh.coords()
    for ax in range(len(mesh.axis_names)):
        lines: dict[tuple[int, ...], list[int]] = {}
        for d, c in coords.items():
            lines.setdefault(c[:ax] + c[ax + 1:], []).append(d)
        groups.update(tuple(sorted(g)) for g in lines.values())
    return sorted(groups)
