"""Timelines: what ran where and when — simulated or measured — and their trace files.

A :class:`Span` is one op of the step graph on one device lane, carrying the op's id, so a
simulated and a measured timeline of the same graph compare op by op. Metrics (busy, bubble,
exposed communication, the compute stream's waits for transfers, peak activations) are
defined once for both — exposed communication as every trace report defines it
(:mod:`scheduler.exposure`); the waits follow the graph's data edges (``inputs``: a compute
-> the transfers that bring its input), not names. Chrome/Perfetto JSON is written and read
back with op ids and those edges, so ``overlap trace report`` computes the same metrics from
a file.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple, overload

from .exposure import Figures, device_table, figures_of, waits
from .graph import Compute, GradReduce, Op, TransferOp
from .intervals import check_id, length, scaled_interval, union
from .schedules import peak_live


class Span(NamedTuple):
    """One op on one device stream of the timeline (a tuple: cheap by the hundred thousand)."""

    device: int
    stream: str  # "compute", or the comm stream: a channel ("fwd<s>" / "bwd<s>") or "comm"
    name: str  # "F s1 mb3", "reshard s1→s2 mb3 #0", "grad s2→s1 mb3 #1"
    start: float
    end: float
    stage: int  # the compute's stage; a transfer's source stage (-1: a standalone resharding)
    microbatch: int
    kind: str  # "F", "B", "fwd", "bwd", "dp" (gradient reduction; "comm": a resharding)
    op: int = -1  # the step graph's op id (-1: a trace from elsewhere, without ids)


class SpanTable(Sequence[Span]):
    """The spans of a simulated step, made on first use from the ops and their start and end
    times (a 64-stage × 256-microbatch step has ~400 k spans; a caller that wants only the
    iteration time never pays for them)."""

    def __init__(self, ops: Sequence[Op], start: Sequence[float], end: Sequence[float]) -> None:
        self._ops, self._start, self._end = ops, start, end
        self._spans: tuple[Span, ...] | None = None

    @property
    def last_end(self) -> float:
        return max(self._end, default=0.0)

    def _all(self) -> tuple[Span, ...]:
        if self._spans is None:
            start, end = self._start, self._end
            meta: dict[int, tuple[str, int, int, str]] = {}  # ops of one action share a body
            spans = []
            for op in self._ops:
                m = meta.get(id(op.body))
                if m is None:
                    m = meta[id(op.body)] = span_meta(op.body)
                name, stage, mb, kind = m
                i = op.id
                for d in op.devices:
                    spans.append(Span(d, op.stream, name, start[i], end[i], stage, mb, kind, i))
            self._spans = tuple(spans)
        return self._spans

    def __len__(self) -> int:
        return len(self._all())

    @overload
    def __getitem__(self, k: int) -> Span: ...
    @overload
    def __getitem__(self, k: slice) -> tuple[Span, ...]: ...
    def __getitem__(self, k):  # type: ignore[no-untyped-def]
        return self._all()[k]

    def __iter__(self) -> Iterator[Span]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (SpanTable, tuple)):
            return self._all() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


def span_meta(body: Compute | TransferOp | GradReduce) -> tuple[str, int, int, str]:
    """(name, stage, microbatch, kind) of an op's spans: a compute's stage and F/B; a
    transfer's source stage and channel direction (-1 and "comm" in a standalone
    resharding); a gradient reduction's stage, microbatch -1 and "dp"."""
    if isinstance(body, Compute):
        return str(body), body.stage, body.microbatch, body.kind
    if isinstance(body, GradReduce):
        return str(body), body.stage, -1, "dp"
    ch = body.channel
    if ch is None:
        return str(body), -1, 0, "comm"
    return str(body), ch.src_stage, body.microbatch, ch.direction


