"""``overlap simulate``: compare every pipeline schedule (and ``signal``) on one pipeline.

Flags describe a uniform pipeline: ``--stages`` stages, stage ``s`` on host ``s`` of a cluster
preset (its first ``--gpus-per-stage`` GPUs, mesh axes "host", "gpu"), one boundary tensor
layout for every stage boundary, and per-microbatch compute times. A JSON case file
(``--case``) can give anything else::

    {"cluster": {"preset": "p3.8xlarge", "num_hosts": 4},
     "stages": [{"devices": [[0, 1, 2, 3]], "axis_names": ["host", "gpu"]}, ...],
     "boundaries": [{"shape": [1024, 8192], "dtype": "float16",
                     "producer": [null, "gpu"], "consumer": ["gpu", null]}, ...],
     "microbatches": 16,
     "compute_ms": {"F": 50, "B": 100},       # or a list per stage: [{"F": .., "B": ..}, ...]
     "data_parallel": {"1": {"axis": "dp", "nbytes": 1073741824}}}   # optional

``data_parallel`` names the stages whose mesh axis splits the batch, with their gradients'
bytes per device: each schedule's graph then reduces them after the stage's last backward
(:class:`~scheduler.DataParallel`), as ``overlap partition --json`` writes for its dp stages.

Schedules that split the backward (zb-h1, zbv, and auto's split candidates) take ``I`` and
``W`` from ``compute_ms`` when given, else half of ``B`` each. The schedules with two stages
per rank (interleaved-1f1b, zbv) run, from flags, the same model on the same hosts cut into
twice as many half stages (each ``F/2``, ``B/2``, the same boundary tensor between every
pair), placed as the schedule says; from a case file, the case's own stages, when the stages
the schedule puts on one rank share a mesh. A case may also hold a ``schedule``
(``Schedule.to_json``'s object, as ``overlap partition --json`` writes): its row is added,
and its signal row when it runs several stages per rank (the fixed schedules then do not
apply: the case's stages share meshes).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..auto import auto_schedule
from ..cluster import Cluster
from ..graph import DataParallel
from ..lowering import Boundary, _check_meshes, lower
from ..mesh import DeviceMesh
from ..planner import PlanCache, PlanOptions
from ..schedules import (
    ALL_SCHEDULES,
    MAX_STAGE_MICROBATCHES,
    SCHEDULES,
    Schedule,
    make_schedule,
)
from ..sharding import Sharding, ShardingSpec
from ..simulator import simulate
from ..timeline import Timeline
from .common import (
    add_plan_options,
    interpret_case,
    joined_specs,
    parse_spec,
    parser,
    plan_options,
    read_json_file,
)

EVERY_SCHEDULE = (*ALL_SCHEDULES, "auto")
HALF_STAGE_SCHEDULES = ("interleaved-1f1b", "zbv")  # two stages per rank


@dataclass(frozen=True)
class PipelineCase:
    cluster: Cluster
    stages: tuple[DeviceMesh, ...]
    boundaries: tuple[Boundary, ...]
    microbatches: int
    compute: dict[tuple[int, str], float]  # seconds; F, B, I, W per stage
    # From flags: the same pipeline cut into two half stages per rank, placed as the given
    # schedule (of twice the stages) says. None for a case file (its stages are the stages).
    halves: Callable[[Schedule], PipelineCase] | None = field(default=None, compare=False)
    schedule: Schedule | None = None  # the case's own (a partition plan's), if it has one
    data_parallel: dict[int, DataParallel] = field(default_factory=dict)  # (a case file's)


@dataclass(frozen=True)
class Row:
    label: str
    timeline: Timeline
    peak: float = 0.0  # rank 0's peak activations, in full stages' microbatches
    chosen: str = ""  # auto: the candidate it chose


def schedule_case(name: str, case: PipelineCase) -> tuple[Schedule | None, PipelineCase]:
    """The schedule ``name`` (None for auto) and the case it runs on; ValueError saying why
    ``name`` does not apply to ``case``."""
    if name not in EVERY_SCHEDULE:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(EVERY_SCHEDULE)}")
    p, m = len(case.stages), case.microbatches
    if name in HALF_STAGE_SCHEDULES and case.halves is not None:
        sched = make_schedule(name, 2 * p, m)
        return sched, case.halves(sched)
    sched = make_schedule("1f1b" if name == "auto" else name, p, m)
    _check_meshes(case.stages, sched, case.cluster)  # (the stages each rank runs)
    return (None if name == "auto" else sched), case


def run_rows(case: PipelineCase, options: PlanOptions | None = None, *,
             schedules: Sequence[str] = SCHEDULES, signal_schedule: str = "eager-1f1b",
             trace_dir: Path | None = None) -> tuple[list[Row], list[tuple[str, str]]]:
    """Simulate each schedule that applies to ``case``, plus ``signal`` (``signal_schedule``
    with latency-only comm); each boundary is planned once for all rows. Returns the rows
    and the schedules that do not apply, with the reason."""
    rows, skipped = [], []
    cache = PlanCache(case.cluster)
    own = case.schedule
    runs: list[tuple[str, str | Schedule]] = [(name, name) for name in schedules]
    if own is not None and own.name not in schedules:
        runs.append((own.name, own))
    runs.append(("signal", own if own is not None and own.stages_per_rank > 1
                 else signal_schedule))
    for label, what in runs:
        try:
            sched, c = (what, case) if isinstance(what, Schedule) else \
                schedule_case(what, case)
        except ValueError as exc:
            skipped.append((label, str(exc)))
            continue
        chosen = ""
        if sched is None:
            choice = auto_schedule(c.stages, c.boundaries, c.microbatches, c.cluster,
                                   c.compute, options, cache=cache,
                                   data_parallel=c.data_parallel)
            sched, graph = choice.schedule, choice.graph
            chosen = sched.name.removeprefix("auto (").removesuffix(")")
        else:
            graph = lower(c.stages, c.boundaries, sched, c.cluster, options, cache=cache,
                          data_parallel=c.data_parallel)
        tl = simulate(graph, c.cluster, c.compute, signal=label == "signal")
        if trace_dir is not None:
            tl.to_chrome_trace(Path(trace_dir) / f"sim-{label}.json")
        peak = sched.peak_rank_activations(0) / sched.stages_per_rank
        rows.append(Row(label, tl, peak, chosen))
    return rows, skipped


def format_rows(rows: Sequence[Row], reference: str = "signal") -> str:
    ref = next((r.timeline.iteration_time for r in rows if r.label == reference), None)
    head = ["schedule", "iteration ms", f"/ {reference}", "bubble", "exposed comm",
            "compute waited", "peak act. rank 0"]
    body = []
    for r in rows:
        t = r.timeline
        body.append([
            r.label, f"{t.iteration_time * 1e3:.1f}",
            f"{t.iteration_time / ref:.3f}" if ref else "-",
            f"{t.bubble_fraction:.1%}", f"{t.exposed_comm_fraction:.1%}",
            f"{t.transfer_wait_fraction:.1%}", f"{r.peak:g}",
        ])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda row: "  ".join(x.rjust(w) for x, w in zip(row, widths))
    note = ("exposed comm: communication while a device computed nothing; compute waited: "
            "its compute stream idle\nfor a transfer bringing an input (part of exposed); "
            "both as shares of the iteration, mean over devices")
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body), note])


def case_from_json(data: dict[str, Any]) -> PipelineCase:
    missing = {"cluster", "stages", "boundaries", "microbatches", "compute_ms"} - set(data)
    if missing:
        raise ValueError(f"case file: missing keys {sorted(missing)}")
    cluster = Cluster.from_dict(data["cluster"])
    if not isinstance(data["stages"], list):
        raise ValueError(f"stages: expected a list of stage meshes, got "
                         f"{type(data['stages']).__name__}")
    _check_size(len(data["stages"]), 1, "stages")
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
    m = _count(data["microbatches"], "microbatches")
    _check_size(len(stages), m, "microbatches")
    schedule = None
    if "schedule" in data:
        schedule = Schedule.from_json(json.dumps(data["schedule"]))
        if (schedule.num_stages, schedule.num_microbatches) != (len(stages), m):
            raise ValueError(f"schedule: {schedule.name} is for {schedule.num_stages} stages × "
                             f"{schedule.num_microbatches} microbatches; the case has "
                             f"{len(stages)} × {m}")
    return PipelineCase(cluster, stages, tuple(boundaries), m,
                        _compute_table(data["compute_ms"], len(stages)), schedule=schedule,
                        data_parallel=_data_parallel(data.get("data_parallel", {}), stages))


def _count(value: Any, field: str) -> int:
    """A case file's count (``microbatches``): an int >= 1 — not a bool, a float (NaN,
    infinite or whole), or a string; ValueError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}: expected an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{field}: expected an int >= 1, got {value}")
    return value


