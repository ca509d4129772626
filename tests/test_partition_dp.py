"""scheduler.partition with data parallelism inside a stage (issue 45): dp × tp × pp chosen
where splitting the batch pays and not where the gradient reduction costs more; the plan's
step graph reduces once per "dp" line and validates; layouts, costs, memory, text, JSON and
the CLI carry the DP degree."""

from __future__ import annotations

import json
import math

import pytest

from scheduler import (
    Cluster,
    GradReduce,
    Layer,
    P,
    PartitionPlan,
    lower,
    partition,
    simulate,
)
from scheduler.cli.partition import partition_main
from scheduler.graph import reduce_lines
from scheduler.validate import validate

CLUSTER = Cluster.preset("p3.8xlarge", num_hosts=2)  # 8 V100s, 4 per host


def _flat(n: int = 4, params: int = 1 << 20, batch: int = 64, **kwargs) -> list[Layer]:
    """Layers that do not speed up with tensor parallelism: the same seconds at every
    degree (the extra devices only help by splitting the batch)."""
    same = {1: 0.01, 2: 0.01, 4: 0.01}
    return [Layer(same, {t: 2 * v for t, v in same.items()}, (batch, 256), "float16", params,
                  1 << 20, name=f"l{i}", **kwargs) for i in range(n)]


def _reductions(plan: PartitionPlan) -> list:
    return [op for op in plan.lower().ops if isinstance(op.body, GradReduce)]


def test_layers_that_tp_does_not_speed_up_get_dp_and_a_faster_plan():
    layers = _flat()
    plan = partition(layers, CLUSTER, 8)
    tp_only = partition(layers, CLUSTER, 8, data_parallel=False)
    assert any(st.dp > 1 for st in plan.stages)
    assert all(st.dp == 1 for st in tp_only.stages)
    assert plan.iteration_time < tp_only.iteration_time
    # What the plan says is what its own graph simulates to, reductions included.
    assert plan.simulate().iteration_time == plan.iteration_time


def test_every_dp_plan_lowers_to_a_valid_graph_with_one_reduction_per_dp_line():
    plan = partition(_flat(), CLUSTER, 8)
    graph = plan.lower()
    validate(graph)
    want = sorted((s, line) for s, st in enumerate(plan.stages) if st.dp > 1
                  for line in reduce_lines(st.mesh, "dp"))
    got = sorted((op.body.stage, op.devices) for op in _reductions(plan))
    assert got == want and got
    for op in _reductions(plan):
        st = plan.stages[op.body.stage]
        assert len(op.devices) == st.dp
        # Each device all-reduces its share of the stage's parameters: bytes / TP degree.
        params = sum(layer.params_bytes for layer in _flat()[st.layers.start:st.layers.stop])
        assert op.body.nbytes == math.ceil(params / st.tp)


def test_the_reduction_is_costed_in_the_simulated_time():
    plan = partition(_flat(params=64 << 20), CLUSTER, 8)
    assert any(st.dp > 1 for st in plan.stages)
    bare = lower(plan.meshes, plan.boundaries, plan.schedule, plan.cluster, plan.options)
    without = simulate(bare, plan.cluster, plan.compute_costs()).iteration_time
    assert plan.iteration_time > without


def test_huge_parameters_and_tiny_compute_keep_dp_at_one():
    # 4 GiB of gradients to all-reduce against 0.3 ms of compute saved: never worth it.
    same = {1: 1e-4, 2: 1e-4, 4: 1e-4}
    layers = [Layer(same, {t: 2 * v for t, v in same.items()}, (64, 256), "float16",
                    4 << 30, 1 << 20) for _ in range(4)]
    plan = partition(layers, CLUSTER, 8)
    assert all(st.dp == 1 for st in plan.stages)
    assert _reductions(plan) == []
    # ... while the same layers without parameters do split the batch.
    light = [Layer(same, {t: 2 * v for t, v in same.items()}, (64, 256), "float16", 0,
                   1 << 20) for _ in range(4)]
    assert any(st.dp > 1 for st in partition(light, CLUSTER, 8).stages)


