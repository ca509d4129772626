"""``overlap profile``: run a training script under Nsight Systems, then report how much of its
communication was hidden.

    overlap profile --steps 3:5 -o prof -- python train.py --my-args

runs ``nsys profile`` with CUDA and NVTX tracing, an SQLite export and — with ``--steps`` — a
capture range on the CUDA profiler API: the environment variable ``OVERLAP_PROFILE_STEPS``
tells the script's :class:`overlap.Runtime` which steps to record (it calls
``cudaProfilerStart`` before the first and ``cudaProfilerStop`` after the last). Multi-process
jobs work the same way (``-- mpiexec -n 4 python train.py``): nsys follows child processes.
Then prints ``overlap trace report`` of the capture.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ..traces.capture import PROFILE_STEPS_ENV, steps_window
from ..traces.nsys import read_sqlite
from ..traces.report import Trace, file_report, report_json, report_text
from .common import output_dir, parser

INSTALL = ("Nsight Systems' `nsys` is not on PATH: install it (https://developer.nvidia.com/"
           "nsight-systems, or the `nsight-systems-cli` package of NVIDIA's CUDA apt/yum "
           "repository) on the machine with the GPUs, or put its bin/ folder on PATH")


def nsys_command(nsys: str, output: Path, window: range | None,
                 command: Sequence[str]) -> list[str]:
    """The ``nsys profile`` command line that records ``command`` for the report."""
    cmd = [nsys, "profile", "--trace=cuda,nvtx", "--sample=none", "--export=sqlite",
           "--force-overwrite=true", f"--output={output}"]
    if window is not None:  # record only between cudaProfilerStart and Stop
        cmd += ["--capture-range=cudaProfilerApi", "--capture-range-end=stop"]
    return cmd + list(command)


def profile_main(argv: Sequence[str]) -> int:

    p = parser("overlap profile", "Run a training script under Nsight Systems (nsys) and "
               "report per-device compute, communication and how much of it was hidden. "
               "Usage: overlap profile [--steps A:B] [-o DIR] -- python train.py ...")
    p.add_argument("--steps", default=None,
                   help="record only training steps A..B-1 (counting from 0), e.g. 3:5; "
                        "default: the whole run")
    p.add_argument("-o", "--output", type=output_dir, default=Path("profile"),
                   help="folder for the capture (profile.nsys-rep, profile.sqlite)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("command", nargs="*", help="the program to profile, after --")
    args = p.parse_args(argv)
    if not args.command:
        p.error("command: give the program to profile after --, e.g. "
                "overlap profile -- python train.py")
    try:
        window = steps_window(args.steps, "--steps") if args.steps is not None else None
    except (TypeError, ValueError) as exc:
        p.error(str(exc))
    nsys = shutil.which("nsys")
    if nsys is None:
        print(f"error: {INSTALL}", file=sys.stderr)
        return 2
    try:
        args.output.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"error: -o: cannot make the directory {args.output}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    base = args.output / "profile"
    env = dict(os.environ)
    if window is not None:
        env[PROFILE_STEPS_ENV] = f"{window.start}:{window.stop}"
    sqlite = base.with_suffix(".sqlite")
    sqlite.unlink(missing_ok=True)  # (never report an older run's capture)
    done = subprocess.run(nsys_command(nsys, base, window, args.command), env=env)
    if not sqlite.is_file():
        print(f"error: nsys wrote no {sqlite} (exit status {done.returncode}); see its "
              "output above", file=sys.stderr)
        return done.returncode or 2
    try:
        capture = read_sqlite(sqlite)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = [file_report(Trace(sqlite, capture, None, "nsys"))]
    print(json.dumps(report_json(report), indent=1) if args.json else report_text(report))
    if done.returncode != 0:
        print(f"note: the profiled program exited with status {done.returncode}",
              file=sys.stderr)
    return done.returncode
