"""examples/toy_pipeline.py — the README's first command — as a new user runs it: it trains
(the loss falls), checks itself against the float64 reference at any size, compares the
schedules by medians with the machine's noise, and every flag value its --help and the docs
name works; bad values are refused naming the flag."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import toy_pipeline
from toy import ToyMLP

from scheduler import Cluster

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "toy_pipeline.py"


def _run(capsys, tmp_path, *argv: str) -> str:
    assert toy_pipeline.main([*argv, "--trace-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for schedule in ("1f1b", "eager-1f1b"):
        assert (tmp_path / f"toy-{schedule}.json").stat().st_size > 0
    return out


def _losses(out: str) -> tuple[float, float]:
    found = re.search(r"mean loss per row: ([\d.]+) at step 0, ([\d.]+) at step", out)
    assert found, out
    return float(found.group(1)), float(found.group(2))


@pytest.mark.parametrize("hidden", ["16", "64"])
def test_the_loss_falls_and_matches_the_reference_over_several_steps(tmp_path, hidden):
    """``--steps 4`` (and ``--hidden 64``) failed with a fixed absolute tolerance while the
    loss climbed 8.6×: now the loss falls and every step matches to a relative bound. Run as
    the user runs it (its own process: the script sets BLAS to one thread before numpy
    loads, which an import here would be too late for)."""
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "4", "--hidden", hidden,
                           "--trace-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    first, last = _losses(done.stdout)
    assert last < 0.5 * first, done.stdout
    assert done.stdout.count("match the reference") == 4, done.stdout


def test_the_comparison_is_a_median_with_the_noise_beside_it(capsys, tmp_path):
    out = _run(capsys, tmp_path, "--steps", "4", "--batch", "64")
    assert "median step ms (of 3)" in out, out
    assert re.search(r"eager-1f1b / 1f1b: [\d.]+ × \(", out), out
    assert re.search(r"noise: the 3 measured steps of one schedule spread over up to \d+%",
                     out), out


def test_one_step_says_the_noise_cannot_be_told(capsys, tmp_path):
    out = _run(capsys, tmp_path, "--steps", "1", "--batch", "64")
    assert "too few to tell a difference from noise" in out, out


FLAG_VALUES = [
    ["--emulate", "p3.8xlarge"],
    ["--emulate", "dgx-h100"],
    ["--emulate", "p3.8xlarge", "--compute-ratio", "0.5"],
    ["--microbatches", "1"],
    ["--microbatches", "3"],
    ["--batch", "1"],
    ["--hidden", "2"],
    ["--lr", "1e-6"],
]


@pytest.mark.parametrize("flags", FLAG_VALUES, ids=" ".join)
def test_every_documented_flag_value_runs(capsys, tmp_path, flags):
    defaults = {"--steps": "2", "--batch": "64"}
    argv = [*flags]
    for flag, value in defaults.items():
        if flag not in flags:
            argv += [flag, value]
    out = _run(capsys, tmp_path, *argv)
    assert "match the reference" in out and "overlap report" in out, out


def test_every_flag_of_the_help_is_exercised():
    """The flags --help lists are the ones the tests above run (a new flag needs a case)."""
    listed = {f for a in toy_pipeline.build_parser()._actions for f in a.option_strings}
    tested = {f for flags in FLAG_VALUES for f in flags if f.startswith("--")}
    tested |= {"--steps", "--batch", "--trace-dir", "-h", "--help"}
    assert listed <= tested, listed - tested


@pytest.mark.parametrize("argv, flag", [
    (["--hidden", "7"], "--hidden"), (["--hidden", "0"], "--hidden"),
    (["--steps", "0"], "--steps"), (["--microbatches", "-1"], "--microbatches"),
    (["--batch", "x"], "--batch"), (["--lr", "nan"], "--lr"), (["--lr", "-0.1"], "--lr"),
    (["--compute-ratio", "inf"], "--compute-ratio"), (["--emulate", "nope"], "--emulate"),
])
def test_a_bad_value_is_refused_naming_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as done:
        toy_pipeline.main(argv)
    assert done.value.code == 2
    captured = capsys.readouterr()
    assert f"argument {flag}:" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_the_reference_check_is_relative_to_the_values():
    model = ToyMLP.build(Cluster.preset("p3.8xlarge", 4), hidden=4, batch=2)
    ref = [w * 1e6 for w in model.full_weights]  # large values: last bits are large too
    for key in model.weights:
        model.weights[key] = model.shard(key[0], key[1], ref[key[0]]).copy()
        model.grads[key] = np.zeros_like(model.weights[key])
    zeros = [np.zeros_like(w) for w in ref]
    model.weights[(0, 0)][0, 0] += 1e-4  # 1e-10 of the values, 1e-4 absolute
    assert model.check_against(ref, zeros, atol=0, rtol=1e-9) == pytest.approx(1e-4, rel=1e-3)
    with pytest.raises(AssertionError, match=r"differs from the reference by .* \(stage 0"):
        model.check_against(ref, zeros)  # (an absolute 1e-10 would refuse it)
    model.weights[(0, 0)][0, 0] += 1.0  # 1e-6 of the values
    with pytest.raises(AssertionError, match="stage 0, device 0"):
        model.check_against(ref, zeros, atol=0, rtol=1e-9)
