"""Discrete-event simulation of lowered programs on a cluster, and the Timeline it produces.

The simulator interprets the same programs as the runtime: it dry-runs them
(:func:`~scheduler.programs.validate`) to get a launch order, turns every compute instruction
and every transfer of every resharding into an operation on its streams, and runs them through
the planner's cost model (:meth:`CostModel.run_costs`): FIFO per stream, event waits as
dependencies, transfers sharing NIC and NVLink ports max-min fairly. In **signal** mode every
transfer costs only its latency (the paper's upper bound: a 1-byte message).
"""

from __future__ import annotations

import json
import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .cluster import Cluster
from .cost import CostModel, TransferCost
from .programs import Programs, Record, Wait, dry_run

ComputeCosts = Mapping[Any, float] | Callable[[int, str], float]


class Span(NamedTuple):
    """One operation on one device stream of the timeline (a tuple: cheap by the million)."""

    device: int
    stream: str  # "compute", or the comm channel: "fwd<s>" / "bwd<s>"
    name: str  # "F s1 mb3", "reshard s1→s2 mb3", "grad s2→s1 mb3"
    start: float
    end: float
    stage: int
    microbatch: int
    kind: str  # "F", "B", "fwd", "bwd"


@dataclass(frozen=True)
class Timeline:
    """What ran where and when, with the metrics measured and simulated runs share."""

    spans: tuple[Span, ...]
    num_stages: int
    devices: tuple[int, ...]
    stage_of: Mapping[int, int]

    def __post_init__(self) -> None:
        # Spans per device, built once: metrics are asked per device, many times.
        by_device: dict[int, list[Span]] = defaultdict(list)
        for span in self.spans:
            by_device[span.device].append(span)
        object.__setattr__(self, "_by_device", dict(by_device))
        object.__setattr__(self, "_end", max((s.end for s in self.spans), default=0.0))
        object.__setattr__(self, "_exposed", {
            d: _exposed_on(spans, self.num_stages) for d, spans in by_device.items()
        })

    def spans_of(self, device: int) -> list[Span]:
        return self._by_device.get(device, [])  # type: ignore[attr-defined]

    @property
    def iteration_time(self) -> float:
        return self._end  # type: ignore[attr-defined]

    def busy(self, device: int, stream: str = "compute") -> float:
        """Seconds the device's ``stream`` was busy."""
        return _union_length(
            [(s.start, s.end) for s in self.spans_of(device) if s.stream == stream]
        )

    def busy_fraction(self, device: int) -> float:
        t = self.iteration_time
        return self.busy(device) / t if t > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Mean over devices of the share of the iteration their compute stream is idle."""
        if not self.devices:
            return 0.0
        return sum(1.0 - self.busy_fraction(d) for d in self.devices) / len(self.devices)

    def exposed_comm(self, device: int) -> float:
        """Seconds the device's compute stream sat waiting for a transfer still in flight.

        For every compute that needs a resharding's result (an F after stage 0, a B before the
        last stage), the idle gap before it on the compute stream, intersected with the time
        the device spent on that resharding (its spans named "reshard s→s' mbN" / "grad
        s→s' mbN"). Measured and simulated timelines use the same definition.
        """
        return self._exposed.get(device, 0.0)  # type: ignore[attr-defined]

    @property
    def exposed_comm_fraction(self) -> float:
        """Mean over devices of exposed communication / iteration time."""
        t = self.iteration_time
        if t <= 0 or not self.devices:
            return 0.0
        return sum(self.exposed_comm(d) for d in self.devices) / len(self.devices) / t

    def streams(self, device: int) -> tuple[str, ...]:
        """The device's streams in the timeline: "compute" first, then its comm channels."""
        names = {s.stream for s in self.spans_of(device)}
        return ("compute", *sorted(names - {"compute"}))

    def comm_time(self, device: int) -> float:
        """Seconds at least one of the device's comm streams was busy."""
        return _union_length([(s.start, s.end) for s in self.spans_of(device)
                              if s.stream != "compute"])

    def peak_activations(self, stage: int) -> int:
        """Most microbatches with F done and B not yet, on the stage's first device."""
        devs = [d for d in self.devices if self.stage_of[d] == stage]
        if not devs:
            raise ValueError(f"stage: no device runs stage {stage}")
        # Spans of one stream are kept in program order (ties in time keep their order).
        ops = [s.kind == "B" for s in self.spans_of(devs[0]) if s.stream == "compute"]
        live = peak = 0
        for is_b in ops:
            live += -1 if is_b else 1
            peak = max(peak, live)
        return peak

    def summary(self) -> dict[str, float]:
        return {
            "iteration_s": self.iteration_time,
            "bubble": self.bubble_fraction,
            "exposed_comm": self.exposed_comm_fraction,
        }

    def report(self) -> str:
        """Per device: busy %, communication time, exposed and hidden communication."""
        t = self.iteration_time
        lines = [
            f"iteration {t * 1e3:.3f} ms, bubble {self.bubble_fraction:.1%}, exposed "
            f"communication {self.exposed_comm_fraction:.1%} of the iteration",
            f"{'device':>6} {'stage':>5} {'busy':>7} {'comm ms':>9} {'exposed ms':>11} "
            f"{'hidden':>7}",
        ]
        for d in self.devices:
            comm = self.comm_time(d)
            exp = self.exposed_comm(d)
            hidden = f"{1 - exp / comm:.1%}" if comm > 0 else "-"
            lines.append(f"{d:>6} {self.stage_of[d]:>5} {self.busy_fraction(d):>7.1%} "
                         f"{comm * 1e3:>9.3f} {exp * 1e3:>11.3f} {hidden:>7}")
        return "\n".join(lines)

    @classmethod
    def from_chrome_trace(cls, path: str | Path) -> Timeline:
        """Read back a trace written by :meth:`to_chrome_trace` (simulated or measured)."""
        try:
            data = json.loads(Path(path).read_text())
            events = data["traceEvents"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"path: {path} is not a trace written by overlap: {exc}") from None
        threads: dict[tuple[int, int], str] = {}
        stage_of: dict[int, int] = {}
        for e in events:
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                threads[(e["pid"], e["tid"])] = e["args"]["name"]
            if e.get("ph") == "M" and e.get("name") == "process_name":
                label = e["args"]["name"]  # "device 5 (stage 1)"
                if "(stage " in label:
                    stage_of[e["pid"]] = int(label.rsplit("(stage ", 1)[1].rstrip(")"))
        spans = []
        for e in events:
            if e.get("ph") != "X":
                continue
            args = e.get("args", {})
            start = e["ts"] / 1e6
            spans.append(Span(e["pid"], threads.get((e["pid"], e["tid"]), "compute"), e["name"],
                              start, start + e["dur"] / 1e6, int(args.get("stage", 0)),
                              int(args.get("microbatch", 0)), str(args.get("kind", ""))))
        for sp in spans:
            stage_of.setdefault(sp.device, sp.stage)
        num_stages = max(stage_of.values(), default=-1) + 1
        return cls(tuple(spans), num_stages, tuple(sorted(stage_of)), stage_of)

    # ---- output --------------------------------------------------------------------------

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write Chrome/Perfetto trace JSON: one process per device, one track per stream."""
        events: list[dict[str, Any]] = []
        for d in self.devices:
            events.append({"ph": "M", "name": "process_name", "pid": d,
                           "args": {"name": f"device {d} (stage {self.stage_of[d]})"}})
        tids = {}
        for d in self.devices:
            for tid, stream in enumerate(self.streams(d)):
                tids[(d, stream)] = tid
                events.append({"ph": "M", "name": "thread_name", "pid": d, "tid": tid,
                               "args": {"name": stream}})
        for s in self.spans:
            events.append({
                "ph": "X", "name": s.name, "cat": "compute" if s.stream == "compute" else "comm",
                "pid": s.device, "tid": tids[(s.device, s.stream)],
                "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6,
                "args": {"stage": s.stage, "microbatch": s.microbatch, "kind": s.kind},
            })
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                    "metadata": self.summary()}))
        return path

    def plot(self, path: str | Path) -> Path:
        """A PNG Gantt chart (needs matplotlib: the ``viz`` extra)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "Timeline.plot needs matplotlib: pip install 'overlap[viz]'"
            ) from None
        colors = {"F": "tab:blue", "B": "tab:green", "fwd": "tab:orange", "bwd": "tab:red"}
        rows = [(d, st) for d in self.devices for st in self.streams(d)]
        fig, ax = plt.subplots(figsize=(12, max(2.0, 0.3 * len(rows))))
        for y, (d, st) in enumerate(rows):
            for kind, color in colors.items():
                bars = [(s.start * 1e3, (s.end - s.start) * 1e3) for s in self.spans_of(d)
                        if s.stream == st and s.kind == kind]
                if bars:
                    ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=color)
        ax.set_yticks(range(len(rows)), [f"d{d} {st}" for d, st in rows], fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.set_title(f"iteration {self.iteration_time * 1e3:.2f} ms, bubble "
                     f"{self.bubble_fraction:.1%}, exposed comm {self.exposed_comm_fraction:.1%}")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        ax.legend(handles, ["F", "B", "activation", "gradient"], loc="upper right", fontsize=7)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def input_label(stage: int, microbatch: int, kind: str, num_stages: int) -> str | None:
    """The name of the resharding a compute waits for (None at the pipeline's ends)."""
    if kind == "F" and stage > 0:
        return f"reshard s{stage - 1}→s{stage} mb{microbatch}"
    if kind == "B" and stage < num_stages - 1:
        return f"grad s{stage + 1}→s{stage} mb{microbatch}"
    return None


def _exposed_on(spans: list[Span], num_stages: int) -> float:
    """See :meth:`Timeline.exposed_comm` (spans of one device, in program order per stream)."""
    window: dict[str, list[float]] = {}
    for s in spans:
        if s.stream != "compute":
            w = window.get(s.name)
            if w is None:
                window[s.name] = [s.start, s.end]
            else:
                w[0] = min(w[0], s.start)
                w[1] = max(w[1], s.end)
    exposed, prev_end = 0.0, 0.0
    for s in sorted((s for s in spans if s.stream == "compute"), key=lambda s: s.start):
        name = input_label(s.stage, s.microbatch, s.kind, num_stages)
        w = window.get(name) if name else None
        if w is not None:
            exposed += max(0.0, min(s.start, w[1]) - max(prev_end, w[0]))
        prev_end = max(prev_end, s.end)
    return exposed


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, -math.inf, -math.inf
    for s, e in sorted(intervals):
        if s > cur_e:
            total += max(0.0, cur_e - cur_s) if cur_e > cur_s else 0.0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e > cur_s:
        total += cur_e - cur_s
    return total


def _compute_cost_fn(compute_costs: ComputeCosts, num_stages: int) -> Callable[[int, str], float]:
    if callable(compute_costs):
        fn = compute_costs
    elif isinstance(compute_costs, Mapping):
        table = dict(compute_costs)

        def fn(stage: int, kind: str) -> float:
            if (stage, kind) in table:
                return table[(stage, kind)]
            if kind in table:
                return table[kind]
            raise ValueError(
                f"compute_costs: no duration for stage {stage} {kind!r}; give "
                "{(stage, 'F'): seconds, ...} or {'F': seconds, 'B': seconds}"
            )
    else:
        raise TypeError(
            f"compute_costs: expected a mapping or a callable (stage, kind) -> seconds, got "
            f"{type(compute_costs).__name__}"
        )
    durations: dict[tuple[int, str], float] = {}
    for s in range(num_stages):
        for k in ("F", "B"):
            v = fn(s, k)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
                raise TypeError(f"compute_costs: stage {s} {k!r} has duration {v!r} "
                                f"({type(v).__name__}); need a number of seconds")
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"compute_costs: stage {s} {k!r} has duration {v!r}; "
                                 "need finite seconds >= 0")
            durations[(s, k)] = float(v)
    return lambda stage, kind: durations[(stage, kind)]


