"""Gradient reductions of data-parallel stages as step-graph ops: lowered after each stage's
last backward, checked by the validator, costed by the simulator, run by the runtime on the
stage's own stream."""

from __future__ import annotations

import numpy as np
import pytest

from overlap import GradSync, Runtime, Stage
from scheduler import (
    Boundary,
    Cluster,
    Compute,
    DataParallel,
    DeviceMesh,
    GradReduce,
    P,
    StepGraph,
    lower,
    make_schedule,
    simulate,
)
from scheduler.sharding import Sharding
from scheduler.validate import ProgramError, validate

M0 = DeviceMesh([[0], [1]], ("dp", "tp"))
M1 = DeviceMesh([[2, 3], [4, 5]], ("dp", "tp"))
CLUSTER = Cluster.preset("p3.8xlarge", num_hosts=2)
BOUNDARY = Boundary((8, 16), "float32", Sharding(M0, P("dp")), Sharding(M1, P("dp")))
DP = {0: DataParallel("dp", 1 << 20), 1: DataParallel("dp", 1 << 16)}
COSTS = {"F": 1e-3, "B": 2e-3, "I": 1e-3, "W": 1e-3}


def _reductions(graph: StepGraph) -> list:
    return [op for op in graph.ops if isinstance(op.body, GradReduce)]


@pytest.mark.parametrize("name", ["1f1b", "eager-1f1b", "gpipe", "zb-h1"])
def test_one_reduction_per_line_after_the_last_backward(name):
    graph = lower([M0, M1], [BOUNDARY], make_schedule(name, 2, 4), CLUSTER, data_parallel=DP)
    validate(graph)
    groups = sorted((op.body.stage, op.devices) for op in _reductions(graph))
    assert groups == [(0, (0, 1)), (1, (2, 4)), (1, (3, 5))]
    for op in _reductions(graph):
        assert op.stream == f"dp{op.body.stage}"
        for d in op.devices:
            lane = graph.lanes[(d, "compute")]
            last = max(i for i in lane if graph.ops[i].body.stage == op.body.stage)
            assert (last, d) in {(w.op, w.dst) for w in op.waits}
            assert graph.ops[last].body.kind in ("B", "W")


def test_interleaved_reduces_each_stage_apart():
    mesh = DeviceMesh([[0], [1]], ("dp", "tp"))
    other = DeviceMesh([[2], [3]], ("dp", "tp"))
    b = [Boundary((8, 4), "float32", Sharding(m, P("dp")), Sharding(n, P("dp")))
         for m, n in [(mesh, other), (other, mesh), (mesh, other)]]
    sched = make_schedule("interleaved-1f1b", 4, 4, stages_per_rank=2)
    dp = {s: DataParallel("dp", 4096) for s in range(4)}
    graph = lower([mesh, other, mesh, other], b, sched, CLUSTER, data_parallel=dp)
    validate(graph)
    # Device 0 holds stages 0 and 2: each reduces on its own stream, after its own backward.
    streams = {lane.stream for lane in graph.lanes if lane.device == 0}
    assert {"dp0", "dp2"} <= streams


def test_text_and_json_round_trip():
    graph = lower([M0, M1], [BOUNDARY], make_schedule("1f1b", 2, 3), CLUSTER, data_parallel=DP)
    again = StepGraph.from_json(graph.to_json())
    assert again.to_json() == graph.to_json()
    assert again.data_parallel == graph.data_parallel
    assert graph.with_text(graph.to_text()).to_json() == graph.to_json()
    assert graph.digest() != lower([M0, M1], [BOUNDARY], make_schedule("1f1b", 2, 3),
                                   CLUSTER).digest()


def test_validator_refuses_a_reduction_before_the_last_backward():
    graph = lower([M0, M1], [BOUNDARY], make_schedule("1f1b", 2, 3), CLUSTER, data_parallel=DP)
    text = graph.to_text()
    assert "dp1:2<1B2" in text
    with pytest.raises(ProgramError, match=r"dependency violation: device 2 .* last backward"):
        validate(graph.with_text(text.replace("dp1:2<1B2", "dp1:2<1B1")))


def test_validator_refuses_a_missing_reduction():
    only0 = lower([M0, M1], [BOUNDARY], make_schedule("1f1b", 2, 3), CLUSTER,
                  data_parallel={0: DP[0]})
    claims = StepGraph(only0.ops, only0.lanes, only0.stages, only0.schedule, only0.plans, DP)
    with pytest.raises(ProgramError, match=r"stage 1: no gradient reduction over \[2, 4\]"):
        validate(claims)


