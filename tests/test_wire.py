"""Collectives across ranks over wires (``overlap/backends/job/wire.py``) in one process: each
rank a ``WireTransport`` over ``HostLinks`` (joined by socket pairs, read by that rank's
progress engine), run on threads of its own. The backend and the control plane are small
stand-ins (the backend's placement, rank and timeout; ``Distributed``'s ``overdue`` and
``duplicate``); pieces are small, so every byte goes over the links and none over MPI
(``NoMpi`` fails the test if one did). What a broadcast delivers through a chain, in pieces;
the mismatch it names; a wait past the timeout asking the control plane; cancellation; hop
timings; the piece-size model. (Across processes: tests/test_mpi.py.)"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from overlap.backends import Transport
from overlap.backends.devices.bound import Bound
from overlap.backends.devices.routes import Route
from overlap.backends.job import wire
from overlap.backends.job.engine import Engine
from overlap.backends.job.host_links import HostLinks
from overlap.backends.job.wire import HopTiming, WireTransport, piece_bytes
from overlap.errors import (
    CollectiveAborted,
    CollectiveMismatch,
    CollectiveTimeout,
    OverlapRuntimeError,
)
from overlap.scope import CancelScope
from overlap.world import Placement

BOUND_S = 10.0  # every wait here is bounded: a hang fails the test
WHAT = "broadcast[#3] root 0"


class Backend:
    """The part of a ``Backend`` a ``WireTransport`` reads."""

    def __init__(self, rank: int, placement: Placement, timeout: float) -> None:
        self.rank, self.placement, self.timeout = rank, placement, timeout
        self.bound = Bound(timeout)


class Dist:
    """The part of ``Distributed`` a wire asks: ``overdue`` past the timeout (recorded; then
    ``answer`` — by default a peer not at work: :class:`CollectiveTimeout`, naming ``who``)
    and ``duplicate`` (a new channel's communicator: a token here)."""

    def __init__(self, answer: Callable[[], None] | None = None) -> None:
        self.asked: list[tuple[str, tuple[int, ...], str]] = []
        self.answer = answer

    def overdue(self, what: str, peers: Sequence[int], who: str, scope: CancelScope) -> None:
        self.asked.append((what, tuple(peers), who))
        if self.answer is None:
            raise CollectiveTimeout(f"{what}: {who}", op=what, devices=(), missing=tuple(peers))
        self.answer()  # (returns: the peers are at work, the wait goes on)

    def duplicate(self, what: str) -> Any:
        return f"communicator for {what}"


class NoMpi:
    """``MpiWire``'s stand-in: it is given the channels' communicators; no message may go
    over it."""

    tag_ub = (1 << 31) - 1

    def __init__(self) -> None:
        self.channels: dict[int, Any] = {}

    def add_channel(self, channel: int, comm: Any) -> None:
        self.channels[channel] = comm

    def isend(self, *args: Any) -> Any:
        raise AssertionError(f"a message went over MPI: {args[:3]}")

    irecv = isend

    def close(self) -> None:
        pass


class SaysPosted(HostLinks):
    """Host links that say when a receive has been posted (a test's hand-off: the wire's
    thread goes on to wait for it)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.posted = threading.Event()

    def irecv(self, channel: int, peer: int, tag: int, buf: Any) -> Any:
        req = super().irecv(channel, peer, tag, buf)
        self.posted.set()
        return req


class Ranks:
    """``n`` ranks in this process: their engines, host links and wire transports."""

    def __init__(self, placement: Placement, *, timeout: float, chunk_bytes: int | None,
                 dist: Dist | None = None, mpi: Callable[[HostLinks], Any] = lambda _: NoMpi(),
                 prepare: bool = True, links: type[HostLinks] = HostLinks) -> None:
        n = len(set(placement.owners))
        ends = _mesh(n)
        self.engines = [Engine(f"overlap-engine-r{r}") for r in range(n)]
        self.links = [links(r, ends[r], self.engines[r]) for r in range(n)]
        self.dists = [dist or Dist() for _ in range(n)]
        self.wires = [WireTransport(Backend(r, placement, timeout), self.dists[r],
                                    mpi(self.links[r]), self.links[r],
                                    chunk_bytes=chunk_bytes) for r in range(n)]
        if prepare:
            for w in self.wires:
                w.prepare({"comm": ()}, [])

    def close(self) -> None:
        for w in self.wires:
            w.close()
        for lk in self.links:
            lk.close()
        for e in self.engines:
            e.close()


@pytest.fixture
def make_ranks() -> Iterator[Callable[..., Ranks]]:
    made: list[Ranks] = []

    def make(n: int | Placement = 2, *, timeout: float = 60.0, chunk_bytes: int | None = None,
             **kwargs: Any) -> Ranks:
        placement = n if isinstance(n, Placement) else Placement.blocks(n, n)
        made.append(Ranks(placement, timeout=timeout, chunk_bytes=chunk_bytes, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Run each call on a thread of its own (the ranks' stream threads): what each returned
    or raised."""
    results: list[Any] = [None] * len(calls)

    def run(k: int, fn: Callable[[], Any]) -> None:
        try:
            results[k] = fn()
        except BaseException as exc:
            results[k] = exc

    threads = [threading.Thread(target=run, args=(k, fn)) for k, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    return results


def bcast(w: WireTransport, order: tuple[int, ...], device: int, buffer: np.ndarray,
          tag: int | None = 7, scope: CancelScope | None = None) -> Callable[[], None]:
    """A device's part of ``#3``, a broadcast from device 0 over ``order``, as a call."""
    return lambda: w.broadcast(order, device, 0, buffer, "#3", "comm", tag,
                               scope or CancelScope("a call"))


def issued(w: WireTransport, route: Route, buf: np.ndarray, tag: int = 7,
           scope: CancelScope | None = None) -> Callable[[], None]:
    """A transfer part as a call that returns once its device work is done: ``transfer``
    returns the messages it left in flight (a stream would go on); here the caller waits."""
    def run() -> None:
        s = scope or CancelScope("a call")
        work = w.transfer(route, buf, tag, s)
        if work is not None:
            work.block(s, "the test")
    return run


def ok(results: list[Any]) -> None:
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]


def test_the_wire_transport_is_a_transport(make_ranks):
    ranks = make_ranks(2)
    assert all(isinstance(w, Transport) for w in ranks.wires)


def test_a_piece_sent_by_the_root_lands_in_the_last_ranks_buffer(make_ranks):
    ranks = make_ranks(2)
    sent = np.arange(24, dtype=np.float32).reshape(4, 6)
    got = np.zeros_like(sent)

    def part(r: int, buf: np.ndarray) -> Callable[[], None]:
        w = ranks.wires[r]
        route = Route("#3", "comm", 0, (0, 1), r, buf.nbytes, True,
                      w.hop((0, 1), r, 0, "comm", buf.nbytes))
        return issued(w, route, buf)

    ok(together(part(0, sent), part(1, got)))
    np.testing.assert_array_equal(got, sent)
    # (One hop of two ranks: one piece, over the link.)
    assert ranks.links[0].frames_sent == 1 and ranks.links[1].frames_received == 1


def test_a_chain_of_three_ranks_forwards_the_pieces_in_the_plans_order(make_ranks):
    ranks = make_ranks(3, chunk_bytes=16)
    sent = np.random.default_rng(0).integers(0, 255, 100, np.uint8)
    bufs = [sent, np.zeros_like(sent), np.zeros_like(sent)]
    order = (0, 2, 1)  # (the root, then its receivers in the plan's order: 0 → 2 → 1)
    hops = [w.hop(order, r, 0, "comm", sent.nbytes) for r, w in enumerate(ranks.wires)]
    assert [(h.prev, h.next, h.piece) for h in hops] == [(None, 2, 16), (2, None, 16),
                                                         (0, 1, 16)]
    ok(together(*(bcast(ranks.wires[r], order, r, bufs[r]) for r in (1, 2, 0))))
    for buf in bufs[1:]:
        np.testing.assert_array_equal(buf, sent)
    pieces = 7  # (100 bytes in pieces of 16)
    assert [lk.frames_sent for lk in ranks.links] == [pieces, 0, pieces]
    assert [lk.frames_received for lk in ranks.links] == [0, pieces, pieces]


def test_a_rank_with_two_receivers_gets_the_bytes_once_and_copies_them(make_ranks):
    ranks = make_ranks(Placement.explicit([0, 1, 1], 3, 2), chunk_bytes=8)
    sent = np.arange(8, dtype=np.int32)  # 32 bytes: one message (nobody forwards it)
    mine = [np.zeros_like(sent), np.zeros_like(sent)]
    assert ranks.wires[1].hop((0, 1, 2), 1, 0, "comm", sent.nbytes).local == (1, 2)
    ok(together(bcast(ranks.wires[0], (0, 1, 2), 0, sent),
                bcast(ranks.wires[1], (0, 1, 2), 1, mine[0]),
                bcast(ranks.wires[1], (0, 1, 2), 2, mine[1])))
    for buf in mine:
        np.testing.assert_array_equal(buf, sent)
    assert ranks.links[1].frames_received == 1


def test_a_strided_receiver_gets_the_bytes_and_a_strided_root_is_refused(make_ranks):
    ranks = make_ranks(2)
    sent = np.arange(16, dtype=np.float64).reshape(4, 4)
    wide = np.zeros((4, 8))
    got = wide[:, ::2]  # (a strided view: staged, then copied in)
    ok(together(bcast(ranks.wires[0], (0, 1), 0, sent),
                bcast(ranks.wires[1], (0, 1), 1, got)))
    np.testing.assert_array_equal(got, sent)
    assert (wide[:, 1::2] == 0).all()
    with pytest.raises(OverlapRuntimeError,
                       match=re.escape(f"{WHAT}: the root's buffer is not contiguous")):
        bcast(ranks.wires[0], (0, 1), 0, wide[:, ::2])()
    with pytest.raises(OverlapRuntimeError, match=r"spans ranks \[0, 1\] and needs a tag"):
        bcast(ranks.wires[0], (0, 1), 0, sent, tag=None)()


def test_a_message_of_another_size_is_named_as_a_mismatch(make_ranks):
    ranks = make_ranks(2)
    results = together(bcast(ranks.wires[0], (0, 1), 0, np.ones(16, np.uint8)),
                       bcast(ranks.wires[1], (0, 1), 1, np.zeros(8, np.uint8)))
    assert results[0] is None
    assert isinstance(results[1], CollectiveMismatch)
    assert f"{WHAT}: rank 1 received 16 bytes from rank 0 where 8 were expected" in \
        str(results[1])


def test_a_receive_whose_sender_never_sends_asks_the_peer_and_is_taken_back(make_ranks):
    timeout = 0.05
    ranks = make_ranks(2, timeout=timeout)
    late = np.zeros(4, np.uint8)
    started = time.perf_counter()
    with pytest.raises(CollectiveTimeout, match="rank 0 never sent it"):
        bcast(ranks.wires[1], (0, 1), 1, late)()
    assert time.perf_counter() - started >= timeout  # (asked only past the timeout)
    assert ranks.dists[1].asked == [(WHAT, (0,), "rank 0 never sent it")]
    # The message that comes after goes to the next receive, not the abandoned buffer.
    again = np.zeros(4, np.uint8)
    ok(together(bcast(ranks.wires[0], (0, 1), 0, np.full(4, 9, np.uint8)),
                bcast(ranks.wires[1], (0, 1), 1, again)))
    assert late.tolist() == [0] * 4 and again.tolist() == [9] * 4


def test_a_wait_past_the_timeout_goes_on_while_the_peer_is_at_work(make_ranks):
    """``overdue`` returns (the peer answered it is at work): the wait goes on, and ends when
    the bytes come."""
    ranks: Ranks

    def sender_at_work() -> None:
        if len(ranks.dists[1].asked) == 1:  # (asked the first time: the root sends now)
            bcast(ranks.wires[0], (0, 1), 0, np.full(4, 5, np.uint8))()

    ranks = make_ranks(2, timeout=0.02, dist=Dist(answer=sender_at_work))
    got = np.zeros(4, np.uint8)
    bcast(ranks.wires[1], (0, 1), 1, got)()
    assert got.tolist() == [5] * 4
    assert ranks.dists[1].asked[0] == (WHAT, (0,), "rank 0 never sent it")


def test_cancelling_the_scope_wakes_a_waiting_transfer_at_once(make_ranks):
    ranks = make_ranks(2, timeout=600.0, links=SaysPosted)  # (only the cancel can end it)
    scope = CancelScope("a call")
    waiting = np.zeros(4, np.uint8)
    receiving = ranks.links[1].frames_received
    results: list[Any] = []
    t = threading.Thread(target=lambda: results.extend(
        together(bcast(ranks.wires[1], (0, 1), 1, waiting, scope=scope))))
    t.start()
    assert ranks.links[1].posted.wait(BOUND_S)  # (its receive is posted: it waits for it)
    scope.cancel(RuntimeError("rank 0 failed"))
    t.join(BOUND_S)
    assert not t.is_alive()
    assert isinstance(results[0], CollectiveAborted)
    assert f"{WHAT}: aborted (RuntimeError: rank 0 failed)" in str(results[0])
    assert ranks.dists[1].asked == []  # (woken by the cancel, not past a timeout)
    # Its receive was taken back: the next message goes to the next receive.
    again = np.zeros(4, np.uint8)
    ok(together(bcast(ranks.wires[0], (0, 1), 0, np.full(4, 3, np.uint8)),
                bcast(ranks.wires[1], (0, 1), 1, again)))
    assert again.tolist() == [3] * 4 and waiting.tolist() == [0] * 4
    assert ranks.links[1].frames_received == receiving + 1


def test_a_route_resolved_before_its_channel_was_prepared_is_resolved_again(make_ranks):
    ranks = make_ranks(2, prepare=False)
    sent, got = np.arange(8, dtype=np.uint8), np.zeros(8, np.uint8)
    routes = [Route("#3", "comm", 0, (0, 1), r, 8, True, w.hop((0, 1), r, 0, "comm", 8))
              for r, w in enumerate(ranks.wires)]
    assert all(route.hop.channel < 0 for route in routes)
    for w in ranks.wires:
        w.prepare({"comm": ()}, [])
    ok(together(issued(ranks.wires[0], routes[0], sent), issued(ranks.wires[1], routes[1], got)))
    np.testing.assert_array_equal(got, sent)


def test_hop_timings_record_each_ranks_part_when_set_to_a_list(make_ranks):
    ranks = make_ranks(2)
    assert ranks.wires[0].hop_timings is None  # (not timed unless asked)
    for w in ranks.wires:
        w.hop_timings = []
    ok(together(bcast(ranks.wires[0], (0, 1), 0, np.ones(16, np.uint8)),
                bcast(ranks.wires[1], (0, 1), 1, np.zeros(16, np.uint8))))
    (root,), (last,) = ranks.wires[0].hop_timings, ranks.wires[1].hop_timings
    assert isinstance(root, HopTiming)
    assert (root.tag, root.prev, root.nxt, root.nbytes, root.landed) == (7, None, 1, 16, None)
    assert root.posted <= root.done
    assert (last.tag, last.prev, last.nxt, last.nbytes) == (7, 0, None, 16)
    assert last.landed is not None and last.posted <= last.landed <= last.done


def test_a_bad_piece_size_is_named():
    with pytest.raises(ValueError, match=r"chunk_bytes: expected an int >= 1 or None"):
        WireTransport(Backend(0, Placement.blocks(2, 2), 1.0), Dist(), NoMpi(), None,
                      chunk_bytes=0)


def test_pieces_only_where_someone_forwards(make_ranks):
    """One hop: one message whatever ``chunk_bytes``; a chain of three cuts pieces
    (``chunk_bytes``, else the model's size)."""
    nbytes = 64 << 20
    assert make_ranks(2, chunk_bytes=16).wires[0].hop((0, 1), 0, 0, "comm", nbytes).piece \
        == nbytes
    three = make_ranks(3).wires[0].hop((0, 1, 2), 0, 0, "comm", nbytes)
    assert three.piece == piece_bytes(nbytes, 2) < nbytes


def test_broadcast_pieces_minimise_the_pipeline_model():
    """The piece size is the best whole number of pieces under its own model (k pieces
    through s stages: (k + s - 1) x (bytes / (k x bandwidth) + overhead))."""

    def modeled(nbytes: int, stages: int, k: int) -> float:
        return (k + stages - 1) * (nbytes / k / wire.HOST_BYTES_PER_S + wire.PIECE_OVERHEAD_S)

    for nbytes in (1 << 20, 7 << 20, 64 << 20, 1 << 30):
        for stages in (2, 3, 5, 9):
            piece = piece_bytes(nbytes, stages)
            assert piece >= wire.MIN_PIECE_BYTES
            k = -(-nbytes // piece)
            best = min(modeled(nbytes, stages, j) for j in range(1, 2000))
            assert modeled(nbytes, stages, k) <= best * 1.02, (nbytes, stages, k)
    # One stage (one hop, nothing copied on): one message; small tensors: one piece.
    assert piece_bytes(64 << 20, 1) == 64 << 20
    assert piece_bytes(1000, 4) == 1000
    assert piece_bytes(0, 1) == 1
    # Longer pipelines cut finer.
    assert piece_bytes(64 << 20, 9) < piece_bytes(64 << 20, 2)


# ---- stage collectives (their exchange over a stand-in MPI wire made of the links) ------


class LinksAsMpi(NoMpi):
    """A stand-in MPI wire whose messages go over the host links (the same point-to-point
    semantics): the stage collectives' exchange, which always takes ``self.mpi``."""

    def __init__(self, links: HostLinks) -> None:
        super().__init__()
        self.links = links

    def isend(self, channel: int, peer: int, tag: int, buf: Any) -> Any:
        return self.links.isend(channel, peer, tag, buf)

    def irecv(self, channel: int, peer: int, tag: int, buf: Any) -> Any:
        return self.links.irecv(channel, peer, tag, buf)


def test_an_all_reduce_and_an_all_gather_across_ranks_equal_one_process(make_ranks):
    group = (0, 1, 2, 3)
    ranks = make_ranks(Placement.blocks(4, 2), mpi=LinksAsMpi, prepare=False)
    for w in ranks.wires:
        w.prepare({"comm": ()}, [("comm", group)])
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(5).astype(np.float32) for _ in group]
    expect = xs[0].copy()
    for x in xs[1:]:
        expect = expect + x  # (device order: one process's sum, bit for bit)
    bufs = [x.copy() for x in xs]
    outs = [np.zeros((4, 5), np.float32) for _ in group]

    def reduce(d: int) -> Callable[[], None]:
        return lambda: ranks.wires[d // 2].all_reduce(group, d, bufs[d], "g", np.add, "comm",
                                                      None, CancelScope("a call"))

    def gather(d: int) -> Callable[[], None]:
        return lambda: ranks.wires[d // 2].all_gather(group, d, xs[d], outs[d], "g", "comm",
                                                      None, CancelScope("a call"))

    ok(together(*(reduce(d) for d in group)))
    for b in bufs:
        assert b.tobytes() == expect.tobytes()
    ok(together(*(gather(d) for d in group)))
    for o in outs:
        np.testing.assert_array_equal(o, np.stack(xs))


def _mesh(n: int) -> list[dict[int, socket.socket]]:
    """Sockets joining every pair of ``n`` ranks: ``ends[r][p]`` is rank r's end to p."""
    ends: list[dict[int, socket.socket]] = [{} for _ in range(n)]
    for r in range(n):
        for p in range(r + 1, n):
            ends[r][p], ends[p][r] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return ends
