"""What one stage hands the next: one tensor, or a tuple or a flat dict of them.

A stage module may return a tensor (the next stage is called ``module(x)``), a tuple or
list (``module(*values)``: a Hugging Face-style decoder layer's hidden states and position
ids) or a dict with string keys (``module(**values)``). Each tensor of a tuple or dict is a
boundary of its own — its own layout, resharding plan and channel; a gradient crosses back
for each floating-point one (an integer tensor — positions, a mask — has none). Any other
value (None, a number, a string, ...) is not moved: it is passed through to the next
stage as it was when the pipeline first ran the stage on a microbatch of that shape, and
must be the same on every microbatch (checked: a value that changes raises naming it).

The last stage returns one tensor (``loss_fn`` reads it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

Kind = Literal["tensor", "tuple", "dict"]


@dataclass(frozen=True)
class Crossing:
    """The structure of a stage's output: ``kind``, its entries' ``keys`` (positions of a
    tuple, names of a dict), and which are ``constants`` (key -> the value passed through);
    the others are tensors, each crossing on its own."""

    kind: Kind
    keys: tuple[Any, ...] = (0,)
    constants: tuple[tuple[Any, Any], ...] = ()

    @classmethod
    def of(cls, value: object, what: str) -> Crossing:
        """The structure of ``value``, a stage's output (``what`` names it in errors)."""
        if isinstance(value, torch.Tensor):
            return cls("tensor")
        if isinstance(value, (tuple, list)):
            items: Sequence[tuple[Any, Any]] = list(enumerate(value))
            kind: Kind = "tuple"
        elif isinstance(value, Mapping):
            bad = [k for k in value if not isinstance(k, str)]
            if bad:
                raise TypeError(f"{what}: returned a dict with key {bad[0]!r}; its keys name the "
                                "next stage's keyword arguments (strings)")
            items, kind = list(value.items()), "dict"
        else:
            raise TypeError(f"{what}: returned {type(value).__name__}; a stage returns a tensor, "
                            "or a tuple or dict of them")
        tensors = [k for k, v in items if isinstance(v, torch.Tensor)]
        if not tensors:
            raise TypeError(f"{what}: returned a {kind} without a tensor; at least one tensor "
                            "must cross to the next stage")
        nested = [k for k, v in items if isinstance(v, (tuple, list, Mapping))]
        if nested:
            raise TypeError(f"{what}: entry {nested[0]!r} is a "
                            f"{type(dict(items)[nested[0]]).__name__}; a stage's tuple or "
                            "dict holds tensors (and values passed through), not nested ones")
        return cls(kind, tuple(k for k, _ in items),
                   tuple((k, v) for k, v in items if not isinstance(v, torch.Tensor)))

    @property
    def grouped(self) -> bool:
        """Whether it crosses as a tuple of boundaries (a tuple or dict), not one tensor."""
        return self.kind != "tensor"

    @property
    def tensor_keys(self) -> tuple[Any, ...]:
        """The keys of its tensors, in order: element e of the boundary is ``tensor_keys[e]``."""
        fixed = dict(self.constants)
        return tuple(k for k in self.keys if k not in fixed)

    def tensors(self, value: Any, what: str) -> list[torch.Tensor]:
        """``value``'s tensors, in element order, checked against this structure."""
        if not self.grouped:
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{what}: returned {type(value).__name__}, where it returned a "
                                "tensor before")
            return [value]
        now = Crossing.of(value, what)
        if now.keys != self.keys or now.kind != self.kind:
            raise ValueError(f"{what}: returned a {now.kind} with entries {list(now.keys)}, "
                             f"where it returned a {self.kind} with {list(self.keys)} before")
        entries = value if isinstance(value, Mapping) else dict(enumerate(value))
        for k, v in self.constants:
            now = entries[k]
            if isinstance(now, torch.Tensor) or not _same(now, v):
                raise ValueError(f"{what}: entry {k!r} is {_show(now)}, where it was {_show(v)} "
                                 "before; a value that is not a tensor is passed through as it "
                                 "was, and must be the same on every microbatch (return it as "
                                 "a tensor to send it)")
        out = []
        for k in self.tensor_keys:
            if not isinstance(entries[k], torch.Tensor):
                raise TypeError(f"{what}: entry {k!r} is {_show(entries[k])}, where it was a "
                                "tensor before")
            out.append(entries[k])
        return out

    def call(self, module: nn.Module, tensors: Sequence[torch.Tensor]) -> Any:
        """``module`` on the tensors that crossed, with the constants put back."""
        if not self.grouped:
            return module(tensors[0])
        entries = dict(self.constants)
        entries.update(zip(self.tensor_keys, tensors))
        if self.kind == "dict":
            return module(**{k: entries[k] for k in self.keys})
        return module(*(entries[k] for k in self.keys))


def _same(a: object, b: object) -> bool:
    """Whether a value passed through is the one first seen (NaN equals NaN; a comparison
    that cannot say — arrays — is not equal unless it is the same object)."""
    if a is b:
        return True
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _show(v: object) -> str:
    return "a tensor" if isinstance(v, torch.Tensor) else repr(v)[:60]


__all__ = ["Crossing"]
