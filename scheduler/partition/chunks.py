"""Two chunks per rank: the candidates :func:`scheduler.partition` hands the schedules that
run several stages on one submesh (interleaved-1f1b, zbv).

The dynamic program gives each stage its own submesh; these schedules need two stages
(*chunks*) per rank. The search covers them with a family on equal submeshes: for every TP
degree ``t`` all the layers support and every ``p`` ranks (``2p <= layers``, ``p·t <=
devices``), the layers are cut into ``2p`` contiguous chunks of least largest F + B (the
min-max linear partition), chunk ``c`` on rank ``c mod p`` (interleaved-1f1b's loop) or in
a V (zbv: rank ``c`` on the way down, ``2p − 1 − c`` back up), rank ``r`` on devices
``r·t .. (r+1)·t − 1``. Each member is estimated by the chunked closed form

    E₂ = m · max(max_r w_r, max_b x_b→, max_b x_b←) + (p − 1) · max_c c_c + Σ_b (x_b→ + x_b←)

(``w_r``: rank ``r``'s chunks' F + B; ``c_c``: one chunk's — the fill and drain a rank
pays once per chunk, which interleaving halves; with one chunk per rank it is E), and the
best that fits memory under the schedule (each rank holding both chunks' parameters and the
activations the schedule keeps of each) goes on to the simulator. The family is
tensor-parallel only (DP degree 1 on every chunk).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from ..schedules import MAX_STAGE_MICROBATCHES, Schedule, make_schedule
from .model import Problem, Stage

MULTI_CHUNK = ("interleaved-1f1b", "zbv")


@dataclass(frozen=True)
class Chunked:
    """One member of the family: ``schedule``, its chunks as stages (pipeline order, each on
    its rank's submesh) and its estimate E₂."""

    schedule: Schedule
    stages: tuple[Stage, ...]
    estimate: float


def balanced_edges(costs: np.ndarray, parts: int) -> list[int]:
    """Edges of ``parts`` nonempty contiguous chunks of ``costs`` whose largest sum is least
    (bisection on that sum, each step a greedy count over the prefix sums)."""
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    lo, hi = float(costs.max()), float(prefix[-1])
    for _ in range(64):
        mid = (lo + hi) / 2
        if len(_greedy(prefix, mid)) - 1 <= parts:
            hi = mid
        else:
            lo = mid
    edges = _greedy(prefix, hi)
    while len(edges) - 1 < parts:  # split the costliest chunk of several layers
        k = max((c for c in range(len(edges) - 1) if edges[c + 1] - edges[c] > 1),
                key=lambda c: prefix[edges[c + 1]] - prefix[edges[c]])
        a, b = edges[k], edges[k + 1]
        half = (prefix[a] + prefix[b]) / 2
        cut = min(max(int(np.searchsorted(prefix, half, "right")) - 1, a + 1), b - 1)
        edges.insert(k + 1, cut)
    return edges


def _greedy(prefix: np.ndarray, cap: float) -> list[int]:
    """Edges of the fewest chunks, each as long as it stays within ``cap``."""
    edges, start, n = [0], 0, len(prefix) - 1
    while start < n:
        end = int(np.searchsorted(prefix, prefix[start] + cap * (1 + 1e-12), "right")) - 1
        start = max(end, start + 1)
        edges.append(min(start, n))
    return edges


def rank_of(schedule: Schedule) -> list[int]:
    return [schedule.rank_of(c) for c in range(schedule.num_stages)]


def chunked(problem: Problem, keep: int) -> list[Chunked]:
    """The ``keep`` best members (by E₂) for each schedule that applies, that fit memory."""
    m, L, N = problem.num_microbatches, len(problem.layers), problem.cluster.num_devices
    common = set.intersection(*(set(x.degrees) for x in problem.layers))
    names = [n for n in MULTI_CHUNK if n != "zbv" or problem.split]
    out: list[Chunked] = []
    for name in names:
        found = []
        for t in (s for s in problem.sizes if s in common):
            costs = np.array([x.seconds(t) for x in problem.layers])
            for p in range(2, min(L // 2, N // t) + 1):
                if (name == "interleaved-1f1b" and m % p) or 2 * p * m > MAX_STAGE_MICROBATCHES:
                    continue
                sched = make_schedule(name, 2 * p, m)
                edges = balanced_edges(costs, 2 * p)
                stages = tuple((edges[c], edges[c + 1], r * t, t, 1)
                               for c, r in enumerate(rank_of(sched)))
                if fits(problem, sched, stages):
                    found.append(Chunked(sched, stages, estimate(problem, sched, stages)))
        out += sorted(found, key=lambda c: c.estimate)[:keep]
    return out


def fits(problem: Problem, schedule: Schedule, stages: tuple[Stage, ...]) -> bool:
    """Every rank holds its chunks' parameters and the activations the schedule keeps."""
    return all(total <= (problem.memory_per_device or math.inf)
               for total in rank_memory(problem, schedule, stages))


def rank_memory(problem: Problem, schedule: Schedule, stages: tuple[Stage, ...]
                ) -> list[float]:
    """Bytes per device of each rank: its chunks' parameters and kept activations."""
    total = [0.0] * schedule.num_ranks
    for c, (a, b, _, size, dp) in enumerate(stages):
        params, acts = problem.stage_bytes(a, b, size, dp)
        total[schedule.rank_of(c)] += params + schedule.peak_activations(c) * acts
    return total


def estimate(problem: Problem, schedule: Schedule, stages: tuple[Stage, ...]) -> float:
    """E₂ of the module doc."""
    m, p = problem.num_microbatches, schedule.num_ranks
    chunk = [problem.stage_seconds(a, b, size, dp) for a, b, _, size, dp in stages]
    work = [0.0] * p
    for c, w in enumerate(chunk):
        work[schedule.rank_of(c)] += w
    comm, worst = 0.0, 0.0
    for prev, here in itertools.pairwise(stages):
        fwd, bwd = problem.boundary_seconds(here[0], prev[2:], here[2:])
        comm += fwd + bwd
        worst = max(worst, fwd, bwd)
    return m * max(max(work), worst) + (p - 1) * max(chunk) + comm


__all__ = ["MULTI_CHUNK", "Chunked", "balanced_edges", "chunked", "estimate", "rank_memory"]