def _check_size(stages: int, microbatches: int, field: str) -> None:
    """ValueError naming ``field`` when ``stages`` × ``microbatches`` is more than any
    schedule lists (:data:`~scheduler.schedules.MAX_STAGE_MICROBATCHES` pairs): refused
    before a mesh or boundary is made."""
    if stages * microbatches > MAX_STAGE_MICROBATCHES:
        raise ValueError(f"{field}: {stages} stages × {microbatches} microbatches is more "
                         f"than {MAX_STAGE_MICROBATCHES} (stage, microbatch) pairs, the most "
                         "one schedule runs")


def _data_parallel(spec: Any, stages: tuple[DeviceMesh, ...]) -> dict[int, DataParallel]:
    """A case's ``data_parallel``: ``{"<stage>": {"axis": name, "nbytes": bytes}}``."""
    if not isinstance(spec, dict):
        raise ValueError(f"data_parallel: expected an object stage -> {{axis, nbytes}}, got "
                         f"{type(spec).__name__}")
    out: dict[int, DataParallel] = {}
    for key, entry in spec.items():
        if not str(key).isdigit() or not int(key) < len(stages):
            raise ValueError(f"data_parallel: key {key!r} is not a stage (0..{len(stages) - 1})")
        if not isinstance(entry, dict) or set(entry) != {"axis", "nbytes"}:
            raise ValueError(f"data_parallel[{key}]: expected {{\"axis\": name, \"nbytes\": "
                             f"bytes}}, got {entry!r}")
        s = int(key)
        if entry["axis"] not in stages[s].axis_names:
            raise ValueError(f"data_parallel[{key}]: stage {s}'s mesh has no axis "
                             f"{entry['axis']!r}")
        out[s] = DataParallel(entry["axis"], entry["nbytes"])
    return out


