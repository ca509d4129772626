"""Running a whole-state resharding plan (:class:`~scheduler.StateReshardPlan`): every tensor
of a state dict moved from one layout to another in one call — an RL weight refit, a
checkpoint reshaped from N ranks to M.

The plan runs as ONE step graph (:func:`scheduler.state_graph`): every transfer of every
tensor in the plan's launch order, each one a pack → move → unpack on its devices' comm
streams (:func:`overlap.reshard.transfer_op`, the one-tensor call's own), with each device's
staging window (:func:`scheduler.state_reshard.staging_window`) as event waits — so a device
never has more than the plan's ``bucket_bytes`` staged bytes in flight, and no device waits
for a whole bucket. The call goes through the runtime's one call
path (:meth:`overlap.call.Calls.run`): the gate, the agreement across
processes (a SHA-256 of the plan, among the ranks holding any of its devices), the timeout,
cancellation and one named root cause on failure — exactly as :meth:`Runtime.reshard`.

Inputs: ``shards[name][device]`` — the source shards of the devices THIS process drives
(each process gives only its own; a tensor none of whose source devices is local may be left
out); ``out[name][device]`` optionally gives preallocated destination arrays (any subset of
the tensors). Every bad input is refused, naming the argument, before anything moves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler import Op, Region, StateReshardPlan, StepGraph, region_shape, state_graph

from .backends import OpReport, Route
from .launch import launch
from .reshard import BufferTable, check_outs, check_shards, shards_match, transfer_op
from .runtime_parts import RuntimeParts
from .scope import CancelScope

State = dict[str, dict[int, Any]]  # tensor name -> device -> array


@dataclass(frozen=True)
class StateJob:
    """What a plan asks of every call of one runtime, worked out once: its step graph, each
    op's tensor, each tensor's source and destination regions and dtype, the shapes this
    process must pass, and the agreement's digest and members (multi-process)."""

    plan: StateReshardPlan
    graph: StepGraph
    tensor_of_op: tuple[str, ...]
    index_of_op: tuple[int, ...]
    src: Mapping[str, Mapping[int, Region]]
    dst: Mapping[str, Mapping[int, Region]]
    dtypes: Mapping[str, np.dtype]
    expected: Mapping[str, Mapping[int, tuple[int, ...]]]
    digest: bytes
    members: tuple[int, ...] | None

    @property
    def channels(self) -> dict[str, tuple[int, ...]]:
        """The communicators the call's transfers use: one per comm stream of its graph,
        over every device of the state (both layouts of every tensor)."""
        devices = tuple(sorted({d for t in self.plan.tensors.values()
                                for d in (*t.src.mesh.device_ids, *t.dst.mesh.device_ids)}))
        return {name: devices for name in self.graph.comm_streams.get(None, ())}


def make_job(plan: object, num_devices: int, is_local: Callable[[int], bool],
             ranks_of: Callable[[tuple[int, ...]], Any] | None, stream: str) -> StateJob:
    """The :class:`StateJob` of ``plan`` on a runtime of ``num_devices`` devices; TypeError /
    ValueError / PlanError naming ``plan`` when it is no whole-state plan, is for another
    (larger) cluster, or does not deliver every element once. ``ranks_of``: the ranks owning
    devices (None in one process)."""
    if not isinstance(plan, StateReshardPlan):
        raise TypeError(f"plan: expected a StateReshardPlan (scheduler.plan_state_resharding), "
                        f"got {type(plan).__name__}")
    devices = {d for t in plan.tensors.values()
               for d in (*t.src.mesh.device_ids, *t.dst.mesh.device_ids)}
    top = max(devices, default=-1)
    if top >= num_devices:
        raise ValueError(f"plan: device {top} is outside the runtime's cluster (devices "
                         f"0..{num_devices - 1}): a plan for another cluster")
    # A plan this runtime did not make may be broken (edited JSON, another tool): checked
    # once, before anything moves, so that no destination keeps uninitialised memory.
    plan.check()
    graph = state_graph(plan, stream)
    order = plan.launch_order
    src = {n: t.src.device_regions(t.shape) for n, t in plan.tensors.items()}
    expected = {n: {d: region_shape(r) for d, r in regions.items() if is_local(d)}
                for n, regions in src.items()}
    digest, members = b"", None
    if ranks_of is not None:
        digest = hashlib.sha256(plan.to_json().encode()).digest()
        members = tuple(sorted(ranks_of(tuple(sorted(devices)))))
    return StateJob(plan, graph, tuple(n for n, _ in order), tuple(i for _, i in order), src,
                    {n: t.dst.device_regions(t.shape) for n, t in plan.tensors.items()},
                    {n: np.dtype(t.dtype) for n, t in plan.tensors.items()}, expected,
                    digest, members)


