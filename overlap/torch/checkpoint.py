"""``TorchPipeline.state_dict`` / ``load_state_dict``: a pipeline's weights under the names of
the plain model they came from.

The keys are those of ``nn.Sequential(*stage_modules).state_dict()`` — ``"<stage>.<name>"``
with each stage's full module names — so a checkpoint moves both ways between a pipeline and
the single-process torch model, and between pipelines of other placements, schedules and
tensor-parallel plans: a tensor-parallel stage's shards are gathered on the way out and
split again on the way in, a replicated stage's copies all get the same values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from .checks import check_index
from .gather import gather_split

# (``pipe`` below is a TorchPipeline, which imports this module: typed as Any, no cycle.)
TorchPipeline = Any


class LoadResult(NamedTuple):
    """As torch's ``load_state_dict`` returns: keys the stages wanted and did not get, and
    keys that name nothing here (both empty under ``strict=True``, which raises instead)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def writers(pipe: TorchPipeline) -> tuple[Any, tuple[int, ...] | None, int]:
    """(the runtime, device -> rank where processes split the stages, this rank): who
    writes which stage (:func:`stage_state`)."""
    rt = pipe._runtime
    owners = None if pipe._local is None or rt is None else rt.backend.placement.owners
    return rt, owners, 0 if rt is None else rt.world.rank


def pipeline_state(pipe: TorchPipeline) -> dict[str, torch.Tensor]:
    """The ``"<stage>.<name>"`` state of the stages this process writes (see module doc)."""
    out: dict[str, torch.Tensor] = {}
    rt, owners, rank = writers(pipe)
    for s in range(len(pipe.meshes)):
        part = stage_state(pipe, s, rt, owners, rank)
        out.update({f"{s}.{k}": v for k, v in (part or {}).items()})
    return out


def full_stage_state(pipe: TorchPipeline, stage: int) -> dict[str, torch.Tensor]:
    """Stage ``stage``'s state under its full module's names, every device of it local."""
    check_index(stage, len(pipe.meshes), "stage")
    if pipe._local is not None:
        away = [d for d in pipe.meshes[stage].device_ids if d not in pipe._local]
        if away:
            raise ValueError(f"stage: stage {stage}'s devices {away} are driven by other "
                             "processes, whose parameters this one does not have; call it "
                             "where all of the stage's devices are local")
    tp = pipe.tp[stage]
    if tp is not None:
        return tp.state_dict()
    return {k: v.detach().clone() for k, v in pipe.modules[stage][0].state_dict().items()}


def stage_state(pipe: TorchPipeline, s: int, rt: Any, owners: tuple[int, ...] | None,
                rank: int) -> dict[str, torch.Tensor] | None:
    """Stage ``s``'s state under its full module's names (copies), from the process that
    writes it — the one driving the stage's first device; None elsewhere. ``owners``:
    device -> rank (None: one process). A tensor-parallel stage spanning processes is
    gathered through ``rt`` (:mod:`overlap.torch.gather`: collective, every process calls
    this for every stage in order)."""
    ids = pipe.meshes[s].device_ids
    tp = pipe.tp[s]
    if owners is None or len({owners[d] for d in ids}) == 1:
        if owners is not None and owners[ids[0]] != rank:
            return None
        if tp is not None:
            return tp.state_dict()
        return {k: v.detach().clone() for k, v in pipe.modules[s][0].state_dict().items()}
    writer = owners[ids[0]] == rank
    here = [k for k, d in enumerate(ids) if owners[d] == rank]
    out: dict[str, torch.Tensor] = {}
    first = pipe.modules[s][0].state_dict() if writer else {}
    if tp is None:  # replicas: the first device's copy
        return {k: v.detach().clone() for k, v in first.items()} if writer else None
    states = {ids[k]: pipe.modules[s][k].state_dict() for k in here}
    for key, ref in tp.module.state_dict().items():
        if key in tp.split:
            full = gather_split(rt, tp, key, tuple(ref.shape), ref.dtype,
                                {d: st[key] for d, st in states.items()})
            if writer:
                assert full is not None
                out[key] = full
        elif writer:
            out[key] = first[key].detach().clone()
    return out if writer else None


def stage_keys(pipe: TorchPipeline, s: int) -> dict[str, torch.Tensor]:
    """Stage ``s``'s full-module state (names and tensors of the template: shapes)."""
    tp = pipe.tp[s]
    return (tp.module if tp is not None else pipe.modules[s][0]).state_dict()


def load(pipe: TorchPipeline, state: Any, strict: bool, here: set[int] | None) -> LoadResult:
    """Check everything, then copy (nothing is changed when a check fails)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict: expected a mapping of names to tensors, got "
                        f"{type(state).__name__}")
    p = len(pipe.meshes)
    by_stage: dict[int, dict[str, Any]] = {}
    unexpected = []
    for key, value in state.items():
        head, _, rest = str(key).partition(".")
        if not head.isdigit() or int(head) >= p or not rest:
            unexpected.append(str(key))
            continue
        by_stage.setdefault(int(head), {})[rest] = value
    missing = []
    plans = []
    for s in range(p):
        devices = [k for k, d in enumerate(pipe.meshes[s].device_ids)
                   if here is None or d in here]
        if not devices:
            continue  # another process's stage: its keys are for that process
        want = stage_keys(pipe, s)
        given = by_stage.get(s, {})
        missing += [f"{s}.{k}" for k in want if k not in given]
        unexpected += [f"{s}.{k}" for k in given if k not in want]
        for k, ref in want.items():
            if k not in given:
                continue
            v = given[k]
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"state_dict[{f'{s}.{k}'!r}]: expected a tensor, got "
                                f"{type(v).__name__}")
            if tuple(v.shape) != tuple(ref.shape):
                raise ValueError(f"state_dict[{f'{s}.{k}'!r}]: shape {tuple(v.shape)}, but "
                                 f"stage {s}'s {k} is {tuple(ref.shape)}")
        plans.append((s, devices, given))
    if strict and (missing or unexpected):
        raise KeyError(f"state_dict: missing keys {missing[:8]}"
                       f"{' …' if len(missing) > 8 else ''}, unexpected keys {unexpected[:8]}"
                       f"{' …' if len(unexpected) > 8 else ''} (strict=True; keys are "
                       "'<stage>.<name>', as nn.Sequential(*stages) names them)")
    with torch.no_grad():
        for s, devices, given in plans:
            tp = pipe.tp[s]
            for k in devices:
                module = pipe.modules[s][k]
                target = module.state_dict()
                for name, value in given.items():
                    if name not in target:
                        continue
                    if tp is not None and name in tp.split:
                        comm = tp.comms[k]
                        value = value.chunk(comm.size, tp.split[name])[comm.index]
                    target[name].copy_(value)
    return LoadResult(missing, unexpected)


__all__ = ["LoadResult", "full_stage_state", "load", "pipeline_state", "stage_keys",
           "stage_state", "writers"]
