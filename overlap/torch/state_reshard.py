"""A torch state dict from one layout to another in one call: training -> inference ("refit").

    src = pipe.state_layout()                                   # the training layout
    dst = tensor_parallel_layout(model, mesh, plan)             # the inference layout
    plan = plan_state_dict(src, dst, rt.cluster)                # one plan, one bound
    engine = parallelize(model, mesh, plan_tp)                  # the inference shards
    out = reshard_state_dict(rt, plan, pipe.local_shards(),     # each step, after opt.step()
                             out=tensor_parallel_shards(engine))

A layout is ``name -> TensorLayout(shape, dtype, sharding)`` under the plain model's names:
:func:`pipeline_state_layout` gives a :class:`~overlap.torch.TorchPipeline`'s (``"<stage>.<name>"``,
as its ``state_dict`` names them: a tensor-parallel stage's split parameters sharded over its
plan's axis, everything else replicated over the stage's mesh, the data-parallel axis
included); :func:`tensor_parallel_layout` one made from a module, a mesh and a plan in
torch's vocabulary (``ColwiseParallel`` / ``RowwiseParallel``: the same split
:func:`~overlap.torch.parallelize` makes). Shards are ``name -> {device: tensor}`` (this
process's devices); :func:`reshard_state_dict` moves them through
:meth:`overlap.Runtime.reshard_state`, bfloat16 and float8 included, zero-copy on both sides
(the destination tensors of ``out`` — an inference engine's own parameters — are written in
place).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scheduler import Cluster, DeviceMesh, P, Sharding, StateOptions, StateReshardPlan, StateTensor
from scheduler import plan_state_resharding as _plan

from ..runtime import Runtime
from .parallel import ParallelStyle, TensorParallel, plan_split
from .tensors import array_to_torch, as_array, numpy_dtype

Shards = dict[str, dict[int, torch.Tensor]]


@dataclass(frozen=True)
class TensorLayout:
    """Where one tensor of a state dict lives: its global ``shape``, its ``dtype`` (the
    runtime's name: ``"float32"``, ``"bfloat16"``) and its ``sharding`` over devices."""

    shape: tuple[int, ...]
    dtype: str
    sharding: Sharding


def _dtype_name(t: torch.Tensor, key: str) -> str:
    dt = numpy_dtype(t.dtype)
    if dt is None:
        raise TypeError(f"{key}: {t.dtype} has no array type the runtime can move")
    return dt.name


def _spec(dim: int | None, axis: str) -> Any:
    return P() if dim is None else P(*([None] * dim), axis)


def pipeline_state_layout(pipe: Any) -> dict[str, TensorLayout]:
    """The training layout of ``pipe``'s state (``TorchPipeline.state_layout()``): every
    entry of its ``state_dict`` — parameters and buffers, ``"<stage>.<name>"`` — with the
    stage's mesh and, for a tensor-parallel stage's split parameter, its split dimension
    over the plan's axis (other axes replicate)."""
    out: dict[str, TensorLayout] = {}
    for s, mesh in enumerate(pipe.meshes):
        tp = pipe.tp[s]
        template = tp.module if tp is not None else pipe.modules[s][0]
        for key, value in template.state_dict().items():
            dim = tp.split.get(key) if tp is not None else None
            spec = _spec(dim, tp.axis if tp is not None else "")
            out[f"{s}.{key}"] = TensorLayout(tuple(value.shape),
                                             _dtype_name(value, f"stage {s} {key}"),
                                             Sharding(mesh, spec))
    return out


def tensor_parallel_layout(module: nn.Module, mesh: DeviceMesh,
                           plan: Mapping[str, ParallelStyle], *, axis: str | None = None,
                           prefix: str = "") -> dict[str, TensorLayout]:
    """The layout :func:`~overlap.torch.parallelize` ``(module, mesh, plan, axis=axis)`` gives
    ``module``'s state (the same checks, nothing built): each split parameter sharded along
    its dimension over ``axis``, every other entry replicated over ``mesh``; names are
    ``module.state_dict()``'s with ``prefix`` before them."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
    axis, split, _, _ = plan_split(module, mesh, plan, axis)
    return {f"{prefix}{key}": TensorLayout(tuple(v.shape), _dtype_name(v, key),
                                           Sharding(mesh, _spec(split.get(key), axis)))
            for key, v in module.state_dict().items()}


def plan_state_dict(src: Mapping[str, TensorLayout], dst: Mapping[str, TensorLayout],
                    cluster: Cluster, options: StateOptions | None = None) -> StateReshardPlan:
    """One :func:`scheduler.plan_state_resharding` plan moving every tensor of ``src`` to its
    layout in ``dst`` (the same names, shapes and dtypes: ValueError naming the keys or the
    tensor otherwise, before any planning)."""
    for name, layouts in (("src", src), ("dst", dst)):
        if not isinstance(layouts, Mapping):
            raise TypeError(f"{name}: expected a mapping of names to TensorLayout, got "
                            f"{type(layouts).__name__}")
        for key, lay in layouts.items():
            if not isinstance(lay, TensorLayout):
                raise TypeError(f"{name}[{key!r}]: expected a TensorLayout, got "
                                f"{type(lay).__name__}")
    missing, extra = sorted(set(src) - set(dst)), sorted(set(dst) - set(src))
    if missing or extra:
        raise ValueError(f"dst: its names differ from src's: missing {missing[:6]}, unexpected "
                         f"{extra[:6]} (filter both to the tensors to move)")
    tensors = {}
    for key, a in src.items():
        b = dst[key]
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ValueError(f"dst[{key!r}]: {b.shape} {b.dtype}, but src[{key!r}] is "
                             f"{a.shape} {a.dtype}")
        tensors[key] = StateTensor(a.shape, a.dtype, a.sharding, b.sharding)
    return _plan(tensors, cluster, options)


def pipeline_shards(pipe: Any) -> Shards:
    """This process's devices' tensors of ``pipe``'s state (``TorchPipeline.local_shards()``):
    ``"<stage>.<name>" -> {device: tensor}``, each the device's own module's tensor
    (detached, sharing its memory: no copy)."""
    out: Shards = {}
    for st in pipe.local_stages:
        for d, module in zip(st.devices, st.modules):
            for key, value in module.state_dict().items():
                out.setdefault(f"{st.index}.{key}", {})[d] = value
    return out


def tensor_parallel_shards(tp: TensorParallel, *, prefix: str = "",
                           devices: Any = None) -> Shards:
    """The tensors of :func:`~overlap.torch.parallelize`'s shard modules, by name (with
    ``prefix``) and device — each the module's own storage: pass them as ``out`` and a
    resharding writes straight into the engine's parameters. ``devices``: only these (the
    devices this process drives; all by default)."""
    if not isinstance(tp, TensorParallel):
        raise TypeError(f"tp: expected what overlap.torch.parallelize returns, got "
                        f"{type(tp).__name__}")
    out: Shards = {}
    for d, module in zip(tp.mesh.device_ids, tp.modules):
        if devices is None or d in devices:
            for key, value in module.state_dict().items():
                out.setdefault(f"{prefix}{key}", {})[d] = value
    return out


def _arrays(table: object, argument: str, xp: Any) -> dict[str, dict[int, Any]]:
    if not isinstance(table, Mapping):
        raise TypeError(f"{argument}: expected a mapping of names to {{device: tensor}}, got "
                        f"{type(table).__name__}")
    out: dict[str, dict[int, Any]] = {}
    for name, by_device in table.items():
        if not isinstance(by_device, Mapping):
            raise TypeError(f"{argument}[{name!r}]: expected a mapping device -> tensor, got "
                            f"{type(by_device).__name__}")
        row = out[name] = {}
        for d, t in by_device.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{argument}[{name!r}][{d}]: expected a torch.Tensor, got "
                                f"{type(t).__name__}")
            row[d] = as_array(t.detach(), xp)  # (a parameter's storage: written in place)
    return out


def reshard_state_dict(rt: Any, plan: StateReshardPlan, local_tensors: Mapping[str, Any], *,
                       out: Mapping[str, Any] | None = None) -> Shards:
    """Move a state dict's shards by ``plan`` (:meth:`overlap.Runtime.reshard_state`):
    ``local_tensors[name][device]`` — this process's source devices' tensors — in,
    ``name -> {device: tensor}`` of this process's destination devices out: the tensors of
    ``out`` where given (written in place), new ones sharing the runtime's arrays otherwise.
    Every bad input raises naming it before anything moves."""
    if not isinstance(rt, Runtime):
        raise TypeError(f"rt: expected an overlap.Runtime, got {type(rt).__name__}")
    xp = rt.backend.xp
    shards = _arrays(local_tensors, "local_tensors", xp)
    arrays = None if out is None else _arrays(out, "out", xp)
    try:
        got = rt.reshard_state_sync(plan, shards, out=arrays)
    except (TypeError, ValueError) as exc:
        text = str(exc)
        if text.startswith("shards"):  # (the runtime's argument: this function's name)
            raise type(exc)("local_tensors" + text[len("shards"):]) from None
        raise
    result: Shards = {}
    for name, by_device in got.items():
        given = (out or {}).get(name, {})
        result[name] = {d: given[d] if d in given else array_to_torch(a, xp)
                        for d, a in by_device.items()}
    return result


__all__ = ["TensorLayout", "pipeline_shards", "pipeline_state_layout", "plan_state_dict",
           "reshard_state_dict", "tensor_parallel_layout", "tensor_parallel_shards"]
