"""``overlap partition`` (issue 36, point 6): the plan as a table and as JSON that ``overlap
simulate`` and the runtime accept; malformed case files as one ``error:`` line, exit 2."""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest
from cli_errors import ROOT, assert_one_line_error, run_overlap

import overlap
from scheduler import Cluster, Layer, P, PartitionPlan, Sharding, partition

CASE = ROOT / "examples" / "cases" / "partition_case.json"
BASE = json.loads(CASE.read_text())


def test_the_sample_case_prints_a_plan_that_overlap_simulate_reads_back(tmp_path):
    out = tmp_path / "plan.json"
    done = run_overlap("partition", "--case", str(CASE), "--json", str(out))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    head = next(line for line in lines if line.strip().startswith("stage"))
    for column in ("layers", "mesh", "devices", "TP", "receives", "sends", "F ms"):
        assert column in head
    said = re.search(r"schedule (.+), 16 microbatches: simulated iteration ([\d.]+) ms",
                     done.stdout)
    assert said, done.stdout
    plan = PartitionPlan.from_json(out.read_text())
    assert plan.schedule.name == said.group(1)
    assert sum(len(s.layers) for s in plan.stages) == 26  # 1 + 24 (repeat) + 1
    sim = run_overlap("simulate", "--case", str(out))
    assert sim.returncode == 0, sim.stderr
    row = next(line for line in sim.stdout.splitlines()
               if line.strip().startswith(plan.schedule.name))
    assert row.split()[len(plan.schedule.name.split())] == said.group(2)[:-1]  # 1 decimal


def _edited(edit) -> dict:
    data = json.loads(json.dumps(BASE))
    edit(data)
    return data


def _layer(data: dict, **change) -> None:
    data["layers"][1].update(change)


CASES = {
    "not-an-object": ([1, 2], r"--case: .* holds no JSON object"),
    "no-layers": (_edited(lambda d: d.pop("layers")), r"missing keys \['layers'\]"),
    "empty-layers": (_edited(lambda d: d.update(layers=[])), r"layers: expected a non-empty"),
    "layer-a-number": (_edited(lambda d: d["layers"].insert(0, 5)),
                       r"layers\[0\]: expected an object"),
    "no-forward": (_edited(lambda d: d["layers"][1].pop("forward_ms")),
                   r"missing field 'forward_ms'"),
    "forward-a-list": (_edited(lambda d: _layer(d, forward_ms=[1, 2])),
                       r"layers\[1\]\.forward_ms: expected an object"),
    "degree-not-int": (_edited(lambda d: _layer(d, forward_ms={"four": 1.0})),
                       r"layers\[1\]\.forward_ms: TP degree 'four' is not an int"),
    "negative-ms": (_edited(lambda d: _layer(d, backward_ms={"1": -1, "2": 1, "4": 1})),
                    r"layers\[1\]: backward\[1\]: expected finite seconds"),
    "bad-dtype": (_edited(lambda d: _layer(d, dtype="text")), r"layers\[1\]: dtype: 'text'"),
    "unknown-field": (_edited(lambda d: _layer(d, flops=5)),
                      r"layers\[1\]: unknown fields \['flops'\]"),
    "repeat-zero": (_edited(lambda d: _layer(d, repeat=0)), r"layers\[1\]\.repeat"),
    "bad-spec": (_edited(lambda d: _layer(d, output_spec=["gpu"])),
                 r"layers\[1\]: output_spec: .* names axes \['gpu'\]"),
    "microbatches-zero": (_edited(lambda d: d.update(microbatches=0)),
                          r"microbatches: expected an int >= 1"),
    "memory-a-string": (_edited(lambda d: d.update(memory_per_device_gib="16")),
                        r"memory_per_device_gib: expected a number"),
    "memory-too-small": (_edited(lambda d: d.update(memory_per_device_gib=0.1)),
                         r"cannot fit even alone|no partition fits memory_per_device"),
    "preset-without-hosts": (_edited(lambda d: d.update(cluster={"preset": "dgx-h100"})),
                             r"missing field 'num_hosts'"),
}


def _in_process(capsys, *argv: str) -> subprocess.CompletedProcess[str]:
    """``overlap ARGV`` in this process (what the subprocess runs, without its start-up):
    an exception escaping it fails the test as a traceback would."""
    from scheduler.cli import main

    code = main(list(argv), prog="overlap")
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["overlap", *argv], code, out, err)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_partition_case_is_one_named_error(tmp_path, capsys, case):
    data, match = CASES[case]
    path = tmp_path / "case.json"
    path.write_text(json.dumps(data))
    assert_one_line_error(_in_process(capsys, "partition", "--case", str(path)), match)


