"""Collectives across processes over point-to-point wires: the CPU kind's data plane between
MPI ranks.

A wire moves one message to one peer (``isend``/``irecv`` returning a
:class:`~overlap.backends.job.engine.Completion`, matched by channel, source and tag): a host
link (:mod:`.host_links`) between the ranks of one host, for pieces of at most
``LINK_MAX_PIECE_BYTES`` — the socket's kernel buffer completes a send at once, and the engine
wakes only for a message; MPI (:mod:`.mpi`) otherwise — larger pieces (a socket copies twice),
and ranks on other hosts. The process's progress engine completes both. A new wire is a new
file with those two methods.

**Broadcast** (a plan's transfer): a chain over the ranks it spans, in the plan's receiver
order (the chain the cost model prices). Each transfer part is resolved once per step graph
into a frozen :class:`Hop` (this rank's place in the chain, the piece size, the channel),
the route's ``hop``. The bytes go in pieces when someone forwards them (a chain of three
ranks or more); each piece is forwarded the moment it lands. How many pieces is a pipelining
trade-off (:func:`piece_bytes`). A rank with several participants meets them first (a
rendezvous by launch position); the last to arrive moves the bytes through its rank's part
of the chain and copies them to the others.

**All-reduce / all-gather** (stage collectives): every rank sends its participants'
contributions to every other rank of the group and reduces in device order, so results equal
one process's bit for bit.

**Tags**: a transfer's is its op id in the step graph (the same on every rank; a standalone
resharding's: the first of a range of its own, taken from a running total of ops, + its op
id); a stage collective's is its group's id
and launch position. Threads of different ranks reach a channel's transfers in different
orders; with tags that can neither deadlock nor cross messages.

**Every wait** is for a completion, woken by the engine or by the call's cancellation; one
past the timeout asks the peer how far it got (:meth:`~.distributed.Distributed.overdue`):
a peer still at work (in this call, or in an earlier one this rank had no part in) is waited
for; one idle, behind or mute is named in a :class:`~overlap.errors.CollectiveTimeout`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ...errors import CollectiveAborted, CollectiveMismatch, OverlapRuntimeError
from ...scope import CancelScope
from ...waits import OneShot, block_on, wait_on, when_all
from ..devices.bound import Bounded
from ..devices.collectives import Communicators, check_alike, reduce_in_order
from ..devices.routes import Route
from .engine import Completion

if TYPE_CHECKING:
    from ..devices.backend import Backend
    from .distributed import Distributed
    from .host_links import HostLinks
    from .mpi import MpiWire

# Larger pieces go over MPI even between the ranks of a host: a socket copies twice and a
# message that comes before its receive is posted is kept in a copy (MPI's rendezvous waits
# for the receive instead); MPI's polling is small next to moving megabytes.
LINK_MAX_PIECE_BYTES = 1 << 20
GROUP_TAG_BITS = 16  # stage collectives: tag = group id << 16 | launch position (mod 2**16)

# The constants of the piece-size model, measured on the 2-core machine of
# docs/benchmarks.md (4 ranks): shared-memory copies move ~10 GB/s, and a piece costs
# ~0.2 ms of fixed time (a wake-up and the message's rendezvous).
HOST_BYTES_PER_S = 10e9
PIECE_OVERHEAD_S = 2e-4
MIN_PIECE_BYTES = 256 << 10


def piece_bytes(nbytes: int, stages: int) -> int:
    """Piece size for a broadcast of ``nbytes`` through ``stages`` pipeline stages (hops, plus
    one for local copies). A pipeline of k pieces takes about (k + stages − 1) × (nbytes /
    (k × bandwidth) + overhead), least at k = sqrt(nbytes / bandwidth × (stages − 1) /
    overhead). One stage: one piece. Every rank computes the same size (both ends of a hop
    must cut the same pieces)."""
    if stages <= 1 or nbytes <= MIN_PIECE_BYTES:
        return max(nbytes, 1)
    k = math.sqrt(nbytes / HOST_BYTES_PER_S * (stages - 1) / PIECE_OVERHEAD_S)
    k = max(1, round(k))
    return max(MIN_PIECE_BYTES, -(-nbytes // k))


@dataclass(frozen=True, slots=True)
class Hop:
    """A rank's place in one broadcast's chain (see module doc): the channel's id, the rank
    it receives from and the one it passes the bytes on to (None: it is the root, the last),
    the piece size, and this rank's participants (the root's, or the receivers')."""

    channel: int
    prev: int | None
    next: int | None
    piece: int
    local: tuple[int, ...]


