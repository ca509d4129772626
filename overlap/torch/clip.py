"""Gradient norms and clipping over a whole pipeline, as plain torch computes them on the
whole model: :meth:`TorchPipeline.get_total_norm` and :meth:`TorchPipeline.clip_grad_norm_`.

``torch.nn.utils.clip_grad_norm_(pipe.parameters(), ...)`` is wrong on a pipeline: every
replica of a replicated stage holds the whole gradient (counted once per replica), and under
several processes each sees only its own stages. Here every element of the model is counted
exactly once: a replicated stage's gradient from its first device, a tensor-parallel stage's
split parameters from every shard of one line of its mesh (the shards together are the
parameter) and its unsplit ones (norms, a row-parallel bias) from that line's first device;
the processes' parts are then combined (a sum of p-th powers, or a maximum for the infinity
norm). Clipping scales every copy — each replica, each shard — by the same coefficient, so
replicas stay identical, exactly as ``torch.nn.utils.clip_grad_norm_`` scales the model's.

Under a launcher both are collectives: every process calls them, at the same point.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from ..world import max_over_ranks, sum_over_ranks

# (``pipe``: a TorchPipeline — typed Any, as this module is imported by its own.)
TorchPipeline = Any


def counted_once(pipe: TorchPipeline) -> Iterator[torch.Tensor]:
    """This process's parameters whose gradients make up the model's, each element once."""
    local = pipe._local
    for s, mesh in enumerate(pipe.meshes):
        tp = pipe.tp[s]
        if tp is None:
            first = mesh.device_ids[0]
            if local is None or first in local:
                yield from pipe.modules[s][0].parameters()
            continue
        line = tp.comms[0].group
        ids = tp.mesh.device_ids
        for d in line:
            if local is not None and d not in local:
                continue
            for name, p in tp.modules[ids.index(d)].named_parameters():
                if name in tp.split or d == line[0]:
                    yield p


def total_norm(pipe: TorchPipeline, norm_type: float, error_if_nonfinite: bool
               ) -> torch.Tensor:
    """The norm of every gradient of the model (see module doc): a scalar tensor, float32
    (float64 where a gradient is), on the device of this process's first gradient (the CPU
    if it has none)."""
    p = _check_norm_type(norm_type)
    grads = [q.grad for q in counted_once(pipe) if q.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    world = pipe._runtime.world if pipe._runtime is not None else None
    # Each tensor's norm in float32 at least (torch computes in the gradient's dtype: in
    # bfloat16 that rounds every partial sum to 8 bits), gathered on one device.
    dtype = torch.float32
    for g in grads:
        dtype = torch.promote_types(dtype, g.dtype)
    norms = [torch.linalg.vector_norm(g.detach(), p, dtype=dtype).to(device) for g in grads]
    if math.isinf(p):
        local = float(torch.stack(norms).max()) if norms else 0.0
        value = local if world is None else max_over_ranks(local, world)
    else:
        local = float(torch.stack(norms).pow(p).sum()) if norms else 0.0
        summed = local if world is None else sum_over_ranks(local, world)
        value = summed ** (1.0 / p)
    total = torch.tensor(value, dtype=dtype, device=device)
    if error_if_nonfinite and not math.isfinite(value):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from the pipeline's parameters "
            "is non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return total


def clip_grad_norm_(pipe: TorchPipeline, max_norm: float, norm_type: float,
                    error_if_nonfinite: bool) -> torch.Tensor:
    """Scale every gradient of this process's parameters (every replica and shard) so that
    the model's total norm is at most ``max_norm``; return the total norm before."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) \
            or not max_norm >= 0:
        raise ValueError(f"max_norm: expected a number >= 0, got {max_norm!r}")
    total = total_norm(pipe, norm_type, error_if_nonfinite)
    coef = float(max_norm) / (float(total) + 1e-6)
    # (torch clamps the coefficient to 1 — gradients are never scaled up — and a NaN norm
    # makes every gradient NaN, as there)
    if not coef >= 1.0:
        with torch.no_grad():
            for q in pipe.parameters():
                if q.grad is not None:
                    q.grad.mul_(coef)
    return total


def _check_norm_type(norm_type: object) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) \
            or (not math.isinf(norm_type) and not norm_type > 0):
        raise ValueError(f"norm_type: expected a number > 0 or inf, got {norm_type!r}")
    return float(norm_type)


__all__ = ["clip_grad_norm_", "counted_once", "total_norm"]
