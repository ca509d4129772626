"""The step graph: one training step (or one resharding) as typed ops on device streams.

Every device runs streams, as on a GPU: one **compute** stream, and one comm stream per
**channel** it takes part in. A :class:`Channel` is a stage boundary in one direction:
``Channel("fwd", s)`` carries activations from stage ``s`` to ``s + 1``, ``Channel("bwd", s)``
their gradients back; its stream is named ``str(channel)`` (``"fwd0"``), here and nowhere
else. A (device, stream) pair is a :class:`Lane`.

An :class:`Op` is a :class:`Compute` — stage ``s``'s F or B of a microbatch on one
device —, a :class:`TransferOp` — one transfer of a resharding plan, a collective of its
devices, on their lanes of the channel's stream —, or a :class:`GradReduce` — a stage's
parameter gradients all-reduced over one line of its mesh's data-parallel axis, on the
stage's stream ``dp<s>`` once each device of the line ran the stage's last backward of the
step. Dependencies are explicit:

- **stream order**: ``StepGraph.lanes[lane]`` lists the ops of each lane in FIFO order; an op
  with several lanes (a transfer) starts once it heads all of them;
- **events**: ``op.waits`` — :class:`Dep` ``(op, src, dst)``: this op's lane on device
  ``dst`` waits for the end of ``op`` recorded on its lane on device ``src``. A data
  dependency is an event on one device (a compute waits for the transfers that deliver its
  input there; a transfer's sender waits for the compute that produced what it sends);
  a plan's ``Transfer.after`` is one between the two transfers' senders (or on the later
  sender alone, when it took part in the earlier transfer). A transfer on lane k > 0 runs on
  stream ``<stream>.<k>`` of each participant (:func:`lane_stream`).

Op ids are positions in ``ops``; the lowering numbers ops in one global launch order (a
dependency order), so they are stable for the same inputs and name the same op in the
simulator's timeline, the runtime's measured trace and across processes. The validator, the
simulator and every runtime backend execute this one value.

**Text form** (a view; :meth:`StepGraph.to_text`, :meth:`StepGraph.with_text`): one line per
lane, its ops in order; a compute is ``1F0`` (stage 1, F, microbatch 0, as torch's pipelining
actions), a transfer ``fwd0:3#2`` (channel fwd0, microbatch 3, transfer 2 of the plan; ``#2``
alone in a standalone resharding), a gradient reduction ``dp1:4`` (stage 1's, over the line
of its data-parallel axis that starts at device 4); an op's waits on that lane follow ``<``,
comma-separated, ``@d`` marking one recorded on another device::

    d0 compute: 0F0 0F1 0B0<bwd0:0#0 0B1<bwd0:1#0
    d0 fwd0: fwd0:0#0<0F0 fwd0:1#0<0F1
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, NamedTuple

from .errors import load_json
from .mesh import DeviceMesh
from .plan import ReshardPlan, Transfer
from .schedules import Schedule

COMPUTE = "compute"  # the compute stream's name on every device


@dataclass(frozen=True, order=True)
class Channel:
    """A stage boundary in one direction: ``fwd`` carries activations from stage ``boundary``
    to ``boundary + 1``, ``bwd`` their gradients back; ``element``: which tensor of a boundary
    of several. Its stream is named ``str(self)``."""

    direction: Literal["fwd", "bwd"]
    boundary: int
    element: int = 0

    def __post_init__(self) -> None:
        if self.direction not in ("fwd", "bwd"):
            raise ValueError(f"direction: expected 'fwd' or 'bwd', got {self.direction!r}")
        if isinstance(self.boundary, bool) or not isinstance(self.boundary, int) \
                or self.boundary < 0:
            raise ValueError(f"boundary: expected an int >= 0, got {self.boundary!r}")
        if isinstance(self.element, bool) or not isinstance(self.element, int) \
                or self.element < 0:
            raise ValueError(f"element: expected an int >= 0, got {self.element!r}")

    @property
    def src_stage(self) -> int:
        """The stage that sends on this channel."""
        return self.boundary if self.direction == "fwd" else self.boundary + 1

    @property
    def dst_stage(self) -> int:
        """The stage that receives on this channel."""
        return self.boundary + 1 if self.direction == "fwd" else self.boundary

    @property
    def kind(self) -> Literal["F", "B"]:
        """The compute that produces what the channel carries, and consumes it."""
        return "F" if self.direction == "fwd" else "B"

    def __str__(self) -> str:
        tail = f"_{self.element}" if self.element else ""
        return f"{self.direction}{self.boundary}{tail}"

    @classmethod
    def parse(cls, text: str) -> Channel:
        """A channel from its name, ``fwd<boundary>`` or ``bwd<boundary>`` (``_<element>``
        for a boundary's tensor other than its first)."""
        m = re.fullmatch(r"(fwd|bwd)(\d+)(?:_(\d+))?", text.strip())
        if m is None:
            raise ValueError(f"channel: expected fwd<s> or bwd<s> (or fwd<s>_<element>), got "
                             f"{text!r}")
        return cls(m.group(1), int(m.group(2)), int(m.group(3) or 0))  # type: ignore[arg-type]


def input_channel(stage: int, kind: str, p: int) -> Channel | None:
    """The channel bringing a compute its input (None at the pipeline's ends, and for a
    weight gradient W, which works on what its stage kept)."""
    if kind == "F":
        return Channel("fwd", stage - 1) if stage > 0 else None
    if kind == "W":
        return None
    return Channel("bwd", stage) if stage < p - 1 else None


def output_channel(stage: int, kind: str, p: int) -> Channel | None:
    """The channel taking a compute's output on (None at the pipeline's ends, and for W:
    the gradient leaves right after the I that makes it, while W computes)."""
    if kind == "F":
        return Channel("fwd", stage) if stage < p - 1 else None
    if kind == "W":
        return None
    return Channel("bwd", stage - 1) if stage > 0 else None


ChannelSets = dict[tuple[str, int], tuple[Channel, ...]]
"""(direction, boundary) -> its channels, one per tensor (element) crossing it that way."""


def channel_sets(keys: Iterable[object]) -> ChannelSets:
    """The channels of each (direction, boundary) among plan keys (:data:`PlanKey`)."""
    sets: dict[tuple[str, int], set[Channel]] = {}
    for k in keys:
        ch = k[0] if isinstance(k, tuple) else k
        if isinstance(ch, Channel):
            sets.setdefault((ch.direction, ch.boundary), set()).add(ch)
    return {key: tuple(sorted(v)) for key, v in sets.items()}


def inputs_of(stage: int, kind: str, p: int, sets: ChannelSets | None) -> tuple[Channel, ...]:
    """Every channel bringing a compute its input (each tensor of a boundary of several; one
    channel where ``sets`` is None)."""
    ch = input_channel(stage, kind, p)
    if ch is None:
        return ()
    return (ch,) if sets is None else sets.get((ch.direction, ch.boundary), ())


def outputs_of(stage: int, kind: str, p: int, sets: ChannelSets | None) -> tuple[Channel, ...]:
    """Every channel taking a compute's output on (see :func:`inputs_of`)."""
    ch = output_channel(stage, kind, p)
    if ch is None:
        return ()
    return (ch,) if sets is None else sets.get((ch.direction, ch.boundary), ())


def buffers_used(body: Compute | TransferOp | GradReduce, p: int,
                 sets: ChannelSets | None = None) -> tuple[tuple[object, int], ...]:
    """The per-device step buffers an op uses on each of its devices, as (what, microbatch):
    ``(channel, i)`` — what the channel brings to or takes from the device for microbatch i —
    and, for a compute of stage s, ``(("saved", s), i)`` — the dict that stage's F and B of i
    share (a device may run several stages). A standalone resharding's transfers (no
    channel) use the caller's buffers: none."""
    if isinstance(body, GradReduce):
        return ()  # (the stage's parameters' gradients: the user's, not the step's)
    if isinstance(body, TransferOp):
        return () if body.channel is None else ((body.channel, body.microbatch),)
    i = body.microbatch
    keys: list[tuple[object, int]] = [(("saved", body.stage), i)]
    keys += [(ch, i) for ch in (*inputs_of(body.stage, body.kind, p, sets),
                                *outputs_of(body.stage, body.kind, p, sets))]
    return tuple(keys)


class Lane(NamedTuple):
    """A stream of a device: ``"compute"`` or a comm stream (a channel's, or a resharding's)."""

    device: int
    stream: str

    def __str__(self) -> str:
        return f"d{self.device} {self.stream}"


@dataclass(frozen=True, slots=True)
class Compute:
    """Stage ``stage``'s forward (F) or backward (B) of ``microbatch``, on one device."""

    stage: int
    microbatch: int
    kind: Literal["F", "B"]

    @property
    def token(self) -> str:
        """Its cell in :meth:`StepGraph.to_text`: stage, kind, microbatch (``0F3``)."""
        return f"{self.stage}{self.kind}{self.microbatch}"

    def __str__(self) -> str:
        return f"{self.kind} s{self.stage} mb{self.microbatch}"


@dataclass(frozen=True, slots=True)
class TransferOp:
    """Transfer ``index`` of a plan — region, sender, receivers, bytes: ``transfer`` — for
    ``microbatch`` on ``channel`` (None: a standalone resharding)."""

    channel: Channel | None
    microbatch: int
    index: int
    transfer: Transfer

    @property
    def token(self) -> str:
        """Its cell in :meth:`StepGraph.to_text`: ``channel:microbatch#index`` (``#index``
        for a transfer on no channel)."""
        if self.channel is None:
            return f"#{self.index}"
        return f"{self.channel}:{self.microbatch}#{self.index}"

    def __str__(self) -> str:
        ch = self.channel
        if ch is None:
            return f"reshard #{self.index}"
        what = "reshard" if ch.direction == "fwd" else "grad"
        return f"{what} s{ch.src_stage}→s{ch.dst_stage} mb{self.microbatch} #{self.index}"


@dataclass(frozen=True, slots=True)
class DataParallel:
    """A stage whose mesh axis ``axis`` splits each microbatch's batch: every line of devices
    along it holds replicas whose parameter gradients — ``nbytes`` per device — are summed
    (and averaged) over the line once the step's backward of the stage is done there."""

    axis: str
    nbytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or not self.axis:
            raise TypeError(f"DataParallel axis: expected a mesh axis name, got {self.axis!r}")
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) \
                or self.nbytes < 0:
            raise ValueError(f"DataParallel nbytes: expected an int >= 0 (the gradients' bytes "
                             f"per device), got {self.nbytes!r}")


