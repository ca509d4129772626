"""Microbatches of different shapes in one step (``MicrobatchBoundaries``): each distinct
shape planned once, every microbatch moved by its own plan, numerics equal to the float64
reference under every schedule; what does not fit is named before any work."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from job_results import assert_same_as_single, outputs, verdicts
from launchers import LAUNCHERS, launch
from toy import ToyMLP, reference_step

from overlap import Runtime
from scheduler import (
    Cluster,
    MicrobatchBoundaries,
    PlanCache,
    StepGraph,
    lower,
    make_schedule,
    simulate,
    validate,
)

CLUSTER = Cluster.preset("p3.8xlarge", 4)
ROWS = [3, 8, 5, 1, 8, 2]  # each microbatch's batch rows


def _bounds(model: ToyMLP, rows: list[int]) -> MicrobatchBoundaries:
    return MicrobatchBoundaries(tuple(
        tuple(dataclasses.replace(b, shape=(n, model.hidden)) for b in model.boundaries())
        for n in rows))


def _microbatches(rows: list[int], hidden: int, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, hidden)) for n in rows]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "eager-1f1b", "zb-h1", "auto"])
def test_a_step_of_microbatches_of_different_shapes_equals_the_reference(schedule):
    model = ToyMLP.build(CLUSTER, hidden=8, batch=8, seed=0)
    mbs = _microbatches(ROWS, 8)
    stages = model.split_stages() if schedule == "zb-h1" else model.stages()
    costs = (lambda s, kind: 1e-3) if schedule == "auto" else None
    with Runtime(CLUSTER, compute_time=costs) as rt:
        losses = rt.train_step_sync(stages, _bounds(model, ROWS), mbs,
                                    input_sharding=model.input_sharding(), schedule=schedule)
    ref_losses, ref_grads = reference_step(model.full_weights, mbs)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    model.check_against(model.full_weights, ref_grads)


def test_each_distinct_shape_is_planned_once_and_the_graph_keeps_every_microbatchs_plan():
    model = ToyMLP.build(CLUSTER, hidden=8, batch=8)
    bounds = _bounds(model, ROWS)
    cache = PlanCache(CLUSTER)
    graph = lower(model.meshes, bounds, make_schedule("1f1b", 4, len(ROWS)), CLUSTER,
                  cache=cache)
    distinct = len(set(ROWS))
    assert len({id(p) for p in graph.plans.values()}) == distinct * 6  # 3 boundaries × 2 ways
    for i, n in enumerate(ROWS):
        for channel in {k[0] for k in graph.plans}:
            assert graph.plan_for(channel, i).shape == (n, 8)
    validate(graph)
    again = StepGraph.from_json(graph.to_json())
    assert again.to_json() == graph.to_json() and again.digest() == graph.digest()
    swapped = list(ROWS)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    other = lower(model.meshes, _bounds(model, swapped), make_schedule("1f1b", 4, len(ROWS)),
                  CLUSTER, cache=cache)
    assert other.digest() != graph.digest()  # the order of shapes is part of the call
    # Bytes follow the shapes: the simulated step moves less than a padded one.
    padded = lower(model.meshes, _bounds(model, [8] * len(ROWS)),
                   make_schedule("1f1b", 4, len(ROWS)), CLUSTER, cache=cache)
    moved = sum(op.body.transfer.nbytes for op in graph.ops if hasattr(op.body, "transfer"))
    full = sum(op.body.transfer.nbytes for op in padded.ops if hasattr(op.body, "transfer"))
    assert moved == full * sum(ROWS) // (8 * len(ROWS))
    assert simulate(graph, CLUSTER, lambda s, k: 1e-3).iteration_time > 0


def test_one_shape_for_every_microbatch_is_the_plain_graph():
    model = ToyMLP.build(CLUSTER, hidden=8, batch=8)
    sched = make_schedule("1f1b", 4, 3)
    same = lower(model.meshes, _bounds(model, [8, 8, 8]), sched, CLUSTER)
    plain = lower(model.meshes, model.boundaries(), sched, CLUSTER)
    assert same.digest() == plain.digest()


def test_what_does_not_fit_is_named_before_any_work():
    model = ToyMLP.build(CLUSTER, hidden=8, batch=8)
    mbs = _microbatches(ROWS, 8)
    with Runtime(CLUSTER) as rt:
        with pytest.raises(ValueError, match=r"microbatches\[1\]: shape \(8, 8\) != "
                                             r"microbatches\[0\] \(3, 8\) .* need "
                                             r"MicrobatchBoundaries"):
            rt.train_step_sync(model.stages(), model.boundaries(), mbs,
                               input_sharding=model.input_sharding())
        with pytest.raises(ValueError, match=r"boundaries: given for 5 microbatches, the step "
                                             r"has 6"):
            rt.train_step_sync(model.stages(), _bounds(model, ROWS[:5]), mbs,
                               input_sharding=model.input_sharding())
        from overlap import StreamError

        with pytest.raises(StreamError, match=r"returned \(3, 8\) float64; this device's "
                                              r"region of the boundary needs \(8, 8\)"):
            rt.train_step_sync(model.stages(), _bounds(model, [8] * 6), mbs,
                               input_sharding=model.input_sharding(), schedule="gpipe")
    b = model.boundaries()
    with pytest.raises(ValueError, match=r"per\[1\]\[0\]: dtype and layouts must be "):
        MicrobatchBoundaries(((b[0],), (dataclasses.replace(b[0], dtype="float32"),)))
    with pytest.raises(ValueError, match=r"per\[1\]: 1 boundaries, microbatch 0 has 3"):
        MicrobatchBoundaries((tuple(b), (b[0],)))
    with pytest.raises(TypeError, match=r"per\[0\]: expected a sequence of Boundary"):
        MicrobatchBoundaries((b[0],))
    with pytest.raises(ValueError, match=r"plans: given plans fit one shape per channel"):
        g = lower(model.meshes, b, make_schedule("1f1b", 4, 2), CLUSTER)
        lower(model.meshes, _bounds(model, [2, 4]), make_schedule("1f1b", 4, 2), CLUSTER,
              plans={k: v for k, v in g.plans.items()})


# ---- across processes: the same shapes everywhere, or a named mismatch ------------------------

JOB = Path(__file__).parent / "mpi_jobs" / "job.py"


def _one_process_varied() -> dict[str, np.ndarray]:
    sys.path.insert(0, str(JOB.parent))
    import job

    with Runtime(CLUSTER) as rt:
        return job.run_varied(rt, [])


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_variable_shapes_across_4_processes_equal_one_process_bit_for_bit(tmp_path, launcher):
    done = launch(launcher, 4, JOB, "vary", str(tmp_path), timeout=120)
    assert done.returncode == 0, verdicts(done.stdout + done.stderr)
    assert_same_as_single(outputs(tmp_path, 4), _one_process_varied(), replicated=("/losses",))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_rank_whose_microbatches_come_in_another_order_is_named_on_every_rank(tmp_path,
                                                                                 launcher):
    done = launch(launcher, 4, JOB, "vary", str(tmp_path), "permute", "2", timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode != 0, verdicts(text)
    for r in (0, 1, 3):
        assert (f"CallMismatch: train_step: the step graph (call 1): ranks [2] made a "
                f"different call than rank {r}: microbatch 0 has shape (3, 8) here and "
                f"(8, 8) on rank 2") in text, verdicts(text)
    assert ("ranks [0, 1, 3] made a different call than rank 2: microbatch 0 has shape "
            "(8, 8) here and (3, 8) on rank 0") in text, verdicts(text)
    assert not list(tmp_path.glob("rank*.npz"))  # nobody trained on swapped shapes


def test_a_rank_with_fewer_microbatches_is_told_the_counts(tmp_path):
    done = launch("mpiexec", 4, JOB, "vary", str(tmp_path), "fewer", "2", timeout=120)
    text = done.stdout + done.stderr
    assert done.returncode != 0, verdicts(text)
    sys.path.insert(0, str(JOB.parent))
    import job

    n = len(job.VARIED_ROWS)
    for r in (0, 1, 3):
        assert (f"ranks [2] made a different call than rank {r}: this step has {n} "
                f"microbatches here and {n - 1} on rank 2") in text, verdicts(text)


def test_the_simulator_costs_each_microbatch_by_its_own_size():
    model = ToyMLP.build(CLUSTER, hidden=8, batch=8)
    graph = lower(model.meshes, _bounds(model, ROWS), make_schedule("1f1b", 4, len(ROWS)),
                  CLUSTER)
    from scheduler import Channel

    def by_rows(stage, kind, i):
        return 1e-3 * graph.plan_for(Channel("fwd", 0), i).shape[0] / 8

    flat = simulate(graph, CLUSTER, {"F": 1e-3, "B": 1e-3}).iteration_time
    sized = simulate(graph, CLUSTER, {"F": 1e-3, "B": 1e-3},
                     microbatch_costs=by_rows).iteration_time
    assert sized < flat  # most microbatches are smaller than the largest
    for bad, error in ((lambda s, k, i: -1.0, ValueError), (lambda s, k, i: "1", TypeError)):
        with pytest.raises(error, match=r"microbatch_costs: stage 0 'F' microbatch 0"):
            simulate(graph, CLUSTER, {"F": 1e-3, "B": 1e-3}, microbatch_costs=bad)
    with pytest.raises(TypeError, match=r"microbatch_costs: expected a callable"):
        simulate(graph, CLUSTER, {"F": 1e-3, "B": 1e-3}, microbatch_costs=3)
