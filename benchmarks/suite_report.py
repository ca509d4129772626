"""Plan every case of a suite with every strategy and balance; one table, ratios to the bound."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler import PlanOptions, estimate, plan_resharding
from scheduler.cli.common import Case
from scheduler.cost import lower_bound_for, paper_model_time

# The columns: (label, strategy, balance).
VARIANTS: tuple[tuple[str, str, str], ...] = (
    ("send_recv", "send_recv", "size"),
    ("local_ag", "local_allgather", "size"),
    ("bc/none", "broadcast", "none"),
    ("bc/size", "broadcast", "size"),
    ("bc/greedy", "broadcast", "greedy"),
    ("bc/search", "broadcast", "search"),
    ("bc/auto", "broadcast", "auto"),
)
AUTO = "bc/auto"


@dataclass(frozen=True)
class CaseResult:
    case: str
    lower_bound: float
    estimates: dict[str, float]  # variant label -> seconds (project cost model)
    paper_model: dict[str, float]  # variant label -> seconds (paper's simple model)
    plan_seconds: dict[str, float]  # variant label -> wall-clock planning time
    transfers: dict[str, int]

    def ratio(self, label: str, *, paper: bool = False) -> float:
        t = (self.paper_model if paper else self.estimates)[label]
        return t / self.lower_bound if self.lower_bound > 0 else 1.0


def run_case(case: Case, variants: Sequence[tuple[str, str, str]] = VARIANTS) -> CaseResult:
    lb = lower_bound_for(case.shape, case.dtype, case.src, case.dst, case.cluster)
    est, paper, secs, count = {}, {}, {}, {}
    for label, strategy, balance in variants:
        t0 = time.perf_counter()
        plan = plan_resharding(case.shape, case.dtype, case.src, case.dst, case.cluster,
                               PlanOptions(strategy=strategy, balance=balance))
        secs[label] = time.perf_counter() - t0
        est[label] = estimate(plan, case.cluster)
        paper[label] = paper_model_time(plan, case.cluster)
        count[label] = len(plan.transfers)
    return CaseResult(case.name, lb, est, paper, secs, count)


def format_table(results: Sequence[CaseResult],
                 variants: Sequence[tuple[str, str, str]] = VARIANTS) -> str:
    labels = [v[0] for v in variants]
    head = ["case", "bound ms", *labels, "best/bound", "auto paper/bound", "auto plan s"]
    rows = []
    for r in results:
        best = min(r.estimates.values())
        rows.append([
            r.case,
            f"{r.lower_bound * 1e3:.1f}",
            *(f"{r.estimates[k] * 1e3:.1f}" for k in labels),
            f"{best / r.lower_bound:.3f}" if r.lower_bound else "-",
            f"{r.ratio(AUTO, paper=True):.3f}" if AUTO in r.estimates else "-",
            f"{r.plan_seconds.get(AUTO, float('nan')):.3f}",
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda row: "  ".join(str(x).rjust(w) for x, w in zip(row, widths))
    lines = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in rows]
    return "\n".join(lines)


def format_ratio_summary(results: Sequence[CaseResult],
                         variants: Sequence[tuple[str, str, str]] = VARIANTS) -> str:
    """Mean and worst estimate/bound per variant (and the paper model for auto)."""
    lines = ["variant       mean ratio  worst ratio   (estimate / lower bound)"]
    for label, _, _ in variants:
        ratios = [r.ratio(label) for r in results]
        lines.append(f"{label:<12}  {statistics.mean(ratios):>10.3f}  {max(ratios):>11.3f}")
    paper = [r.ratio(AUTO, paper=True) for r in results if AUTO in r.paper_model]
    if paper:
        lines.append(
            f"{'auto (paper)':<12}  {statistics.mean(paper):>10.3f}  {max(paper):>11.3f}"
            "   (the paper's simple model)"
        )
    return "\n".join(lines)
