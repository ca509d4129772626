"""``overlap trace report|plot FILE...``: figures and pictures of traces of any source — ours
(runtime or simulator), an Nsight Systems capture, a PyTorch profiler trace — one file, or
one per rank of a job, merged."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..exposure import DEFINITION
from .common import OneLineErrors

HELP = f"""\
report: one table, per device: compute, communication (comm), exposed communication,
overlap %, and the time the compute stream waited for transfers; then the GPU work inside
none of the runtime's ranges (unattributed, per GPU: never guessed onto a device; memcpy,
memset and synchronizations are neither compute nor comm), each GPU's span, idle, compute
and non-compute time (as Holistic Trace Analysis's temporal breakdown), and iteration time
and bubble from the steps. The same definitions for every source:

{textwrap.fill(DEFINITION + ".", 88, initial_indent="  ", subsequent_indent="  ")}

plot: one row per device stream (compute; one per comm channel: fwd<s>, bwd<s>, and
fwd<s>.<lane>), each op its own bar with its kind and microbatch where they fit, the
compute stream's waits for transfers hatched, a legend; several files one under the other.

Several FILEs are the ranks of one job (one file per process, each with its own devices):
one report with a per-rank breakdown, or one picture. They are ordered by the rank each
PyTorch trace names (distributedInfo.rank) when every file names one, else taken in the
order given as ranks 0, 1, ...

--json keys: definition; devices: {{"<device>": {{compute_ms, comm_ms, exposed_comm_ms,
overlap_pct (null without communication), waited_for_transfer_ms, stages, rank}}}};
unattributed: [{{rank, gpu, compute_ms, ...}}]; gpus: [{{rank, gpu, span_ms, idle_ms,
compute_ms, non_compute_ms}}] (every GPU's work, classed as Holistic Trace Analysis classes
it); steps, iteration_ms, bubble_pct (when the traces have steps: the fewest steps, the
longest iteration and the bubble over every device, of several ranks); ranks: [{{rank, file,
source, devices, steps, iteration_ms, bubble_pct}}].
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrors(
        prog="overlap trace", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Summarize or draw traces: ours (runtime or simulator, Chrome JSON),\n"
                    "Nsight Systems captures (SQLite export, or .nsys-rep), PyTorch profiler\n"
                    "(Kineto) traces, with or without GPU work.", epilog=HELP)
    p.add_argument("action", choices=("report", "plot"),
                   help="report: per-device figures; plot: a picture (-o)")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE",
                   help="a trace of any of those sources; several: one per rank")
    p.add_argument("--json", action="store_true", help="report: print the figures as JSON")
    p.add_argument("-o", "--output", type=Path, default=Path("timeline.png"),
                   help="plot: the file to write, exactly this name; its suffix is the format: "
                        ".png, .svg or .pdf (default: timeline.png)")
    return p


def trace_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check_arguments(args)
        from ..traces.report import check_ranks, file_report, in_rank_order, read_trace

        ranked = in_rank_order([read_trace(f) for f in args.files])
        if args.action == "plot":
            print(f"wrote {_plot(ranked, args.output)}")
            return 0
        reports = [file_report(t, rank) for rank, t in ranked]
        check_ranks(reports)
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # (writing the picture)
        print(f"error: -o: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(_render(reports, args.json))
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    """Every argument checked before any file is read (ValueError naming it)."""
    for f in args.files:
        if not f.is_file():
            raise ValueError(f"file: no such file: {f}" if not f.exists() else
                             f"file: {f} is not a regular file")
    if args.action == "report":
        return
    from ..traces.plot import check_output, pyplot

    check_output(args.output)
    pyplot("overlap trace plot")  # (ImportError without the viz extra, before any work)
    parent = next((p for p in args.output.absolute().parents if p.exists()), None)
    if args.output.is_dir() or parent is None or not parent.is_dir() \
            or not os.access(args.output if args.output.exists() else parent, os.W_OK):
        raise ValueError(f"-o: cannot write {args.output} (a folder, or no permission)")


def _render(reports: Sequence[Any], as_json: bool) -> str:
    from ..traces.report import report_json, report_text

    return json.dumps(report_json(reports), indent=1) if as_json else report_text(reports)


def _plot(ranked: Sequence[tuple[int, Any]], output: Path) -> Path:
    from ..traces.plot import plot_rows, traces_rows

    traces = [t for _, t in ranked]
    title = ", ".join(str(t.path) for t in traces)
    if len(traces) == 1 and traces[0].timeline is not None:
        title += ": " + traces[0].timeline.headline()
    return plot_rows(traces_rows(traces, [rank for rank, _ in ranked]), output, title)
