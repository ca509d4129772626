"""Zero-copy crossings between the runtime's arrays and torch tensors, on the op's stream.

The runtime hands stage functions numpy arrays (CPU backend) or CuPy arrays (CUDA backend)
and takes arrays back. A torch stage must not pay a copy on each crossing:

- CPU: ``torch.from_numpy`` and ``Tensor.numpy()`` share memory in both directions.
- CUDA: DLPack both ways (``torch.from_dlpack(cupy_array)``, ``cupy.from_dlpack(tensor)``),
  with torch's current stream set to the op's CuPy stream (``torch.cuda.ExternalStream``), so
  torch's kernels are enqueued where the runtime's events expect them and the DLPack
  exchange needs no stream synchronization (producer and consumer stream are the same).
  **This path has not run on a GPU yet** (no session so far was lent one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..pipeline import StageContext


def on_cpu(ctx: StageContext) -> bool:
    return ctx.cuda_stream is None


@contextlib.contextmanager
def op_stream(ctx: StageContext) -> Iterator[None]:
    """Make torch run on the op's device and stream (CUDA); nothing to do on the CPU."""
    stream = ctx.cuda_stream
    if stream is None:
        yield
        return
    # The CUDA backend runs each op with its GPU current (cupy.cuda.Device) and its
    # non-blocking stream current; torch must enqueue on that same stream.
    gpu = ctx.xp.cuda.Device().id
    ext = torch.cuda.ExternalStream(stream.ptr, device=torch.device("cuda", gpu))
    with torch.cuda.device(gpu), torch.cuda.stream(ext):
        yield


def to_torch(x: Any, ctx: StageContext) -> torch.Tensor:
    """The runtime's array as a tensor sharing its memory (call inside :func:`op_stream`)."""
    if on_cpu(ctx):
        return torch.from_numpy(np.asarray(x))
    return torch.from_dlpack(x)


def from_torch(t: torch.Tensor, ctx: StageContext) -> Any:
    """A tensor (no grad) as the runtime's array, sharing its memory."""
    if on_cpu(ctx):
        return t.numpy()
    return ctx.xp.from_dlpack(t)


def numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """numpy's name for a torch dtype (None where numpy has none, e.g. bfloat16)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None
