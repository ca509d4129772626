"""Automatic partitioning of a torch model: measure each block, then :func:`scheduler.partition`.

    from overlap.torch import auto_partition
    auto = auto_partition(blocks, cluster, num_microbatches=8, sample=x_mb, target=y_mb,
                          loss_fn=loss_fn, tp_plans=plan_of)   # plan_of(block) -> plan | None
    print(auto.plan.to_text())
    pipe = auto.pipeline(loss_fn)                             # a TorchPipeline
    losses = pipe.train_step_sync(rt, x, y, num_microbatches=8, schedule=auto.schedule)

What is measured, on the sample's device (the CPU; on a GPU each time is read after
``torch.cuda.synchronize`` — written, not yet run on one), with a few timed microbatches
after ``warmup`` untimed ones (median of ``repeat``), on copies of the blocks (the model,
its ``.grad`` and the caller's RNG are left as they were):

- per block, on one microbatch (``sample``: the first block's input; each next block gets the
  previous one's output): forward, full backward, and the backward split into the input
  gradient (``torch.autograd.grad`` on the input, the graph kept) and the weight gradient
  (``backward(inputs=parameters)``) — what ``TorchPipeline`` runs for zb-h1 and zbv; the last
  block with ``loss_fn`` (its backward starts from the loss);
- its output's shape and dtype; its parameters' bytes (and as many for their gradients, plus
  ``optimizer_states`` copies: Adam keeps 2); the bytes autograd saves for its backward
  (``torch.autograd.graph.saved_tensors_hooks``: the activations a stage keeps per
  microbatch).

**Tensor-parallel degrees** (``degrees``; default: every divisor of the GPUs per host the
block's plan splits — ``parallelize`` refuses the others) cannot all be run on one device, so
they are **measured on one shard and modelled for its communication**: the block is sharded
by its plan for a mesh of ``t`` devices and shard 0 is timed alone (its compute is the real
``1/t`` of the work), its collectives answered locally without waiting (an all-reduce returns
its input, an all-gather ``t`` copies) while their sizes are recorded; each recorded
collective is then costed by the project's cost model on the cluster's first ``t`` devices (an
all-reduce twice an all-gather's lower bound) and added. Parameters and saved activations are
divided by ``t``. A block without a plan runs at degree 1 only.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from scheduler import (
    Cluster,
    DeviceMesh,
    Layer,
    PartitionPlan,
    PlanOptions,
    Schedule,
    SearchBudget,
    ShardingSpec,
    partition,
)
from scheduler.partition import all_reduce_seconds

from .parallel import Replicate, TensorParallel, parallelize, spec_of
from .pipeline import LossFn, TorchPipeline, replicate
from .tensors import numpy_dtype

TpPlans = Callable[[nn.Module], Mapping[str, Any] | None] | Sequence[Mapping[str, Any] | None]


class _Rehearsal:
    """Stands in for a stage context while one shard runs alone: collectives answered at
    once (shapes right, values not), each one's bytes recorded for the cost model."""

    cuda_stream = None

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls: list[tuple[str, int]] = []

    def all_reduce(self, x: np.ndarray, axis: str | None = None) -> np.ndarray:
        self.calls.append(("all_reduce", x.nbytes))
        return x.copy()

    def all_gather(self, x: np.ndarray, axis: str | None = None) -> np.ndarray:
        self.calls.append(("all_gather", x.nbytes))
        return np.stack([x] * self.size)


@dataclass(frozen=True)
class Timing:
    """Seconds per microbatch of one block at one degree, and what its collectives cost."""

    forward: float
    backward: float
    input_grad: float
    weight_grad: float


def _clock(x: torch.Tensor) -> float:
    """Now, once the work queued on ``x``'s GPU is done (CUDA runs asynchronously)."""
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter()


def _median(fn: Callable[[], Any], warmup: int, repeat: int, x: torch.Tensor) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = _clock(x)
        fn()
        times.append(_clock(x) - t0)
    return statistics.median(times)


