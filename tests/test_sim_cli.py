"""`overlap simulate`: flags, JSON case files, traces, and errors naming the argument."""

from __future__ import annotations

import json
import re

import pytest

from overlap.cli import main as overlap_main
from scheduler.cli.simulate import EVERY_SCHEDULE, case_from_json

FLAGS = ["--stages", "3", "--microbatches", "4", "--shape", "64,32", "--src-spec=-,gpu",
         "--dst-spec=gpu,-", "--fwd-ms", "5", "--bwd-ms", "10"]


def _table(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] in (*EVERY_SCHEDULE, "signal"):
            rows[parts[0]] = parts[1:]
    return rows


def test_flags_print_one_row_per_schedule_and_signal(capsys):
    assert overlap_main(["simulate", *FLAGS]) == 0
    out = capsys.readouterr().out
    rows = _table(out)
    # interleaved-1f1b runs microbatches in groups of its ranks: 4 do not split over 3.
    assert set(rows) == {"gpipe", "1f1b", "eager-1f1b", "zb-h1", "zbv", "auto", "signal"}
    assert "not run: interleaved-1f1b (num_microbatches:" in out
    signal = float(rows["signal"][0])
    assert float(rows["signal"][1]) == 1.0
    for name in ("gpipe", "1f1b", "eager-1f1b"):
        assert float(rows[name][0]) >= signal  # signal is the upper bound on speed
    # Peak activations of stage 0 follow the schedules: m, min(m, p), min(m, 2p - 1).
    assert [rows[n][-1] for n in ("gpipe", "1f1b", "eager-1f1b")] == ["4", "3", "4"]


def test_signal_lower_bound_is_compute_critical_path(capsys):
    # With zero-latency transfers the 1f1b-free bound is (m + p - 1) * (F + B) for equal stages.
    assert overlap_main(["simulate", *FLAGS]) == 0
    rows = _table(capsys.readouterr().out)
    # p3.8xlarge latencies are microseconds: the signal row sits just above 6 × 15 ms.
    assert 90.0 <= float(rows["signal"][0]) < 91.0


