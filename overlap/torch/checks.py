"""Argument checks of the torch adapter: every bad input is named before any work starts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from scheduler import DeviceMesh

# Where a module's tensors live and the dtype of its floating parameters (None: it has none).
DeviceDtype = tuple[torch.device | None, torch.dtype | None]


def check_meshes(meshes: Any) -> tuple[DeviceMesh, ...]:
    if isinstance(meshes, DeviceMesh) or not isinstance(meshes, Sequence) or not meshes:
        raise TypeError(f"meshes: expected a non-empty sequence of DeviceMesh (one per stage), "
                        f"got {type(meshes).__name__}")
    for s, m in enumerate(meshes):
        if not isinstance(m, DeviceMesh):
            raise TypeError(f"meshes[{s}]: expected a DeviceMesh, got {type(m).__name__}")
    seen: dict[int, int] = {}
    for s, m in enumerate(meshes):
        for d in m.device_ids:
            t = seen.setdefault(d, s)
            if t != s and meshes[t] != m:
                # Stages of one rank share its mesh (a schedule with several stages per rank
                # checks which); partly overlapping meshes belong to no placement.
                raise ValueError(f"meshes[{s}]: device {d} is also in meshes[{t}], a "
                                 f"different mesh; stage meshes are disjoint, or the same "
                                 f"mesh for stages of one rank")
    return tuple(meshes)


def check_modules(modules: Any, meshes: Sequence[DeviceMesh],
                  shards: Sequence[Sequence[nn.Module] | None] = ()
                  ) -> tuple[tuple[nn.Module, ...], ...]:
    """One module per device of each stage's mesh (a bare module for a one-device mesh);
    ``shards[s]``, where given, are stage s's tensor-parallel shards (made from its one full
    module by ``parallelize``), which stand for the entry."""
    if isinstance(modules, nn.Module) or not isinstance(modules, Sequence):
        raise TypeError(f"modules: expected a sequence with one entry per stage, got "
                        f"{type(modules).__name__}")
    if len(modules) != len(meshes):
        raise ValueError(f"modules: {len(modules)} stages, but meshes has {len(meshes)}")
    out = []
    for s, (entry, mesh) in enumerate(zip(modules, meshes)):
        n = len(mesh.device_ids)
        if s < len(shards) and shards[s] is not None:
            out.append(tuple(shards[s]))  # type: ignore[arg-type]
            continue
        replicas = (entry,) if isinstance(entry, nn.Module) else entry
        if not isinstance(replicas, Sequence):
            raise TypeError(f"modules[{s}]: expected an nn.Module or a list of them (one per "
                            f"device of meshes[{s}]), got {type(entry).__name__}")
        if len(replicas) != n:
            raise ValueError(f"modules[{s}]: meshes[{s}] has {n} devices {mesh.device_ids}, "
                             f"so it needs {n} modules (one per device), got {len(replicas)}")
        for k, m in enumerate(replicas):
            if not isinstance(m, nn.Module):
                raise TypeError(f"modules[{s}][{k}]: expected an nn.Module, got "
                                f"{type(m).__name__}")
        out.append(tuple(replicas))
    _check_distinct(out)
    for s, replicas in enumerate(out):
        if s < len(shards) and shards[s] is not None:
            continue  # (shards differ by design)
        for k in range(1, len(replicas)):
            _check_same(replicas[0], replicas[k], f"modules[{s}][{k}]", f"modules[{s}][0]")
    return tuple(out)


def _check_distinct(stages: Sequence[Sequence[nn.Module]]) -> None:
    # Each device accumulates into its own .grad from its own thread: a module or parameter
    # shared by two devices would race and sum gradients twice.
    owner: dict[int, str] = {}
    for s, replicas in enumerate(stages):
        for k, m in enumerate(replicas):
            name = f"modules[{s}][{k}]"
            if id(m) in owner:
                raise ValueError(f"{name}: the same module object as {owner[id(m)]}; give each "
                                 f"device its own copy (copy.deepcopy)")
            owner[id(m)] = name
    params: dict[int, str] = {}
    for s, replicas in enumerate(stages):
        for k, m in enumerate(replicas):
            name = f"modules[{s}][{k}]"
            for pname, p in m.named_parameters():
                if id(p) in params and not params[id(p)].startswith(name + "."):
                    raise ValueError(f"{name}: parameter {pname!r} is shared with "
                                     f"{params[id(p)]}; modules of different devices must "
                                     f"not share parameters")
                params[id(p)] = f"{name}.{pname}"


def _check_same(ref: nn.Module, other: nn.Module, name: str, ref_name: str) -> None:
    """Replicas compute the same output (the planner picks any one as the sender)."""
    a, b = ref.state_dict(), other.state_dict()
    if list(a) != list(b):
        raise ValueError(f"{name}: its state_dict keys {list(b)} differ from {ref_name}'s "
                         f"{list(a)}; replicas of a stage must be copies")
    for key in a:
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype or not _equal(x, y):
            raise ValueError(f"{name}: {key!r} differs from {ref_name}'s ({tuple(y.shape)} "
                             f"{y.dtype} vs {tuple(x.shape)} {x.dtype}, or other values); "
                             f"replicas of a stage must start identical (copy.deepcopy)")


def _equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.is_meta or y.is_meta:  # no values to compare (placement is checked per step)
        return True
    return torch.equal(x.cpu(), y.cpu())


def module_device_dtype(m: nn.Module, name: str) -> DeviceDtype:
    """The one device of a module's tensors and the one dtype of its floating parameters."""
    devices = {t.device for t in (*m.parameters(), *m.buffers())}
    if len(devices) > 1:
        raise ValueError(f"{name}: its tensors are on several devices {sorted(map(str, devices))}"
                         f"; a stage module must live on its device")
    dtypes = {p.dtype for p in m.parameters() if p.is_floating_point()}
    if len(dtypes) > 1:
        raise ValueError(f"{name}: floating parameters of several dtypes {sorted(map(str, dtypes))}"
                         f"; the boundaries carry one dtype")
    return (next(iter(devices)) if devices else None,
            next(iter(dtypes)) if dtypes else None)


def device_dtypes(modules: Sequence[Sequence[nn.Module]]) -> list[list[DeviceDtype]]:
    """:func:`module_device_dtype` of every module of every stage (``modules[s][k]``)."""
    return [[module_device_dtype(m, f"modules[{s}][{k}]") for k, m in enumerate(reps)]
            for s, reps in enumerate(modules)]


def check_loss_fn(loss_fn: Any) -> Any:
    if not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable (output, target) -> scalar loss "
                        f"tensor, got {type(loss_fn).__name__}")
    return loss_fn


def check_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def check_index(value: Any, n: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        raise ValueError(f"{name}: expected an int in 0..{n - 1}, got {value!r}")
    return value
