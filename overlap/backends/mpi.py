"""The CPU backend across processes: each MPI rank drives its own devices; collectives that
span ranks move bytes with nonblocking MPI point-to-point operations. (What every
multi-process backend shares — ownership, per-call agreement, failure notices, exit — is in
``distributed.py``; the GPU flavour is ``cuda_mpi.py``.)

Every process lowers the same step graph and launches only its own devices' lanes (the
runtime checks every call against the other ranks — see ``Runtime``). Inside a process
nothing changes: a stream is a thread, and a collective first rendezvouses the process's own
participants by launch position (as on the one-process backend).

**Communicators — a bounded number.** One per channel namespace (``declare_group``: each
pipeline boundary in each direction, each stream name a standalone resharding uses), one for
stage collectives, one for the runtime's own small messages and one for failure notices; all
are duplicates of ``COMM_WORLD`` created on the main thread in the same order on every rank.
A pipeline of p stages uses 2 (p − 1) + 3 of them whatever its plans' device sets (plus one
for the NCCL bootstrap on the GPU flavour), and one more per lane above 0 a channel's plan
uses (``Transfer.lane``: a lane is a stream of its own, so a namespace of its own).

**Matching by tag, not by order.** Within a channel every transfer has a global index (the
resharding's id × transfers per plan + its index in the plan); it is the MPI tag of its
messages. Threads of one rank reach different transfers of a channel in different orders than
the threads of another rank (they are different devices), and tags make that harmless: a
receive matches exactly its transfer's messages whatever was posted before — no launch order
across ranks to agree on, so ranks cannot deadlock on ordering. Stage collectives use
(group id, launch position) as the tag; group ids come from the stage meshes, which every rank
registers in the same order.

**Data movement.** A broadcast runs as a chain over the ranks it spans, in the plan's receiver
order (the chain the cost model prices). The local rendezvous only picks a leader (the root,
else the first local receiver) and shares the buffers: the leader moves the bytes — in pieces,
each forwarded as soon as it lands, when the chain has three ranks or more or a rank fans out
locally; else one message per hop — while each other local participant copies every piece
into its own buffer as it lands (a strided destination view: one copy once all landed). How
many pieces is a pipelining trade-off (:func:`piece_bytes`): each piece costs a fixed
``PIECE_OVERHEAD_S`` (a poll's wake-up, a message's rendezvous), and more pieces shorten the
pipeline's fill; the optimum is sqrt(bytes / bandwidth × (stages − 1) / overhead) pieces.
All-reduce and all-gather exchange every rank's contributions and reduce them in device order
on every rank, so results are bit-for-bit those of the one-process backend.

**Host links.** Between the ranks of one host, pieces of at most ``LINK_MAX_PIECE_BYTES``
go over Unix sockets (``host_links.py``, made by ``Distributed``), not MPI: a send completes
once the kernel has its bytes, and a receive's step is woken by its message (``step_waker``)
instead of being polled — on a host with fewer cores than ranks, the wake-ups of polling were
most of a training step's CPU (docs/benchmarks.md). Larger pieces, and ranks on other hosts,
use MPI as below; ``OVERLAP_HOST_LINKS=0`` (or ``host_links=False``) sends everything over MPI.

**Progress.** A transfer whose device is its rank's only participant is a stepped op
(:meth:`MpiBackend.broadcast_steps`, see ``CpuStream.launch``): a first step posts its
requests, later ones ``Test`` them, with exponential backoff (20 µs doubling to 200 µs)
between. Whoever needs it steps it (``helping``): the producer's thread posts a send as soon
as it records its output; the consumer's thread, waiting for the receive, sees it land and
runs on at once; the stream's own thread steps it while no one else does — someone must,
since a rendezvous send completes only once the receiving process called into MPI. With
several participants on the rank, the stream thread polls after the local rendezvous. The
asyncio loop never calls a blocking MPI function. Blocking MPI
calls busy-poll inside the library, which on a machine with fewer cores than ranks starves
the very processes that must make progress; ``benchmarks/mpi_reshard.py`` measures this
choice against spinning and against a fixed sleep. A receive is usually posted long before
its sender sends (it waits for the pipeline), so it first sleeps through half the wait that
receives from that peer on that communicator saw before (``adaptive_wait``; measured in
``benchmarks/mpi_step_profile.py``: half the tests, −5 % CPU).

**Failures.** A rank whose step fails tells every other rank (``RankFailed`` there, naming it
and its error); a control thread per process listens for that. After a failure across
processes the job cannot continue (MPI cannot take back messages in flight): the runtime stays
failed, and at exit a failed process waits briefly for its peers to report, then calls
``MPI_Abort`` so the launcher ends every rank and returns non-zero. An exception that escapes
the user's script on one rank does the same. A stuck transfer raises ``CollectiveTimeout``
naming the operation and the rank that never sent (or received) it. A rank killed by a signal
cannot report and MPICH ends the others within a second: ``python -m overlap.guard`` names it
(see ``overlap/guard.py``); without it ``mpiexec`` prints a pid, which the runtime's log line
``rank r/N (pid P on host): devices ...`` ties to a rank.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..errors import CollectiveAborted, CollectiveMismatch, OverlapRuntimeError
from ..world import Placement, World
from .cpu import _POLL_S, Communicator, CpuBackend, step_waker, waking
from .distributed import Backoff, Distributed, _cancel

# A wait on a host link is woken by its message (step_waker): the step asks to be looked at
# only this much later — to check for a timeout; aborts are seen within _POLL_S anyway.
LINK_RECHECK_S = 5 * _POLL_S
# Larger pieces go over MPI even between the ranks of a host: a socket copies twice and a
# message that comes before its receive is posted is kept in a copy (MPI's rendezvous waits
# for the receive instead); the polling MPI costs is small next to moving megabytes
# (benchmarks/mpi_reshard.py, docs/benchmarks.md).
LINK_MAX_PIECE_BYTES = 1 << 20

GROUP_TAG_BITS = 16  # stage collectives: tag = group id << 16 | launch position (mod 2**16)


class MpiBackend(CpuBackend):
    """Virtual devices of one rank of an MPI job (see module doc)."""

    name = "cpu"
    helping = True  # its cross-rank transfers are stepped ops (see steps_broadcast)

    def __init__(self, num_devices: int, *, world: World, placement: Placement,
                 timeout: float = 30.0, poll: Backoff | None = None,
                 chunk_bytes: int | None = None, grace: float = 5.0,
                 host_links: bool | None = None) -> None:
        """``chunk_bytes``: the size of a broadcast's pieces; ``None`` (default) chooses it
        per broadcast with :func:`piece_bytes`. ``host_links``: move transfers between
        ranks of one host over Unix sockets (see ``host_links.py``) rather than MPI; None
        (default): yes, unless the environment sets ``OVERLAP_HOST_LINKS=0``. Every rank
        must pass the same."""
        if chunk_bytes is not None and (isinstance(chunk_bytes, bool)
                                        or not isinstance(chunk_bytes, int) or chunk_bytes < 1):
            raise ValueError(f"chunk_bytes: expected an int >= 1 or None, got {chunk_bytes!r}")
        super().__init__(num_devices, timeout=timeout, placement=placement, rank=world.rank)
        self.dist = Distributed(self, world, placement, poll=poll, grace=grace,
                                host_links=host_links)
        self.MPI = self.dist.MPI
        comm = self.dist.comm
        self.chunk_bytes = chunk_bytes
        self.tag_ub = self.dist.tag_ub
        # Collective over every rank, in the same order everywhere (main thread).
        # The data plane's links (None: every byte over MPI; mpi_step_profile.py turns them
        # off step by step to compare — the runtime's rounds keep dist.links).
        self.links = self.dist.links
        self._channels: dict[str, Any] = {"compute": comm.Dup()}
        self._channel_ids: dict[str, int] = {"compute": 0}  # the same on every rank
        self._group_ids: dict[tuple[str, tuple[int, ...]], int] = {}
        self._local_comms: dict[tuple[str, tuple[int, ...]], Communicator] = {}
        # Set to a list to time every cross-rank hop this rank takes part in (a
        # ``HopTiming`` each; ``benchmarks/mpi_step_profile.py``); None: not timed.
        self.hop_timings: list[HopTiming] | None = None
        # How long receives from a peer on a communicator waited for their first piece
        # (a moving average): the next one sleeps through a part of that before it polls.
        self._early: dict[tuple[int, int], float] = {}
        self.adaptive_wait = True  # False: poll with the backoff from the start
        self._stepped: dict[tuple[frozenset[int], int], bool] = {}  # steps_broadcast's answers
        self._places: dict[tuple[int, tuple[int, ...], str], tuple] = {}  # see _hop

    # ---- communicators -------------------------------------------------------------------

    def declare_group(self, namespace: str, devices: Sequence[int]) -> None:
        """A channel: its communicator is made the first time (every rank, same order). The
        making is collective, and a rank may reach it while others are still in the call
        before (one it took no part in), or never (a peer that failed there): its wait is
        bounded — it ends at a failure notice, or past the timeout, naming the ranks."""
        if namespace not in self._channels:
            comm, req = self.dist.runtime_comm.Idup()
            self.dist.wait_polled(req, f"making channel {namespace!r}'s communicator (with "
                                  "every rank)", patient=True)
            self._channels[namespace] = comm
            self._channel_ids[namespace] = len(self._channel_ids)

    def declare_subgroups(self, namespace: str, groups: Sequence[Sequence[int]]) -> None:
        """Give each device group of stage collectives an id (every rank, same order)."""
        limit = (self.tag_ub >> GROUP_TAG_BITS) + 1
        for g in groups:
            key = (namespace, tuple(sorted(set(g))))
            if key not in self._group_ids:
                if len(self._group_ids) >= limit:
                    raise OverlapRuntimeError(f"more than {limit} collective groups: MPI's tag "
                                              f"range ({self.tag_ub}) has no room for more")
                self._group_ids[key] = len(self._group_ids)

    def _comm(self, namespace: str, desc: str) -> Any:
        try:
            return self._channels[namespace]
        except KeyError:
            raise OverlapRuntimeError(f"{desc}: namespace {namespace!r} spans processes but was "
                                      "never declared (declare_group) on this rank") from None

    def _local_part(self, namespace: str, group: tuple[int, ...]) -> Communicator:
        """The rendezvous of this rank's participants in collectives of ``group``."""
        key = (namespace, group)
        with self._lock:
            c = self._local_comms.get(key)
            if c is None:
                c = self._local_comms[key] = Communicator(
                    self, tuple(d for d in group if self.is_local(d)))
            return c

    def _tag(self, tag: int) -> int:
        return tag % (self.tag_ub + 1)

    # ---- collectives ---------------------------------------------------------------------

    def steps_broadcast(self, devices: Sequence[int], device: int) -> bool:
        """Stepped where the broadcast spans ranks and ``device`` is its rank's only
        participant: nothing to rendezvous locally, so its part is MPI requests posted, then
        tested — steps that never block (see ``CpuStream.launch``)."""
        key = (tuple(devices), device)  # (a tuple: cheaper to make than a set, every call)
        known = self._stepped.get(key)
        if known is None:  # (asked for every transfer part at every launch: kept)
            group = frozenset(devices)
            known = self._stepped[key] = (len(self.placement.ranks_of(tuple(group))) > 1
                                          and sum(1 for d in group if self.is_local(d)) == 1)
        return known

    def broadcast_steps(self, devices: Sequence[int], device: int, root: int,
                        buffer: np.ndarray, desc: str, namespace: str = "",
                        tag: int | None = None) -> Iterator[float]:
        if not self.steps_broadcast((root, *devices), device):
            raise OverlapRuntimeError(f"broadcast[{desc}]: device {device}'s part is not "
                                      "stepped (it shares its rank with other participants)")
        hop = self._hop(devices, root, desc, namespace, tag)
        if device == root and not buffer.flags.c_contiguous:
            raise OverlapRuntimeError(f"{hop.what}: the root's buffer is not contiguous")
        # Where the bytes land: the buffer, or a staging copy when it is a strided view.
        landing = buffer if buffer.flags.c_contiguous else np.empty(buffer.shape, buffer.dtype)
        data = landing.reshape(-1).view(np.uint8)
        peer = hop.next if hop.prev is None else hop.prev
        if (self.hop_timings is None and (hop.prev is None or hop.next is None)
                and peer is not None and self._one_link_piece(hop, peer, data.nbytes)):
            yield from self._link_steps(hop, data)
        else:
            yield from self._chain_steps(hop, data, lambda upto: None)
        if landing is not buffer:
            np.copyto(buffer, landing)

    def _hop(self, devices: Sequence[int], root: int, desc: str, namespace: str,
             tag: int | None) -> _Hop:
        """This rank's place in a broadcast's chain over ranks (the plan's receiver order)."""
        what = f"broadcast[{desc}] root {root}"
        if tag is None:
            chain = self.placement.ranks_of(tuple(dict.fromkeys((root, *devices))))
            raise OverlapRuntimeError(f"{what}: spans ranks {list(chain)} and needs a tag")
        key = (root, tuple(devices), namespace)
        place = self._places.get(key)  # (the same for every call of a plan: kept)
        if place is None:
            place = self._places[key] = self._place(root, devices, namespace, what)
        comm, channel, prev, nxt, stages = place
        return _Hop(what, comm, channel, prev, nxt, self._tag(tag), stages)

    def _place(self, root: int, devices: Sequence[int], namespace: str, what: str
               ) -> tuple[Any, int, int | None, int | None, int]:
        """What :meth:`_hop` returns but the name and the tag."""
        order = tuple(dict.fromkeys((root, *devices)))
        chain = self.placement.ranks_of(order)
        comm = self._comm(namespace, what)
        group = tuple(sorted(order))
        me = chain.index(self.rank)
        # Pieces when someone forwards them (a chain of 3+ ranks) or copies them on to other
        # devices of its rank as they land; every rank computes the same size from the group.
        per_rank = [sum(1 for d in group if self.placement.owners[d] == r) for r in chain]
        # Pipeline stages after the first hop: more hops, and the local copies on a rank
        # that fans out (they follow the pieces landing there).
        stages = len(chain) - 1 + (1 if any(k > 1 for k in per_rank[1:]) else 0)
        return (comm, self._channel_ids[namespace], chain[me - 1] if me else None,
                chain[me + 1] if me + 1 < len(chain) else None, stages)

    def _piece(self, hop: _Hop, nbytes: int) -> int:
        if self.chunk_bytes is not None and hop.stages > 1:
            return self.chunk_bytes
        return piece_bytes(nbytes, hop.stages)

    def broadcast(self, devices: Sequence[int], device: int, root: int, buffer: np.ndarray,
                  desc: str, namespace: str = "", tag: int | None = None) -> None:
        order = tuple(dict.fromkeys((root, *devices)))
        if self.placement.ranks_of(order) == (self.rank,):
            return super().broadcast(devices, device, root, buffer, desc, namespace)
        if self.steps_broadcast(order, device):
            _drive(self.broadcast_steps(devices, device, root, buffer, desc, namespace, tag),
                   self)
            return None
        hop = self._hop(devices, root, desc, namespace, tag)
        what = hop.what

        def combine(bufs: dict[int, np.ndarray]) -> tuple[float, _Relay]:
            leader = root if root in bufs else next(d for d in order if d in bufs)
            src = bufs[leader]
            for d, b in bufs.items():
                if b.shape != src.shape or b.dtype != src.dtype:
                    raise CollectiveMismatch(f"{what}: device {d} buffer {b.shape} {b.dtype} != "
                                             f"device {leader} buffer {src.shape} {src.dtype}")
            if leader == root and not src.flags.c_contiguous:
                raise OverlapRuntimeError(f"{what}: the root's buffer is not contiguous")
            return 0.0, _Relay(bufs, leader)

        # The rendezvous of this rank's participants only picks the leader and shares buffers;
        # the leader then moves the bytes while the others copy each piece as it lands.
        local = self._local_part(namespace, tuple(sorted(order)))
        relay: _Relay = local.run(device, what, buffer, combine)
        if device != relay.leader:
            relay.follow(device, self, what)
            return None
        data = relay.source.reshape(-1).view(np.uint8)
        try:
            if hop.prev is None:
                relay.publish(data.nbytes)  # the root holds it all already
            _drive(self._chain_steps(hop, data, relay.publish), self)
        except BaseException as exc:
            relay.fail(exc)
            raise
        if relay.source is not relay.bufs[device]:
            np.copyto(relay.bufs[device], relay.source)  # the leader's strided destination
        relay.wait_followers(self, what)
        return None

    def all_reduce(self, devices: Sequence[int], device: int, buffer: np.ndarray, desc: str,
                   op: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.add,
                   namespace: str = "", tag: int | None = None) -> None:
        group = tuple(sorted(set(devices)))
        if self.placement.ranks_of(group) == (self.rank,):
            return super().all_reduce(devices, device, buffer, desc, op, namespace)
        what = f"all_reduce[{desc}]"

        def combine(bufs: dict[int, np.ndarray]) -> float:
            parts = self._exchange(namespace, group, bufs, tag, what)
            total = parts[group[0]].copy()  # device order: the one-process result, bit for bit
            for d in group[1:]:
                total = op(total, parts[d])
            for b in bufs.values():
                np.copyto(b, total)
            return 0.0

        self._local_part(namespace, group).run(device, what, buffer, combine)
        return None

    def all_gather(self, devices: Sequence[int], device: int, buffer: np.ndarray,
                   out: np.ndarray, desc: str, namespace: str = "",
                   tag: int | None = None) -> None:
        group = tuple(sorted(set(devices)))
        if self.placement.ranks_of(group) == (self.rank,):
            return super().all_gather(devices, device, buffer, out, desc, namespace)
        what = f"all_gather[{desc}]"

        def combine(pairs: dict[int, tuple[np.ndarray, np.ndarray]]) -> float:
            parts = self._exchange(namespace, group, {d: p[0] for d, p in pairs.items()}, tag,
                                   what)
            stacked = np.stack([parts[d] for d in group])
            for _, o in pairs.values():
                np.copyto(o, stacked)
            return 0.0

        self._local_part(namespace, group).run(device, what, (buffer, out), combine)
        return None

    # ---- MPI point-to-point, polled ------------------------------------------------------

    def _one_link_piece(self, hop: _Hop, peer: int, nbytes: int) -> bool:
        """Whether ``nbytes`` go to (come from) ``peer`` in one piece over a host link."""
        links = self.links
        return (links is not None and nbytes <= LINK_MAX_PIECE_BYTES
                and self._piece(hop, nbytes) >= nbytes and links.has(peer))

    def _link_steps(self, hop: _Hop, data: np.ndarray) -> Iterator[float]:
        """:meth:`_chain_steps` for the commonest hop, kept lean (every transfer of a step
        pays for it): one piece over a host link, sent by the root to the next rank, or
        received by the last rank from the one before. A send completes once the kernel
        has its bytes; a receive's step is woken by its message."""
        links = self.links
        assert links is not None
        started = time.perf_counter()  # (before the post: a link's send lands at once)
        if hop.prev is None:
            req = links.isend(hop.channel, hop.next, hop.tag, data)
            who, peer = f"rank {hop.next} never received it", hop.next
        else:
            req = links.irecv(hop.channel, hop.prev, hop.tag, data)
            who, peer = f"rank {hop.prev} never sent it", hop.prev
        try:
            while not req.Test():
                self.dist.check_transfer(hop.what, started, who, peer)
                until = _armed(req, time.perf_counter())
                if until is not None:
                    yield until
        except BaseException:
            _cancel([req] if hop.prev is not None else [])
            raise
        if hop.prev is not None and req.count != data.nbytes:
            raise _size_mismatch(hop, self.rank, req.count, data.nbytes)

    def _chain_steps(self, hop: _Hop, data: np.ndarray,
                     landed_to: Callable[[int], None]) -> Iterator[float]:
        """Receive ``data`` from ``hop.prev`` (unless this rank is the root) and pass it on to
        ``hop.next``, in pieces (both ends of a hop cut the same), each forwarded as soon as it
        has landed; ``landed_to(k)``: the first k bytes are here. Steps (see
        ``CpuStream.launch``): post, then test, yielding when to test again."""
        MPI, prev, nxt, tag, what = self.MPI, hop.prev, hop.next, hop.tag, hop.what
        n = data.nbytes
        step = self._piece(hop, n)
        post_recv, recv_link = self._poster(hop, prev, step, receive=True)
        post_send, send_link = self._poster(hop, nxt, step, receive=False)
        pieces = [data[i:i + step] for i in range(0, n, step)] or [data[:0]]
        started = time.perf_counter()  # (before the posts: a link's send lands at once)
        recvs = [post_recv(p) for p in pieces] if prev is not None else []
        sends = [post_send(p) for p in pieces] if prev is None and nxt is not None else []
        # Nothing to poll: every wait is for a link's message, which wakes the step.
        woken = (recv_link or prev is None) and (send_link or nxt is None)
        landed = 0
        # (A link's request keeps its count; a root receives nothing.)
        status = None if recv_link or prev is None else MPI.Status()
        seen = None  # when the last piece was seen landed (receivers)
        attempt = polls = 0
        key = (id(hop.comm), -1 if prev is None else prev)
        # A receive is usually posted long before its sender sends (it waits for the
        # pipeline): once, it sleeps through half the usual wait instead of testing all along.
        # (The same for sends, which wait for their receiver, changed nothing: measured.)
        quiet = (started + 0.5 * self._early.get(key, 0.0)
                 if recvs and self.adaptive_wait and not recv_link else 0.0)
        try:
            while True:
                moved = False
                polls += 1
                while landed < len(recvs) and recvs[landed].Test(status):
                    got = recvs[landed].count if recv_link else status.Get_count(MPI.BYTE)
                    if got != pieces[landed].nbytes:
                        raise _size_mismatch(hop, self.rank, got, pieces[landed].nbytes)
                    if nxt is not None:
                        sends.append(post_send(pieces[landed]))
                    landed += 1
                    if landed == 1:
                        waited = time.perf_counter() - started
                        self._early[key] = 0.5 * (self._early.get(key, waited) + waited)
                    landed_to(min(n, landed * step))
                    moved = True
                    if landed == len(recvs):
                        seen = time.perf_counter()
                if landed == len(recvs) and (all(r.Test() for r in sends) if send_link
                                             else MPI.Request.Testall(sends)):
                    if self.hop_timings is not None:
                        self.hop_timings.append(HopTiming(
                            tag, prev, nxt, n, started, seen, time.perf_counter(), polls))
                    return
                if moved:
                    attempt = 0
                    continue
                who = (f"rank {prev} never sent it" if landed < len(recvs)
                       else f"rank {nxt} never received it")
                self.dist.check_transfer(what, started, who, prev if landed < len(recvs) else nxt)
                now = time.perf_counter()
                if woken:  # (else: polled)
                    until = _armed(recvs[landed] if landed < len(recvs) else sends[-1], now)
                    if until is not None:
                        yield until
                    continue
                left = quiet - now if landed == 0 else 0.0
                if left > 0:
                    # In 2 ms slices, each a test: one sleep through the quiet would see a
                    # message that came meanwhile only at its end, so the wait learned would
                    # never fall below half the last one (tried: fewer tests, but a long
                    # wait then made every later receive on the link late).
                    yield now + min(2e-3, left)
                    continue
                yield now + self.dist.poll.delay(attempt)
                attempt += 1
        except BaseException:
            _cancel(recvs[landed:])
            raise

    def _poster(self, hop: _Hop, peer: int | None, size: int, receive: bool
                ) -> tuple[Callable[[np.ndarray], Any], bool]:
        """What posts a piece's receive from (send to) ``peer``, and whether it goes over a
        host link (a wait woken by the message) rather than MPI (a wait polled): where there
        is one and pieces (of ``size`` bytes at most) are at most ``LINK_MAX_PIECE_BYTES``
        (both ends cut the same)."""
        links = self.links
        if (links is not None and peer is not None and size <= LINK_MAX_PIECE_BYTES
                and links.has(peer)):
            post = links.irecv if receive else links.isend
            return (lambda piece: post(hop.channel, peer, hop.tag, piece)), True
        if receive:
            return (lambda piece: hop.comm.Irecv(piece, peer, hop.tag)), False
        return (lambda piece: hop.comm.Isend(piece, peer, hop.tag)), False

    def _exchange(self, namespace: str, group: tuple[int, ...], bufs: dict[int, np.ndarray],
                  tag: int | None, what: str) -> dict[int, np.ndarray]:
        """Every participant's buffer, on every rank of ``group``."""
        comm = self._comm(namespace, what)
        if tag is None:
            gid = self._group_ids.get((namespace, group))
            if gid is None:
                raise OverlapRuntimeError(f"{what}: group {list(group)} spans ranks but was not "
                                          "declared (declare_subgroups) on this rank")
            pos = self._local_part(namespace, group).position
            tag = gid << GROUP_TAG_BITS | (pos & ((1 << GROUP_TAG_BITS) - 1))
        tag = self._tag(tag)
        mine = [d for d in group if d in bufs]
        shape, dtype = bufs[mine[0]].shape, bufs[mine[0]].dtype
        for d in mine:
            if bufs[d].shape != shape or bufs[d].dtype != dtype:
                raise CollectiveMismatch(f"{what}: device {d} buffer {bufs[d].shape} "
                                         f"{bufs[d].dtype} != device {mine[0]} buffer {shape} "
                                         f"{dtype}")
        packed = np.ascontiguousarray(np.stack([bufs[d] for d in mine]))
        by_rank: dict[int, list[int]] = {}
        for d in group:
            by_rank.setdefault(self.placement.owners[d], []).append(d)
        others = [r for r in by_rank if r != self.rank]
        inbox = {r: np.empty((len(by_rank[r]), *shape), dtype) for r in others}
        MPI = self.MPI
        recvs = [comm.Irecv(inbox[r], r, tag) for r in others]
        sends = [comm.Isend(packed, r, tag) for r in others]
        statuses = [MPI.Status() for _ in others]
        done = [False] * len(others)
        started = time.perf_counter()
        attempt = 0
        try:
            while True:
                for i, req in enumerate(recvs):
                    if not done[i] and req.Test(statuses[i]):
                        done[i] = True
                        if statuses[i].Get_count(MPI.BYTE) != inbox[others[i]].nbytes:
                            raise CollectiveMismatch(
                                f"{what}: rank {others[i]} sent "
                                f"{statuses[i].Get_count(MPI.BYTE)} bytes, expected "
                                f"{inbox[others[i]].nbytes} (buffers of different shapes?)")
                if all(done) and MPI.Request.Testall(sends):
                    break
                waiting = [others[i] for i in range(len(others)) if not done[i]]
                self.dist.check_transfer(what, started,
                                         f"ranks {waiting} never sent their part" if waiting
                                         else "a peer never received this rank's part",
                                         waiting[0] if waiting else None)
                self.dist.poll.pause(attempt)
                attempt += 1
        except BaseException:
            _cancel([r for r, ok in zip(recvs, done) if not ok])
            raise
        parts = {d: bufs[d] for d in mine}
        for r in others:
            for i, d in enumerate(by_rank[r]):
                parts[d] = inbox[r][i]
        return parts

