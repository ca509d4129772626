"""What to do when a tensor-parallel shard's forward fails: the module, its sizes per shard.

A shard computes its column-parallel projections' share of their output features. Code that
reshapes those outputs with the full model's sizes — nanoGPT's ``view(B, T, self.n_head,
C // self.n_head)`` or ``split(self.n_embd, dim=2)`` — then fails with a bare shape error that
says nothing about the split. :func:`shard_failure` names the innermost module of the shard
the error came from, the integer sizes it (or a module above it) keeps, what they are per
shard, and which of the plan's projections are split.
"""

from __future__ import annotations

import re
from types import TracebackType

from torch import nn

from .parallel import HEADS, TensorParallel

# Integer attributes that are sizes a forward may reshape with (nanoGPT's n_head, n_embd;
# Hugging Face's num_attention_heads, hidden_size, head_dim; torchtitan's n_heads, dim).
_SIZES = re.compile(r"(^|_)(n_?heads?|num_(attention_)?heads|nhead|n_embd|embed_dim|"
                    r"hidden(_size)?|head_dim|dim|width|d_model)$")


class ShardForwardError(RuntimeError):
    """A tensor-parallel shard's forward failed (its cause is the original error)."""


def shard_failure(tp: TensorParallel, stage: int, device: int, exc: BaseException
                  ) -> ShardForwardError:
    """The error to raise from ``exc`` (see module doc)."""
    k = tp.mesh.device_ids.index(device)
    shard = tp.modules[k]
    where = _innermost(shard, exc.__traceback__)
    n = tp.degree
    sizes = _sizes(shard, where)
    split = _colwise_names(tp)
    module = type(dict(shard.named_modules())[where]).__name__
    lines = [f"plans[{stage}]: {where or 'the stage module'} ({module}) failed in its "
             f"tensor-parallel shard on device {device} (shard {tp.comms[k].index + 1} of "
             f"{n} over mesh axis {tp.axis!r}): {type(exc).__name__}: {exc}"]
    if split:
        shown = ", ".join(split[:6]) + (", ..." if len(split) > 6 else "")
        lines.append(f"Its column-parallel modules ({shown}) give each shard 1/{n} of their "
                     "output features: code that reshapes them with the full model's sizes "
                     "fails.")
    if sizes:
        per = ", ".join(f"{name} = {value}" + (
            " (divided per shard already)" if name.rpartition(".")[2] in HEADS else
            f" (per shard {value // n})" if value % n == 0 else "") for name, value in sizes)
        lines.append(f"Sizes it keeps: {per}. Compute them from the tensors' shapes, or set "
                     f"them per shard ({', '.join(HEADS)} are divided per shard for you).")
    fused = [name for name in split if _fused(shard, name, n)]
    if fused:
        lines.append(f"{', '.join(fused)} project to 3 × their input (a fused q/k/v): split "
                     "column-wise each shard gets a block of the three together, not a block "
                     "of each — give q, k and v Linears of their own.")
    return ShardForwardError("\n".join(lines))


def _fused(shard: nn.Module, name: str, n: int) -> bool:
    """Whether a column-parallel Linear (its shard holds 1/n of the output rows) looks like
    a fused q/k/v projection: its full output is 3 × its input."""
    m = dict(shard.named_modules()).get(name)
    return isinstance(m, nn.Linear) and m.weight.shape[0] * n == 3 * m.weight.shape[1]


def _colwise_names(tp: TensorParallel) -> list[str]:
    """The modules whose weight is split along its rows (dimension 0): column-parallel."""
    out = []
    for name, dim in tp.split.items():
        owner, _, pname = name.rpartition(".")
        if pname == "weight" and dim == 0 and owner not in out:
            out.append(owner)
    return out


def _innermost(shard: nn.Module, tb: TracebackType | None) -> str:
    """The name (in ``shard``) of the last module of ``shard`` whose code is in ``tb``."""
    names = {id(m): name for name, m in shard.named_modules()}
    found = ""
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


def _sizes(shard: nn.Module, where: str) -> list[tuple[str, int]]:
    """Integer size attributes of the module ``where`` and of the modules above it, nearest
    first (``path.attr``)."""
    subs = dict(shard.named_modules())
    parts = where.split(".") if where else []
    out: list[tuple[str, int]] = []
    for depth in range(len(parts), -1, -1):
        path = ".".join(parts[:depth])
        for attr, value in vars(subs[path]).items():
            if isinstance(value, int) and not isinstance(value, bool) and _SIZES.search(attr):
                out.append((f"{path}.{attr}" if path else attr, value))
    return out


__all__ = ["ShardForwardError", "shard_failure"]
