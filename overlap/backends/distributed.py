"""What every multi-process backend shares, composed with it as ``backend.dist``: the
runtime's own messages over MPI (per-call agreement, shared losses), failure notices between
ranks, waits that name the rank a timeout is waiting for, and ending a failed job with a
non-zero status on every rank. Which devices a process drives is the backend's own business
(its ``placement``). See ``mpi.py`` for the CPU data plane and ``cuda_mpi.py`` for the GPU
one.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (
    CallMismatch,
    CollectiveAborted,
    CollectiveTimeout,
    RankFailed,
)
from ..loop_calls import call_soon_any_thread
from ..world import Placement, World, describe, mpi_world_comm
from .host_links import HostLinks, LinkRequest

_FAILED, _EXITING, _QUERY, _REPLY, _LEFT = 1, 2, 3, 4, 5  # control message tags
# What each control message carries: field -> type. Messages are JSON objects of exactly
# these fields (plain data: nothing a peer sends is ever unpickled or executed).
_FIELDS: dict[int, dict[str, type]] = {
    _FAILED: {"rank": int, "during": str, "error": str, "calls": int},
    _EXITING: {"rank": int},
    _QUERY: {},
    _REPLY: {"calls": int, "busy": bool},
    _LEFT: {"rank": int, "calls": int, "how": str},
}
_MAX_MESSAGE = 1 << 16  # bytes: a control message is a few hundred
# Host-link channels of the runtime's own rounds (a data plane numbers its channels from 0).
AGREE_CHANNEL, SHARE_CHANNEL, DONE_CHANNEL = 0xFFFF_FFFF, 0xFFFF_FFFE, 0xFFFF_FFFD
HOST_LINKS_ENV = "OVERLAP_HOST_LINKS"
_TAGS = 1 << 31  # a round's tag is its call number modulo this (a link's tags are int32)
# A round over host links of at most this many members goes all-to-all, one hop; a larger
# one through a hub. Measured on 4 ranks sharing 2 cores (benchmarks/mpi_rounds.py): with 3
# and 4 members, calls that move data took 6-14 % less time all-to-all, a call with none
# ~20 % more; beyond 4 members its m - 1 messages a rank are not measured.
DIRECT_MEMBERS = 4


@dataclass(frozen=True)
class Backoff:
    """How a waiting thread polls MPI requests: ``spin`` tests without sleeping, then sleeps
    from ``start`` doubling up to ``cap`` seconds."""

    spin: int = 0
    start: float = 20e-6
    cap: float = 200e-6

    def __post_init__(self) -> None:
        if self.spin < 0 or not 0 <= self.start <= self.cap:
            raise ValueError(f"poll: need spin >= 0 and 0 <= start <= cap, got {self}")

    def delay(self, attempt: int) -> float:
        """Seconds to sleep before test number ``attempt + 1`` (0 while spinning)."""
        if attempt < self.spin:
            return 0.0
        return min(self.cap, self.start * 2.0 ** min(attempt - self.spin, 30))

    def pause(self, attempt: int) -> None:
        delay = self.delay(attempt)
        if delay:
            time.sleep(delay)


# How a call's agreement round is polled while the call's work runs: rarely, because testing
# it alongside a large transfer contends for MPI's lock (measured: a 64 MiB transfer took
# +1.0-1.4 ms with the round tested every 20-200 µs beside it); MPI's progress is global, so the
# work's own tests move the round along meanwhile. Once the work ends, at the normal backoff.
QUIET = Backoff(start=1e-3, cap=16e-3)


_LIVE: weakref.WeakSet[Distributed] = weakref.WeakSet()
log = logging.getLogger("overlap")


class Distributed:
    """The multi-process layer of one rank's backend, composed with it: a data-plane backend
    (``MpiBackend``, ``CudaMpiBackend``) makes one as its ``dist``. It uses only the backend's
    public API (``abort``, ``abort_reason``, ``note_failure``, ``failures``, ``timeout``,
    ``num_devices``); the runtime reaches it as ``backend.dist``.

    ``grace``: how long a failed process waits at exit for its peers to report (and print
    their errors) before ``MPI_Abort`` ends the job.

    ``host_links``: link the ranks of each host with Unix sockets (``host_links.py``) — the
    runtime's own rounds (agreement, shared losses) then go over them where they join every
    rank, and a data plane may move its bytes over them (``MpiBackend`` does); None
    (default): yes, unless the environment sets ``OVERLAP_HOST_LINKS=0``. Every rank must
    pass the same."""

    def __init__(self, backend: Any, world: World, placement: Placement, *,
                 poll: Backoff | None = None, grace: float = 5.0,
                 host_links: bool | None = None) -> None:
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
            raise ValueError(f"grace: expected seconds >= 0, got {grace!r}")
        links_on = host_links_wanted(host_links)
        placement.check_covers(backend.num_devices)
        self.MPI = _mpi()
        comm = mpi_world_comm("a multi-process world")
        if comm.Get_size() != world.size or comm.Get_rank() != world.rank:
            raise ValueError(f"world: rank {world.rank} of {world.size} does not match "
                             f"MPI.COMM_WORLD (rank {comm.Get_rank()} of {comm.Get_size()})")
        self.backend = backend
        self.world = world
        self.placement = placement
        self.rank = world.rank
        self.local_devices = placement.devices_of(world.rank)
        self.poll = poll or Backoff()
        self.grace = grace
        self.comm = comm  # COMM_WORLD: data planes Dup their communicators from it
        # Collective over every rank, in the same order everywhere (main thread).
        self.runtime_comm = comm.Dup()
        self.tag_ub = int(comm.Get_attr(self.MPI.TAG_UB))  # (the same on its Dups)
        self.broken: BaseException | None = None
        self.calls = 0  # the runtime's call counter (the control thread reports it to peers)
        self.members = self.everyone  # the ranks the latest call needs (see ``agree``)
        self.busy = False  # inside a call (the runtime sets it; peers ask, see _Control)
        # When every member of the latest call was known to be in it (its agreement came
        # back; None: not yet): a transfer's wait for a peer counts its timeout from then.
        self.agreed_at: float | None = 0.0
        self.departed: dict[int, tuple[int, str]] = {}  # rank -> (its calls, how it left)
        self.left = False  # this rank told its peers it left
        self.closed = False
        self.control = _Control(self, comm.Dup())
        self.links = HostLinks.connect(comm) if links_on else None
        # The runtime's rounds go over links when they join this rank to every other.
        self.rounds_linked = (self.links is not None
                              and len(self.links.peers) == world.size - 1)
        _LIVE.add(self)
        _install_exit_guards()

    def check(self, what: str, started: float, who: str, peer: int | None) -> None:
        """Raise if the run was aborted, or (naming ``who``) if ``what`` has waited too long."""
        reason = self.backend.abort_reason
        if reason is not None:
            raise CollectiveAborted(f"{what} on rank {self.rank}: aborted ({reason})")
        if time.perf_counter() - started > self.backend.timeout:
            missing = () if peer is None else tuple(self.placement.devices_of(peer))
            raise CollectiveTimeout(
                f"{what}: rank {self.rank} waited {self.backend.timeout:g} s; {who} "
                "(a failed or stuck peer, or step graphs that differ between ranks)",
                op=what, devices=(), missing=missing)

    def check_transfer(self, what: str, started: float, who: str, peer: int | None) -> None:
        """:meth:`check` for a transfer's wait for a peer (``started``: when it began): its
        timeout counts from when every member of the call was known to be in it (the
        agreement), not before — a rank outside a call goes on to the next one and posts its
        receives while the call's members may be busy there a long time (their own waits
        bound that call); until the agreement, the agreement's wait bounds this one."""
        self.check(what, self.bound_start(started), who, peer)

    def bound_start(self, started: float) -> float:
        """When the time bound of a transfer that began at ``started`` starts: once every
        member of the call was known to be in it (``agreed_at``; not yet: now)."""
        agreed = self.agreed_at
        return time.perf_counter() if agreed is None else max(started, agreed)

    # ---- the runtime's own messages (main thread / event loop) ---------------------------

    def agree(self, digest: bytes, what: str, call: int,
              members: tuple[int, ...] | None = None) -> Agreement | None:
        """Start checking that every rank of the call's ``members`` (default: every rank)
        passes the same ``digest`` for call number ``call`` (same step graph, same plan): the
        caller posts the round (:meth:`Agreement.post`) once it has launched the call's work
        (its first data goes ahead of the row) — or as that work ends, over host links
        (see :class:`Agreement`) — then awaits :meth:`Agreement.wait` for the verdict.
        None where there is nothing to check: this
        rank holds none of the call's devices, or is their only holder — it takes no part in
        the call's rounds, and no other rank waits for it. Raises :class:`RankFailed` at once
        when a member that left cannot make this call."""
        members = self.everyone if members is None else members
        self.members = members
        self._check_departed(call, members)
        if self.rank not in members or len(members) == 1:
            self.agreed_at = time.perf_counter()
            return None
        self.agreed_at = None
        return Agreement(self, digest, what, call, members)

    @property
    def everyone(self) -> tuple[int, ...]:
        return tuple(range(self.world.size))

    def _check_departed(self, call: int, members: tuple[int, ...]) -> None:
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
        if self.broken is None:
            self.broken = err
        self.backend.note_failure(err)
        self.backend.abort(f"rank {r} left")
        raise err

    def peer_left(self, rank: int, calls: int, how: str) -> None:
        """A notice from the control thread: ``rank`` left after ``calls`` calls."""
        self.departed[rank] = (calls, how)
        self.control.exiting.add(rank)  # gone: nothing to wait for at exit
        # The call in flight (if any) fails at once if it needs the rank; the next call
        # fails when it starts (agree).
        if self.calls > calls and self.broken is None:
            with contextlib.suppress(RankFailed):
                self._check_departed(self.calls, self.members)

    def leave(self, how: str) -> None:
        """Tell every other rank that this one leaves (its runtime closed, or the process
        exits) after ``self.calls`` calls: a peer that makes a further call fails at once,
        naming it, instead of waiting out its timeout."""
        if not self.left:
            self.left = True
            self.control.tell_all(_LEFT, {"rank": self.rank, "calls": self.calls, "how": how})

    async def share(self, values: np.ndarray, root_rank: int, what: str) -> np.ndarray:
        """``values`` of ``root_rank`` on every rank (an ``Ibcast``, or its sends over host
        links)."""
        buf = np.ascontiguousarray(values, dtype=np.float64).copy()
        if self.rounds_linked:
            assert self.links is not None
            links = self.links
            round_ = (_LinkRound([links.isend(SHARE_CHANNEL, r, 0, buf) for r in links.peers],
                                 []) if self.rank == root_rank else
                      _LinkRound([], [links.irecv(SHARE_CHANNEL, root_rank, 0, buf)]))
            await self.wait_linked(round_, what)
            return buf
        await self._await(self.runtime_comm.Ibcast(buf, root=root_rank), what)
        return buf

    async def _await(self, req: Any, what: str, patient: bool = False) -> None:
        """Wait for ``req`` off the event loop: a worker thread polls it with the backoff
        (the loop's timers have millisecond resolution; MPI rounds take microseconds)."""
        await asyncio.to_thread(self.wait_polled, req, what, None, None, patient)

    async def wait_round(self, round_: Any, what: str,
                         through_abort: Callable[[], bool] | None = None,
                         pause: Callable[[int], None] | None = None,
                         patient: bool = False, among: tuple[int, ...] | None = None) -> None:
        """Wait for a round made by :meth:`gather_round`: on the event loop when it goes
        over host links (:meth:`wait_linked`), else polled by a worker thread
        (:meth:`wait_polled`, ``pause`` between tests)."""
        if isinstance(round_, _LinkRound):
            await self.wait_linked(round_, what, through_abort, patient, among)
        else:
            await asyncio.to_thread(self.wait_polled, round_, what, through_abort, pause,
                                    patient, among)

    def wait_polled(self, req: Any, what: str,
                    through_abort: Callable[[], bool] | None = None,
                    pause: Callable[[int], None] | None = None,
                    patient: bool = False, among: tuple[int, ...] | None = None) -> None:
        """Poll ``req`` until it completes (``pause(attempt)`` between tests; default the
        backoff). Once the run is aborted, keep waiting only while ``through_abort`` says the
        request can still complete, and at most half the ``grace`` (so this rank still
        reports to a failed peer before that peer's wait at exit ends). Past the timeout
        the peers (``among``: the call's members; default every rank) are asked how far
        they got: the wait fails naming them — unless ``patient`` and every one answers that
        it is at work, inside this call or still inside an earlier one it had no part in (a
        wait for the others' work: a stuck op there is found by its own rank)."""
        pause = pause or self.poll.pause
        started = time.perf_counter()
        aborted_at: float | None = None
        attempt = 0
        try:
            while not req.Test():
                aborted_at, late = self._look(what, started, aborted_at, through_abort)
                if late:
                    who, inside = self.control.lagging(self.calls, among)
                    if patient and inside:
                        started = time.perf_counter()
                    else:
                        self.check(what, started, who, None)
                pause(attempt)
                attempt += 1
        except BaseException:
            _cancel([req])
            raise

    def gather_round(self, channel: int, call: int, members: tuple[int, ...],
                     mine: np.ndarray, every: np.ndarray) -> Any:
        """Post one of the runtime's rounds for call number ``call``: each member's ``mine``
        in ``every[r]`` on every member (this rank's row is the caller's; ``channel``:
        ``AGREE_CHANNEL`` or ``DONE_CHANNEL``). Only the ``members`` (sorted ranks, this one
        among them) take part. Returns a request to wait for with :meth:`wait_round`.

        Over host links where they join every member (:meth:`_gather_linked`); else over MPI
        on the runtime's communicator: an ``Iallgather`` where every rank is a member, point
        to point among the members otherwise (an all-to-all: one hop, no forwarding, and the
        members need no communicator of their own)."""
        others = [r for r in members if r != self.rank]
        if self.linked(others):
            return self._gather_linked(channel, call, members, others, mine, every)
        if len(members) == self.world.size:
            return self.runtime_comm.Iallgather(mine, every)
        comm, tag = self.runtime_comm, self._p2p_tag(channel, call)
        return _MpiRound([comm.Isend(mine, dest=r, tag=tag) for r in others],
                         [comm.Irecv(every[r], source=r, tag=tag) for r in others],
                         self.MPI)

    def collective_round(self, members: tuple[int, ...]) -> bool:
        """Whether :meth:`gather_round` among ``members`` is an MPI collective (an
        ``Iallgather`` on the runtime's communicator), which every rank must post in the same
        order as its other collectives there — so from one thread, the event loop."""
        return (not self.linked([r for r in members if r != self.rank])
                and len(members) == self.world.size)

    def linked(self, others: list[int]) -> bool:
        """Whether a host link joins this rank to every one of ``others``."""
        return self.links is not None and all(self.links.has(r) for r in others)

    def _p2p_tag(self, channel: int, call: int) -> int:
        """An MPI tag for a round among some ranks: the call number (wrapped below the MPI's
        tag bound) and which round of the call."""
        kinds = (AGREE_CHANNEL, DONE_CHANNEL)
        span = max(1, (self.tag_ub + 1) // len(kinds))
        return (call % span) * len(kinds) + kinds.index(channel)

    def _gather_linked(self, channel: int, call: int, members: tuple[int, ...],
                       others: list[int], mine: np.ndarray, every: np.ndarray) -> _LinkRound:
        """:meth:`gather_round` over host links. Up to ``DIRECT_MEMBERS`` members send their
        row to every other (one hop, m (m - 1) messages a round). More gather through one
        member — the hub, which changes with the ``call`` number so that no rank carries
        every call's load: the others send theirs to the hub and receive the whole table
        from it, which the hub sends from the thread that lands the last row (not by way of
        its event loop): 2 (m - 1) messages a round, for one more hop."""
        links = self.links
        assert links is not None
        tag = call % _TAGS
        if len(members) <= DIRECT_MEMBERS:
            # (Receives first: a row that comes before its receive is posted is copied.)
            recvs = [links.irecv(channel, r, tag, every[r]) for r in others]
            return _LinkRound([links.isend(channel, r, tag, mine) for r in others], recvs)
        hub = members[call % len(members)]
        if self.rank != hub:
            return _LinkRound([links.isend(channel, hub, tag, mine)],
                              [links.irecv(channel, hub, tag, every)])

        def forward() -> None:
            for r in others:
                links.isend(channel, r, tag, every)

        round_ = _LinkRound([], [links.irecv(channel, r, tag, every[r]) for r in others])
        round_.when_landed(forward)
        return round_

    async def wait_linked(self, round_: _LinkRound, what: str,
                          through_abort: Callable[[], bool] | None = None,
                          patient: bool = False, among: tuple[int, ...] | None = None) -> None:
        """:meth:`wait_polled` for a round over host links, on the event loop itself: each
        completion wakes the loop (no worker thread between, two thread hand-offs fewer a
        round); aborts and timeouts are looked at every ``LISTEN_TICK_S``."""
        if round_.Test():
            return  # (over already, as the end-of-call round often is: nothing to arm)
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                call_soon_any_thread(loop, ready.set)

        round_.arm(wake)
        started = time.perf_counter()
        aborted_at: float | None = None
        try:
            while not round_.Test():
                aborted_at, late = self._look(what, started, aborted_at, through_abort)
                if late:
                    who, inside = await asyncio.to_thread(self.control.lagging, self.calls,
                                                          among)
                    if patient and inside:
                        started = time.perf_counter()
                    else:
                        self.check(what, started, who, None)
                # A timer, not asyncio.wait_for: on 3.11 that drops a cancel that comes in
                # the loop pass its wait ends (gh-86296) — Ctrl-C would go unseen.
                tick = loop.call_later(LISTEN_TICK_S, ready.set)
                try:
                    await ready.wait()
                finally:
                    tick.cancel()
                ready.clear()  # (before the next Test: a completion after it sets it again)
        except BaseException:
            _cancel([round_])
            raise

    def _look(self, what: str, started: float, aborted_at: float | None,
              through_abort: Callable[[], bool] | None) -> tuple[float | None, bool]:
        """One look while a request is pending: raise if aborted (unless ``through_abort``
        says it can still complete, for at most half the ``grace``); return when the abort
        was first seen and whether the wait ran past the timeout — for the caller to ask
        the peers how far they got. (Not after an abort: that waits up to a second for
        replies a failed peer never sends — a call aborted by a peer's failure notice
        returned a second late.)"""
        now = time.perf_counter()
        if self.backend.abort_reason is not None and aborted_at is None:
            aborted_at = now
        if (aborted_at is None or through_abort is None or not through_abort()
                or now - aborted_at >= self.grace / 2):
            self.check(what, now, "", None)  # the abort only: the timeout is the caller's
        return aborted_at, now - started > self.backend.timeout

    # ---- failures across processes -------------------------------------------------------

    def announce_failure(self, during: str, error: BaseException) -> None:
        """Tell every other rank that this one failed (best effort, bounded)."""
        if self.broken is None:
            self.broken = error
        text = f"{type(error).__name__}: {error}"
        self.control.tell_all(_FAILED, {"rank": self.rank, "during": during, "error": text,
                                        "calls": self.calls})

    def remote_failure(self, msg: dict[str, Any]) -> None:
        err = RankFailed(
            f"rank {msg['rank']} failed during {msg['during']}: {msg['error']} "
            f"(rank {self.rank} stopped its work)",
            rank=int(msg["rank"]), error=str(msg["error"]), calls=int(msg["calls"]))
        if self.broken is None:
            self.broken = err
        self.backend.note_failure(err)
        self.backend.abort(f"rank {msg['rank']} failed")

    def close(self, error: BaseException | None = None, handled: bool = False) -> None:
        """The runtime closed: tell the peers this rank left, stop listening.

        ``error``: the exception leaving the runtime's ``with`` block; the peers are then told
        this rank failed (unless it is ``sys.exit(0)``). A runtime that failed keeps listening
        — and the exit guards end the job at exit (see :func:`_at_exit`) — unless the caller
        ``handled`` the failure: ``Runtime.close()`` called with no exception in flight. Only
        the first call counts (the backend's close calls it again)."""
        if self.closed:
            return
        self.closed = True
        if error is not None and not _clean_exit(error):
            if self.broken is None:
                self.announce_failure("the script (an uncaught exception)", error)
            return
        if self.broken is not None and not handled:
            return
        if self.broken is None:
            self.leave("exited" if error is not None else "closed its runtime")
        self.control.stop()
        if self.links is not None:
            self.links.close()
        _LIVE.discard(self)

    def describe(self) -> str:
        return describe(self.world, self.local_devices)


class Agreement:
    """One runtime call's check that every member of the call (the ranks holding its
    devices) made the same call: a gather of rows (:meth:`Distributed.gather_round`) — each
    member's 32-byte digest, and whether its part of the call had ended well when it posted
    the row.

    Posted as the call's work is launched, so it runs alongside it — or, over host links on
    a backend whose events end with their work, once this rank's part has ended (at most
    ``ROW_WITHIN_S`` after the launch, :meth:`post_within`): a row that says so stands for
    this rank's row of the end-of-call round too, and where every member's does, that round
    is not needed (every member sees the same table, so all skip it alike).

    A mismatch is also recorded as the backend's failure, so work launched meanwhile stops at
    once, with it as the root cause. Over host links the rows are compared by the thread
    that lands the last of them (``checked_early``): no task waits for them meanwhile; over
    MPI a task polls the round (:meth:`wait`)."""

    def __init__(self, dist: Distributed, digest: bytes, what: str, call: int,
                 members: tuple[int, ...]) -> None:
        self.dist = dist
        self.what = what
        self.call = call
        self.members = members
        self._mine = np.zeros(_ROW, np.uint8)
        self._mine[:32] = np.frombuffer(digest.ljust(32, b"\0")[:32], np.uint8)
        self._every = np.zeros((dist.world.size, _ROW), np.uint8)
        # Hurries a round polled over MPI (``_pause``; made with it: over host links nothing
        # polls).
        self._hurry: threading.Event | None = None
        self._hurried_at = 0
        self._post_lock = threading.Lock()  # (posting the row; taken before _done_lock)
        self._done_lock = threading.Lock()  # (the end-of-call round's, and settling's)
        self._settled = False
        self._mismatch: CallMismatch | None = None
        self._req: Any = None  # the round, once posted (``post``)
        self._over = False  # the call ended here (``finish``, ``abandon``): no row goes now
        self._timer: asyncio.TimerHandle | None = None  # ``post_within``'s
        # Over host links the landing thread compares the rows; and the row may wait for the
        # work's end (see the class doc).
        self.checked_early = dist.linked([r for r in members if r != dist.rank])
        self._done: Any = None  # the end-of-call round, once posted (see ``post_done``)
        self._flags = np.zeros((dist.world.size, 1), np.uint8)
        self._flags[dist.rank] = _DONE

    def post(self, ended: bool = False) -> bool:
        """Post this rank's row (once; any thread), saying whether this rank's part of the
        call has ``ended`` well. False: posted already (or the call is over here)."""
        with self._post_lock:
            if self._req is not None or self._over:
                return False
            d = self.dist
            self._mine[_ENDED] = ended
            self._every[d.rank] = self._mine
            self._req = d.gather_round(AGREE_CHANNEL, self.call, self.members, self._mine,
                                       self._every)
            if self.checked_early:
                self._req.when_landed(self._settle)
            else:
                self._hurry = threading.Event()
            return True

    def post_within(self, loop: asyncio.AbstractEventLoop, seconds: float | None = None
                    ) -> None:
        """Post the row from ``loop`` in ``seconds`` unless the work's end posts it first: a
        peer's transfer timeouts, and a mismatch's discovery, wait for it."""
        if self._req is None:
            self._timer = loop.call_later(ROW_WITHIN_S if seconds is None else seconds,
                                          self.post)

    def hurry(self) -> None:
        """The call's work has ended (or failed): poll at the normal backoff from now on."""
        if self._hurry is not None:
            self._hurry.set()

    def hurry_after(self, events: Sequence[Any], ended: bool = False) -> None:
        """:meth:`hurry` as soon as every one of ``events`` completes or fails, from the
        thread that completes the last one (not by way of the event loop: one thread hop
        fewer at the end of every call). ``ended``: an event's completion is its work's end
        (the host backends; on CUDA it is its launch) — then, if every one succeeded, this
        rank's row goes from that thread, saying so, if it has not gone yet; else its row of
        the end-of-call round (:meth:`post_done`). Either way a peer waiting for it is not
        kept waiting until this rank's event loop has run. (A failed part posts nothing
        here: the event loop's :meth:`wait` posts the row.)"""
        left = [len(events)]
        failed = [False]
        lock = threading.Lock()

        def over() -> None:
            self.hurry()
            if not ended or failed[0]:
                return
            # (A post that fails here — the links closed or failed meanwhile — is posted
            # again by the event loop, which meets the failure itself: wait, finish.)
            with contextlib.suppress(Exception):
                if not self.post(ended=True):
                    self.post_done(early=True)

        def one(ev: Any) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
                failed[0] = failed[0] or ev.error is not None
            if last:
                over()

        if not events:
            over()
        for ev in events:
            ev.add_done_callback(one)

    def post_done(self, early: bool = False) -> None:
        """Post this rank's row of the end-of-call round (once; any thread). ``early``: from
        the thread that completed the call's work, where the round may go from any thread:
        not an MPI collective (those must be posted in one order on every rank, and the
        runtime's come from its event loop) and not after an abort (then the work failed
        here or elsewhere, and the round would only be cancelled)."""
        d = self.dist
        if early and (d.backend.abort_reason is not None or d.collective_round(self.members)):
            return
        with self._done_lock:
            if self._done is None and not self._over:
                self._done = d.gather_round(DONE_CHANNEL, self.call, self.members, _DONE,
                                            self._flags)

    def abandon(self) -> None:
        """The call failed: post nothing more, and take back the end-of-call round's
        receives if it was posted (the rows of the agreement were waited for, or taken back,
        by :meth:`wait`)."""
        self._end_here()
        with self._done_lock:
            done = self._done
        if done is not None:
            _cancel([done])

    def _end_here(self) -> None:
        with self._post_lock:
            self._over = True
        if self._timer is not None:
            self._timer.cancel()

    def _pause(self, attempt: int) -> None:
        assert self._hurry is not None  # (a polled round's)
        if not self._hurry.is_set():
            self._hurried_at = attempt + 1
            self._hurry.wait(QUIET.delay(attempt))
        else:
            self.dist.poll.pause(attempt - self._hurried_at)

    def _can_complete(self) -> bool:
        """Every member that made this call posted its part of the round, so it completes
        even after an abort, unless a failed member never got this far."""
        return all(f.calls >= self.call for f in self.dist.backend.failures
                   if isinstance(f, RankFailed) and f.rank in self.members)

    async def finish(self) -> None:
        """This rank's work for the call ended well: return once every member's did — at
        once where every member's row of the agreement said so, else after the end-of-call
        round (a barrier: the same gather as the digests', of one byte). A rank whose work
        failed never gets here; its failure notice aborts this wait, which then raises (the
        runtime reports :class:`RankFailed` naming it). It waits for the others' whole
        remaining work, so past the timeout it waits on while every member says it is
        inside this call (an op stuck there is that rank's to find)."""
        if all(self._every[r, _ENDED] for r in self.members):
            self._end_here()
            return
        d = self.dist
        self.post_done()  # (unless posted already, as the work ended)
        self._end_here()
        await d.wait_round(self._done, f"{self.what}: every rank's work", patient=True,
                           among=self.members)

    async def wait(self) -> None:
        """Raise :class:`CallMismatch` unless every member made the same call.

        Programs that differ make the work fail too, here or on another rank, often before
        this round completes: it is still awaited then (bounded, while it can complete),
        because a mismatch is the explanation the user needs, not the failures it caused."""
        self.post()  # (unless posted already: as the work ended, or failed, here)
        if not self._settled:
            # Patient: a member may still be inside an earlier call this rank had no part in.
            await self.dist.wait_round(self._req, self.what, self._can_complete, self._pause,
                                       patient=True, among=self.members)
            self._settle()
        if self._mismatch is not None:
            raise self._mismatch

    def _settle(self) -> None:
        """Every row is in (any thread, once): the agreement time, and a mismatch recorded as
        the backend's failure (which stops the work at once). Settled only once the verdict
        is known: a second caller (the loop's :meth:`wait`, as the landing thread settles)
        waits for it here."""
        b = self.dist
        with self._done_lock:
            if self._settled:
                return
            b.agreed_at = time.perf_counter()
            # (Bytes compared: numpy's dispatch costs more than the comparison, every call.)
            mine, rows = self._mine[:32].tobytes(), self._every.tobytes()
            differ = tuple(r for r in self.members if rows[_ROW * r:_ROW * r + 32] != mine)
            if differ:
                self._mismatch = CallMismatch(
                    f"{self.what}: ranks {list(differ)} made a different call than rank "
                    f"{b.rank} (every process must make the same runtime calls, in the same "
                    "order, with the same plans and pipelines; a skipped call, or a planner "
                    "option that depends on the process?)", ranks=differ)
            self._settled = True
        if self._mismatch is not None:
            b.backend.note_failure(self._mismatch)


_DONE = np.ones(1, np.uint8)
# An agreement's row: the call's 32-byte digest, then whether the rank's part had ended well.
_ROW, _ENDED = 33, 32
# How long after its launch a call may hold its agreement row back for its work's end (see
# Agreement): a peer's transfer timeouts and a mismatch's discovery wait for it meanwhile.
ROW_WITHIN_S = 10e-3


class _LinkRound:
    """Sends and receives over host links, waited for like an MPI request (``Test``,
    ``Cancel``, ``Wait``; see :meth:`Distributed.wait_linked`). What :meth:`when_landed`
    was given runs once every receive has landed, on the thread that lands the last one (or
    the caller's, if they all had)."""

    def __init__(self, sends: list[LinkRequest], recvs: list[LinkRequest]) -> None:
        self._recvs = recvs
        self._reqs = [*sends, *recvs]
        self._lock = threading.Lock()
        self._wake: Callable[[], None] | None = None
        self._hooks: list[Callable[[], None]] | None = []  # when_landed's (None: landed)
        self._left = len(recvs) + 1  # (+1: until every request is watched)
        for r in sends:
            r.notify(self._ended)
        for r in recvs:
            if not r.notify(self._landed):
                self._landed()
        self._landed()

    def _ended(self) -> None:
        # The waiter is woken once the round is over, not once a message (a wake-up costs
        # tens of microseconds on a busy machine; a hub receives n - 1). A request failed by
        # its link wakes nobody: the peer's notice, or the timeout, ends that wait.
        wake = self._wake
        if wake is not None and self.Test():
            wake()

    def _landed(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
            hooks: list[Callable[[], None]] = []
            if last:
                hooks, self._hooks = self._hooks or [], None
        # (A receive failed by its link ends too: no hook runs for a round with a hole.)
        if last and all(r.done for r in self._recvs):
            for hook in hooks:
                hook()
        self._ended()

    def when_landed(self, fn: Callable[[], None]) -> None:
        """``fn()`` once every receive has landed, on the thread that lands the last one —
        or now, on this one, if they all have."""
        with self._lock:
            if self._hooks is not None:
                self._hooks.append(fn)
                return
        if all(r.done for r in self._recvs):
            fn()

    def arm(self, wake: Callable[[], None]) -> None:
        """``wake()`` once every request has completed (from now: a round over already is
        seen by ``Test``)."""
        self._wake = wake

    def Test(self) -> bool:
        # A request failed by a link that closed stays "pending": the peer's notice (or the
        # timeout) ends the wait and names the rank — not this link's error.
        return all(r.done for r in self._reqs)

    def Cancel(self) -> None:
        for r in self._recvs:
            r.Cancel()

    def Wait(self) -> None:
        """(After ``Cancel``: nothing to wait for.)"""


class _MpiRound:
    """A round's MPI requests among some ranks, waited for as one (``Test``: all complete;
    ``Cancel``, then ``Wait``: the receives taken back)."""

    def __init__(self, sends: list[Any], recvs: list[Any], mpi: Any) -> None:
        self._reqs = [*sends, *recvs]
        self._recvs = recvs
        self._testall = mpi.Request.Testall

    def Test(self) -> bool:
        return bool(self._testall(self._reqs))

    def Cancel(self) -> None:
        for r in self._recvs:
            r.Cancel()

    def Wait(self) -> None:
        for r in self._recvs:
            r.Wait()


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


def _clean_exit(error: BaseException) -> bool:
    """``sys.exit()`` / ``sys.exit(0)``: the script ends normally."""
    return isinstance(error, SystemExit) and error.code in (None, 0)


def _parse(tag: int, data: bytes) -> dict[str, Any] | None:
    """A control message, if ``data`` is one of the kind ``tag`` says (else None)."""
    fields = _FIELDS.get(tag)
    if fields is None or len(data) > _MAX_MESSAGE:
        return None
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(msg, dict) or set(msg) != set(fields):
        return None
    if not all(type(msg[k]) is t for k, t in fields.items()):
        return None
    return msg


def _cancel(reqs: Sequence[Any]) -> None:
    """Take back receives still pending (MPI can cancel receives, not sends)."""
    for r in reqs:
        with contextlib.suppress(Exception):
            r.Cancel()
            r.Wait()


LISTEN_TICK_S = 0.02


class _Control:
    """A thread per process listening for failure and exit notices from other ranks, and
    answering "how many calls have you made?" queries."""

    def __init__(self, dist: Distributed, comm: Any) -> None:
        self.dist = weakref.proxy(dist)
        self.comm = comm
        self.rank = dist.rank
        self.size = dist.world.size
        self.MPI = dist.MPI
        self.exiting: set[int] = set()
        self.replies: dict[int, tuple[int, bool]] = {}  # rank -> its calls, inside one
        # Seconds between looks for a notice. A notice needs no hurry (a failed rank is named
        # within a second), and every look costs CPU a busy peer on the same cores needs:
        # ``benchmarks/mpi_step_profile.py`` measured 1.1-1.5 ms per rank per 60 ms step at
        # 2 ms (docs/benchmarks.md).
        self.tick = LISTEN_TICK_S
        # Sends in flight, with their bytes (kept alive until MPI is done with them).
        self._pending: list[tuple[Any, bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="overlap-mpi-control",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        MPI = self.MPI
        status = MPI.Status()
        while not self._stop.is_set():
            if not self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                self._stop.wait(self.tick)
                continue
            source, tag = status.Get_source(), status.Get_tag()
            buf = bytearray(status.Get_count(MPI.BYTE))
            self.comm.Recv([buf, MPI.BYTE], source=source, tag=tag)
            msg = _parse(tag, bytes(buf))
            if msg is None:
                log.warning("overlap: ignored a malformed control message (tag %d) from rank "
                            "%d", tag, source)
                continue
            with contextlib.suppress(ReferenceError):  # (the runtime went away meanwhile)
                self._handle(source, tag, msg)

    def _handle(self, source: int, tag: int, msg: dict[str, Any]) -> None:
        if tag == _EXITING:
            self.exiting.add(source)
        elif tag == _QUERY:
            self._send(source, _REPLY, {"calls": self.dist.calls, "busy": self.dist.busy})
        elif tag == _REPLY:
            self.replies[source] = (msg["calls"], msg["busy"])
        elif tag == _FAILED:
            self.dist.remote_failure(msg)
        elif tag == _LEFT:
            self.dist.peer_left(source, msg["calls"], msg["how"])

    def _send(self, dest: int, tag: int, msg: dict[str, Any]) -> Any:
        """Post one message (JSON bytes); the request keeps its buffer alive until done."""
        data = json.dumps(msg).encode()
        with self._lock:
            self._pending = [(r, b) for r, b in self._pending if not r.Test()]
            req = self.comm.Isend([data, self.MPI.BYTE], dest=dest, tag=tag)
            self._pending.append((req, data))
        return req

    def tell_all(self, tag: int, msg: dict[str, Any], wait: float = 1.0) -> None:
        reqs = [self._send(r, tag, msg) for r in range(self.size) if r != self.rank]
        deadline = time.perf_counter() + wait
        while reqs and time.perf_counter() < deadline:
            reqs = [r for r in reqs if not r.Test()]
            time.sleep(0.001)

    def behind(self, calls: int, wait: float = 1.0,
               among: Sequence[int] | None = None) -> str:
        """Ask every rank how many runtime calls it has made; name those of ``among`` (the
        call's members; default every rank) behind ``calls`` (still in an earlier call, or
        not in any: they never joined this one), past it (they went on without this rank)
        and those that did not answer."""
        return self.lagging(calls, among, wait)[0]

    def lagging(self, calls: int, among: Sequence[int] | None = None,
                wait: float = 1.0) -> tuple[str, bool]:
        """:meth:`behind`'s text, and whether every other member answered that it is at
        work: inside this call, or still inside an earlier one (which this rank had no part
        in) — so a wait for it may go on; a stuck op there is its own rank's to find."""
        self.replies.clear()
        self.tell_all(_QUERY, {}, wait)
        others = [r for r in (range(self.size) if among is None else among) if r != self.rank]
        deadline = time.perf_counter() + wait
        # (Not past an abort: a failure notice that came meanwhile is the explanation, and
        # a failed peer may never answer — the caller raised a second late.)
        while (any(r not in self.replies for r in others) and time.perf_counter() < deadline
               and self.dist.backend.abort_reason is None):
            time.sleep(0.005)
        got = {r: self.replies[r] for r in others if r in self.replies}
        late = [r for r, (c, busy) in got.items() if c < calls and not busy]
        earlier = [r for r, (c, busy) in got.items() if c < calls and busy]
        past = [r for r, (c, _) in got.items() if c > calls]
        mute = [r for r in others if r not in got]
        inside = [r for r, (c, _) in got.items() if c == calls]
        parts = []
        if late:
            parts.append(f"ranks {late} never made this call (they are at calls "
                         f"{[got[r][0] for r in late]}, this rank at {calls})")
        if past:
            parts.append(f"ranks {past} went on without this rank (they are at calls "
                         f"{[got[r][0] for r in past]}, this rank at {calls}: did they make "
                         "this call with other devices, a different plan?)")
        if mute:
            parts.append(f"ranks {mute} do not answer (exited, dead, or blocked in MPI)")
        if earlier and not parts:
            parts.append(f"ranks {earlier} are still in calls {[got[r][0] for r in earlier]}, "
                         f"this rank at {calls}")
        if inside and not parts:
            parts.append(f"ranks {inside} are in this call but never got this far (stuck in "
                         "an op? their own errors say which)")
        return ("; ".join(parts) or "every rank made this call (a stuck peer?)",
                len(inside) + len(earlier) == len(others))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()


# ---- process exit: a failed job must end, on every rank, with a non-zero status ------------

_GUARDS = False
_LINGER_S = 0.5  # after every peer reported: time for the launcher to forward their output


def print_whole(tp: type[BaseException], value: BaseException, tb: Any) -> None:
    """Print a traceback as Python does, but in one write: the default hook writes it in
    pieces ("overlap.errors.", "CallMismatch", ": ", the message...), and with unbuffered
    output (PYTHONUNBUFFERED) the launcher interleaves the pieces of several ranks' errors
    mid-line (seen: "overlap.errors.    return self.run_sync(...)")."""
    text = "".join(traceback.format_exception(tp, value, tb))
    with contextlib.suppress(Exception):
        sys.stderr.write(text)
        sys.stderr.flush()


def _install_exit_guards() -> None:
    global _GUARDS
    if _GUARDS:
        return
    _GUARDS = True
    previous = sys.excepthook

    def excepthook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        if previous is sys.__excepthook__:
            print_whole(tp, value, tb)
        else:  # the user's own hook (IPython, rich, ...) prints it their way
            previous(tp, value, tb)
        for d in list(_LIVE):
            if d.broken is None and not isinstance(value, RankFailed):
                d.announce_failure("the script (an uncaught exception)", value)
            d.broken = d.broken or value
            break

    sys.excepthook = excepthook
    atexit.register(_at_exit)


def _at_exit() -> None:
    for d in list(_LIVE):
        failures = d.backend.failures
        if d.broken is None and failures:  # failed work nobody raised: still a failure
            d.announce_failure("work that failed before exit", failures[0])
    broken = [d for d in list(_LIVE) if d.broken is not None]
    if not broken:
        for d in list(_LIVE):
            d.leave("exited")  # the script ended without closing its runtime
            d.control.stop()
        return
    b = broken[0]
    # Let the peers print their own errors before the launcher takes the job down: every
    # rank flushes what it printed, then says so, and the first MPI_Abort waits for all.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    b.control.tell_all(_EXITING, {"rank": b.rank})
    deadline = time.perf_counter() + b.grace
    others = set(range(b.world.size)) - {b.rank}
    while not others <= b.control.exiting and time.perf_counter() < deadline:
        time.sleep(0.01)
    # What a rank wrote sits in a pipe until the launcher forwards it, and the launcher drops
    # what it has not read when MPI_Abort tears the job down (seen under load: a rank's
    # error, and the aborting ranks' own "Abort(1)" lines, missing from the job's output).
    time.sleep(min(_LINGER_S, b.grace))
    b.MPI.COMM_WORLD.Abort(1)


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


__all__ = ["Backoff", "Distributed"]