def _drive(steps: Iterator[float], backend: MpiBackend) -> None:
    """Run a stepped op's steps on this thread, sleeping between them as they ask — at most
    ``_POLL_S`` at a time, and no longer once the backend is aborted (the next step sees it)
    or a step's waker is called (see ``step_waker``)."""
    ready = threading.Event()
    it = iter(steps)
    while True:
        with waking(ready.set):
            until = next(it, None)
        if until is None:
            return
        while (left := until - time.perf_counter()) > 0 and backend.abort_reason is None:
            if ready.wait(min(left, _POLL_S)):
                break
        ready.clear()


def _size_mismatch(hop: _Hop, rank: int, got: int, want: int) -> CollectiveMismatch:
    return CollectiveMismatch(f"{hop.what}: rank {rank} received {got} bytes from rank "
                              f"{hop.prev} where {want} were expected (different plans?)")


def _armed(pending: Any, now: float) -> float | None:
    """A host link's request to wait for: have the step's waker called when it completes,
    and the time to look anyway (for timeouts); None: it completed meanwhile, look again
    now."""
    wake = step_waker()
    if wake is None:  # (steps taken by hand: poll)
        return now + 50e-6
    return now + LINK_RECHECK_S if pending.notify(wake) else None


class _Hop(NamedTuple):
    """A rank's place in one broadcast's chain: the rank it receives from and the one it
    passes the data on to (None: it is the root, the last), the message tag, and the stages
    of the pipeline the pieces go through (for their size); the channel's communicator and
    its id on host links."""

    what: str
    comm: Any
    channel: int
    prev: int | None
    next: int | None
    tag: int
    stages: int


