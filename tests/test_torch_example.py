"""examples/torch_pipeline.py checks itself against plain torch and fails loudly otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
from launchers import LAUNCHERS, launch

pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 (the "
                                    "'torch' extra) to run the torch example")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_pipeline.py"
SMALL = ["--steps", "2", "--width", "32", "--batch", "16", "--microbatches", "4"]


@pytest.fixture
def example(monkeypatch):
    import torch
    from torch_reference import load_example

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave the suite's alone
    return load_example("torch_pipeline.py")


def test_example_matches_plain_torch(example, tmp_path, capsys):
    assert example.main([*SMALL, "--trace-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "match plain torch" in out and "overlap report" in out
    assert (tmp_path / "torch-eager-1f1b.json").stat().st_size > 0


def test_example_exits_nonzero_when_the_check_fails(example, tmp_path, monkeypatch, capsys):
    # A pipeline whose gradients are off by a tiny amount must fail the 1e-5 check: every
    # backward through a parameter of its first replicas adds 1e-3 to that gradient (a
    # tensor hook, as a user's would).
    real = example.TorchPipeline

    class Off(real):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            for reps in self.modules:
                for p in reps[0].parameters():
                    p.register_hook(lambda g: g + 1e-3)

    monkeypatch.setattr(example, "TorchPipeline", Off)
    assert example.main([*SMALL, "--trace-dir", str(tmp_path)]) == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_example_under_a_launcher_compares_each_processs_own_stages(tmp_path, launcher):
    # Each process builds and trains only its stages' parameters; comparing every stage made
    # every process print FAILED although every loss matched (issue 17, point 5).
    done = launch(launcher, 4, EXAMPLE, *SMALL, "--trace-dir", str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # One process speaks; every rank writes its own trace.
    assert done.stdout.count("match plain torch") == 1 and "FAILED" not in done.stdout
    assert done.stdout.count("torch pipeline: 4 stages") == 1
    assert len(list(tmp_path.glob("torch-eager-1f1b.rank*.json"))) == 4
