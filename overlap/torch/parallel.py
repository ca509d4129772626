"""Tensor parallelism inside a stage, in ``torch.distributed.tensor.parallel``'s vocabulary.

    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.out": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    tp = parallelize(block, mesh, plan, axis="tp")   # tp.modules: one shard per device

The user gives one full ``nn.Module`` and a plan mapping submodule names to styles;
:func:`parallelize` makes one shard module per device of ``mesh`` (the named axis splits, any
other axis replicates), with the parameters sliced and the collectives the plan implies
installed as forward hooks (:mod:`overlap.torch.comm`: autograd-aware, through the runtime's
stage collectives). Unlike torch's DTensor, tensors stay plain local tensors; a layout is
what a module's input or output *means* across the axis:

- :class:`Replicate` — every device holds the whole tensor;
- :class:`Shard` ``(dim)`` — device k of the axis holds block k of dimension ``dim``.

Styles (torch's defaults):

- :class:`ColwiseParallel` on ``nn.Linear`` (weight rows and bias split: output features
  sharded) or ``nn.Embedding`` (embedding dimension split). ``input_layouts`` Replicate() or
  Shard(d) (gathered first), ``output_layouts`` Shard(-1) (kept) or Replicate() (gathered).
- :class:`RowwiseParallel` on ``nn.Linear`` (weight columns split; the partial products
  summed, then the bias added) or ``nn.Embedding`` (vocabulary split: rows outside a
  device's block read as zero, then summed). ``input_layouts`` Shard(-1) or Replicate()
  (split first), ``output_layouts`` Replicate() (all-reduce) or Shard(d) (reduce-scatter).
- :class:`SequenceParallel` on modules that act on each position alone (``LayerNorm``,
  ``RMSNorm``, ``Dropout``, activations): input and output Shard(``sequence_dim``); their
  replicated parameters' gradients are summed over the axis.
- :class:`PrepareModuleInput` / :class:`PrepareModuleOutput` convert a module's first
  positional input / its output from one layout to another; on the stage's root (key ``""``)
  they also declare the layout the stage receives and hands on.

A stage's boundary layouts: its input is what the root's ``PrepareModuleInput`` says it
receives, else Shard(seq) when its first planned module is sequence-parallel, else
Replicate(); its output is what the root's ``PrepareModuleOutput`` makes it, else what its last
planned module (in ``named_modules`` order) leaves. A module with an integer ``num_heads`` (or
``n_heads``, or nanoGPT's ``n_head``) attribute above column-parallel projections gets
``num_heads // n`` in each shard, which then computes its own heads (as torchtitan sets by
hand). A shard whose forward fails anyway says where and with which sizes
(:mod:`overlap.torch.shard_errors`).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from scheduler import DeviceMesh, P, ShardingSpec

from ..pipeline import axis_line
from .comm import AxisComm, convert, reduce_grad


@dataclass(frozen=True)
class Replicate:
    """Every device of the axis holds the whole tensor."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    """Device k of the axis holds block k of dimension ``dim`` (negative: from the end)."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"Shard: dim must be an int, got {self.dim!r}")


Layout = Replicate | Shard


def _layout(value: object, argument: str) -> Layout:
    if isinstance(value, (Replicate, Shard)):
        return value
    raise TypeError(f"{argument}: expected Replicate() or Shard(dim), got {value!r}")


def _first(value: object, argument: str) -> Layout:
    """A style's layouts: one layout, or torch's tuple per positional input (the first is the
    tensor; later entries must be None)."""
    if isinstance(value, tuple):
        if not value or any(v is not None for v in value[1:]):
            raise ValueError(f"{argument}: only the first positional input can have a layout "
                             f"here, got {value!r}")
        value = value[0]
    return _layout(value, argument)


