"""The validator: does a step graph run, and does it respect its data dependencies?

:func:`validate` checks, in order:

1. **structure** — every op sits exactly once on each of its lanes and on no other; every
   wait names an existing op, recorded on one of that op's devices and waited on one of this
   op's; a data dependency (compute ↔ transfer) is an event on one device;
2. **each device's own order** (pipeline graphs) — every device of a stage's mesh runs each
   of its microbatches' computes once, in their order: F, then B (or I, then W) — edges no
   transfer carries (the last stage's backward reads its own forward's ``ctx.saved``; W reads
   what I kept), so only the lane order keeps them;
   **data dependencies** — every compute waits for each transfer of its
   input's resharding that its device takes part in (delivering the input to it, or forwarding
   it from its buffer, which the compute may overwrite), and every transfer whose sender
   computed the data waits for that compute on the sender; a data-parallel stage reduces its
   gradients once per line of its axis, each device of the line waiting there for its last
   backward of the stage (a reduction before it would miss gradients);
3. **a dry run** — with the runtime's semantics (FIFO lanes; a transfer runs once it heads
   all its lanes, a collective; an op runs after its waits) every op runs, in steps: step k
   holds the ops whose predecessors all ran in steps before k. A deadlock — a cycle of
   waits, which covers a collective launched in different orders on two devices (a
   communicator needs one launch order) and a wait for an op later on the waiter's own
   stream (FIFO) — is reported with the devices × steps grid, the op each stuck lane stops at
   marked, and what it waits for, down to the cycle.
"""

from __future__ import annotations

from collections import Counter

from .graph import (
    Compute,
    GradReduce,
    Lane,
    StepGraph,
    TransferOp,
    inputs_of,
    op_key,
    reduce_lines,
)


class ProgramError(ValueError):
    """A step graph that deadlocks, breaks a data dependency or is malformed."""


Steps = list[tuple[int, ...]]


def validate(graph: StepGraph) -> Steps:
    """The dry run's steps (op ids per step), or :class:`ProgramError` (see module doc)."""
    if not isinstance(graph, StepGraph):
        raise TypeError(f"graph: expected a StepGraph, got {type(graph).__name__}")
    _check_structure(graph)
    if graph.schedule is not None:
        _check_local_order(graph)
        _check_data(graph)
    steps = dry_run(graph)
    if sum(len(s) for s in steps) < len(graph.ops):
        raise ProgramError(_deadlock(graph, steps))
    return steps


def dry_run(graph: StepGraph) -> Steps:
    """Run every op instantly, in steps (see module doc): the ops that ran, step by step
    (fewer than all of them when the graph deadlocks)."""
    succ, need0 = graph.successors
    need = list(need0)
    frontier = [i for i, k in enumerate(need) if k == 0]
    steps: Steps = []
    while frontier:
        steps.append(tuple(frontier))
        nxt = []
        for i in frontier:
            for j in succ[i]:
                need[j] -= 1
                if need[j] == 0:
                    nxt.append(j)
        frontier = sorted(nxt)
    return steps


# ---- structure ---------------------------------------------------------------------------


def _check_structure(graph: StepGraph) -> None:
    ops = graph.ops
    seen: Counter[tuple[int, Lane]] = Counter()
    for lane, ids in graph.lanes.items():
        for i in ids:
            if not 0 <= i < len(ops):
                raise ProgramError(f"lane {lane}: names op {i}, but the graph has ops "
                                   f"0..{len(ops) - 1}")
            if lane not in ops[i].lanes:
                raise ProgramError(f"lane {lane}: holds {ops[i]} ({ops[i].key}), which runs on "
                                   f"{', '.join(map(str, ops[i].lanes))}")
            seen[(i, lane)] += 1
    for k, op in enumerate(ops):
        if op.id != k:
            raise ProgramError(f"ops[{k}]: {op} has id {op.id}; an op's id is its position")
        for lane in op.lanes:
            if seen[(op.id, lane)] != 1:
                raise ProgramError(f"{op} ({op.key}) appears {seen[(op.id, lane)]} times on "
                                   f"lane {lane}; an op runs once on each of its lanes")
        for dep in op.waits:
            _check_dep(graph, op.id, dep)
    _check_fifo(graph)


def _check_dep(graph: StepGraph, i: int, dep) -> None:
    op = graph.ops[i]
    if not 0 <= dep.op < len(graph.ops) or dep.op == i:
        raise ProgramError(f"{op} ({op.key}) waits for op {dep.op}, which is not another op "
                           "of the graph")
    other = graph.ops[dep.op]
    if dep.src not in other.devices or dep.dst not in op.devices:
        raise ProgramError(f"{op} ({op.key}) waits on device {dep.dst} for {other} "
                           f"({other.key}) recorded on device {dep.src}; the waiter runs on "
                           f"{list(op.devices)}, the other op on {list(other.devices)}")
    data = isinstance(op.body, Compute) or isinstance(other.body, Compute)
    if data and dep.src != dep.dst:
        raise ProgramError(f"{op} ({op.key}) on device {dep.dst} waits for {other} "
                           f"({other.key}) on device {dep.src}: a data dependency is an event "
                           "of one device")


