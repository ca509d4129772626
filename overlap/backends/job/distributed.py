"""The control plane of a multi-process job: what the runtime's calls say to each other, and
how a failure ends the job.

:func:`~overlap.backends.make_backend` makes a multi-process backend: the device kind, the
process's one progress engine (:mod:`.engine`), the host links between the ranks of a host
(:mod:`.host_links`, unless ``OVERLAP_HOST_LINKS=0``), the data plane (:mod:`.wire` for the
CPU kind, :mod:`.nccl` for CUDA) and a :class:`Distributed`.

**A call's rounds** (:class:`CallRounds`) are among its members only — the ranks holding a
device of the call (a resharding: of either layout; a training step: every rank). Every
process still makes every call and counts it, but a rank outside a call posts nothing and
waits for no one. At most two rounds a call, each posted once:

- the **agreement**, at admission: each member's row is the first 24 bytes of a SHA-256 of
  the call's plan or step graph and the call number; the rows are compared by the thread
  that lands the last of them, and a mismatch (:class:`~overlap.errors.CallMismatch`, naming
  the ranks whose call differs) fails the call's scope at once — it is the root cause
  everywhere, the failures it causes come second;
- the **end of the call**, for a call whose result every member returns (a training step:
  its rows carry the losses, from the last stage's owner), once this rank's part ended well:
  such a call returns only once every member's did (a rank whose part ended early learns
  here of a peer's failure). A resharding has none: nothing to share, and a peer's failure
  after this rank's part ended reaches this rank's next call.

A round goes all-to-all over host links where they join every member, as one
``MPI_Iallgather`` where every rank is a member and some are not linked, else point to point
among the members over MPI. Its messages carry the call number as their tag.

**Every wait for a peer is bounded**: past ``timeout`` the waiter asks the peers it waits for
how far they got (:meth:`Distributed.overdue`): one that answers it is at work — inside this
call, or still inside an earlier one this rank had no part in — is waited for, since its own
work is bounded; one idle and behind ("never made this call"), past ("went on without this
rank") or mute (dead, frozen, blocked) within ``QUERY_WAIT_S`` fails the wait with
:class:`~overlap.errors.CollectiveTimeout` naming it.

**Failures**: a rank whose call fails tells every other rank (``RankFailed`` there, which
cancels the runtime's scope — and so the call in flight — naming the rank, its call and
error); an uncaught exception in the script does the same. A rank that leaves (its runtime
closed, its script ended) says after how many calls: a peer's call that needs it fails at
once, naming it. Control messages are JSON objects of fixed, typed fields per tag; a
malformed one is logged and dropped, nothing is unpickled. They go over MPI (every rank can
reach every other), and the engine looks for them every ``LISTEN_TICK_S``.

**Exit**: MPI cannot take back messages in flight, so a failed multi-process runtime does not
recover; how its process then ends is :mod:`.exit_guard`'s (a :class:`Distributed` is watched
from when it is made until it leaves).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import CallMismatch, CollectiveAborted, CollectiveTimeout, RankFailed
from ...scope import CancelScope
from ...waits import OneShot, block_on, wait_on
from ...world import Placement, World, describe
from ..devices.bound import Bound, Bounded, bound_of
from . import exit_guard
from .control_messages import ControlTag, encode_control, parse_control
from .engine import Completion, Engine
from .host_links import HostLinks
from .mpi import MpiReceive

_FAILED, _EXITING, _QUERY, _REPLY, _LEFT = (ControlTag.FAILED, ControlTag.EXITING,
                                          ControlTag.QUERY, ControlTag.REPLY, ControlTag.LEFT)
# Host-link channels of the runtime's own rounds (a data plane numbers its channels from 0).
AGREE_CHANNEL, DONE_CHANNEL = 0xFFFF_FFFF, 0xFFFF_FFFD
CONTROL_CHANNEL = 0xFFFF_FFFB  # control messages, in a job without MPI
NCCL_ID_CHANNEL = 0xFFFF_FFF9  # NCCL's unique ids, in a job without MPI
HOST_LINKS_ENV = "OVERLAP_HOST_LINKS"
_TAGS = 1 << 31  # a round's tag is its call number modulo this (a link's tags are int32)
LISTEN_TICK_S = 0.02  # how often the engine looks for control messages
QUERY_WAIT_S = 0.5  # how long an overdue wait waits for the peers' answers
# An agreement row: the digest's first 24 bytes, the call number, then the step's number of
# microbatches (int32) and the shapes of its first microbatches (SHAPE_SLOTS of them,
# SHAPE_DIMS int32 dimensions each, -1 for none): a mismatch of counts is named by both
# counts, one of shapes by microbatch and both shapes.
SHAPE_SLOTS, SHAPE_DIMS = 32, 4
_SHAPE_BYTES = 4 + SHAPE_SLOTS * SHAPE_DIMS * 4
AGREEMENT_ROW_BYTES = 32 + _SHAPE_BYTES


def shape_table(shapes: Sequence[Sequence[int]], count: int | None = None) -> bytes:
    """The shapes part of an agreement row: the step's number of microbatches (``count``,
    default ``len(shapes)``) and each microbatch's (first boundary's) shape."""
    table = np.full((SHAPE_SLOTS, SHAPE_DIMS), -1, np.int32)
    for i, shape in enumerate(shapes[:SHAPE_SLOTS]):
        dims = [min(int(n), 2**31 - 1) for n in shape][:SHAPE_DIMS]
        table[i, :len(dims)] = dims
    n = len(shapes) if count is None else count
    return np.int32(min(n, 2**31 - 1)).tobytes() + table.tobytes()


def _count_of(row: bytes) -> int:
    return int(np.frombuffer(row, np.int32, 1, 32)[0])


def _shape_text(row: bytes, slot: int) -> str:
    dims = np.frombuffer(row, np.int32, SHAPE_DIMS, 36 + slot * SHAPE_DIMS * 4)
    return str(tuple(int(n) for n in dims if n >= 0))

log = logging.getLogger("overlap")


def host_links_wanted(host_links: bool | None) -> bool:
    """``host_links`` if given, else what ``OVERLAP_HOST_LINKS`` says (default: on)."""
    if host_links is not None:
        if not isinstance(host_links, bool):
            raise ValueError(f"host_links: expected True, False or None, got {host_links!r}")
        return host_links
    value = os.environ.get(HOST_LINKS_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{HOST_LINKS_ENV}: expected 0 or 1, got {value!r}")
    return value == "1"


class Distributed(Bounded):
    """One rank's control plane (see module doc), on its progress ``engine``."""

    def __init__(self, world: World, placement: Placement, engine: Engine, comm: Any,
                 links: HostLinks | None, *, timeout: float | Bound,
                 grace: float = 5.0) -> None:
        if comm is None:  # (torchrun: no MPI; links join every pair of ranks)
            if links is None or len(links.peers) != world.size - 1:
                raise RuntimeError("a job without MPI needs links between every two ranks")
            self.MPI: Any = None
        else:
            from mpi4py import MPI

            self.MPI = MPI
        self.world = world
        self.placement = placement
        self.rank = world.rank
        self.local_devices = placement.devices_of(world.rank)
        self.engine = engine
        self.links = links
        self.bound = bound_of(timeout)  # (the backend's: a call may widen it)
        self.grace = grace
        self.comm = comm  # COMM_WORLD: duplicated, never used directly (None: no MPI)
        # Collective over every rank, in the same order everywhere (main thread).
        self.runtime_comm = None if comm is None else comm.Dup()  # the rounds over MPI
        self.control_comm = None if comm is None else comm.Dup()  # notices and queries
        self.tag_ub = _TAGS - 1 if comm is None else int(comm.Get_attr(self.MPI.TAG_UB))
        # The runtime's scope: a peer's failure cancels it (the job cannot go on).
        self.scope: CancelScope | None = None
        self.broken: BaseException | None = None
        self.calls = 0  # the runtime's call counter (reported to peers that ask)
        self.busy = False  # inside a call
        self.members: tuple[int, ...] = ()  # the ranks the call in flight needs
        self._call_scope: CancelScope | None = None  # the call in flight's
        self.departed: dict[int, tuple[int, str]] = {}  # rank -> (its calls, how it left)
        self.exiting: set[int] = set()  # ranks that said they are exiting (or left)
        self.left = False  # this rank told its peers it left
        self.closed = False
        # A failed runtime closed while its failure propagates keeps its engine for the exit
        # guards (its peers' reports); one closed after it was handled stops it.
        self.listening = False
        self._replies: dict[int, tuple[int, bool, float]] = {}  # rank -> calls, busy, when
        self._asked: dict[int, float] = {}  # rank -> when it was last asked
        self._replied = threading.Lock()  # (a leaf: the replies and the asks awaiting them)
        # Asks in flight: (ranks asked, when, finished once every one answered after that).
        self._asking: list[tuple[frozenset[int], float, OneShot]] = []
        # The runtime's rounds go over links when they join this rank to every other.
        self.rounds_linked = links is not None and len(links.peers) == world.size - 1
        if comm is None:
            assert links is not None
            links.listen(CONTROL_CHANNEL, self._take)
        else:
            self._probe = self.MPI.Status()
            engine.every(LISTEN_TICK_S, self._listen)
        exit_guard.watch(self)  # (until it leaves: a failure ends the job at exit)

    def describe(self) -> str:
        return describe(self.world, self.local_devices)

    @property
    def everyone(self) -> tuple[int, ...]:
        return tuple(range(self.world.size))

    def linked(self, others: Sequence[int]) -> bool:
        """Whether a host link joins this rank to every one of ``others``."""
        return self.links is not None and all(self.links.has(r) for r in others)

    # ---- calls ---------------------------------------------------------------------------

    def begin_call(self, what: str, digest: bytes, members: tuple[int, ...] | None,
                   scope: CancelScope) -> CallRounds | None:
        """A call begins (every rank makes every call): count it, fail it at once if a
        member it needs left, post its agreement row. None where this rank has no one to
        check with — it holds none of the call's devices, or all of them."""
        self.calls += 1
        self.busy = True
        members = self.everyone if members is None else members
        self.members = members
        self._call_scope = scope
        doing = f"{what} (call {self.calls})"
        exit_guard.report(doing)
        self._check_departed(self.calls, members, scope)
        if self.rank not in members or len(members) == 1:
            return None
        return CallRounds(self, doing, self.calls, members, digest, scope)

    def end_call(self) -> None:
        """The call ended here (peers that wait for this rank past their timeout ask)."""
        self.busy = False
        self._call_scope = None

    def _check_departed(self, call: int, members: tuple[int, ...], scope: CancelScope) -> None:
        """A member that left after fewer calls than ``call`` will never make it: fail now."""
        if self.rank not in members:
            return  # (this rank waits for nobody in this call)
        gone = sorted((r, c, how) for r, (c, how) in list(self.departed.items())
                      if c < call and r in members)
        if not gone:
            return
        r, c, how = gone[0]
        err = RankFailed(f"rank {r} {how} after {c} runtime calls; this rank's call {call} "
                         f"needs it (rank {self.rank} stopped its work)",
                         rank=r, error=how, calls=c)
        scope.fail(err)
        raise err

    def failed(self, what: str, root: BaseException) -> None:
        """This rank's call failed with ``root``: the job cannot go on — tell the others
        (unless it is a peer's failure, which they know)."""
        if self.broken is None:
            self.broken = root
            if not isinstance(root, RankFailed):
                self.announce_failure(what, root)

    # ---- rounds ----------------------------------------------------------------------------

    def gather(self, channel: int, call: int, members: tuple[int, ...], row: np.ndarray,
               table: np.ndarray) -> Round:
        """Post one round of call number ``call``: each member's ``row`` in ``table[r]`` on
        every member (this rank's row is the caller's). Over host links where they join
        every member; else as one ``MPI_Iallgather`` where every rank is a member (posted
        in call order from the event loop on every rank), else point to point over MPI."""
        others = [r for r in members if r != self.rank]
        table[self.rank] = row
        if self.linked(others):
            links = self.links
            assert links is not None
            tag = call % _TAGS
            # (Receives first: a row that comes before its receive is posted is copied.)
            recvs = [links.irecv(channel, r, tag, table[r]) for r in others]
            sends = [links.isend(channel, r, tag, row) for r in others]
            return Round(self, recvs, sends, members)
        if len(members) == self.world.size:
            done = Completion("the runtime's round over MPI")
            request = self.runtime_comm.Iallgather(row, table)
            done.keep = (row, table)
            self.engine.watch_mpi(request, lambda st: _finished(done, st))
            return Round(self, [done], [], members)
        kinds = (AGREE_CHANNEL, DONE_CHANNEL)
        span = max(1, (self.tag_ub + 1) // len(kinds))
        tag = (call % span) * len(kinds) + kinds.index(channel)
        recvs, sends = [], []
        for r in others:
            recvs.append(self._mpi_round_recv(table[r], r, tag))
            sends.append(self._mpi_round_part(self.runtime_comm.Isend(row, r, tag), r, row))
        return Round(self, recvs, sends, members)

    def _mpi_round_recv(self, buf: np.ndarray, peer: int, tag: int) -> MpiReceive:
        """A round's receive over MPI point to point: one a failed call's ``abandon`` can
        take back (MPI's cancel; else it would stay posted, take the peer's late row and
        count as landed), and that, taken back, fails — it never completes the round."""
        MPI = self.MPI
        status = MPI.Status()
        request = self.runtime_comm.Irecv(buf, peer, tag)
        done = MpiReceive("the runtime's round over MPI", peer, request, buf)

        def finished(st: Any) -> None:
            if isinstance(st, BaseException):
                done.fail(CollectiveAborted(f"{done.what}: {st}"))
            elif st.Is_cancelled():
                done.fail(CollectiveAborted(f"{done.what}: taken back"))
            else:
                done.complete()

        self.engine.watch_mpi(request, finished, status)
        return done

    def _mpi_round_part(self, request: Any, peer: int, keep: Any) -> Completion:
        done = Completion("the runtime's round over MPI", peer)
        done.keep = keep
        self.engine.watch_mpi(request, lambda st: _finished(done, st))
        return done

    # ---- every wait for a peer is bounded ------------------------------------------------

    def overdue(self, what: str, peers: Sequence[int], who: str, scope: CancelScope) -> None:
        """A wait of ``what`` for ``peers`` (default: the call's members) ran past the
        timeout: return if every one of them answers it is at work (the wait goes on); else
        raise :class:`~overlap.errors.CollectiveTimeout` — saying ``who`` (what the peer
        never did: "rank 0 never sent it") where every peer that is not at work answered it
        is idle, the answers' account otherwise. Blocks up to ``QUERY_WAIT_S``."""
        peers = tuple(peers) or self.members
        answers = self.ask(peers, scope)
        if answers.at_work:
            return
        account = who if who and answers.idle else answers.text
        raise CollectiveTimeout(f"{what}: rank {self.rank} waited {self.timeout:g} s; "
                                f"{account}", op=what, devices=(),
                                missing=tuple(d for p in peers
                                              for d in self.placement.devices_of(p)),
                                ranks=answers.absent)

    def ask(self, among: Sequence[int], scope: CancelScope | None = None,
            wait: float = QUERY_WAIT_S) -> Answers:
        """Ask the ranks ``among`` how far they got (blocking, up to ``wait``; see
        :class:`Answers`)."""
        others = [r for r in dict.fromkeys(among) if r != self.rank]
        if not others:
            return Answers("no other rank to wait for", False, True)
        now = time.perf_counter()
        # A rank asked a moment ago is not asked again: its answer stands, and so does its
        # silence (a frozen peer would cost every wait that asks another QUERY_WAIT_S).
        recent = now - QUERY_WAIT_S
        with self._replied:
            known = {r: self._replies[r][:2] for r in others
                     if r in self._replies and self._replies[r][2] >= recent}
            silent = {r for r in others if r not in known
                      and recent - QUERY_WAIT_S <= self._asked.get(r, -1.0) <= recent
                      and self._replies.get(r, (0, False, -1.0))[2] < self._asked[r]}
        to_ask = [r for r in others if r not in known and r not in silent]
        answered = OneShot()  # (finished by the engine, handling the last answer)
        with self._replied:
            self._asking.append((frozenset(to_ask), now, answered))
        for r in to_ask:
            self._asked[r] = now
            self._tell(r, _QUERY, {})
        if not to_ask:
            answered.finish()
        try:
            block_on(answered, scope, "the peers' answers", wait)
        except CollectiveAborted:
            pass  # (not past a cancellation: a failure notice that came meanwhile is the
            # explanation, and a failed peer may never answer)
        finally:
            with self._replied:
                self._asking = [a for a in self._asking if a[2] is not answered]
        with self._replied:
            got = {r: self._replies[r][:2] for r in to_ask
                   if r in self._replies and self._replies[r][2] >= now}
        return Answers.of(self.calls, {**known, **got}, others)

    # ---- control messages ----------------------------------------------------------------

    def _tell(self, dest: int, tag: int, msg: dict[str, Any]) -> Completion:
        """Post one control message (JSON bytes); kept alive until MPI is done with it."""
        data = encode_control(msg)
        if self.control_comm is None:
            assert self.links is not None
            try:
                return self.links.isend(CONTROL_CHANNEL, dest, tag, data)
            except CollectiveAborted as exc:  # (the links closed: nobody hears it)
                gone = Completion(f"control message to rank {dest}", dest)
                gone.fail(exc)
                return gone
        done = Completion(f"control message to rank {dest}", dest)
        done.keep = data
        request = self.control_comm.Isend([data, self.MPI.BYTE], dest=dest, tag=tag)
        try:
            self.engine.watch_mpi(request, lambda st: _finished(done, st))
        except CollectiveAborted as exc:  # (the engine is closing: a reply a peer asked for
            done.fail(exc)                # as this rank leaves; its exit notice says more)
        return done

    def tell_all(self, tag: int, msg: dict[str, Any], wait: float = 1.0) -> None:
        """Send ``msg`` to every other rank and wait (at most ``wait``) until it left."""
        sent = [self._tell(r, tag, msg) for r in range(self.world.size) if r != self.rank]
        deadline = time.perf_counter() + wait
        for c in sent:
            with contextlib.suppress(Exception):
                c.block(CancelScope("telling the peers"), "a control message",
                        max(0.0, deadline - time.perf_counter()))

    def _listen(self) -> None:
        """(The engine's, every tick.) Take in every control message that came."""
        MPI, status = self.MPI, self._probe
        while self.control_comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            source, tag = status.Get_source(), status.Get_tag()
            buf = bytearray(status.Get_count(MPI.BYTE))
            self.control_comm.Recv([buf, MPI.BYTE], source=source, tag=tag)
            self._take(source, tag, bytes(buf))

    def _take(self, source: int, tag: int, data: bytes) -> None:
        """(The engine's.) One control message from ``source``."""
        msg = parse_control(tag, data)
        if msg is None:
            log.warning("overlap: ignored a malformed control message (tag %d) from rank %d",
                        tag, source)
            return
        self._handle(source, tag, msg)

    def _handle(self, source: int, tag: int, msg: dict[str, Any]) -> None:
        if tag == _EXITING:
            self.exiting.add(source)
        elif tag == _QUERY:
            self._tell(source, _REPLY, {"calls": self.calls, "busy": self.busy})
        elif tag == _REPLY:
            with self._replied:
                self._replies[source] = (msg["calls"], msg["busy"], time.perf_counter())
                done = [a for ranks, since, a in self._asking if all(
                    self._replies.get(r, (0, False, -1.0))[2] >= since for r in ranks)]
            for a in done:  # (outside the lock: no one-shot finished under one)
                a.finish()
        elif tag == _FAILED:
            self._remote_failure(msg)
        elif tag == _LEFT:
            self._peer_left(source, msg["calls"], msg["how"])

    def _remote_failure(self, msg: dict[str, Any]) -> None:
        err = RankFailed(
            f"rank {msg['rank']} failed during {msg['during']}: {msg['error']} "
            f"(rank {self.rank} stopped its work)",
            rank=int(msg["rank"]), error=str(msg["error"]), calls=int(msg["calls"]))
        if self.broken is None:
            self.broken = err
        if self.scope is not None:
            self.scope.fail(err)  # (the runtime's: the call in flight is cancelled too)

    def _peer_left(self, rank: int, calls: int, how: str) -> None:
        """``rank`` left after ``calls`` calls: the call in flight fails at once if it needs
        the rank; a later call that does fails when it begins."""
        self.departed[rank] = (calls, how)
        self.exiting.add(rank)  # gone: nothing to wait for at exit
        scope = self._call_scope
        if scope is not None and self.calls > calls and rank in self.members:
            with contextlib.suppress(RankFailed):
                self._check_departed(self.calls, self.members, scope)

    def announce_failure(self, during: str, error: BaseException) -> None:
        """Tell every other rank that this one failed (best effort, bounded)."""
        if self.broken is None:
            self.broken = error
        text = f"{type(error).__name__}: {error}"
        self.tell_all(_FAILED, {"rank": self.rank, "during": during, "error": text,
                                "calls": self.calls})

    def leave(self, error: BaseException | None = None, handled: bool = False) -> None:
        """The runtime closes: tell the peers this rank left, stop listening.

        ``error``: the exception leaving the runtime's ``with`` block; the peers are then
        told this rank failed (unless it is ``sys.exit(0)``). A runtime that failed keeps
        listening — and the exit guards end the job at exit — unless the caller ``handled``
        the failure: ``Runtime.close()`` called with no exception in flight."""
        if self.closed:
            return
        self.closed = True
        if error is not None and not _clean_exit(error):
            if self.broken is None:
                self.announce_failure("the script (an uncaught exception)", error)
            self.listening = True
            return
        if self.broken is not None and not handled:
            self.listening = True
            return
        if self.broken is None:
            self.say_left("exited" if error is not None else "closed its runtime")
        exit_guard.release(self)

    def say_left(self, how: str) -> None:
        """Tell every peer this rank left, after how many calls (once)."""
        if not self.left:
            self.left = True
            self.tell_all(_LEFT, {"rank": self.rank, "calls": self.calls, "how": how})

    def bootstrap_comm(self) -> Any:
        """What carries NCCL's unique ids between ranks (collective: every rank, in the
        same order): a duplicate of MPI's world, or a channel of the links without MPI."""
        if self.comm is None:
            from .host_links import LinksComm

            assert self.links is not None
            return LinksComm(self.links, NCCL_ID_CHANNEL)
        return self.comm.Dup()

    def duplicate(self, what: str) -> Any:
        """A new communicator over every rank (``MPI_Comm_idup`` of the runtime's), its
        wait bounded (collective: a rank may reach it while the others are still in an
        earlier call; one that never comes is named past the timeout)."""
        comm, request = self.runtime_comm.Idup()
        done = Completion(what)
        self.engine.watch_mpi(request, lambda st: _finished(done, st))
        scope = self._call_scope or CancelScope(what)

        def overdue() -> bool:
            self.overdue(what, self.everyone, "", scope)
            return True  # (every rank is at work: on)

        done.block(scope, what, self.timeout, overdue)
        return comm

    def close(self) -> None:
        """The backend closes: stop the engine, close the links and communicators — except
        what a failed runtime keeps listening with for the exit guards: its peers' reports
        (that they are exiting too) come over the engine — and, without MPI, over the links,
        which then stay open until the process ends (closed, every peer's report would be
        lost and each rank would wait the whole ``grace`` at exit)."""
        if self.listening and self.MPI is None:
            return  # (without MPI the control messages come over the links)
        if self.links is not None:
            self.links.close()
        if not self.listening:
            self.engine.close()


@dataclass(frozen=True)
class Answers:
    """What the peers a wait waits for said when asked how far they got: ``text`` names
    those behind this rank's call (idle in an earlier one: they never joined it), done with
    it, past it (they went on without this rank) and mute; ``at_work``: every one is inside
    this call or still inside an earlier one (which this rank had no part in) — its own
    work is bounded, so the wait may go on; ``idle``: every one not at work answered that it
    is not in a call."""

    text: str
    at_work: bool
    idle: bool
    absent: tuple[int, ...] = ()  # the ranks asked that are not at work (or did not answer)
    behind: tuple[int, ...] = ()  # ...that never made this call and are in none
    mute: tuple[int, ...] = ()  # ...that did not answer at all

    @classmethod
    def of(cls, calls: int, got: dict[int, tuple[int, bool]], asked: Sequence[int]) -> Answers:
        late = [r for r, (c, busy) in got.items() if c < calls and not busy]
        done = [r for r, (c, busy) in got.items() if c == calls and not busy]
        past = [r for r, (c, _) in got.items() if c > calls]
        mute = [r for r in asked if r not in got]
        working = [r for r, (c, busy) in got.items() if c <= calls and busy]
        parts = []
        if late:
            parts.append(f"ranks {late} never made this call (they are at calls "
                         f"{[got[r][0] for r in late]}, this rank at {calls})")
        if done:
            parts.append(f"ranks {done} are done with this call (call {calls}) without what "
                         "this rank waits for (different plans?)")
        if past:
            parts.append(f"ranks {past} went on without this rank (they are at calls "
                         f"{[got[r][0] for r in past]}, this rank at {calls}: did they make "
                         "this call with other devices, a different plan?)")
        if mute:
            parts.append(f"ranks {mute} do not answer (exited, dead, stopped, or blocked in "
                         "MPI)")
        if not parts:
            parts.append(f"ranks {working} are at work (calls "
                         f"{[got[r][0] for r in working]}, this rank at {calls})")
        return cls("; ".join(parts), len(working) == len(asked), not past and not mute,
                   tuple(r for r in asked if r not in working), tuple(late), tuple(mute))


class Round(OneShot):
    """One round's sends and receives (see :meth:`Distributed.gather`), awaited as one: a
    one-shot done once every part is (one wake-up of the loop, by the last), or failed by
    the first part that fails other than taken back (a part taken back never completes the
    round: its wait goes on, to the timeout's ask)."""

    def __init__(self, dist: Distributed, recvs: list[Completion], sends: list[Completion],
                 members: tuple[int, ...]) -> None:
        super().__init__()
        self.dist = dist
        self.members = members
        self._recvs = recvs
        self._all = [*recvs, *sends]
        self._landed_hooks: list[Any] | None = []
        self._left_landing = len(recvs)
        self._left = len(self._all)
        for c in recvs:
            if not c.add_callback(lambda c=c: self._one_over(c, True)):
                self._one_over(c, True)
        for c in sends:
            if not c.add_callback(lambda c=c: self._one_over(c, False)):
                self._one_over(c, False)
        if not self._all:
            self.finish()

    def _one_over(self, part: Completion, landing: bool) -> None:
        error = part.error
        if error is not None and not isinstance(error, CollectiveAborted):
            self.finish(error)  # (its wait raises it at once)
        hooks = None
        with self._lock:
            self._left -= 1
            last = self._left == 0
            if landing:
                self._left_landing -= 1
                if self._left_landing == 0:
                    hooks, self._landed_hooks = self._landed_hooks, None
        if hooks and all(r.done for r in self._recvs):  # (one failed by its link: no hook)
            for hook in hooks:
                hook()
        if last and all(c.done for c in self._all):
            self.finish()

    def when_landed(self, fn: Any) -> None:
        """``fn()`` once every receive has landed, on the thread that lands the last one —
        or now, if they all have."""
        with self._lock:
            if self._landed_hooks is not None:
                self._landed_hooks.append(fn)
                return
        if all(r.done for r in self._recvs):
            fn()

    @property
    def over(self) -> bool:
        """Done, or failed — done as soon as every part is, before the thread that did it
        has run the round's callbacks (the landing hook may be comparing the rows now: a
        waiter woken meanwhile by the mismatch's cancellation sees the round done)."""
        return self._over or all(c.done for c in self._all)

    @property
    def done(self) -> bool:
        """Every send and receive is done."""
        return self.over and self._error is None

    def missing(self) -> list[int]:
        """The members whose rows have not landed (all others, for one MPI collective)."""
        if any(c.peer < 0 and not c.done for c in self._recvs):
            return [r for r in self.members if r != self.dist.rank]
        return [c.peer for c in self._recvs if not c.done]

    def cancel(self) -> None:
        """Take back the receives still pending."""
        for r in self._recvs:
            if not r.over:
                with contextlib.suppress(Exception):
                    r.Cancel()

    async def wait(self, scope: CancelScope, what: str, *, until_cancelled: bool = True,
                   deadline: float | None = None) -> bool:
        """Await every send and receive: woken once, by the last to complete (or by the
        scope's cancellation, which raises — unless ``until_cancelled`` is False); past the
        timeout, the liveness rule (:meth:`Distributed.overdue`, asked off the loop). With
        a ``deadline`` (perf_counter), False once it passed (the round goes on)."""
        if self.done:
            return True
        dist = self.dist
        period = dist.timeout
        if deadline is not None:
            period = min(period, max(0.0, deadline - time.perf_counter()))

        async def overdue() -> bool:
            if deadline is not None and time.perf_counter() >= deadline:
                return False
            # (One MPI collective has no peer of its own: every other member. Never this
            # rank: its devices are not what the wait misses.)
            pending = [c.peer for c in self._all if not c.done and c.peer >= 0] or [
                r for r in self.members if r != dist.rank]
            await asyncio.to_thread(dist.overdue, what, pending, "", scope)
            return True

        try:
            if not await wait_on(self, scope if until_cancelled else None, what, period,
                                    overdue):
                return False
            if until_cancelled and scope.cancelled and not self.done:
                raise scope.aborted(what)
            if self._error is not None:
                raise self._error
            return True
        except BaseException:
            self.cancel()
            raise


def _finished(done: Completion, status: Any) -> None:
    if isinstance(status, BaseException):
        done.fail(CollectiveAborted(f"{done.what}: {status}"))
    else:
        done.complete()


class CallRounds:
    """One call's two rounds among its members (see module doc)."""

    def __init__(self, dist: Distributed, what: str, call: int, members: tuple[int, ...],
                 digest: bytes, scope: CancelScope) -> None:
        self.dist = dist
        self.what = what
        self.call = call
        self.members = members
        self.scope = scope
        size = dist.world.size
        self._mine = np.zeros(AGREEMENT_ROW_BYTES, np.uint8)
        self._mine[:24] = np.frombuffer(digest[:24].ljust(24, b"\0"), np.uint8)
        self._mine[24:32] = np.frombuffer(call.to_bytes(8, "little"), np.uint8)
        # (digest[32:]: the call's shape table, when it has one)
        self._mine[32:] = np.frombuffer(digest[32:32 + _SHAPE_BYTES].ljust(_SHAPE_BYTES,
                                                                             b"\0"), np.uint8)
        self._every = np.zeros((size, AGREEMENT_ROW_BYTES), np.uint8)
        self._lock = threading.Lock()
        self._settled = False
        self.mismatch: CallMismatch | None = None
        self._done: Round | None = None
        self.agreement = dist.gather(AGREE_CHANNEL, call, members, self._mine, self._every)
        # Compared by the thread that lands the last row: a mismatch stops the work at once.
        self.agreement.when_landed(self._settle)

    def _settle(self) -> None:
        with self._lock:
            if self._settled:
                return
            self._settled = True
            mine, rows = self._mine.tobytes(), self._every.tobytes()
            n = AGREEMENT_ROW_BYTES
            differ = tuple(r for r in self.members if rows[n * r:n * r + n] != mine)
            if differ:
                self.mismatch = CallMismatch(
                    f"{self.what}: ranks {list(differ)} made a different call than rank "
                    f"{self.dist.rank}{self._shapes_differ(rows, differ)} (every process must "
                    "make the same runtime calls, in the same order, with the same plans and "
                    "pipelines; a skipped call, or a planner option that depends on the "
                    "process?)", ranks=differ)
        if self.mismatch is not None:
            self.scope.fail(self.mismatch)

    def _shapes_differ(self, rows: bytes, differ: tuple[int, ...]) -> str:
        """Where the first differing rank's step differs from this rank's: both numbers of
        microbatches, or the microbatch and both shapes (empty where they agree: something
        else differs)."""
        mine = self._mine.tobytes()
        r = differ[0]
        n = AGREEMENT_ROW_BYTES
        theirs = rows[n * r:n * r + n]
        here, there = _count_of(mine), _count_of(theirs)
        if here != there:
            return (f": this step has {here} microbatches here and {there} on rank {r} (every "
                    "process splits the step into the same number of microbatches)")
        for slot in range(SHAPE_SLOTS):
            a, b = (_shape_text(x, slot) for x in (mine, theirs))
            if a != b:
                return (f": microbatch {slot} has shape {a} here and {b} on rank {r} "
                        "(microbatches in another order, or of other shapes)")
        return ""

    async def agreed(self) -> None:
        """Raise :class:`~overlap.errors.CallMismatch` unless every member made this call
        (the rows came in meanwhile, usually: no wait)."""
        await self.agreement.wait(self.scope, self.what)
        self._settle()
        if self.mismatch is not None:
            raise self.mismatch

    async def verdict_after_failure(self, waited: bool = False) -> CallMismatch | None:
        """The call failed here: the agreement's verdict anyway — a mismatch explains the
        failures it caused — while the round can still complete (no member that failed
        never made this call), for at most half the ``grace`` (so this rank still reports to
        a failed peer before that peer's wait at exit ends); else None."""
        with self._lock:  # (the landing thread may be comparing the rows now: its verdict)
            if self._settled:
                return self.mismatch
        # A missing row may still come from any member that answers: one that made this
        # call posted its row then, and one idle in an earlier call (slower, not wrong —
        # seen under load) may yet make it; the deadline bounds the wait for one that never
        # does. Only a mute member (exited, dead) is given up on at once.
        missing = self.agreement.missing()
        if missing:
            # (A short ask: a wrong "mute" here only skips a verdict — the call failed.)
            answers = await asyncio.to_thread(self.dist.ask, missing, None, QUERY_WAIT_S / 2)
            # (``waited``: the call failed waiting the full timeout for a peer — one idle
            # behind it was waited for long enough already.)
            if answers.mute or (waited and answers.behind):
                return None
        deadline = time.perf_counter() + self.dist.grace / 2
        while not self.agreement.done and self._can_complete():
            if time.perf_counter() >= deadline:
                return None
            try:
                await self.agreement.wait(self.scope, self.what, until_cancelled=False,
                                          deadline=min(deadline,
                                                       time.perf_counter() + LISTEN_TICK_S))
            except Exception:
                return None
        if self.agreement.done:
            self._settle()
        return self.mismatch

    def _can_complete(self) -> bool:
        """Every member that failed (said so) had made this call: its row was posted."""
        failures = [*self.scope.failures, *(self.scope.parent.failures
                                            if self.scope.parent else ())]
        return all(f.calls >= self.call for f in failures
                   if isinstance(f, RankFailed) and f.rank in self.members)

    async def finish(self, payload: bytes) -> dict[int, bytes]:
        """This rank's part ended well: return every member's ``payload`` once every
        member's part did (waiting past the timeout while each says it is at work)."""
        row = np.frombuffer(b"\x01" + payload, np.uint8)
        table = np.zeros((self.dist.world.size, len(row)), np.uint8)
        self._done = self.dist.gather(DONE_CHANNEL, self.call, self.members, row, table)
        await self._done.wait(self.scope, f"{self.what}: every rank's work")
        return {r: table[r, 1:].tobytes() for r in self.members}

    def abandon(self) -> None:
        """The call failed: take back the rounds' receives still pending."""
        self.agreement.cancel()
        if self._done is not None:
            self._done.cancel()


def _clean_exit(error: BaseException) -> bool:
    """``sys.exit()`` / ``sys.exit(0)``: the script ends normally."""
    return isinstance(error, SystemExit) and error.code in (None, 0)


__all__ = ["Answers", "CallRounds", "Distributed", "Round", "host_links_wanted", "shape_table"]
