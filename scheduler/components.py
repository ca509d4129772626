"""Independent host groups of a resharding, and the classes of identical ones.

Two sends interact only through what they share: a device (its stream runs one transfer at
a time), a NIC or a host's NVLink. Sends whose holders and receivers live on disjoint sets
of hosts share none of these, so each such *component* can be planned alone and the plans
put side by side: the cost model times them independently (no shared port, no shared
stream), and so does the paper's sequential model (a host is in one component only).

Regular layouts repeat: at cluster scale a resharding is often hundreds of components that
are the same up to a renaming of hosts (the same send shapes, holders and receivers at the
same local GPU indices, the same local work before them). A *class* is such a set; its
first component is planned and the others get that plan renamed. Planning work then grows
with the number of distinct classes, not with the cluster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .cluster import Cluster
from .plan import Transfer
from .regions import region_shape
from .sends import Pieces, Send


@dataclass(frozen=True)
class Component:
    """Sends (indices into the planner's list) and local work (indices into ``before``) on a
    set of hosts that nothing else touches; ``devices``: every device named, in the order of
    first appearance, which is how two components of one class are matched."""

    sends: tuple[int, ...]
    before: tuple[int, ...]
    devices: tuple[int, ...]


def components(sends: Sequence[Send], before: Sequence[Transfer],
               cluster: Cluster) -> list[Component]:
    """The host-disjoint groups of ``sends`` (with the local work on their hosts), ordered
    by their first send."""
    parent: dict[int, int] = {}

    def find(h: int) -> int:
        root = h
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[h] != root:  # path compression keeps later finds short
            parent[h], h = root, parent[h]
        return root

    def join(devices: Sequence[int]) -> None:
        hosts = {cluster.host_of(d) for d in devices}
        first = find(hosts.pop())
        for h in hosts:
            parent[find(h)] = first

    for s in sends:
        join((*s.holders, *s.receivers))
    for t in before:
        join(t.devices)
    sends_of: dict[int, list[int]] = {}
    for i, s in enumerate(sends):
        sends_of.setdefault(find(cluster.host_of(s.holders[0])), []).append(i)
    before_of: dict[int, list[int]] = {}
    for j, t in enumerate(before):
        before_of.setdefault(find(cluster.host_of(t.sender)), []).append(j)
    out = []
    for root, idx in sends_of.items():
        local = before_of.get(root, [])
        seen = dict.fromkeys(d for i in idx for d in (*sends[i].holders, *sends[i].receivers))
        seen.update(dict.fromkeys(d for j in local for d in before[j].devices))
        out.append(Component(tuple(idx), tuple(local), tuple(seen)))
    return out


def signature(comp: Component, sends: Sequence[Send], before: Sequence[Transfer],
              cluster: Cluster) -> tuple:
    """Equal for two components exactly when one is the other with its hosts renamed: each
    device written as (host in order of first appearance, GPU index on the host)."""
    g = cluster.gpus_per_host
    hosts: dict[int, int] = {}
    for d in comp.devices:
        hosts.setdefault(d // g, len(hosts))

    def local(devs: Sequence[int]) -> tuple[int, ...]:
        return tuple(hosts[d // g] * g + d % g for d in devs)

    return (
        tuple((region_shape(sends[i].region), sends[i].nbytes, local(sends[i].holders),
               local(sends[i].receivers)) for i in comp.sends),
        tuple((region_shape(t.region), t.nbytes, local((t.sender,)), local(t.receivers),
               t.after) for t in _local_work(comp, before)),
    )


def classes(comps: Sequence[Component], sends: Sequence[Send], before: Sequence[Transfer],
            cluster: Cluster) -> list[list[Component]]:
    """``comps`` grouped by :func:`signature`, in order of first appearance."""
    by_sig: dict[tuple, list[Component]] = {}
    for c in comps:
        by_sig.setdefault(signature(c, sends, before, cluster), []).append(c)
    return list(by_sig.values())


def rename(pieces: Pieces, rep: Component, comp: Component,
           sends: Sequence[Send]) -> Pieces:
    """The representative's ``pieces`` for ``comp``: its devices renamed, each piece moved
    to the same place inside ``comp``'s matching send (the sends have equal extents)."""
    devmap = dict(zip(rep.devices, comp.devices))
    sendmap = dict(zip(rep.sends, comp.sends))
    out: Pieces = []
    for i, piece, dev, receivers, after, lane in pieces:
        j = sendmap[i]
        src, dst = sends[i].region, sends[j].region
        moved = tuple((b0 + a - a0, b0 + b - a0)
                      for (a, b), (a0, _), (b0, _) in zip(piece, src, dst))
        out.append((j, moved, devmap[dev], tuple(devmap[r] for r in receivers), after, lane))
    return out


def interleave(parts: Sequence[Pieces]) -> Pieces:
    """One launch order for independent plans: their pieces taken in turn (so every group
    starts at once under a launcher that goes down the list), ``after`` renumbered."""
    order = sorted(((k, c) for c, p in enumerate(parts) for k in range(len(p))))
    position = {key: n for n, key in enumerate(order)}
    return [
        (i, piece, dev, receivers, tuple(position[(a, c)] for a in after), lane)
        for k, c in order
        for i, piece, dev, receivers, after, lane in (parts[c][k],)
    ]


def _local_work(comp: Component, before: Sequence[Transfer]) -> list[Transfer]:
    """``comp``'s local work, its ``after`` renumbered within it (an order on hosts outside
    the component cannot change its timing: they share nothing)."""
    position = {j: k for k, j in enumerate(comp.before)}
    return [dataclasses.replace(before[j], after=tuple(
                position[a] for a in before[j].after if a in position))
            if before[j].after else before[j] for j in comp.before]


def plan_by_class(
    sends: Sequence[Send], before: Sequence[Transfer], cluster: Cluster, budget: int,
    plan_one: Callable[[list[Send], list[Transfer], int], tuple[Pieces, dict]],
) -> tuple[Pieces, dict] | None:
    """Plan each class's first component with ``plan_one(sends, before, budget)`` (a share
    of ``budget`` in proportion to its sends), rename that plan for the class's other
    components, and interleave them all; ``None`` when the sends form one component."""
    comps = components(sends, before, cluster)
    if len(comps) < 2:
        return None
    groups = classes(comps, sends, before, cluster)
    total = sum(len(g[0].sends) for g in groups)
    parts: dict[Component, Pieces] = {}
    choices: dict[str, int] = {}
    for group in groups:
        rep = group[0]
        share = max(1, budget * len(rep.sends) // total)
        local, stats = plan_one([sends[i] for i in rep.sends], _local_work(rep, before), share)
        # plan_one numbers sends 0..n-1 within the component: back to the planner's indices.
        pieces = [(rep.sends[i], *rest) for i, *rest in local]
        for comp in group:
            parts[comp] = pieces if comp is rep else rename(pieces, rep, comp, sends)
        choice = str(stats.get("auto_choice", "?"))
        choices[choice] = choices.get(choice, 0) + len(group)
    merged = interleave([parts[c] for c in comps])
    return merged, {
        "components": len(comps),
        "classes": len(groups),
        "auto_choice": "; ".join(f"{c} ×{n}" for c, n in choices.items()),
    }