class HopTiming(NamedTuple):
    """One rank's part in one hop of a transfer, in ``time.perf_counter`` seconds (one clock
    for every process of a host): posted its receive or send, saw the last piece land
    (receivers; None on the root), saw its part complete; ``polls``: tests it made."""

    tag: int
    prev: int | None  # the rank it receives from (None: the root)
    nxt: int | None  # the rank it sends to
    nbytes: int
    posted: float
    landed: float | None
    done: float
    polls: int


# The constants of the piece-size model, measured on the 2-core machine of
# docs/benchmarks.md (4 ranks): shared-memory copies move ~10 GB/s, and a piece costs
# ~0.2 ms of fixed time (the polling thread's wake-up and the message's rendezvous).
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


class _Relay:
    """One rank's share of a broadcast: the leader's buffer fills piece by piece (from MPI, or
    all at once on the root's rank) and every other local participant copies each piece into
    its own buffer as it lands — the copies overlap the transfer."""

    def __init__(self, bufs: dict[int, np.ndarray], leader: int) -> None:
        self.bufs = bufs
        self.leader = leader
        mine = bufs[leader]
        # Where the bytes land: the leader's buffer, or a staging copy when that buffer is a
        # strided view (the leader then copies it in place, like every strided follower).
        self.source = mine if mine.flags.c_contiguous else np.empty(mine.shape, mine.dtype)
        self.size = mine.nbytes
        self._cv = threading.Condition()
        self._landed = 0
        self._error: BaseException | None = None
        self._copied = 0  # followers done

    def publish(self, upto: int) -> None:
        with self._cv:
            self._landed = upto
            self._cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            self._error = exc
            self._cv.notify_all()

    def follow(self, device: int, backend: MpiBackend, what: str) -> None:
        """Copy the bytes into this device's buffer: piece by piece as they land when it is
        contiguous, in one strided copy once all have landed when it is a view."""
        mine = self.bufs[device]
        flat = mine.flags.c_contiguous
        src = self.source.reshape(-1).view(np.uint8)
        dst = mine.reshape(-1).view(np.uint8) if flat else None
        done = 0
        try:
            while done < self.size:
                with self._cv:
                    while (self._landed == done or (not flat and self._landed < self.size)) \
                            and self._error is None:
                        self._cv.wait(_POLL_S)
                        backend.dist.check(what, time.perf_counter(), "", None)
                    if self._error is not None:
                        raise CollectiveAborted(f"{what} on device {device}: the transfer failed "
                                                f"({self._error})")
                    upto = self._landed
                if flat:
                    dst[done:upto] = src[done:upto]
                else:
                    np.copyto(mine, self.source)
                done = upto
        finally:
            with self._cv:
                self._copied += 1
                self._cv.notify_all()

    def wait_followers(self, backend: MpiBackend, what: str) -> None:
        """The leader returns (and its buffer may be reused) only after every copy."""
        with self._cv:
            while self._copied < len(self.bufs) - 1:
                self._cv.wait(_POLL_S)
                backend.dist.check(what, time.perf_counter(), "", None)


__all__ = ["Backoff", "HopTiming", "MpiBackend"]
