"""A backward split in two that costs one backward: ``I`` (the input's gradient) and ``W``
(the parameters'), for the schedules that run them apart (``zb-h1``, ``zbv``).

The stage's autograd graph, from its output back to its input ``x`` and its parameters, has
two kinds of nodes: those on a path to ``x`` (the *activation path*, which ``I`` must run)
and those that lead only to parameters. A node on the activation path that also feeds
parameters — a linear layer's ``AddmmBackward`` feeds its input, its weight and its bias — is
where the two parts meet. ``I`` runs the activation path with ``torch.autograd.grad(out,
x)``: the engine computes only what ``x`` needs, so such a node skips its weight-gradient
half. A pre-hook on each meeting node keeps the gradient arriving there. ``W`` then starts
the engine at each meeting node with the gradient kept (``torch.autograd.backward`` from a
``GradientEdge``, restricted to that node's parameters): it runs only the weight halves and
accumulates into ``.grad`` through the parameters' own accumulators — their hooks included
(a tensor-parallel parameter's gradient reduction) — exactly as a fused backward would. No
activation gradient is computed twice.

That holds when no parameter is reached from two meeting nodes (a weight used twice in the
stage — tied, or a module called twice): starting at the later node would walk the
activation path down to the earlier one again and count its part twice. Such a stage, and a
stage whose output does not depend on ``x`` (stage 0: ``I`` has nothing to compute), gets
the plain split instead: ``I`` as above, ``W`` one backward from the output restricted to the
parameters (the activation path walked again: correct, slower). So does a torch older than
2.7 (no ``GradientEdge`` in ``torch.autograd.backward``).

Memory: between ``I`` and ``W`` the graph's saved tensors stay (as with any split) and the
gradients kept at the meeting nodes (about one activation per parameterized layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

_EDGES_IN_BACKWARD = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) \
    >= (2, 7)


@dataclass(frozen=True)
class _Kept:
    """A meeting node, the gradients that arrived at it in ``I`` (one per output of its
    forward; None where none came), and the parameters ``W`` computes from it."""

    node: Node
    grads: tuple[torch.Tensor | None, ...]
    params: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class PendingWeights:
    """What ``I`` leaves for ``W``: the kept gradients of the meeting nodes (``kept``), or,
    for the plain split, the output and its gradient (``out``, ``grad``)."""

    params: tuple[torch.Tensor, ...]
    kept: tuple[_Kept, ...] = ()
    out: torch.Tensor | None = None
    grad: torch.Tensor | None = None


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
                   params: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, PendingWeights]:
    """``I``: the gradient of ``x`` (None when ``x`` is None or does not reach ``out``) and
    what :func:`backward_weight` needs for the parameters ``params``."""
    params = tuple(p for p in params if p.requires_grad)
    if not out.requires_grad or x is None:
        return None, PendingWeights(params, out=out, grad=grad)
    root = out.grad_fn
    target = get_gradient_edge(x).node
    path = _activation_path(root, target)
    if not path:  # (x does not reach the output)
        return None, PendingWeights(params, out=out, grad=grad)
    meeting = _meeting_nodes(path, params) if _EDGES_IN_BACKWARD else None
    if meeting is None:  # the plain split (module doc)
        dx, = torch.autograd.grad(out, (x,), grad, retain_graph=True)
        return dx, PendingWeights(params, out=out, grad=grad)
    arrived: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def keeper(node: Node) -> Any:
        def keep(grads: tuple[torch.Tensor | None, ...]) -> None:
            arrived[node] = tuple(grads)
        return keep

    handles = [node.register_prehook(keeper(node)) for node, _ in meeting]
    try:
        dx, = torch.autograd.grad(out, (x,), grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    kept = tuple(_Kept(node, arrived[node], ps) for node, ps in meeting if node in arrived)
    return dx, PendingWeights(params, kept=kept)


def backward_weight(pending: PendingWeights) -> None:
    """``W``: the parameters' gradients, accumulated into their ``.grad``."""
    if pending.out is not None:
        if pending.params and pending.out.requires_grad:
            torch.autograd.backward(pending.out, pending.grad, inputs=list(pending.params))
        return
    for k in pending.kept:
        edges = [GradientEdge(k.node, i) for i, g in enumerate(k.grads) if g is not None]
        if edges:
            torch.autograd.backward(edges, [g for g in k.grads if g is not None],
                                    inputs=list(k.params))


def _activation_path(root: Node | None, target: Node) -> set[Node]:
    """The nodes reachable from ``root`` that lead to ``target`` (``target`` included)."""
    if root is None:
        return set()
    reaches: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node in reaches and not expanded:
            continue
        nexts = [n for n, _ in node.next_functions if n is not None]
        if not expanded:
            if node is target:
                reaches[node] = True
                continue
            reaches.setdefault(node, False)
            stack.append((node, True))
            stack.extend((n, False) for n in nexts if n not in reaches)
            continue
        reaches[node] = any(reaches.get(n, False) for n in nexts)
    return {n for n, r in reaches.items() if r}


def _meeting_nodes(path: set[Node], params: tuple[torch.Tensor, ...]
                   ) -> list[tuple[Node, tuple[torch.Tensor, ...]]] | None:
    """Each node of the activation path with the parameters it leads to off the path, in a
    fixed order (the same on every device of a tensor-parallel stage: ``W``'s collectives
    run in it); None when a parameter is reached from two of them."""
    accumulators = {get_gradient_edge(p).node: p for p in params}
    below: dict[Node, frozenset[Node]] = {}  # off-path node -> the accumulators it leads to

    def params_below(start: Node) -> frozenset[Node]:
        stack: list[tuple[Node, bool]] = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if node in below and not expanded:
                continue
            nexts = [n for n, _ in node.next_functions if n is not None]
            if not expanded:
                stack.append((node, True))
                stack.extend((n, False) for n in nexts if n not in below)
                continue
            found = {node} if node in accumulators else set()
            for n in nexts:
                found |= below[n]
            below[node] = frozenset(found)
        return below[start]

    out: list[tuple[Node, tuple[torch.Tensor, ...]]] = []
    seen: set[Node] = set()
    for node in _ordered(path):
        reached: set[Node] = set()
        for n, _ in node.next_functions:
            if n is not None and n not in path:
                reached |= params_below(n)
        if not reached:
            continue
        if reached & seen:
            return None  # a parameter fed from two meeting nodes: the plain split
        seen |= reached
        out.append((node, tuple(accumulators[a] for a in _sorted_like(reached, params,
                                                                      accumulators))))
    return out


def _ordered(path: set[Node]) -> list[Node]:
    """The path's nodes by their sequence numbers, latest first (the order a backward
    reaches them in; the same on every device that built the same graph)."""
    return sorted(path, key=lambda n: -n._sequence_nr())


def _sorted_like(reached: set[Node], params: tuple[torch.Tensor, ...],
                 accumulators: dict[Node, torch.Tensor]) -> list[Node]:
    order = {id(p): i for i, p in enumerate(params)}
    return sorted(reached, key=lambda a: order[id(accumulators[a])])


__all__ = ["PendingWeights", "backward_input", "backward_weight"]
