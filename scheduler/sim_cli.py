"""``overlap simulate``: compare gpipe / 1f1b / eager-1f1b / signal on one pipeline.

Flags describe a uniform pipeline: ``--stages`` stages, stage ``s`` on host ``s`` of a cluster
preset (its first ``--gpus-per-stage`` GPUs, mesh axes "host", "gpu"), one boundary tensor
layout for every stage boundary, and per-microbatch compute times. A JSON case file
(``--case``) can give anything else::

    {"cluster": {"preset": "p3.8xlarge", "num_hosts": 4},
     "stages": [{"devices": [[0, 1, 2, 3]], "axis_names": ["host", "gpu"]}, ...],
     "boundaries": [{"shape": [1024, 8192], "dtype": "float16",
                     "producer": [null, "gpu"], "consumer": ["gpu", null]}, ...],
     "microbatches": 16,
     "compute_ms": {"F": 50, "B": 100}}       # or a list per stage: [{"F": .., "B": ..}, ...]

``I`` and ``W`` times (both) give the split backward. A case may also hold a ``schedule``
(``Schedule.to_json``'s object, as ``overlap partition --json`` writes): its row is added —
alone, with its signal row, when it runs several stages per rank (stages sharing meshes,
which the fixed schedules cannot run).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cli_common import (
    add_plan_options,
    interpret_case,
    joined_specs,
    parse_spec,
    parser,
    plan_options,
    read_json_file,
)
from .cluster import Cluster
from .lowering import Boundary, lower
from .mesh import DeviceMesh
from .planner import PlanCache, PlanOptions
from .schedules import SCHEDULES, Schedule, make_schedule
from .sharding import Sharding, ShardingSpec
from .simulator import simulate
from .timeline import Timeline


@dataclass(frozen=True)
class PipelineCase:
    cluster: Cluster
    stages: tuple[DeviceMesh, ...]
    boundaries: tuple[Boundary, ...]
    microbatches: int
    compute: dict[tuple[int, str], float]  # seconds
    schedule: Schedule | None = None  # the case's own (a partition plan's), if it has one


@dataclass(frozen=True)
class Row:
    label: str
    timeline: Timeline


def run_rows(case: PipelineCase, options: PlanOptions | None = None, *,
             schedules: Sequence[str] = SCHEDULES, signal_schedule: str = "eager-1f1b",
             trace_dir: Path | None = None) -> list[Row]:
    """Simulate each schedule, plus ``signal`` (``signal_schedule`` with latency-only comm);
    each boundary is planned once for all rows."""
    rows = []
    cache = PlanCache(case.cluster)
    runs: list[tuple[str, str | Schedule, bool]] = [(name, name, False) for name in schedules]
    own = case.schedule
    if own is not None and own.stages_per_rank > 1:
        runs = [(own.name, own, False), ("signal", own, True)]
    else:
        runs += ([(own.name, own, False)] if own is not None else []) + \
            [("signal", signal_schedule, True)]
    for label, name, signal in runs:
        schedule = name if isinstance(name, Schedule) else \
            make_schedule(name, len(case.stages), case.microbatches)
        graph = lower(case.stages, case.boundaries, schedule, case.cluster, options,
                      cache=cache)
        tl = simulate(graph, case.cluster, case.compute, signal=signal)
        if trace_dir is not None:
            tl.to_chrome_trace(Path(trace_dir) / f"sim-{label}.json")
        rows.append(Row(label, tl))
    return rows


def format_rows(rows: Sequence[Row], reference: str = "signal") -> str:
    ref = next((r.timeline.iteration_time for r in rows if r.label == reference), None)
    head = ["schedule", "iteration ms", f"/ {reference}", "bubble", "exposed comm",
            "peak act. s0"]
    body = []
    for r in rows:
        t = r.timeline
        body.append([
            r.label, f"{t.iteration_time * 1e3:.1f}",
            f"{t.iteration_time / ref:.3f}" if ref else "-",
            f"{t.bubble_fraction:.1%}", f"{t.exposed_comm_fraction:.1%}",
            str(t.peak_activations(0)),
        ])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda row: "  ".join(x.rjust(w) for x, w in zip(row, widths))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body)])


def case_from_json(data: dict[str, Any]) -> PipelineCase:
    missing = {"cluster", "stages", "boundaries", "microbatches", "compute_ms"} - set(data)
    if missing:
        raise ValueError(f"case file: missing keys {sorted(missing)}")
    cluster = Cluster.from_dict(data["cluster"])
    stages = tuple(DeviceMesh.from_dict(m) for m in data["stages"])
    if not stages:
        raise ValueError("case file: stages: need at least one stage mesh")
    if len(data["boundaries"]) != len(stages) - 1:
        raise ValueError(f"case file: boundaries: {len(stages)} stages need "
                         f"{len(stages) - 1} boundaries, got {len(data['boundaries'])}")
    boundaries = []
    for s, b in enumerate(data["boundaries"]):
        boundaries.append(Boundary(
            tuple(b["shape"]), str(b.get("dtype", "float16")),
            Sharding(stages[s], ShardingSpec.from_json(b["producer"])),
            Sharding(stages[s + 1], ShardingSpec.from_json(b["consumer"])),
        ))
    m = int(data["microbatches"])
    schedule = None
    if "schedule" in data:
        schedule = Schedule.from_json(json.dumps(data["schedule"]))
        if (schedule.num_stages, schedule.num_microbatches) != (len(stages), m):
            raise ValueError(f"schedule: {schedule.name} is for {schedule.num_stages} stages × "
                             f"{schedule.num_microbatches} microbatches; the case has "
                             f"{len(stages)} × {m}")
    return PipelineCase(cluster, stages, tuple(boundaries), m,
                        _compute_table(data["compute_ms"], len(stages)), schedule)


def _compute_table(spec: Any, num_stages: int) -> dict[tuple[int, str], float]:
    per_stage = spec if isinstance(spec, list) else [spec] * num_stages
    if len(per_stage) != num_stages:
        raise ValueError(f"compute_ms: {len(per_stage)} entries for {num_stages} stages")
    out = {}
    split = all("I" in e and "W" in e for e in per_stage)
    for s, entry in enumerate(per_stage):
        for k in ("F", "B", "I", "W") if split else ("F", "B"):
            if k not in entry:
                raise ValueError(f"compute_ms: stage {s} has no {k!r} time")
            out[(s, k)] = float(entry[k]) / 1e3
    return out


def _case_from_args(args: argparse.Namespace) -> PipelineCase:
    if args.case is not None:
        data = read_json_file(args.case, "--case")
        return interpret_case(args.case, data, case_from_json)
    if args.shape is None:
        raise ValueError("--shape is required without --case")
    if args.stages < 1:
        raise ValueError(f"--stages: need at least 1, got {args.stages}")
    if args.hosts is not None and args.hosts < args.stages:
        raise ValueError(f"--hosts: {args.hosts} hosts for {args.stages} stages (stage s runs "
                         "on host s); give at least as many hosts as stages, or omit --hosts")
    cluster = Cluster.preset(args.cluster, args.hosts or args.stages)
    gpus = args.gpus_per_stage or cluster.gpus_per_host
    if not 1 <= gpus <= cluster.gpus_per_host:
        raise ValueError(f"--gpus-per-stage: {gpus} not in 1..{cluster.gpus_per_host}")
    stages = tuple(cluster.mesh([h], gpus=gpus) for h in range(args.stages))
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        raise ValueError(f"--shape: expected comma-separated ints, got {args.shape!r}") from None
    boundaries = []
    for s in range(args.stages - 1):
        try:
            producer = Sharding(stages[s], parse_spec(args.src_spec))
            producer.spec.padded(len(shape))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--src-spec: {exc}") from None
        try:
            consumer = Sharding(stages[s + 1], parse_spec(args.dst_spec))
            consumer.spec.padded(len(shape))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--dst-spec: {exc}") from None
        boundaries.append(Boundary(shape, args.dtype, producer, consumer))
    for name in ("fwd_ms", "bwd_ms"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 0")
    compute = {(s, k): (args.fwd_ms if k == "F" else args.bwd_ms) / 1e3
               for s in range(args.stages) for k in ("F", "B")}
    return PipelineCase(cluster, stages, tuple(boundaries), args.microbatches, compute)


def _parser() -> argparse.ArgumentParser:
    p = parser("overlap simulate",
               "Simulate gpipe / 1f1b / eager-1f1b / signal for one pipeline.")
    p.add_argument("--case", type=Path, default=None,
                   help="a pipeline case file: JSON with cluster, stages, boundaries, "
                        "microbatches, compute_ms (examples/cases/simulate_case.json; not a "
                        "plan case); replaces the flags below")
    p.add_argument("--cluster", default="p3.8xlarge", help="cluster preset")
    p.add_argument("--hosts", type=int, default=None,
                   help="hosts of the preset, at least one per stage (default: one per stage)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages, stage s on host s")
    p.add_argument("--gpus-per-stage", type=int, default=None,
                   help="GPUs of its host each stage uses (default: all)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    p.add_argument("--shape", default=None, help="boundary tensor per microbatch, e.g. 1024,8192")
    p.add_argument("--dtype", default="float16", help="numpy dtype name of the boundaries")
    p.add_argument("--src-spec", default="", help="producer layout, e.g. -,gpu")
    p.add_argument("--dst-spec", default="", help="consumer layout, e.g. gpu,-")
    p.add_argument("--fwd-ms", type=float, default=10.0, help="forward per microbatch")
    p.add_argument("--bwd-ms", type=float, default=20.0, help="backward per microbatch")
    add_plan_options(p)
    p.add_argument("--trace-dir", type=Path, default=None,
                   help="write a Perfetto trace per row here")
    return p


def _signal_of(case: PipelineCase) -> str:
    own = case.schedule
    return own.name if own is not None and own.stages_per_rank > 1 else "eager-1f1b"


def simulate_main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(joined_specs(sys.argv[1:] if argv is None else argv))
    try:
        if args.trace_dir is not None and args.trace_dir.exists() \
                and not args.trace_dir.is_dir():
            raise ValueError(f"--trace-dir: {args.trace_dir} exists and is not a directory")
        case = _case_from_args(args)
        rows = run_rows(case, plan_options(args), trace_dir=args.trace_dir)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # (the trace directory: made, then unwritable)
        print(f"error: --trace-dir: cannot write {args.trace_dir}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    print(f"{len(case.stages)} stages × {case.microbatches} microbatches on "
          f"{case.cluster.num_hosts} × {args.cluster if args.case is None else 'cluster'}; "
          f"transfers: {args.strategy}/{args.balance}; signal = {_signal_of(case)} with "
          "latency-only transfers")
    print(format_rows(rows))
    if args.trace_dir is not None:
        print(f"traces written to {args.trace_dir}/sim-*.json (open in ui.perfetto.dev)")
    return 0
