"""The CLI on malformed case files and output paths: one ``error: <argument>: ...`` line and
exit 2 before any work — never a traceback (issue 35's corpus of CLI inputs)."""

from __future__ import annotations

import json
import re

import pytest
from cli_errors import ROOT, assert_one_line_error, run_overlap

PLAN = json.loads((ROOT / "examples" / "cases" / "plan_case.json").read_text())
SIM = json.loads((ROOT / "examples" / "cases" / "simulate_case.json").read_text())


def _edited(base: dict, edit) -> dict:
    data = json.loads(json.dumps(base))
    edit(data)
    return data


CASES = {
    "plan-preset-without-hosts": ("plan", _edited(PLAN, lambda d: d.update(
        cluster={"preset": "p3.8xlarge"})), r"--case: .*: missing field 'num_hosts'"),
    "plan-empty-src": ("plan", _edited(PLAN, lambda d: d.update(src={})),
                       r"missing field 'mesh'"),
    "plan-not-an-object": ("plan", [1, 2], r"holds no JSON object"),
    "plan-shape-a-number": ("plan", _edited(PLAN, lambda d: d.update(shape=8)),
                            r"--case: .*: a field of the wrong kind"),
    "sim-no-stages": ("simulate", _edited(SIM, lambda d: d.update(stages=[])),
                      r"stages: need at least one stage mesh"),
    "sim-too-few-stages": ("simulate", _edited(SIM, lambda d: d.update(stages=d["stages"][:1])),
                           r"boundaries: 1 stages need 0 boundaries"),
    "sim-boundary-without-shape": ("simulate", _edited(SIM, lambda d: d["boundaries"][0].pop(
        "shape")), r"missing field 'shape'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_case_file_is_one_named_error(tmp_path, case):
    command, data, match = CASES[case]
    path = tmp_path / "case.json"
    path.write_text(json.dumps(data))
    assert_one_line_error(run_overlap(command, "--case", str(path)), match)


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_case_paths_that_are_no_case_file_are_named(tmp_path, command):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    cases = ((str(deep), r"--case: .* nests its JSON too deep"),
             ("/dev/zero", r"--case: /dev/zero is not a regular file"),
             (str(tmp_path), r"is not a regular file"),
             (str(tmp_path / "none.json"), r"no such file"))
    for path, match in cases:
        assert_one_line_error(run_overlap(command, "--case", path), match)


def test_output_paths_that_cannot_be_written_are_named_before_any_work(tmp_path):
    plan_case = ROOT / "examples" / "cases" / "plan_case.json"
    assert_one_line_error(run_overlap("plan", "--case", str(plan_case), "--json", str(tmp_path)),
                    r"--json: .* is a directory")
    afile = tmp_path / "README.md"
    afile.write_text("mine")
    assert_one_line_error(run_overlap("simulate", "--case", str(ROOT / "examples" / "cases" /
                                                    "simulate_case.json"),
                         "--trace-dir", str(afile)), r"--trace-dir: .* is not a directory")
    assert afile.read_text() == "mine"


@pytest.mark.parametrize("argv, match", [
    (["simulate", "--stages", "x"], r"^error: --stages: invalid int value: 'x'$"),
    (["simulate", "--stages", "3", "--bogus"], r"^error: unrecognized arguments: --bogus$"),
    (["plan", "--strategy", "nope"], r"^error: --strategy: invalid choice: 'nope'"),
    (["trace", "report"], r"^error: the following arguments are required"),
])
def test_argument_errors_of_every_command_are_one_line(argv, match):
    assert_one_line_error(run_overlap(*argv), match)


def test_profile_names_a_bad_output_folder_before_looking_for_nsys(tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    done = run_overlap("profile", "-o", str(afile), "--", "python", "train.py")
    assert_one_line_error(done, r"^error: -o/--output: .*notes.txt is a file, not a directory$")
    assert afile.read_text() == "mine"


EXAMPLES = ("toy_pipeline.py", "torch_pipeline.py", "gpt_pipeline.py")


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_examples_refuse_bad_flags_before_any_work(tmp_path, example):
    import subprocess
    import sys

    if example != "toy_pipeline.py":
        pytest.importorskip("torch")
    afile = tmp_path / "README.md"
    afile.write_text("mine")
    for argv, match in ((["--trace-dir", str(afile)], r"--trace-dir: .* is a file, not a "
                                                      r"directory"),
                        (["--steps", "0"], r"--steps: must be >= 1, got 0"),
                        (["--microbatches", "-2"], r"--microbatches: must be >= 1, got -2"),
                        (["--lr", "nan"], r"--lr: must be a finite number > 0, got nan")):
        done = subprocess.run([sys.executable, str(ROOT / "examples" / example), *argv],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert re.search(rf"{example}: error: argument {match}", last), last
        assert done.stdout == ""
    assert afile.read_text() == "mine"
    assert list(tmp_path.iterdir()) == [afile]  # (no traces folder made)


# ---- issue 46: inputs bounded before any work (sizes the machine cannot hold) ------------

BOUNDED = 2 << 30  # each hostile run's address space: far below what the input would take
PARTITION = json.loads((ROOT / "examples" / "cases" / "partition_case.json").read_text())


@pytest.mark.parametrize("argv, match", [
    (["--microbatches", "-1"], r"^error: --microbatches: need at least 1, got -1$"),
    (["--microbatches", "0"], r"^error: --microbatches: need at least 1, got 0$"),
    (["--microbatches", str(10**12)], r"^error: --microbatches: 4 stages × 1000000000000 "
                                      r"microbatches is more than 65536"),
    (["--stages", "64", "--microbatches", "1025"], r"^error: --microbatches: 64 stages × "
                                                   r"1025 microbatches is more than 65536"),
    (["--stages", str(10**12)], r"^error: --stages: 1000000000000 stages × 8 microbatches is "
                                r"more than 65536"),
    (["--gpus-per-stage", "0"], r"^error: --gpus-per-stage: need at least 1, got 0$"),
])
def test_simulate_flags_past_what_a_schedule_holds_are_refused(argv, match):
    done = run_overlap("simulate", "--shape", "8,8", *argv, memory=BOUNDED)
    assert_one_line_error(done, match)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "2.5", "true", '"4"', "0",
                                   str(10**12)])
def test_simulate_case_microbatches_that_are_no_count_are_named(tmp_path, value):
    path = tmp_path / "case.json"
    text = json.dumps({**SIM, "microbatches": "HERE"}).replace('"HERE"', value)
    path.write_text(text)  # (NaN and Infinity as JSON's non-standard literals)
    assert_one_line_error(run_overlap("simulate", "--case", str(path), memory=BOUNDED),
                          r"^error: microbatches: (expected an int >= 1|.* is more than)")


def test_simulate_exits_2_saying_why_when_no_schedule_applies(tmp_path):
    m0, m1 = SIM["stages"][:2]  # stage 2 back on stage 0's devices, another rank's
    path = tmp_path / "case.json"
    path.write_text(json.dumps({**SIM, "stages": [m0, m1, m0],
                                "boundaries": SIM["boundaries"][:2]}))
    assert_one_line_error(run_overlap("simulate", "--case", str(path)),
                          r"^error: --case: .*: no schedule applies to this pipeline: stages: "
                          r"device 0 is in stage 0 and stage 2")


def _partition_case(hosts: int, repeat: int) -> dict:
    return _edited(PARTITION, lambda d: (d["cluster"].update(num_hosts=hosts),
                                         d["layers"][1].update(repeat=repeat)))


@pytest.mark.parametrize("hosts, repeat, match", [
    (10**9, 24, r"^error: cluster: 1000000000 hosts × 4 GPUs is 4000000000 devices; a "
                r"partition searches at most 4096$"),
    (64, 24, r"^error: cluster: 26 layers on 256 devices \(\d+ stage shapes\) need about "
             r"[\d.]+ GiB of search tables, more than 4.00 GiB"),
    (2, 4000, r"^error: layers: 4002 layers on 8 devices \(\d+ stage shapes\) need about "
              r"[\d.]+ GiB of search tables, more than 4.00 GiB"),
    (2, 10000, r"^error: layers\[1\]\.repeat: expected an int in 1\.\.4096, got 10000$"),
])
def test_partition_cases_past_what_the_search_can_hold_are_refused(tmp_path, hosts, repeat,
                                                                   match):
    from scheduler.partition.search import MAX_SEARCH_BYTES

    path = tmp_path / "case.json"
    path.write_text(json.dumps(_partition_case(hosts, repeat)))
    assert MAX_SEARCH_BYTES == 4 << 30  # (the figure the messages name)
    assert_one_line_error(run_overlap("partition", "--case", str(path), memory=BOUNDED), match)


def test_the_search_size_estimate_grows_as_its_tables(tmp_path):
    """search_bytes: the layers² part quadruples with twice the layers; the boundary part
    grows with the devices × stage shapes²."""
    from scheduler.cli.partition import case_from_json
    from scheduler.partition import make_problem, search_bytes

    def sizes(hosts: int, repeat: int) -> tuple[int, int]:
        case = case_from_json(_partition_case(hosts, repeat))
        return search_bytes(make_problem(case["layers"], case["cluster"], case["microbatches"],
                                     case["memory"], None))

    (sq1, b1), (sq2, _), (_, b4) = sizes(2, 998), sizes(2, 1998), sizes(4, 998)
    assert 3.9 < sq2 / sq1 < 4.1  # (1000 → 2000 layers)
    assert b4 > 3 * b1  # (8 → 16 devices, 9 → 18 shapes)


def test_plan_of_an_empty_tensor_says_so_instead_of_a_nan_ratio():
    done = run_overlap("plan", "--shape", "0,8", "--hosts", "2", "--src-mesh", "0:1",
                       "--dst-mesh", "1:2")
    assert done.returncode == 0, done.stderr
    assert "nan" not in done.stdout
    assert "no ratio: the tensor is empty (shape (0, 8))" in done.stdout
