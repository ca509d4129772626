"""Pipeline training steps: user stage functions run by the lowered per-device programs.

The user describes each stage by its mesh and two SPMD functions, called once per device of
the mesh for every microbatch:

- ``forward(ctx, x) -> y``: ``x`` is this device's shard of the stage input (the previous
  stage's output in this stage's input layout; for stage 0, its shard of the microbatch);
  ``y`` is its shard of the output in the boundary's producer layout. The last stage returns
  the microbatch loss (a scalar) instead.
- ``backward(ctx, dy) -> dx``: ``dy`` is this device's shard of the output gradient (``None`` on
  the last stage); returns its shard of the input gradient (ignored on stage 0, may be None).
  Parameter gradients are the user's to accumulate (e.g. in a dict keyed by ``ctx.device``),
  ready for the user's optimizer after the step.

``ctx`` (:class:`StageContext`) names the device, stage, microbatch and mesh, carries
``ctx.saved`` — a dict shared by the F and B of the same (device, microbatch) — and offers mesh
collectives (``ctx.all_reduce``, ``ctx.all_gather``) that run on the device's compute stream.

The runtime lowers the schedule (``scheduler.lower``), launches every device's streams at once
(the host never waits on a device to decide what to launch), and awaits the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduler import (
    Boundary,
    Cluster,
    Compute,
    DeviceMesh,
    Programs,
    Record,
    Reshard,
    Sharding,
    Wait,
    lower,
    make_schedule,
)

from .backends.cpu import CpuBackend, CpuEvent
from .reshard import region_shape, transfer_op

Forward = Callable[["StageContext", np.ndarray], Any]
Backward = Callable[["StageContext", "np.ndarray | None"], "np.ndarray | None"]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its mesh and its SPMD forward and backward functions."""

    mesh: DeviceMesh
    forward: Forward
    backward: Backward


@dataclass(frozen=True)
class StageContext:
    """What a stage function knows about where it runs (see module doc)."""

    device: int
    stage: int
    microbatch: int
    phase: str  # "F" or "B"
    mesh: DeviceMesh
    saved: dict[str, Any]
    _backend: CpuBackend = field(repr=False)

    @property
    def coords(self) -> dict[str, int]:
        """This device's index along each mesh axis."""
        idx = self.mesh.coords()[self.device]
        return dict(zip(self.mesh.axis_names, idx))

    def _group(self, axis: str | None) -> tuple[int, ...]:
        if axis is None:
            return self.mesh.device_ids
        ax = self.mesh.axis_index(axis)
        here = self.mesh.coords()[self.device]
        return tuple(d for d, c in self.mesh.coords().items()
                     if all(c[i] == here[i] for i in range(len(c)) if i != ax))

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
                                 namespace="compute")
        return buf

    def all_gather(self, x: np.ndarray, axis: str | None = None) -> np.ndarray:
        """``x`` of every participant, stacked in device order along a new first axis."""
        group = self._group(axis)
        xp = self.xp
        buf = xp.ascontiguousarray(x)
        out = xp.empty((len(group), *buf.shape), buf.dtype)
        self._backend.all_gather(group, self.device, buf, out,
                                 f"all_gather s{self.stage} mb{self.microbatch} {self.phase}",
                                 namespace="compute")
        return out


@dataclass
class StepState:
    """Buffers of one step: per (reshard id, device) sources and destinations; losses."""

    sends: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    recvs: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    losses: dict[int, Any] = field(default_factory=dict)  # as returned (may live on a GPU)
    saved: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)