def spec_of(layout: Layout, rank: int | None, axis: str, argument: str) -> ShardingSpec:
    """``layout`` over mesh axis ``axis`` as a sharding spec for a rank-``rank`` tensor
    (``rank`` None: any rank, for a layout on a non-negative dimension)."""
    if isinstance(layout, Replicate):
        return P()
    if rank is None:
        if layout.dim < 0:
            raise ValueError(f"{argument}: {layout!r} counts from the end; the tensor's rank is "
                             "needed (TorchPipeline.prepare gives the step's input sharding)")
        return P(*([None] * layout.dim), axis)
    dim = layout.dim + rank if layout.dim < 0 else layout.dim
    if not 0 <= dim < rank:
        raise ValueError(f"{argument}: {layout!r} names no dimension of a rank-{rank} tensor")
    return P(*([None] * dim), axis)


# ---- styles ------------------------------------------------------------------------------


class ParallelStyle:
    """What a style does to one submodule of one shard (see the module doc)."""

    supports: tuple[type, ...] = ()

    def check(self, module: nn.Module, name: str, n: int) -> None:
        """TypeError/ValueError naming the plan entry if this style cannot apply to ``module`` split
        ``n`` ways."""
        if self.supports and not isinstance(module, self.supports):
            names = ", ".join(f"nn.{t.__name__}" for t in self.supports)
            raise TypeError(f"plan[{name!r}]: {type(self).__name__} supports {names}; "
                            f"{name or 'the root'} is {type(module).__name__}")

    def shards(self, module: nn.Module, n: int) -> dict[str, int]:
        """Parameter name -> the dimension split over the axis (others replicate)."""
        return {}

    def install(self, module: nn.Module, comm: AxisComm, name: str) -> None:
        """Hooks on this device's copy of ``module`` (its parameters are already sliced)."""

    def input_layout(self) -> Layout | None:
        """The layout the style expects of its module's input (None: any)."""
        return None

    def output_layout(self) -> Layout | None:
        """The layout the style gives its module's output (None: as it comes)."""
        return None


def _split_dim(module: nn.Module, pname: str, dim: int, n: int, name: str, what: str) -> None:
    size = getattr(module, pname).shape[dim]
    if size % n:
        raise ValueError(f"plan[{name!r}]: {what} ({size}) does not split over the mesh axis of "
                         f"size {n}")


def _pre(fn: Any) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not args or not isinstance(args[0], torch.Tensor):
            return args
        return (fn(args[0]), *args[1:])
    return hook


def _post(fn: Any) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        return fn(out) if isinstance(out, torch.Tensor) else out
    return hook


def _to(x: torch.Tensor, comm: AxisComm, src: Layout, dst: Layout, what: str,
        consumer_sharded: bool) -> torch.Tensor:
    """``x`` from layout ``src`` to ``dst``. ``consumer_sharded``: what reads the result is
    sharded compute (its gradient is partial on each device: reduced here)."""
    if src == dst:
        if consumer_sharded and isinstance(dst, Replicate):
            return convert(x, comm, "identity", "all_reduce", what=what)
        return x
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        back = "reduce_scatter" if consumer_sharded else "split"
        return convert(x, comm, "all_gather", back, src.dim, what)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return convert(x, comm, "split", "all_gather", dst.dim, what)
    raise ValueError(f"{what}: from {src!r} to {dst!r} needs an all-to-all, which this "
                     "adapter does not do; gather to Replicate() in between")


class _LinearStyle(ParallelStyle):
    """Column- and row-parallel styles: ``input_layouts`` and ``output_layouts`` fields."""

    input_layouts: Any
    output_layouts: Any
    supports = (nn.Linear, nn.Embedding)

    def input_layout(self) -> Layout:
        return _first(self.input_layouts, "input_layouts")

    def output_layout(self) -> Layout:
        return _first(self.output_layouts, "output_layouts")