def _check_fifo(graph: StepGraph) -> None:
    """A wait for an op later on the waiter's own lane can never be met (FIFO order)."""
    pos = {(i, lane): k for lane, ids in graph.lanes.items() for k, i in enumerate(ids)}
    for op in graph.ops:
        for dep in op.waits:
            lane = Lane(dep.dst, op.stream)
            if (dep.src == dep.dst and graph.ops[dep.op].stream == op.stream
                    and pos[(dep.op, lane)] > pos[(op.id, lane)]):
                raise ProgramError(
                    f"lane {lane}: {op} ({op.key}) waits for {graph.ops[dep.op]} "
                    f"({graph.ops[dep.op].key}), which comes later on the same stream: FIFO "
                    "order makes that a deadlock")


# ---- each device's own order (pipelines) -------------------------------------------------

_BEFORE = {"F": "", "B": "F", "I": "F", "W": "FI"}


def _check_local_order(graph: StepGraph) -> None:
    """Per device, its computes of each (stage, microbatch) come F, then B (or I, then W),
    each once, and every device of a stage's mesh runs them all (see module doc)."""
    sched = graph.schedule
    assert sched is not None
    seen: dict[tuple[int, int, int], str] = {}  # (device, stage, microbatch) -> kinds so far
    for lane, ids in graph.lanes.items():
        for i in ids:
            b = graph.ops[i].body
            if not isinstance(b, Compute):
                continue
            key = (lane.device, b.stage, b.microbatch)
            done = seen.get(key, "")
            need = _BEFORE[b.kind]
            if done != need:
                problem = (f"before its {need[len(done)]}" if need.startswith(done)
                           and len(done) < len(need) else f"after {done!r} already ran there")
                raise ProgramError(
                    f"lane {lane}: {b} ({b.token}) runs {problem}: a device runs a "
                    f"microbatch's F, then B (or I, then W), each once"
                    f" (the lane stops at the op marked '>')\n"
                    + "\n".join(_grid(graph, dry_run(graph), {lane: i}, [lane])))
            seen[key] = done + b.kind
    _check_same_order(graph)
    whole = ("F",) if sched.forward_only else ("FB", "FIW")
    for s, mesh in enumerate(graph.stages):
        for d in mesh.device_ids:
            for mb in range(sched.num_microbatches):
                got = seen.get((d, s, mb), "")
                if got not in whole:
                    raise ProgramError(f"device {d}: microbatch {mb} of stage {s} runs "
                                       f"{got or 'nothing'!r}; it needs one of {list(whole)}")


def _check_same_order(graph: StepGraph) -> None:
    """Every device of a stage's mesh runs that stage's computes in one order: a stage's
    collectives (``ctx.all_reduce``) are matched by launch order across its devices."""
    orders: dict[int, dict[int, list[str]]] = {}  # stage -> device -> its tokens
    for lane, ids in graph.lanes.items():
        for i in ids:
            b = graph.ops[i].body
            if isinstance(b, Compute):
                orders.setdefault(b.stage, {}).setdefault(lane.device, []).append(b.token)
    for s, by_device in sorted(orders.items()):
        (d0, first), *rest = sorted(by_device.items())
        for d, order in rest:
            if order != first:
                k = next((k for k, (a, b) in enumerate(zip(first, order)) if a != b),
                         min(len(first), len(order)))
                mine = order[k] if k < len(order) else "nothing"
                theirs = first[k] if k < len(first) else "nothing"
                raise ProgramError(
                    f"stage {s}: device {d} runs {mine} where device {d0} runs {theirs} "
                    f"(compute {k} of the stage): every device of a stage runs its computes "
                    "in one order (its collectives are matched by launch order)")


# ---- data dependencies (pipelines) -------------------------------------------------------


