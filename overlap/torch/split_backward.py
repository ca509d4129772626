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
activation gradient is computed twice. Parameters whose gradient is a mere reduction (1-d:
a norm's scale and shift, a lone bias) are finished in ``I`` itself: keeping their meeting
node's gradient would cost memory and a call of the engine in ``W`` for almost no work.

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
    """Meeting nodes none of which is below another on the activation path (one call of
    the engine in ``W`` serves them all), each with the gradients that arrived at it in
    ``I`` (one per output of its forward; None where none came), and the parameters ``W``
    computes from them."""

    nodes: tuple[tuple[Node, tuple[torch.Tensor | None, ...]], ...]
    params: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class PendingWeights:
    """What ``I`` leaves for ``W``: the kept gradients of the meeting nodes (``kept``), or,
    for the plain split, the output and its gradient (``out``, ``grad``)."""

    params: tuple[torch.Tensor, ...]
    kept: tuple[_Kept, ...] = ()
    out: torch.Tensor | tuple[torch.Tensor, ...] | None = None
    grad: torch.Tensor | tuple[torch.Tensor | None, ...] | None = None


class Weights:
    """Parameters and their gradient accumulators (the graph's leaves for them), found once
    for the many backwards of one module; :meth:`of` makes them anew when the module's
    parameters changed."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = tuple(p for p in params if p.requires_grad)
        self.key = _key(params)
        self.accumulators = {get_gradient_edge(p).node: p for p in self.params}

    @classmethod
    def of(cls, params: Sequence[torch.Tensor], known: Weights | None) -> Weights:
        """``known`` if it is of these very parameters, else new ones."""
        params = tuple(params)
        return known if known is not None and known.key == _key(params) else cls(params)


def _key(params: Sequence[torch.Tensor]) -> tuple[tuple[int, bool], ...]:
    return tuple((id(p), p.requires_grad) for p in params)


def stage_backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
                   params: Sequence[torch.Tensor] | Weights
                   ) -> tuple[torch.Tensor | None, PendingWeights]:
    """``I``: the gradient of ``x`` (None when ``x`` is None or does not reach ``out``) and
    what :func:`stage_backward_weight` needs for the parameters ``params`` (or :class:`Weights`,
    to find their accumulators once for many backwards)."""
    weights = params if isinstance(params, Weights) else Weights(params)
    params = weights.params
    if not out.requires_grad or x is None:
        return None, PendingWeights(params, out=out, grad=grad)
    reached, found = _meeting_nodes(out.grad_fn, get_gradient_edge(x).node, weights)
    if not reached:  # (x does not reach the output: nothing for I to compute)
        return None, PendingWeights(params, out=out, grad=grad)
    if found is None or not _EDGES_IN_BACKWARD:  # the plain split (module doc)
        dx, = torch.autograd.grad(out, (x,), grad, retain_graph=True)
        return dx, PendingWeights(params, out=out, grad=grad)
    groups, now = found
    arrived: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def keeper(node: Node) -> Any:
        def keep(grads: tuple[torch.Tensor | None, ...]) -> None:
            arrived[node] = tuple(grads)
        return keep

    handles = [node.register_prehook(keeper(node)) for group in groups for node, _ in group]
    try:
        # The cheap parameters' gradients (``now``) are accumulated here, the input's
        # into x.grad (x is the stage's own leaf).
        torch.autograd.backward(out, grad, retain_graph=True, inputs=[x, *now])
    finally:
        for h in handles:
            h.remove()
    kept = tuple(_Kept(tuple((node, arrived[node]) for node, _ in group if node in arrived),
                       tuple(p for _, ps in group for p in ps)) for group in groups)
    return x.grad, PendingWeights(params, kept=kept)


def plain_split_input(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                      xs: Sequence[torch.Tensor], params: Sequence[torch.Tensor] | Weights
                      ) -> PendingWeights:
    """``I`` of a stage with several outputs or inputs (tensors of a tuple boundary): the
    floating-point inputs' gradients, into their ``.grad`` (one walk, the graph kept), and
    for ``W`` the outputs and their gradients (a second walk, to the parameters)."""
    weights = params if isinstance(params, Weights) else Weights(params)
    wanted = [x for x in xs if x.requires_grad]
    if outs and wanted:
        dxs = torch.autograd.grad(list(outs), wanted, list(grads), retain_graph=True,
                                  allow_unused=True)
        for x, dx in zip(wanted, dxs):
            if dx is not None:
                x.grad = dx
    return PendingWeights(weights.params, out=tuple(outs), grad=tuple(grads))


def stage_backward_weight(pending: PendingWeights) -> None:
    """``W``: the parameters' gradients, accumulated into their ``.grad``."""
    if pending.out is not None:
        outs = pending.out if isinstance(pending.out, tuple) else (pending.out,)
        grads = pending.grad if isinstance(pending.out, tuple) else (pending.grad,)
        live = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]  # type: ignore[arg-type]
        if pending.params and live:
            torch.autograd.backward([o for o, _ in live], [g for _, g in live],
                                    inputs=list(pending.params))
        return
    for k in pending.kept:
        edges = [(GradientEdge(node, i), g) for node, grads in k.nodes
                 for i, g in enumerate(grads) if g is not None]
        if edges:
            torch.autograd.backward([e for e, _ in edges], [g for _, g in edges],
                                    inputs=list(k.params))


