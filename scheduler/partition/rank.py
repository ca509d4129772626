"""The search's finalists, ranked by the project's simulator.

Each finalist becomes a real pipeline — stage meshes, boundaries with the layers' layouts
(``"dp"`` on dim 0 of a data-parallel side), per-stage compute costs, the gradient
reductions of its data-parallel stages — lowered (its boundaries planned with the caller's
:class:`~scheduler.PlanOptions`) and simulated under the fixed schedules that fit memory
(gpipe, 1f1b, eager-1f1b; zb-h1 when every layer splits its backward): the best estimate's
first, then the two-chunks-per-rank candidates, then the other finalists while the budget
lasts, keeping what ``auto`` (:func:`scheduler.auto_schedule`: comm-aware lists too, under
each stage's memory cap) would cost on the first; ``auto`` then runs on the fastest
single-chunk pipeline. Work is counted in simulated compute ops (microbatches × kinds ×
devices, per schedule; ``auto`` as many as it has candidates), never seconds: each step
runs only if the budget holds it, and the first finalist's 1F1B always runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..auto import auto_schedule
from ..graph import DataParallel
from ..lowering import Boundary, lower
from ..mesh import DeviceMesh
from ..planner import PlanCache, PlanOptions
from ..schedules import SCHEDULES, Schedule, make_schedule
from ..sharding import Sharding
from ..simulator import simulate
from ..timeline import Timeline
from .chunks import Chunked, chunked
from .model import DP_AXIS, Problem, Stage, grad_bytes, stage_mesh, with_dp


@dataclass(frozen=True)
class Pipeline:
    """A finalist made concrete: meshes, boundaries, compute costs, memory caps."""

    stages: tuple[Stage, ...]
    meshes: tuple[DeviceMesh, ...]
    boundaries: tuple[Boundary, ...]
    costs: dict[tuple[int, str], float]
    caps: tuple[int, ...]  # most microbatches each stage may keep (m: no limit)
    # The stages of DP degree > 1: their gradient reductions in every graph lowered.
    data_parallel: dict[int, DataParallel] = field(default_factory=dict)


@dataclass(frozen=True)
class Trial:
    """One simulated (finalist, schedule)."""

    pipeline: Pipeline
    estimate: float
    schedule: Schedule
    seconds: float
    timeline: Timeline = field(repr=False, compare=False)


def realize(problem: Problem, stages: tuple[Stage, ...]) -> Pipeline:
    """The finalist's meshes (``dp × tp`` where DP > 1), boundaries (``"dp"`` on dim 0 of a
    data-parallel side's layout), per-device seconds (the layers' at ``tp`` over ``dp``),
    memory caps and gradient reductions."""
    layers = problem.layers
    meshes = tuple(stage_mesh(start, size, dp) for _, _, start, size, dp in stages)
    boundaries = tuple(_boundary(problem, stages, s, meshes) for s in range(len(stages) - 1))
    costs: dict[tuple[int, str], float] = {}
    for s, (a, b, _, size, dp) in enumerate(stages):
        part, tp = layers[a:b], size // dp
        costs[(s, "F")] = sum(x.forward[tp] for x in part) / dp
        costs[(s, "B")] = sum(x.backward[tp] for x in part) / dp
        if problem.split:
            costs[(s, "I")] = sum(x.input_grad[tp] for x in part) / dp  # type: ignore[index]
            costs[(s, "W")] = sum(x.weight_grad[tp] for x in part) / dp  # type: ignore[index]
    caps = tuple(problem.most_kept(a, b, size, dp) for a, b, _, size, dp in stages)
    return Pipeline(stages, meshes, boundaries, costs, caps, data_parallel(problem, stages))


def _boundary(problem: Problem, stages: tuple[Stage, ...], s: int,
              meshes: tuple[DeviceMesh, ...]) -> Boundary:
    """The boundary after stage ``s``: the last layer's output in each side's layout."""
    cut = stages[s][1]
    out, into = problem.layers[cut - 1], problem.layers[cut]
    src = with_dp(out.output_spec, out.output_shape, stages[s][4])
    dst = with_dp(into.input_spec, out.output_shape, stages[s + 1][4])
    if src is None or dst is None:  # (the search never picks it: its boundary costs inf)
        raise ValueError(f"stages: the cut before layer {cut} cannot split its batch "
                         f"{out.output_shape[0]} over the stages' DP degrees")
    return Boundary(out.output_shape, out.dtype, Sharding(meshes[s], src),
                    Sharding(meshes[s + 1], dst))


def data_parallel(problem: Problem, stages: tuple[Stage, ...]) -> dict[int, DataParallel]:
    """Each stage of DP degree > 1: its gradients (parameter bytes / TP degree per device)
    all-reduced over the ``"dp"`` axis after its last backward."""
    out = {}
    for s, (a, b, _, size, dp) in enumerate(stages):
        if dp > 1:
            params = sum(x.params_bytes for x in problem.layers[a:b])
            out[s] = DataParallel(DP_AXIS, grad_bytes(params, size // dp))
    return out


class Ranking:
    """Simulates finalists within ``budget`` simulated compute ops (module doc)."""

    def __init__(self, problem: Problem, options: PlanOptions, budget: int) -> None:
        self.problem, self.options, self.left = problem, options, budget
        self.cache = PlanCache(problem.cluster)
        self.trials: list[Trial] = []

    def units(self, pipe: Pipeline) -> int:
        kinds = 3 if self.problem.split else 2
        return self.problem.num_microbatches * kinds * sum(m.size for m in pipe.meshes)

    def auto_units(self, pipe: Pipeline) -> int:
        """What ``auto`` costs on ``pipe``: its candidates' simulations."""
        split = self.problem.split
        count = len(SCHEDULES) + (len(pipe.meshes) + 2) * (2 if split else 1) + split
        return count * self.units(pipe)

    def fixed(self, estimate: float, pipe: Pipeline, keep: int = 0) -> None:
        """Each fixed schedule that fits memory, while the budget lasts (``keep`` of it
        left over)."""
        p, m = len(pipe.meshes), self.problem.num_microbatches
        names = SCHEDULES + (("zb-h1",) if self.problem.split else ())
        for name in sorted(names, key=lambda n: n != "1f1b"):  # 1f1b first: it always fits
            sched = make_schedule(name, p, m)
            if any(sched.peak_activations(s) > c for s, c in enumerate(pipe.caps)):
                continue
            if self.trials and self.units(pipe) > self.left - keep:
                return
            self.left -= self.units(pipe)
            graph = lower(pipe.meshes, pipe.boundaries, sched, self.problem.cluster,
                          self.options, cache=self.cache, data_parallel=pipe.data_parallel)
            tl = simulate(graph, self.problem.cluster, pipe.costs)
            self.trials.append(Trial(pipe, estimate, sched, tl.iteration_time, tl))

    def auto(self, best: Trial) -> None:
        """``auto`` on the best finalist, if the budget holds all its candidates."""
        pipe = best.pipeline
        if self.auto_units(pipe) > self.left:
            return
        self.left -= self.auto_units(pipe)
        m = self.problem.num_microbatches
        caps = None if all(c >= m for c in pipe.caps) else list(pipe.caps)
        choice = auto_schedule(pipe.meshes, pipe.boundaries, m, self.problem.cluster,
                               pipe.costs, self.options, max_activations=caps,
                               cache=self.cache, data_parallel=pipe.data_parallel)
        tl = simulate(choice.graph, self.problem.cluster, pipe.costs)
        self.trials.append(Trial(pipe, best.estimate, choice.schedule, tl.iteration_time, tl))

    def chunked(self, member: Chunked) -> None:
        """A two-chunks-per-rank member under its schedule, if the budget holds it."""
        pipe = realize(self.problem, member.stages)
        if self.trials and self.units(pipe) > self.left:
            return
        self.left -= self.units(pipe)
        graph = lower(pipe.meshes, pipe.boundaries, member.schedule, self.problem.cluster,
                      self.options, cache=self.cache, data_parallel=pipe.data_parallel)
        tl = simulate(graph, self.problem.cluster, pipe.costs)
        self.trials.append(Trial(pipe, member.estimate, member.schedule, tl.iteration_time,
                                 tl))