def _check_data(graph: StepGraph) -> None:
    p = len(graph.stages)
    by_channel: dict[tuple[object, int], list[int]] = {}
    for op in graph.ops:
        if isinstance(op.body, TransferOp):
            by_channel.setdefault((op.body.channel, op.body.microbatch), []).append(op.id)
    _check_complete(graph, by_channel)
    _check_reductions(graph)
    for op in graph.ops:
        b = op.body
        waits = {(dep.op, dep.dst) for dep in op.waits}
        if isinstance(b, Compute):
            d = op.devices[0]
            into = inputs_of(b.stage, b.kind, p, graph.channel_sets)
            for t in (t for channel in into for t in by_channel.get((channel, b.microbatch), ())):
                if d in graph.ops[t].devices and (t, d) not in waits:
                    raise ProgramError(
                        f"dependency violation: device {d} runs {b} ({b.token}) before "
                        f"{graph.ops[t]} ({graph.ops[t].key}), which moves its input, has "
                        "ended: it does not wait for it")
        elif isinstance(b, TransferOp) and b.channel is not None:
            sender = b.transfer.sender
            made = graph.by_key.get(op_key(
                Compute(b.channel.src_stage, b.microbatch, b.channel.kind).token, sender))
            if made is not None and (made, sender) not in waits:
                raise ProgramError(
                    f"dependency violation: device {sender} sends {b} ({b.token}) before it "
                    f"ran {graph.ops[made]} ({graph.ops[made].body.token}): it does not wait "
                    "for it")


def _check_reductions(graph: StepGraph) -> None:
    """Each data-parallel stage's lines reduce once, each device after its last backward of
    the stage (the end of the stage's computes on its lane: nothing adds to a gradient after
    it)."""
    last: dict[tuple[int, int], int] = {}  # (device, stage) -> its last compute of the stage
    for lane, ids in graph.lanes.items():
        for i in ids:
            b = graph.ops[i].body
            if isinstance(b, Compute):
                last[(lane.device, b.stage)] = i
    seen: dict[tuple[int, tuple[int, ...]], int] = {}
    for op in graph.ops:
        b = op.body
        if not isinstance(b, GradReduce):
            continue
        dp = graph.data_parallel.get(b.stage)
        if dp is None or b.group not in reduce_lines(graph.stages[b.stage], dp.axis):
            raise ProgramError(f"{b} ({b.token}) reduces over no data-parallel line of stage "
                               f"{b.stage}")
        if (b.stage, b.group) in seen:
            raise ProgramError(f"{b} ({b.token}) appears twice; a line reduces once a step")
        seen[(b.stage, b.group)] = op.id
        waits = {(dep.op, dep.dst) for dep in op.waits}
        for d in b.group:
            end = last.get((d, b.stage))
            if end is None or (end, d) not in waits:
                what = "nothing of the stage" if end is None else \
                    f"{graph.ops[end]} ({graph.ops[end].body.token})"
                raise ProgramError(
                    f"dependency violation: device {d} runs {b} ({b.token}) without waiting "
                    f"for its last backward of stage {b.stage}, {what}: the gradients would "
                    "be reduced before they are complete")
    for s, dp in sorted(graph.data_parallel.items()):
        for line in reduce_lines(graph.stages[s], dp.axis):
            if (s, line) not in seen:
                raise ProgramError(f"stage {s}: no gradient reduction over {list(line)} (its "
                                   f"data-parallel axis {dp.axis!r}); the replicas would "
                                   "drift apart")


def _check_complete(graph: StepGraph, by_channel: dict[tuple[object, int], list[int]]) -> None:
    """Every transfer of every channel's plan moves every microbatch once: a graph missing
    one would leave part of a stage's input uninitialised."""
    for key, plan in graph.plans.items():
        if key is None:
            continue
        channel, mbs = (key[0], (key[1],)) if isinstance(key, tuple) else \
            (key, range(graph.schedule.num_microbatches))  # type: ignore[union-attr]
        want = list(range(len(plan.transfers)))
        for mb in mbs:
            have = sorted(graph.ops[i].body.index for i in by_channel.get((channel, mb), ()))
            if have != want:
                gone = sorted(set(want) - set(have))
                raise ProgramError(
                    f"{channel} microbatch {mb}: the graph moves transfers {have[:8]}"
                    f"{'...' if len(have) > 8 else ''} of its plan's {len(want)}"
                    + (f"; missing #{gone[0]} ({plan.transfers[gone[0]]})" if gone
                       else "; some more than once"))


# ---- deadlock report ---------------------------------------------------------------------

_GRID_STEPS = 6  # steps shown before the stuck ops
_GRID_LANES = 16  # stuck lanes shown (those of the cycle first)


def _deadlock(graph: StepGraph, steps: Steps) -> str:
    ran = {i for step in steps for i in step}
    heads = {lane: next(i for i in ids if i not in ran)
             for lane, ids in graph.lanes.items() if any(i not in ran for i in ids)}
    cycle = _cycle(graph, heads, ran)
    in_cycle = {lane for i, _ in cycle for lane in graph.ops[i].lanes if lane in heads}
    shown = sorted(heads, key=lambda la: (la not in in_cycle, la))[:_GRID_LANES]
    stuck = len(graph.ops) - len(ran)
    lines = [f"programs deadlock: {stuck} of {len(graph.ops)} ops never run; each stuck lane "
             "stops at the op marked '>'", *_grid(graph, steps, heads, sorted(shown)), ""]
    for lane in sorted(shown):
        lines.append(f"{lane} >{graph.ops[heads[lane]].body.token}: " + "; ".join(
            _why(graph, heads[lane], lane, heads, ran)))
    if len(heads) > len(shown):
        lines.append(f"... and {len(heads) - len(shown)} more stuck lanes")
    if cycle:
        lines.append("cycle: " + " -> ".join(
            graph.ops[i].key + (f" (behind {graph.ops[via].key}'s lane)" if via is not None
                                else "") for i, via in cycle) + " -> " + graph.ops[cycle[0][0]].key)
        lines += _explain(graph, [i for i, _ in cycle])
    return "\n".join(lines)