@dataclass(frozen=True, slots=True)
class GradReduce:
    """Stage ``stage``'s parameter gradients all-reduced over ``group`` — one line of its
    mesh along the data-parallel axis, in the axis's order — ``nbytes`` per device, on the
    stage's stream ``dp<stage>``."""

    stage: int
    group: tuple[int, ...]
    nbytes: int

    @property
    def token(self) -> str:
        """Its cell in :meth:`StepGraph.to_text`: ``dp<stage>:<first device of the line>``."""
        return f"dp{self.stage}:{self.group[0]}"

    @property
    def microbatch(self) -> int:
        """-1: a gradient reduction belongs to the whole step, no microbatch."""
        return -1

    def __str__(self) -> str:
        return f"dp all-reduce s{self.stage} over {list(self.group)}"


def dp_stream(stage: int) -> str:
    """The stream a stage's gradient reductions run on, on each device of its mesh."""
    return f"dp{stage}"


class Dep(NamedTuple):
    """This op's lane on device ``dst`` waits for the end of op ``op``, recorded on that op's
    lane on device ``src`` (the same device for a data dependency: events are per device)."""

    op: int
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class Op:
    """One operation: ``body`` on the ``stream`` of each of ``devices``, after ``waits``."""

    id: int
    body: Compute | TransferOp | GradReduce
    stream: str
    devices: tuple[int, ...]
    waits: tuple[Dep, ...] = ()

    @property
    def lanes(self) -> tuple[Lane, ...]:
        """The (device, stream) lanes the op runs on."""
        return tuple(Lane(d, self.stream) for d in self.devices)

    @property
    def key(self) -> str:
        """The op's name in the text form: its token, ``@device`` for a compute."""
        b = self.body  # (no token parsing here: keys are made for every op of a graph)
        return _compute_key(b.token, self.devices[0]) if isinstance(b, Compute) else b.token

    def __str__(self) -> str:
        return str(self.body)