@dataclass(frozen=True)
class ColwiseParallel(_LinearStyle):
    """Output features split (``nn.Linear``: weight rows and bias; ``nn.Embedding``: the
    embedding dimension). See the module doc for the layouts."""

    input_layouts: Any = Replicate()
    output_layouts: Any = Shard(-1)

    def __post_init__(self) -> None:
        _first(self.input_layouts, "ColwiseParallel.input_layouts")
        out = _first(self.output_layouts, "ColwiseParallel.output_layouts")
        if isinstance(out, Shard) and out.dim != -1:
            raise ValueError("ColwiseParallel.output_layouts: its output is sharded on the last "
                             f"dimension, Shard(-1), or gathered, Replicate(); got {out!r}")

    def shards(self, module: nn.Module, n: int) -> dict[str, int]:
        if isinstance(module, nn.Embedding):
            return {"weight": 1}
        return {"weight": 0, **({"bias": 0} if module.bias is not None else {})}

    def check(self, module: nn.Module, name: str, n: int) -> None:
        super().check(module, name, n)
        if isinstance(module, nn.Embedding):
            _split_dim(module, "weight", 1, n, name, "embedding_dim")
        else:
            _split_dim(module, "weight", 0, n, name, "out_features")

    def install(self, module: nn.Module, comm: AxisComm, name: str) -> None:
        src = _first(self.input_layouts, "input_layouts")
        out = _first(self.output_layouts, "output_layouts")
        if not isinstance(module, nn.Embedding):  # (token ids carry no gradient)
            module.register_forward_pre_hook(_pre(lambda x: comm.shared(
                x, ("colwise input", src),
                lambda: _to(x, comm, src, Replicate(), f"{name} input", True))))
        if isinstance(out, Replicate):
            module.register_forward_hook(_post(
                lambda y: convert(y, comm, "all_gather", "split", -1, f"{name} output")))


@dataclass(frozen=True)
class RowwiseParallel(_LinearStyle):
    """Input features split (``nn.Linear``: weight columns; ``nn.Embedding``: the
    vocabulary); the partial results summed. See the module doc for the layouts."""

    input_layouts: Any = Shard(-1)
    output_layouts: Any = Replicate()

    def __post_init__(self) -> None:
        src = _first(self.input_layouts, "RowwiseParallel.input_layouts")
        _first(self.output_layouts, "RowwiseParallel.output_layouts")
        if isinstance(src, Shard) and src.dim != -1:
            raise ValueError("RowwiseParallel.input_layouts: its input is sharded on the last "
                             f"dimension, Shard(-1), or replicated, Replicate(); got {src!r}")

    def shards(self, module: nn.Module, n: int) -> dict[str, int]:
        return {"weight": 0 if isinstance(module, nn.Embedding) else 1}

    def check(self, module: nn.Module, name: str, n: int) -> None:
        super().check(module, name, n)
        if isinstance(module, nn.Embedding):
            _split_dim(module, "weight", 0, n, name, "num_embeddings")
            if module.max_norm is not None:
                raise ValueError(f"plan[{name!r}]: RowwiseParallel on an nn.Embedding with "
                                 "max_norm (renormalizing rows needs the whole row)")
        else:
            _split_dim(module, "weight", 1, n, name, "in_features")

    def install(self, module: nn.Module, comm: AxisComm, name: str) -> None:
        src = _first(self.input_layouts, "input_layouts")
        out = _first(self.output_layouts, "output_layouts")
        reduce = ("all_reduce", "identity") if isinstance(out, Replicate) else \
            ("reduce_scatter", "all_gather")
        dim = -1 if isinstance(out, Replicate) else out.dim
        if isinstance(module, nn.Embedding):
            _vocab_parallel(module, comm, name, reduce, dim)
            return
        if isinstance(src, Replicate):
            module.register_forward_pre_hook(_pre(
                lambda x: _to(x, comm, Replicate(), Shard(-1), f"{name} input", False)))
        if isinstance(out, Shard) and module.bias is not None and module.bias.requires_grad:
            # Added to this device's sequence block only: its gradient is partial.
            module.bias.register_hook(reduce_grad(comm, f"{name}.bias"))

        def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            # The partial products summed first, the bias added once after the sum.
            y = convert(F.linear(x, self.weight), comm, *reduce, dim, f"{name} output")
            return y if self.bias is None else y + self.bias
        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]


