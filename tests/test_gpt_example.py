"""examples/gpt_pipeline.py: a GPT in stages of tensor-parallel degrees 1, 2, 4, 2 trains
under every schedule with plain torch's numerics, in one process and under mpiexec, and
fails loudly when it does not."""

from __future__ import annotations

from pathlib import Path

import pytest
from launchers import launch

pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 (the "
                                    "'torch' extra) to run the GPT example")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt_pipeline.py"
SMALL = ["--layers", "8", "--width", "32", "--heads", "4", "--seq", "8", "--vocab", "64",
         "--batch", "8", "--microbatches", "4", "--steps", "2"]


@pytest.fixture
def example(monkeypatch):
    import torch
    from torch_reference import load_example

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave the suite's alone
    return load_example("gpt_pipeline.py")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "eager-1f1b", "zb-h1",
                                      "interleaved-1f1b", "zbv"])
def test_every_schedule_trains_the_tensor_parallel_gpt_like_torch(example, schedule, tmp_path,
                                                                   capsys):
    assert example.main([*SMALL, "--schedule", schedule, "--trace-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "match plain torch" in out and "tokens/s" in out
    # Every boundary is reported with its plan/bound ratio (at least 1).
    ratios = [float(line.rsplit("ratio ", 1)[1]) for line in out.splitlines()
              if line.strip().startswith("boundary")]
    stages = 8 if schedule in ("interleaved-1f1b", "zbv") else 4
    assert len(ratios) == 2 * (stages - 1) and min(ratios) >= 1.0


@pytest.mark.parametrize("args", [["--dtype", "bfloat16"], ["--sequence-parallel"],
                                  ["--dtype", "bfloat16", "--sequence-parallel",
                                   "--schedule", "zb-h1"]])
def test_bfloat16_and_sequence_parallel_match_torch(example, args, tmp_path, capsys):
    assert example.main([*SMALL, *args, "--trace-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "match plain torch" in out
    if "--sequence-parallel" in args:
        assert "P(None, 'tp')" in out  # boundaries sharded along the sequence


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved-1f1b", "zbv"])
def test_sequences_of_their_own_lengths_match_torch(example, schedule, tmp_path, capsys):
    # --seq 16: lengths between 4 and 16, multiples of 4 (sequence-parallel blocks).
    args = [*SMALL, "--seq", "16", "--variable-lengths", "--sequence-parallel", "--schedule",
            schedule, "--trace-dir", str(tmp_path)]
    assert example.main(args) == 0
    assert "match plain torch" in capsys.readouterr().out


def test_lengths_are_long_tailed_multiples_of_the_block(example):
    import torch

    got = example.lengths(torch.Generator().manual_seed(0), 400, 1024, 4)
    assert min(got) >= 256 and max(got) <= 1024 and all(n % 4 == 0 for n in got)
    assert sorted(got)[len(got) // 2] < 512  # most are short
    assert max(got) > 900  # a few are long


def test_the_example_fails_when_a_gradient_is_wrong(example, tmp_path, monkeypatch, capsys):
    # A tensor-parallel all-reduce that drops the other devices' part must fail the check.
    from overlap.torch import comm

    real = comm.AxisComm.run

    def partial(self, op, t, dim, what):
        if op == "all_reduce" and "(backward)" in what:
            return t
        return real(self, op, t, dim, what)

    monkeypatch.setattr(comm.AxisComm, "run", partial)
    assert example.main([*SMALL, "--trace-dir", str(tmp_path)]) == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("launcher, schedule, extra", [
    ("mpiexec", "1f1b", []), ("torchrun", "1f1b", []),
    ("mpiexec", "interleaved-1f1b", ["--sequence-parallel"]),
    ("torchrun", "zb-h1", ["--sequence-parallel"]),
    ("mpiexec", "zb-h1", ["--variable-lengths", "--seq", "16"]),
    ("torchrun", "interleaved-1f1b", ["--variable-lengths", "--seq", "16",
                                      "--sequence-parallel"])])
def test_the_gpt_example_under_a_launcher(tmp_path, launcher, schedule, extra):
    # 4 ranks of 3-4 devices: stage meshes span ranks (TP collectives over the wire).
    done = launch(launcher, 4, EXAMPLE, *SMALL, "--schedule", schedule, *extra,
                  "--trace-dir", str(tmp_path), timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("match plain torch") == 1 and "FAILED" not in done.stdout
    assert len(list(tmp_path.glob("gpt-*.rank*.json"))) == 4
