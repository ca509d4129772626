"""``overlap trace report|plot FILE``: figures and plots of a trace of any source — ours
(runtime or simulator), an Nsight Systems capture, a PyTorch profiler trace."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cli_common import parser


def trace_main(argv: Sequence[str]) -> int:
    p = parser("overlap trace", "Summarize a trace: ours (runtime or simulator, Chrome "
               "JSON), an Nsight Systems capture (its SQLite export, or a .nsys-rep), or a "
               "PyTorch profiler (Kineto) trace.")
    p.add_argument("action", choices=("report", "plot"),
                   help="report: per-device figures; plot: a PNG of per-device compute and "
                        "communication tracks (-o)")
    p.add_argument("file", type=Path, help="a trace written by the runtime or the simulator, "
                   "an Nsight Systems SQLite export or .nsys-rep, or a PyTorch profiler trace")
    p.add_argument("--json", action="store_true",
                   help="print the figures as JSON: {\"devices\": {\"<device>\": "
                        "{compute_ms, comm_ms, exposed_comm_ms, overlap_pct}}, steps, "
                        "iteration_ms, bubble_pct}")
    p.add_argument("-o", "--output", type=Path, default=Path("timeline.png"),
                   help="where plot writes its PNG")
    args = p.parse_args(argv)
    if not args.file.is_file():
        print(f"error: no such file: {args.file}", file=sys.stderr)
        return 2
    try:
        capture, tl = _read_trace(args.file)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.action == "plot":
        from .capture import plot_work

        try:
            print(f"wrote {plot_work(capture.work, args.output, title=args.file.name)}")
        except ImportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.json:
        print(json.dumps(trace_figures(capture, tl), indent=1))
        return 0
    print(trace_text(args.file, capture, tl))
    return 0


def trace_figures(capture: Any, tl: Any) -> dict[str, Any]:
    """The JSON of ``overlap trace report --json``: per-device figures, and the steps'
    (iteration time, bubble) where the source has them."""
    from .capture import device_figures, step_figures

    devices = {str(d): f for d, f in device_figures(capture.work).items()}
    out: dict[str, Any] = {"devices": devices}
    if tl is not None:  # one of our traces: one step, and how long compute waited for data
        for d, f in devices.items():
            f["waited_for_transfer_ms"] = tl.exposed_comm(int(d)) * 1e3
        out.update(steps=1, iteration_ms=tl.iteration_time * 1e3,
                   bubble_pct=100.0 * tl.bubble_fraction)
    else:
        out.update(step_figures(capture) or {})
    return out


def trace_text(path: Path, capture: Any, tl: Any) -> str:
    """The text of ``overlap trace report``."""
    from .capture import device_figures, figures_text, step_figures

    lines = [f"{path}:"]
    if tl is not None:
        lines.append(tl.report())
    elif not capture.work:
        lines.append("no GPU work in this capture (was CUDA traced? `nsys profile -t "
                     "cuda,nvtx`)")
    steps = step_figures(capture) if tl is None else None
    if steps is not None:
        lines.append(f"{steps['steps']} steps: iteration {steps['iteration_ms']:.3f} ms (mean), "
                     f"bubble {steps['bubble_pct']:.1f}%")
    elif tl is None and capture.work:
        lines.append("no step ranges in this capture: no iteration time or bubble (the "
                     "runtime opens one per train_step)")
    lines.append(figures_text(device_figures(capture.work)))
    return "\n".join(lines)


def _read_trace(path: Path) -> tuple[Any, Any]:
    """The attributed GPU work (a Capture) of a trace of any source, and our own Timeline
    when it is one of ours (ValueError naming the file otherwise)."""
    from .capture import Capture, timeline_work
    from .kineto import is_kineto, kineto_work
    from .nsys import is_sqlite, read_sqlite
    from .timeline import Timeline

    if path.suffix == ".nsys-rep":
        return read_sqlite(_exported(path)), None
    if is_sqlite(path):
        return read_sqlite(path), None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"path: {path} is not a trace written by overlap: "
                         f"{type(exc).__name__}: {exc}") from None
    if is_kineto(data):
        return kineto_work(data), None  # a PyTorch profiler trace
    tl = Timeline.from_chrome_json(data, path)
    return Capture(tuple(timeline_work(tl))), tl


def _exported(report: Path) -> Path:
    """The SQLite export of an ``.nsys-rep``: the one next to it when it is newer, else made
    with ``nsys`` when on PATH — next to it when no file has that name, else in a new
    temporary directory (a file the user did not name is never replaced)."""
    import shutil
    import subprocess
    import tempfile

    out = report.with_suffix(".sqlite")
    if out.is_file() and out.stat().st_mtime >= report.stat().st_mtime:
        return out
    if out.exists():  # (an older export, or anything else of that name: left alone)
        out = Path(tempfile.mkdtemp(prefix="overlap-nsys-")) / out.name
    nsys = shutil.which("nsys")
    if nsys is None:
        raise ValueError(f"{report}: a .nsys-rep is read through its SQLite export, and `nsys` "
                         f"is not on PATH here: run `nsys export --type sqlite {report}` "
                         "where Nsight Systems is installed (or capture with `nsys profile "
                         "--export sqlite`), then report the .sqlite")
    done = subprocess.run([nsys, "export", "--type", "sqlite", "--output", str(out),
                           str(report)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.is_file():
        raise ValueError(f"{report}: `nsys export` failed: {done.stderr.strip()[-500:]}")
    return out