def test_a_plan_of_one_stage_per_rank_is_simulated_beside_the_fixed_schedules(tmp_path,
                                                                               capsys):
    # Three layers: no two-chunks-per-rank candidate (it needs 2 layers per rank), so the
    # plan runs one stage per rank and simulate adds its row to the fixed schedules'.
    case = {**BASE, "layers": [BASE["layers"][0], {**BASE["layers"][1], "repeat": 1},
                               BASE["layers"][2]], "microbatches": 4}
    path, out = tmp_path / "case.json", tmp_path / "plan.json"
    path.write_text(json.dumps(case))
    done = _in_process(capsys, "partition", "--case", str(path), "--json", str(out))
    assert done.returncode == 0, done.stderr
    plan = PartitionPlan.from_json(out.read_text())
    assert plan.schedule.stages_per_rank == 1
    sim = _in_process(capsys, "simulate", "--case", str(out))
    assert sim.returncode == 0, sim.stderr
    lines = sim.stdout.splitlines()
    table = lines[3:next(i for i, line in enumerate(lines) if line.startswith("exposed comm:"))]
    rows = [line.split()[0] for line in table]
    assert rows[:3] == ["gpipe", "1f1b", "eager-1f1b"] and rows[-1] == "signal"
    assert plan.schedule.name.split()[0] == rows[-2]  # the plan's own row, before signal


def test_paths_and_flags_that_cannot_work_are_named_before_any_work(tmp_path, capsys):
    # (as a user runs it, once: the entry point itself)
    assert_one_line_error(run_overlap("partition", "--case", "/dev/zero"),
                          r"--case: /dev/zero is not a regular file")
    assert_one_line_error(_in_process(capsys, "partition", "--case",
                                      str(tmp_path / "none.json")), r"--case: no such file")
    assert_one_line_error(_in_process(capsys, "partition", "--case", str(CASE), "--json",
                                      str(tmp_path)), r"--json: .* is a directory")
    assert_one_line_error(_in_process(capsys, "partition", "--case", str(CASE),
                                      "--microbatches", "0"),
                          r"--microbatches: expected an int >= 1")


def test_the_plan_json_runs_on_the_runtime_like_a_hand_written_pipeline():
    # Stage functions in numpy (tanh layers, replicated layouts: every device of a stage
    # computes the whole microbatch), the plan's graph read back from its JSON, against a
    # plain numpy run of the same layers.
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((16, 16)) / 4 for _ in range(6)]
    layers = [Layer({1: 1e-3 * (1 + i % 3), 2: 6e-4 * (1 + i % 3)},
                    {1: 2e-3 * (1 + i % 3), 2: 1.2e-3 * (1 + i % 3)}, (4, 16), "float64",
                    0, 0, output_spec=P(), input_spec=P()) for i in range(6)]
    cluster = Cluster.local(4)
    # (data_parallel=False: these stage functions are written for replicated layouts.)
    plan = PartitionPlan.from_json(partition(layers, cluster, 4,
                                             data_parallel=False).to_json())
    graph = plan.lower()
    stages = [overlap.Stage(st.mesh, _forward(weights, st.layers, last=s == len(plan.stages) - 1),
                            _backward(weights, st.layers))
              for s, st in enumerate(plan.stages)]
    xs = [rng.standard_normal((4, 16)) for _ in range(4)]
    with overlap.Runtime(cluster) as rt:
        losses = rt.train_step_sync(stages, plan.boundaries, xs,
                                    input_sharding=Sharding(plan.stages[0].mesh, P()),
                                    graph=graph)
    want = []
    for x in xs:
        for w in weights:
            x = np.tanh(x @ w)
        want.append(0.5 * float((x * x).sum()))
    assert losses == pytest.approx(want, rel=1e-12)


def _forward(weights, layers, last):
    def f(ctx, x):
        ys = [x]
        for i in layers:
            ys.append(np.tanh(ys[-1] @ weights[i]))
        ctx.saved["ys"] = ys
        y = ys[-1]
        return 0.5 * float((y * y).sum()) if last else y
    return f


def _backward(weights, layers):
    def b(ctx, dy):
        ys = ctx.saved["ys"]
        g = ys[-1] if dy is None else dy
        for k, i in reversed(list(enumerate(layers))):
            g = (g * (1 - ys[k + 1] ** 2)) @ weights[i].T
        return g
    return b
