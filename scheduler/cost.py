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

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from .cluster import Cluster
from .kernel import Kernel

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
        # (sender, receivers) -> (ports, latency, hop rates) of its chain: a whole state
        # costs tens of thousands of transfers over a few thousand distinct chains.
        self._chains: dict[tuple[int, tuple[int, ...]], tuple[tuple, float, tuple]] = {}

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
        """What transfer ``t`` needs from the cluster (:meth:`cost_of` of its fields)."""
        return self.cost_of(t.sender, t.receivers, t.nbytes)

    def cost_of(self, sender: int, receivers: Sequence[int], nbytes: int) -> TransferCost:
        """What sending ``nbytes`` from ``sender`` along a chained broadcast to ``receivers``
        needs: the ports it occupies, its fixed seconds (latency of every hop plus the
        pipeline fill of one chunk) and its bottleneck bandwidth (a copy to the sender
        itself is one device-memory copy)."""
        c = self.cluster
        if tuple(receivers) == (sender,):
            return TransferCost(
                ((GPU_MEM, sender),), c.nvlink_latency_s, nbytes, c.nvlink_bytes_per_s
            )
        key = (sender, tuple(receivers))
        known = self._chains.get(key)
        if known is None:
            ports: list[tuple[str, int]] = []
            latency = 0.0
            rates = []
            for hop in self.chain(sender, receivers):
                if hop.network:
                    ports += [(NIC_OUT, c.nic_of(hop.src)), (NIC_IN, c.nic_of(hop.dst))]
                    latency += c.nic_latency_s
                    rates.append(c.nic_bytes_per_s)
                else:
                    ports += [(GPU_OUT, hop.src), (GPU_IN, hop.dst)]
                    latency += c.nvlink_latency_s
                    rates.append(c.nvlink_bytes_per_s)
            if len(self._chains) >= 1 << 16:  # a long-lived model: keep the memory bounded
                self._chains.clear()
            # A chain may leave and enter the same NIC on different hops only across hosts;
            # a port listed twice would be double-booked, so keep each once.
            known = self._chains[key] = (tuple(dict.fromkeys(ports)), latency, tuple(rates))
        ports_once, latency, rates = known
        chunk = min(self.chunk_bytes, nbytes)
        bw = min(rates, default=math.inf)
        chunk_time = 0.0  # one chunk through every hop
        for hop_bw in rates:
            chunk_time += chunk / hop_bw
        # Pipelining: the last byte leaves the bottleneck at bytes/bw, then still has to cross
        # the other hops one chunk at a time.
        fill = chunk_time - chunk / bw
        return TransferCost(ports_once, latency + fill, nbytes, bw)

    def ring(self, group: Sequence[int]) -> list[Hop]:
        """The hops of a ring over ``group`` (NCCL's ring all-reduce): the devices host by
        host, in their order, and back to the first."""
        c = self.cluster
        by_host: dict[int, list[int]] = {}
        for d in group:
            by_host.setdefault(c.host_of(d), []).append(d)
        order = [d for devices in by_host.values() for d in devices]
        return [Hop(a, b, c.host_of(a) != c.host_of(b))
                for a, b in zip(order, order[1:] + order[:1])]

    def all_reduce_cost(self, group: Sequence[int], nbytes: int) -> TransferCost:
        """What a ring all-reduce of ``nbytes`` per device over ``group`` needs: every device
        sends ``2 (n - 1) / n`` of the bytes to its ring neighbour, in ``2 (n - 1)`` steps of
        the slowest hop's latency; its ports are the ring's, its bandwidth the slowest hop's."""
        n = len(group)
        if n < 2:
            return TransferCost((), 0.0, 0, math.inf)
        c = self.cluster
        ports: list[tuple[str, int]] = []
        bw, latency = math.inf, 0.0
        for hop in self.ring(group):
            if hop.network:
                ports += [(NIC_OUT, c.nic_of(hop.src)), (NIC_IN, c.nic_of(hop.dst))]
                bw, latency = min(bw, c.nic_bytes_per_s), max(latency, c.nic_latency_s)
            else:
                ports += [(GPU_OUT, hop.src), (GPU_IN, hop.dst)]
                bw, latency = min(bw, c.nvlink_bytes_per_s), max(latency, c.nvlink_latency_s)
        return TransferCost(tuple(dict.fromkeys(ports)), 2 * (n - 1) * latency,
                            2 * (n - 1) * nbytes // n, bw)

    def latency_of(self, sender: int, receivers: Sequence[int]) -> float:
        """Only the latency terms of a transfer: what a 1-byte message costs (signal mode)."""
        c = self.cluster
        if tuple(receivers) == (sender,):
            return c.nvlink_latency_s
        return sum(c.nic_latency_s if h.network else c.nvlink_latency_s
                   for h in self.chain(sender, receivers))

    def capacity(self, port: tuple[str, int]) -> float:
        """Bytes per second ``port`` (a ``(kind, index)`` key) carries: a NIC's or NVLink's."""
        c = self.cluster
        return c.nic_bytes_per_s if port[0] in (NIC_OUT, NIC_IN) else c.nvlink_bytes_per_s

    def alone_time(self, t: Transfer) -> float:
        """Seconds transfer ``t`` takes when nothing else runs (:meth:`alone_seconds`)."""
        return self.alone_seconds(t.sender, t.receivers, t.nbytes)

    def alone_seconds(self, sender: int, receivers: Sequence[int], nbytes: int) -> float:
        """Seconds a transfer takes when nothing else runs (what link emulation plays)."""
        tc = self.cost_of(sender, receivers, nbytes)
        return tc.fixed_s + tc.nbytes / tc.alone_bw

    # ---- many transfers ------------------------------------------------------------------

    def run(self, transfers: Sequence[Transfer], *, until: float = math.inf
            ) -> list[TransferTiming]:
        """Start and end time of every transfer, launched in order on per-device streams
        (one per lane). ``until``: stop once the clock would pass it — a transfer not
        ended by then has a nan end (and a nan start if it had not started): a caller that
        only wants to know whether the run ends by ``until`` need not run the rest."""
        return self.run_costs(
            [self.transfer_cost(t) for t in transfers],
            # A device's streams: one FIFO per lane (lanes of a device run side by side).
            [t.devices if not t.lane else tuple((d, t.lane) for d in t.devices)
             for t in transfers],
            after=[t.after for t in transfers],
            until=until,
        )

    def run_costs(
        self,
        costs: Sequence[TransferCost],
        devices: Sequence[Sequence[Any]],
        ready: Sequence[float] | None = None,
        after: Sequence[Sequence[int]] | None = None,
        until: float = math.inf,
    ) -> list[TransferTiming]:
        """Fluid discrete-event run of transfers in launch order, FIFO per device.

        ``ready[i]`` is the earliest time transfer ``i`` may start (default 0);
        ``after[i]`` lists earlier transfers that must end before ``i`` starts.
        """
        n = len(costs)
        succ: list[list[int]] = [[] for _ in range(n)]
        need = [0] * n
        last: dict[Any, int] = {}
        for i, devs in enumerate(devices):
            for d in devs:  # FIFO: the previous transfer on each of its devices ends first
                j = last.get(d)
                if j is not None:
                    succ[j].append(i)
                    need[i] += 1
                last[d] = i
        for i, deps in enumerate(after or ()):
            for j in deps:
                if not 0 <= j < i:
                    raise ValueError(f"after[{i}]: {j} is not an earlier transfer")
                succ[j].append(i)
                need[i] += 1
        start, end = self.run_ops(costs, succ, need, ready, until=until)
        return [TransferTiming(s, e) for s, e in zip(start, end)]

    def run_ops(
        self,
        costs: Sequence[TransferCost],
        succ: Sequence[Sequence[int]],
        need: Sequence[int],
        ready: Sequence[float] | None = None,
        *,
        until: float = math.inf,
    ) -> tuple[list[float], list[float]]:
        """Start and end times of ops that each start as soon as ``need[i]`` of the ops
        naming it in their ``succ`` lists have ended (and not before ``ready[i]``): the one
        engine behind plan costing and the pipeline simulator. An op without ports (a
        compute, or a signal-mode transfer) lasts its ``fixed_s``. Raises RuntimeError if
        some op can never start (a cycle). ``until``: stop once the clock would pass it (ops
        not ended by then keep a nan end)."""
        return _DependentRun(self, costs, succ, need, ready).run(until)

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
        run = _ListRun(self, costs, devices, ready)
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
                if taken.isdisjoint(devices[i]):  # else re-ranked once its devices free up
                    chosen.append(i)
                    taken.update(devices[i])
                    if on_start is not None:
                        on_start(i)
            for i in chosen:
                order.append(i)
                for d in devices[i]:
                    pending_on[d].discard(i)
            return chosen

        run.startable = startable
        start, end = run.run()
        return order, [TransferTiming(s, e) for s, e in zip(start, end)]

    def plan_time(self, plan: ReshardPlan) -> float:
        """Seconds ``plan`` takes: the end of its last transfer under :meth:`run`."""
        if not plan.transfers:
            return 0.0
        return max(t.end for t in self.run(plan.transfers))

    def network_bytes(self, plan: ReshardPlan) -> int:
        """Bytes ``plan`` puts on the network: each transfer's size times its inter-host hops."""
        return sum(
            t.nbytes * sum(h.network for h in self.chain(t.sender, t.receivers))
            for t in plan.transfers
        )


# The fluid engine's events are ints, op * 4 + kind; at one instant they run in kind order:
# flows that end, fixed parts that end, wake-ups; after the last of an instant, when needed,
# the engine settles (rebalances, starts what the policy starts).
_FLOW, _FIXED, _WAKE = 0, 1, 2


class _FluidEngine:
    """Ops through the cost model on the event kernel.

    An op first pays its fixed time (latency, pipeline fill, or a compute's duration)
    holding no bandwidth, then its bytes flow at a max-min fair rate over its ports. Rates
    are recomputed — for the connected component of flows whose ports changed — once per
    instant, after everything that happened at that instant (the settle); a flow whose rate
    is unchanged keeps its predicted end. Ops of equal cost that start at the same instant
    are indistinguishable in a fluid model (same rate at every moment, same end), so they run
    as one group, a flow weighted by its size: the computes of a stage's devices, or a
    pipeline boundary's transfers between two hosts, cost one event, not one per GPU.
    Subclasses say what an op's end releases (``on_end``) and, when ``settle_on_end``, which
    ops start at the settle (``on_settle``).
    """

    settle_on_end = False

    def __init__(self, model: CostModel, costs: Sequence[TransferCost],
                 ready: Sequence[float] | None) -> None:
        n = len(costs)
        self.kernel = Kernel()
        self.n = n
        self.earliest = list(ready) if ready is not None else None
        port_ids: dict[tuple[str, int], int] = {}
        caps: list[float] = []
        # Ops share cost values (by object, then by value): each distinct one is a class.
        by_id: dict[int, tuple[int, tuple[int, ...]]] = {}
        by_value: dict[TransferCost, int] = {}
        self.flow_ports: list[tuple[int, ...]] = []
        self.cost_class: list[int] = []
        for tc in costs:
            known = by_id.get(id(tc))
            if known is None:
                for p in tc.ports:
                    if p not in port_ids:
                        port_ids[p] = len(caps)
                        caps.append(model.capacity(p))
                known = by_id[id(tc)] = (by_value.setdefault(tc, len(by_value)),
                                         tuple(port_ids[p] for p in tc.ports))
            self.cost_class.append(known[0])
            self.flow_ports.append(known[1])
        self.cap = caps
        self.fixed = [tc.fixed_s for tc in costs]
        self.start = [math.nan] * n
        self.end = [math.nan] * n
        # Flow state, updated lazily: bytes left at time `last`, draining at `rate`; the
        # kernel count of the flow's latest predicted end (older predictions are stale).
        self.left = [float(tc.nbytes) for tc in costs]
        self.last = [0.0] * n
        self.rate = [0.0] * n
        self.flow_event = [-1] * n
        # A group: its first op stands for it; members[first] lists them all. Groups form
        # among the ops launched at one instant (cost class -> the group launched at it).
        self.members: dict[int, list[int]] = {}
        self.launching: dict[int, int] = {}
        self.launched_at = -1.0
        self.port_flows: dict[int, set[int]] = defaultdict(set)
        self.changed: set[int] = set()
        self.fills: dict[tuple, dict[Sequence[int], float]] = {}  # see _max_min_rates

    # ---- what subclasses decide ----------------------------------------------------------

    def first(self) -> None: ...  # start what starts at time 0
    def on_end(self, i: int) -> None: ...
    def on_wake(self, i: int) -> None: ...
    def on_settle(self) -> None: ...

    # ---- the engine ----------------------------------------------------------------------

    def launch(self, i: int) -> None:
        """Start op ``i`` now (or wake it at its ``ready`` time, if that is later): with the
        group of its cost class started at this instant, else as a new group whose fixed
        part ends ``fixed[i]`` from now."""
        kernel = self.kernel
        now = kernel.now
        if self.earliest is not None and self.earliest[i] > now:
            kernel.schedule(self.earliest[i], i * 4 + _WAKE, _WAKE)
            return
        self.start[i] = now
        if now != self.launched_at:
            self.launching.clear()
            self.launched_at = now
        c = self.cost_class[i]
        group = self.launching.get(c)
        if group is not None:
            self.members[group].append(i)
            return
        self.launching[c] = i
        self.members[i] = [i]
        kernel.schedule(now + self.fixed[i], i * 4 + _FIXED, _FIXED)

    def run(self, until: float = math.inf) -> tuple[list[float], list[float]]:
        kernel = self.kernel
        left, last, rate, flow_event = self.left, self.last, self.rate, self.flow_event
        flow_ports, port_flows, changed = self.flow_ports, self.port_flows, self.changed
        launching, cost_class = self.launching, self.cost_class
        settle_on_end = self.settle_on_end
        peek = kernel.peek

        def handle(count: int, event: int) -> None:
            kind = event & 3
            i = event >> 2
            if kind == _FIXED:
                if launching.get(cost_class[i]) == i:
                    del launching[cost_class[i]]  # ops launched from now on start anew
                ports = flow_ports[i]
                if ports and left[i] > 0:  # the bytes start to flow
                    last[i] = kernel.now
                    rate[i] = 0.0
                    for p in ports:
                        port_flows[p].add(i)
                    changed.update(ports)
                else:
                    self._finish(i)
                    if not settle_on_end and not changed:
                        return
            elif kind == _FLOW:
                if flow_event[i] != count:  # superseded by a later prediction
                    if not changed:
                        return
                else:
                    self._flow_ends(i)
            else:
                self.on_wake(i)
            head = peek()
            if head is None or head[0] > kernel.now:  # the last event of this instant
                self._settle()

        self.first()
        kernel.run(handle, until)
        if len(kernel):  # stopped at ``until``: what has not ended keeps its nan
            return self.start, self.end
        if any(e != e for e in self.end):  # NaN: never ended
            raise RuntimeError(
                "cost model: transfers can never start (a device order has a cycle?)")
        return self.start, self.end

    def _finish(self, group: int) -> None:
        now, end, on_end = self.kernel.now, self.end, self.on_end
        for j in self.members.pop(group):
            end[j] = now
            on_end(j)

    def _flow_ends(self, i: int) -> None:
        self.flow_event[i] = -1
        for p in self.flow_ports[i]:
            self.port_flows[p].discard(i)
        self.changed.update(self.flow_ports[i])
        self._finish(i)

    def _settle(self) -> None:
        kernel = self.kernel
        now = kernel.now
        # Flows predicted to end within rounding of now end now, together.
        limit = now * (1 + 1e-12) + 1e-15
        while (head := kernel.peek()) is not None and head[1] == _FLOW and head[0] <= limit:
            _, _, count, event = kernel.pop()
            kernel.now = now
            if self.flow_event[event >> 2] == count:
                self._flow_ends(event >> 2)
        if self.changed:
            self._rebalance(now)
        self.on_settle()

    def _rebalance(self, now: float) -> None:
        left, rate, last, flow_event = self.left, self.rate, self.last, self.flow_event
        rates = _max_min_rates(self.changed, self.flow_ports, self.port_flows, self.members,
                               self.cap, self.fills)
        self.changed.clear()
        schedule = self.kernel.schedule
        for i, r in rates.items():
            if r == rate[i]:
                continue  # its predicted end stands
            left[i] -= rate[i] * (now - last[i])
            last[i] = now
            rate[i] = r
            flow_event[i] = (schedule(now + max(left[i], 0.0) / r, i * 4 + _FLOW, _FLOW)
                             if r > 0 else -1)


class _DependentRun(_FluidEngine):
    """Each op starts as soon as its predecessors have ended (``need[i]`` of them, each
    naming it in its ``succ`` list), and not before ``ready[i]``."""

    def __init__(self, model: CostModel, costs: Sequence[TransferCost],
                 succ: Sequence[Sequence[int]], need: Sequence[int],
                 ready: Sequence[float] | None) -> None:
        super().__init__(model, costs, ready)
        if len(succ) != self.n or len(need) != self.n:
            raise ValueError(f"succ, need: expected {self.n} entries each, got {len(succ)} "
                             f"and {len(need)}")
        self.succ = succ
        self.need = list(need)

    def _finish(self, group: int) -> None:
        # (on_end for every member, inlined: this loop runs once per op of a whole step)
        need, succ, end, launch = self.need, self.succ, self.end, self.launch
        now = self.kernel.now
        for j in self.members.pop(group):
            end[j] = now
            for k in succ[j]:
                need[k] -= 1
                if need[k] == 0:
                    launch(k)

    def on_wake(self, i: int) -> None:
        self.launch(i)

    def first(self) -> None:
        for i, k in enumerate(self.need):
            if k == 0:
                self.launch(i)


class _ListRun(_FluidEngine):
    """Ops start when ``startable(freed devices)`` names them (a list scheduler's policy):
    called at the settle of every instant where devices freed up; an op holds its devices
    while it runs."""

    settle_on_end = True

    def __init__(self, model: CostModel, costs: Sequence[TransferCost],
                 devices: Sequence[Sequence[int]], ready: Sequence[float] | None) -> None:
        super().__init__(model, costs, ready)
        self.devices = devices
        self.busy: set[int] = set()
        self.freed: set[int] = {d for devs in devices for d in devs}
        self.startable: Callable[[set[int]], list[int]] = lambda freed: []
        for t in sorted({t for t in (ready or ()) if t > 0}):
            self.kernel.schedule(t, _WAKE, _WAKE)

    def can_start(self, i: int) -> bool:
        earliest = self.earliest
        return ((earliest is None or earliest[i] <= self.kernel.now)
                and self.busy.isdisjoint(self.devices[i]))

    def on_end(self, i: int) -> None:
        self.busy.difference_update(self.devices[i])
        self.freed.update(self.devices[i])

    def on_wake(self, i: int) -> None:
        self.freed = {d for devs in self.devices for d in devs} - self.busy

    def first(self) -> None:
        self.on_settle()

    def on_settle(self) -> None:
        if self.freed:
            freed, self.freed = self.freed, set()
            for i in self.startable(freed):
                self.busy.update(self.devices[i])
                self.launch(i)


def _max_min_rates(
    changed: Iterable[int],
    flow_ports: Sequence[Sequence[int]],
    port_flows: Mapping[int, set[int]],
    members: Mapping[int, list[int]],
    cap: Sequence[float],
    memo: dict[tuple, dict[Sequence[int], float]],
) -> dict[int, float]:
    """Max-min fair rates, by progressive filling, of the flows connected (through shared
    ports) to the ``changed`` ports: only their rates can change. A flow counts as its
    ``members``; flows over the same ports fill as one class; ``memo`` keeps the fill of
    every component met (its classes and their sizes decide it)."""
    stack = list(changed)
    rem = {p: cap[p] for p in stack}
    classes: dict[Sequence[int], list[int]] = {}
    seen: set[int] = set()  # (a flow is met once per port it uses: taken the first time)
    while stack:  # the connected component: its ports (rem) and flows, by port set
        for i in port_flows.get(stack.pop(), ()):
            if i in seen:
                continue
            seen.add(i)
            ports = flow_ports[i]
            flows = classes.get(ports)
            if flows is None:
                classes[ports] = [i]
                for q in ports:
                    if q not in rem:
                        rem[q] = cap[q]
                        stack.append(q)
            else:
                flows.append(i)
    if len(classes) <= 1:  # nothing flows, or one class alone: its narrowest port decides
        for ports, flows in classes.items():
            share = min(rem[p] for p in ports) / sum(len(members[i]) for i in flows)
            return dict.fromkeys(flows, share)
        return {}
    weights = {ports: sum(len(members[i]) for i in flows) for ports, flows in classes.items()}
    key = tuple(sorted(weights.items()))
    shares = memo.get(key)  # a pipeline's steady state meets the same components again
    if shares is None:
        shares = memo[key] = _fill(weights, {p: cap[p] for p in rem})
    return {i: shares[ports] for ports, flows in classes.items() for i in flows}


def _fill(weights: Mapping[Sequence[int], int], cap: Mapping[int, float]
          ) -> dict[Sequence[int], float]:
    """Progressive filling: the rate of each class (port set) of flows, ``weights[ports]``
    flows in it, over ports of capacity ``cap``."""
    rem = dict(cap)
    count = dict.fromkeys(rem, 0)
    users: dict[int, list[Sequence[int]]] = {p: [] for p in rem}
    for ports, w in weights.items():
        for p in ports:
            count[p] += w
            users[p].append(ports)
    shares: dict[Sequence[int], float] = {}
    while len(shares) < len(weights):
        share, bottleneck = math.inf, -1
        for p, c in count.items():  # the port whose fair share is least
            if c and rem[p] < share * c:
                share, bottleneck = rem[p] / c, p
        for ports in users[bottleneck]:
            if ports in shares:
                continue
            shares[ports] = share
            w = weights[ports]
            for p in ports:
                left = rem[p] - share * w
                rem[p] = left if left > 0.0 else 0.0
                count[p] -= w
    return shares


def estimate(plan: ReshardPlan, cluster: Cluster) -> float:
    """Seconds ``plan`` takes on ``cluster`` under the cost model."""
    return CostModel(cluster).plan_time(plan)


def plan_report(plan: ReshardPlan, cluster: Cluster) -> str:
    """The plan's summary, with its network bytes, estimate, lower bound and their ratio."""
    from .plan import fmt_bytes

    model = CostModel(cluster)
    est = model.plan_time(plan)
    lb = lower_bound_for(plan.shape, plan.dtype, plan.src, plan.dst, cluster)
    return "\n".join([
        plan.summary(),
        f"  network bytes: {fmt_bytes(model.network_bytes(plan))}",
        f"  estimate {est * 1e3:.2f} ms, lower bound {lb * 1e3:.2f} ms, "
        f"{ratio_text(est, lb, plan.shape)}",
    ])


def ratio_text(time: float, bound: float, shape: Sequence[int]) -> str:
    """``ratio X`` of a time to its lower bound; without a bound to divide by (0: nothing
    has to move), why — never ``ratio nan``."""
    if bound > 0:
        return f"ratio {time / bound:.3f}"
    if math.prod(shape) == 0:
        return f"no ratio: the tensor is empty (shape {tuple(shape)})"
    return "no ratio: the lower bound is 0 (nothing has to cross a link)"


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
    return paper_model_transfers(plan.transfers, cluster)


def paper_model_transfers(transfers: Sequence[Transfer], cluster: Cluster) -> float:
    """:func:`paper_model_time` of a list of transfers (a plan's, or a candidate's)."""
    model = CostModel(cluster)
    nic_free: dict[int, float] = defaultdict(float)
    dev_free: dict[int, float] = defaultdict(float)
    ends: list[float] = []
    makespan = 0.0
    for t in transfers:
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
    """Seconds no plan can beat under the cost model (a physical limit: docs/concepts/plans.md).

    The largest of: every destination host ingests, through its NICs, the bytes its devices
    need that no source device on that host holds; every set of source hosts that alone holds
    some bytes needed elsewhere sends them out through its NICs (checked for each single host
    and each distinct set of holder hosts); every destination GPU ingests what it needs and
    does not hold, at most at NVLink plus NIC rate. The host terms plus one network latency
    (their bytes cross a NIC); the GPU terms plus the least latency of a hop (a GPU's bytes
    may all come over NVLink: adding a network latency there overstated the bound of a state
    whose busiest GPU is fed on its own host).
    """
    from .tasks import unit_tasks

    return lower_bound_of_tasks([unit_tasks(shape, dtype, src, dst, cluster)], cluster)


def lower_bound_of_tasks(task_lists: Iterable[Sequence[Any]], cluster: Cluster) -> float:
    """:func:`lower_bound_for` of several reshardings run together (each a list of
    :class:`~scheduler.tasks.UnitTask`): every term sums the bytes of all of them before the
    largest is taken (a host ingests every tensor's bytes through the same NICs), so the
    bound of a whole state is at least the bound of each of its tensors."""
    c = cluster
    host_in: dict[int, int] = defaultdict(int)
    gpu_in: dict[int, int] = defaultdict(int)
    # holder hosts -> needing hosts -> bytes (summed: a state repeats the same pairs)
    exclusive: dict[frozenset[int], dict[frozenset[int], int]] = defaultdict(
        lambda: defaultdict(int))
    crosses_host = crosses_device = False
    for task in (task for tasks in task_lists for task in tasks):
        holder_hosts = frozenset(c.host_of(d) for d in task.holders)
        need_hosts = {c.host_of(r) for r in task.needers}
        for h in need_hosts - holder_hosts:
            host_in[h] += task.nbytes
            crosses_host = True
        for r in task.needers:
            if r not in task.holders:
                gpu_in[r] += task.nbytes
                crosses_device = True
        exclusive[holder_hosts][frozenset(need_hosts)] += task.nbytes
    host_bw = c.nics_per_host * c.nic_bytes_per_s
    terms = [0.0]  # bytes that must cross a NIC: each pays at least a network hop's latency
    terms += [b / host_bw for b in host_in.values()]
    candidates = set(exclusive) | {frozenset([h]) for s in exclusive for h in s}
    for group in candidates:
        out = sum(
            nbytes
            for holders, items in exclusive.items()
            if holders <= group
            for need, nbytes in items.items()
            if need - group
        )
        terms.append(out / (len(group) * host_bw))
    gpu_bw = c.nvlink_bytes_per_s + c.nic_bytes_per_s
    # A GPU's bytes may all come over NVLink: its term pays the least latency of a hop.
    gpu_term = max((b / gpu_bw for b in gpu_in.values()), default=0.0)
    hop_latency = min(c.nic_latency_s, c.nvlink_latency_s) if crosses_host else c.nvlink_latency_s
    return max(max(terms) + c.nic_latency_s if crosses_host else 0.0,
               gpu_term + hop_latency if crosses_device else 0.0)
