"""Resharding planner benchmark (not a test): the paper's suite, a scale row, a random suite.

Every number is a ratio to the physical lower bound, computed in this run, so the table means
the same on any machine; planning times are wall-clock on this machine (stated on top).

    python benchmarks/reshard_suite.py [--suite paper|scale|random|all] [--random N] [--seed S]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from suite_report import AUTO, CaseResult, format_ratio_summary, format_table, run_case
from suites import paper_suite, random_suite, scale_case

from scheduler import PlanOptions, estimate, lower_bound, paper_model_time, plan_resharding
from scheduler.cli.common import line_buffered_stdout, machine_line


def scale_row() -> str:
    case = scale_case()
    lines = [f"{case.name}: {case.src.spec!r} on (64, 8) -> {case.dst.spec!r} on (64, 8), "
             f"{case.shape} {case.dtype}"]
    lb = lower_bound(case.shape, case.dtype, case.src, case.dst, case.cluster)
    for strategy, balance in (("send_recv", "size"), ("broadcast", "size"),
                              ("broadcast", "auto")):
        t0 = time.perf_counter()
        plan = plan_resharding(case.shape, case.dtype, case.src, case.dst, case.cluster,
                               PlanOptions(strategy=strategy, balance=balance))
        secs = time.perf_counter() - t0
        est = estimate(plan, case.cluster)
        lines.append(
            f"  {strategy}/{balance:<5} plan {secs:6.3f} s  {len(plan.transfers):5d} transfers  "
            f"estimate {est * 1e3:8.3f} ms  bound {lb * 1e3:8.3f} ms  ratio {est / lb:.3f}  "
            f"paper model ratio {paper_model_time(plan, case.cluster) / lb:.3f}"
        )
    return "\n".join(lines)


def scale_table(hosts: tuple[int, ...] = (128, 256, 512, 1024)) -> str:
    """broadcast + auto on the scale case at growing cluster sizes: planning time, transfers,
    and the plan's ratio to the lower bound under both models (issue 16's table)."""
    lines = [f"{'hosts (GPUs)':<14}{'plan s':>8}{'transfers':>11}{'cost model':>12}"
             f"{'paper model':>13}{'estimate s':>12}"]
    for n in hosts:
        case = scale_case(n)
        lb = lower_bound(case.shape, case.dtype, case.src, case.dst, case.cluster)
        t0 = time.perf_counter()
        plan = plan_resharding(case.shape, case.dtype, case.src, case.dst, case.cluster,
                               PlanOptions(strategy="broadcast", balance="auto"))
        secs = time.perf_counter() - t0
        t1 = time.perf_counter()
        est = estimate(plan, case.cluster)
        est_secs = time.perf_counter() - t1
        lines.append(f"{f'{n} ({8 * n})':<14}{secs:>8.2f}{len(plan.transfers):>11}"
                     f"{est / lb:>12.3f}{paper_model_time(plan, case.cluster) / lb:>13.3f}"
                     f"{est_secs:>12.2f}")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def paper_table() -> list[CaseResult]:
    paper = [run_case(c) for c in paper_suite()]
    print("== paper suite (5 x p3.8xlarge, int32) ==")
    print(format_table(paper))
    print()
    print(format_ratio_summary(paper))
    worst = max(max(r.ratio(AUTO), r.ratio(AUTO, paper=True)) for r in paper)
    print(f"target broadcast+auto <= 1.05 x bound on every paper case, both models: "
          f"worst {worst:.3f} -> {'met' if worst <= 1.05 else 'NOT met'}")
    return paper


def random_table(num_cases: int, seed: int) -> list[CaseResult]:
    print(f"== random suite ({num_cases} cases, seed {seed}) ==")
    rand = [run_case(c) for c in random_suite(num_cases, seed)]
    print(format_table(rand))
    print()
    print(format_ratio_summary(rand))
    ratios = [r.ratio(AUTO) for r in rand]
    mean, worst = statistics.mean(ratios), max(ratios)
    ok = mean <= 1.02 and worst <= 1.10
    print(f"target auto mean <= 1.02, worst <= 1.10: mean {mean:.3f}, worst {worst:.3f} -> "
          f"{'met' if ok else 'NOT met'}")
    return rand


def main() -> int:
    line_buffered_stdout()
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=("paper", "scale", "scale-table", "random", "all"),
                    default="all")
    ap.add_argument("--random", type=int, default=48, help="random cases")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(machine_line())
    print("estimates in ms under the project cost model; ratios to the lower bound\n")
    t0 = time.perf_counter()
    results: list[CaseResult] = []
    if args.suite in ("paper", "all"):
        results += paper_table()
    if args.suite in ("scale", "all"):
        print("\n== scale row ==")
        print(scale_row())
    if args.suite == "scale-table":
        print("== scale table: broadcast + auto, ratios to the lower bound ==")
        scale_table()
    if args.suite in ("random", "all"):
        print()
        results += random_table(args.random, args.seed)
    beaten = [r.case for r in results
              if r.estimates[AUTO] > min(r.estimates.values()) * (1 + 1e-9)]
    print(f"cases where another variant beats auto: {beaten or 'none'}")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