def _check_by_name(job: StateJob, value: object, argument: str) -> None:
    """TypeError unless ``value`` maps tensor names to per-device arrays; ValueError naming
    ``argument`` for a name the plan does not have."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{argument}: expected a mapping of tensor name -> {{device: array}}, "
                        f"got {type(value).__name__}")
    extra = sorted(str(n) for n in value if n not in job.plan.tensors)
    if extra:
        raise ValueError(f"{argument}: tensors {extra} are not in the plan (its tensors: "
                         f"{_names(job.plan.tensors)})")


def check_state_shards(job: StateJob, shards: object, array_types: tuple[type, ...],
                       is_local: Callable[[int], bool] | None) -> None:
    """Raise naming ``shards[name]`` (and the device) unless ``shards`` gives every tensor
    of the plan that has a source device here, each as :meth:`Runtime.reshard` takes it
    (``is_local`` None: one process, every source device)."""
    _check_by_name(job, shards, "shards")
    missing = sorted(n for n, want in job.expected.items() if want and n not in shards)
    if missing:
        raise ValueError(f"shards: no shards for tensors {missing}, which have source devices "
                         "in this process")
    for name, plan in job.plan.plans.items():
        given = shards.get(name, {})
        if shards_match(job.expected[name], given, job.dtypes[name], array_types):
            continue
        try:
            check_shards(plan, given, array_types, is_local)
        except (TypeError, ValueError) as exc:
            raise type(exc)(_renamed(exc, "shards", name)) from None


def check_state_outs(job: StateJob, out: object, shards: Mapping[str, Mapping[int, Any]],
                     array_types: tuple[type, ...], is_local: Callable[[int], bool],
                     xp: Any) -> None:
    """Raise naming ``out[name]`` unless every tensor ``out`` names is in the plan and its
    arrays are as :meth:`Runtime.reshard` takes them; an array may not share memory with
    another tensor's destination or any source shard of this process either."""
    _check_by_name(job, out, "out")
    for name, arrays in out.items():
        try:
            check_outs(job.plan.plans[name], arrays, shards.get(name, {}), array_types,
                       is_local, xp)
        except (TypeError, ValueError) as exc:
            raise type(exc)(_renamed(exc, "out", name)) from None
    if xp is np:
        _check_disjoint(out, shards)


def _check_disjoint(out: Mapping[str, Mapping[int, Any]],
                    shards: Mapping[str, Mapping[int, Any]]) -> None:
    """No destination array overlaps another tensor's array (one tensor's own were checked):
    the byte ranges sorted, neighbours that overlap looked at closely (n log n, not n²)."""
    spans = []
    for side, table in (("out", out), ("shards", shards)):
        for name, arrays in table.items():
            for d, a in arrays.items():
                if isinstance(a, np.ndarray) and a.size:
                    low, high = np.lib.array_utils.byte_bounds(a)
                    spans.append((low, high, side, name, d, a))
    spans.sort(key=lambda s: s[:2])
    reach: list[Any] = []  # the spans still open at the current start
    for span in spans:
        reach = [r for r in reach if r[1] > span[0]]
        for r in reach:
            if r[3] != span[3] and "out" in (r[2], span[2]) \
                    and np.may_share_memory(r[5], span[5]):
                a, b = (r, span) if r[2] == "out" else (span, r)
                raise ValueError(f"out[{a[3]!r}][{a[4]}]: overlaps {b[2]}[{b[3]!r}][{b[4]}] "
                                 "(a transfer would write what another reads or writes)")
        reach.append(span)