def _run(module: nn.Module, x: torch.Tensor, target: Any, loss_fn: LossFn | None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(its input, made a leaf that wants a gradient if it can; its output or loss)."""
    x = x.detach().requires_grad_(x.is_floating_point())
    out = module(x)
    if loss_fn is not None:
        out = loss_fn(out, target) if target is not None else loss_fn(out)
    return x, out


def time_block(module: nn.Module, x: torch.Tensor, target: Any, loss_fn: LossFn | None,
               warmup: int, repeat: int) -> Timing:
    """Forward, backward, input and weight gradient of ``module`` on ``x`` (``loss_fn``:
    the last block's, its backward from the loss)."""
    params = [p for p in module.parameters() if p.requires_grad]

    def forward() -> None:
        _run(module, x, target, loss_fn)

    def backward() -> None:
        _, out = _run(module, x, target, loss_fn)
        grad = torch.ones_like(out)
        t0 = _clock(x)
        torch.autograd.backward(out, grad)
        spent.append(_clock(x) - t0)

    def split() -> None:
        xin, out = _run(module, x, target, loss_fn)
        grad = torch.ones_like(out)
        t0 = _clock(x)
        if xin.requires_grad:
            torch.autograd.grad(out, [xin], grad, retain_graph=True)
        t1 = _clock(x)
        if params:
            torch.autograd.backward(out, grad, inputs=params)
        parts.append((t1 - t0, _clock(x) - t1))

    fwd = _median(forward, warmup, repeat, x)
    spent: list[float] = []
    _median(backward, warmup, repeat, x)
    parts: list[tuple[float, float]] = []
    _median(split, warmup, repeat, x)
    ig = statistics.median(p[0] for p in parts[warmup:])
    wg = statistics.median(p[1] for p in parts[warmup:])
    return Timing(fwd, statistics.median(spent[warmup:]), ig, wg)


def _saved_bytes(module: nn.Module, x: torch.Tensor, target: Any,
                 loss_fn: LossFn | None) -> int:
    """Bytes autograd saves for ``module``'s backward on ``x`` (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run(module, x, target, loss_fn)
    return sum(seen.values())


def _shard_input(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    layout = tp.input_layout
    if isinstance(layout, Replicate):
        return x
    return x.chunk(tp.degree, layout.dim)[0].contiguous()


def sharded(block: nn.Module, plan: Mapping[str, Any], degree: int) -> TensorParallel | None:
    """``block`` sharded by ``plan`` for a mesh of ``degree`` devices (a copy), or None where
    the plan cannot split it that many ways (``parallelize`` refuses it)."""
    try:
        return parallelize(copy.deepcopy(block), DeviceMesh(list(range(degree)), ("tp",)),
                           plan, axis="tp")
    except (ValueError, TypeError):
        return None


def time_shard(tp: TensorParallel, x: torch.Tensor, target: Any, loss_fn: LossFn | None,
               cluster: Cluster, warmup: int, repeat: int) -> Timing:
    """Shard 0 of ``tp`` timed alone on ``x`` (the whole microbatch), plus its collectives
    as the cost model prices them on the cluster's first devices (module doc)."""
    shard, comm, degree = tp.modules[0], tp.comms[0], tp.degree
    stand_in = _Rehearsal(degree)
    xs = _shard_input(x, tp)
    comm.ctx = stand_in  # type: ignore[assignment]
    try:
        timing = time_block(shard, xs, target, loss_fn, warmup, repeat)
        stand_in.calls.clear()
        comm.ctx = stand_in  # type: ignore[assignment]  (forgets what one op shared)
        _, out = _run(shard, xs, target, loss_fn)
        forward = list(stand_in.calls)
        stand_in.calls.clear()
        torch.autograd.backward(out, torch.ones_like(out))
        backward = list(stand_in.calls)
    finally:
        comm.ctx = None
    fwd = sum(_collective_seconds(op, n, degree, cluster) for op, n in forward)
    bwd = sum(_collective_seconds(op, n, degree, cluster) for op, n in backward)
    return Timing(timing.forward + fwd, timing.backward + bwd, timing.input_grad + bwd,
                  timing.weight_grad)


def _collective_seconds(op: str, nbytes: int, degree: int, cluster: Cluster) -> float:
    if op == "all_reduce":
        return all_reduce_seconds(nbytes, degree, cluster)
    return all_reduce_seconds(nbytes * degree, degree, cluster) / 2  # an all-gather


def _plan_of(tp_plans: TpPlans | None, block: nn.Module, i: int) -> Mapping[str, Any] | None:
    if tp_plans is None:
        return None
    if callable(tp_plans):
        return tp_plans(block)
    return tp_plans[i]


def _check_int(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
    return value


def _check_blocks(blocks: object) -> list[nn.Module]:
    if isinstance(blocks, nn.Sequential):
        blocks = list(blocks)
    if isinstance(blocks, (nn.Module, str, bytes)) or not isinstance(blocks, Sequence) \
            or not blocks:
        raise TypeError(f"blocks: expected an nn.Sequential or a non-empty list of nn.Module, "
                        f"got {type(blocks).__name__}")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"blocks[{i}]: expected an nn.Module, got {type(b).__name__}")
    return list(blocks)


def _check_plans(tp_plans: object, n: int) -> None:
    if tp_plans is None or callable(tp_plans):
        return
    if isinstance(tp_plans, (Mapping, str)) or not isinstance(tp_plans, Sequence):
        raise TypeError(f"tp_plans: expected a callable block -> plan (or None), or one plan "
                        f"(or None) per block, got {type(tp_plans).__name__}")
    if len(tp_plans) != n:
        raise ValueError(f"tp_plans: {len(tp_plans)} plans for {n} blocks")


def _check_degrees(degrees: object, cluster: Cluster | None) -> list[int]:
    if degrees is None:
        g = cluster.gpus_per_host if cluster is not None else 1
        return [t for t in range(1, g + 1) if g % t == 0]
    if isinstance(degrees, (str, bytes)) or not isinstance(degrees, Sequence):
        raise TypeError(f"degrees: expected a sequence of TP degrees, got {degrees!r}")
    out = sorted({_check_int("degrees", t, 1) for t in degrees})
    if not out:
        raise ValueError("degrees: expected at least one TP degree")
    if cluster is None and out != [1]:
        raise ValueError(f"degrees: {out} needs a cluster= to cost the collectives of degrees "
                         "above 1")
    return out


def measure_layers(blocks: Sequence[nn.Module] | nn.Sequential, sample: torch.Tensor, *,
                   target: Any = None, loss_fn: LossFn | None = None,
                   tp_plans: TpPlans | None = None, degrees: Sequence[int] | None = None,
                   cluster: Cluster | None = None, warmup: int = 1, repeat: int = 3,
                   optimizer_states: int = 0) -> list[Layer]:
    """One :class:`scheduler.Layer` per block, measured as the module doc says. ``sample``
    is one microbatch of the first block's input (``target`` its target for ``loss_fn``);
    ``tp_plans``: the plan of each block for tensor parallelism (a callable ``block ->
    plan or None``, or one per block); ``cluster``: where the collectives of degrees above 1
    are costed (without it, degree 1 only)."""
    blocks = _check_blocks(blocks)
    if not isinstance(sample, torch.Tensor):
        raise TypeError(f"sample: expected a tensor (one microbatch), got "
                        f"{type(sample).__name__}")
    if cluster is not None and not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a scheduler.Cluster, got {type(cluster).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable, got {type(loss_fn).__name__}")
    _check_plans(tp_plans, len(blocks))
    wanted = _check_degrees(degrees, cluster)
    warmup, repeat = _check_int("warmup", warmup, 0), _check_int("repeat", repeat, 1)
    states = _check_int("optimizer_states", optimizer_states, 0)
    layers, x = [], sample
    gpus = [sample.device.index or 0] if sample.is_cuda else []
    with torch.random.fork_rng(devices=gpus):  # (dropout draws; the caller's RNG is kept)
        for i, block in enumerate(blocks):
            last = i == len(blocks) - 1
            layer, x = _measure(block, i, x, target if last else None,
                                loss_fn if last else None, _plan_of(tp_plans, block, i),
                                wanted, cluster, warmup, repeat, states)
            layers.append(layer)
    return layers


def _measure(block: nn.Module, i: int, x: torch.Tensor, target: Any, loss_fn: LossFn | None,
             plan: Mapping[str, Any] | None, degrees: list[int], cluster: Cluster | None,
             warmup: int, repeat: int, states: int) -> tuple[Layer, torch.Tensor]:
    mine = copy.deepcopy(block)  # (its .grad and buffers are the copy's)
    whole = time_block(mine, x, target, loss_fn, warmup, repeat)
    times = {1: whole} if 1 in degrees else {}
    saved = _saved_bytes(mine, x, target, loss_fn)
    with torch.no_grad():
        out = mine(x)  # (the next block's input)
    in_spec = out_spec = ShardingSpec()
    for t in degrees:
        tp = None if t == 1 or plan is None or cluster is None or t > cluster.num_devices \
            else sharded(block, plan, t)
        if tp is None:
            continue
        times[t] = time_shard(tp, x, target, loss_fn, cluster, warmup, repeat)  # type: ignore[arg-type]
        in_spec = spec_of(tp.input_layout, x.dim(), "tp", f"blocks[{i}] input")
        out_spec = spec_of(tp.output_layout, out.dim(), "tp", f"blocks[{i}] output")
    if not times:
        why = ("its plan splits it none of those ways" if plan is not None else
               "it has no tensor-parallel plan: degree 1 only")
        raise ValueError(f"blocks[{i}] ({type(block).__name__}): supports none of degrees "
                         f"{degrees} ({why})")
    dtype = numpy_dtype(out.dtype)
    if dtype is None:
        raise TypeError(f"blocks[{i}]: its output is {out.dtype}, which the runtime cannot "
                        "carry")
    params = sum(p.numel() * p.element_size() for p in block.parameters())
    layer = Layer({t: v.forward for t, v in times.items()},
                  {t: v.backward for t, v in times.items()}, tuple(out.shape), dtype.name,
                  params * (2 + states), saved,
                  input_grad={t: v.input_grad for t, v in times.items()},
                  weight_grad={t: v.weight_grad for t, v in times.items()},
                  output_spec=out_spec, input_spec=in_spec,
                  name=f"{i}:{type(block).__name__}")
    return layer, out.detach()


@dataclass(frozen=True)
class AutoPartition:
    """What :func:`auto_partition` chose: the ``plan`` (:class:`scheduler.PartitionPlan`),
    the ``layers`` it was made from, and per stage its module (an ``nn.Sequential`` of the
    blocks themselves, not copies), its mesh (axis ``"tp"``) and its tensor-parallel plan
    (the blocks' plans under the stage's names; None at TP degree 1) — what
    :class:`TorchPipeline` takes, with :attr:`schedule`. A stage the plan splits over
    ``"dp"`` (``plan.stages[s].dp > 1``) gets its mesh's ``dp`` axis as
    ``TorchPipeline(..., data_parallel="dp")``."""

    plan: PartitionPlan
    layers: tuple[Layer, ...]
    modules: tuple[nn.Sequential, ...]
    meshes: tuple[DeviceMesh, ...]
    plans: tuple[dict[str, Any] | None, ...]

    @property
    def schedule(self) -> Schedule:
        """The schedule the partition chose (run it with :meth:`pipeline`)."""
        return self.plan.schedule

    def pipeline(self, loss_fn: LossFn, **kwargs: Any) -> TorchPipeline:
        """A :class:`TorchPipeline` of these stages (``kwargs``: its other arguments)."""
        planned = any(p is not None for p in self.plans)
        split = any(st.dp > 1 for st in self.plan.stages)
        # An unplanned stage on several devices takes a module per device: the block
        # itself first, copies for the others.
        modules: list[Any] = [m if p is not None or len(mesh.device_ids) == 1
                              else replicate(m, len(mesh.device_ids))
                              for m, p, mesh in zip(self.modules, self.plans, self.meshes)]
        if split:
            kwargs.setdefault("data_parallel", "dp")
        return TorchPipeline(modules, self.meshes, loss_fn,
                             plans=list(self.plans) if planned else None,
                             axis="tp" if planned else None, **kwargs)


def stage_plan(plans: Sequence[Mapping[str, Any] | None]) -> dict[str, Any]:
    """The plan of an ``nn.Sequential`` of blocks from each block's plan: block k's
    ``"name"`` becomes ``"k.name"`` (its root ``""``: ``"k"``)."""
    out: dict[str, Any] = {}
    for k, plan in enumerate(plans):
        for name, style in (plan or {}).items():
            out[f"{k}.{name}" if name else str(k)] = style
    return out


def _check_before_measuring(num_microbatches: object, memory: object, options: object,
                            budget: object) -> None:
    """What :func:`scheduler.partition` would refuse, refused before the blocks are timed."""
    _check_int("num_microbatches", num_microbatches, 1)
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float))
                               or not 0 < memory < float("inf")):
        raise ValueError(f"memory_per_device: expected bytes > 0 (or None: no limit), got "
                         f"{memory!r}")
    if options is not None and not isinstance(options, PlanOptions):
        raise TypeError(f"options: expected a PlanOptions, got {type(options).__name__}")
    if budget is not None and not isinstance(budget, SearchBudget):
        raise TypeError(f"budget: expected a SearchBudget, got {type(budget).__name__}")


