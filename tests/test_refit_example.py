"""examples/refit.py: the GPT trained in a TP 1/2/4/2x2 pipeline is resharded every step into
an inference engine of another layout (TP 4 on other devices; TP 8 colocated on the training
devices) whose shards equal the trained weights bit for bit and which generates plain torch's
tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 (the "
                                    "'torch' extra) to run the refit example")

SMALL = ["--layers", "4", "--width", "32", "--heads", "8", "--seq", "8", "--vocab", "64",
         "--batch", "8", "--microbatches", "2", "--steps", "2", "--new-tokens", "2",
         "--bucket-kib", "16"]


@pytest.fixture
def example(monkeypatch):
    import torch
    from torch_reference import load_example

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave the suite's alone
    return load_example("refit.py")


@pytest.mark.parametrize("engine, dtype", [("tp4", "float32"), ("colocated", "bfloat16"),
                                           ("colocated", "float32")])
def test_every_refit_delivers_the_trained_weights(example, engine, dtype, capsys):
    assert example.main([*SMALL, "--engine", engine, "--dtype", dtype]) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.strip().startswith("step ")]
    assert len(steps) == 2
    assert all(line.endswith("trained weights: 0") for line in steps), out
    assert "ratio" in out and "refit: OK" in out


def test_a_refit_that_misses_the_engine_fails_loudly(example, monkeypatch, capsys):
    """The example's own checks: a refit that writes elsewhere leaves the engine's initial
    weights, which the shard check and the generated tokens both catch."""
    from overlap.torch import reshard_state_dict

    monkeypatch.setattr(example, "reshard_state_dict",  # (new tensors, not the engine's)
                        lambda rt, plan, shards, out: reshard_state_dict(rt, plan, shards))
    assert example.main([*SMALL, "--engine", "tp4"]) == 1
    out = capsys.readouterr().out
    assert "refit: FAILED" in out and "trained weights: 0" not in out