class HopTiming(NamedTuple):
    """One rank's part in one hop of a transfer, in ``time.perf_counter`` seconds (one clock
    for every process of a host): posted its receive or send, saw the last piece land
    (receivers; None on the root), saw its part complete."""

    tag: int
    prev: int | None  # the rank it receives from (None: the root)
    nxt: int | None  # the rank it sends to
    nbytes: int
    posted: float
    landed: float | None
    done: float


class WireTransport(Bounded):
    """Collectives whose participants span processes, over wires (see module doc). Part of
    a multi-process CPU backend (its ``remote``)."""

    def __init__(self, backend: Backend, dist: Distributed, mpi: MpiWire | None,
                 links: HostLinks | None, *, chunk_bytes: int | None = None) -> None:
        if chunk_bytes is not None and (isinstance(chunk_bytes, bool)
                                        or not isinstance(chunk_bytes, int) or chunk_bytes < 1):
            raise ValueError(f"chunk_bytes: expected an int >= 1 or None, got {chunk_bytes!r}")
        assert backend.placement is not None
        self.backend = backend
        self.placement = backend.placement
        self.rank = backend.rank
        self.dist = dist
        self.mpi = mpi  # (None: a job without MPI, every byte over links)
        # The data's links (None: every byte over MPI; the control plane keeps its own).
        self.links = links
        if mpi is None and (links is None or len(links.peers) != dist.world.size - 1):
            raise OverlapRuntimeError("a wire without MPI needs links to every other rank")
        self.tag_ub = dist.tag_ub if mpi is None else mpi.tag_ub
        self.chunk_bytes = chunk_bytes  # a broadcast's pieces (None: piece_bytes's choice)
        self.bound = backend.bound
        self.comms = Communicators(backend.bound)  # this rank's participants' rendezvous
        self._channels: dict[str, int] = {}  # namespace -> channel id (the same on every rank)
        self._group_ids: dict[tuple[str, tuple[int, ...]], int] = {}
        # Set to a list to time every cross-rank hop this rank takes part in (a
        # ``HopTiming`` each; ``benchmarks/mpi_step_profile.py``); None: not timed.
        self.hop_timings: list[HopTiming] | None = None
        self._spans: dict[tuple[int, ...], bool] = {}

    # ---- communicators (every rank, same order) ------------------------------------------

    def spans(self, group: Sequence[int]) -> bool:
        key = tuple(group)
        known = self._spans.get(key)
        if known is None:  # (asked for every transfer part at every launch: kept)
            known = self._spans[key] = self.placement.ranks_of(key) != (self.rank,)
        return known

    def prepared(self, channels: dict[str, tuple[int, ...]],
                 groups: Sequence[tuple[str, tuple[int, ...]]]) -> bool:
        """Whether every one of these channels and groups is made already (every call asks:
        a call with nothing new goes on without a thread hop)."""
        return ("compute" in self._channels and all(n in self._channels for n in channels)
                and all(n in self._channels and (n, tuple(sorted(set(g)))) in self._group_ids
                        for n, g in groups))

    def prepare(self, channels: dict[str, tuple[int, ...]],
                groups: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        """Make each new channel's communicator (an ``MPI_Comm_idup`` over every rank, in
        the same order everywhere: collective, its wait bounded by the liveness rule) — a
        group's namespace (a data-parallel stage's ``dp<s>``) is one too — and number each
        new stage-collective group."""
        if "compute" not in self._channels:
            self._new_channel("compute")
        for namespace in [*channels, *(n for n, _ in groups)]:
            if namespace not in self._channels:
                self._new_channel(namespace)
        limit = (self.tag_ub >> GROUP_TAG_BITS) + 1
        for namespace, g in groups:
            key = (namespace, tuple(sorted(set(g))))
            if key not in self._group_ids:
                if len(self._group_ids) >= limit:
                    raise OverlapRuntimeError(f"more than {limit} collective groups: the "
                                              f"tag range ({self.tag_ub}) has no room for more")
                self._group_ids[key] = len(self._group_ids)

    def _new_channel(self, namespace: str) -> None:
        channel = len(self._channels)
        if self.mpi is not None:  # (links match by channel id: nothing to make)
            comm = self.dist.duplicate(f"making channel {namespace!r}'s communicator (with "
                                       "every rank)")
            self.mpi.add_channel(channel, comm)
        self._channels[namespace] = channel

    def _channel(self, namespace: str, what: str) -> int:
        try:
            return self._channels[namespace]
        except KeyError:
            raise OverlapRuntimeError(f"{what}: namespace {namespace!r} spans processes but was "
                                      "never prepared on this rank") from None

    # ---- broadcasts ----------------------------------------------------------------------

    def hop(self, order: tuple[int, ...], device: int, root: int, namespace: str,
            nbytes: int) -> Hop:
        """This rank's place in the chain of a broadcast over ``order`` (see :class:`Hop`)."""
        owners = self.placement.owners
        chain = self.placement.ranks_of(order)
        me = chain.index(self.rank)
        local = tuple(d for d in order if owners[d] == self.rank)
        # Pieces when someone forwards them as they land (a chain of 3+ ranks); every rank
        # computes the same size. (A rank's copies to its other devices follow its whole
        # part, so they are no stage of the pipeline.)
        stages = len(chain) - 1
        piece = (self.chunk_bytes if self.chunk_bytes is not None and stages > 1
                 else piece_bytes(nbytes, stages))
        return Hop(self._channels.get(namespace, -1), chain[me - 1] if me else None,
                   chain[me + 1] if me + 1 < len(chain) else None, piece, local)

    def transfer(self, route: Route, buffer: Any, tag: int, scope: CancelScope
                 ) -> WireWork | None:
        """``route.device``'s part of a broadcast across processes (see module doc). Where
        nothing is left to do on this rank once its messages are posted — the root's sends
        on to one rank, the last rank's receives into a buffer that takes them in place —
        the part is *issued*: it returns the messages as :class:`WireWork`, device work the
        engine completes (the stream goes on; what waits for it waits for that work, as for
        a GPU's). Every other part (a relay's, or one with several devices of this rank)
        returns when it is done."""
        hop: Hop = route.hop
        if hop.channel < 0:  # (resolved before its channel was prepared)
            hop = self.hop(route.order, route.device, route.root, route.namespace, route.nbytes)
        if len(hop.local) == 1:
            root = route.device == route.root
            if (hop.prev is None or hop.next is None) and (root or buffer.flags.c_contiguous):
                if root and not buffer.flags.c_contiguous:
                    raise OverlapRuntimeError(f"{route.what}: the root's buffer is not "
                                              "contiguous")
                return self._issue(hop, route.what, buffer.reshape(-1).view(np.uint8), tag,
                                   scope)
            self._move(hop, route, buffer, tag, scope)
            return None

        def combine(bufs: dict[int, Any]) -> float:
            leader = route.root if route.root in bufs else hop.local[0]
            src = bufs[leader]
            for d, b in bufs.items():
                if b.shape != src.shape or b.dtype != src.dtype:
                    raise CollectiveMismatch(f"{route.what}: device {d} buffer {b.shape} "
                                             f"{b.dtype} != device {leader} buffer {src.shape} "
                                             f"{src.dtype}")
            self._move(hop, route, src, tag, scope)
            for d, b in bufs.items():  # (the root's rank: its other devices receive too)
                if d != leader:
                    np.copyto(b, src)
            return 0.0

        self.comms.get(route.namespace, hop.local).run(route.device, route.what, buffer,
                                                       combine, scope)
        return None

    def _issue(self, hop: Hop, what: str, data: np.ndarray, tag: int, scope: CancelScope
               ) -> WireWork:
        """Post this rank's messages of a hop that ends here (the root sends, or the last
        rank receives): their completions as one :class:`WireWork`."""
        prev, nxt, n, step = hop.prev, hop.next, data.nbytes, hop.piece
        pieces = [data[i:i + step] for i in range(0, n, step)] or [data[:0]]
        posted = time.perf_counter()
        if prev is not None:
            parts = [self._wire(prev, step).irecv(hop.channel, prev, tag, p) for p in pieces]
            peer, who = prev, f"rank {prev} never sent it"
        elif nxt is not None:
            parts = [self._wire(nxt, step).isend(hop.channel, nxt, tag, p) for p in pieces]
            peer, who = nxt, f"rank {nxt} never received it"
        else:  # (a chain of one rank: nothing crosses)
            parts, peer, who = [], -1, ""
        sizes = [p.nbytes for p in pieces] if prev is not None else None
        timing = None
        if self.hop_timings is not None:
            timings = self.hop_timings

            def timing(landed: float | None) -> None:
                timings.append(HopTiming(tag, prev, nxt, n, posted, landed,
                                         time.perf_counter()))
        return WireWork(self, parts, what, peer, who, scope, sizes, timing)

    def broadcast(self, order: tuple[int, ...], device: int, root: int, buffer: Any,
                  desc: str, namespace: str, tag: int | None, scope: CancelScope) -> None:
        """A broadcast not resolved ahead (``Backend.broadcast``): resolved now."""
        if tag is None:
            raise OverlapRuntimeError(f"broadcast[{desc}] root {root}: spans ranks "
                                      f"{list(self.placement.ranks_of(order))} and needs a tag")
        hop = self.hop(order, device, root, namespace, buffer.nbytes)
        work = self.transfer(Route(desc, namespace, root, order, device, buffer.nbytes, True,
                                   hop), buffer, tag, scope)
        if work is not None:  # (asked to broadcast, not to issue: done when it returns)
            work.block(scope, f"broadcast[{desc}] root {root}")

    def _move(self, hop: Hop, route: Route, buffer: Any, tag: int, scope: CancelScope) -> None:
        """This rank's part of the chain with ``buffer``: the root's data, or where it lands
        (a staging copy first when the buffer is a strided view)."""
        if route.device == route.root and not buffer.flags.c_contiguous:
            raise OverlapRuntimeError(f"{route.what}: the root's buffer is not contiguous")
        landing = buffer if buffer.flags.c_contiguous else np.empty(buffer.shape, buffer.dtype)
        self._chain(hop, route.what, landing.reshape(-1).view(np.uint8), tag, scope)
        if landing is not buffer:
            np.copyto(buffer, landing)

    def _chain(self, hop: Hop, what: str, data: np.ndarray, tag: int,
               scope: CancelScope) -> None:
        """Receive ``data`` from ``hop.prev`` (unless this rank is the root) and pass it on to
        ``hop.next``, in pieces (both ends of a hop cut the same), each forwarded as soon as
        it has landed."""
        prev, nxt, n, step = hop.prev, hop.next, data.nbytes, hop.piece
        pieces = [data[i:i + step] for i in range(0, n, step)] or [data[:0]]
        posted = time.perf_counter()
        recvs = [self._wire(prev, step).irecv(hop.channel, prev, tag, p) for p in pieces] \
            if prev is not None else []
        sends = [self._wire(nxt, step).isend(hop.channel, nxt, tag, p) for p in pieces] \
            if prev is None and nxt is not None else []
        landed = None
        try:
            for k, r in enumerate(recvs):
                self._wait(r, scope, what, prev, f"rank {prev} never sent it")
                if r.count != pieces[k].nbytes:
                    raise CollectiveMismatch(f"{what}: rank {self.rank} received {r.count} "
                                             f"bytes from rank {prev} where "
                                             f"{pieces[k].nbytes} were expected (different "
                                             "plans?)")
                if nxt is not None:
                    sends.append(self._wire(nxt, step).isend(hop.channel, nxt, tag, pieces[k]))
            landed = time.perf_counter() if recvs else None
            for s in sends:
                self._wait(s, scope, what, nxt, f"rank {nxt} never received it")
        except BaseException:
            for r in recvs:
                if not r.over:
                    r.Cancel()
            raise
        if self.hop_timings is not None:
            self.hop_timings.append(HopTiming(tag, prev, nxt, n, posted, landed,
                                              time.perf_counter()))

    def _wire(self, peer: int | None, size: int) -> Any:
        links = self.links
        if links is not None and peer is not None and links.has(peer) and (
                size <= LINK_MAX_PIECE_BYTES or self.mpi is None):
            return links
        return self.mpi

    def _wait(self, c: Completion, scope: CancelScope, what: str, peer: int | None,
              who: str) -> None:
        """Until ``c`` is done: past the timeout, while the peer is at work (see module doc),
        on; else :class:`~overlap.errors.CollectiveTimeout` naming it."""
        def overdue() -> bool:
            self.dist.overdue(what, () if peer is None else (peer,), who, scope)
            return True  # (the peer is at work: on)

        c.block(scope, what, self.timeout, overdue)

    # ---- stage collectives across ranks ---------------------------------------------------

    def all_reduce(self, group: tuple[int, ...], device: int, buffer: Any, desc: str,
                   op: Callable[[Any, Any], Any], namespace: str, tag: int | None,
                   scope: CancelScope) -> None:
        what = f"all_reduce[{desc}]"

        def combine(bufs: dict[int, Any]) -> float:
            parts = self._exchange(namespace, group, bufs, tag, what, local, scope)
            total = reduce_in_order(parts, group, op)  # device order: one process's, bit for bit
            for b in bufs.values():
                np.copyto(b, total)
            return 0.0

        local = self.comms.get(f"{namespace}@all", self._locals(group))
        local.run(device, what, buffer, combine, scope)

    def all_gather(self, group: tuple[int, ...], device: int, buffer: Any, out: Any,
                   desc: str, namespace: str, tag: int | None, scope: CancelScope) -> None:
        what = f"all_gather[{desc}]"

        def combine(pairs: dict[int, tuple[Any, Any]]) -> float:
            parts = self._exchange(namespace, group, {d: p[0] for d, p in pairs.items()}, tag,
                                   what, local, scope)
            stacked = np.stack([parts[d] for d in group])
            for _, o in pairs.values():
                np.copyto(o, stacked)
            return 0.0

        local = self.comms.get(f"{namespace}@all", self._locals(group))
        local.run(device, what, (buffer, out), combine, scope)

    def _locals(self, group: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(d for d in group if self.placement.owners[d] == self.rank)

    def _exchange(self, namespace: str, group: tuple[int, ...], bufs: dict[int, Any],
                  tag: int | None, what: str, local: Any, scope: CancelScope
                  ) -> dict[int, Any]:
        """Every participant's buffer, on every rank of ``group``."""
        channel = self._channel(namespace, what)
        if tag is None:
            gid = self._group_ids.get((namespace, group))
            if gid is None:
                raise OverlapRuntimeError(f"{what}: group {list(group)} spans ranks but was not "
                                          "prepared on this rank")
            tag = gid << GROUP_TAG_BITS | (local.position & ((1 << GROUP_TAG_BITS) - 1))
        check_alike(bufs, what)
        mine = sorted(bufs)
        shape, dtype = bufs[mine[0]].shape, bufs[mine[0]].dtype
        packed = np.ascontiguousarray(np.stack([bufs[d] for d in mine]))
        by_rank: dict[int, list[int]] = {}
        for d in group:
            by_rank.setdefault(self.placement.owners[d], []).append(d)
        others = [r for r in by_rank if r != self.rank]
        inbox = {r: np.empty((len(by_rank[r]), *shape), dtype) for r in others}
        wire: Any = self.mpi if self.mpi is not None else self.links
        # (As bytes: MPI reads a numpy array through DLPack, which has no narrow floats.)
        recvs = {r: wire.irecv(channel, r, tag, inbox[r].reshape(-1).view(np.uint8))
                 for r in others}
        sends = [wire.isend(channel, r, tag, packed.reshape(-1).view(np.uint8))
                 for r in others]
        try:
            for r, c in recvs.items():
                self._wait(c, scope, what, r, f"rank {r} never sent its part")
                if c.count != inbox[r].nbytes:
                    raise CollectiveMismatch(f"{what}: rank {r} sent {c.count} bytes, expected "
                                             f"{inbox[r].nbytes} (buffers of different shapes?)")
            for s in sends:
                self._wait(s, scope, what, s.peer, "a peer never received this rank's part")
        except BaseException:
            for c in recvs.values():
                if not c.over:
                    c.Cancel()
            raise
        parts = {d: bufs[d] for d in mine}
        for r in others:
            for i, d in enumerate(by_rank[r]):
                parts[d] = inbox[r][i]
        return parts

    def receives_strided(self, group: Sequence[int]) -> bool:
        return True

    def forget(self) -> None:
        """After a failed call: this rank's rendezvous start again."""
        self.comms.forget()

    def close(self) -> None:
        if self.mpi is not None:
            self.mpi.close()


class WireWork(OneShot):
    """A transfer part's messages in flight
    (:class:`~overlap.backends.devices.streams.DeviceWork`): done once the engine completed
    every one of them (and a receive's sizes were right). It is bounded as every wait on the
    wire: past the timeout, the peer is asked how far it got
    (:meth:`Distributed.overdue <overlap.backends.job.distributed.Distributed.overdue>`). A
    failure — a message of the wrong size, a link that failed — fails the call's scope; the
    scope's cancellation takes the receives back (and fails it: that is how a cancellation
    reaches its waits)."""

    def __init__(self, transport: WireTransport, parts: list[Completion], what: str,
                 peer: int, who: str, scope: CancelScope, sizes: list[int] | None,
                 timing: Callable[[float | None], None] | None) -> None:
        super().__init__()
        self.transport, self.parts, self.what = transport, parts, what
        self.peer, self.who, self.scope = peer, who, scope
        self._sizes, self._timing = sizes, timing
        self._cancel = scope.on_cancel(self._take_back)
        if self._cancel is None:  # (cancelled already)
            self._take_back()
            return
        when_all(parts, self._all_over)

    @property
    def done(self) -> bool:
        return self._over and self._error is None

    def _all_over(self) -> None:
        error = next((c.error for c in self.parts if c.error is not None), None)
        if error is None and self._sizes is not None:
            for c, want in zip(self.parts, self._sizes):
                if c.count != want:
                    error = CollectiveMismatch(
                        f"{self.what}: rank {self.transport.rank} received {c.count} bytes "
                        f"from rank {self.peer} where {want} were expected (different plans?)")
                    break
        self.finish(error)

    def _on_finish(self, error: BaseException | None) -> None:
        self.scope.remove(self._cancel)
        if error is not None and not isinstance(error, CollectiveAborted):
            self.scope.fail(error)
        if error is None and self._timing is not None:
            self._timing(time.perf_counter() if self._sizes is not None else None)

    def _take_back(self) -> None:
        self._give_up(self.scope.aborted(self.what))

    def _give_up(self, error: BaseException) -> None:
        """Over with ``error``: the receives still pending are taken back first (a message
        that comes later goes to the next receive, not to this buffer)."""
        for c in self.parts:
            if not c.over:
                c.Cancel()
        self.finish(error)

    def _overdue(self, scope: CancelScope) -> bool:
        """Past the timeout: on, while the peer is at work; else give up, naming it."""
        try:
            self.transport.dist.overdue(self.what, (self.peer,), self.who, scope)
        except BaseException as exc:
            self._give_up(exc)
            raise
        return True

    def block(self, scope: CancelScope, what: str) -> None:
        """Block this thread until it is done (raising what failed it, or at the scope's
        cancellation): past the timeout, the liveness rule."""
        block_on(self, scope, what, self.transport.timeout, lambda: self._overdue(scope))
        if self._error is not None:
            raise self._error

    async def wait(self, _: Any = None) -> None:
        """Await it on the event loop (raising what failed it; a cancellation fails it):
        past the timeout, the liveness rule, asked off the loop."""
        await wait_on(self, None, self.what, self.transport.timeout, self._ask)
        if self._error is not None:
            raise self._error

    async def _ask(self) -> bool:
        return await asyncio.to_thread(self._overdue, self.scope)


__all__ = ["GROUP_TAG_BITS", "LINK_MAX_PIECE_BYTES", "Hop", "HopTiming", "WireTransport",
           "WireWork", "piece_bytes"]
