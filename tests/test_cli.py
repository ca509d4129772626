"""The command line: ``overlap plan`` / ``python -m scheduler plan`` (scheduler/cli/__init__.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import overlap.cli
import scheduler.cli
from scheduler import Cluster, DeviceMesh, P, PlanOptions, ReshardPlan, Sharding, plan_resharding
from scheduler.cli.common import (
    add_plan_options,
    case_from_json,
    parse_mesh,
    parse_spec,
    plan_options,
)

ROOT = Path(__file__).resolve().parents[1]

# 2 × p3.8xlarge: an (8, 4) float32 tensor split by rows over host 0's GPUs, to columns
# split over host 1's GPUs.
SMALL = [
    "--cluster", "p3.8xlarge", "--hosts", "2", "--shape", "8,4", "--dtype", "float32",
    "--src-mesh", "0:1", "--src-spec=gpu,-", "--dst-mesh", "1:2", "--dst-spec=-,gpu",
]


def small_plan(options: PlanOptions | None = None) -> ReshardPlan:
    cluster = Cluster.preset("p3.8xlarge", 2)
    src = Sharding(DeviceMesh([[0, 1, 2, 3]], ("host", "gpu")), P("gpu", None))
    dst = Sharding(DeviceMesh([[4, 5, 6, 7]], ("host", "gpu")), P(None, "gpu"))
    return plan_resharding((8, 4), "float32", src, dst, cluster, options)


def mesh_json(devices) -> dict:
    return {"devices": devices, "axis_names": ["host", "gpu"]}


CASE = {
    "name": "tiny",
    "cluster": {"preset": "p3.8xlarge", "num_hosts": 3},
    "shape": [12, 6],
    "dtype": "int32",
    "src": {"mesh": mesh_json([[0, 1, 2, 3]]), "spec": ["gpu", None]},
    "dst": {"mesh": mesh_json([[4, 5], [8, 9]]), "spec": [None, ["host", "gpu"]]},
}


# ---- overlap plan -------------------------------------------------------------------------


def test_overlap_plan_prints_summary(capsys):
    assert overlap.cli.main(["plan", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "ReshardPlan (8, 4) float32" in out
    assert "strategy=broadcast balance=auto" in out
    assert "estimate" in out
    assert "lower bound" in out
    assert "paper's simple model" in out
    # No transfer listing without --show-transfers.
    assert "  0  " not in out


def test_scheduler_main_plan_matches_overlap(capsys):
    assert overlap.cli.main(["plan", *SMALL]) == 0
    a = capsys.readouterr().out
    assert scheduler.cli.main(["plan", *SMALL]) == 0
    b = capsys.readouterr().out
    assert scheduler.cli.plan_main(SMALL) == 0
    c = capsys.readouterr().out
    assert a == b == c


def test_show_transfers_lists_every_transfer(capsys):
    plan = small_plan()
    assert overlap.cli.main(["plan", *SMALL, "--show-transfers"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [ln for ln in lines if "->" in ln and "B)" in ln]
    assert len(listed) == len(plan.transfers) > 0
    for i, t in enumerate(plan.transfers):
        assert listed[i].split()[0] == str(i)
        assert f"{t.sender} -> {','.join(map(str, t.receivers))}" in listed[i]
        assert f"({t.nbytes} B)" in listed[i]


def test_json_output_round_trips(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert overlap.cli.main(["plan", *SMALL, "--json", str(path)]) == 0
    assert str(path) in capsys.readouterr().out
    loaded = ReshardPlan.from_json(path.read_text())
    expected = small_plan()
    assert loaded.transfers == expected.transfers
    assert loaded.shape == (8, 4)
    assert loaded.dtype == "float32"
    assert loaded.src == expected.src
    assert loaded.dst == expected.dst
    assert (loaded.strategy, loaded.balance) == ("broadcast", "auto")
    loaded.check()


def test_strategy_and_balance_flags_reach_the_planner(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["plan", *SMALL, "--strategy", "send_recv", "--balance", "size", "--json", str(path)]
    assert overlap.cli.main(argv) == 0
    assert "strategy=send_recv balance=size" in capsys.readouterr().out
    loaded = ReshardPlan.from_json(path.read_text())
    # send_recv: one receiver per transfer.
    assert all(len(t.receivers) == 1 for t in loaded.transfers)
    loaded.check()


def test_case_file(tmp_path, capsys):
    case_path = tmp_path / "case.json"
    case_path.write_text(json.dumps(CASE))
    out_path = tmp_path / "plan.json"
    argv = ["plan", "--case", str(case_path), "--show-transfers", "--json", str(out_path)]
    assert overlap.cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "ReshardPlan (12, 6) int32" in out
    assert "estimate" in out and "lower bound" in out
    loaded = ReshardPlan.from_json(out_path.read_text())
    assert loaded.src == Sharding(DeviceMesh([[0, 1, 2, 3]], ("host", "gpu")), P("gpu"))
    assert loaded.dst == Sharding(
        DeviceMesh([[4, 5], [8, 9]], ("host", "gpu")), P(None, ("host", "gpu"))
    )
    cluster = Cluster.preset("p3.8xlarge", 3)
    expected = plan_resharding((12, 6), "int32", loaded.src, loaded.dst, cluster)
    assert loaded.transfers == expected.transfers
    loaded.check()


def test_case_from_json_reads_fields():
    case = case_from_json(CASE)
    assert case.name == "tiny"
    assert case.shape == (12, 6)
    assert case.dtype == "int32"
    assert case.cluster == Cluster.preset("p3.8xlarge", 3)
    assert case.src.mesh.devices.tolist() == [[0, 1, 2, 3]]
    assert case.dst.spec.entries == (None, ("host", "gpu"))
    # Defaults: name "case", dtype float32; a cluster given by its fields.
    data = {k: v for k, v in CASE.items() if k not in ("name", "dtype")}
    data["cluster"] = {"num_hosts": 3, "gpus_per_host": 4, "nic_gbps": 25.0}
    case = case_from_json(data)
    assert (case.name, case.dtype) == ("case", "float32")
    assert case.cluster == Cluster(3, 4, nic_gbps=25.0)


def test_case_from_json_missing_keys():
    data = {k: v for k, v in CASE.items() if k not in ("dst", "shape")}
    with pytest.raises(ValueError, match=r"missing keys \['dst', 'shape'\]"):
        case_from_json(data)


# ---- parse_spec / parse_mesh --------------------------------------------------------------


def test_parse_spec():
    spec = parse_spec("host,-,-")
    assert spec == P("host", None, None)
    assert spec.entries == ("host", None, None)
    spec = parse_spec("host+gpu,None")
    assert spec == P(("host", "gpu"), None)
    assert spec.entries == (("host", "gpu"), None)
    assert parse_spec("-,gpu").entries == (None, "gpu")
    assert parse_spec(" gpu + host , none").entries == (("gpu", "host"), None)
    assert parse_spec("").entries == (None,)


def test_parse_mesh_whole_hosts():
    c = Cluster.preset("p3.8xlarge", 4)
    mesh = parse_mesh("0:2", c, argument="--src-mesh")
    assert mesh.devices.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.axis_names == ("host", "gpu")
    assert parse_mesh("3", c, argument="--src-mesh").devices.tolist() == [[12, 13, 14, 15]]
    assert parse_mesh("2:4", c, argument="--src-mesh").devices.tolist() == [
        [8, 9, 10, 11], [12, 13, 14, 15]
    ]


def test_parse_mesh_first_gpus():
    c = Cluster.preset("p3.8xlarge", 4)
    assert parse_mesh("1:2x2", c, argument="--dst-mesh").devices.tolist() == [[4, 5]]
    assert parse_mesh("0:3x1", c, argument="--dst-mesh").devices.tolist() == [[0], [4], [8]]


@pytest.mark.parametrize("text", ["abc", "0:b", "", "0:2xq", "1.5:2"])
def test_parse_mesh_bad_text(text):
    c = Cluster.preset("p3.8xlarge", 4)
    with pytest.raises(ValueError, match="--src-mesh"):
        parse_mesh(text, c, argument="--src-mesh")


@pytest.mark.parametrize("text", ["0:5", "4:5", "2:1", "1:1", "-1:2", "0:2x5", "0:2x0"])
def test_parse_mesh_out_of_range(text):
    c = Cluster.preset("p3.8xlarge", 4)
    with pytest.raises(ValueError, match="--src-mesh"):
        parse_mesh(text, c, argument="--src-mesh")
    with pytest.raises(ValueError, match="my-arg"):
        parse_mesh(text, c, argument="my-arg")


# ---- error paths --------------------------------------------------------------------------


def run_err(capsys, argv, main=overlap.cli.main) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def replace_flag(argv, flag, value):
    out = list(argv)
    for i, a in enumerate(out):
        if a == flag:
            out[i + 1] = value
            return out
        if a.startswith(flag + "="):
            out[i] = f"{flag}={value}"
            return out
    raise AssertionError(flag)


def test_unknown_axis_in_src_spec(capsys):
    err = run_err(capsys, ["plan", *replace_flag(SMALL, "--src-spec", "foo,-")])
    assert "error" in err
    assert "'foo'" in err
    assert "--src-spec" in err


def test_unknown_axis_in_dst_spec(capsys):
    err = run_err(capsys, ["plan", *replace_flag(SMALL, "--dst-spec", "-,bar")])
    assert "'bar'" in err
    assert "--dst-spec" in err


def test_missing_shape(capsys):
    argv = [a for a in SMALL if a not in ("--shape", "8,4")]
    err = run_err(capsys, ["plan", *argv])
    assert "--shape" in err and "required" in err


@pytest.mark.parametrize("flag", ["--src-mesh", "--dst-mesh"])
def test_missing_mesh(capsys, flag):
    i = SMALL.index(flag)
    argv = SMALL[:i] + SMALL[i + 2 :]
    assert flag in run_err(capsys, ["plan", *argv])


@pytest.mark.parametrize("shape", ["8,x", "8;4", "8,,4", "eight"])
def test_bad_shape_text(capsys, shape):
    err = run_err(capsys, ["plan", *replace_flag(SMALL, "--shape", shape)])
    assert "--shape" in err
    assert repr(shape) in err


@pytest.mark.parametrize(("flag", "value"), [("--src-mesh", "0:9"), ("--dst-mesh", "x")])
def test_bad_mesh_on_command_line(capsys, flag, value):
    err = run_err(capsys, ["plan", *replace_flag(SMALL, flag, value)])
    assert flag in err


def test_case_file_missing_keys(tmp_path, capsys):
    path = tmp_path / "case.json"
    path.write_text(json.dumps({k: v for k, v in CASE.items() if k != "dst"}))
    err = run_err(capsys, ["plan", "--case", str(path)])
    assert "case file" in err
    assert "missing keys" in err and "'dst'" in err


def test_unknown_cluster_preset(capsys):
    err = run_err(capsys, ["plan", *replace_flag(SMALL, "--cluster", "nope")])
    assert "'nope'" in err


@pytest.mark.parametrize("main", [overlap.cli.main, scheduler.cli.main])
def test_unknown_subcommand(capsys, main):
    err = run_err(capsys, ["frobnicate", "--shape", "8"], main=main)
    assert "'frobnicate'" in err
    assert "plan" in err


@pytest.mark.parametrize("main", [overlap.cli.main, scheduler.cli.main])
def test_no_subcommand_is_an_error_but_help_is_not(capsys, main):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out


# ---- python -m scheduler ------------------------------------------------------------------


def test_module_entry_point_plans():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler", "plan", *SMALL],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ReshardPlan (8, 4) float32" in proc.stdout
    assert "estimate" in proc.stdout


def test_seed_and_budget_flags_reach_the_planner(tmp_path, capsys):
    # greedy with a budget of one shuffle and seed 3 is the plan PlanOptions(...) gives.
    path = tmp_path / "plan.json"
    argv = ["plan", *SMALL, "--balance", "greedy", "--seed", "3", "--budget", "1",
            "--json", str(path)]
    assert overlap.cli.main(argv) == 0
    capsys.readouterr()
    plan = small_plan(PlanOptions(balance="greedy", seed=3, budget=1))
    assert ReshardPlan.from_json(path.read_text()).transfers == plan.transfers
    parser = argparse.ArgumentParser()
    add_plan_options(parser)
    args = parser.parse_args(["--balance", "greedy", "--seed", "3", "--budget", "1"])
    assert plan_options(args) == PlanOptions("broadcast", "greedy", 3, 1)
    assert plan_options(parser.parse_args([])) == PlanOptions()


@pytest.mark.parametrize(("flag", "value"), [("--budget", "0"), ("--budget", "-5")])
def test_bad_plan_option_names_the_flag(flag, value, capsys):
    assert overlap.cli.main(["plan", *SMALL, flag, value]) == 2
    assert "--budget" in capsys.readouterr().err


# ---- what a new user tripped on --------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "examples" / "cases"


def test_the_shipped_case_files_run(capsys):
    assert overlap.cli.main(["plan", "--case", str(CASES / "plan_case.json")]) == 0
    assert "ReshardPlan" in capsys.readouterr().out
    assert overlap.cli.main(["simulate", "--case", str(CASES / "simulate_case.json")]) == 0
    assert "eager-1f1b" in capsys.readouterr().out


@pytest.mark.parametrize("command, other", [("plan", "simulate_case.json"),
                                            ("simulate", "plan_case.json")])
def test_a_case_file_of_the_other_command_is_named(capsys, command, other):
    err = run_err(capsys, [command, "--case", str(CASES / other)])
    assert "case file: missing keys" in err


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_missing_or_broken_case_file_is_named(capsys, tmp_path, command):
    err = run_err(capsys, [command, "--case", str(tmp_path / "nope.json")])
    assert f"--case: no such file: {tmp_path / 'nope.json'}" in err
    (tmp_path / "bad.json").write_text("{not json")
    assert "is not JSON" in run_err(capsys, [command, "--case", str(tmp_path / "bad.json")])


def test_trace_report_of_a_missing_file_says_so(capsys, tmp_path):
    err = run_err(capsys, ["trace", "report", str(tmp_path / "missing.json")])
    assert "no such file" in err and "not a trace" not in err


def test_version(capsys):
    assert overlap.cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("overlap ")


def test_a_spec_starting_with_a_dash_needs_no_equals_sign(capsys):
    argv = ["plan", "--hosts", "2", "--shape", "8,8", "--src-mesh", "0:1", "--dst-mesh", "1:2"]
    assert overlap.cli.main([*argv, "--src-spec", "-,gpu", "--dst-spec", "gpu,-"]) == 0
    spaced = capsys.readouterr().out
    assert overlap.cli.main([*argv, "--src-spec=-,gpu", "--dst-spec=gpu,-"]) == 0
    assert capsys.readouterr().out == spaced


def test_simulate_refuses_fewer_hosts_than_stages(capsys):
    err = run_err(capsys, ["simulate", "--hosts", "2", "--stages", "4", "--shape", "64,64"])
    assert "--hosts: 2 hosts for 4 stages" in err


@pytest.mark.parametrize("make", [
    lambda: scheduler.cli.build_parser(),
    lambda: __import__("scheduler.cli.simulate").cli.simulate.build_parser()],
    ids=["plan", "simulate"])
def test_every_option_has_a_help_text_and_help_shows_defaults(make):
    p = make()
    for action in p._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.option_strings
    assert "(default: p3.8xlarge)" in " ".join(p.format_help().split())


def test_line_buffered_stdout_prints_each_line_as_written(monkeypatch, tmp_path):
    """The benchmarks call it first: piped into a file, each row appears as it finishes."""
    import io

    from scheduler.cli.common import line_buffered_stdout

    with open(tmp_path / "out.txt", "w") as piped:
        assert not piped.line_buffering
        monkeypatch.setattr("sys.stdout", piped)
        line_buffered_stdout()
        assert piped.line_buffering
        print("row 1")
        assert (tmp_path / "out.txt").read_text() == "row 1\n"  # before the file is closed
    monkeypatch.setattr("sys.stdout", io.StringIO())  # (a replaced stdout: left alone)
    line_buffered_stdout()