def _compute_table(spec: Any, num_stages: int) -> dict[tuple[int, str], float]:
    per_stage = spec if isinstance(spec, list) else [spec] * num_stages
    if len(per_stage) != num_stages:
        raise ValueError(f"compute_ms: {len(per_stage)} entries for {num_stages} stages")
    out = {}
    for s, entry in enumerate(per_stage):
        for k in ("F", "B"):
            if k not in entry:
                raise ValueError(f"compute_ms: stage {s} has no {k!r} time")
            out[(s, k)] = float(entry[k]) / 1e3
        for k in ("I", "W"):  # a split backward: half of B each unless given
            out[(s, k)] = float(entry[k]) / 1e3 if k in entry else out[(s, "B")] / 2
    return out


@dataclass(frozen=True)
class UniformPipeline:
    """What the flags describe: every stage alike, stage s on host ``host_of[s]``."""

    cluster: Cluster
    gpus: int
    shape: tuple[int, ...]
    dtype: str
    src_spec: ShardingSpec
    dst_spec: ShardingSpec
    fwd_s: float
    bwd_s: float
    microbatches: int

    def case(self, host_of: Sequence[int], scale: float = 1.0) -> PipelineCase:
        """``len(host_of)`` stages, each ``scale`` of a stage's compute."""
        stages = tuple(self.cluster.mesh([h], gpus=self.gpus) for h in host_of)
        boundaries = tuple(
            Boundary(self.shape, self.dtype, Sharding(stages[s], self.src_spec),
                     Sharding(stages[s + 1], self.dst_spec)) for s in range(len(stages) - 1))
        f, b = self.fwd_s * scale, self.bwd_s * scale
        compute = {(s, k): v for s in range(len(stages))
                   for k, v in (("F", f), ("B", b), ("I", b / 2), ("W", b / 2))}
        return PipelineCase(self.cluster, stages, boundaries, self.microbatches, compute,
                            self._halves if scale == 1.0 else None)

    def _halves(self, schedule: Schedule) -> PipelineCase:
        return self.case([schedule.rank_of(v) for v in range(schedule.num_stages)], 0.5)


def _signal_of(case: PipelineCase) -> str:
    own = case.schedule
    return own.name if own is not None and own.stages_per_rank > 1 else "eager-1f1b"


def _checked_spec(text: str, mesh: DeviceMesh, ndim: int, flag: str) -> ShardingSpec:
    try:
        spec = Sharding(mesh, parse_spec(text)).spec
        spec.padded(ndim)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{flag}: {exc}") from None
    return spec


