"""Zero-copy crossings between the runtime's arrays and torch tensors, on the op's stream.

The runtime hands stage functions numpy arrays (CPU backend) or CuPy arrays (CUDA backend)
and takes arrays back. A torch stage must not pay a copy on each crossing:

- CPU: ``torch.from_numpy`` and ``Tensor.numpy()`` share memory in both directions.
- CUDA: DLPack both ways (``torch.from_dlpack(cupy_array)``, ``cupy.from_dlpack(tensor)``),
  with torch's current stream set to the op's CuPy stream (``torch.cuda.ExternalStream``), so
  torch's kernels are enqueued where the runtime's events expect them and the DLPack
  exchange needs no stream synchronization (producer and consumer stream are the same).
  It has run on one H200 (the GPT example in bfloat16 matches plain torch).

Narrow floats (``torch.bfloat16``, ``torch.float8_*``) have no numpy type of their own; the
runtime carries them as ``ml_dtypes``' types (:mod:`scheduler.dtypes`). Neither
``torch.from_numpy`` nor every DLPack version knows those, so they cross as views of an
unsigned integer of the same size (the same bytes, no copy) and are viewed back on the other
side. On CUDA the runtime's buffers of such a dtype need CuPy >= 14 (its ml_dtypes support).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from scheduler import NARROW_FLOATS

from ..pipeline import StageContext

# torch's narrow floats, their ml_dtypes twin and the same-size integer both sides can view.
_NARROW: dict[torch.dtype, tuple[np.dtype, torch.dtype]] = {
    getattr(torch, name): (dt, {1: torch.uint8, 2: torch.int16}[dt.itemsize])
    for name, dt in NARROW_FLOATS.items() if hasattr(torch, name)
}
_TORCH_OF = {dt.name: t for t, (dt, _) in _NARROW.items()}


def on_cpu(ctx: StageContext) -> bool:
    return ctx.cuda_stream is None


@contextlib.contextmanager
def op_stream(ctx: StageContext, streams: dict[tuple[int, int], Any] | None = None
              ) -> Iterator[None]:
    """Make torch run on the op's device and stream (CUDA); nothing to do on the CPU.
    ``streams``: the torch ``ExternalStream`` of each (CUDA stream, GPU) made so far, kept
    by the caller across ops (one per runtime stream, not one per op: each costs torch a
    stream-priority query)."""
    stream = ctx.cuda_stream
    if stream is None:
        yield
        return
    # The CUDA backend runs each op with its GPU current (cupy.cuda.Device) and its
    # non-blocking stream current; torch must enqueue on that same stream.
    gpu = ctx.xp.cuda.Device().id
    key = (stream.ptr, gpu)
    ext = None if streams is None else streams.get(key)
    if ext is None:
        ext = torch.cuda.ExternalStream(stream.ptr, device=torch.device("cuda", gpu))
        if streams is not None:
            streams[key] = ext
    with torch.cuda.device(gpu), torch.cuda.stream(ext):
        yield


def to_torch(x: Any, ctx: StageContext | None = None) -> torch.Tensor:
    """The runtime's array as a tensor sharing its memory (call inside :func:`op_stream`);
    ``ctx`` None: a numpy array (the CPU backend's, or a step's inputs)."""
    cpu = ctx is None or on_cpu(ctx)
    arr = np.asarray(x) if cpu else x
    twin = _TORCH_OF.get(arr.dtype.name) if arr.dtype.name in NARROW_FLOATS else None
    if twin is not None:
        bits = arr.view(f"u{arr.dtype.itemsize}" if arr.dtype.itemsize == 1 else "i2")
        t = torch.from_numpy(bits) if cpu else torch.from_dlpack(bits)
        return t.view(twin)
    return torch.from_numpy(arr) if cpu else torch.from_dlpack(arr)


def from_torch(t: torch.Tensor, ctx: StageContext | None = None) -> Any:
    """A tensor (no grad) as the runtime's array, sharing its memory (``ctx`` None: numpy)."""
    return as_array(t, np if ctx is None or on_cpu(ctx) else ctx.xp)


def as_array(t: torch.Tensor, xp: Any) -> Any:
    """``t`` (no grad) as an array of ``xp`` (numpy for a CPU tensor, cupy for a CUDA one),
    sharing its memory."""
    cpu = xp is np
    narrow = _NARROW.get(t.dtype)
    if narrow is not None:
        dt, bits = narrow
        t = t.view(bits)
        return (t.numpy() if cpu else xp.from_dlpack(t)).view(dt)
    return t.numpy() if cpu else xp.from_dlpack(t)


def array_to_torch(x: Any, xp: Any) -> torch.Tensor:
    """An array of ``xp`` (numpy, or cupy on the CUDA backend) as a tensor sharing its
    memory (the inverse of :func:`as_array`; bfloat16 and float8 as their torch types)."""
    cpu = xp is np
    twin = _TORCH_OF.get(x.dtype.name) if x.dtype.name in NARROW_FLOATS else None
    if twin is not None:
        bits = x.view(f"u{x.dtype.itemsize}" if x.dtype.itemsize == 1 else "i2")
        return (torch.from_numpy(bits) if cpu else torch.from_dlpack(bits)).view(twin)
    return torch.from_numpy(x) if cpu else torch.from_dlpack(x)


def numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """The runtime's dtype for a torch dtype: numpy's, or ml_dtypes' for bfloat16 and the
    float8 types; None where there is none."""
    if dtype in _NARROW:
        return _NARROW[dtype][0]
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None
