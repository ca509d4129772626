"""The project's one cost model (α–β with shared links) and the physical lower bound.

Resources. Each NIC has an egress and an ingress port of ``nic_gbps``; each GPU an NVLink
egress and ingress port of ``nvlink_gbps``; each GPU's memory serves local copies at the NVLink
rate without contending with NVLink.

A transfer is a chain (NCCL's pipelined ring/chain broadcast): the sender, then its receivers
on the sender's host over NVLink, then host by host in the order the receivers are listed — one
network hop into each host (out of the previous device's NIC, into the next device's NIC), then
NVLink hops inside it. A point-to-point copy is a one-hop chain. Its time alone is
``Σ hop latency + bytes / bottleneck bandwidth + Σ chunk / hop bandwidth − chunk / bottleneck``
(the pipeline fill: the last chunk still crosses the other hops).

Concurrency follows the runtime: every device has one communication stream, so a device takes
part in one transfer at a time, in plan order, and a transfer starts when all its devices are
done with their earlier transfers. Transfers that run at the same time share every port they
both use, max-min fairly (progressive filling), recomputed whenever a transfer starts or ends.
The same code costs a plan here and the comm streams in the pipeline simulator.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from .cluster import Cluster

if TYPE_CHECKING:
    from .plan import ReshardPlan, Transfer
    from .sharding import Sharding

# A pipelined chain forwards data in chunks; NCCL's default staging buffer is 4 MiB split into
# 8 steps, so a hop forwards 512 KiB at a time (Simple protocol).
DEFAULT_CHUNK_BYTES = 512 << 10

# Port kinds: (kind, index) keys of the resource table.
NIC_OUT, NIC_IN, GPU_OUT, GPU_IN, GPU_MEM = "nic_out", "nic_in", "gpu_out", "gpu_in", "mem"


@dataclass(frozen=True)
class Hop:
    src: int
    dst: int
    network: bool


@dataclass(frozen=True)
class TransferCost:
    """What one transfer needs from the cluster."""

    ports: tuple[tuple[str, int], ...]
    fixed_s: float  # latency and pipeline-fill terms, paid once
    nbytes: int
    alone_bw: float  # bottleneck bandwidth when nothing else runs (bytes/s)


class TransferTiming(NamedTuple):
    start: float
    end: float


class CostModel:
    """Costs transfers on a :class:`Cluster` (see module doc for the model)."""

    def __init__(self, cluster: Cluster, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if not isinstance(cluster, Cluster):
            raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.cluster = cluster
        self.chunk_bytes = chunk_bytes

    # ---- one transfer --------------------------------------------------------------------

    def chain(self, sender: int, receivers: Sequence[int]) -> list[Hop]:
        """The hops of a chained broadcast (a point-to-point copy is one hop)."""
        c = self.cluster
        if tuple(receivers) == (sender,):
            return []
        by_host: dict[int, list[int]] = {}
        for r in receivers:
            by_host.setdefault(c.host_of(r), []).append(r)
        home = c.host_of(sender)
        order = ([home] if home in by_host else []) + [h for h in by_host if h != home]
        hops: list[Hop] = []
        prev = sender
        for h in order:
            for r in by_host[h]:
                hops.append(Hop(prev, r, c.host_of(prev) != c.host_of(r)))
                prev = r
        return hops

    def transfer_cost(self, t: Transfer) -> TransferCost:
        return self.cost_of(t.sender, t.receivers, t.nbytes)

    def cost_of(self, sender: int, receivers: Sequence[int], nbytes: int) -> TransferCost:
        c = self.cluster
        if tuple(receivers) == (sender,):
            return TransferCost(
                ((GPU_MEM, sender),), c.nvlink_latency_s, nbytes, c.nvlink_bytes_per_s
            )
        hops = self.chain(sender, receivers)
        ports: list[tuple[str, int]] = []
        latency = 0.0
        chunk_time = 0.0  # one chunk through every hop
        bw = math.inf
        chunk = min(self.chunk_bytes, nbytes)
        for hop in hops:
            if hop.network:
                ports += [(NIC_OUT, c.nic_of(hop.src)), (NIC_IN, c.nic_of(hop.dst))]
                latency += c.nic_latency_s
                hop_bw = c.nic_bytes_per_s
            else:
                ports += [(GPU_OUT, hop.src), (GPU_IN, hop.dst)]
                latency += c.nvlink_latency_s
                hop_bw = c.nvlink_bytes_per_s
            bw = min(bw, hop_bw)
            chunk_time += chunk / hop_bw
        # Pipelining: the last byte leaves the bottleneck at bytes/bw, then still has to cross
        # the other hops one chunk at a time.
        fill = chunk_time - chunk / bw
        # A chain may leave and enter the same NIC on different hops only across hosts;
        # a port listed twice would be double-booked, so keep each once.
        return TransferCost(tuple(dict.fromkeys(ports)), latency + fill, nbytes, bw)

    def latency_of(self, sender: int, receivers: Sequence[int]) -> float:
        """Only the latency terms of a transfer: what a 1-byte message costs (signal mode)."""
        c = self.cluster
        if tuple(receivers) == (sender,):
            return c.nvlink_latency_s
        return sum(c.nic_latency_s if h.network else c.nvlink_latency_s
                   for h in self.chain(sender, receivers))

    def capacity(self, port: tuple[str, int]) -> float:
        c = self.cluster
        return c.nic_bytes_per_s if port[0] in (NIC_OUT, NIC_IN) else c.nvlink_bytes_per_s

    def alone_time(self, t: Transfer) -> float:
        tc = self.transfer_cost(t)
        return tc.fixed_s + tc.nbytes / tc.alone_bw

    # ---- many transfers ------------------------------------------------------------------

    def run(self, transfers: Sequence[Transfer]) -> list[TransferTiming]:
        """Start and end time of every transfer, launched in order on per-device streams."""
        return self.run_costs(
            [self.transfer_cost(t) for t in transfers],
            [t.devices for t in transfers],
            after=[t.after for t in transfers],
        )

    def run_costs(
        self,
        costs: Sequence[TransferCost],
        devices: Sequence[Sequence[int]],
        ready: Sequence[float] | None = None,
        after: Sequence[Sequence[int]] | None = None,
    ) -> list[TransferTiming]:
        """Fluid discrete-event run of transfers in launch order, FIFO per device.

        ``ready[i]`` is the earliest time transfer ``i`` may start (default 0);
        ``after[i]`` lists earlier transfers that must end before ``i`` starts.
        """
        run = _FluidRun(self, costs, devices, ready, after)
        queues: dict[int, deque[int]] = defaultdict(deque)
        for i, devs in enumerate(devices):
            for d in devs:
                queues[d].append(i)

        def startable(freed: Iterable[int]) -> list[int]:
            heads = {queues[d][0] for d in freed if queues[d]}
            out = []
            for i in sorted(heads):
                if run.can_start(i) and all(queues[d][0] == i for d in devices[i]):
                    out.append(i)
            return out

        def started(i: int) -> None:
            for d in devices[i]:
                queues[d].popleft()

        return run.run(startable, started)

    def list_schedule(
        self,
        costs: Sequence[TransferCost],
        devices: Sequence[Sequence[int]],
        key: Callable[[int], Any],
        on_start: Callable[[int], None] | None = None,
        ready: Sequence[float] | None = None,
    ) -> tuple[list[int], list[TransferTiming]]:
        """A launch order found by running the model itself as a non-delay list schedule.

        Whenever devices free up, the transfers whose devices are all free start, smallest
        ``key(i)`` first (``key`` is evaluated at that moment, so it may depend on what has
        started: ``on_start(i)`` is called as each one starts). Replaying the returned order
        with :meth:`run_costs` gives the same timings, because per-device FIFO order is all
        that the replay enforces and the schedule never idles a startable transfer.
        ``ready[i]`` is the earliest start of transfer ``i``.
        """
        run = _FluidRun(self, costs, devices, ready, None)
        pending_on: dict[int, set[int]] = defaultdict(set)
        for i, devs in enumerate(devices):
            for d in devs:
                pending_on[d].add(i)
        order: list[int] = []

        def startable(freed: Iterable[int]) -> list[int]:
            cands = {i for d in freed for i in pending_on[d]}
            ranked = sorted((i for i in cands if run.can_start(i)), key=key)
            chosen: list[int] = []
            taken: set[int] = set()
            for i in ranked:
                if taken.isdisjoint(devices[i]):
                    chosen.append(i)
                    taken.update(devices[i])
                    if on_start is not None:
                        on_start(i)
                else:
                    # Re-ranked once the devices it waits for are free again.
                    pass
            return chosen

        def started(i: int) -> None:
            order.append(i)
            for d in devices[i]:
                pending_on[d].discard(i)

        return order, run.run(startable, started)

    def plan_time(self, plan: ReshardPlan) -> float:
        if not plan.transfers:
            return 0.0
        return max(t.end for t in self.run(plan.transfers))

    def network_bytes(self, plan: ReshardPlan) -> int:
        return sum(
            t.nbytes * sum(h.network for h in self.chain(t.sender, t.receivers))
            for t in plan.transfers
        )


class _FluidRun:
    """The event loop shared by in-order runs and list scheduling.

    A transfer first pays its fixed time (latency, pipeline fill) holding no bandwidth, then
    its bytes flow at a max-min fair rate over its ports, recomputed at every start and end.
    ``startable(freed_devices)`` names the transfers to start now (their devices are free).
    """

    def __init__(self, model: CostModel, costs, devices, ready, after) -> None:
        self.costs = costs
        self.devices = devices
        self.n = len(costs)
        self.earliest = list(ready) if ready is not None else [0.0] * self.n
        self.after = [tuple(a) for a in after] if after is not None else [()] * self.n
        self.dependents: list[list[int]] = [[] for _ in range(self.n)]
        for i, deps in enumerate(self.after):
            for j in deps:
                if not 0 <= j < i:
                    raise ValueError(f"after[{i}]: {j} is not an earlier transfer")
                self.dependents[j].append(i)
        self.ended = [False] * self.n
        port_ids: dict[tuple[str, int], int] = {}
        caps: list[float] = []
        self.flow_ports: list[list[int]] = []
        for tc in costs:
            ids = []
            for p in tc.ports:
                if p not in port_ids:
                    port_ids[p] = len(caps)
                    caps.append(model.capacity(p))
                ids.append(port_ids[p])
            self.flow_ports.append(ids)
        self.cap = caps
        self.busy: set[int] = set()
        self.now = 0.0

    def can_start(self, i: int) -> bool:
        if self.earliest[i] > self.now or not self.busy.isdisjoint(self.devices[i]):
            return False
        ended = self.ended
        return all(ended[j] for j in self.after[i])

    def run(self, startable, started) -> list[TransferTiming]:
        n, costs = self.n, self.costs
        start = [math.nan] * n
        end = [math.nan] * n
        # Flow state, updated lazily: bytes left at time `last`, draining at `rate`.
        left = [float(tc.nbytes) for tc in costs]
        last = [0.0] * n
        rate = [0.0] * n
        version = [0] * n
        fixed_heap: list[tuple[float, int, int]] = []  # (time, seq, i): fixed part over
        flow_heap: list[tuple[float, int, int]] = []  # (predicted end, version, i)
        wake: list[float] = sorted({t for t in self.earliest if t > 0})
        flowing: set[int] = set()
        port_flows: dict[int, set[int]] = defaultdict(set)
        seq = 0
        done = 0
        freed: set[int] = {d for devs in self.devices for d in devs}
        while True:
            if freed:
                for i in startable(freed):
                    start[i] = self.now
                    self.busy.update(self.devices[i])
                    started(i)
                    heapq.heappush(fixed_heap, (self.now + costs[i].fixed_s, seq, i))
                    seq += 1
                freed = set()
            if done == n:
                break
            while flow_heap and flow_heap[0][1] != version[flow_heap[0][2]]:
                heapq.heappop(flow_heap)
            t_flow = flow_heap[0][0] if flow_heap else math.inf
            t_fix = fixed_heap[0][0] if fixed_heap else math.inf
            t_wake = wake[0] if wake else math.inf
            t_next = min(t_flow, t_fix, t_wake)
            if t_next == math.inf:
                raise RuntimeError(
                    "cost model: transfers can never start (a device order has a cycle?)"
                )
            self.now = t_next
            finished: list[int] = []
            changed: set[int] = set()  # ports whose set of flows changed
            # Flows ending now (ties within rounding end together).
            while flow_heap:
                t, ver, i = flow_heap[0]
                if ver != version[i]:
                    heapq.heappop(flow_heap)
                    continue
                if t > self.now * (1 + 1e-12) + 1e-15:
                    break
                heapq.heappop(flow_heap)
                version[i] += 1
                flowing.discard(i)
                finished.append(i)
                for p in self.flow_ports[i]:
                    port_flows[p].discard(i)
                    changed.add(p)
            while fixed_heap and fixed_heap[0][0] <= self.now:
                _, _, i = heapq.heappop(fixed_heap)
                if left[i] <= 0 or not self.flow_ports[i]:
                    finished.append(i)
                else:
                    flowing.add(i)
                    last[i] = self.now
                    rate[i] = 0.0
                    for p in self.flow_ports[i]:
                        port_flows[p].add(i)
                        changed.add(p)
            while wake and wake[0] <= self.now:
                wake.pop(0)
                freed = {d for devs in self.devices for d in devs} - self.busy
            for i in finished:
                end[i] = self.now
                done += 1
                self.ended[i] = True
                self.busy.difference_update(self.devices[i])
                freed.update(self.devices[i])
                for j in self.dependents[i]:
                    freed.update(self.devices[j])
            if changed:
                comp = _component(changed, self.flow_ports, port_flows)
                for i, r in _max_min_rates(comp, self.flow_ports, port_flows, self.cap).items():
                    left[i] -= rate[i] * (self.now - last[i])
                    last[i] = self.now
                    rate[i] = r
                    version[i] += 1
                    if r > 0:
                        heapq.heappush(
                            flow_heap, (self.now + max(left[i], 0.0) / r, version[i], i)
                        )
        return [TransferTiming(s, e) for s, e in zip(start, end)]


def _max_min_rates(
    flows: Sequence[int],
    flow_ports: Sequence[Sequence[int]],
    port_flows: Mapping[int, set[int]],
    cap: Sequence[float],
) -> dict[int, float]:
    """Max-min fair rates of ``flows`` by progressive filling.

    ``flows`` must be closed under sharing a port (a connected component, or a union of them):
    then the rates elsewhere do not change, and only this component is recomputed.
    """
    rem: dict[int, float] = {}
    count: dict[int, int] = {}
    for i in flows:
        for p in flow_ports[i]:
            if p not in rem:
                rem[p] = cap[p]
                count[p] = 0
            count[p] += 1
    rates: dict[int, float] = {}
    active = set(flows)
    while active:
        p_min = min((p for p in count if count[p] > 0), key=lambda p: rem[p] / count[p])
        share = rem[p_min] / count[p_min]
        for i in [i for i in port_flows[p_min] if i in active]:
            rates[i] = share
            active.discard(i)
            for p in flow_ports[i]:
                rem[p] = max(0.0, rem[p] - share)
                count[p] -= 1
    return rates


def _component(start_ports: set[int], flow_ports, port_flows) -> list[int]:
    """Flowing transfers connected to ``start_ports`` through shared ports."""
    seen_ports = set(start_ports)
    stack = list(start_ports)
    flows: set[int] = set()
    while stack:
        p = stack.pop()
        for i in port_flows.get(p, ()):
            if i not in flows:
                flows.add(i)
                for q in flow_ports[i]:
                    if q not in seen_ports:
                        seen_ports.add(q)
                        stack.append(q)
    return list(flows)


# ---- the paper's simple model ----------------------------------------------------------------


def paper_model_time(plan: ReshardPlan, cluster: Cluster) -> float:
    """Makespan under the paper's simple model (arXiv 2211.05322 §4).

    A NIC (a host, on one-NIC clusters) takes part in one network transfer at a time;
    transfers are taken in plan order and each starts as soon as all its NICs are free; it
    holds them for bytes / NIC bandwidth (a pipelined broadcast costs what one hop costs),
    and never before the transfers it is declared ``after``.
    Transfers inside a host cost bytes / NVLink bandwidth and hold no NIC; they start when
    every transfer earlier in the plan that shares a device with them is over.
    This is a yardstick to compare with the paper, not the project's cost model.
    """
    model = CostModel(cluster)
    nic_free: dict[int, float] = defaultdict(float)
    dev_free: dict[int, float] = defaultdict(float)
    ends: list[float] = []
    makespan = 0.0
    for t in plan.transfers:
        not_before = max((ends[j] for j in t.after), default=0.0)
        hops = model.chain(t.sender, t.receivers)
        nics = {cluster.nic_of(h.src) for h in hops if h.network} | {
            cluster.nic_of(h.dst) for h in hops if h.network
        }
        if nics:
            begin = max(not_before, *(nic_free[n] for n in nics))
            finish = begin + t.nbytes / cluster.nic_bytes_per_s
            for n in nics:
                nic_free[n] = finish
        else:
            begin = max(not_before, *(dev_free[d] for d in t.devices))
            finish = begin + t.nbytes / cluster.nvlink_bytes_per_s
        ends.append(finish)
        for d in t.devices:
            dev_free[d] = max(dev_free[d], finish)
        makespan = max(makespan, finish)
    return makespan


# ---- lower bound -----------------------------------------------------------------------------


def lower_bound_for(
    shape: Sequence[int], dtype: object, src: Sharding, dst: Sharding, cluster: Cluster
) -> float:
    """Seconds no plan can beat under the cost model (a physical limit; see DESIGN.md).

    The largest of: every destination host ingests, through its NICs, the bytes its devices
    need that no source device on that host holds; every set of source hosts that alone holds
    some bytes needed elsewhere sends them out through its NICs (checked for each single host
    and each distinct set of holder hosts); every destination GPU ingests what it needs and
    does not hold, at most at NVLink plus NIC rate. Plus one network (or NVLink) latency when
    anything must cross hosts (or devices).
    """
    from .tasks import unit_tasks

    tasks = unit_tasks(shape, dtype, src, dst, cluster)
    c = cluster
    host_in: dict[int, int] = defaultdict(int)
    gpu_in: dict[int, int] = defaultdict(int)
    exclusive: dict[frozenset[int], list[tuple[frozenset[int], int]]] = defaultdict(list)
    crosses_host = crosses_device = False
    for task in tasks:
        holder_hosts = frozenset(c.host_of(d) for d in task.holders)
        need_hosts = {c.host_of(r) for r in task.needers}
        for h in need_hosts - holder_hosts:
            host_in[h] += task.nbytes
            crosses_host = True
        for r in task.needers:
            if r not in task.holders:
                gpu_in[r] += task.nbytes
                crosses_device = True
        exclusive[holder_hosts].append((frozenset(need_hosts), task.nbytes))
    host_bw = c.nics_per_host * c.nic_bytes_per_s
    terms = [0.0]
    terms += [b / host_bw for b in host_in.values()]
    gpu_bw = c.nvlink_bytes_per_s + c.nic_bytes_per_s
    terms += [b / gpu_bw for b in gpu_in.values()]
    candidates = set(exclusive) | {frozenset([h]) for s in exclusive for h in s}
    for group in candidates:
        out = sum(
            nbytes
            for holders, items in exclusive.items()
            if holders <= group
            for need, nbytes in items
            if need - group
        )
        terms.append(out / (len(group) * host_bw))
    latency = c.nic_latency_s if crosses_host else (c.nvlink_latency_s if crosses_device else 0.0)
    return max(terms) + latency