def _vocab_parallel(module: nn.Embedding, comm: AxisComm, name: str,
                    reduce: tuple[str, str], dim: int) -> None:
    """Rows of this device's vocabulary block; other ids read as zero, then summed."""
    rows = module.weight.shape[0]
    lo = comm.index * rows
    # The ids outside the block, from the pre-hook to the hook of the same call (one forward
    # at a time on a device's stream; a slot, not a stack: a forward that raised in between
    # leaves nothing behind for the next one).
    outside: dict[str, torch.Tensor] = {}

    def shift(ids: torch.Tensor) -> torch.Tensor:
        outside["ids"] = mask = (ids < lo) | (ids >= lo + rows)
        return torch.where(mask, torch.zeros_like(ids), ids - lo)

    def finish(y: torch.Tensor) -> torch.Tensor:
        y = y.masked_fill(outside.pop("ids").unsqueeze(-1), 0.0)
        return convert(y, comm, *reduce, dim, f"{name} output")
    module.register_forward_pre_hook(_pre(shift))
    module.register_forward_hook(_post(finish))


_POINTWISE: tuple[type, ...] = (nn.LayerNorm, nn.Dropout, nn.GELU, nn.ReLU, nn.SiLU,
                                nn.Identity, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """A module that acts on each position alone, run on this device's block of the sequence
    dimension; its parameters' gradients are summed over the axis."""

    sequence_dim: int = 1
    supports = _POINTWISE

    def install(self, module: nn.Module, comm: AxisComm, name: str) -> None:
        for pname, p in module.named_parameters():
            if p.requires_grad:
                p.register_hook(reduce_grad(comm, f"{name}.{pname}"))

    def input_layout(self) -> Layout:
        return Shard(self.sequence_dim)

    def output_layout(self) -> Layout:
        return Shard(self.sequence_dim)


@dataclass(frozen=True)
class PrepareModuleInput(ParallelStyle):
    """The module's first positional input from ``input_layouts`` to
    ``desired_input_layouts`` (on the root: also the layout the stage receives)."""

    input_layouts: Any = Replicate()
    desired_input_layouts: Any = Replicate()

    def __post_init__(self) -> None:
        _first(self.input_layouts, "PrepareModuleInput.input_layouts")
        _first(self.desired_input_layouts, "PrepareModuleInput.desired_input_layouts")

    def install(self, module: nn.Module, comm: AxisComm, name: str) -> None:
        src = _first(self.input_layouts, "input_layouts")
        dst = _first(self.desired_input_layouts, "desired_input_layouts")
        if src != dst:
            module.register_forward_pre_hook(_pre(
                lambda x: _to(x, comm, src, dst, f"{name or 'stage'} input", False)))

    def input_layout(self) -> Layout:
        return _first(self.input_layouts, "input_layouts")


@dataclass(frozen=True)
class PrepareModuleOutput(ParallelStyle):
    """The module's output from ``output_layouts`` to ``desired_output_layouts`` (on the root:
    also the layout the stage hands on)."""

    output_layouts: Any = Replicate()
    desired_output_layouts: Any = Replicate()

    def __post_init__(self) -> None:
        _first(self.output_layouts, "PrepareModuleOutput.output_layouts")
        _first(self.desired_output_layouts, "PrepareModuleOutput.desired_output_layouts")

    def install(self, module: nn.Module, comm: AxisComm, name: str) -> None:
        src = _first(self.output_layouts, "output_layouts")
        dst = _first(self.desired_output_layouts, "desired_output_layouts")
        if src != dst:
            module.register_forward_hook(_post(
                lambda y: _to(y, comm, src, dst, f"{name or 'stage'} output", False)))

    def output_layout(self) -> Layout:
        return _first(self.desired_output_layouts, "desired_output_layouts")


@dataclass(frozen=True)
class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module."""

    input_layouts: Any = Replicate()
    desired_input_layouts: Any = Replicate()
    output_layouts: Any = Replicate()
    desired_output_layouts: Any = Replicate()

    def _parts(self) -> tuple[PrepareModuleInput, PrepareModuleOutput]:
        return (PrepareModuleInput(self.input_layouts, self.desired_input_layouts),
                PrepareModuleOutput(self.output_layouts, self.desired_output_layouts))

    def __post_init__(self) -> None:
        self._parts()

    def install(self, module: nn.Module, comm: AxisComm, name: str) -> None:
        for part in self._parts():
            part.install(module, comm, name)

    def input_layout(self) -> Layout:
        return self._parts()[0].input_layout()

    def output_layout(self) -> Layout:
        return self._parts()[1].output_layout()


# ---- parallelize -------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorParallel:
    """What :func:`parallelize` made: a shard module per device of ``mesh`` (in
    ``mesh.device_ids`` order), the axis they split over, the stage's boundary layouts, and
    which parameter of the full module is split along which dimension."""

    module: nn.Module  # the full module given (a template: the shards are trained)
    mesh: DeviceMesh
    axis: str
    modules: tuple[nn.Module, ...]
    comms: tuple[AxisComm, ...] = field(repr=False)
    input_layout: Layout
    output_layout: Layout
    split: Mapping[str, int]  # full parameter name -> split dimension

    @property
    def degree(self) -> int:
        """The tensor-parallel degree: the size of the mesh axis the modules are split over."""
        return self.mesh.axis_sizes[self.axis]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full module's ``state_dict`` from the shards: split parameters concatenated
        along their dimension in axis order (from the first line of the mesh), the others
        from the first device."""
        ids = self.mesh.device_ids
        line = self.comms[0].group
        states = [self.modules[ids.index(d)].state_dict() for d in line]
        out: dict[str, torch.Tensor] = {}
        for key in self.module.state_dict():
            if key in self.split:
                out[key] = torch.cat([s[key].detach() for s in states], self.split[key]).clone()
            else:
                out[key] = states[0][key].detach().clone()
        return out


def parallelize(module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, ParallelStyle], *,
                axis: str | None = None) -> TensorParallel:
    """One shard of ``module`` per device of ``mesh``, split over ``axis`` by ``plan`` (see
    the module doc); every check is made before any shard is built."""
    axis, split, heads, ordered = plan_split(module, mesh, plan, axis)
    n = mesh.axis_sizes[axis]
    in_layout, out_layout = _stage_layouts(plan, ordered)
    modules, comms = [], []
    for d in mesh.device_ids:
        comm = AxisComm(d, axis, axis_line(mesh, d, axis))
        shard = _shard(module, split, comm)
        shard_subs = dict(shard.named_modules())
        for k in ordered:
            plan[k].install(shard_subs[k], comm, k)
        for owner, attr in heads:  # (torchtitan sets these by hand)
            setattr(shard_subs[owner], attr, getattr(shard_subs[owner], attr) // n)
        modules.append(shard)
        comms.append(comm)
    return TensorParallel(module, mesh, axis, tuple(modules), tuple(comms), in_layout,
                          out_layout, split)


def plan_split(module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, ParallelStyle],
               axis: str | None = None
               ) -> tuple[str, dict[str, int], list[tuple[str, str]], list[str]]:
    """Every check :func:`parallelize` makes, and what it found: the axis, which parameter
    of ``module`` is split along which dimension (full names), the head counts to divide
    and the planned submodules in forward order — nothing built."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh: expected a scheduler.DeviceMesh, got {type(mesh).__name__}")
    axis = _check_axis(mesh, axis)
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan: expected a dict of submodule name -> style, got "
                        f"{type(plan).__name__}")
    n = mesh.axis_sizes[axis]
    subs = dict(module.named_modules())
    for name, style in plan.items():
        if not isinstance(name, str):
            raise TypeError(f"plan: keys are submodule names (str), got {name!r}")
        if name not in subs:
            near = [k for k in subs if k and (k.endswith(name) or name.endswith(k))][:3]
            raise ValueError(f"plan[{name!r}]: {type(module).__name__} has no submodule "
                             f"{name!r}" + (f" (did you mean {', '.join(near)}?)" if near else
                                            "; names are those of named_modules()"))
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"plan[{name!r}]: expected a parallel style (ColwiseParallel(), "
                            f"...), got {type(style).__name__}")
        if name == "" and not isinstance(style, _ROOT_STYLES):
            raise ValueError("plan['']: the root takes PrepareModuleInput, PrepareModuleOutput "
                             "or PrepareModuleInputOutput (the stage's boundary layouts)")
        style.check(subs[name], name, n)
    heads = _heads_owners(module, plan)
    for owner, attr in heads:
        count = getattr(subs[owner], attr)
        if count % n:
            raise ValueError(f"plan: {owner or 'the module'}.{attr} = {count} heads do not "
                             f"split over the mesh axis of size {n}")
    ordered = [k for k in subs if k in plan]  # (forward order, as registered)
    split = {f"{k}.{p}" if k else p: dim for k in ordered
             for p, dim in plan[k].shards(subs[k], n).items()}
    return axis, split, heads, ordered


_ROOT_STYLES = (PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)


def _check_axis(mesh: DeviceMesh, axis: str | None) -> str:
    if axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(f"axis: mesh {mesh!r} has axes {mesh.axis_names}; name the one "
                             "tensor parallelism splits over (the others replicate)")
        return mesh.axis_names[0]
    if axis not in mesh.axis_names:
        raise ValueError(f"axis: {axis!r} is not an axis of mesh {mesh!r} "
                         f"(axes {mesh.axis_names})")
    return axis


def _shard(module: nn.Module, split: Mapping[str, int], comm: AxisComm) -> nn.Module:
    """A deep copy of ``module`` whose split parameters are this device's blocks (the full
    tensors are never copied: the copy's memo gets the blocks first)."""
    memo: dict[int, Any] = {}
    params = dict(module.named_parameters())
    for pname, dim in split.items():
        p = params[pname]
        block = p.detach().chunk(comm.size, dim)[comm.index].clone()
        memo[id(p)] = nn.Parameter(block, requires_grad=p.requires_grad)
    shard = copy.deepcopy(module, memo)
    for sub in shard.modules():  # keep the sizes a reader sees true
        if isinstance(sub, nn.Linear):
            sub.out_features, sub.in_features = sub.weight.shape
        elif isinstance(sub, nn.Embedding):
            sub.num_embeddings, sub.embedding_dim = sub.weight.shape
    return shard


