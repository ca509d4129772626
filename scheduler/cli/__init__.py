"""Command line: ``python -m scheduler plan ...`` (also ``overlap plan ...``).

Examples::

    overlap plan --cluster p3.8xlarge --hosts 5 --shape 1024,1024,512 --dtype int32 \\
        --src-mesh 0:2 --src-spec=host,-,- --dst-mesh 2:4 --dst-spec=host,-,-
    overlap plan --case examples/cases/plan_case.json --strategy send_recv --show-transfers

(The paper's suite of cases: ``python benchmarks/reshard_suite.py``.)

Meshes on the command line are whole hosts ``FIRST:STOP`` (axes "host", "gpu"), optionally
``FIRST:STOPxGPUS`` for the first GPUS GPUs of each host. A spec is comma-separated entries:
``-`` (or ``None``) for an unsplit dim, an axis name, or names joined by ``+`` for a tuple
(``host+gpu`` = ("host", "gpu")); ``--src-spec -,host`` and ``--src-spec=-,host`` both work.
A JSON case file (``examples/cases/plan_case.json``) holds ``cluster`` (fields of Cluster, or
``{"preset": NAME, "num_hosts": N}``), ``shape``, ``dtype``, and ``src``/``dst`` each
``{"mesh": {"devices": [[...]], "axis_names": [...]}, "spec": [...]}``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..cluster import Cluster
from ..cost import lower_bound_for, paper_model_time, plan_report, ratio_text
from ..plan import transfers_text
from ..planner import plan_resharding
from ..sharding import Sharding
from .common import (
    Case,
    add_plan_options,
    case_from_json,
    interpret_case,
    joined_specs,
    parse_mesh,
    parse_spec,
    parser,
    plan_options,
    read_json_file,
    write_output,
)


def build_parser() -> argparse.ArgumentParser:
    p = parser("overlap plan", "Plan a cross-mesh resharding and cost it.")
    p.add_argument("--case", type=Path, default=None,
                   help="a resharding case file: JSON with cluster, shape, dtype, src, dst "
                        "(examples/cases/plan_case.json); replaces the flags below")
    p.add_argument("--cluster", default="p3.8xlarge", help="cluster preset")
    p.add_argument("--hosts", type=int, default=4, help="number of hosts of the preset")
    p.add_argument("--shape", default=None, help="comma-separated dims, e.g. 1024,1024,512")
    p.add_argument("--dtype", default="float32", help="numpy dtype name")
    p.add_argument("--src-mesh", default=None, help="FIRST:STOP[xGPUS] hosts of the source mesh")
    p.add_argument("--dst-mesh", default=None,
                   help="FIRST:STOP[xGPUS] hosts of the destination mesh")
    p.add_argument("--src-spec", default="",
                   help="source layout per dim: -, an axis, or axes joined by +; e.g. host,-,-")
    p.add_argument("--dst-spec", default="", help="destination layout, e.g. -,host,-")
    add_plan_options(p)
    p.add_argument("--show-transfers", action="store_true", help="list every transfer")
    p.add_argument("--json", type=Path, default=None, help="write the plan as JSON to this file")
    return p


def _case_from_args(args: argparse.Namespace) -> Case:
    if args.case is not None:
        data = read_json_file(args.case, "--case")
        return interpret_case(args.case, data, case_from_json)
    for name in ("shape", "src_mesh", "dst_mesh"):
        if getattr(args, name) is None:
            raise ValueError(f"--{name.replace('_', '-')} is required without --case")
    cluster = Cluster.preset(args.cluster, args.hosts)
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        raise ValueError(f"--shape: expected comma-separated ints, got {args.shape!r}") from None
    src = _sharding(args.src_mesh, args.src_spec, cluster, len(shape), side="src")
    dst = _sharding(args.dst_mesh, args.dst_spec, cluster, len(shape), side="dst")
    return Case("cli", shape, args.dtype, src, dst, cluster)


def _sharding(mesh_text: str, spec_text: str, cluster: Cluster, rank: int, *,
              side: str) -> Sharding:
    mesh = parse_mesh(mesh_text, cluster, argument=f"--{side}-mesh")
    try:
        sharding = Sharding(mesh, parse_spec(spec_text))
        sharding.spec.padded(rank)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"--{side}-spec: {exc}") from None
    return sharding


def plan_main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(joined_specs(sys.argv[1:] if argv is None else argv))
    try:
        if args.json is not None and args.json.is_dir():
            raise ValueError(f"--json: {args.json} is a directory; name the file to write")
        case = _case_from_args(args)
        plan = plan_resharding(case.shape, case.dtype, case.src, case.dst, case.cluster,
                               plan_options(args))
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(plan_report(plan, case.cluster))
    lb = lower_bound_for(case.shape, case.dtype, case.src, case.dst, case.cluster)
    paper = paper_model_time(plan, case.cluster)
    print(f"  paper's simple model: {paper * 1e3:.2f} ms ({ratio_text(paper, lb, case.shape)})")
    if args.show_transfers:
        print(transfers_text(plan.transfers))
    if args.json is not None:
        if not write_output(args.json, plan.to_json(), "--json"):
            return 2
        print(f"plan written to {args.json}")
    return 0


COMMANDS = {
    "plan": "plan a cross-mesh resharding and cost it",
    "simulate": "compare every pipeline schedule (and signal) on a pipeline",
    "partition": "choose a model's stages, submeshes, TP degrees, layouts and schedule "
                 "(--case FILE), by simulation",
    "trace": "trace report FILE [--json] | plot FILE -o PNG: busy, bubble, communication and "
             "how much of it was hidden (our traces, Nsight Systems, PyTorch profiler)",
    "profile": "profile [--steps A:B] [-o DIR] -- python train.py ...: run it under Nsight "
               "Systems, then report",
}


def main(argv: Sequence[str] | None = None, prog: str = "python -m scheduler") -> int:
    """Dispatch a subcommand; ``overlap`` and ``python -m scheduler`` both land here."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"{prog} {version('overlap')}")
        except PackageNotFoundError:  # run from a checkout that is not installed
            print(f"{prog} (not installed)")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {prog} [--version] COMMAND [options]   (see '{prog} COMMAND --help')"
              "\n\ncommands:")
        for name, what in COMMANDS.items():
            print(f"  {name:<9} {what}")
        return 0 if argv else 2
    if argv[0] == "plan":
        return plan_main(argv[1:])
    if argv[0] == "simulate":
        from .simulate import simulate_main

        return simulate_main(argv[1:])
    if argv[0] == "partition":
        from .partition import partition_main

        return partition_main(argv[1:])
    if argv[0] == "trace":
        from .trace import trace_main

        return trace_main(argv[1:])
    if argv[0] == "profile":
        from .profile import profile_main

        return profile_main(argv[1:])
    print(f"{prog}: unknown command {argv[0]!r}; known: {', '.join(COMMANDS)}", file=sys.stderr)
    return 2
