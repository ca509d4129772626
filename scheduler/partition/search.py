"""The search behind :func:`scheduler.partition`: a dynamic program over layers × devices ×
stage shapes (a submesh size and its DP degree), in the spirit of Alpa's inter-operator
pass, minimising the estimate E of :mod:`scheduler.partition.model`.

E = S + (m − 1)·P is a sum S of per-stage and per-boundary terms plus their maximum P. As
Alpa does, the program fixes a threshold ``t`` on every term and minimises the sum alone:

    f(i, d, q, n) = min over stages (layers i..j−1, shape k) of
                    stage(i, j, k) + R(i, j, k) + cut(i, d, q, k) + f(j, next(d, k), k, n − 1)

— the best sum for layers ``i..`` when device ``d`` is the first free one, ``q`` the shape
of the stage before (the boundary's cost depends on both submeshes and their layouts) and
``n`` the stages left, itself included (1F1B keeps ``min(m, n)`` microbatches on a stage
``n`` from the end): counted 1..B−1 and "B or more", B one more than the largest memory cap
below the most stages a pipeline can have among the stages the threshold allows — beyond it
no allowed stage's feasibility changes — and not counted at all when no such cap binds.
Every term above ``t`` is left out. A data-parallel stage's gradient reduction R is part of
the sum but no term of the maximum. Run at every distinct term value ``t`` (in increasing
order, stopping once ``S_min + (m − 1)·t`` cannot beat the best E found), the minimum over
the runs is the exact minimum of E. Each run is vectorised over the devices and the stages
left (numpy). When the runs would exceed the work budget (cells of the program evaluated,
never seconds), a coarse grid of thresholds runs first, then ``t`` takes a geometric grid of
ratio ``1 + gap``, which keeps the result within ``1 + gap`` of the optimum (reported).
Every run's solution is a candidate; the best few by E go on to the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .model import Problem, Stage, dp_allowed, placed

INF = math.inf
BOUND_SLACK = 1e-9
# What the search's tables may take (estimated by search_bytes before any is built): a
# sixth of the 24 GiB of the machine the limits were measured on.
MAX_SEARCH_BYTES = 4 << 30
MAX_DEVICES = 4096  # devices a partition searches over (its shapes are listed before sizing)


def search_bytes(problem: Problem) -> tuple[int, int]:
    """Bytes the search's largest arrays take at once, as (the part growing with layers²:
    :meth:`Tables._stage_tables` and the thresholds, the part growing with layers × devices ×
    shapes²: the boundary tables and one :class:`Run`) — known from the problem's sizes
    alone, before any table is built."""
    L, N, S = len(problem.layers), problem.cluster.num_devices, len(problem.shapes)
    cuts = len({(a.output_shape, a.dtype, a.output_spec, b.input_spec)
                for a, b in zip(problem.layers, problem.layers[1:])})
    n = min(L, N, problem.num_microbatches) + 2  # a run's "stages left" index
    square = (L + 1) ** 2 * (S * (3 * 8 + 2 + 2 * 8) + 12 * 8)  # stage, cap, reduce; masks;
    # the thresholds (concatenated, then unique); a shape's float temporaries
    cells = (N + 2) * (S + 1)
    boundary = 3 * 8 * L * cells * S + 2 * 8 * cuts * cells * S  # bsum, bmax, a run's cut;
    # the cached tables of each distinct tensor crossing a cut
    run = (L + 1) * cells * n * (8 + 1) + 4 * L * S * (N + 1) * n + 2 * 8 * cells * S * n
    return square, boundary + run


@dataclass(frozen=True)
class Found:
    """What the search found: ``candidates`` (E, stages) best first; ``runs`` of the program,
    ``cells`` it evaluated, ``gap`` (0: E's minimum is exact; else within ``1 + gap``)."""

    candidates: tuple[tuple[float, tuple[Stage, ...]], ...]
    runs: int
    cells: int
    gap: float


class Tables:
    """The program's tables for one problem (built once, used by every run)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.L, self.N = len(problem.layers), problem.cluster.num_devices
        # Index k runs over the stage shapes: sizes[k] devices at DP degree dps[k].
        self.sizes = np.array([n for n, _ in problem.shapes], dtype=np.int64)
        self.dps = np.array([k for _, k in problem.shapes], dtype=np.int64)
        self.S = len(self.sizes)
        self._placement()
        self.stage, self.cap, self.reduce = self._stage_tables()
        self._memory_mode()
        self.bsum, self.bmax = self._boundary_tables()

    # ---- tables ----------------------------------------------------------------------------

    def _placement(self) -> None:
        """start[d, k], next_free[d, k] (N + 1: the size does not fit from d)."""
        N, cluster = self.N, self.problem.cluster
        self.start = np.zeros((N + 1, self.S), np.int64)
        self.next_free = np.full((N + 1, self.S), N + 1, np.int64)
        for k, size in enumerate(self.sizes.tolist()):
            for d in range(N + 1):
                s = placed(d, size, cluster)
                self.start[d, k] = s
                if s + size <= N:
                    self.next_free[d, k] = s + size

    def _stage_tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """stage[i, j, k]: F + B of layers i..j−1 at shape k (inf: a layer lacks the TP
        degree or cannot run at the DP degree, or j <= i); cap[i, j, k]: most microbatches
        it may keep within memory (−1: none); reduce[i, j, k]: its gradient reduction R."""
        p, L, S = self.problem, self.L, self.S
        stage = np.full((L + 1, L + 1, S), INF)
        cap = np.full((L + 1, L + 1, S), -1, np.int64)
        reduce = np.zeros((L + 1, L + 1, S))
        params = np.concatenate([[0], np.cumsum([x.params_bytes for x in p.layers])])
        acts = np.concatenate([[0], np.cumsum([x.activation_bytes for x in p.layers])])
        big = p.num_microbatches + L  # "any number": more than a stage ever keeps
        upper = np.triu(np.ones((L + 1, L + 1), bool), 1)
        for k, (size, dp) in enumerate(p.shapes):
            tp = size // dp
            secs = np.array([x.seconds(tp) if tp in x.forward else 0.0 for x in p.layers])
            lacks = np.concatenate([[0], np.cumsum([tp not in x.forward
                                                    or not dp_allowed(x, dp)
                                                    for x in p.layers])])
            cum = np.concatenate([[0.0], np.cumsum(secs)])
            ok = upper & (lacks[None, :] - lacks[:, None] == 0)
            stage[:, :, k] = np.where(ok, (cum[None, :] - cum[:, None]) / dp, INF)
            if dp > 1:
                reduce[:, :, k] = _reduce_table(p, np.maximum(params[None, :] - params[:, None],
                                                              0), size, dp)
            if p.memory_per_device is None:
                cap[:, :, k] = np.where(ok, big, -1)
                continue
            # (int sums, one division: the same floats Problem.fits computes)
            pb = (params[None, :] - params[:, None]) / tp
            ab = (acts[None, :] - acts[:, None]) / size
            cap[:, :, k] = np.where(ok, _most_kept(pb, ab, p.memory_per_device, big), -1)
        stage[cap < 1] = INF
        return stage, cap, reduce

    def _memory_mode(self) -> None:
        """Entries of stages whose memory cap binds below the most stages a pipeline can
        have, by cost: a run at threshold t counts the stages left up to the largest such
        cap among the stages it allows (and lumps every larger count together)."""
        p = self.problem
        self.most = min(self.L, self.N, p.num_microbatches)
        binding = np.isfinite(self.stage) & (self.cap >= 1) & (self.cap < self.most)
        order = np.argsort(self.stage[binding], kind="stable")
        self._bind_cost = self.stage[binding][order]
        self._bind_cap = np.maximum.accumulate(self.cap[binding][order]) \
            if order.size else np.zeros(0, np.int64)

    def bucket(self, t: float) -> int:
        """B: the stages left are counted 1..B−1 and "B or more" (0: not counted — no stage
        allowed at t has a binding cap)."""
        return int(self.buckets(np.array([t]))[0])

    def buckets(self, ts: np.ndarray) -> np.ndarray:
        """:meth:`bucket` of every threshold of ``ts`` at once."""
        k = np.searchsorted(self._bind_cost, ts, "right")
        caps = self._bind_cap[np.maximum(k - 1, 0)] + 1 if self._bind_cap.size else 0
        return np.where(k == 0, 0, caps).astype(np.int64)

    def _boundary_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """bsum / bmax[i, d, q, k]: both directions' seconds summed / their larger, at the
        cut before layer i, the stage before of shape index q ending at d, this one of shape
        k starting at start[d, k] (q = S: no stage before, only at i = 0, d = 0)."""
        L, N, S = self.L, self.N, self.S
        bsum = np.full((L, N + 1, S + 1, S), INF)
        bmax = np.full((L, N + 1, S + 1, S), INF)
        bsum[0, 0, S, :] = bmax[0, 0, S, :] = 0.0
        by_tensor: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        layers = self.problem.layers
        for i in range(1, L):
            out, into = layers[i - 1], layers[i]
            key = (out.output_shape, out.dtype, out.output_spec, into.input_spec)
            if key not in by_tensor:
                by_tensor[key] = self._cut_table(i)
            bsum[i, :, :S], bmax[i, :, :S] = by_tensor[key]
        return bsum, bmax

    def _cut_table(self, cut: int) -> tuple[np.ndarray, np.ndarray]:
        N, S, shapes, cluster = self.N, self.S, self.problem.shapes, self.problem.cluster
        total = np.full((N + 1, S, S), INF)
        worst = np.full((N + 1, S, S), INF)
        for q, (before, qdp) in enumerate(shapes):
            for d in range(before, N + 1):
                first = d - before
                if placed(first, before, cluster) != first:
                    continue  # no stage of that size ends at d
                for k, (size, dp) in enumerate(shapes):
                    if self.next_free[d, k] > N:
                        continue
                    fwd, bwd = self.problem.boundary_seconds(
                        cut, (first, before, qdp), (int(self.start[d, k]), size, dp))
                    total[d, q, k], worst[d, q, k] = fwd + bwd, max(fwd, bwd)
        return total, worst

    # ---- what the runs need ----------------------------------------------------------------

    @cached_property
    def thresholds(self) -> np.ndarray:
        """Every distinct term value (a stage's or one direction of a boundary's)."""
        values = np.concatenate([self.stage[np.isfinite(self.stage)],
                                 self.bmax[np.isfinite(self.bmax)]])
        return np.unique(values)

    @cached_property
    def bounds(self) -> tuple[float, float]:
        """(the least possible maximum term, the least possible sum of stage terms)."""
        best = [min((x.seconds(n // k) / k for n, k in self.problem.shapes
                     if n // k in x.forward), default=INF) for x in self.problem.layers]
        return max(best), sum(best)

    def ends(self, t: float) -> np.ndarray:
        """ends[i, k]: the last stop layer j of a stage from i of size k with every term
        <= t (its cost grows with j, and a row's finite entries come first; i: none)."""
        return np.arange(self.L)[:, None] + (self.stage[:self.L] <= t).sum(axis=1)

    @cached_property
    def _finite_terms(self) -> np.ndarray:
        """Every finite stage term, sorted (what the runs' widths count)."""
        return np.sort(self.stage[np.isfinite(self.stage)], kind="stable")

    def cells(self, ts: np.ndarray) -> np.ndarray:
        """Cells a run at each threshold of ``ts`` evaluates (its work, known before)."""
        # A run at t visits, per (i, k), the stop layers whose term is <= t: summed over
        # every (i, k), that is how many finite terms are <= t — one count over all of them.
        widths = np.searchsorted(self._finite_terms, ts, "right").astype(np.int64)
        counts = np.maximum(1, self.buckets(ts) + 1)
        return (widths + self.L * (self.S + 1) * self.S) * (self.N + 1) * counts


def _reduce_table(problem: Problem, params: np.ndarray, size: int, dp: int) -> np.ndarray:
    """:meth:`Problem.reduce_seconds` of every entry of ``params`` (integer bytes), in
    whole arrays: the same integer steps, so the same floats. Bytes past what float64 and
    int64 hold exactly are priced one by one."""
    tp = size // dp
    if params.dtype.kind in "iu" and (params.size == 0 or int(params.max()) < 1 << 53):
        grad = np.ceil(params / tp).astype(np.int64)  # (grad_bytes: float quotient, ceil)
        if grad.size == 0 or int(grad.max()) < (1 << 62) // (2 * dp):
            fixed, bw = problem.ring(size, dp)
            return fixed + (2 * (dp - 1) * grad // dp) / bw
    return np.vectorize(lambda b: problem.reduce_seconds(int(b), size, dp),
                        otypes=[float])(params)


def _most_kept(params: np.ndarray, acts: np.ndarray, memory: float, big: int) -> np.ndarray:
    """The most microbatches c with ``params + c·acts <= memory`` (−1: not even the
    parameters fit; ``big`` when activations take nothing)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.floor(np.where(acts > 0, (memory - params) / acts, big))
    c = np.clip(np.nan_to_num(c, nan=-1.0, posinf=big, neginf=-1.0), -1, big).astype(np.int64)
    c = np.where(params + (c + 1) * acts <= memory, np.minimum(c + 1, big), c)  # (rounding)
    c = np.where((c >= 0) & (params + c * acts > memory), c - 1, c)
    return np.where(params > memory, -1, c)


class Run:
    """One run of the program at threshold ``t``: the best sum, and the stages that give it.
    ``n`` (the stages left, the stage itself included) is counted 1..B−1, index B meaning
    "B or more" (:meth:`Tables.bucket`); B = 0: not counted (one index, "any")."""

    def __init__(self, tables: Tables, t: float) -> None:
        T = self.T = tables
        self.B = T.bucket(t)
        Nn = self.B + 1 if self.B else 1
        self.need = np.arange(Nn)  # microbatches a stage with n left keeps (n <= B <= m)
        self.need[0] = T.most + 1 if self.B else 1  # (counted: no stage has 0 left)
        self.f = np.full((T.L + 1, T.N + 2, T.S + 1, Nn), INF)
        self.f[T.L, :T.N + 1, :, 0] = 0.0
        self.stop = np.zeros((T.L, T.S, T.N + 1, Nn), np.int32)
        self.size = np.zeros((T.L, T.N + 1, T.S + 1, Nn), np.int8)
        ends = T.ends(t)
        cut = np.where(T.bmax <= t, T.bsum, INF)
        for i in range(T.L - 1, -1, -1):
            best = self._stages_from(i, ends[i])
            total = cut[i][:, :, :, None] + best.transpose(1, 0, 2)[:, None, :, :]
            self.f[i, :T.N + 1] = total.min(2)
            self.size[i] = total.argmin(2)

    def _stages_from(self, i: int, ends: np.ndarray) -> np.ndarray:
        """best[k, d, n]: the least sum from layer i with a first stage of size k placed from
        device d (its stop layer kept in ``self.stop``)."""
        T = self.T
        best = np.full((T.S, T.N + 1, self.f.shape[3]), INF)
        for k in range(T.S):
            e = int(ends[k])
            if e <= i:
                continue
            after = self.f[i + 1:e + 1][:, T.next_free[:, k], k, :]
            here = T.stage[i, i + 1:e + 1, k] + T.reduce[i, i + 1:e + 1, k]
            val = here[:, None, None] + self._left(after)
            if self.B:
                fits = T.cap[i, i + 1:e + 1, k][:, None] >= self.need[None, :]
                val = np.where(fits[:, None, :], val, INF)
            best[k] = val.min(0)
            self.stop[i, k] = val.argmin(0) + i + 1
        return best

    def _left(self, after: np.ndarray) -> np.ndarray:
        """The rest's value seen from a stage with ``n`` stages left (itself included)."""
        if not self.B:
            return after
        out = np.full_like(after, INF)
        out[..., 1:] = after[..., :-1]
        out[..., -1] = np.minimum(after[..., -2], after[..., -1])  # B or more: B−1, or more
        return out

    def solution(self) -> tuple[Stage, ...] | None:
        """The stages of the best sum (None: nothing fits under this threshold)."""
        T = self.T
        f0 = self.f[0, 0, T.S]
        n = int(np.argmin(f0))
        if not math.isfinite(f0[n]):
            return None
        stages: list[Stage] = []
        i, d, q = 0, 0, T.S
        while i < T.L:
            k = int(self.size[i, d, q, n])
            j = int(self.stop[i, k, d, n])
            stages.append((i, j, int(T.start[d, k]), int(T.sizes[k]), int(T.dps[k])))
            i, d, q = j, int(T.next_free[d, k]), k
            if self.B:  # the index the value came from (the bucket: the smaller)
                n = n if n == self.B and self.f[i, d, q, n] < self.f[i, d, q, n - 1] else n - 1
        return tuple(stages)


class _Sweep:
    """Runs at thresholds within a budget, keeping every solution and its E."""

    def __init__(self, T: Tables, budget: int) -> None:
        self.T, self.left = T, budget
        self.found: dict[tuple[Stage, ...], float] = {}
        self.runs = self.cells = 0
        # The bounds add each layer's seconds directly, the tables by differences of prefix
        # sums: the same value may round a few ulps apart, so the bounds are loosened by a
        # relative 1e-9 — a run too many costs nothing, a threshold dropped loses the optimum.
        lo, least = T.bounds
        self.least = least * (1 - BOUND_SLACK)
        self.ts = T.thresholds[T.thresholds >= lo * (1 - BOUND_SLACK)]
        self.cost = T.cells(self.ts)
        self.done = np.zeros(len(self.ts), bool)

    def stop(self) -> float:
        """Thresholds from here on cannot beat the best E found."""
        if not self.found:
            return INF
        m = self.T.problem.num_microbatches
        return (min(self.found.values()) - self.least) / (m - 1)

    def run(self, indices) -> bool:
        """Run at ``ts[indices]`` in order until past :meth:`stop`; False if the budget ran
        out first."""
        for ix in indices:
            if self.done[ix]:
                continue
            if self.found and self.ts[ix] >= self.stop():
                return True
            if self.found and self.cost[ix] > self.left:
                return False
            self.done[ix] = True
            self.left -= int(self.cost[ix])
            self.runs += 1
            self.cells += int(self.cost[ix])
            stages = Run(self.T, float(self.ts[ix])).solution()
            if stages is not None:
                self.found[stages] = self.T.problem.estimate(stages)
        return True

    def grid(self, ratio: float) -> list[int]:
        """Indices of the thresholds of a geometric grid of ``ratio`` over ts (each grid
        value's run is the run at the largest threshold not above it)."""
        out, v, top = [], float(self.ts[0]), float(self.ts[-1])
        while True:
            out.append(int(np.searchsorted(self.ts, v, "right")) - 1)
            if v >= top:
                break
            v = min(v * ratio, top)
        return sorted(set(out))

    def todo(self, indices) -> list[int]:
        stop = self.stop()
        return [ix for ix in indices if not self.done[ix] and self.ts[ix] < stop]


RATIOS = (1.001, 1.003, 1.01, 1.03, 1.1)


def search(problem: Problem, budget: int, keep: int) -> Found:
    """The ``keep`` best candidates by E within ``budget`` cells (module doc)."""
    sweep = _Sweep(Tables(problem), budget)
    gap = 0.0
    if not sweep.ts.size:
        pass
    elif problem.num_microbatches == 1:  # E is the sum alone: everything allowed
        sweep.run([len(sweep.ts) - 1])
    elif int(sweep.cost.sum()) <= budget:
        sweep.run(range(len(sweep.ts)))
    else:
        whole = sweep.run(sweep.grid(1.25))  # a first best, cheaply
        everything = sweep.todo(range(len(sweep.ts)))
        if int(sweep.cost[everything].sum()) <= sweep.left:
            sweep.run(everything)
        else:
            gap = 0.25 if whole else INF
            for ratio in RATIOS:
                grid = sweep.todo(sweep.grid(ratio))
                if int(sweep.cost[grid].sum()) <= sweep.left:
                    sweep.run(grid)
                    gap = ratio - 1
                    break
    best = sorted(sweep.found.items(), key=lambda kv: (kv[1], kv[0]))[:keep]
    return Found(tuple((e, s) for s, e in best), sweep.runs, sweep.cells, gap)


__all__ = ["Found", "Run", "Tables", "search"]