def auto_partition(blocks: Sequence[nn.Module] | nn.Sequential, cluster: Cluster,
                   num_microbatches: int, sample: torch.Tensor, *, target: Any = None,
                   loss_fn: LossFn | None = None, tp_plans: TpPlans | None = None,
                   degrees: Sequence[int] | None = None,
                   memory_per_device: float | None = None, options: PlanOptions | None = None,
                   budget: SearchBudget | None = None, warmup: int = 1, repeat: int = 3,
                   optimizer_states: int = 0,
                   layers: Sequence[Layer] | None = None,
                   data_parallel: bool = True) -> AutoPartition:
    """Measure ``blocks`` (:func:`measure_layers`; or take ``layers`` already measured),
    partition them on ``cluster`` (:func:`scheduler.partition`; ``data_parallel``: whether
    a stage may split the batch over a ``"dp"`` axis of its mesh) and build each stage's
    module, mesh and tensor-parallel plan (module doc)."""
    blocks = _check_blocks(blocks)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a scheduler.Cluster, got {type(cluster).__name__}")
    _check_plans(tp_plans, len(blocks))
    _check_before_measuring(num_microbatches, memory_per_device, options, budget)
    if layers is None:
        layers = measure_layers(blocks, sample, target=target, loss_fn=loss_fn,
                                tp_plans=tp_plans, degrees=degrees, cluster=cluster,
                                warmup=warmup, repeat=repeat,
                                optimizer_states=optimizer_states)
    elif len(layers) != len(blocks):
        raise ValueError(f"layers: {len(layers)} layers for {len(blocks)} blocks")
    plan = partition(list(layers), cluster, num_microbatches,
                     memory_per_device=memory_per_device, options=options, budget=budget,
                     data_parallel=data_parallel)
    modules, plans = [], []
    for st in plan.stages:
        part = blocks[st.layers.start:st.layers.stop]
        modules.append(nn.Sequential(*part))
        block_plans = [_plan_of(tp_plans, b, i) for i, b in zip(st.layers, part)]
        plans.append(stage_plan(block_plans) if st.tp > 1 else None)
    return AutoPartition(plan, tuple(layers), tuple(modules), plan.meshes, tuple(plans))


__all__ = ["AutoPartition", "Timing", "auto_partition", "measure_layers", "stage_plan"]