def test_layouts_put_dp_on_dim_0_composed_with_the_tp_layout():
    # 64 MiB of parameters per layer: all-reducing 256 MiB across the hosts' NICs costs
    # more than a boundary between two hosts, each stage data-parallel inside its host.
    layers = _flat(params=64 << 20, output_spec=P(None, "tp"), input_spec=P(None, "tp"))
    plan = partition(layers, CLUSTER, 8)
    assert any(st.dp > 1 for st in plan.stages) and len(plan.stages) > 1
    for s, b in enumerate(plan.boundaries):
        for side, st in ((b.producer, plan.stages[s]), (b.consumer, plan.stages[s + 1])):
            assert side.mesh == st.mesh
            want = P("dp", "tp") if st.dp > 1 else P(None, "tp")
            assert tuple(side.spec.padded(2)) == tuple(want.padded(2))


@pytest.mark.parametrize("change", [{"batch": 3}, {"output_spec": P("tp")}])
def test_a_batch_that_cannot_split_keeps_dp_at_one(change):
    # A batch of 3 does not divide by 2 or 4; a layout already splitting dim 0 over "tp"
    # leaves it nothing to split over "dp".
    plan = partition(_flat(**change), CLUSTER, 8)
    assert all(st.dp == 1 for st in plan.stages)


def test_costs_and_memory_follow_the_degrees():
    layers = _flat()
    plan = partition(layers, CLUSTER, 8)
    for s, st in enumerate(plan.stages):
        part = layers[st.layers.start:st.layers.stop]
        assert st.forward == pytest.approx(sum(x.forward[st.tp] for x in part) / st.dp)
        assert st.backward == pytest.approx(sum(x.backward[st.tp] for x in part) / st.dp)
        assert st.params_bytes == pytest.approx(sum(x.params_bytes for x in part) / st.tp)
        assert st.activation_bytes == pytest.approx(
            sum(x.activation_bytes for x in part) / (st.tp * st.dp))
        kept = plan.schedule.peak_activations(s)
        assert plan.peak_memory[s] == pytest.approx(st.params_bytes + kept * st.activation_bytes)


def test_text_json_and_cli_carry_the_dp_degree(tmp_path, capsys):
    plan = partition(_flat(), CLUSTER, 8)
    head = plan.to_text().splitlines()[0].split()
    assert "DP" in head
    column = head.index("DP")
    rows = [line.split() for line in plan.to_text().splitlines()[1:len(plan.stages) + 1]]
    assert [int(r[column]) for r in rows] == [st.dp for st in plan.stages]
    data = json.loads(plan.to_json())
    assert data["partition"]["dp"] == [st.dp for st in plan.stages]
    again = PartitionPlan.from_json(plan.to_json())
    assert [st.dp for st in again.stages] == [st.dp for st in plan.stages]
    assert again.lower().to_json() == plan.lower().to_json()
    # The CLI prints the same table.
    case = {"cluster": {"preset": "p3.8xlarge", "num_hosts": 2}, "microbatches": 8,
            "layers": [{"forward_ms": {"1": 10, "2": 10, "4": 10},
                        "backward_ms": {"1": 20, "2": 20, "4": 20}, "output_shape": [64, 256],
                        "dtype": "float16", "params_bytes": 1 << 20,
                        "activation_bytes": 1 << 20, "repeat": 4}]}
    path = tmp_path / "case.json"
    path.write_text(json.dumps(case))
    assert partition_main(["--case", str(path)]) == 0
    out = capsys.readouterr().out
    assert " DP " in out and plan.to_text().splitlines()[1] in out


def test_data_parallel_must_be_a_bool():
    with pytest.raises(TypeError, match=r"data_parallel: expected a bool"):
        partition(_flat(), CLUSTER, 8, data_parallel=1)


def test_simulate_case_of_a_dp_plan_includes_its_reductions():
    from scheduler.cli.simulate import case_from_json, run_rows

    layers = [Layer({1: 0.01, 2: 0.01}, {1: 0.02, 2: 0.02}, (8, 64), "float32", 64 << 20,
                    1 << 10) for _ in range(4)]
    plan = partition(layers, Cluster.local(8), 4)
    assert plan.data_parallel, plan.to_text()
    case = case_from_json(json.loads(plan.to_json()))
    assert case.data_parallel == plan.data_parallel
    rows, _ = run_rows(case, schedules=())
    own = next(r for r in rows if r.label == plan.schedule.name)
    assert own.timeline.iteration_time == pytest.approx(plan.simulate().iteration_time)
    data = json.loads(plan.to_json())
    data["data_parallel"] = {"0": {"axis": "rows", "nbytes": 8}}
    with pytest.raises(ValueError, match=r"data_parallel\[0\]: stage 0's mesh has no axis "
                                         r"'rows'"):
        case_from_json(data)
