"""A step's microbatches from a :class:`~overlap.torch.TorchPipeline` step's arguments.

Either ``inputs`` (and ``targets``) with ``num_microbatches`` — split into equal views along
dimension 0, no copies — or ``microbatches=[(x0, y0), ...]`` already split (torch's
``arg_mbs`` / ``target_mbs``), each of its own shape. Every tensor is checked before anything
runs: dense, strided (its memory crosses without a copy), and at least one sample per
microbatch (the mean of nothing is NaN).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .checks import check_count


def step_microbatches(inputs: Any, targets: Any, num_microbatches: Any, microbatches: Any
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """A step's microbatches and their targets (None: none) from its arguments: one of the
    two ways of the module doc, never both."""
    if microbatches is None:
        return split_batch(inputs, targets, num_microbatches)
    if inputs is not None or targets is not None or num_microbatches is not None:
        raise ValueError("microbatches: give the step's microbatches already split, or "
                         "inputs (and targets) with num_microbatches — not both")
    return split_given(microbatches)


def check_devices(xs: Sequence[torch.Tensor], backend: str, where: str) -> None:
    """Microbatches on the device type of the runtime's ``backend`` (its name)."""
    want = "cuda" if backend == "cuda" else "cpu"
    for x in xs:
        if x.device.type != want:
            raise ValueError(f"{where}: on {x.device}, the runtime's {backend} backend needs "
                             f"them on {want}")


def check_tensor(t: torch.Tensor, name: str) -> None:
    """A step's tensor: dense and strided (its memory crosses without a copy), and not an
    empty batch (every loss would be the mean of nothing: NaN)."""
    if t.layout != torch.strided:
        raise TypeError(f"{name}: a {t.layout} tensor; give a dense one (.to_dense())")
    if t.dim() >= 1 and t.shape[0] == 0:
        raise ValueError(f"{name}: an empty batch (shape {tuple(t.shape)}); a step needs at "
                         "least one sample per microbatch")


def split_given(microbatches: Any) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """``microbatches``: a list of input tensors, or of ``(input, target)`` pairs (torch's
    ``arg_mbs`` / ``target_mbs``), each of its own shape; checked, detached."""
    if isinstance(microbatches, (torch.Tensor, str, bytes, Mapping)) or \
            not isinstance(microbatches, Sequence) or not microbatches:
        raise TypeError("microbatches: expected a non-empty list of input tensors or of "
                        f"(input, target) pairs, got {type(microbatches).__name__}")
    paired = not isinstance(microbatches[0], torch.Tensor)
    xs: list[torch.Tensor] = []
    ts: list[torch.Tensor] = []
    for i, item in enumerate(microbatches):
        pair = item if paired else (item, None)
        if (not paired and not isinstance(item, torch.Tensor)) or (paired and (
                not isinstance(item, (tuple, list)) or len(item) != 2)):
            kind = "an (input, target) pair" if paired else "a tensor"
            raise TypeError(f"microbatches[{i}]: expected {kind} like microbatches[0], got "
                            f"{type(item).__name__}")
        x, t = pair
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise TypeError(f"microbatches[{i}]: the input must be a tensor of at least one "
                            f"dimension, got {type(x).__name__}")
        check_tensor(x, f"microbatches[{i}]")
        if isinstance(t, torch.Tensor):
            check_tensor(t, f"microbatches[{i}] target")
        if paired:
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != x.shape[0]:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"microbatches[{i}]: its target must be a tensor with the "
                                 f"input's {x.shape[0]} rows along dim 0, got {got}")
            ts.append(t.detach())
        xs.append(x.detach())
    first = xs[0]
    for i, x in enumerate(xs):
        if x.dtype != first.dtype or x.dim() != first.dim():
            raise ValueError(f"microbatches[{i}]: {x.dim()}-d {x.dtype}, microbatches[0] is "
                             f"{first.dim()}-d {first.dtype}; only the sizes may differ")
    return xs, (ts if paired else None)


def split_batch(inputs: Any, targets: Any, num_microbatches: Any
                ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """``inputs`` (and ``targets``) split into ``num_microbatches`` equal views along
    dimension 0, checked, detached."""
    if num_microbatches is None:
        raise ValueError("num_microbatches: how many microbatches to split inputs into "
                         "(or pass microbatches=[(x0, y0), ...] already split)")
    m = check_count(num_microbatches, "num_microbatches")
    if not isinstance(inputs, torch.Tensor):
        raise TypeError(f"inputs: expected a torch.Tensor, got {type(inputs).__name__}")
    check_tensor(inputs, "inputs")
    if inputs.dim() < 1 or inputs.shape[0] % m:
        raise ValueError(f"inputs: batch dimension of shape {tuple(inputs.shape)} does not "
                         f"split into num_microbatches={m} equal microbatches")
    if targets is not None:
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets: expected a torch.Tensor or None, got "
                            f"{type(targets).__name__}")
        check_tensor(targets, "targets")
        if targets.dim() < 1 or targets.shape[0] != inputs.shape[0]:
            raise ValueError(f"targets: shape {tuple(targets.shape)} does not match the "
                             f"batch of inputs {tuple(inputs.shape)} along dim 0")
    xs = list(inputs.detach().chunk(m))
    return xs, (list(targets.detach().chunk(m)) if targets is not None else None)


__all__ = ["check_devices", "check_tensor", "split_batch", "split_given", "step_microbatches"]
