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