def test_trace_dir_writes_one_trace_per_row(tmp_path, capsys):
    assert overlap_main(["simulate", *FLAGS, "--trace-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"sim-{n}.json" for n in
                           ("1f1b", "eager-1f1b", "gpipe", "zb-h1", "zbv", "auto", "signal"))
    data = json.loads((tmp_path / "sim-1f1b.json").read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    # 3 stages × 4 GPUs × 4 microbatches × (F + B) compute spans, plus transfers.
    assert sum(e["cat"] == "compute" for e in spans) == 3 * 4 * 4 * 2
    assert any(e["cat"] == "comm" for e in spans)


def _case_dict() -> dict:
    return {
        "cluster": {"preset": "p3.8xlarge", "num_hosts": 2},
        "stages": [{"devices": [[0, 1]], "axis_names": ["host", "gpu"]},
                   {"devices": [[4, 5]], "axis_names": ["host", "gpu"]}],
        "boundaries": [{"shape": [16, 16], "dtype": "float32",
                        "producer": ["gpu"], "consumer": [None, "gpu"]}],
        "microbatches": 3,
        "compute_ms": [{"F": 2, "B": 4}, {"F": 3, "B": 6}],
    }


def test_json_case_file(tmp_path, capsys):
    path = tmp_path / "case.json"
    path.write_text(json.dumps(_case_dict()))
    assert overlap_main(["simulate", "--case", str(path)]) == 0
    out = capsys.readouterr().out
    rows = _table(out)
    # Two stages of different meshes cannot share one rank (interleaved-1f1b, zbv).
    assert set(rows) == {"gpipe", "1f1b", "eager-1f1b", "zb-h1", "auto", "signal"}
    assert "not run: zbv (stages[1]: zbv runs stage 1 on rank 0 with stage 0" in out
    case = case_from_json(_case_dict())
    assert case.compute[(1, "B")] == pytest.approx(0.006)
    assert [m.device_ids for m in case.stages] == [(0, 1), (4, 5)]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--stages", "2", "--shape", "4,4", "--src-spec=bogus"], "--src-spec"),
        (["--stages", "2", "--shape", "4,4", "--dst-spec=-,-,-"], "--dst-spec"),
        (["--stages", "2"], "--shape"),
        (["--stages", "2", "--shape", "4,x"], "--shape"),
        (["--stages", "0", "--shape", "4,4"], "--stages"),
        (["--stages", "2", "--shape", "4,4", "--gpus-per-stage", "9"], "--gpus-per-stage"),
        (["--stages", "2", "--shape", "4,4", "--fwd-ms", "-1"], "--fwd-ms"),
        (["--stages", "2", "--shape", "4,4", "--cluster", "nope"], "nope"),
        (["--stages", "2", "--shape", "4,4", "--schedules", "1f1b,nope"],
         "--schedules: nope: unknown schedule"),
        (["--stages", "3", "--microbatches", "4", "--shape", "4,4", "--schedules",
          "interleaved-1f1b"], "--schedules: interleaved-1f1b: num_microbatches"),
        (["--stages", "3", "--shape", "4,4", "--schedules", " , "], "--schedules"),
    ],
)
def test_bad_flags_exit_2_naming_the_argument(argv, needle, capsys):
    assert overlap_main(["simulate", *argv]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err
    assert captured.out == ""


def test_case_file_missing_keys(tmp_path, capsys):
    data = _case_dict()
    del data["compute_ms"]
    path = tmp_path / "case.json"
    path.write_text(json.dumps(data))
    assert overlap_main(["simulate", "--case", str(path)]) == 2
    assert "compute_ms" in capsys.readouterr().err


def test_case_file_compute_list_must_match_stages():
    data = _case_dict()
    data["compute_ms"] = [{"F": 1, "B": 2}]
    with pytest.raises(ValueError, match="compute_ms"):
        case_from_json(data)


def test_every_schedule_runs_from_flags_and_the_split_ones_beat_1f1b(tmp_path, capsys):
    """Transfers of a few bytes (signal-like): the schedules built to shrink 1f1b's bubble —
    the split backward (zb-h1, zbv), two half stages per rank (interleaved-1f1b, zbv) — take
    less time than 1f1b on the same hosts, and auto is as fast as the fastest fixed
    schedule it tries (it tries gpipe, 1f1b, eager-1f1b and zb-h1)."""
    names = "gpipe,1f1b,eager-1f1b,zb-h1,interleaved-1f1b,zbv,auto"
    argv = ["simulate", "--stages", "4", "--microbatches", "8", "--shape", "8,8",
            "--schedules", names, "--trace-dir", str(tmp_path)]
    assert overlap_main(argv) == 0
    out = capsys.readouterr().out
    rows = {name: float(cols[0]) for name, cols in _table(out).items()}
    assert set(rows) == {*names.split(","), "signal"}
    for name in ("zb-h1", "interleaved-1f1b", "zbv"):
        assert rows[name] < rows["1f1b"], (name, rows)
    assert rows["auto"] <= min(rows[n] for n in ("gpipe", "1f1b", "eager-1f1b", "zb-h1"))
    assert "auto's choice: " in out and "not run" not in out
    # interleaved-1f1b and zbv: 8 half stages, two per host, 4 devices each.
    data = json.loads((tmp_path / "sim-zbv.json").read_text())
    computes = [e for e in data["traceEvents"] if e.get("ph") == "X" and e["cat"] == "compute"]
    assert len(computes) == 8 * 4 * 8 * 3  # stages × devices × microbatches × (F, I, W)


def test_a_case_whose_ranks_share_meshes_runs_the_two_stage_per_rank_schedules(tmp_path,
                                                                              capsys):
    data = _case_dict()
    m0, m1 = data["stages"]
    data["stages"] = [m0, m1, m1, m0]  # zbv's V: stages 0 and 3 on rank 0, 1 and 2 on rank 1
    data["boundaries"] = data["boundaries"] * 3
    data["compute_ms"] = {"F": 2, "B": 4, "I": 1, "W": 3}
    data["microbatches"] = 4
    path = tmp_path / "case.json"
    path.write_text(json.dumps(data))
    assert overlap_main(["simulate", "--case", str(path), "--schedules", "zbv"]) == 0
    out = capsys.readouterr().out
    assert set(_table(out)) == {"zbv"}
    # ... and the one-stage-per-rank schedules (signal's eager-1f1b too) do not apply.
    assert "not run: signal (stages: device 4 is in stage 1 and stage 2" in out
    assert case_from_json(data).compute[(2, "W")] == pytest.approx(0.003)
    # interleaved-1f1b places stage s on rank s mod 2: stages 0 and 2 differ here.
    assert overlap_main(["simulate", "--case", str(path), "--schedules",
                         "interleaved-1f1b"]) == 2
    assert "--schedules: interleaved-1f1b: stages[2]" in capsys.readouterr().err


@pytest.mark.parametrize("make", [
    lambda: __import__("scheduler.cli.simulate").cli.simulate.build_parser(),
    lambda: __import__("scheduler.cli").cli.build_parser()],
    ids=["simulate", "plan"])
def test_help_states_each_default_once_and_never_none(make):
    text = make().format_help()
    blocks = re.split(r"\n(?=  -)", text[text.index("options:"):])[1:]  # one per option
    assert len(blocks) > 10
    for block in blocks:
        flat = " ".join(block.split())
        assert flat.count("default") <= 1, flat
        for nothing in ("(default: None)", "(default: )", "(default: False)"):
            assert nothing not in flat, flat