def _case_from_args(args: argparse.Namespace) -> PipelineCase:
    if args.case is not None:
        data = read_json_file(args.case, "--case")
        return interpret_case(args.case, data, case_from_json)
    if args.shape is None:
        raise ValueError("--shape is required without --case")
    _check_counts(args)
    if args.hosts is not None and args.hosts < args.stages:
        raise ValueError(f"--hosts: {args.hosts} hosts for {args.stages} stages (stage s runs "
                         "on host s); give at least as many hosts as stages, or omit --hosts")
    cluster = Cluster.preset(args.cluster, args.hosts or args.stages)
    gpus = cluster.gpus_per_host if args.gpus_per_stage is None else args.gpus_per_stage
    if not 1 <= gpus <= cluster.gpus_per_host:
        raise ValueError(f"--gpus-per-stage: {gpus} not in 1..{cluster.gpus_per_host}")
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        raise ValueError(f"--shape: expected comma-separated ints, got {args.shape!r}") from None
    mesh = cluster.mesh([0], gpus=gpus)
    src = _checked_spec(args.src_spec, mesh, len(shape), "--src-spec")
    dst = _checked_spec(args.dst_spec, mesh, len(shape), "--dst-spec")
    for name in ("fwd_ms", "bwd_ms"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 0")
    pipeline = UniformPipeline(cluster, gpus, shape, args.dtype, src, dst, args.fwd_ms / 1e3,
                               args.bwd_ms / 1e3, args.microbatches)
    return pipeline.case(range(args.stages))


def _check_counts(args: argparse.Namespace) -> None:
    """The flags' counts, before any mesh is made: --stages, --microbatches and
    --gpus-per-stage >= 1 (0 GPUs is no stage), stages × microbatches within
    :data:`~scheduler.schedules.MAX_STAGE_MICROBATCHES`."""
    for flag, value in (("--stages", args.stages), ("--microbatches", args.microbatches),
                        ("--gpus-per-stage", args.gpus_per_stage)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: need at least 1, got {value}")
    _check_size(args.stages, args.microbatches, "--stages" if args.stages >
                MAX_STAGE_MICROBATCHES else "--microbatches")


def _schedules(text: str | None, case: PipelineCase) -> tuple[list[str], list[str]]:
    """The schedules to run, and notes on those left out (default: every one that applies);
    ValueError naming --schedules for an unknown one or one asked for that does not apply."""
    if text is None:
        names, notes = [], []
        for name in EVERY_SCHEDULE:
            try:
                schedule_case(name, case)
                names.append(name)
            except ValueError as exc:
                notes.append(f"not run: {name} ({exc})")
        return names, notes
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise ValueError("--schedules: name at least one schedule")
    for name in names:
        try:
            schedule_case(name, case)
        except ValueError as exc:
            raise ValueError(f"--schedules: {name}: {exc}") from None
    return list(dict.fromkeys(names)), []


def build_parser() -> argparse.ArgumentParser:
    p = parser("overlap simulate",
               "Simulate every pipeline schedule (gpipe, 1f1b, eager-1f1b, zb-h1, "
               "interleaved-1f1b, zbv, auto) and signal for one pipeline.")
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
    p.add_argument("--src-spec", default="", help="producer layout, e.g. -,gpu (default: "
                   "replicated)")
    p.add_argument("--dst-spec", default="", help="consumer layout, e.g. gpu,- (default: "
                   "replicated)")
    p.add_argument("--fwd-ms", type=float, default=10.0, help="forward per microbatch")
    p.add_argument("--bwd-ms", type=float, default=20.0,
                   help="backward per microbatch (split schedules: input and weight gradient "
                        "half of it each)")
    p.add_argument("--schedules", default=None,
                   help=f"comma-separated, of {', '.join(EVERY_SCHEDULE)} (default: every one "
                        "that applies to the pipeline; interleaved-1f1b and zbv cut each "
                        "stage in two half stages on the same host)")
    add_plan_options(p)
    p.add_argument("--trace-dir", type=Path, default=None,
                   help="write a Perfetto trace per row here")
    return p


def _none_ran(skipped: Sequence[tuple[str, str]], argument: str) -> str:
    """The error when no row ran: every schedule refused the pipeline (the reasons, each
    once)."""
    why = "; ".join(dict.fromkeys(reason for _, reason in skipped)) or "none was asked for"
    return f"{argument}: no schedule applies to this pipeline: {why}"


def simulate_main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(joined_specs(sys.argv[1:] if argv is None else argv))
    try:
        if args.trace_dir is not None and args.trace_dir.exists() \
                and not args.trace_dir.is_dir():
            raise ValueError(f"--trace-dir: {args.trace_dir} exists and is not a directory")
        case = _case_from_args(args)
        names, notes = _schedules(args.schedules, case)
        rows, skipped = run_rows(case, plan_options(args), schedules=names,
                                 trace_dir=args.trace_dir)
        if not rows:
            raise ValueError(_none_ran(skipped, "--schedules" if args.case is None
                                       else f"--case: {args.case}"))
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
    for r in rows:
        if r.chosen:
            print(f"{r.label}'s choice: {r.chosen}")
    for note in [*notes, *(f"not run: {name} ({why})" for name, why in skipped)]:
        print(note)
    if args.trace_dir is not None:
        print(f"traces written to {args.trace_dir}/sim-*.json (open in ui.perfetto.dev)")
    return 0
