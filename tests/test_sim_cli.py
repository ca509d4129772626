"""`overlap simulate`: flags, JSON case files, traces, and errors naming the argument."""

from __future__ import annotations

import json

import pytest

from overlap.cli import main as overlap_main
from scheduler.sim_cli import case_from_json

FLAGS = ["--stages", "3", "--microbatches", "4", "--shape", "64,32", "--src-spec=-,gpu",
         "--dst-spec=gpu,-", "--fwd-ms", "5", "--bwd-ms", "10"]


def _table(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] in ("gpipe", "1f1b", "eager-1f1b", "signal"):
            rows[parts[0]] = parts[1:]
    return rows


def test_flags_print_one_row_per_schedule_and_signal(capsys):
    assert overlap_main(["simulate", *FLAGS]) == 0
    rows = _table(capsys.readouterr().out)
    assert set(rows) == {"gpipe", "1f1b", "eager-1f1b", "signal"}
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
    assert names == ["sim-1f1b.json", "sim-eager-1f1b.json", "sim-gpipe.json", "sim-signal.json"]
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
    rows = _table(capsys.readouterr().out)
    assert set(rows) == {"gpipe", "1f1b", "eager-1f1b", "signal"}
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
