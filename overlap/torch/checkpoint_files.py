"""Checkpoints in a directory, one file per process: ``TorchPipeline.save_checkpoint`` and
``load_checkpoint``, both ways between any numbers of processes (N → M), placements and
plans, and plain torch.

Saving (every process, together): each writes what :meth:`TorchPipeline.state_dict` and
:meth:`TorchPipeline.optimizer_state_dict` give it — the stages whose first device it drives,
a tensor-parallel stage split across processes gathered first — to ``rank<r>-of-<n>.pt``
(written aside and renamed: never half a file under its name); the processes then agree
that every file is written, and rank 0 writes ``checkpoint.json`` last, naming the files and
the save's id (the same in every file). When ``save_checkpoint`` returns on any process the
checkpoint is complete: a load right after, in the same job, needs no barrier of its own.

Loading (any number of processes, even one; plain torch too): each process reads the
manifest and every file it names (the whole model, on the CPU), checks each carries the
save's id (a file left by another save, or a save that did not finish, is refused by name),
and loads the union — the whole model's state under the plain model's names — into its
stages (keys of stages it does not run are skipped). Plain torch: :func:`read_checkpoint`
gives the union, for ``model.load_state_dict`` and
``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..world import max_over_ranks

MANIFEST = "checkpoint.json"
FORMAT = "overlap.torch checkpoint 1"

# (``pipe``: a TorchPipeline, which imports this module: typed Any, no cycle.)
TorchPipeline = Any


def save_checkpoint(pipe: TorchPipeline, directory: str | os.PathLike[str],
                    optimizer: torch.optim.Optimizer | None = None,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write this process's part of the checkpoint (see module doc); returns its file."""
    out = _directory(directory, create=True)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra: expected a dict (saved beside the state, e.g. the step), "
                        f"got {type(extra).__name__}")
    rt = pipe._runtime
    world = rt.world if rt is not None else None
    rank, size = (world.rank, world.size) if world is not None else (0, 1)
    # The save's id, the same on every process: the latest clock of them all.
    save_id = time.time() if world is None else max_over_ranks(time.time(), world)
    part = {"format": FORMAT, "save_id": save_id, "rank": rank, "ranks": size,
            "model": pipe.state_dict(),
            "optim": None if optimizer is None else pipe.optimizer_state_dict(optimizer),
            "extra": extra}
    path = out / f"rank{rank}-of-{size}.pt"
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(part, tmp)
    os.replace(tmp, path)
    if world is not None:  # every file written before the manifest names them
        max_over_ranks(0.0, world)
    if rank == 0:
        manifest = {"format": FORMAT, "save_id": save_id, "ranks": size,
                    "files": [f"rank{r}-of-{size}.pt" for r in range(size)]}
        tmp_manifest = out / f"{MANIFEST}.tmp{os.getpid()}"
        tmp_manifest.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp_manifest, out / MANIFEST)
    if world is not None:  # the manifest is there before any process returns
        max_over_ranks(0.0, world)
    return path


def read_checkpoint(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole checkpoint: ``{"model": state_dict, "optim": optimizer state or None,
    "extra": rank 0's extra}`` — the union of every process's file, for plain torch or a
    pipeline of any placement."""
    src = _directory(directory, create=False)
    manifest_path = src / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"directory: {str(src)!r} has no {MANIFEST} — not a checkpoint "
                         "(or its save did not finish)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"directory: {manifest_path} is not readable JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"directory: {manifest_path} is not an {FORMAT!r} manifest")
    model: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {}
    groups: Any = None
    extra: Any = None
    any_optim = False
    for name in manifest["files"]:
        path = src / name
        try:
            # (Not mmap: a tensor kept from it — an optimizer's state — would read a file
            # the next save may replace.)
            part = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ValueError(f"directory: {path} is missing: the checkpoint names "
                             f"{len(manifest['files'])} files") from None
        if not isinstance(part, dict) or part.get("save_id") != manifest["save_id"]:
            raise ValueError(f"directory: {path} is not of this checkpoint's save (another "
                             "save's file, or one that did not finish)")
        overlap = set(model) & set(part["model"])
        if overlap:
            raise ValueError(f"directory: {path} holds {sorted(overlap)[:3]}, which another "
                             "file holds too")
        model.update(part["model"])
        if part["optim"] is not None:
            any_optim = True
            state.update(part["optim"]["state"])
            groups = groups if groups is not None else part["optim"]["param_groups"]
        if part["rank"] == 0:
            extra = part["extra"]
    optim = {"state": state, "param_groups": groups} if any_optim else None
    return {"model": model, "optim": optim, "extra": extra}


def load_checkpoint(pipe: TorchPipeline, directory: str | os.PathLike[str],
                    optimizer: torch.optim.Optimizer | None = None, strict: bool = True
                    ) -> dict[str, Any] | None:
    """Load a checkpoint written by :func:`save_checkpoint` (any number of processes) into
    this process's stages, and ``optimizer``'s state when given; returns the ``extra``
    saved. Everything is checked before anything changes."""
    whole = read_checkpoint(directory)
    if optimizer is None:
        pipe.load_state_dict(whole["model"], strict=strict)
        return whole["extra"]
    if whole["optim"] is None:
        raise ValueError(f"optimizer: the checkpoint in {str(directory)!r} was saved without "
                         "an optimizer's state")
    # Each load checks everything before it changes anything; the optimizer's goes first
    # and is put back (its old state's tensors, untouched: a load replaces them) if the
    # model's is refused, so a refused checkpoint changes nothing at all.
    state, groups = dict(optimizer.state), [dict(g) for g in optimizer.param_groups]
    pipe.load_optimizer_state_dict(optimizer, whole["optim"])
    try:
        pipe.load_state_dict(whole["model"], strict=strict)
    except BaseException:
        optimizer.state.clear()
        optimizer.state.update(state)
        for g, saved in zip(optimizer.param_groups, groups):
            g.clear()
            g.update(saved)
        raise
    return whole["extra"]


def _directory(directory: Any, create: bool) -> Path:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory: expected a path, got {type(directory).__name__}")
    path = Path(directory)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    elif not path.is_dir():
        raise ValueError(f"directory: {str(path)!r} is not a directory")
    return path


__all__ = ["load_checkpoint", "read_checkpoint", "save_checkpoint"]
