"""Resharding planner benchmark (not a test): the paper's suite, a scale row, a random suite.

Every number is a ratio to the physical lower bound, computed in this run, so the table means
the same on any machine; planning times are wall-clock on this machine (stated on top).

    python benchmarks/reshard_suite.py [--random N] [--seed S] [--skip-scale]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler import lower_bound, paper_model_time, plan_resharding
from scheduler.cli import machine_line
from scheduler.suite_report import (
    AUTO,
    format_ratio_summary,
    format_table,
    run_case,
)
from scheduler.suites import paper_suite, random_suite, scale_case


def scale_row() -> str:
    case = scale_case()
    lines = [f"{case.name}: {case.src.spec!r} on (64, 8) -> {case.dst.spec!r} on (64, 8), "
             f"{case.shape} {case.dtype}"]
    lb = lower_bound(case.shape, case.dtype, case.src, case.dst, case.cluster)
    for strategy, balance in (("send_recv", "size"), ("broadcast", "size"),
                              ("broadcast", "auto")):
        t0 = time.perf_counter()
        plan = plan_resharding(case.shape, case.dtype, case.src, case.dst, case.cluster,
                               strategy=strategy, balance=balance)
        secs = time.perf_counter() - t0
        est = plan.estimate(case.cluster)
        lines.append(
            f"  {strategy}/{balance:<5} plan {secs:6.3f} s  {len(plan.transfers):5d} transfers  "
            f"estimate {est * 1e3:8.3f} ms  bound {lb * 1e3:8.3f} ms  ratio {est / lb:.3f}  "
            f"paper model ratio {paper_model_time(plan, case.cluster) / lb:.3f}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random", type=int, default=48, help="random cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-scale", action="store_true")
    args = ap.parse_args()
    print(machine_line())
    print("estimates in ms under the project cost model; ratios to the lower bound\n")
    t0 = time.perf_counter()
    paper = [run_case(c) for c in paper_suite()]
    print("== paper suite (5 x p3.8xlarge, int32) ==")
    print(format_table(paper))
    print()
    print(format_ratio_summary(paper))
    worst = max(max(r.ratio(AUTO), r.ratio(AUTO, paper=True)) for r in paper)
    print(f"target broadcast+auto <= 1.05 x bound on every paper case, both models: "
          f"worst {worst:.3f} -> {'met' if worst <= 1.05 else 'NOT met'}")
    if not args.skip_scale:
        print("\n== scale row ==")
        print(scale_row())
    print(f"\n== random suite ({args.random} cases, seed {args.seed}) ==")
    rand = [run_case(c) for c in random_suite(args.random, args.seed)]
    print(format_table(rand))
    print()
    print(format_ratio_summary(rand))
    ratios = [r.ratio(AUTO) for r in rand]
    mean, worst = statistics.mean(ratios), max(ratios)
    ok = mean <= 1.02 and worst <= 1.10
    print(f"target auto mean <= 1.02, worst <= 1.10: mean {mean:.3f}, worst {worst:.3f} -> "
          f"{'met' if ok else 'NOT met'}")
    beaten = [r.case for r in rand + paper
              if r.estimates[AUTO] > min(r.estimates.values()) * (1 + 1e-9)]
    print(f"cases where another variant beats auto: {beaten or 'none'}")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
