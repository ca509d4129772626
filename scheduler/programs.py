"""The IR: per-device stream programs, the lowering that builds them, and their dry run.

Every device runs streams, as on a GPU: one **compute** stream, and one **comm** stream per
channel it takes part in. A channel is a stage boundary in one direction: ``fwd<s>`` carries
activations from stage ``s`` to ``s + 1``, ``bwd<s>`` their gradients back. A stage in the middle
of the pipeline has four comm streams (activations in and out, gradients in and out), so
receiving the next activation never queues behind sending the last one — as with NCCL, where
each channel gets its own communicator and stream. Instructions:

- ``Compute(stage, microbatch, kind)`` — the stage's F or B on this device (compute stream).
- ``Reshard(id)`` — this device's part of resharding ``id`` (its channel's stream): the
  transfers of its plan that involve the device, in plan order. Each transfer is a collective
  of its devices.
- ``Record(event)`` / ``Wait(event)`` — events are per device, as CUDA events: a stream records
  one after its previous instruction completes; another stream of the same device waits for
  it. Devices synchronize only through collectives.

Lowering places every forward activation's resharding on its channel right after the F that
produces it (the channel waits for that F), and the consumer's compute stream waits only right
before the compute that needs it; gradients likewise, backward. All reshardings follow one
global launch order (a dependency order of the schedule); each device's channel stream takes
the subsequence it is part of, so every participant launches its collectives in the same order.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from .cluster import Cluster
from .errors import ClusterError
from .mesh import DeviceMesh
from .plan import ReshardPlan
from .planner import plan_resharding
from .schedules import Action, Schedule, dependency_order
from .sharding import Sharding
from .tasks import check_dtype


class ProgramError(ValueError):
    """Programs that deadlock or break a data dependency (raised by :func:`validate`)."""


# ---- instructions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Compute:
    stage: int
    microbatch: int
    kind: Literal["F", "B"]

    def __str__(self) -> str:
        return f"{self.kind} s{self.stage} mb{self.microbatch}"


@dataclass(frozen=True)
class Reshard:
    id: int

    def __str__(self) -> str:
        return f"reshard #{self.id}"


@dataclass(frozen=True)
class Record:
    event: str

    def __str__(self) -> str:
        return f"record {self.event}"


@dataclass(frozen=True)
class Wait:
    event: str

    def __str__(self) -> str:
        return f"wait {self.event}"


Instruction = Compute | Reshard | Record | Wait


def _instr_json(ins: Instruction) -> dict[str, Any]:
    if isinstance(ins, Compute):
        return {"op": "compute", "stage": ins.stage, "microbatch": ins.microbatch,
                "kind": ins.kind}
    if isinstance(ins, Reshard):
        return {"op": "reshard", "id": ins.id}
    return {"op": "record" if isinstance(ins, Record) else "wait", "event": ins.event}


def _instr_from_json(d: dict[str, Any]) -> Instruction:
    op = d["op"]
    if op == "compute":
        return Compute(int(d["stage"]), int(d["microbatch"]), d["kind"])
    if op == "reshard":
        return Reshard(int(d["id"]))
    if op == "record":
        return Record(str(d["event"]))
    if op == "wait":
        return Wait(str(d["event"]))
    raise ValueError(f"program JSON: unknown op {op!r}")


# ---- program values --------------------------------------------------------------------------


@dataclass(frozen=True)
class Boundary:
    """The tensor crossing from stage ``s`` to ``s + 1`` (its gradient crosses back)."""

    shape: tuple[int, ...]
    dtype: str
    producer: Sharding  # on stage s's mesh
    consumer: Sharding  # on stage s+1's mesh


@dataclass(frozen=True)
class ReshardOp:
    """One resharding instance: boundary ``s`` (stage s ↔ s+1), a direction, a microbatch."""

    id: int
    boundary: int
    direction: Literal["fwd", "bwd"]
    microbatch: int
    plan_key: str  # key into Programs.plans: "fwd<s>" or "bwd<s>"

    @property
    def src_stage(self) -> int:
        return self.boundary if self.direction == "fwd" else self.boundary + 1

    @property
    def dst_stage(self) -> int:
        return self.boundary + 1 if self.direction == "fwd" else self.boundary

    @property
    def label(self) -> str:
        what = "reshard" if self.direction == "fwd" else "grad"
        return f"{what} s{self.src_stage}→s{self.dst_stage} mb{self.microbatch}"

    @property
    def channel(self) -> str:
        """The comm stream this resharding runs on: ``fwd<boundary>`` or ``bwd<boundary>``."""
        return f"{self.direction}{self.boundary}"


COMPUTE = "compute"


@dataclass(frozen=True)
class DeviceProgram:
    """One device's instruction lists: ``streams["compute"]`` and one per comm channel."""

    device: int
    stage: int
    streams: Mapping[str, tuple[Instruction, ...]]

    @property
    def compute(self) -> tuple[Instruction, ...]:
        return self.streams[COMPUTE]

    @property
    def channels(self) -> tuple[str, ...]:
        """The comm streams, in name order."""
        return tuple(sorted(k for k in self.streams if k != COMPUTE))


