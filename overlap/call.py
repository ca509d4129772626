"""One runtime call as a scope (structured concurrency, as trio's nursery): admit, launch,
watch, finish — and on exit, recover and name one root cause.

- **Admit.** One call at a time per runtime, from whichever thread or event loop
  (:class:`CallGate`: callers queue, in order); a call from inside a stage function (a
  stream thread of the runtime) is refused. Then what an interrupted call left running is
  settled; in a multi-process job the call is announced to its members
  (:mod:`.backends.distributed`: its agreement row goes out; a member known to have left
  fails the call at once), and the communicators it needs across processes are made.
- **Launch.** The call's step graph is enqueued on the streams, every item under the call's
  :class:`~overlap.scope.CancelScope` — a child of the runtime's.
- **Watch.** The call waits for its lanes' end events all at once (woken once, by the last
  of them or by the scope's cancellation), and every tick looks at what each stream runs: a
  compute op past the timeout (user code, which nothing can interrupt) is hung and becomes
  :class:`~overlap.errors.StageTimeout` naming it. A compute op that returns past the
  timeout (it held the interpreter lock, so nothing could look) fails the call the same
  way, from its own stream. Waits bound themselves: a
  collective's rendezvous and a wait on the wire raise past the timeout, naming who never
  came.
- **Finish.** Across processes, the agreement's verdict; and, for a call whose result every
  member returns (a training step's losses), the end-of-call round: such a call returns only
  once every member's part of it ended well. A resharding has no such round: it returns
  once its agreement is settled and this rank's part ended, and a peer's failure after that
  reaches this rank's next call.
- **Exit.** On a failure the scope is cancelled — every wait of the call wakes at once —
  and the streams are settled: each gets through the call's remaining work (skipped), an op
  still running gets until its time bound, and a stream stuck past it is abandoned
  (:class:`~overlap.errors.DeviceThreadLost` from then on). Then :func:`root_cause` picks the
  one failure that explains the others, which is raised (and, across processes, announced).
  An interrupted call (Ctrl-C, a cancelled task) returns within the grace and leaves the
  settling it could not finish to the next call.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from scheduler import Compute, StepGraph

from .backends import SETTLE_GRACE_S, Busy
from .backends.streams import current_stream
from .errors import (
    CallMismatch,
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
    from .backends import Backend, Event, Trace
    from .backends.distributed import CallRounds, Distributed
    from .hang_dump import HangDump

TICK_S = 0.1  # how often a waiting call looks for hung ops (at most; less for small timeouts)


# ---- one call at a time --------------------------------------------------------------------


class CallGate:
    """Admits one call at a time, from whichever thread or event loop, in the order they
    came. Two calls never share the runtime's streams, rendezvous or call counter: a second
    event loop's call waits its turn (it is never mixed with the first)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held = False
        self._queue: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._held:
                self._held = True
                return
            fut: asyncio.Future[None] = loop.create_future()
            entry = (loop, fut)
            self._queue.append(entry)
        try:
            await fut
        except BaseException:
            with self._lock:
                if entry in self._queue:  # not granted: leave the queue
                    self._queue.remove(entry)
                    raise
            if fut.done() and not fut.cancelled():
                self._release()  # granted as this caller left: pass it on
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        with self._lock:
            while self._queue:
                loop, fut = self._queue.popleft()
                try:
                    loop.call_soon_threadsafe(self._grant, fut)
                    return
                except RuntimeError:  # its loop closed: that caller is gone
                    continue
            self._held = False

    def _grant(self, fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            self._release()  # (its caller left meanwhile: the next one)
        else:
            fut.set_result(None)


def refuse_reentry(what: str, backend: Backend) -> None:
    """A runtime call from one of this runtime's stream threads — from inside a stage
    function — would wait for the very streams it runs on: refused, naming where."""
    stream = current_stream()
    if stream is not None and stream.backend is backend:
        raise OverlapRuntimeError(
            f"{what}: called from inside this runtime's work (device {stream.device}'s "
            f"{stream.name!r} stream: a stage function?); a runtime call cannot run inside "
            "another — make it after the call returns")


# ---- hung ops -------------------------------------------------------------------------------


def describe(busy: Busy, graph: StepGraph | None) -> tuple[str, int | None, int | None,
                                                           str | None]:
    """(what the op is, its stage, microbatch, phase) from the step graph when it is known."""
    body = graph.ops[busy.op].body if graph is not None and busy.op is not None else None
    if isinstance(body, Compute):
        phase = {"F": "forward", "B": "backward", "I": "input gradient",
                 "W": "weight gradient"}.get(body.kind, body.kind)
        return (f"stage {body.stage} {phase} of microbatch {body.microbatch} on device "
                f"{busy.device}", body.stage, body.microbatch, body.kind)
    if body is not None:
        return f"{body} on device {busy.device}", None, getattr(body, "microbatch", None), None
    return busy.label, None, None, None


def hang_error(stuck: Sequence[Busy], graph: StepGraph | None, timeout: float, *,
               abandoned: bool = True) -> StageTimeout:
    """The error naming ``stuck`` ops, the longest-running first (the likeliest culprit: the
    others may be waiting inside it, e.g. in a stage collective); ``abandoned``: their threads
    were given up (else: named while they still ran, before the streams settled)."""
    ordered = sorted(stuck, key=lambda b: b.since)
    first = ordered[0]
    what, stage, mb, phase = describe(first, graph)
    now = time.perf_counter()
    seconds = now - first.since
    others = [f"{describe(b, graph)[0]} ({now - b.since:.1f} s)" for b in ordered[1:]]
    text = (f"{what} {'never finished' if abandoned else 'is past the timeout'}: it has run "
            f"{seconds:.1f} s on device {first.device}'s {first.stream!r} stream (timeout "
            f"{timeout:g} s)")
    if others:
        text += "; also still running: " + ", ".join(others)
    if abandoned:
        text += (". Its thread is abandoned and this runtime refuses further work: close it "
                 "and make a fresh Runtime")
    return StageTimeout(text, op=what, device=first.device, stream=first.stream, stage=stage,
                        microbatch=mb, phase=phase, seconds=seconds)


def overran_error(busy: Busy, seconds: float, graph: StepGraph | None,
                  timeout: float) -> StageTimeout:
    """The error naming a compute op that returned, but only after ``seconds`` past the
    ``timeout`` (one that held the interpreter lock, so that nothing could name it while it
    ran). Its thread is not lost: the runtime works on."""
    what, stage, mb, phase = describe(busy, graph)
    return StageTimeout(
        f"{what} ran {seconds:.1f} s on device {busy.device}'s {busy.stream!r} stream, past "
        f"the timeout ({timeout:g} s); it returned, but too late, so the step failed. "
        "Nothing could name it while it ran: it held Python's interpreter lock (a C "
        "extension that does not release it?) — see 'Failure behaviour' in the docs",
        op=what, device=busy.device, stream=busy.stream, stage=stage, microbatch=mb,
        phase=phase, seconds=seconds)


def overdue(backend: Backend, scope: CancelScope) -> list[Busy]:
    """The scope's compute ops that have run longer than the timeout now. (Only compute ops:
    user code nothing else bounds. Waits and transfers bound themselves.)"""
    now = time.perf_counter()
    return [b for b in backend.busy() if b.scope is scope and not b.waiting
            and b.category == "compute" and now >= b.since + backend.timeout]


# ---- the root cause -------------------------------------------------------------------------


def root_cause(exc: BaseException, failures: Sequence[BaseException]) -> BaseException:
    """The failure that explains the others: processes that made different calls (which
    makes work fail everywhere, in whatever order); else the first failure that is not a
    consequence of another (an abort, a timeout waiting for a peer, a peer that failed);
    else a peer's failure; else the first timeout; else ``exc`` itself."""
    every = (exc, *failures)
    for f in every:
        if isinstance(f, CallMismatch):
            return f
    for f in failures:
        if not isinstance(f, (CollectiveAborted, CollectiveTimeout, RankFailed)):
            return f
    for f in every:
        if isinstance(f, RankFailed):
            return f
    return next((f for f in failures if isinstance(f, CollectiveTimeout)), exc)


def _consequence(exc: BaseException) -> bool:
    return isinstance(exc, (CollectiveAborted, CollectiveTimeout, RankFailed))


# ---- the call -------------------------------------------------------------------------------


class Call:
    """One call's scope (see module doc). Made by the runtime inside its gate, run once."""

    def __init__(self, backend: Backend, parent: CancelScope, what: str,
                 graph: StepGraph | None, dist: Distributed | None, *,
                 trace: Trace | None = None, dump: HangDump | None = None) -> None:
        self.backend = backend
        self.what = what
        self.graph = graph
        self.dist = dist
        self.scope = CancelScope(what, parent)
        self.scope.trace = trace
        self.scope.overran = lambda busy, seconds: overran_error(busy, seconds, graph,
                                                                 backend.timeout)
        self.lost: DeviceThreadLost | None = None  # set when a stream had to be abandoned
        self.named: StageTimeout | None = None  # ops the watch found past the timeout
        self.dump = dump  # tracebacks from a C timer if the watch misses a look
        self.unsettled = False  # an interruption left streams busy: the next call settles

    async def run(self, launch: Callable[[CancelScope], list[Event]], *,
                  channels: tuple[dict[str, tuple[int, ...]], list[tuple[str, tuple[int, ...]]]]
                  | None = None, digest: bytes = b"", members: tuple[int, ...] | None = None,
                  payload: Callable[[], bytes] | None = None, subject: str = ""
                  ) -> dict[int, bytes] | None:
        """Admit, launch, watch and finish the call. Raises the root cause of a failure.
        ``digest``: what the call's agreement compares (a hash of ``subject``: its plan, its
        step graph). With ``payload`` (a call whose result every member returns: a training
        step's losses), across processes the call ends with the end-of-call round and
        returns every member's ``payload()`` (this rank's, once its part ended); without,
        it returns once its agreement is settled and this rank's part ended (a peer's
        failure after that reaches this rank's next call). None in one process."""
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
            ends = launch(scope)
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
        if pending:  # launched, not yet done on the device (CUDA)
            tasks = {asyncio.ensure_future(ev.wait()) for ev in pending}
            try:
                while tasks:
                    done, tasks = await asyncio.wait(tasks, timeout=tick,
                                                     return_when=asyncio.FIRST_EXCEPTION)
                    for t in done:
                        if t.exception() is not None:
                            raise t.exception()  # type: ignore[misc]
                    scope.check(self.what)
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
            if _consequence(root) or root is self.named:
                root = hang  # an op here that never finished explains what waited for it
        else:
            backend.forget()
            if _consequence(root) or root is self.named:
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
            if f is not self.named and not _consequence(f):
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
        work in the call (``answers``: :class:`~overlap.backends.distributed.Answers`)."""
        dist = self.dist
        assert dist is not None
        return CollectiveTimeout(
            f"{timeout.op}: rank {dist.rank} waited {self.backend.timeout:g} s (its devices "
            f"{list(timeout.missing)} waited in turn for what other ranks send); "
            f"{answers.text}", op=timeout.op, devices=timeout.devices,
            missing=tuple(d for r in answers.absent for d in dist.placement.devices_of(r)),
            ranks=answers.absent)

    def _abandon(self, stuck: list[Busy]) -> StageTimeout:
        backend = self.backend
        err = hang_error(stuck, self.graph, backend.timeout)
        names = tuple((b.device, b.stream, describe(b, self.graph)[0]) for b in stuck)
        backend.abandon(stuck, f"device {stuck[0].device} stream {stuck[0].stream!r}: its "
                               f"thread is stuck in {names[0][2]}")
        self.lost = DeviceThreadLost(
            "this runtime lost the thread of "
            + "; ".join(f"device {d}'s {s!r} stream (stuck in {op})" for d, s, op in names)
            + f": it ran past the timeout ({backend.timeout:g} s) and was abandoned. Close "
            "this runtime and make a fresh Runtime", stuck=names)
        return err


async def settle_leftovers(backend: Backend) -> list[Busy]:
    """Before a call, after an interrupted one that could not wait for its streams: let them
    get through its work (off the event loop), an op still running until its time bound.
    Returns the streams stuck past it."""
    start = time.perf_counter()
    stuck = await asyncio.to_thread(backend.settle, lambda b: backend.stop_bound(b, start))
    if not stuck:
        backend.forget()
    return stuck


__all__ = ["Call", "CallGate", "describe", "hang_error", "overdue",
           "overran_error", "refuse_reentry", "root_cause", "settle_leftovers"]
