"""The candidate plans of a whole-state resharding, as one launch order of transfers each.

:func:`~scheduler.state_reshard.plan_state_resharding` builds several candidates and keeps
the one the cost model times fastest. Each candidate here is a list of *entries* ``(tensor
number, transfer)`` in launch order, ``after`` naming earlier entries of the same tensor:

- :func:`joint_entries`: every tensor's unit tasks and decomposition, then ONE balancing
  over the union of their sends (a NIC one tensor loads is avoided by the next);
- :func:`concatenated`: every tensor's own :func:`~scheduler.planner.plan_resharding`
  plan (:func:`per_tensor_plans`), one after another in the state's order. So the kept plan
  is never slower, under the cost model, than that concatenation bucketed the same way;
- :func:`interleaved`: the same plans, those of tensors on different source hosts side by
  side (a pipeline's stages send at once);
- :func:`paced_entries`: the joint decomposition, each tensor's sends in *rounds* (no device
  twice in a round), whole tensors spread over the lanes by load, each lane's rounds rotated
  so that the lanes reach different devices at once, and long chains of a replicated
  destination cut per host (entering each host through a different GPU).

(:func:`per_tensor_plans` plans each distinct tensor at the full budget: the per-tensor
candidates are built only when ``StateOptions.per_tensor`` asks for them.)

Identical tensors are planned once (:func:`tensor_classes`): two tensors of the same shape,
dtype, specs and mesh shapes whose devices are the same up to a renaming of hosts (each
device written as its host's rank of first appearance and its GPU index on the host) have
unit tasks, decomposition and bound that are the same up to that renaming, and a plan of
one, renamed, is a plan of the other of the same cost: the cost model sees hosts, NICs and
GPUs only through which are equal.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from .balance import MAX_LANES, _by_size, _Ports, balance_sends
from .cluster import Cluster
from .cost import CostModel
from .plan import Transfer
from .planner import PlanOptions, _decompose, plan_resharding
from .regions import volume
from .sends import Send
from .tasks import UnitTask, unit_tasks

Entry = tuple[int, Transfer]  # (tensor number in the state's order, transfer)


def _signature(t: Any, cluster: Cluster) -> tuple[tuple, tuple[int, ...]]:
    """(what must be equal, the devices in the order the renaming pairs them)."""
    devices = (*t.src.mesh.device_ids, *t.dst.mesh.device_ids)
    g = cluster.gpus_per_host
    hosts: dict[int, int] = {}
    for d in devices:
        hosts.setdefault(d // g, len(hosts))
    local = tuple(hosts[d // g] * g + d % g for d in devices)
    key = (t.shape, t.dtype, t.src.spec, t.dst.spec, t.src.mesh.axis_names,
           t.dst.mesh.axis_names, t.src.mesh.devices.shape, t.dst.mesh.devices.shape, local)
    return key, devices


def tensor_classes(tensors: Sequence[Any], cluster: Cluster
                   ) -> list[tuple[int, list[tuple[int, dict[int, int]]]]]:
    """The tensors (``shape``, ``dtype``, ``src``, ``dst``) grouped into classes of identical
    ones: ``(representative, [(member, device map from the representative's devices to the
    member's)])``, members in the state's order, the representative first with the identity."""
    by_key: dict[tuple, tuple[int, tuple[int, ...], list]] = {}
    for k, t in enumerate(tensors):
        key, devices = _signature(t, cluster)
        entry = by_key.get(key)
        if entry is None:
            by_key[key] = (k, devices, [(k, {d: d for d in devices})])
        else:
            entry[2].append((k, dict(zip(entry[1], devices))))
    return [(rep, members) for rep, _, members in by_key.values()]


def renamed(transfers: Sequence[Transfer], devmap: Mapping[int, int]) -> list[Transfer]:
    """``transfers`` with every device renamed by ``devmap`` (regions and order kept)."""
    return [Transfer(t.region, devmap[t.sender], tuple(devmap[r] for r in t.receivers),
                     t.nbytes, t.after, t.lane) for t in transfers]


def renamed_tasks(tasks: Sequence[UnitTask], devmap: Mapping[int, int]) -> list[UnitTask]:
    """Unit tasks of a member of a class, from its representative's."""
    return [UnitTask(t.region, t.nbytes, tuple(devmap[d] for d in t.holders),
                     tuple(devmap[d] for d in t.needers)) for t in tasks]


def state_tasks(tensors: Sequence[Any], classes: Sequence, cluster: Cluster
                ) -> list[list[UnitTask]]:
    """Every tensor's unit tasks, computed once per class and renamed for the others."""
    out: list[list[UnitTask]] = [[] for _ in tensors]
    for rep, members in classes:
        t = tensors[rep]
        tasks = unit_tasks(t.shape, t.dtype, t.src, t.dst, cluster)
        for k, devmap in members:
            out[k] = tasks if k == rep else renamed_tasks(tasks, devmap)
    return out


def per_tensor_plans(tensors: Sequence[Any], classes: Sequence, cluster: Cluster,
                     options: PlanOptions) -> list[list[Transfer]]:
    """Each tensor's transfers as :func:`plan_resharding` plans it alone with ``options``
    (the same plan a caller gets for that tensor): each class's representative planned,
    the other members renamed."""
    single = PlanOptions(options.strategy, options.balance, options.seed, options.budget)
    plans: list[list[Transfer]] = [[] for _ in tensors]
    for rep, members in classes:
        t = tensors[rep]
        plan = plan_resharding(t.shape, t.dtype, t.src, t.dst, cluster, single)
        for k, devmap in members:
            plans[k] = list(plan.transfers) if k == rep else renamed(plan.transfers, devmap)
    return plans


def concatenated(plans: Sequence[Sequence[Transfer]]) -> list[Entry]:
    """The plans one after another in the state's order (``after`` shifted to entries)."""
    return _entries([(k, i) for k, p in enumerate(plans) for i in range(len(p))], plans)


def interleaved(plans: Sequence[Sequence[Transfer]], tensors: Sequence[Any],
                cluster: Cluster) -> list[Entry]:
    """The plans of tensors whose sources share no host side by side: tensors grouped by
    the hosts of their source mesh (a pipeline stage, say), each group's plans concatenated,
    and the groups merged fairly — each transfer placed by the fraction of its group's bytes
    done when it ends — so every group moves at the same relative pace and all finish
    together, instead of one source group sending while the others wait their turn."""
    g = cluster.gpus_per_host
    groups: dict[frozenset[int], list[int]] = {}
    for k, t in enumerate(tensors):
        groups.setdefault(frozenset(d // g for d in t.src.mesh.device_ids), []).append(k)
    keyed: list[tuple[float, int, int, int]] = []
    for n, members in enumerate(groups.values()):
        seq = [(k, i) for k in members for i in range(len(plans[k]))]
        total = sum(plans[k][i].nbytes for k, i in seq)
        done = 0
        for pos, (k, i) in enumerate(seq):
            done += plans[k][i].nbytes
            frac = done / total if total else (pos + 1) / len(seq)
            keyed.append((frac, n, k, i))
    keyed.sort()
    return _entries([(k, i) for _, _, k, i in keyed], plans)


def _entries(order: Sequence[tuple[int, int]], plans: Sequence[Sequence[Transfer]]
             ) -> list[Entry]:
    """(tensor, index in its plan) in launch order as entries, ``after`` renumbered."""
    position = {key: n for n, key in enumerate(order)}
    out: list[Entry] = []
    for k, i in order:
        t = plans[k][i]
        out.append((k, Transfer(t.region, t.sender, t.receivers, t.nbytes,
                                tuple(position[(k, a)] for a in t.after), t.lane)))
    return out


def joint_entries(task_lists: Sequence[Sequence[UnitTask]], itemsizes: Sequence[int],
                  cluster: Cluster, options: PlanOptions) -> tuple[list[Entry], dict]:
    """Every tensor's decomposition, then one balancing over all their sends, after all
    their local work; the all-gather forwards of ``local_allgather`` last."""
    parts = [_decompose(tasks, itemsize, cluster, options.strategy)
             for tasks, itemsize in zip(task_lists, itemsizes)]
    owner_of_send: list[int] = []
    sends, before = [], []
    entries: list[Entry] = []
    for k, p in enumerate(parts):
        owner_of_send += [k] * len(p.sends)
        sends += p.sends
        before += p.before
        entries += [(k, t) for t in p.before]
    ordered, stats = balance_sends(sends, cluster, options.balance, seed=options.seed,
                                   budget=options.budget, before=before, groups=owner_of_send)
    offset = len(entries)
    brought: dict[int, list[int]] = {}  # global send index -> the entries that carry it
    for j, (idx, region, sender, receivers, after, lane) in enumerate(ordered):
        k = owner_of_send[idx]
        entries.append((k, Transfer(region, sender, receivers, volume(region) * itemsizes[k],
                                    tuple(offset + a for a in after), lane)))
        brought.setdefault(idx, []).append(offset + j)
    first_send = 0
    for k, p in enumerate(parts):
        for idx, region, local in p.after:
            owner = p.sends[idx].receivers[0]
            entries.append((k, Transfer(region, owner, local, volume(region) * itemsizes[k],
                                        tuple(brought.get(first_send + idx, ())))))
        first_send += len(p.sends)
    return entries, stats


def _per_host_chains(send: Send, cluster: Cluster, turn: int) -> list[Send] | None:
    """``send`` cut into one chain per receiving host when its chain is long (several
    receivers on each of several hosts: NVLink hops after each network hop) and its holders
    have several NICs to send the chains from; each host's receivers rotated by ``turn`` so
    that the host's entry GPU (whose NIC takes the bytes in) differs from send to send.
    ``None`` when it stays one chain."""
    by_host: dict[int, list[int]] = {}
    for r in send.receivers:
        by_host.setdefault(cluster.host_of(r), []).append(r)
    if (len(by_host) < 2 or len(send.receivers) == len(by_host)
            or len({cluster.nic_of(h) for h in send.holders}) < 2):
        return None
    out = []
    for n, rs in enumerate(by_host.values()):
        k = (turn + n) % len(rs)
        out.append(Send(send.region, send.nbytes, send.holders, tuple(rs[k:] + rs[:k])))
    return out


def _rounds(transfers: Sequence[Transfer]) -> list[int]:
    """Each transfer's round, first fit: the first round in which none of its devices is
    busy (a round is a set of transfers that share no device: they can all run at once)."""
    used: dict[int, int] = defaultdict(int)  # device -> bit set of its rounds
    out = []
    for t in transfers:
        busy = 0
        for d in t.devices:
            busy |= used[d]
        r = (~busy & (busy + 1)).bit_length() - 1  # the lowest free round
        for d in t.devices:
            used[d] |= 1 << r
        out.append(r)
    return out


def paced_entries(task_lists: Sequence[Sequence[UnitTask]], itemsizes: Sequence[int],
                  cluster: Cluster, options: PlanOptions) -> tuple[list[Entry], dict]:
    """The joint decomposition (long chains to a replicated destination cut per host), each
    send from its holder whose NIC has sent least (largest first), then paced over the
    lanes, in time linear in the sends but for the rounds:

    1. each tensor's transfers in rounds (:func:`_rounds`);
    2. tensors, heaviest first (alone time), each whole on the lane (of
       :data:`~scheduler.balance.MAX_LANES`) whose busiest device of the tensor has least
       time on it so far;
    3. on each lane, each tensor's rounds rotated by ``lane × rounds / lanes`` (plus a third
       of its rounds per tensor before it on the lane): the lanes' transfers of the same
       moment reach different devices, where the same first round on every lane would load
       the same receivers and leave the others idle;
    4. one launch order: every transfer at its estimated start (the time its devices'
       lane has so far), so that the lanes advance together.
    """
    model = CostModel(cluster)
    parts = [_decompose(tasks, itemsize, cluster, options.strategy)
             for tasks, itemsize in zip(task_lists, itemsizes)]
    entries: list[Entry] = [(k, t) for k, p in enumerate(parts) for t in p.before]
    sends, owner, origin = _cut_chains(parts, cluster)
    ports = _Ports(sends, cluster, {})
    by_tensor: dict[int, list[tuple[int, Transfer]]] = {}
    for i, region, sender in _by_size(sends, ports):
        k = owner[i]
        by_tensor.setdefault(k, []).append(
            (origin[i], Transfer(region, sender, sends[i].receivers,
                                 volume(region) * itemsizes[k])))
    units = []
    for k, items in by_tensor.items():
        rounds = _rounds([t for _, t in items])
        order = sorted(range(len(items)), key=lambda n: (rounds[n], n))
        alone = [model.alone_time(items[n][1]) for n in order]
        units.append((sum(alone), k, [(rounds[n], *items[n]) for n in order], alone,
                      max(rounds) + 1))
    on_lane = _on_lanes(_stage_turns(units, cluster))
    offset = len(entries)
    brought: dict[int, list[int]] = {}
    for j, (_, _, k, idx, t) in enumerate(_paced(on_lane)):
        entries.append((k, t))
        brought.setdefault(idx, []).append(offset + j)
    first = 0
    for k, p in enumerate(parts):
        for idx, region, local in p.after:
            owner_dev = p.sends[idx].receivers[0]
            entries.append((k, Transfer(region, owner_dev, local,
                                        volume(region) * itemsizes[k],
                                        tuple(brought.get(first + idx, ())))))
        first += len(p.sends)
    return entries, {"paced_lanes": len(on_lane)}


def _cut_chains(parts: Sequence[Any], cluster: Cluster
                ) -> tuple[list[Send], list[int], list[int]]:
    """Every tensor's sends, long chains to a replicated destination cut per host
    (:func:`_per_host_chains`, each cut entering its hosts at the next turn); with each
    send's tensor and the decomposition's send (numbered across tensors) it came from."""
    sends: list[Send] = []
    owner: list[int] = []
    origin: list[int] = []
    first = 0
    turn = 0
    for k, p in enumerate(parts):
        for i, s in enumerate(p.sends):
            split = _per_host_chains(s, cluster, turn)
            if split is not None:
                turn += 1
            for piece in split or [s]:
                sends.append(piece)
                owner.append(k)
                origin.append(first + i)
        first += len(p.sends)
    return sends, owner, origin


def _stage_turns(units: list[Any], cluster: Cluster) -> list[Any]:
    """Heaviest first (the lanes balanced as in LPT scheduling), but tensors of about the
    same weight (within 10 %) taken one per source group (the hosts they are sent from: a
    pipeline stage) in turn — else the lanes would all take one stage's equal tensors at
    once, and that stage's NICs would feed every lane while the other stages wait."""
    units = sorted(units, key=lambda u: (-u[0], u[1]))
    ordered: list[Any] = []
    start = 0
    while start < len(units):
        end = start
        while end < len(units) and units[end][0] >= 0.9 * units[start][0]:
            end += 1
        turn: dict[frozenset[int], int] = {}
        first_seen: dict[frozenset[int], int] = {}
        ranked = []
        for unit in units[start:end]:
            hosts = frozenset(cluster.host_of(t.sender) for _, _, t in unit[2])
            first_seen.setdefault(hosts, len(first_seen))
            turn[hosts] = turn.get(hosts, -1) + 1
            ranked.append((turn[hosts], first_seen[hosts], unit[1], unit))
        ordered += [u for *_, u in sorted(ranked, key=lambda r: r[:3])]
        start = end
    return ordered


def _on_lanes(units: list[Any]) -> dict[int, list[Any]]:
    """Each tensor whole on the lane whose busiest device of the tensor has least time on
    it so far, in the order given."""
    lanes = MAX_LANES if units else 1
    load: dict[tuple[int, int], float] = defaultdict(float)
    on_lane: dict[int, list[Any]] = defaultdict(list)
    for unit in units:
        devices = {d for _, _, t in unit[2] for d in t.devices}
        lane = min(range(lanes), key=lambda n: (max(load[(d, n)] for d in devices), n))
        for (_, _, t), x in zip(unit[2], unit[3]):
            for d in t.devices:
                load[(d, lane)] += x
        on_lane[lane].append(unit)
    return on_lane


def _paced(on_lane: dict[int, list[Any]]) -> list[tuple[float, int, int, int, Transfer]]:
    """One launch order: on each lane each tensor's rounds rotated (see
    :func:`paced_entries`), every transfer at its estimated start (the time its devices'
    lane has so far), so that the lanes advance together; (start, n, tensor, send, transfer
    on its lane)."""
    lanes = MAX_LANES if on_lane else 1
    clock: dict[tuple[int, int], float] = defaultdict(float)
    keyed: list[tuple[float, int, int, int, Transfer]] = []
    for lane in sorted(on_lane):
        for n_unit, (_, k, items, alone, count) in enumerate(on_lane[lane]):
            shift = (lane * count // lanes + n_unit * count // 3) % count
            order = sorted(range(len(items)), key=lambda n: ((items[n][0] - shift) % count, n))
            for n in order:
                _, idx, t = items[n]
                begin = max(clock[(d, lane)] for d in t.devices)
                for d in t.devices:
                    clock[(d, lane)] = begin + alone[n]
                keyed.append((begin, len(keyed), k, idx,
                              Transfer(t.region, t.sender, t.receivers, t.nbytes, (), lane)))
    keyed.sort(key=lambda e: e[:2])
    return keyed


def plans_of(entries: Sequence[Entry], count: int) -> tuple[list[list[Transfer]], list[int]]:
    """Entries split per tensor (``after`` within the tensor; across tensors it is dropped:
    the buckets' per-device order stands in) and each entry's index in its tensor's list."""
    local_index: list[int] = []
    seen = [0] * count
    for k, _ in entries:
        local_index.append(seen[k])
        seen[k] += 1
    per_tensor: list[list[Transfer]] = [[] for _ in range(count)]
    for k, t in entries:
        after = tuple(local_index[a] for a in t.after if entries[a][0] == k)
        per_tensor[k].append(Transfer(t.region, t.sender, t.receivers, t.nbytes, after, t.lane))
    return per_tensor, local_index


__all__ = ["concatenated", "interleaved", "joint_entries", "paced_entries", "per_tensor_plans",
           "plans_of", "renamed", "state_tasks", "tensor_classes"]