def simulate(
    programs: Programs,
    cluster: Cluster,
    compute_costs: ComputeCosts,
    *,
    signal: bool = False,
) -> Timeline:
    """Simulate one training step of ``programs`` on ``cluster``.

    Args:
        compute_costs: seconds per (stage, kind): a mapping ``{(stage, "F"): s, ...}`` or
            ``{"F": s, "B": s}`` for every stage, or a callable ``(stage, kind) -> s``.
        signal: cost every transfer only its latency (the paper's upper bound).
    """
    if not isinstance(programs, Programs):
        raise TypeError(f"programs: expected Programs, got {type(programs).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
    cost_of = _compute_cost_fn(compute_costs, programs.schedule.num_stages)
    model = CostModel(cluster)
    order = dry_run(programs)

    # Per stream: the events each op-bearing instruction waits on (since the previous one),
    # and which op-bearing instruction each Record follows.
    record_source: dict[tuple[int, str], tuple[str, int]] = {}
    waits_before: dict[tuple[int, str], list[tuple[str, ...]]] = {}
    last_op: dict[tuple[int, str], list[int]] = {}  # op index of each instruction, per stream
    for d, prog in programs.devices.items():
        for st, instrs in prog.streams.items():
            prev, pending = -1, []
            waits: list[tuple[str, ...]] = [()] * len(instrs)
            for i, ins in enumerate(instrs):
                kind = type(ins)
                if kind is Wait:
                    pending.append(ins.event)
                elif kind is Record:
                    if prev >= 0:
                        record_source[(d, ins.event)] = (st, prev)
                else:
                    waits[i] = tuple(pending)
                    prev, pending = i, []
            waits_before[(d, st)] = waits
            last_op[(d, st)] = [-1] * len(instrs)

    def deps_for(d: int, st: str, i: int, out: list[int]) -> None:
        for e in waits_before[(d, st)][i]:
            src = record_source.get((d, e))
            if src is not None:
                out.append(last_op[(d, src[0])][src[1]])

    costs: list[TransferCost] = []
    keys: list[tuple[tuple[str, int], ...]] = []
    after: list[list[int]] = []
    # Per op: (devices, stream, name, stage, microbatch, kind, reshard id or -1).
    meta: list[tuple[tuple[int, ...], str, str, int, int, str, int]] = []
    compute_cost: dict[tuple[int, str], TransferCost] = {}
    transfer_cost: dict[tuple[str, int], tuple[TransferCost, tuple[tuple[str, int], ...]]] = {}
    current: tuple[int, int] | None = None  # (reshard id, transfer index) of the last comm op
    transfer_op: dict[tuple[int, int], int] = {}  # (reshard id, transfer index) -> op
    devices = programs.devices
    label: dict[Any, str] = {}
    for d, stream, idx, k in order:
        if stream == "compute":
            ins = devices[d].compute[idx]
            ck = (ins.stage, ins.kind)
            if ck not in compute_cost:
                compute_cost[ck] = TransferCost((), cost_of(ins.stage, ins.kind), 0, math.inf)
            n = len(costs)
            costs.append(compute_cost[ck])
            keys.append((("compute", d),))
            deps: list[int] = []
            if waits_before[(d, "compute")][idx]:
                deps_for(d, "compute", idx, deps)
            after.append(deps)
            name = label.get(ins)
            if name is None:
                name = label[ins] = str(ins)
            meta.append(((d,), "compute", name, ins.stage, ins.microbatch, ins.kind, -1))
            last_op[(d, "compute")][idx] = n
            continue
        ins = devices[d].streams[stream][idx]
        # The dry run lists every device of a transfer together: the first creates the op.
        if current != (ins.id, k):
            current = (ins.id, k)
            op = programs.op(ins.id)
            ck2 = (op.plan_key, k)
            if ck2 not in transfer_cost:  # the same for every microbatch
                t = programs.plans[op.plan_key].transfers[k]
                transfer_cost[ck2] = (
                    TransferCost((), model.latency_of(t.sender, t.receivers), 0, math.inf)
                    if signal else model.transfer_cost(t),
                    tuple((stream, e) for e in t.devices),
                )
            cost, tkeys = transfer_cost[ck2]
            costs.append(cost)
            keys.append(tkeys)
            # The plan's own ordering constraints between its transfers (Transfer.after).
            after.append([transfer_op[(ins.id, j)]
                          for j in programs.plans[op.plan_key].transfers[k].after])
            transfer_op[(ins.id, k)] = len(costs) - 1
            meta.append((tuple(e for _, e in tkeys), stream, op.label, op.src_stage,
                         op.microbatch, op.direction, op.id))
        n = len(costs) - 1
        slots = last_op[(d, stream)]
        if slots[idx] < 0 and waits_before[(d, stream)][idx]:
            # The device's first transfer of this Reshard: the waits before it apply.
            deps_for(d, stream, idx, after[n])
        slots[idx] = n

    timings = model.run_costs(costs, keys, after=[tuple(sorted(set(a))) for a in after])
    spans = [
        Span(d, stream, name, tm.start, tm.end, stage, mb, kind)
        for (devs, stream, name, stage, mb, kind, _), tm in zip(meta, timings)
        for d in devs
    ]
    stage_of = {d: p.stage for d, p in programs.devices.items()}
    return Timeline(tuple(spans), programs.schedule.num_stages, tuple(sorted(programs.devices)),
                    stage_of)