@dataclass(frozen=True)
class Timeline:
    """What ran where and when, with the metrics measured and simulated runs share.

    ``spans``: a tuple, or a simulation's :class:`SpanTable`. ``inputs`` maps a compute op's
    id to the ops whose ends bring it its input (the step graph's data edges); exposed
    communication is measured along them."""

    spans: Sequence[Span]
    num_stages: int
    devices: tuple[int, ...]
    stage_of: Mapping[int, int]
    inputs: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    @cached_property
    def _by_device(self) -> dict[int, list[Span]]:
        # Spans per device, built once: metrics are asked per device, many times.
        by_device: dict[int, list[Span]] = defaultdict(list)
        for span in self.spans:
            by_device[span.device].append(span)
        return dict(by_device)

    @cached_property
    def _exposed(self) -> dict[tuple[int, str | None], float]:
        """(device, direction) -> exposed seconds, each worked out when first asked."""
        return {}

    def spans_of(self, device: int) -> list[Span]:
        """Every span on ``device``, all its streams, in the timeline's order."""
        return self._by_device.get(device, [])

    @cached_property
    def iteration_time(self) -> float:
        if isinstance(self.spans, SpanTable):
            return self.spans.last_end
        return max((s.end for s in self.spans), default=0.0)

    def busy(self, device: int, stream: str = "compute") -> float:
        """Seconds the device's ``stream`` was busy."""
        return length(union((s.start, s.end) for s in self.spans_of(device)
                            if s.stream == stream))

    def busy_fraction(self, device: int) -> float:
        """Share of the iteration the device's compute stream was busy (0 for an empty step)."""
        t = self.iteration_time
        return self.busy(device) / t if t > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Mean over devices of the share of the iteration their compute stream is idle."""
        if not self.devices:
            return 0.0
        return sum(1.0 - self.busy_fraction(d) for d in self.devices) / len(self.devices)

    def exposed_comm(self, device: int) -> float:
        """Seconds the device communicated while it computed nothing: its communication
        (every comm stream) minus its compute — the definition every trace report uses
        (:mod:`scheduler.exposure`)."""
        return self._figures(device).exposed

    def transfer_wait(self, device: int, direction: str | None = None) -> float:
        """Seconds the device's compute stream sat idle before a compute while a transfer
        bringing its input (the graph's data edges, ``inputs``) ran on the device — the part
        of :meth:`exposed_comm` the step paid for. ``direction`` ``"fwd"``: only before
        forwards (activations), ``"bwd"``: only before backwards and input gradients
        (gradients), None: both. Measured and simulated timelines use the same definition."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction: expected 'fwd', 'bwd' or None, got {direction!r}")
        key = (device, direction)
        if key not in self._exposed:
            spans = self._by_device.get(device)
            self._exposed[key] = (0.0 if spans is None else
                                  length(self.transfer_waits(device, direction)))
        return self._exposed[key]

    def transfer_waits(self, device: int, direction: str | None = None
                       ) -> list[tuple[float, float]]:
        """The intervals of :meth:`transfer_wait` (sorted, disjoint): what a plot marks."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction: expected 'fwd', 'bwd' or None, got {direction!r}")
        return _waits_on(self.spans_of(device), self.inputs, DIRECTIONS[direction])

    def figures(self, device: int) -> Figures:
        """The device's compute, communication, exposed and waited seconds
        (:class:`~scheduler.exposure.Figures`)."""
        return dataclasses.replace(self._figures(device), waited=self.transfer_wait(device))

    def _figures(self, device: int) -> Figures:
        """:meth:`figures` without the waits (what exposed communication alone needs), made
        once per device."""
        if device not in self._unions:
            spans = self.spans_of(device)
            self._unions[device] = figures_of(
                [(s.start, s.end) for s in spans if s.stream == "compute"],
                [(s.start, s.end) for s in spans if s.stream != "compute"])
        return self._unions[device]

    @cached_property
    def _unions(self) -> dict[int, Figures]:
        return {}

    @property
    def exposed_comm_fraction(self) -> float:
        """Mean over devices of exposed communication (:meth:`exposed_comm`) / iteration
        time."""
        return self._mean_share(self.exposed_comm)

    @property
    def transfer_wait_fraction(self) -> float:
        """Mean over devices of :meth:`transfer_wait` / iteration time."""
        return self.wait_fraction()

    def wait_fraction(self, direction: str | None = None) -> float:
        """Mean over devices of the compute stream's waits for transfers (of ``direction``,
        see :meth:`transfer_wait`) / iteration time."""
        return self._mean_share(lambda d: self.transfer_wait(d, direction))

    def _mean_share(self, seconds: Any) -> float:
        t = self.iteration_time
        if t <= 0 or not self.devices:
            return 0.0
        return sum(seconds(d) for d in self.devices) / len(self.devices) / t

    def streams(self, device: int) -> tuple[str, ...]:
        """The device's streams in the timeline: "compute" first, then its comm channels."""
        names = {s.stream for s in self.spans_of(device)}
        return ("compute", *sorted(names - {"compute"}))

    def comm_time(self, device: int) -> float:
        """Seconds at least one of the device's comm streams was busy."""
        return self._figures(device).comm

    def peak_activations(self, stage: int) -> int:
        """Most microbatches with F done and B (or W) not yet, on the stage's first device
        (a device may run several stages: only this stage's computes count)."""
        spans = [s for s in self.spans if s.stage == stage and s.stream == "compute"]
        if not spans:
            raise ValueError(f"stage: no device runs stage {stage}")
        first = min(s.device for s in spans)
        # Spans of one stream are kept in program order (ties in time keep their order); the
        # count is the schedule's own (I frees nothing).
        return peak_live(s for s in spans if s.device == first)

    def summary(self) -> dict[str, float]:
        """The headline figures by name: iteration seconds, bubble, exposed communication,
        transfer wait (fractions of the iteration)."""
        return {
            "iteration_s": self.iteration_time,
            "bubble": self.bubble_fraction,
            "exposed_comm": self.exposed_comm_fraction,
            "transfer_wait": self.transfer_wait_fraction,
        }

    def report(self) -> str:
        """Iteration, bubble, and per device the figures of :mod:`scheduler.exposure` (the
        text ``overlap trace report`` prints for one of our traces)."""
        rows = [(str(d), str(self.stage_of.get(d, "-")), self.figures(d)) for d in self.devices]
        return self.headline() + "\n" + device_table(rows, ("device", "stage"))

    @classmethod
    def from_chrome_trace(cls, path: str | Path) -> Timeline:
        """Read back a trace written by :meth:`to_chrome_trace` (simulated or measured)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"path: {path} is not a trace written by overlap: "
                             f"{type(exc).__name__}: {exc}") from None
        return cls.from_chrome_json(data, path)

    @classmethod
    def from_chrome_json(cls, data: Any, source: str | Path) -> Timeline:
        """:meth:`from_chrome_trace` of JSON already parsed (from ``source``)."""
        try:
            return cls._from_events(data["traceEvents"])
        except KeyError as exc:
            what = ("no 'traceEvents' list" if exc.args[0] == "traceEvents" else
                    f"an event without its {exc.args[0]!r} field")
            raise ValueError(f"path: {source} is not a trace written by overlap: {what}"
                             ) from None
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"path: {source} is not a trace written by overlap: a field of "
                             f"the wrong kind ({type(exc).__name__}: {exc})") from None

    @classmethod
    def _from_events(cls, events: list[dict[str, Any]]) -> Timeline:
        threads: dict[tuple[int, int], str] = {}
        stage_of: dict[int, int] = {}
        for e in events:
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                threads[(check_id(e["pid"], "thread_name", "pid"),
                         check_id(e["tid"], "thread_name", "tid"))] = e["args"]["name"]
            if e.get("ph") == "M" and e.get("name") == "process_name":
                label = e["args"]["name"]  # "device 5 (stage 1)"
                if "(stage " in label:
                    stage_of[check_id(e["pid"], "process_name", "pid")] = int(
                        label.rsplit("(stage ", 1)[1].rstrip(")"))
        spans = []
        inputs: dict[int, tuple[int, ...]] = {}
        for e in events:
            if e.get("ph") != "X":
                continue
            args = e.get("args", {})
            what = f"event {str(e.get('name', ''))[:60]!r}"
            start, end = scaled_interval(e["ts"], e["dur"], 1e-6, what)
            pid, tid = check_id(e["pid"], what, "pid"), check_id(e["tid"], what, "tid")
            op = check_id(args.get("op", -1), what, "op", lo=-1)
            spans.append(Span(pid, threads.get((pid, tid), "compute"), e["name"],
                              start, end, check_id(args.get("stage", 0), what, "stage"),
                              check_id(args.get("microbatch", 0), what, "microbatch"),
                              str(args.get("kind", "")), op))
            if args.get("inputs"):
                inputs[op] = tuple(check_id(j, what, "inputs") for j in args["inputs"])
        for sp in spans:
            stage_of.setdefault(sp.device, sp.stage)
        num_stages = max(stage_of.values(), default=-1) + 1
        return cls(tuple(spans), num_stages, tuple(sorted(stage_of)), stage_of, inputs)

    # ---- output --------------------------------------------------------------------------

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write Chrome/Perfetto trace JSON: one process per device, one track per stream;
        each span's args carry its op id and, for a compute, the ops it waited for."""
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
            args: dict[str, Any] = {"stage": s.stage, "microbatch": s.microbatch,
                                    "kind": s.kind, "op": s.op}
            if s.op in self.inputs:
                args["inputs"] = list(self.inputs[s.op])
            events.append({
                "ph": "X", "name": s.name, "cat": "compute" if s.stream == "compute" else "comm",
                "pid": s.device, "tid": tids[(s.device, s.stream)],
                "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6, "args": args,
            })
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                    "metadata": self.summary()}))
        return path

    def plot(self, path: str | Path) -> Path:
        """A picture of the step (``.png``, ``.svg`` or ``.pdf``; needs matplotlib: the
        ``viz`` extra): see :mod:`scheduler.traces.plot`."""
        from .traces.plot import plot_rows, timeline_rows

        return plot_rows(timeline_rows(self), path, self.headline())

    def headline(self) -> str:
        """The step's figures in one line: iteration, bubble, exposed communication and the
        compute streams' waits for transfers (as shares of the iteration)."""
        return (f"iteration {self.iteration_time * 1e3:.3f} ms, bubble "
                f"{self.bubble_fraction:.1%}, exposed communication "
                f"{self.exposed_comm_fraction:.1%} of the iteration, compute waited for "
                f"transfers {self.transfer_wait_fraction:.1%}")


# Which computes' waits count, per direction: a forward waits for activations, a backward
# (or input gradient) for gradients.
DIRECTIONS: dict[str | None, frozenset[str]] = {
    None: frozenset("FBIW"), "fwd": frozenset("F"), "bwd": frozenset("BI")}


def _waits_on(spans: Sequence[Span], inputs: Mapping[int, tuple[int, ...]],
              kinds: frozenset[str] = DIRECTIONS[None]) -> list[tuple[float, float]]:
    """See :meth:`Timeline.transfer_wait` (spans of one device); only the waits of computes
    of ``kinds`` count."""
    moved: dict[int, list[tuple[float, float]]] = {}
    for s in spans:
        if s.stream != "compute":
            moved.setdefault(s.op, []).append((s.start, s.end))
    computes = []
    for s in spans:
        if s.stream == "compute":
            ins = inputs.get(s.op, ()) if s.kind in kinds else ()
            computes.append((s.start, s.end, union(iv for j in ins for iv in moved.get(j, ()))))
    return waits(computes)