HEADS = ("num_heads", "n_heads", "n_head")


def _heads_owners(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> list[tuple[str, str]]:
    colwise = [k for k, s in plan.items() if isinstance(s, ColwiseParallel)]
    found = []
    for name, sub in module.named_modules():
        for attr in HEADS:
            if isinstance(getattr(sub, attr, None), int) and any(
                    k.startswith(f"{name}.") if name else True for k in colwise):
                found.append((name, attr))
    return found


def _stage_layouts(plan: Mapping[str, ParallelStyle], ordered: Sequence[str]
                   ) -> tuple[Layout, Layout]:
    root = plan.get("")
    styles = [plan[k] for k in ordered if k]
    first = root.input_layout() if root is not None else None
    if first is None:
        first = styles[0].input_layout() if styles and isinstance(
            styles[0], SequenceParallel) else Replicate()
    last = root.output_layout() if root is not None else None
    if last is None:
        last = next((lay for lay in (s.output_layout() for s in reversed(styles))
                     if lay is not None), Replicate())
    return first, last


__all__ = ["ColwiseParallel", "Layout", "ParallelStyle", "PrepareModuleInput",
           "PrepareModuleInputOutput", "PrepareModuleOutput", "Replicate", "RowwiseParallel",
           "SequenceParallel", "Shard", "TensorParallel", "parallelize", "spec_of"]
