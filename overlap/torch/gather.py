"""Gathering a tensor-parallel stage whose devices several processes drive: each split tensor
is moved by the runtime's own resharding — from ``Shard(dim)`` over the stage's axis to one
replica on the stage's first device — so its whole value lands in the process that drives
that device, which writes the stage's part of a checkpoint.

Collective: every process of the job makes the same resharding calls in the same order (the
runtime counts calls), those holding none of the stage's devices too (with no shards): a
checkpoint of a job whose stages span processes is taken on every process together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from scheduler import DeviceMesh, Sharding, ShardingSpec, plan_resharding

from .parallel import TensorParallel
from .tensors import as_array, numpy_dtype, to_torch


def gather_split(rt: Any, tp: TensorParallel, key: str, shape: tuple[int, ...],
                 dtype: torch.dtype, local: Mapping[int, torch.Tensor]) -> torch.Tensor | None:
    """The whole of split tensor ``key`` (``shape``, ``dtype``) from its shards (``local``:
    this process's devices' blocks): on the process driving the stage's first device, else
    None. Every process calls it (see module doc)."""
    dim = tp.split[key]
    mesh = tp.mesh
    spec = ShardingSpec(*(tp.axis if i == dim else None for i in range(len(shape))))
    first = mesh.device_ids[0]
    npd = numpy_dtype(dtype)
    plan = plan_resharding(shape, str(npd), Sharding(mesh, spec),
                           Sharding(DeviceMesh([first], ("gather",)), ShardingSpec()),
                           rt.cluster)
    xp = rt.backend.xp
    regions = plan.src.device_regions(shape)
    shards = {d: as_array(t.detach().contiguous(), xp) for d, t in local.items()
              if d in regions}
    out = rt.reshard_sync(plan, shards)
    if first not in out:
        return None
    arr = out[first]
    return to_torch(arr if xp is np else xp.asnumpy(arr)).clone()


__all__ = ["gather_split"]