_Group = list[tuple[Node, tuple[torch.Tensor, ...]]]
_Found = tuple[list[_Group], list[torch.Tensor]]


def _meeting_nodes(root: Node | None, target: Node, weights: Weights
                   ) -> tuple[bool, _Found | None]:
    """One pass over the graph below ``root``: the nodes on a path to ``target`` (the
    activation path) that lead, off it, to parameters whose gradient is a product (2-d and
    up: a matmul's or a convolution's), each with those parameters — ``W``'s work — in
    groups of nodes none of which is below another on the path (q, k and v's projections:
    one call of the engine serves a group), in a fixed order (the same on every device
    that built the same graph: ``W``'s collectives, a tensor-parallel bias's reduction, run
    in it); and the parameters ``I`` can finish itself (those reached from meeting nodes
    that lead to no product: norms, biases alone; their gradient is a reduction as cheap as
    keeping what it needs). First: whether ``target`` is reached at all; second None where
    a parameter is reached from two meeting nodes."""
    if root is None:
        return False, None
    accumulators, params = weights.accumulators, weights.params
    nexts: dict[Node, list[Node]] = {}
    on_path: dict[Node, bool] = {}
    below: dict[Node, frozenset[Node]] = {}  # off the path: the accumulators it leads to
    reached: dict[Node, frozenset[Node]] = {}  # a meeting node: what it leads to off the path
    bit: dict[Node, int] = {}  # a meeting node's own bit
    under: dict[Node, int] = {}  # on the path: the bits of the meeting nodes below it
    order: list[Node] = []  # the path's nodes, post-order
    stack: list[Node] = [root]
    while stack:
        node = stack[-1]
        if node not in nexts:
            nexts[node] = [n for n, _ in node.next_functions if n is not None]
            stack.extend(n for n in nexts[node] if n not in nexts)
            continue
        stack.pop()
        if node in on_path:
            continue
        children = nexts[node]
        if node is target or any(on_path.get(n, False) for n in children):
            on_path[node] = True
            order.append(node)
            found: set[Node] = set()
            mask = 0
            for n in children:
                if on_path[n]:
                    mask |= under[n] | bit.get(n, 0)
                else:
                    found.update(below[n])
            under[node] = mask
            if found:
                reached[node] = frozenset(found)
                bit[node] = 1 << len(bit)
        else:
            on_path[node] = False
            found = {node} if node in accumulators else set()
            for n in children:
                found.update(below.get(n, ()))
            below[node] = frozenset(found)
    if not on_path.get(root, False):
        return False, None
    groups: list[_Group] = []
    now: list[torch.Tensor] = []
    seen: set[Node] = set()
    rank = {id(p): i for i, p in enumerate(params)}
    group: _Group = []
    group_under = 0
    for node in reversed(order):  # (topological: a node before every node below it)
        if node not in reached:
            continue
        if reached[node] & seen:
            return True, None  # a parameter fed from two meeting nodes: the plain split
        seen.update(reached[node])
        ps = sorted((accumulators[a] for a in reached[node]), key=lambda p: rank[id(p)])
        if not any(p.dim() >= 2 for p in ps):
            now.extend(ps)
            continue
        if group and group_under & bit[node]:  # (below one of the group: a group of its own)
            groups.append(group)
            group, group_under = [], 0
        group.append((node, tuple(ps)))
        group_under |= under[node]
    if group:
        groups.append(group)
    return True, (groups, now)


__all__ = ["PendingWeights", "Weights", "plain_split_input", "stage_backward_input",
           "stage_backward_weight"]