def rank(problem: Problem, finalists: tuple[tuple[float, tuple[Stage, ...]], ...],
         options: PlanOptions, budget: int) -> list[Trial]:
    """Every trial made, fastest first (ties: the earlier): the best finalist's fixed
    schedules, the two-chunks-per-rank family's best members (:mod:`scheduler.
    partition.chunks`), the other finalists' fixed schedules while the budget lasts — keeping
    what ``auto`` costs on the first, when the budget holds it — then ``auto`` on the
    fastest single-chunk pipeline."""
    ranking = Ranking(problem, options, budget)
    estimate, stages = finalists[0]
    first = realize(problem, stages)
    ranking.fixed(estimate, first)
    for member in chunked(problem, keep=1):
        ranking.chunked(member)
    keep = ranking.auto_units(first)
    keep = keep if keep <= ranking.left else 0  # (no auto: nothing to keep for)
    for estimate, stages in finalists[1:]:
        before = len(ranking.trials)
        ranking.fixed(estimate, realize(problem, stages), keep)
        if len(ranking.trials) == before:
            break  # the budget is spent
    single = [t for t in ranking.trials if t.schedule.stages_per_rank == 1]
    ranking.auto(min(single, key=lambda t: t.seconds))
    ordered = sorted(enumerate(ranking.trials), key=lambda it: (it[1].seconds, it[0]))
    return [t for _, t in ordered]


__all__ = ["Pipeline", "Trial", "data_parallel", "rank", "realize"]
