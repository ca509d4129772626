"""Building a pipeline's stage modules where they run: a factory per stage, meta elsewhere.

``TorchPipeline(stage_fn, meshes, loss_fn, rt=rt)`` calls ``stage_fn(s)`` for real only on
the processes that drive a device of stage ``s``. Every other process still needs the
stage's *shapes* — each boundary's shape and dtype is part of the step graph every process
agrees on — so it calls ``stage_fn(s)`` under ``torch.device("meta")``: parameters without
storage, no initialization, no memory. The one-process case builds every stage for real.

Every call runs under a forked RNG seeded ``seed + s``: a stage is initialized the same on
every process that builds it (replicas of a stage on different processes start identical,
as they must) and whatever the placement, without touching the caller's RNG.

A stage with a tensor-parallel plan takes one full module, which ``parallelize``
(:mod:`overlap.torch.parallel`) shards over its mesh here (:func:`parallelize_stages`); a
stage without one takes one module per device (:func:`replicate`: copies of one).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scheduler import DeviceMesh

from .checks import check_count, check_modules
from .parallel import Replicate, TensorParallel, parallelize

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


def stage_modules(modules: Any, meshes: Sequence[DeviceMesh], plans: Any, axis: str | None,
                  local: frozenset[int] | None, seed: object,
                  device_of: Callable[[int], torch.device | None]
                  ) -> tuple[tuple[tuple[nn.Module, ...], ...], tuple[TensorParallel | None, ...]]:
    """A pipeline's ``modules`` argument made its modules — one per device of each stage
    (a replica, or a shard of a planned stage) — and its stages' tensor-parallel plans
    applied (None: replicated): a factory built (:func:`build_stages`), plans applied
    (:func:`parallelize_stages`), shards of devices another process drives kept as shapes
    only, everything checked (:func:`overlap.torch.checks.check_modules`)."""
    if callable(modules) and not isinstance(modules, nn.Module):
        modules = build_stages(modules, meshes, planned_stages(plans, len(meshes)), local,
                               check_seed(seed), device_of)
    elif seed is not None:
        if not isinstance(modules, Sequence) or isinstance(modules, (str, bytes)):
            raise TypeError(f"modules: expected a stage_fn (stage -> nn.Module) or a "
                            f"sequence with one entry per stage, got "
                            f"{type(modules).__name__}")
        raise ValueError("seed: seeds the stages a stage_fn builds; modules given "
                         "already built take none")
    tp = parallelize_stages(modules, meshes, plans, axis)
    for t in tp:
        for k, d in enumerate(() if t is None or local is None else t.mesh.device_ids):
            if d not in local:  # (another process drives it: shapes only)
                t.modules[k].to(META)
    return check_modules(modules, meshes, [None if t is None else t.modules for t in tp]), tp


def local_stages(meshes: Sequence[DeviceMesh], modules: Sequence[Sequence[nn.Module]],
                 local: frozenset[int] | None) -> tuple[LocalStage, ...]:
    """The stages with a device in ``local`` (None: every device), with those devices and
    their modules."""
    out = []
    for s, mesh in enumerate(meshes):
        ks = [k for k, d in enumerate(mesh.device_ids) if local is None or d in local]
        if ks:
            out.append(LocalStage(s, tuple(mesh.device_ids[k] for k in ks),
                                  tuple(modules[s][k] for k in ks)))
    return tuple(out)


def planned_stages(plans: Any, p: int) -> list[bool]:
    """Which of ``p`` stages have a tensor-parallel plan (:func:`parallelize_stages` checks
    ``plans``; anything else here counts as no plan)."""
    if isinstance(plans, Sequence) and not isinstance(plans, Mapping) and len(plans) == p:
        return [q is not None for q in plans]
    return [False] * p


def parallelize_stages(modules: Any, meshes: Sequence[DeviceMesh], plans: Any,
                       axis: str | None) -> tuple[TensorParallel | None, ...]:
    """Each planned stage's one full module sharded over its mesh by its plan (None for a
    stage without one); ``plans`` and ``axis`` checked, errors named after the stage."""
    p = len(meshes)
    if plans is None:
        if axis is not None:
            raise ValueError(f"axis: {axis!r} names the axis tensor-parallel plans split "
                             "over, and no plans= were given")
        return (None,) * p
    if isinstance(plans, Mapping) or not isinstance(plans, Sequence):
        raise TypeError(f"plans: expected one plan (a dict) or None per stage, got "
                        f"{type(plans).__name__}")
    if len(plans) != p:
        raise ValueError(f"plans: {len(plans)} entries, but meshes has {p} stages")
    if not isinstance(modules, Sequence) or len(modules) != p:
        return (None,) * p  # (check_modules names the problem)
    out: list[TensorParallel | None] = []
    for s, plan in enumerate(plans):
        if plan is None:
            out.append(None)
            continue
        if not isinstance(modules[s], nn.Module):
            raise TypeError(f"modules[{s}]: a stage with a plan takes one full nn.Module "
                            f"(its shards are made from it), got {type(modules[s]).__name__}")
        try:
            out.append(parallelize(modules[s], meshes[s], plan, axis=axis))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"plans[{s}]: {exc}") from None
    last = out[-1]
    if last is not None and not isinstance(last.output_layout, Replicate):
        raise ValueError(f"plans[{p - 1}]: the last stage's output is {last.output_layout!r}; "
                         "loss_fn needs the whole output on every device — gather it "
                         "(ColwiseParallel(output_layouts=Replicate()) on the head)")
    return tuple(out)


def replicate(module: nn.Module, n: int) -> list[nn.Module]:
    """``module`` and ``n - 1`` deep copies: the modules of a replicated stage."""
    check_count(n, "n")
    return [module, *(copy.deepcopy(module) for _ in range(n - 1))]


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


__all__ = ["LocalStage", "StageFn", "build_stage", "build_stages", "check_seed", "is_meta",
           "local_stages", "parallelize_stages", "planned_stages", "replicate",
           "stage_modules"]
