"""An optimizer's state under the plain model's parameter names, as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` keys it:

    {"state": {"<stage>.<name>": {"step": ..., "exp_avg": ..., ...}},
     "param_groups": [{"lr": ..., ..., "params": ["<stage>.<name>", ...]}]}

A tensor-parallel parameter's per-element state (a tensor of the shard's shape: Adam's
moments, SGD's momentum) is gathered like the parameter — concatenated along its split
dimension, across processes through the runtime (:mod:`overlap.torch.gather`) — and split
again on load; the rest (``step``) comes from the stage's first device. Each stage is
written by the process that drives its first device, so the union of every process's
dictionary is the whole model's, and it loads into any placement or plan, or into a plain
torch optimizer through ``set_optimizer_state_dict``'s format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .gather import gather_split

TorchPipeline = Any  # (the pipeline imports this module: no cycle)


def param_names(pipe: TorchPipeline) -> dict[int, tuple[int, int, str]]:
    """id(parameter) -> (stage, device index, full name) for this process's modules."""
    out: dict[int, tuple[int, int, str]] = {}
    for st in pipe.local_stages:
        ids = pipe.meshes[st.index].device_ids
        for d, module in zip(st.devices, st.modules):
            for name, p in module.named_parameters():
                out[id(p)] = (st.index, ids.index(d), name)
    return out


def check_optimizer(pipe: TorchPipeline, optimizer: Any) -> dict[int, tuple[int, int, str]]:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    names = param_names(pipe)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("optimizer: it steps a parameter that is none of this "
                                 "process's stage modules' (make it over pipe.parameters())")
    return names


def optimizer_state(pipe: TorchPipeline, optimizer: Any, rt: Any,
                    owners: tuple[int, ...] | None, rank: int) -> dict[str, Any]:
    names = check_optimizer(pipe, optimizer)
    by_key = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    keys, moments = _state_kinds(optimizer)
    state: dict[str, dict[str, Any]] = {}
    for s in range(len(pipe.meshes)):  # (every stage, in order: the gathers are collective)
        ids = pipe.meshes[s].device_ids
        tp = pipe.tp[s]
        writer = owners is None or owners[ids[0]] == rank
        spans = owners is not None and len({owners[d] for d in ids}) > 1
        template = tp.module if tp is not None else pipe.modules[s][0]
        for name, full in template.named_parameters():
            here = {k: optimizer.state.get(by_key[(s, k, name)], {})
                    for k in range(len(ids)) if (s, k, name) in by_key}
            entry: dict[str, Any] = {}
            for key in keys:
                value = here.get(0, {}).get(key)  # (the first device's: the writer's)
                if tp is not None and name in tp.split and key in moments:
                    local = {ids[k]: st[key] for k, st in here.items() if key in st}
                    if spans:
                        value = gather_split(rt, tp, name, tuple(full.shape), full.dtype, local)
                    elif writer and local:
                        value = torch.cat([local[d].detach() for d in tp.comms[0].group],
                                          tp.split[name])
                if writer and value is not None:
                    entry[key] = value.detach().clone() if isinstance(value, torch.Tensor) \
                        else value
            if writer and entry:
                state[f"{s}.{name}"] = entry
    groups = []
    for g in optimizer.param_groups:
        params = list(dict.fromkeys(f"{names[id(p)][0]}.{names[id(p)][2]}" for p in g["params"]))
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    return {"state": state, "param_groups": groups}


def _state_kinds(optimizer: Any) -> tuple[list[str], set[str]]:
    """The state's keys, and which of them hold one value per element of the parameter
    (Adam's moments, a momentum buffer: they are split like it), from this process's first
    parameter that has state — the optimizer makes the same keys for every parameter, and
    every process that stepped has some (so all processes make the same gathers)."""
    for g in optimizer.param_groups:
        for p in g["params"]:
            st = optimizer.state.get(p)
            if st and p.dim() > 0:
                return sorted(st), {k for k, v in st.items() if isinstance(v, torch.Tensor)
                                    and tuple(v.shape) == tuple(p.shape)}
    return [], set()


def load_optimizer_state(pipe: TorchPipeline, optimizer: Any, saved: Any) -> None:
    """Check everything, then set (nothing changes when a check fails)."""
    names = check_optimizer(pipe, optimizer)
    if not isinstance(saved, Mapping) or set(saved) != {"state", "param_groups"}:
        raise ValueError("optimizer_state_dict: expected {'state': ..., 'param_groups': ...} "
                         "(as TorchPipeline.optimizer_state_dict makes it)")
    state, groups = saved["state"], saved["param_groups"]
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        raise ValueError("optimizer_state_dict: 'state' must be a mapping and 'param_groups' "
                         "a list")
    new: dict[Any, dict[str, Any]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            s, k, name = names[id(p)]
            entry = state.get(f"{s}.{name}")
            if entry is None:
                continue
            if not isinstance(entry, Mapping):
                raise ValueError(f"optimizer_state_dict['state'][{f'{s}.{name}'!r}]: expected "
                                 f"a mapping of state names to values")
            new[p] = {key: _shard_of(pipe, s, k, name, key, v, p) for key, v in entry.items()}
    hyper = []
    for g in optimizer.param_groups:
        keys = {f"{names[id(p)][0]}.{names[id(p)][2]}" for p in g["params"]}
        match = next((h for h in groups if isinstance(h, Mapping)
                      and keys & set(h.get("params", ()))), None)
        if match is not None:
            hyper.append((g, {k: v for k, v in match.items() if k != "params"}))
    for p, st in new.items():
        optimizer.state[p] = st
    for g, values in hyper:
        g.update(values)


def _shard_of(pipe: TorchPipeline, s: int, k: int, name: str, key: str, value: Any,
              p: torch.Tensor) -> Any:
    """Device ``k``'s part of saved state ``value`` of parameter ``name``: a per-element
    tensor (the full parameter's shape) split as the parameter is, moved to it."""
    if not isinstance(value, torch.Tensor):
        return value
    tp = pipe.tp[s]
    full = tuple((tp.module if tp is not None else pipe.modules[s][0])
                 .get_parameter(name).shape)
    where = f"optimizer_state_dict['state'][{f'{s}.{name}'!r}][{key!r}]"
    if p.dim() == 0 or tuple(value.shape) != full:
        if value.dim() == p.dim() > 0:
            raise ValueError(f"{where}: shape {tuple(value.shape)}, the parameter is {full}")
        return value.detach().clone()  # (``step``: kept where torch keeps it)
    if tp is not None and name in tp.split:
        comm = tp.comms[k]
        value = value.chunk(comm.size, tp.split[name])[comm.index]
    return value.detach().to(p.device, p.dtype if value.is_floating_point() else value.dtype,
                             copy=True)


__all__ = ["load_optimizer_state", "optimizer_state"]