def _renamed(exc: BaseException, argument: str, name: str) -> str:
    """``exc``'s message about ``argument`` (``shards: ...``, ``shards[3]: ...``) as one
    about ``argument[name]``."""
    text = str(exc)
    if text.startswith(argument):
        return f"{argument}[{name!r}]{text[len(argument):]}"
    return f"{argument}[{name!r}]: {text}"


def _names(names: Any) -> str:
    shown = sorted(names)
    return ", ".join(map(repr, shown[:8])) + (" ..." if len(shown) > 8 else "")


def state_buffers(job: StateJob, out: Mapping[str, Mapping[int, Any]] | None, xp: Any
                  ) -> dict[str, BufferTable]:
    """Per tensor, its destination buffers: the given ``out`` arrays, the others made on
    first use by their device's stream (its memory)."""
    tables = {}
    for name, regions in job.dst.items():
        def make(d: int, regions: Mapping[int, Region] = regions,
                 dtype: np.dtype = job.dtypes[name]) -> Any:
            return xp.empty(region_shape(regions[d]), dtype)
        table = BufferTable(make)
        if out is not None and name in out:
            table.update(out[name])
        tables[name] = table
    return tables


def launch_state(backend: Any, job: StateJob, shards: Mapping[str, Mapping[int, Any]],
                 outs: Mapping[str, BufferTable], routes: Mapping[tuple[int, int], Route],
                 scope: Any, tag_base: int, report: OpReport | None = None) -> list[Any]:
    """Launch this process's part of every transfer of the state (non-blocking) for
    ``scope``, each op with the call's ``report``; returns the lanes' end events. Op ``g``
    is named ``tag_base + g`` across processes."""
    def bind(op: Op, device: int) -> Callable[[], None]:
        name = job.tensor_of_op[op.id]
        return transfer_op(backend, routes[(op.id, device)], op.body.transfer,  # type: ignore[union-attr]
                           job.src[name], job.dst[name], shards.get(name, {}), outs[name],
                           job.dtypes[name], tag_base + op.id, scope)

    return launch(backend, job.graph, bind, scope, report)


def op_name(job: StateJob) -> Callable[[Op], str]:
    """How errors and messages name an op: its tensor and its transfer in that tensor's
    plan (``'layers.0.w' #3``)."""
    return lambda op: f"{job.tensor_of_op[op.id]!r} #{job.index_of_op[op.id]}"


async def reshard_state(parts: RuntimeParts, plan: StateReshardPlan,
                        shards: Mapping[str, Mapping[int, Any]], *,
                        out: Mapping[str, Mapping[int, Any]] | None = None,
                        stream: str = "comm", trace: bool = False) -> State:
    """:meth:`overlap.Runtime.reshard_state` (see there and the module doc)."""
    parts.calls.check_open()
    backend = parts.backend
    distributed = parts.distributed
    mine = backend.is_local if distributed else (lambda _: True)
    # The job holds the plan: its id cannot be reused while the entry lives.
    job: StateJob = parts.graphs.cached(("reshard_state", id(plan), stream), lambda: make_job(
        plan, parts.cluster.num_devices, mine,
        backend.placement.ranks_of if distributed else None, stream))
    types = parts.array_types()
    check_state_shards(job, shards, types, backend.is_local if distributed else None)
    if out is not None:
        check_state_outs(job, out, shards, types, backend.is_local, backend.xp)
    outs = state_buffers(job, out, backend.xp)

    def go(scope: CancelScope, report: OpReport) -> list[Any]:
        base = parts.tags.take(len(job.graph.ops))  # (taken once launched)
        routes = parts.graphs.routes(job.graph, op_name(job))
        return launch_state(backend, job, shards, outs, routes, scope, base, report)

    with parts.measure.traced(job.graph, trace) as recorded:
        await parts.calls.run("reshard_state", job.graph, go, subject="the state plan",
                              channels=(job.channels, []), digest=job.digest,
                              members=job.members, trace=recorded)
    # Devices that got nothing: empty regions. In a multi-process job, this process's.
    return {name: {d: outs[name][d] for d in regions if backend.is_local(d)}
            for name, regions in job.dst.items()}


__all__ = ["StateJob", "check_state_outs", "check_state_shards", "make_job", "reshard_state"]
