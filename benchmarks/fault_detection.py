"""Benchmark (not a test): how fast every planted fault is named, and how fast close() returns.

    python benchmarks/fault_detection.py [--timeout 1.0] [--mpi]

The fault matrix of ``tests/fault_pipeline.py`` — a 3-stage pipeline, every (stage,
microbatch, phase) × {raise, hang, wrong shape, wrong dtype} — each on a fresh runtime
(``timeout`` seconds): the time from the call to its error, the time ``close()`` takes after it,
and whether the next step (same runtime after a raise, a fresh one after a hang) gives the
reference losses. ``--mpi`` runs the same matrix on two ranks (``mpiexec -n 2``, the job of
``tests/mpi_jobs/job.py``) and reports both ranks. Prints one row per fault kind (cases, worst
and median detection, worst close) and the machine.

Then hangs that keep Python's interpreter lock (GIL) busy, ``--gil-repeats`` times each: a C
call holding it for 3 × ``timeout`` (nothing can run meanwhile: it is named when it returns),
and pure-Python busy loops on 1, 2, 4 and 8 devices at once (each stage thread takes the lock
back every 5 ms, so the runtime's watch gets it only now and then): how long the op had run
when it was named, against the timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the fault pipeline the tests use

from fault_pipeline import CLUSTER, KINDS, FaultyMLP, every_fault  # noqa: E402

import overlap  # noqa: E402
from scheduler.cli.common import line_buffered_stdout, machine_line  # noqa: E402


def one_process(timeout: float) -> list[dict]:
    with overlap.Runtime(CLUSTER, timeout=timeout) as rt:
        reference = FaultyMLP().step(rt)
    rows = []
    for fault in every_fault():
        model = FaultyMLP(fault)
        rt = overlap.Runtime(CLUSTER, timeout=timeout)
        start = time.perf_counter()
        try:
            model.step(rt)
            error = None
        except overlap.OverlapRuntimeError as exc:
            error = exc
        seconds = time.perf_counter() - start
        if fault.kind != "hang":
            model.fault = None
            ok = model.step(rt) == reference  # the same runtime recovered
        start = time.perf_counter()
        rt.close()
        closed = time.perf_counter() - start
        model.release.set()
        if fault.kind == "hang":
            with overlap.Runtime(CLUSTER, timeout=timeout) as fresh:
                ok = FaultyMLP().step(fresh) == reference
        rows.append({"fault": str(fault), "kind": fault.kind, "error": type(error).__name__
                     if error else None, "seconds": seconds, "close_seconds": closed,
                     "next_step_ok": ok})
    return rows


def two_ranks() -> list[dict]:
    mpiexec = shutil.which("mpiexec") or shutil.which("mpiexec",
                                                       path=str(Path(sys.executable).parent))
    if mpiexec is None:
        raise SystemExit("--mpi: no mpiexec (pip install mpich)")
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA_"))}
        env["OPENBLAS_NUM_THREADS"] = "1"
        subprocess.run([mpiexec, "-n", "2", sys.executable, str(ROOT / "tests/mpi_jobs/job.py"),
                        "faults", out], check=True, env=env, timeout=600)
        rows = []
        for r in (0, 1):
            for row in json.loads((Path(out) / f"faults{r}.json").read_text()):
                rows.append({**row, "kind": row["fault"].split("@")[0]})
        return rows


def gil_hangs(timeout: float, repeats: int) -> list[str]:
    """Rows of the GIL section (see module doc)."""
    import ctypes
    import threading

    from gil_pipeline import spinning_step

    lines = ["| hang | runs | named right | ran when named: median | worst | next step right |",
             "|---|---|---|---|---|---|"]
    with overlap.Runtime(CLUSTER, timeout=timeout) as rt:
        reference = FaultyMLP().step(rt)
    cases: list[tuple[str, object]] = [("C call holding the GIL 3 × timeout", None)]
    cases += [(f"Python busy loops on {n} device(s)", n) for n in (1, 2, 4, 8)]
    for label, n in cases:
        ran, right, next_ok = [], 0, 0
        for _ in range(repeats):
            if n is None:
                class Held(FaultyMLP):
                    def _planted(self, ctx):
                        if (ctx.stage, ctx.microbatch, ctx.phase, ctx.device) == (1, 0, "F", 4):
                            ctypes.PyDLL(None).usleep(int(3 * timeout * 1e6))
                with overlap.Runtime(CLUSTER, timeout=timeout) as rt:
                    try:
                        Held().step(rt)
                    except overlap.StageTimeout as exc:
                        ran.append(exc.seconds)
                        right += (exc.stage, exc.microbatch, exc.phase) == (1, 0, "F")
                    next_ok += FaultyMLP().step(rt) == reference
                continue
            release = threading.Event()
            err = spinning_step(n, timeout, release)
            release.set()
            ran.append(err.seconds)
            right += (err.stage, err.microbatch, err.phase) == (0, 1, "F")
            next_ok += 1  # (a fresh runtime: the spinning threads were abandoned)
        lines.append(f"| {label} | {repeats} | {right}/{repeats} | "
                     f"{statistics.median(ran):.2f} s | {max(ran):.2f} s | "
                     f"{next_ok}/{repeats} |")
    return lines


def table(title: str, rows: list[dict]) -> str:
    lines = [f"{title}", "| fault | cases | errors named | worst detection | median | "
             "worst close() | next step right |", "|---|---|---|---|---|---|---|"]
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        named = sum(1 for r in mine if r["error"])
        secs = [r["seconds"] for r in mine]
        lines.append(f"| {kind} | {len(mine)} | {named} | {max(secs):.2f} s | "
                     f"{statistics.median(secs):.2f} s | "
                     f"{max(r['close_seconds'] for r in mine):.2f} s | "
                     f"{sum(r['next_step_ok'] for r in mine)}/{len(mine)} |")
    return "\n".join(lines)


def main() -> None:
    line_buffered_stdout()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=1.0)
    ap.add_argument("--mpi", action="store_true", help="also the matrix on two MPI ranks")
    ap.add_argument("--gil-repeats", type=int, default=5,
                    help="runs of each GIL hang (0: skip that section)")
    args = ap.parse_args()
    print(machine_line())
    print(f"timeout {args.timeout:g} s; {sum(1 for _ in every_fault())} faults per run "
          "(stage-0 backward's shape/dtype faults are harmless by contract: its result is "
          "ignored)\n")
    print(table("one process (CPU backend)", one_process(args.timeout)))
    if args.mpi:
        print()
        print(table("two ranks (mpiexec -n 2), both ranks' rows", two_ranks()))
    if args.gil_repeats > 0:
        print(f"\nhangs that keep the GIL busy (one process, timeout {args.timeout:g} s)")
        for line in gil_hangs(args.timeout, args.gil_repeats):
            print(line, flush=True)


if __name__ == "__main__":
    main()
