"""``auto``: the schedule the cost model says is fastest, within an activation-memory cap.

Candidates, each lowered and simulated with the step's own compute costs and planned
boundaries (the simulator the runtime is checked against):

- the fixed schedules — gpipe, 1f1b, eager-1f1b, and zb-h1 when the backward can be split;
- **comm-aware lists** (:func:`comm_aware_actions`): each stage's list made by running the
  pipeline in time with every boundary's estimated transfer time, a free stage taking the
  ready backward (or input gradient) of its oldest microbatch, else a ready forward while it
  keeps fewer than its cap of microbatches, else a held-back weight gradient — so a weight
  gradient fills the time a gradient spends travelling, and a forward the time an activation
  does. Caps from 1f1b's ``p − s`` up by ``k = 0 … p + 1`` more microbatches per stage
  (1f1b's memory to a little past eager-1f1b's), with and without the split backward.

The fastest candidate that fits ``max_activations`` wins; among those within 0.5 % of it the
one with the least activation memory (summed peaks). It is never slower in simulation than
a fixed schedule that fits the same cap, since those are candidates too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .cluster import Cluster
from .cost import estimate
from .graph import DataParallel, StepGraph
from .lowering import Boundaries, MicrobatchBoundaries, channels, lower, per_microbatch
from .mesh import DeviceMesh
from .planner import PlanCache, PlanOptions
from .schedules import SCHEDULES, Action, Schedule, make_schedule
from .simulator import ComputeCosts, _compute_cost_fn, simulate

TIE = 0.005  # candidates this close to the fastest count as equally fast: least memory wins


@dataclass(frozen=True)
class AutoChoice:
    """The chosen schedule, its lowered graph, its simulated iteration time, and every
    candidate's (name, seconds, peak activations per stage) — what was compared."""

    schedule: Schedule
    graph: StepGraph
    seconds: float
    candidates: tuple[tuple[str, float, tuple[int, ...]], ...]


def comm_aware_actions(p: int, m: int, duration: Callable[[int, str], float],
                       fwd_s: Sequence[float], bwd_s: Sequence[float], caps: Sequence[int],
                       split: bool) -> tuple[tuple[Action, ...], ...]:
    """Each stage's list (see module doc). ``duration(stage, kind)``; ``fwd_s[b]`` /
    ``bwd_s[b]``: seconds boundary b's activation / gradient takes; ``caps[s]``: most
    microbatches stage s keeps between its F and its B (or W)."""
    back = "I" if split else "B"
    end: dict[tuple[int, str, int], float] = {}
    nxt = {(s, k): 0 for s in range(p) for k in ("F", back)}
    held: list[list[int]] = [[] for _ in range(p)]
    live, clock = [0] * p, [0.0] * p
    out: list[list[Action]] = [[] for _ in range(p)]
    total = m * (3 if split else 2)

    def ready_at(s: int, kind: str) -> float:
        """When stage s's next ``kind`` may start (inf: its input is not scheduled yet)."""
        i = nxt[(s, kind)]
        if i >= m:
            return math.inf
        if kind == "F":
            return 0.0 if s == 0 else end.get((s - 1, "F", i), math.inf) + fwd_s[s - 1]
        own = end.get((s, "F", i), math.inf)
        if s == p - 1:
            return own
        return max(own, end.get((s + 1, back, i), math.inf) + bwd_s[s])

    def start_of(r: int) -> tuple[float, str | None]:
        """When stage r can next start something, and what (back, F, or W)."""
        t = clock[r]
        at_back = max(t, ready_at(r, back))
        at_f = max(t, ready_at(r, "F")) if live[r] < caps[r] else math.inf
        options = [(at_back, 0, back), (at_f, 1, "F")]
        if held[r]:
            options.append((t, 2, "W"))  # a held weight gradient fills any wait
        when, _, kind = min(options)
        return when, (None if math.isinf(when) else kind)

    while any(len(o) < total for o in out):
        when, kind, s = min(((*start_of(r), r) for r in range(p) if len(out[r]) < total),
                            key=lambda c: (c[0], c[2]))
        if kind is None:
            raise RuntimeError("comm_aware_actions: no stage can move on (deadlock)")
        i = held[s].pop(0) if kind == "W" else nxt[(s, kind)]
        if kind != "W":
            nxt[(s, kind)] += 1
        clock[s] = end[(s, kind, i)] = when + duration(s, kind)
        out[s].append(Action(kind, i))  # type: ignore[arg-type]
        if kind == "F":
            live[s] += 1
        elif kind in ("B", "W"):
            live[s] -= 1
        else:
            held[s].append(i)
    return tuple(map(tuple, out))