@pytest.mark.parametrize("bad, match", [
    ({5: DataParallel("dp", 8)}, r"key 5 is not a stage"),
    ({0: DataParallel("rows", 8)}, r"data_parallel\[0\]: .* has no axis 'rows'"),
    ({0: ("dp", 8)}, r"data_parallel\[0\]: expected a DataParallel"),
])
def test_lower_refuses_bad_data_parallel(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        lower([M0, M1], [BOUNDARY], make_schedule("1f1b", 2, 2), CLUSTER, data_parallel=bad)


def test_lower_refuses_reductions_in_a_forward_only_step():
    order = make_schedule("gpipe", 2, 2).forward_order()
    with pytest.raises(ValueError, match="forward-only"):
        lower([M0, M1], [BOUNDARY], order, CLUSTER, data_parallel=DP)


def test_data_parallel_value_checks_its_fields():
    with pytest.raises(ValueError, match="nbytes"):
        DataParallel("dp", -1)
    with pytest.raises(TypeError, match="axis"):
        DataParallel("", 1)


def test_simulator_costs_the_reduction_and_overlaps_it():
    sched = make_schedule("1f1b", 2, 4)
    plain = simulate(lower([M0, M1], [BOUNDARY], sched, CLUSTER), CLUSTER, COSTS)
    big = {s: DataParallel("dp", 1 << 30) for s in (0, 1)}
    timeline = simulate(lower([M0, M1], [BOUNDARY], sched, CLUSTER, data_parallel=big),
                        CLUSTER, COSTS)
    # A gigabyte over a ring takes time: the step ends later than without it ...
    assert timeline.iteration_time > plain.iteration_time + 0.01
    spans = {(s.device, s.stage): s for s in timeline.spans if s.kind == "dp"}
    last_b0 = max(s.end for s in timeline.spans if s.stage == 0 and s.stream == "compute")
    # ... and the last stage's reduction starts while stage 0 still computes.
    assert spans[(2, 1)].start < last_b0
    signal = simulate(lower([M0, M1], [BOUNDARY], sched, CLUSTER, data_parallel=big),
                      CLUSTER, COSTS, signal=True)
    assert signal.iteration_time < timeline.iteration_time


def _numpy_stages(grads: dict[int, float], reduced: list[int]):
    def forward(ctx, x):
        ctx.saved["x"] = x
        return float(x.sum()) if ctx.stage == 1 else x * 2

    def backward(ctx, dy):
        x = ctx.saved.pop("x")
        grads[ctx.device] = grads.get(ctx.device, 0.0) + float(x.sum())
        return np.ones_like(x) if dy is None else dy * 2

    def reduce(ctx):
        assert ctx.phase == "R" and ctx.microbatch == -1
        reduced.append(ctx.device)
        grads[ctx.device] = float(ctx.all_reduce(np.array([grads[ctx.device]]), "dp")[0])

    return [Stage(m, forward, backward, data_parallel=GradSync("dp", 8, reduce))
            for m in (M0, DeviceMesh([[2], [3]], ("dp", "tp")))]


def test_runtime_runs_each_lines_reduction_on_its_stream():
    grads: dict[int, float] = {}
    reduced: list[int] = []
    stages = _numpy_stages(grads, reduced)
    m1 = stages[1].mesh
    b = Boundary((4, 3), "float64", Sharding(M0, P("dp")), Sharding(m1, P("dp")))
    mbs = [np.arange(12.0).reshape(4, 3) + i for i in range(3)]
    with Runtime(CLUSTER) as rt:
        rt.train_step_sync(stages, [b], mbs, input_sharding=Sharding(M0, P("dp")),
                           schedule="1f1b")
        spans = [s for s in rt.timeline().spans if s.kind == "dp"]
    assert sorted(reduced) == [0, 1, 2, 3]
    # Each device saw half of every microbatch; after the reduction both replicas of a stage
    # hold the sum over the whole batch.
    whole = sum(float(mb.sum()) for mb in mbs)
    assert grads[0] == grads[1] == pytest.approx(whole)
    assert grads[2] == grads[3] == pytest.approx(2 * whole)
    assert {(s.device, s.stream) for s in spans} == {(0, "dp0"), (1, "dp0"), (2, "dp1"),
                                                     (3, "dp1")}


def test_runtime_refuses_a_data_parallel_axis_the_mesh_lacks():
    stages = _numpy_stages({}, [])
    bad = Stage(stages[0].mesh, stages[0].forward, stages[0].backward,
                data_parallel=GradSync("rows", 8, lambda ctx: None))
    m1 = stages[1].mesh
    b = Boundary((4, 3), "float64", Sharding(M0, P("dp")), Sharding(m1, P("dp")))
    with Runtime(CLUSTER) as rt, pytest.raises(ValueError, match=r"stages\[0\]: data_parallel "
                                                                "axis 'rows'"):
        rt.train_step_sync([bad, stages[1]], [b], [np.zeros((4, 3))],
                           input_sharding=Sharding(M0, P("dp")), schedule="1f1b")


def test_compute_ops_are_unchanged_by_reductions():
    sched = make_schedule("zb-h1", 2, 4)
    with_dp = lower([M0, M1], [BOUNDARY], sched, CLUSTER, data_parallel=DP)
    without = lower([M0, M1], [BOUNDARY], sched, CLUSTER)
    computes = [str(op.body) for op in with_dp.ops if isinstance(op.body, Compute)]
    assert computes == [str(op.body) for op in without.ops if isinstance(op.body, Compute)]
