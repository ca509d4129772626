"""Plain single-process torch as the tests' reference for overlap.torch pipelines, and loading
the example scripts as modules (tests import this; it needs torch)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch
from torch import nn
from torch.nn import functional as F

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(filename: str) -> ModuleType:
    """``examples/<filename>`` as a module (its ``main(argv)`` then runs in this process)."""
    spec = importlib.util.spec_from_file_location(Path(filename).stem + "_example",
                                                  EXAMPLES / filename)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Block(nn.Module):
    """LayerNorm, a column-parallel fc1, GELU, a row-parallel fc2, with a residual (the
    tensor-parallel tests' stage)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def reference_losses(modules, xs, loss_fn, ys=None, scale: float | None = None
                     ) -> list[float]:
    """Each microbatch through ``modules`` in turn, ``(loss * scale).backward()`` per
    microbatch (gradients add up in ``.grad``, as the pipeline's do); the unscaled losses.
    ``scale`` None: 1 / the microbatches, the mean the pipeline's ``scale_grads`` gives by
    default (1.0: their sum, ``scale_grads=False``)."""
    if scale is None:
        scale = 1.0 / len(xs)
    losses = []
    for i, x in enumerate(xs):
        h = x
        for m in modules:
            h = m(h)
        loss = loss_fn(h) if ys is None else loss_fn(h, ys[i])
        (loss * scale if scale != 1.0 else loss).backward()
        losses.append(loss.item())
    return losses


def assert_grads_match(pipe, reference, rtol: float, atol: float) -> None:
    """Every device's parameter gradient equals its block of plain torch's (a
    tensor-parallel shard's block along its split dimension, a replica's all of it)."""
    for s, reps in enumerate(pipe.modules):
        full = dict(reference[s].named_parameters())
        tp = pipe.tp[s]
        for k, module in enumerate(reps):
            for name, p in module.named_parameters():
                want = full[name].grad
                if tp is not None and name in tp.split:
                    comm = tp.comms[k]
                    want = want.chunk(comm.size, tp.split[name])[comm.index]
                where = f"stage {s} device {k} {name}"
                assert p.grad is not None, f"{where}: no gradient"
                torch.testing.assert_close(p.grad, want, rtol=rtol, atol=atol,
                                           msg=lambda m, where=where: f"{where}: {m}")