@dataclass(frozen=True)
class Programs:
    """Every device's stream programs for one training step, plus what they refer to."""

    schedule: Schedule
    stages: tuple[DeviceMesh, ...]
    plans: dict[str, ReshardPlan]
    reshards: tuple[ReshardOp, ...]  # in the global launch order
    devices: dict[int, DeviceProgram]

    def __post_init__(self) -> None:
        # Lookup tables (derived, not part of the value): reshard by id, stage device sets.
        object.__setattr__(self, "_by_id", {op.id: op for op in self.reshards})
        object.__setattr__(self, "_find", {
            (r.direction, r.boundary, r.microbatch): r for r in self.reshards
        })
        object.__setattr__(self, "_stage_sets", [frozenset(m.device_ids) for m in self.stages])
        object.__setattr__(self, "_recv", {
            key: frozenset(r for t in plan.transfers for r in t.receivers)
            for key, plan in self.plans.items()
        })

    def op(self, reshard_id: int) -> ReshardOp:
        return self._by_id[reshard_id]  # type: ignore[attr-defined]

    def plan_of(self, reshard_id: int) -> ReshardPlan:
        return self.plans[self.op(reshard_id).plan_key]

    def find(self, direction: str, boundary: int, microbatch: int) -> ReshardOp | None:
        """The resharding of ``boundary`` in ``direction`` for ``microbatch``, if any."""
        return self._find.get((direction, boundary, microbatch))  # type: ignore[attr-defined]

    def receivers(self, plan_key: str) -> frozenset[int]:
        """Devices that receive anything in the plan ``plan_key``."""
        return self._recv[plan_key]  # type: ignore[attr-defined]

    def stage_devices(self, stage: int) -> frozenset[int]:
        return self._stage_sets[stage]  # type: ignore[attr-defined]

    def to_text(self) -> str:
        lines = [f"programs for {self.schedule.name}: {self.schedule.num_stages} stages × "
                 f"{self.schedule.num_microbatches} microbatches, {len(self.devices)} devices"]
        for d in sorted(self.devices):
            prog = self.devices[d]
            lines.append(f"device {d} (stage {prog.stage})")
            for stream in (COMPUTE, *prog.channels):
                instrs = prog.streams[stream]
                lines.append(f"  {stream}:")
                for i, ins in enumerate(instrs):
                    extra = f"  ({self.op(ins.id).label})" if isinstance(ins, Reshard) else ""
                    lines.append(f"    {i:3d} {ins}{extra}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({
            "schedule": json.loads(self.schedule.to_json()),
            "stages": [m.to_dict() for m in self.stages],
            "plans": {k: json.loads(p.to_json()) for k, p in self.plans.items()},
            "reshards": [
                {"id": r.id, "boundary": r.boundary, "direction": r.direction,
                 "microbatch": r.microbatch, "plan": r.plan_key}
                for r in self.reshards
            ],
            "devices": {
                str(d): {"stage": p.stage,
                         "streams": {name: [_instr_json(i) for i in instrs]
                                     for name, instrs in p.streams.items()}}
                for d, p in self.devices.items()
            },
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> Programs:
        data = json.loads(text)
        return cls(
            schedule=Schedule.from_json(json.dumps(data["schedule"])),
            stages=tuple(DeviceMesh.from_dict(m) for m in data["stages"]),
            plans={k: ReshardPlan.from_json(json.dumps(p)) for k, p in data["plans"].items()},
            reshards=tuple(
                ReshardOp(int(r["id"]), int(r["boundary"]), r["direction"],
                          int(r["microbatch"]), str(r["plan"]))
                for r in data["reshards"]
            ),
            devices={
                int(d): DeviceProgram(
                    int(d), int(p["stage"]),
                    {name: tuple(_instr_from_json(i) for i in instrs)
                     for name, instrs in p["streams"].items()},
                )
                for d, p in data["devices"].items()
            },
        )


# ---- lowering --------------------------------------------------------------------------------


def compute_event(stage: int, action: Action) -> str:
    return f"{action.kind}{stage}:{action.microbatch}"


def reshard_event(reshard_id: int) -> str:
    return f"R{reshard_id}"


def lower(
    stages: Sequence[DeviceMesh],
    boundaries: Sequence[Boundary],
    schedule: Schedule,
    cluster: Cluster,
    *,
    strategy: str = "broadcast",
    balance: str = "auto",
    seed: int = 0,
    budget: int = 200_000,
) -> Programs:
    """Lower a schedule over stage meshes to per-device compute and comm programs.

    ``boundaries[s]`` is the tensor stage ``s`` sends to stage ``s + 1``: its producer sharding
    must be on ``stages[s]`` and its consumer sharding on ``stages[s + 1]``. Gradients travel
    back with the same shape and dtype, from the consumer layout to the producer layout.
    """
    stages = tuple(stages)
    boundaries = tuple(boundaries)
    _check_inputs(stages, boundaries, schedule, cluster)
    p = len(stages)
    plans: dict[str, ReshardPlan] = {}
    for s, b in enumerate(boundaries):
        kw = dict(strategy=strategy, balance=balance, seed=seed, budget=budget)
        plans[f"fwd{s}"] = plan_resharding(b.shape, b.dtype, b.producer, b.consumer, cluster, **kw)
        plans[f"bwd{s}"] = plan_resharding(b.shape, b.dtype, b.consumer, b.producer, cluster, **kw)
    # One global launch order: each resharding right after the compute that produces it, in a
    # dependency order of the schedule.
    reshards: list[ReshardOp] = []
    fwd_id: dict[tuple[int, int], int] = {}
    bwd_id: dict[tuple[int, int], int] = {}
    for s, a in dependency_order(schedule):
        if a.kind == "F" and s < p - 1:
            fwd_id[(s, a.microbatch)] = len(reshards)
            reshards.append(ReshardOp(len(reshards), s, "fwd", a.microbatch, f"fwd{s}"))
        elif a.kind == "B" and s > 0:
            bwd_id[(s - 1, a.microbatch)] = len(reshards)
            reshards.append(ReshardOp(len(reshards), s - 1, "bwd", a.microbatch, f"bwd{s - 1}"))
    roles = {key: _roles(plan) for key, plan in plans.items()}
    stage_devices = [set(mesh.device_ids) for mesh in stages]
    comm: dict[int, dict[str, list[Instruction]]] = {
        d: defaultdict(list) for mesh in stages for d in mesh.device_ids
    }
    for op in reshards:
        senders, receivers, members = roles[op.plan_key]
        kind = "F" if op.direction == "fwd" else "B"
        for d in sorted(members):
            stream = comm[d][op.channel]
            if d in senders and d in stage_devices[op.src_stage]:
                stream.append(Wait(compute_event(op.src_stage, Action(kind, op.microbatch))))
            stream.append(Reshard(op.id))
            if d in receivers:
                stream.append(Record(reshard_event(op.id)))
    devices: dict[int, DeviceProgram] = {}
    for s, mesh in enumerate(stages):
        for d in mesh.device_ids:
            compute: list[Instruction] = []
            for a in schedule.actions[s]:
                i = a.microbatch
                # The input: activation (F, from s-1) or gradient (B, from s+1).
                if a.kind == "F" and s > 0 and d in roles[f"fwd{s - 1}"][1]:
                    compute.append(Wait(reshard_event(fwd_id[(s - 1, i)])))
                if a.kind == "B" and s < p - 1 and d in roles[f"bwd{s}"][1]:
                    compute.append(Wait(reshard_event(bwd_id[(s, i)])))
                compute.append(Compute(s, i, a.kind))
                out_key = f"fwd{s}" if a.kind == "F" else f"bwd{s - 1}"
                if out_key in roles and d in roles[out_key][0]:
                    compute.append(Record(compute_event(s, a)))
            streams = {COMPUTE: tuple(compute)}
            streams.update({ch: tuple(ins) for ch, ins in sorted(comm[d].items())})
            devices[d] = DeviceProgram(d, s, streams)
    return Programs(schedule, stages, plans, tuple(reshards), devices)


def _roles(plan: ReshardPlan) -> tuple[set[int], set[int], set[int]]:
    senders = {t.sender for t in plan.transfers}
    receivers = {r for t in plan.transfers for r in t.receivers}
    return senders, receivers, senders | receivers


def _check_inputs(stages, boundaries, schedule, cluster) -> None:
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule: expected a Schedule, got {type(schedule).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
    if not stages:
        raise ValueError("stages: need at least one stage mesh")
    for s, mesh in enumerate(stages):
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"stages[{s}]: expected a DeviceMesh, got {type(mesh).__name__}")
        for dev in mesh.device_ids:
            if dev >= cluster.num_devices:
                raise ClusterError(
                    f"stages[{s}]: device {dev} is outside the cluster "
                    f"(devices 0..{cluster.num_devices - 1})"
                )
    if schedule.num_stages != len(stages):
        raise ValueError(
            f"schedule: built for {schedule.num_stages} stages, but {len(stages)} stage meshes "
            "were given"
        )
    if len(boundaries) != len(stages) - 1:
        raise ValueError(
            f"boundaries: {len(stages)} stages need {len(stages) - 1} boundaries, "
            f"got {len(boundaries)}"
        )
    owner: dict[int, int] = {}
    for s, mesh in enumerate(stages):
        for dev in mesh.device_ids:
            if dev in owner:
                raise ValueError(
                    f"stages: device {dev} is in stage {owner[dev]} and stage {s}; "
                    "stage meshes must be disjoint (one compute stream per device)"
                )
            owner[dev] = s
    for s, b in enumerate(boundaries):
        if not isinstance(b, Boundary):
            raise TypeError(f"boundaries[{s}]: expected a Boundary, got {type(b).__name__}")
        check_dtype(b.dtype)
        if b.producer.mesh != stages[s]:
            raise ValueError(
                f"boundaries[{s}].producer: its mesh {b.producer.mesh!r} is not stage {s}'s "
                f"mesh {stages[s]!r}"
            )
        if b.consumer.mesh != stages[s + 1]:
            raise ValueError(
                f"boundaries[{s}].consumer: its mesh {b.consumer.mesh!r} is not stage "
                f"{s + 1}'s mesh {stages[s + 1]!r}"
            )


# ---- dry run / validator ---------------------------------------------------------------------


class Step(NamedTuple):
    """One executed instruction of the dry run (for a reshard: one of its transfers)."""

    device: int
    stream: str  # "compute" or a comm channel
    index: int  # instruction index in that stream
    transfer: int | None = None  # plan transfer index, for Reshard steps (one per transfer)


def validate(programs: Programs) -> list[Step]:
    """Run every device's programs together, instantly; return the order things ran in.

    Semantics are the runtime's: streams are FIFO; ``Wait`` blocks until the same device has
    recorded the event; each transfer of a resharding runs once all its devices reach it.
    Also checks data dependencies (a compute after its input arrived; a sender after the
    compute producing what it sends). Raises :class:`ProgramError` naming the devices,
    instructions and what they wait on, on deadlock or violation.
    """
    return [Step(*t) for t in dry_run(programs)]


def dry_run(programs: Programs) -> list[tuple[int, str, int, int | None]]:
    """:func:`validate`'s work, returning plain ``(device, stream, index, transfer)`` tuples.

    The simulator runs it on hundreds of thousands of instructions; tuples keep it lean.
    """
    devs = programs.devices
    pos = {(d, st): 0 for d in devs for st in devs[d].streams}
    sub: dict[tuple[int, str], int] = defaultdict(int)  # next transfer within current Reshard
    recorded: dict[int, set[str]] = defaultdict(set)
    waiting_event: dict[tuple[int, str], list[tuple[int, str]]] = defaultdict(list)
    arrived: dict[tuple[int, int], set[int]] = defaultdict(set)  # (reshard, k) -> devices
    my_transfers: dict[tuple[int, str], list[int]] = {}
    computed: dict[int, set[tuple[int, int, str]]] = defaultdict(set)
    reshard_done: dict[int, set[int]] = defaultdict(set)  # device -> completed reshard ids
    order: list[tuple[int, str, int, int | None]] = []
    work = deque((d, st) for d in sorted(devs) for st in devs[d].streams)
    plan_devices: dict[str, list[frozenset[int]]] = {
        key: [frozenset(t.devices) for t in plan.transfers] for key, plan in programs.plans.items()
    }
    # Per plan transfer: its devices in order, and its sender if that sender must first have
    # computed what it sends (it is in the producing stage), else None.
    plan_transfers: dict[str, list[tuple[tuple[int, ...], int | None, tuple[int, ...]]]] = {}
    for op in programs.reshards:
        if op.plan_key not in plan_transfers:
            src = programs.stage_devices(op.src_stage)
            plan_transfers[op.plan_key] = [
                (tuple(sorted(set(t.devices))), t.sender if t.sender in src else None, t.after)
                for t in programs.plans[op.plan_key].transfers
            ]
    # Transfer.after: only plans that use it pay for tracking which transfers have run.
    ordered_plans = {key for key, plan in programs.plans.items()
                     if any(t.after for t in plan.transfers)}
    fired: set[tuple[int, int]] = set()
    held: dict[int, list[int]] = defaultdict(list)  # reshard -> transfers waiting on `after`

    def fire(rid: int, k: int, st: str, check: int | None) -> None:
        """Run transfer k of reshard rid: every device moves past it; release what waited."""
        tracked = plan_key_of[rid] in ordered_plans
        if tracked:
            if (rid, k) in fired:
                return
            fired.add((rid, k))
        if check is not None:
            _check_sender_ready(programs, rid, check, computed, fail)
        del arrived[(rid, k)]
        t_devs = plan_transfers[plan_key_of[rid]][k][0]
        for e in t_devs:
            sub[(e, st)] += 1
            order.append((e, st, pos[(e, st)], k))
            work.append((e, st))
        if not tracked:
            return
        waiting = held.pop(rid, [])
        for j in waiting:
            if all((rid, x) in fired for x in plan_transfers[plan_key_of[rid]][j][2]):
                fire(rid, j, st, plan_transfers[plan_key_of[rid]][j][1])
            else:
                held[rid].append(j)
    plan_key_of = {op.id: op.plan_key for op in programs.reshards}
    input_of: dict[tuple[int, int, str], ReshardOp | None] = {}
    p = programs.schedule.num_stages

    def transfers_of(d: int, rid: int) -> list[int]:
        key_plan = plan_key_of[rid]
        key = (d, key_plan)
        if key not in my_transfers:
            my_transfers[key] = [k for k, devs in enumerate(plan_devices[key_plan]) if d in devs]
        return my_transfers[key]

    def fail(msg: str) -> None:
        raise ProgramError(msg)

    while work:
        d, st = work.popleft()
        instrs = devs[d].streams[st]
        i = pos[(d, st)]
        while i < len(instrs):
            ins = instrs[i]
            kind = type(ins)
            if kind is Wait:
                if ins.event not in recorded[d]:
                    waiting_event[(d, ins.event)].append((d, st))
                    break
            elif kind is Record:
                recorded[d].add(ins.event)
                for w in waiting_event.pop((d, ins.event), ()):
                    work.append(w)
            elif kind is Compute:
                key3 = (ins.stage, ins.microbatch, ins.kind)
                if key3 not in input_of:
                    input_of[key3] = _input_of(programs, ins, p)
                need = input_of[key3]
                if (need is not None and need.id not in reshard_done[d]
                        and d in programs.receivers(need.plan_key)):
                    fail(f"dependency violation: device {d} runs {ins} before its input "
                         f"({need.label}, #{need.id}) has arrived")
                computed[d].add(key3)
                order.append((d, st, i, None))
            else:  # Reshard
                mine = transfers_of(d, ins.id)
                if sub[(d, st)] < len(mine):
                    k = mine[sub[(d, st)]]
                    got = arrived[(ins.id, k)]
                    got.add(d)
                    t_devs, check, deps = plan_transfers[plan_key_of[ins.id]][k]
                    pos[(d, st)] = i
                    if len(got) < len(t_devs):
                        break
                    if any((ins.id, j) not in fired for j in deps):
                        # Everyone is here, but the plan orders it after a transfer that has
                        # not run yet (Transfer.after): it runs when that one does.
                        if k not in held[ins.id]:
                            held[ins.id].append(k)
                        break
                    fire(ins.id, k, st, check)
                    if sub[(d, st)] < len(mine):
                        continue
                sub[(d, st)] = 0
                reshard_done[d].add(ins.id)
            i += 1
        pos[(d, st)] = i
    stuck = [
        (d, st) for d in sorted(devs) for st in devs[d].streams
        if pos[(d, st)] < len(devs[d].streams[st])
    ]
    if stuck:
        raise ProgramError("programs deadlock:\n" + "\n".join(
            _describe_block(programs, d, st, pos[(d, st)], sub[(d, st)], arrived, transfers_of)
            for d, st in stuck
        ))
    return order


def _input_of(programs: Programs, ins: Compute, p: int) -> ReshardOp | None:
    """The resharding that brings a compute its input (None for the pipeline's ends)."""
    if ins.kind == "F" and ins.stage > 0:
        return programs.find("fwd", ins.stage - 1, ins.microbatch)
    if ins.kind == "B" and ins.stage < p - 1:
        return programs.find("bwd", ins.stage, ins.microbatch)
    return None


def _check_sender_ready(programs: Programs, rid: int, sender: int, computed, fail) -> None:
    op = programs.op(rid)
    if sender not in programs.stage_devices(op.src_stage):
        return  # forwards data it received earlier in the same plan
    kind = "F" if op.direction == "fwd" else "B"
    if (op.src_stage, op.microbatch, kind) not in computed[sender]:
        fail(f"dependency violation: device {sender} sends for {op.label} (#{rid}) before it "
             f"ran {kind} s{op.src_stage} mb{op.microbatch}")


def _describe_block(programs, d, st, i, k_sub, arrived, transfers_of) -> str:
    prog = programs.devices[d]
    ins = prog.streams[st][i]
    where = f"device {d} {st}[{i}] {ins}"
    if isinstance(ins, Wait):
        return f"{where}: waits for event {ins.event!r}, never recorded on device {d}"
    if isinstance(ins, Reshard):
        k = transfers_of(d, ins.id)[k_sub]
        t = programs.plan_of(ins.id).transfers[k]
        missing = sorted(set(t.devices) - arrived.get((ins.id, k), set()))
        return (f"{where} ({programs.op(ins.id).label}), transfer {k}: waits for device(s) "
                f"{missing} to reach it")
    return where