def check_pipeline(stages: Sequence[Stage], boundaries: Sequence[Boundary],
                   input_sharding: Sharding, microbatches: Sequence[np.ndarray],
                   array_types: tuple[type, ...] = (np.ndarray,)) -> None:
    if not stages:
        raise ValueError("stages: need at least one stage")
    for s, st in enumerate(stages):
        if not isinstance(st, Stage):
            raise TypeError(f"stages[{s}]: expected a Stage, got {type(st).__name__}")
        if not callable(st.forward) or not callable(st.backward):
            raise TypeError(f"stages[{s}]: forward and backward must be callables")
    if not isinstance(input_sharding, Sharding):
        raise TypeError(f"input_sharding: expected a Sharding, got "
                        f"{type(input_sharding).__name__}")
    if input_sharding.mesh != stages[0].mesh:
        raise ValueError(f"input_sharding: its mesh {input_sharding.mesh!r} is not stage 0's "
                         f"mesh {stages[0].mesh!r}")
    if len(microbatches) < 1:
        raise ValueError("microbatches: need at least one")
    shape0 = np.shape(microbatches[0])
    for i, mb in enumerate(microbatches):
        if not isinstance(mb, array_types):
            raise TypeError(f"microbatches[{i}]: expected a numpy (or, on CUDA, cupy) array, "
                            f"got {type(mb).__name__}")
        if mb.shape != shape0:
            raise ValueError(f"microbatches[{i}]: shape {mb.shape} != microbatches[0] {shape0}")
    input_sharding.device_regions(shape0)  # spec fits the input's rank


def launch_step(
    backend: CpuBackend,
    programs: Programs,
    stages: Sequence[Stage],
    boundaries: Sequence[Boundary],
    input_sharding: Sharding,
    microbatches: Sequence[np.ndarray],
    compute_time: Callable[[int, str], float] | None = None,
) -> tuple[StepState, list[CpuEvent]]:
    """Launch every device's streams for one step; returns the state and the end events.

    ``compute_time(stage, kind)``: seconds each compute must take at least (compute
    emulation: the stream stays busy, as a GPU kernel of that length would keep it).
    """
    state = StepState()
    p = len(stages)
    events: dict[tuple[int, str], CpuEvent] = {}

    def event(d: int, name: str) -> CpuEvent:
        if (d, name) not in events:
            events[(d, name)] = backend.new_event(f"device {d} {name}")
        return events[(d, name)]

    channels = {op.channel: boundaries[op.boundary] for op in programs.reshards}
    for channel, b in channels.items():  # one communicator per channel (CUDA, MPI)
        backend.declare_group(channel, (*b.producer.mesh.device_ids,
                                        *b.consumer.mesh.device_ids))
    # Groups stage collectives may use: every mesh and every mesh axis group of it.
    backend.declare_subgroups("compute", sorted({g for st in stages for g in mesh_groups(st.mesh)}))
    # Transfer k of resharding r is named r * per_plan + k across processes.
    per_plan = max((len(p.transfers) for p in programs.plans.values()), default=1) or 1
    in_regions = input_sharding.device_regions(microbatches[0].shape)
    # Regions of every boundary's layouts, per device.
    prod = [b.producer.device_regions(b.shape) for b in boundaries]
    cons = [b.consumer.device_regions(b.shape) for b in boundaries]
    ends: list[CpuEvent] = []
    for d, prog in programs.devices.items():
        if not backend.is_local(d):
            continue  # another process runs this device's program
        for name, instrs in prog.streams.items():
            stream = backend.stream(d, name)
            for ins in instrs:
                kind = type(ins)
                if kind is Wait:
                    stream.wait_event(event(d, ins.event))
                elif kind is Record:
                    stream.record(event=event(d, ins.event))
                elif kind is Compute:
                    stream.launch(
                        f"{ins} on device {d}",
                        _compute_op(backend, programs, stages, state, d, ins, p,
                                    microbatches, in_regions, prod, cons,
                                    compute_time(ins.stage, ins.kind) if compute_time else 0.0),
                        category="compute",
                        meta=(ins.stage, ins.microbatch, ins.kind, str(ins)),
                    )
                else:
                    _launch_reshard_part(backend, programs, state, stream, d, ins, prod, cons,
                                         per_plan)
            ends.append(stream.record(f"device {d} {name} end"))
    return state, ends


