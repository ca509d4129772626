"""Building a pipeline's stage modules where they run: a factory per stage, meta elsewhere.

``TorchPipeline(stage_fn, meshes, loss_fn, rt=rt)`` calls ``stage_fn(s)`` for real only on
the processes that drive a device of stage ``s``. Every other process still needs the
stage's *shapes* — each boundary's shape and dtype is part of the step graph every process
agrees on — so it calls ``stage_fn(s)`` under ``torch.device("meta")``: parameters without
storage, no initialization, no memory. The one-process case builds every stage for real.

Every call runs under a forked RNG seeded ``seed + s``: a stage is initialized the same on
every process that builds it (replicas of a stage on different processes start identical,
as they must) and whatever the placement, without touching the caller's RNG.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from scheduler import DeviceMesh

META = torch.device("meta")
StageFn = Callable[[int], nn.Module]


@dataclass(frozen=True)
class LocalStage:
    """A stage this process runs: its index, its devices here and their modules (one per
    device: a replica, or a tensor-parallel shard)."""

    index: int
    devices: tuple[int, ...]
    modules: tuple[nn.Module, ...]


def check_seed(seed: object) -> int:
    if seed is None:
        return torch.initial_seed()
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed: expected an int >= 0 (stage s is built under seed + s), "
                         f"got {seed!r}")
    return seed


def build_stages(stage_fn: StageFn, meshes: Sequence[DeviceMesh], planned: Sequence[bool],
                 local: frozenset[int] | None, seed: int,
                 device_of: Callable[[int], torch.device | None]) -> list[object]:
    """The ``modules`` entries of a pipeline made by ``stage_fn``: one full module for a
    planned stage (``parallelize`` shards it), else one module per device — copies of one
    build (``device_of(d)``: where device d's copy goes, None: where it was built). Stages
    none of whose devices are ``local`` are built on the meta device (``local`` None: every
    device is)."""
    out: list[object] = []
    for s, mesh in enumerate(meshes):
        here = [d for d in mesh.device_ids if local is None or d in local]
        module = _call(stage_fn, s, seed, real=bool(here))
        if planned[s]:
            out.append(module)
            continue
        copies = []
        for k, d in enumerate(mesh.device_ids):
            m = module if k == 0 else copy.deepcopy(module)
            if d not in here:
                m = m.to(META)  # another process runs it: shapes only
            elif (want := device_of(d)) is not None:
                m = m.to(want)
            copies.append(m)
        out.append(copies)
    return out


def build_stage(stage_fn: StageFn, stage: int, seed: int) -> nn.Module:
    """Stage ``stage`` as a pipeline built with ``stage_fn`` and ``seed`` builds it: the same
    initial weights, for a plain torch reference or a single-process copy of the model."""
    return _call(stage_fn, stage, check_seed(seed), real=True)


def _call(stage_fn: StageFn, s: int, seed: int, *, real: bool) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + s)
        if real:
            module = stage_fn(s)
        else:
            with META:
                module = stage_fn(s)
    if not isinstance(module, nn.Module):
        raise TypeError(f"stage_fn({s}): expected an nn.Module, got {type(module).__name__}")
    if not real:
        off = sorted({str(t.device) for t in (*module.parameters(), *module.buffers())
                      if not t.is_meta})
        if off:
            raise ValueError(
                f"stage_fn({s}): built under torch.device('meta') (this process runs none of "
                f"stage {s}'s devices and needs only its shapes), it made tensors on {off}; "
                "create the stage's tensors without an explicit device")
    return module


def is_meta(module: nn.Module) -> bool:
    """Whether ``module`` holds shapes only (another process runs it)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


__all__ = ["LocalStage", "StageFn", "build_stage", "build_stages", "check_seed", "is_meta"]
