"""One runtime call, end to end, as a scope (structured concurrency, as trio's nursery):
refused or admitted, launched, watched, finished — and on a failure, settled, with one root
cause named. :meth:`Calls.run` is the one entry: the runtime calls it once per call.

- **Refused** from inside one of the runtime's stream threads (a stage function: it would wait
  for the streams it runs on).
- **Admitted** one at a time per runtime, from whichever thread or event loop, in the order
  the callers came (:class:`~overlap.call_gate.CallGate`); once admitted, refused when the
  runtime is closed, lost a stream, or — across processes — failed
  (:meth:`Calls.check_open`). Then what an interrupted call left running is settled (a
  stream stuck past its bound is abandoned, and the call refused).
- **Agreed** across processes: the call is announced to its members
  (:mod:`.backends.job.distributed`: its agreement row goes out; a member known to have left
  fails the call at once), and the communicators it needs across processes are made.
- **Launched.** The call's step graph is enqueued on the streams, every item under the
  call's :class:`~overlap.scope.CancelScope` — a child of the runtime's — and every op with
  the call's :class:`~overlap.backends.devices.streams.OpReport` (its trace, and the error that
  names an op that returned past the timeout: the scope only cancels).
- **Watched.** The call waits for its lanes' end events all at once (woken once, by the last
  of them or by the scope's cancellation), and every tick looks at what each stream runs: a
  compute op past the timeout (user code, which nothing can interrupt) is hung and becomes
  :class:`~overlap.errors.StageTimeout` naming it. A compute op that returns past the
  timeout (it held the interpreter lock, so nothing could look) fails the call the same
  way, from its own stream. Waits bound themselves: a collective's rendezvous and a wait on
  the wire raise past the timeout, naming who never came.
- **Finished.** Across processes, the agreement's verdict; and, for a call whose result
  every member returns (a training step's losses), the end-of-call round: such a call
  returns only once every member's part of it ended well. A resharding has no such round:
  it returns once its agreement is settled and this rank's part ended, and a peer's failure
  after that reaches this rank's next call.
- **Settled** on a failure: the scope is cancelled — every wait of the call wakes at once —
  and the streams are settled: each gets through the call's remaining work (skipped), an op
  still running gets until its time bound, and a stream stuck past it is **abandoned**
  (:class:`~overlap.errors.DeviceThreadLost` from then on). Then
  :func:`~overlap.call_errors.root_cause` picks the one failure that explains the others,
  which is raised (and, across processes, announced). An interrupted call (Ctrl-C, a
  cancelled task) returns within the grace and leaves the settling it could not finish to
  the next call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from scheduler import StepGraph

from .backends import SETTLE_GRACE_S, Busy, OpReport
from .call_errors import (
    consequence,
    describe,
    hang_error,
    overdue,
    overran_error,
    root_cause,
)
from .call_gate import CallGate, refuse_reentry
from .errors import (
    CollectiveAborted,
    CollectiveTimeout,
    DeviceThreadLost,
    OverlapRuntimeError,
    RankFailed,
    StageTimeout,
)
from .scope import CancelScope
from .waits import OneShot, wait_on, when_all

if TYPE_CHECKING:
    from .backends import Backend, CallRounds, Distributed, Event, Trace
    from .hang_dump import HangDump

TICK_S = 0.1  # how often a waiting call looks for hung ops (at most; less for small timeouts)

# ``launch(scope, report) -> end events``: enqueues the call's work (see Call.run).
Launch = Callable[[CancelScope, OpReport], "list[Event]"]
# What a call prepares across processes (``Backend.prepare``'s arguments).
Channels = tuple[dict[str, tuple[int, ...]], list[tuple[str, tuple[int, ...]]]]


# ---- a runtime's calls ----------------------------------------------------------------------


class Calls:
    """A runtime's calls: each one run by :meth:`run` from its gate to its end (see module
    doc), and what one call leaves the next — streams still to settle, a stream lost."""

    def __init__(self, backend: Backend, scope: CancelScope,
                 dump: HangDump | None = None) -> None:
        self.backend = backend
        self.scope = scope  # the runtime's: the parent of every call's
        self.dump = dump  # tracebacks from a C timer if a watch misses a look
        self.closed = False  # (set by the runtime's close)
        self.lost: DeviceThreadLost | None = None  # a stream abandoned: no call runs again
        self._gate = CallGate()
        # An interrupted call left work for the next call to settle: (its graph,), else None.
        self._leftover: tuple[StepGraph | None] | None = None

    def check_open(self) -> None:
        """Raise unless a call may run: the runtime is open, has lost no stream and — across
        processes — has not failed."""
        if self.closed:
            raise OverlapRuntimeError("runtime is closed")
        if self.lost is not None:
            raise self.lost
        dist = self.backend.dist
        broken = dist.broken if dist is not None else None
        if broken is not None:
            if isinstance(broken, RankFailed):
                raise broken
            raise OverlapRuntimeError(f"this process's runtime failed earlier ({broken}); a "
                                      "multi-process job cannot continue after a failure")

    async def run(self, what: str, graph: StepGraph | None, launch: Launch, *,
                  channels: Channels | None = None, subject: str = "", digest: bytes = b"",
                  members: tuple[int, ...] | None = None,
                  payload: Callable[[], bytes] | None = None, trace: Trace | None = None,
                  timeout: float | None = None) -> dict[int, bytes] | None:
        """Run one call (see module doc and :meth:`Call.run`, which has the arguments' words),
        recording its ops into ``trace`` if given, bounded by ``timeout`` instead of the
        runtime's when given (every wait of the backend reads its one ``Bound``). Returns the
        end-of-call table across processes (None in one process)."""
        backend = self.backend
        refuse_reentry(what, backend)
        async with self._gate:
            self.check_open()
            await self._settle_leftover()
            call = Call(backend, self.scope, what, graph, backend.dist, trace=trace,
                        dump=self.dump)
            bound = backend.bound
            usual = bound.seconds
            if timeout is not None:
                bound.seconds = timeout
            try:
                return await call.run(launch, channels=channels, digest=digest,
                                      members=members, payload=payload, subject=subject)
            finally:
                bound.seconds = usual
                self._leftover = (graph,) if call.unsettled else None
                if call.lost is not None:
                    self.lost = call.lost
                # Nothing the streams still hold (an abandoned op's scope) may keep this
                # call's exceptions — and through their tracebacks the runtime — alive.
                call.scope.forget_failures()

    async def _settle_leftover(self) -> None:
        """What an interrupted call left on the streams, settled before this call; a stream
        stuck past its bound is abandoned (named from the interrupted call's graph), and this
        call refused."""
        if self._leftover is None:
            return
        (graph,), self._leftover = self._leftover, None
        stuck = await settle_leftovers(self.backend)
        if stuck:
            _, self.lost = abandon(self.backend, stuck, graph)
            self.check_open()


# ---- one call -------------------------------------------------------------------------------


class Call:
    """One call's scope (see module doc). Made by :meth:`Calls.run` inside its gate, run
    once."""

    def __init__(self, backend: Backend, parent: CancelScope, what: str,
                 graph: StepGraph | None, dist: Distributed | None, *,
                 trace: Trace | None = None, dump: HangDump | None = None) -> None:
        self.backend = backend
        self.what = what
        self.graph = graph
        self.dist = dist
        self.scope = CancelScope(what, parent)
        # What the streams report of the call's ops: their spans, an op past its bound.
        self.report = OpReport(trace, lambda busy, seconds: overran_error(
            busy, seconds, graph, backend.timeout))
        self.lost: DeviceThreadLost | None = None  # set when a stream had to be abandoned
        self.named: StageTimeout | None = None  # ops the watch found past the timeout
        self.dump = dump  # tracebacks from a C timer if the watch misses a look
        self.unsettled = False  # an interruption left streams busy: the next call settles

    async def run(self, launch: Launch, *, channels: Channels | None = None,
                  digest: bytes = b"", members: tuple[int, ...] | None = None,
                  payload: Callable[[], bytes] | None = None, subject: str = ""
                  ) -> dict[int, bytes] | None:
        """Agree, launch, watch and finish the call. Raises the root cause of a failure.
        ``launch(scope, report)`` enqueues the call's work and returns its lanes' end
        events; ``channels``: what it prepares across processes. ``digest``: what the
        call's agreement compares (a hash of ``subject``: its plan, its step graph); among
        ``members`` (default: every rank). With ``payload`` (a call whose result every member
        returns: a training step's losses), across processes the call ends with the
        end-of-call round and returns every member's ``payload()`` (this rank's, once its
        part ended); without, it returns once its agreement is settled and this rank's part
        ended (a peer's failure after that reaches this rank's next call). None in one
        process."""
        backend, scope, dist = self.backend, self.scope, self.dist
        rounds: CallRounds | None = None
        try:
            if dist is not None:
                rounds = dist.begin_call(f"{self.what}: {subject}" if subject else self.what,
                                         digest, members, scope)
            if channels is not None:
                await backend.prepare(*channels)
            if self.dump is not None:  # (an op may freeze the process before the watch runs)
                self.dump.arm(backend.timeout)
            ends = launch(scope, self.report)
            await self._watch(ends)
            backend.release_to_caller(ends)
            if rounds is None:
                return None
            await rounds.agreed()
            if payload is None:
                return None
            return await rounds.finish(payload())
        except BaseException as exc:
            root = await self._fail(exc, rounds)
            if root is exc:
                raise
            raise root from root.__cause__
        finally:
            if self.dump is not None:
                self.dump.disarm()
            scope.close()
            if dist is not None:
                dist.end_call()

    async def _watch(self, ends: Sequence[Event]) -> None:
        """Until every end event is launched — the last one, or the scope's cancellation,
        wakes the loop once — looking for hung ops every tick; then, on a GPU, until the
        device got there (bounded)."""
        scope, backend = self.scope, self.backend
        tick = min(TICK_S, backend.timeout / 4)
        launched = OneShot()
        when_all(ends, launched.finish)
        if not launched.over:
            def look() -> bool:  # (every tick)
                self._name_hang()
                if self.dump is not None:
                    self.dump.arm(tick)
                return True

            if self.dump is not None:
                self.dump.arm(tick)
            try:
                await wait_on(launched, scope, self.what, tick, look)
            except CollectiveAborted:  # (cancelled: the failure is named below)
                if self.named is None:  # (not by a hang a tick named just now)
                    self._name_hang()
            finally:
                if self.dump is not None:  # (not while a failure settles: no look is due)
                    self.dump.disarm()
        # (Not the failures themselves: the root cause, chosen from them on the way out, is
        # the one raised.)
        if scope.cancelled or any(ev.error is not None for ev in ends):
            raise CollectiveAborted(f"{self.what}: its work failed")
        pending = self.backend.join_ends(ends)
        if pending:  # launched, not yet done on the device (CUDA): each bounds its own wait
            tasks = [asyncio.ensure_future(ev.wait()) for ev in pending]
            settled = OneShot()  # (every one done, or the first failed)
            left = [len(tasks)]

            def one(t: asyncio.Future[Any]) -> None:  # (on the loop)
                left[0] -= 1
                if left[0] == 0 or t.cancelled() or t.exception() is not None:
                    settled.finish()

            for t in tasks:
                t.add_done_callback(one)
            try:
                await wait_on(settled, scope, self.what)
                for t in tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
            finally:
                for t in tasks:
                    t.cancel()

    def _name_hang(self) -> StageTimeout | None:
        """Name the scope's ops running past their bound now as its failure (which cancels
        the rest of the call's work at once)."""
        hung = overdue(self.backend, self.scope)
        if not hung:
            return None
        err = hang_error(hung, self.graph, self.backend.timeout, abandoned=False)
        self.named = err
        self.scope.fail(err)
        return err

    async def _fail(self, exc: BaseException, rounds: CallRounds | None) -> BaseException:
        """Cancel, settle, choose the root cause and tell the other processes; returns the
        error to raise."""
        backend, scope, dist = self.backend, self.scope, self.dist
        interrupted = not isinstance(exc, Exception)  # Ctrl-C, a cancelled task, exit
        start = time.perf_counter()
        scope.cancel(exc if not interrupted else CollectiveAborted(f"{self.what} cancelled"))
        if interrupted:
            # Return at once (an interrupted task may be interrupted again at any await):
            # the streams get the grace, on this thread; what is left is the next call's.
            if rounds is not None:
                rounds.abandon()
            stuck = backend.settle(lambda b: min(backend.stop_bound(b, start),
                                                 start + SETTLE_GRACE_S))
            self.unsettled = bool(stuck)
            if not stuck:
                backend.forget()
            if dist is not None:
                dist.failed(f"{self.what} interrupted", exc)
            return exc
        failures = [*scope.failures, *(scope.parent.failures if scope.parent else ())]
        root = root_cause(exc, failures)
        if rounds is not None:
            # A mismatch explains every failure it caused, here or elsewhere: its verdict is
            # awaited (bounded) even though the work failed.
            # (A timeout here, or a peer's report of one: a member idle behind the call
            # was waited for long enough already.)
            mismatch = await rounds.verdict_after_failure(waited=any(
                isinstance(f, (CollectiveTimeout, RankFailed)) for f in (exc, *failures)))
            if mismatch is not None:
                root = mismatch
            rounds.abandon()
            # A timeout that named ranks not at work is explained already (no report will
            # come from them); one among this rank's own devices, or an abort, may be a
            # stage's hang here or a peer's report that is about to arrive.
            if isinstance(root, CollectiveAborted) or (
                    isinstance(root, CollectiveTimeout) and not root.ranks):
                root = await self._peer_explanation(root)
        stuck = await asyncio.to_thread(backend.settle,
                                        lambda b: backend.stop_bound(b, start))
        if stuck:
            hang = self._abandon(stuck)
            if consequence(root) or root is self.named:
                root = hang  # an op here that never finished explains what waited for it
        else:
            backend.forget()
            if consequence(root) or root is self.named:
                root = self._settled_root(root)
        if dist is not None:
            dist.failed(self.what, root)
        return root

    def _settled_root(self, root: BaseException) -> BaseException:
        """Once the streams settled with none stuck, every op here returned and every
        failure they had to report is in: one that is not a consequence explains ``root``
        (a wait that gave up, or the watch naming an op still running then) better — an op
        that returned past its bound (it held the interpreter lock: nothing could look, or
        the watch saw it just before it returned), a stage's error raised meanwhile."""
        scope = self.scope
        for f in (*scope.failures, *(scope.parent.failures if scope.parent else ())):
            if f is not self.named and not consequence(f):
                return f
        return root

    async def _peer_explanation(self, timeout: BaseException) -> BaseException:
        """A timeout waiting for a peer is often the consequence of a stage that hangs, here
        or on that peer — named when it has run ``timeout``, which may be a little after
        this wait gave up: wait briefly (at most 1 s) for the hang here or the peer's
        report. A wait among this process's own devices that gave up (one of them waited
        in turn for what a peer never sent) also asks every member of the call how far it
        got, as a wait for a peer does: one not at work — frozen, stuck in its own code,
        gone — is named, at every job size; this process's own device is never blamed for
        a peer's silence."""
        dist = self.dist
        assert dist is not None
        scope = self.scope
        deadline = time.perf_counter() + min(1.0, self.backend.timeout)
        asking = None
        if isinstance(timeout, CollectiveTimeout) and not timeout.ranks and dist.members:
            asking = asyncio.ensure_future(asyncio.to_thread(dist.ask, dist.members))
        try:
            while True:
                if isinstance(dist.broken, RankFailed):
                    return dist.broken
                failures = [*scope.failures, *(scope.parent.failures if scope.parent else ())]
                better = root_cause(timeout, failures)
                if not isinstance(better, (CollectiveAborted, CollectiveTimeout)):
                    return better  # (a peer's report, a mismatch, a failure here)
                hung = overdue(self.backend, self.scope)
                if hung:  # (named as the watch names one: the settling says if abandoned)
                    self.named = hang_error(hung, self.graph, self.backend.timeout,
                                            abandoned=False)
                    return self.named
                if asking is not None and asking.done():
                    answers, asking = asking.result(), None
                    if not answers.at_work and answers.absent:
                        return self._silent_peers(timeout, answers)  # type: ignore[arg-type]
                if time.perf_counter() >= deadline and asking is None:
                    return timeout
                await asyncio.sleep(0.01)
        finally:
            if asking is not None:
                asking.cancel()

    def _silent_peers(self, timeout: CollectiveTimeout, answers: Any) -> CollectiveTimeout:
        """``timeout``, among this process's devices, explained by the peers that are not at
        work in the call (``answers``: :class:`~overlap.backends.job.distributed.Answers`)."""
        dist = self.dist
        assert dist is not None
        return CollectiveTimeout(
            f"{timeout.op}: rank {dist.rank} waited {self.backend.timeout:g} s (its devices "
            f"{list(timeout.missing)} waited in turn for what other ranks send); "
            f"{answers.text}", op=timeout.op, devices=timeout.devices,
            missing=tuple(d for r in answers.absent for d in dist.placement.devices_of(r)),
            ranks=answers.absent)

    def _abandon(self, stuck: list[Busy]) -> StageTimeout:
        hang, self.lost = abandon(self.backend, stuck, self.graph)
        return hang


def abandon(backend: Backend, stuck: list[Busy], graph: StepGraph | None
            ) -> tuple[StageTimeout, DeviceThreadLost]:
    """Give up the threads of ``stuck`` streams (each runs nothing more); returns the error
    naming their ops (from ``graph``, the call they ran for) and the one the runtime raises
    from then on."""
    err = hang_error(stuck, graph, backend.timeout)
    names = tuple((b.device, b.stream, describe(b, graph)[0]) for b in stuck)
    backend.abandon(stuck, f"device {stuck[0].device} stream {stuck[0].stream!r}: its "
                           f"thread is stuck in {names[0][2]}")
    lost = DeviceThreadLost(
        "this runtime lost the thread of "
        + "; ".join(f"device {d}'s {s!r} stream (stuck in {op})" for d, s, op in names)
        + f": it ran past the timeout ({backend.timeout:g} s) and was abandoned. Close "
        "this runtime and make a fresh Runtime", stuck=names)
    return err, lost


async def settle_leftovers(backend: Backend) -> list[Busy]:
    """Before a call, after an interrupted one that could not wait for its streams: let them
    get through its work (off the event loop), an op still running until its time bound.
    Returns the streams stuck past it."""
    start = time.perf_counter()
    stuck = await asyncio.to_thread(backend.settle, lambda b: backend.stop_bound(b, start))
    if not stuck:
        backend.forget()
    return stuck


__all__ = ["Call", "CallGate", "Calls", "Channels", "Launch", "abandon", "describe",
           "hang_error", "overdue", "overran_error", "refuse_reentry", "root_cause",
           "settle_leftovers"]