def _compute_op(backend, programs, stages, state, d, ins: Compute, p, microbatches,
                in_regions, prod, cons, min_seconds: float):
    s, i, kind = ins.stage, ins.microbatch, ins.kind
    stage = stages[s]

    def run() -> None:
        start = time.perf_counter()
        try:
            body()
        finally:
            left = start + min_seconds - time.perf_counter()
            if left > 0:
                time.sleep(left)  # emulated device time

    def body() -> None:
        saved = state.saved.setdefault((d, i), {})
        ctx = StageContext(d, s, i, kind, stage.mesh, saved, backend)
        if kind == "F":
            if s == 0:
                # Each device gets its own copy, in its own memory.
                x = backend.xp.array(microbatches[i][tuple(slice(a, b) for a, b in in_regions[d])],
                                     copy=True)
            else:
                x = _received(state, programs.find("fwd", s - 1, i).id, d, cons[s - 1][d],
                              boundaries_dtype(programs, "fwd", s - 1), backend.xp)
            y = stage.forward(ctx, x)
            if s == p - 1:
                if d == stage.mesh.device_ids[0]:
                    state.losses[i] = y  # float() after the step: no device sync here
                return
            _deliver(state, programs, programs.find("fwd", s, i).id, d, y, prod[s][d],
                     f"stage {s} forward (mb {i}, device {d})", backend.xp)
        else:
            dy = None if s == p - 1 else _received(
                state, programs.find("bwd", s, i).id, d, prod[s][d],
                boundaries_dtype(programs, "bwd", s), backend.xp)
            dx = stage.backward(ctx, dy)
            if s > 0:
                _deliver(state, programs, programs.find("bwd", s - 1, i).id, d, dx,
                         cons[s - 1][d], f"stage {s} backward (mb {i}, device {d})", backend.xp)
    return run


def boundaries_dtype(programs: Programs, direction: str, boundary: int) -> np.dtype:
    return np.dtype(programs.plans[f"{direction}{boundary}"].dtype)


def _received(state, rid, d, region, dtype, xp):
    """What device d received (an empty region receives nothing: its buffer is made here)."""
    key = (rid, d)
    if key not in state.recvs:
        state.recvs[key] = xp.empty(region_shape(region), dtype)
    return state.recvs[key]


def _deliver(state, programs, rid, d, value, region, what, xp=np) -> None:
    want = region_shape(region)
    dtype = np.dtype(programs.plan_of(rid).dtype)
    arr = xp.asarray(value)
    if arr.shape != want or arr.dtype != dtype:
        raise ValueError(f"{what} returned {arr.shape} {arr.dtype}; this device's region of "
                         f"the boundary needs {want} {dtype}")
    state.sends[(rid, d)] = arr


def _launch_reshard_part(backend, programs, state, stream, d, ins: Reshard, prod, cons,
                         per_plan: int) -> None:
    op = programs.op(ins.id)
    plan = programs.plans[op.plan_key]
    b = op.boundary
    src_regions = prod[b] if op.direction == "fwd" else cons[b]
    dst_regions = cons[b] if op.direction == "fwd" else prod[b]
    dtype = np.dtype(plan.dtype)
    shards = _Lazy(state.sends, ins.id)
    # Receive buffers are allocated on first use, on the stream's thread (the device's memory).
    outs = _Lazy(state.recvs, ins.id,
                 lambda dev: backend.xp.empty(region_shape(dst_regions[dev]), dtype))
    for k, t in enumerate(plan.transfers):
        if d not in t.devices:
            continue
        stream.launch(
            f"{op.label} transfer {k} on device {d}",
            transfer_op(backend, t.region, t.sender, t.receivers, d, src_regions, dst_regions,
                        shards, outs, dtype, f"{op.label} #{k}", op.channel,
                        op.id * per_plan + k),
            category="comm",
            meta=(op.src_stage, op.microbatch, op.direction, op.label),
        )


class _Lazy(Mapping):
    """device -> buffer of one resharding, read when the transfer runs (after the compute);
    with ``make``, a missing buffer is created on first use."""

    def __init__(self, table: dict[tuple[int, int], np.ndarray], rid: int,
                 make: Callable[[int], Any] | None = None) -> None:
        self.table, self.rid, self.make = table, rid, make

    def __getitem__(self, d: int) -> np.ndarray:
        key = (self.rid, d)
        if key not in self.table and self.make is not None:
            self.table[key] = self.make(d)
        return self.table[key]

    def __iter__(self):
        return (d for (r, d) in self.table if r == self.rid)

    def __len__(self) -> int:
        return sum(1 for _ in self)


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


def make_programs(stages: Sequence[Stage], boundaries: Sequence[Boundary], schedule: str,
                  num_microbatches: int, cluster: Cluster, *, strategy: str,
                  balance: str) -> Programs:
    sched = make_schedule(schedule, len(stages), num_microbatches)
    return lower([st.mesh for st in stages], boundaries, sched, cluster,
                 strategy=strategy, balance=balance)