def auto_schedule(stages: Sequence[DeviceMesh], boundaries: Boundaries,
                  num_microbatches: int, cluster: Cluster, compute_costs: ComputeCosts,
                  options: PlanOptions | None = None, *,
                  max_activations: int | Sequence[int] | None = None,
                  cache: PlanCache | None = None,
                  data_parallel: Mapping[int, DataParallel] | None = None) -> AutoChoice:
    """The fastest schedule in simulation that fits ``max_activations`` (microbatches kept
    between F and B per stage: one number for all, or one per stage); see module doc. The
    backward is split only when ``compute_costs`` gives ``I`` and ``W``. ``data_parallel``:
    stages whose gradients are reduced over a mesh axis (:func:`scheduler.lower`), in every
    candidate's graph and cost."""
    p, m = len(stages), num_microbatches
    caps = check_caps(max_activations, p)
    cache = cache if cache is not None else PlanCache(cluster)
    options = options or PlanOptions()
    kinds = ["F", "B"]
    split = _has_split(compute_costs, p)
    if split:
        kinds += ["I", "W"]
    duration = _compute_cost_fn(compute_costs, p, kinds)
    # Each channel's transfer time: the mean over the microbatches (their shapes may differ).
    per = per_microbatch(boundaries if isinstance(boundaries, MicrobatchBoundaries)
                         else tuple(boundaries), m)
    # (A boundary of several tensors: its channels' times added, one after the other.)
    times: dict[Any, dict[tuple[str, int], float]] = {}
    for row in set(per):
        t = times[row] = {}
        for ch, b, src, dst in channels(row):
            key = (ch.direction, ch.boundary)
            t[key] = t.get(key, 0.0) + estimate(cache.plan(b.shape, b.dtype, src, dst, options),
                                                cluster)
    xfer = {k: sum(times[row].get(k, 0.0) for row in per) / m for k in times[per[0]]}
    fwd_s = [xfer.get(("fwd", b), 0.0) for b in range(p - 1)]
    bwd_s = [xfer.get(("bwd", b), 0.0) for b in range(p - 1)]
    tried: list[tuple[str, float, tuple[int, ...]]] = []
    best: list[tuple[float, int, str, Schedule, StepGraph]] = []
    for name, sched in _candidates(p, m, duration, fwd_s, bwd_s, caps, split):
        peaks = tuple(sched.peak_activations(s) for s in range(p))
        if caps is not None and any(k > c for k, c in zip(peaks, caps)):
            continue
        graph = lower(stages, boundaries, sched, cluster, options, cache=cache,
                      data_parallel=data_parallel)
        seconds = simulate(graph, cluster, compute_costs).iteration_time
        tried.append((name, seconds, peaks))
        best.append((seconds, sum(peaks), name, sched, graph))
    fastest = min(b[0] for b in best)
    seconds, _, name, sched, graph = min((b for b in best if b[0] <= fastest * (1 + TIE)),
                                         key=lambda b: (b[1], b[0]))
    chosen = Schedule(f"auto ({name})", p, m, sched.actions)
    return AutoChoice(chosen, graph, seconds, tuple(tried))


def _candidates(p: int, m: int, duration: Callable[[int, str], float], fwd_s: list[float],
                bwd_s: list[float], caps: list[int] | None, split: bool):
    for name in SCHEDULES + (("zb-h1",) if split else ()):
        yield name, make_schedule(name, p, m)
    for use_split in (False, True) if split else (False,):
        seen = set()
        for k in range(p + 2):  # (a little past eager-1f1b's: small p gains from it)
            want = [min(m, p - s + k) for s in range(p)]
            if caps is not None:
                want = [min(w, c) for w, c in zip(want, caps)]
            if tuple(want) in seen:
                continue
            seen.add(tuple(want))
            acts = comm_aware_actions(p, m, duration, fwd_s, bwd_s, want, use_split)
            label = f"comm-aware{' split' if use_split else ''} +{k}"
            yield label, Schedule(label, p, m, acts)


def _has_split(costs: ComputeCosts, p: int) -> bool:
    if callable(costs):
        try:
            return all(costs(s, k) is not None for s in range(p) for k in ("I", "W"))
        except (KeyError, ValueError, TypeError):
            return False
    table = dict(costs) if isinstance(costs, Mapping) else {}
    return all(k in table or all((s, k) in table for s in range(p)) for k in ("I", "W"))


def check_caps(max_activations: int | Sequence[int] | None, p: int) -> list[int] | None:
    """``max_activations`` checked, as one cap per stage (None: no cap)."""
    if max_activations is None:
        return None
    if not isinstance(max_activations, (int, Sequence)) or isinstance(max_activations, str):
        raise TypeError(f"max_activations: expected an int or one int per stage, got "
                        f"{type(max_activations).__name__}")
    caps = ([max_activations] * p if isinstance(max_activations, int)
            else list(max_activations))
    if len(caps) != p:
        raise ValueError(f"max_activations: {len(caps)} caps for {p} stages")
    for s, c in enumerate(caps):
        if isinstance(c, bool) or not isinstance(c, int):
            raise TypeError(f"max_activations: stage {s}'s cap {c!r} is not an int")
        if c < 1:
            raise ValueError(f"max_activations: stage {s} allows {c} microbatches, but every "
                             "schedule keeps at least 1 there (its F before its B)")
    return caps


__all__ = ["AutoChoice", "auto_schedule", "check_caps", "comm_aware_actions"]
