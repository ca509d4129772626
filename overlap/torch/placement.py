"""A :class:`~overlap.torch.TorchPipeline`'s modules against the runtime it runs on.

Which devices this process drives (a multi-process runtime: its own; one process: all) — the
same at every step as when the pipeline was built with ``rt=`` — where a factory's modules go
(their GPUs on the CUDA backend), and before each step every local module checked to live
where its device runs it: on the CPU, or on its own GPU. On CUDA tensor-parallel shards
move to their GPUs first (``Module.to`` keeps the Parameter objects, so an optimizer made
over ``parameters()`` before still holds them).
"""

from __future__ import annotations

from collections.abc import Callable, MutableSequence, Sequence
from typing import Any

import torch

from scheduler import DeviceMesh

from ..runtime import Runtime
from .checks import DeviceDtype, module_device_dtype
from .parallel import TensorParallel
from .stages import META


def check_runtime(rt: Any) -> None:
    if not isinstance(rt, Runtime):
        raise TypeError(f"rt: expected an overlap.Runtime, got {type(rt).__name__}")


def check_in_cluster(rt: Runtime, meshes: Sequence[DeviceMesh]) -> None:
    top = max(d for mesh in meshes for d in mesh.device_ids)
    if top >= rt.cluster.num_devices:
        raise ValueError(f"meshes: device {top} is outside the runtime's cluster "
                         f"(devices 0..{rt.cluster.num_devices - 1})")


def local_devices(rt: Runtime | None, meshes: Sequence[DeviceMesh]) -> frozenset[int] | None:
    """The devices ``rt``'s process drives where processes split them (None: every device,
    one process — or no runtime given)."""
    if rt is None:
        return None
    check_runtime(rt)
    check_in_cluster(rt, meshes)
    return frozenset(rt.local_devices) if rt.world.distributed else None


def gpu_of(rt: Runtime | None) -> Callable[[int], torch.device | None]:
    """Where a factory's module for a device goes: its GPU on the CUDA backend, else where
    it was built (None)."""
    if rt is None or rt.backend.name != "cuda":
        return lambda d: None
    return lambda d: torch.device("cuda", rt.backend.physical(d))


def attached(rt: Runtime, built_for: frozenset[int] | None) -> frozenset[int] | None:
    """The devices ``rt``'s process drives (None: all, one process), checked to be those
    the pipeline was built for (``rt=``; None: any)."""
    local = frozenset(rt.local_devices) if rt.world.distributed else None
    if built_for is not None and local != built_for:
        raise ValueError(f"rt: this pipeline was built (rt=) for a process driving devices "
                         f"{sorted(built_for)}; this runtime's process drives "
                         f"{sorted(local or range(rt.cluster.num_devices))}")
    return local


def check_placement(rt: Runtime, meshes: Sequence[DeviceMesh],
                    tp: Sequence[TensorParallel | None],
                    device_dtype: Sequence[MutableSequence[DeviceDtype]]) -> None:
    """Every module of a device this process drives on the CPU, or on the device's GPU on
    CUDA (shards moved there first; ``device_dtype`` updated)."""
    check_in_cluster(rt, meshes)
    cuda = rt.backend.name == "cuda"
    if cuda:
        _check_own_gpus(rt, meshes, tp)
        _place_shards(rt, tp, device_dtype)
    for s, mesh in enumerate(meshes):
        for k, d in enumerate(mesh.device_ids):
            dev, _ = device_dtype[s][k]
            if dev is None or not rt.backend.is_local(d):  # (another process runs it)
                continue
            want = torch.device("cuda", rt.backend.physical(d)) if cuda else \
                torch.device("cpu")
            if dev == META:
                raise ValueError(f"modules[{s}][{k}]: on the meta device (shapes only), "
                                 f"but device {d} runs it here; pass a stage_fn instead "
                                 "(built for real where its stage runs, on meta "
                                 "elsewhere)")
            if dev != want:
                raise ValueError(f"modules[{s}][{k}]: on {dev}, but device {d} of the "
                                 f"runtime's {rt.backend.name} backend is {want}")


def _place_shards(rt: Runtime, tp: Sequence[TensorParallel | None],
                  device_dtype: Sequence[MutableSequence[DeviceDtype]]) -> None:
    """Tensor-parallel shards (the adapter's own modules, made on the full module's device)
    move to their device's GPU."""
    for s, t in enumerate(tp):
        if t is None:
            continue
        for k, d in enumerate(t.mesh.device_ids):
            want = torch.device("cuda", rt.backend.physical(d))
            if rt.backend.is_local(d) and device_dtype[s][k][0] != want:
                t.modules[k].to(want)
                device_dtype[s][k] = module_device_dtype(t.modules[k], f"modules[{s}][{k}]")


def _check_own_gpus(rt: Runtime, meshes: Sequence[DeviceMesh],
                    tp: Sequence[TensorParallel | None]) -> None:
    """On CUDA torch runs every backward of one GPU on that GPU's one autograd thread: a
    device of a tensor-parallel stage, waiting there in a collective, would hold up every
    other device of its GPU, and two groups sharing GPUs could wait on each other. So such a
    device has its GPU to itself (one process per GPU always does)."""
    on: dict[int, set[int]] = {}
    for mesh in meshes:
        for d in mesh.device_ids:
            on.setdefault(rt.backend.physical(d), set()).add(d)
    for s, t in enumerate(tp):
        if t is None or t.degree == 1:
            continue
        for d in t.mesh.device_ids:
            gpu = rt.backend.physical(d)
            if len(on[gpu]) > 1:
                raise ValueError(
                    f"plans[{s}]: device {d} of this tensor-parallel stage shares GPU {gpu} "
                    f"with devices {sorted(on[gpu] - {d})}; torch runs all backward work "
                    "of one GPU on one thread, where their collectives would wait on "
                    "each other — give each device of a tensor-parallel stage its own GPU")


__all__ = ["attached", "check_in_cluster", "check_placement", "check_runtime", "gpu_of",
           "local_devices"]