# A pipeline channel's plan (every microbatch's), one microbatch's plan of a channel (a step
# whose boundaries differ by microbatch), or None: a standalone resharding's.
PlanKey = Channel | tuple[Channel, int] | None


def plan_for(plans: Mapping[PlanKey, ReshardPlan], channel: Channel | None,
             microbatch: int) -> ReshardPlan:
    """The plan moving ``microbatch`` on ``channel``: its own, else the channel's."""
    plan = plans.get((channel, microbatch)) if channel is not None else None
    return plan if plan is not None else plans[channel]


def _plan_key_text(k: PlanKey) -> str:
    if k is None:
        return ""
    return f"{k[0]}:{k[1]}" if isinstance(k, tuple) else str(k)


def _plan_key_of(text: str) -> PlanKey:
    if text == "":
        return None
    head, sep, mb = text.partition(":")
    if not sep:
        return Channel.parse(text)
    if not mb.isdigit():
        raise ValueError(f"plans: bad key {text!r} (a channel, or channel:microbatch)")
    return (Channel.parse(head), int(mb))


@dataclass(frozen=True)
class StepGraph:
    """Typed ops on lanes with explicit dependencies (see module doc).

    ``stages`` are the pipeline's stage meshes (empty for a standalone resharding),
    ``schedule`` the schedule it was lowered from (None for a resharding), ``plans`` the
    resharding plan of each channel (key None: the standalone resharding's),
    ``data_parallel`` the stages whose gradients are reduced over a mesh axis (their
    :class:`GradReduce` ops)."""

    ops: tuple[Op, ...]
    lanes: Mapping[Lane, tuple[int, ...]]
    stages: tuple[DeviceMesh, ...] = ()
    schedule: Schedule | None = None
    plans: Mapping[PlanKey, ReshardPlan] = field(default_factory=dict)
    data_parallel: Mapping[int, DataParallel] = field(default_factory=dict)

    # ---- derived tables -------------------------------------------------------------------

    successors: tuple[tuple[list[int], ...], list[int]] = field(
        init=False, repr=False, compare=False)
    """``(succ, need)``: the ops each op's end releases — its next op on each of its lanes and
    the ops that wait for it — and how many releases each op needs before it starts. Every
    consumer's dependency counting starts from these (built with the graph; read-only)."""
    data_inputs: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    """Compute op -> the transfer ops it waits for (what moves its input): the edges along
    which timelines measure exposed communication."""

    def __post_init__(self) -> None:
        n = len(self.ops)
        succ: tuple[list[int], ...] = tuple([] for _ in range(n))
        need = [0] * n
        for ids in self.lanes.values():
            for a, b in itertools.pairwise(ids):
                if 0 <= a < n and 0 <= b < n:  # (the validator names bad ids)
                    succ[a].append(b)
                    need[b] += 1
        inputs: dict[int, tuple[int, ...]] = {}
        for k, op in enumerate(self.ops):
            for dep in op.waits:
                if 0 <= dep.op < n:
                    succ[dep.op].append(k)
                    need[k] += 1
            if op.waits and isinstance(op.body, Compute):
                inputs[k] = tuple(d.op for d in op.waits)
        object.__setattr__(self, "successors", (succ, need))
        object.__setattr__(self, "data_inputs", inputs)

    @cached_property
    def labels(self) -> tuple[str, ...]:
        """Each op's body as text (``str(op.body)``), by op id: made once per graph, not at
        every launch of it."""
        return tuple(str(op.body) for op in self.ops)

    @cached_property
    def recorded(self) -> frozenset[tuple[int, int]]:
        """(op, device) pairs whose end another lane waits for: where events are recorded."""
        return frozenset((dep.op, dep.src) for op in self.ops for dep in op.waits)

    @cached_property
    def buffer_users(self) -> dict[tuple[object, int, int], int]:
        """How many (op, device) parts use each per-device buffer of a step, by
        :func:`buffers_used` key and device — so a runtime frees each as soon as its last user
        is done instead of holding every microbatch's boundaries until the step ends."""
        p = len(self.stages)
        users: dict[tuple[object, int, int], int] = {}
        sets = self.channel_sets
        for op in self.ops:
            for key in buffers_used(op.body, p, sets):
                for d in op.devices:
                    users[(*key, d)] = users.get((*key, d), 0) + 1
        return users

    @cached_property
    def channel_sets(self) -> ChannelSets:
        """Each (direction, boundary)'s channels: one per tensor crossing it that way."""
        return channel_sets(self.plans)

    @cached_property
    def comm_streams(self) -> dict[Channel | None, tuple[str, ...]]:
        """Per plan (a channel, or None: a standalone resharding's) the comm streams its
        transfers run on — its own and one per lane above 0 — sorted: a runtime declares a
        communicator for each, in this one order on every process."""
        streams: dict[Channel | None, set[str]] = {}
        for op in self.ops:
            if isinstance(op.body, TransferOp):
                streams.setdefault(op.body.channel, set()).add(op.stream)
        return {k: tuple(sorted(v)) for k, v in streams.items()}

    @cached_property
    def by_key(self) -> dict[str, int]:
        """Op id by :attr:`Op.key`."""
        return {op.key: op.id for op in self.ops}

    def plan_for(self, channel: Channel | None, microbatch: int) -> ReshardPlan:
        """The plan moving ``microbatch`` on ``channel`` (see :data:`PlanKey`)."""
        return plan_for(self.plans, channel, microbatch)

    def stage_of(self, device: int) -> int:
        """The (first) stage whose mesh holds ``device``; -1 outside every stage."""
        table = self._stage_table
        return table.get(device, -1)

    @cached_property
    def _stage_table(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for s, mesh in enumerate(self.stages):
            for d in mesh.device_ids:
                out.setdefault(d, s)
        return out

    @property
    def devices(self) -> tuple[int, ...]:
        """The devices the graph runs on."""
        return tuple(sorted({lane.device for lane in self.lanes}))

    def program(self, device: int) -> dict[str, tuple[int, ...]]:
        """The device's streams: compute first, then its comm streams by name."""
        mine = {lane.stream: ids for lane, ids in self.lanes.items() if lane.device == device}
        return dict(sorted(mine.items(), key=lambda kv: (kv[0] != COMPUTE, kv[0])))

    # ---- text form -----------------------------------------------------------------------

    def to_text(self) -> str:
        """One line per lane (devices in order, compute first): see module doc."""
        lines = []
        for d in self.devices:
            for stream, ids in self.program(d).items():
                lines.append(f"d{d} {stream}: " + " ".join(self._token(i, d) for i in ids))
        return "\n".join(lines)

    def _token(self, i: int, device: int) -> str:
        op = self.ops[i]
        waits = [dep for dep in op.waits if dep.dst == device]
        if not waits:
            return op.body.token
        return op.body.token + "<" + ",".join(
            self.ops[dep.op].body.token + ("" if dep.src == device else f"@{dep.src}")
            for dep in waits)

    def with_text(self, text: str) -> StepGraph:
        """This graph with the lane orders and waits of ``text`` (:meth:`to_text`'s form,
        perhaps edited): the ops are this graph's, named by their tokens. Raises ValueError
        naming the line for an unknown op or a malformed entry."""
        lanes: dict[Lane, tuple[int, ...]] = {}
        waits: dict[int, list[Dep]] = {op.id: [] for op in self.ops}
        for n, line in enumerate(text.strip().splitlines(), 1):
            lane, entries = _parse_line(line, n)
            ids = []
            for token, deps in entries:
                i = self._lookup(token, lane.device, line, n)
                ids.append(i)
                for dep_token, src in deps:
                    src = lane.device if src is None else src
                    waits[i].append(Dep(self._lookup(dep_token, src, line, n), src,
                                        lane.device))
            lanes[lane] = tuple(ids)
        ops = tuple(Op(op.id, op.body, op.stream, op.devices, tuple(waits[op.id]))
                    for op in self.ops)
        return StepGraph(ops, lanes, self.stages, self.schedule, self.plans, self.data_parallel)

    def _lookup(self, token: str, device: int, line: str, n: int) -> int:
        i = self.by_key.get(op_key(token, device))
        if i is None:
            raise ValueError(f"text: line {n} ({line.strip()!r}) names {token!r}, which is "
                             f"not an op of this graph on device {device}")
        return i

    # ---- JSON and digest -----------------------------------------------------------------

    def to_json(self) -> str:
        """Everything: schedule, stage meshes, plans, ops in id order (their keys) and the
        text form. :meth:`from_json` rebuilds an equal graph."""
        return json.dumps({
            "schedule": None if self.schedule is None else json.loads(self.schedule.to_json()),
            "stages": [m.to_dict() for m in self.stages],
            "plans": {_plan_key_text(k): json.loads(p.to_json())
                      for k, p in self.plans.items()},
            "streams": {op.key: op.stream for op in self.ops if isinstance(op.body, TransferOp)},
            "data_parallel": {str(s): [dp.axis, dp.nbytes]
                              for s, dp in sorted(self.data_parallel.items())},
            "ops": [op.key for op in self.ops],
            "text": self.to_text(),
        })

    @classmethod
    def from_json(cls, text: str | bytes) -> StepGraph:
        """A graph from :meth:`to_json`'s text; ValueError naming what is wrong (validate it before
        running)."""
        return load_json(text, "step graph JSON", cls._from_data)

    @classmethod
    def _from_data(cls, data: dict) -> StepGraph:
        plans: dict[PlanKey, ReshardPlan] = {
            _plan_key_of(k): ReshardPlan.from_json(json.dumps(p))
            for k, p in data["plans"].items()
        }
        stages = tuple(DeviceMesh.from_dict(m) for m in data["stages"])
        dp = {int(s): DataParallel(axis, nbytes)
              for s, (axis, nbytes) in data.get("data_parallel", {}).items()}
        ops = tuple(_op_from_key(i, key, plans, data["streams"], stages, dp)
                    for i, key in enumerate(data["ops"]))
        bare = cls(ops, {}, stages, None if data["schedule"] is None
                   else Schedule.from_json(json.dumps(data["schedule"])), plans, dp)
        return bare.with_text(data["text"])

    def digest(self) -> bytes:
        """SHA-256 of :meth:`to_json`: equal graphs, equal digests (the runtime compares it
        across processes)."""
        return hashlib.sha256(self.to_json().encode()).digest()

    def __str__(self) -> str:
        what = ("a resharding" if self.schedule is None else
                f"{self.schedule.name}: {self.schedule.num_stages} stages × "
                f"{self.schedule.num_microbatches} microbatches")
        return f"step graph of {what}, {len(self.devices)} devices, {len(self.ops)} ops"


# ---- text parsing ------------------------------------------------------------------------

_COMPUTE_TOKEN = re.compile(r"\d+[FBIW]\d+")
_TRANSFER_TOKEN = re.compile(r"((fwd|bwd)\d+(_\d+)?:\d+)?#\d+")
_REDUCE_TOKEN = re.compile(r"dp(\d+):(\d+)")


def _is_op_token(token: str) -> bool:
    return bool(_is_compute(token) or _TRANSFER_TOKEN.fullmatch(token)
                or _REDUCE_TOKEN.fullmatch(token))


def _is_compute(token: str) -> bool:
    return _COMPUTE_TOKEN.fullmatch(token) is not None


def _compute_key(token: str, device: int) -> str:
    return f"{token}@{device}"


def op_key(token: str, device: int) -> str:
    """An op's key (:attr:`Op.key`, :attr:`StepGraph.by_key`) from its token and a device it
    runs on: a compute (one per device) is named with its device, a transfer by its token."""
    return _compute_key(token, device) if _is_compute(token) else token


def _parse_line(line: str, n: int) -> tuple[Lane, list[tuple[str, list[tuple[str, int | None]]]]]:
    """``d<device> <stream>: entry ...`` -> the lane and its (token, [(dep token, src)])."""
    head, sep, body = line.partition(":")
    m = re.fullmatch(r"\s*d(\d+)\s+(\S+)\s*", head)
    if not sep or m is None:
        raise ValueError(f"text: line {n} should start with 'd<device> <stream>:', got {line!r}")
    entries = []
    for entry in body.split():
        token, _, deps = entry.partition("<")
        parsed = []
        for dep in filter(None, deps.split(",")):
            dep_token, at, src = dep.partition("@")
            if at and not src.isdigit():
                raise ValueError(f"text: line {n}: bad device in {dep!r}")
            parsed.append((dep_token, int(src) if at else None))
        for t in (token, *(d for d, _ in parsed)):
            if not _is_op_token(t):
                raise ValueError(f"text: line {n}: {t!r} is neither a compute (1F0), a "
                                 "transfer (fwd0:3#2) nor a gradient reduction (dp1:4)")
        entries.append((token, parsed))
    return Lane(int(m.group(1)), m.group(2)), entries


def _op_from_key(i: int, key: str, plans: Mapping[PlanKey, ReshardPlan],
                 streams: Mapping[str, str], stages: tuple[DeviceMesh, ...] = (),
                 dp: Mapping[int, DataParallel] | None = None) -> Op:
    m = _REDUCE_TOKEN.fullmatch(key)
    if m is not None:
        s, first = int(m.group(1)), int(m.group(2))
        if dp is None or s not in dp or s >= len(stages) \
                or first not in stages[s].device_ids:
            raise ValueError(f"ops[{i}]: {key!r} names no data-parallel line of the graph")
        group = reduce_line(stages[s], first, dp[s].axis)
        return Op(i, GradReduce(s, group, dp[s].nbytes), dp_stream(s), group)
    token, at, device = key.partition("@")
    if at:
        m = re.fullmatch(r"(\d+)([FBIW])(\d+)", token)
        if m is None:
            raise ValueError(f"ops[{i}]: bad compute key {key!r}")
        body = Compute(int(m.group(1)), int(m.group(3)), m.group(2))  # type: ignore[arg-type]
        return Op(i, body, COMPUTE, (int(device),))
    head, _, index = token.partition("#")
    channel, mb = (None, 0) if not head else (Channel.parse(head.split(":")[0]),
                                              int(head.split(":")[1]))
    t = plan_for(plans, channel, mb).transfers[int(index)]
    return Op(i, TransferOp(channel, mb, int(index), t), streams[key], t.devices)


def transfer_ops(plan: ReshardPlan, channel: Channel | None, microbatch: int, stream: str,
                 first_id: int, ready: Mapping[int, Dep] | None = None) -> list[Op]:
    """The ops of one resharding, ids from ``first_id`` in plan order; ``ready[d]``: what a
    sender ``d`` waits for first (the compute that produced its data); each ``after`` of the
    plan is a wait between the two transfers' senders."""
    ops: list[Op] = []
    for k, t in enumerate(plan.transfers):
        waits: list[Dep] = []
        if ready is not None and t.sender in ready:
            waits.append(ready[t.sender])
        for j in t.after:
            # The sender's own part when it took part (what it forwards landed there), else
            # the earlier transfer's sender (an order between NICs).
            earlier = plan.transfers[j]
            src = t.sender if t.sender in earlier.devices else earlier.sender
            waits.append(Dep(first_id + j, src, t.sender))
        ops.append(Op(first_id + k, TransferOp(channel, microbatch, k, t), lane_stream(stream, t),
                      t.devices, tuple(waits)))
    return ops


def reduce_line(mesh: DeviceMesh, device: int, axis: str) -> tuple[int, ...]:
    """The devices of ``mesh`` that differ from ``device`` only along ``axis``, in the order
    of their index along it: the group of a gradient reduction (and of an axis collective)."""
    ax = mesh.axis_index(axis)
    coords = mesh.coords()
    here = coords[device]
    return tuple(sorted((d for d, c in coords.items()
                         if all(c[k] == here[k] for k in range(len(c)) if k != ax)),
                        key=lambda d: coords[d][ax]))


def reduce_lines(mesh: DeviceMesh, axis: str) -> list[tuple[int, ...]]:
    """Every line of ``mesh`` along ``axis`` (:func:`reduce_line`), by first device's order in
    the mesh; lines of one device are left out (nothing to reduce)."""
    out: dict[tuple[int, ...], None] = {}
    for d in mesh.device_ids:
        line = reduce_line(mesh, d, axis)
        if len(line) > 1:
            out.setdefault(line)
    return list(out)


def lane_stream(stream: str, t: Transfer) -> str:
    """The comm stream transfer ``t`` runs on: ``stream`` itself for lane 0, else
    ``stream.<lane>`` (its own FIFO on every participant, and its own communicator)."""
    return f"{stream}.{t.lane}" if t.lane else stream


def lanes_of(ops: Iterable[Op]) -> dict[Lane, tuple[int, ...]]:
    """Each lane's ops in id order (the lowering's launch order)."""
    lanes: dict[Lane, list[int]] = {}
    for op in ops:
        for d in op.devices:
            lanes.setdefault(Lane(d, op.stream), []).append(op.id)
    return {lane: tuple(ids) for lane, ids in lanes.items()}


def reshard_graph(plan: ReshardPlan, stream: str = "comm") -> StepGraph:
    """The graph of one standalone resharding: its transfers in plan order on ``stream``."""
    if not isinstance(plan, ReshardPlan):
        raise TypeError(f"plan: expected a ReshardPlan, got {type(plan).__name__}")
    if not isinstance(stream, str) or not stream or stream == COMPUTE:
        raise ValueError(f"stream: expected a comm stream name other than {COMPUTE!r}, "
                         f"got {stream!r}")
    if re.fullmatch(r".*\.\d+", stream):
        raise ValueError(f"stream: {stream!r} ends like a lane's stream (<name>.<lane>); "
                         "choose a name without a '.<number>' suffix")
    ops = transfer_ops(plan, None, 0, stream, 0)
    return StepGraph(tuple(ops), lanes_of(ops), plans={None: plan})