def _grid(graph: StepGraph, steps: Steps, heads: dict[Lane, int], shown: list[Lane]
          ) -> list[str]:
    """Stuck lanes × the last steps in which one of them ran an op, then where each stops."""
    cells: dict[tuple[Lane, int], str] = {}
    active: set[int] = set()
    shown_set = set(shown)
    for k, step in enumerate(steps):
        for i in step:
            for lane in graph.ops[i].lanes:
                if lane in shown_set:
                    cells[(lane, k)] = graph.ops[i].body.token
                    active.add(k)
    cols = sorted(active)[-_GRID_STEPS:]
    rows = [[str(lane)] + [cells.get((lane, k), ".") for k in cols]
            + [">" + graph.ops[heads[lane]].body.token] for lane in shown]
    head = ["lane", *(f"step {k}" for k in cols), "stops at"]
    widths = [max(len(r[c]) for r in (head, *rows)) for c in range(len(head))]
    return ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in (head, *rows)]


def _blockers(graph: StepGraph, h: int, heads: dict[Lane, int], ran: set[int]
              ) -> list[tuple[str, int]]:
    """What a stuck op waits for: ("lane", the op heading another of its lanes) or ("dep",
    an op it waits for that never ran)."""
    out: list[tuple[str, int]] = []
    for lane in graph.ops[h].lanes:
        if heads.get(lane, h) != h:
            out.append(("lane", heads[lane]))
    for dep in graph.ops[h].waits:
        if dep.op not in ran:
            out.append(("dep", dep.op))
    return out


def _why(graph: StepGraph, h: int, lane: Lane, heads: dict[Lane, int], ran: set[int]
         ) -> list[str]:
    op = graph.ops[h]
    reasons = []
    for what, j in _blockers(graph, h, heads, ran):
        other = graph.ops[j]
        if what == "lane":
            where = next(la for la in op.lanes if heads.get(la) == j)
            reasons.append(f"needs device {where.device} to reach it, but {where} is stuck "
                           f"at {other.body.token} first")
        else:
            reasons.append(f"waits for {other.body.token} ({other}), which never runs")
    if len(reasons) > 3:
        reasons[3:] = [f"and {len(reasons) - 3} more"]
    return reasons


def _cycle(graph: StepGraph, heads: dict[Lane, int], ran: set[int]
           ) -> list[tuple[int, int | None]]:
    """A cycle of stuck ops, each waiting for the next — (op, the op it waits for on the way
    when that one sits deeper in a lane, behind the next) — followed from the first stuck
    lane."""
    head_set = set(heads.values())

    def next_of(i: int) -> tuple[int, int | None] | None:
        for _, j in _blockers(graph, i, heads, ran):
            if j in head_set:
                return j, None
            # An op stuck deeper in a lane waits for that lane's head first.
            for lane in graph.ops[j].lanes:
                if heads.get(lane, j) != j:
                    return heads[lane], j
        return None

    path: list[tuple[int, int | None]] = []
    at: dict[int, int] = {}
    step: tuple[int, int | None] | None = (heads[min(heads)], None)
    while step is not None and step[0] not in at:
        at[step[0]] = len(path)
        nxt = next_of(step[0])
        path.append((step[0], nxt[1] if nxt else None))
        step = nxt
    return path[at[step[0]]:] if step is not None else []


def _explain(graph: StepGraph, cycle: list[int]) -> list[str]:
    """Name the classic cause: two collectives launched in different orders on two devices."""
    if len(cycle) == 2:
        a, b = (graph.ops[i] for i in cycle)
        shared = sorted(set(a.lanes) & set(b.lanes))
        if isinstance(a.body, TransferOp) and isinstance(b.body, TransferOp) and shared:
            firsts = {lane: (a if graph.lanes[lane].index(a.id) < graph.lanes[lane].index(b.id)
                             else b) for lane in shared}
            if len({id(x) for x in firsts.values()}) > 1:
                desc = ", ".join(f"{lane} runs {x.body.token} first"
                                 for lane, x in firsts.items())
                return [f"collectives {a.body.token} and {b.body.token} are launched in "
                        f"different orders ({desc}): a communicator needs one launch order on "
                        "every device"]
    return []
