"""Streams and events with CUDA semantics, whatever the device kind.

A **stream** is a FIFO of work run by one thread of its own, in launch order; different
streams run concurrently. Its thread runs only its own queue: an op (host code: a stage
function, a transfer's part), a **record** (an event completes when the stream gets there),
a **wait** (later work waits until another stream's event completes). A wait blocks the
stream's thread on the event (or on the cancellation of the work's scope, whichever comes
first); no other thread ever advances a stream.

Every item carries the :class:`~overlap.scope.CancelScope` of the call it belongs to. A
failing op fails its scope — which cancels it — and the rest of that call's work on every
stream is skipped (records complete with the failure; waits return at once), while work of
later calls runs as usual: a failed call needs no reset.

A device kind (:class:`~.backend.DeviceKind`: :mod:`~overlap.backends.devices.cpu`,
:mod:`~overlap.backends.devices.cuda`) supplies what differs: how an op's host code runs
(CUDA: with its device and CUDA stream current), what a record records (CUDA: a CUDA event
after the work enqueued so far), what a wait adds (CUDA: a device-side wait), and trace
marks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from ...errors import OverlapRuntimeError, StreamError
from ...nvtx import range_end, range_start
from ...polling import POLL_FIRST_S, poll_first
from ...scope import CancelScope
from ...waits import OneShot, block_on, wait_on

log = logging.getLogger("overlap")

_local = threading.local()  # .stream: the stream whose thread this is (None elsewhere)


def current_stream() -> Stream | None:
    """The stream whose thread is calling (None outside the runtime's stream threads)."""
    return getattr(_local, "stream", None)


@dataclass(frozen=True)
class Busy:
    """What a stream's thread is doing now: an op (``op``: its step-graph id, if any) or a
    wait for another stream's event (``waiting``), since ``since`` (perf_counter seconds),
    for the call of ``scope``."""

    device: int
    stream: str
    label: str
    op: int | None
    category: str
    since: float
    waiting: bool = False
    scope: Any = field(default=None, compare=False, repr=False)


class TraceRecord(NamedTuple):
    """One op as the trace saw it run: its step-graph op id, where, and two marks (the
    device kind's: perf_counter seconds on the CPU, CUDA events on a GPU)."""

    op: int
    device: int
    stream: str
    start: Any
    end: Any


class Trace:
    """The ops of one call, as they ran (a call records one when asked: its
    :class:`OpReport`'s ``trace``), and the device kind's clock their marks are read
    against."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.records: list[TraceRecord] = []


@dataclass(frozen=True)
class OpReport:
    """What the call an op belongs to asks the stream that runs it to report (the call makes
    one and launches its ops with it; the scope only cancels): each op's span, into
    ``trace`` when the call records one, and a compute op that returned only past the
    timeout, as the error ``overran(busy, seconds)`` names it, which fails the op's scope."""

    trace: Trace | None = None
    overran: Callable[[Busy, float], BaseException] | None = None


class Event(OneShot):
    """A point in a stream's work. It is **launched** once the stream's thread got there
    (and everything before it ran) — a one-shot finished by that thread, with the failure
    if the work before it failed — and **done** once the device also got there: at once on
    the CPU; on a GPU when the device passes the CUDA event recorded there (``native``)."""

    __slots__ = ("device_wait", "label", "native")

    def __init__(self, label: str = "") -> None:
        super().__init__()
        self.label = label
        self.native: Any = None  # the device's event (CUDA), recorded with the host's
        # ``async (event) -> None``: until the device passed ``native`` (bounded; the CUDA kind)
        self.device_wait: Callable[[Event], Any] | None = None

    def launched(self) -> bool:
        return self._over

    def done(self) -> bool:
        if not self._over:
            return False
        native = self.native
        return native is None or bool(native.done)

    def add_done_callback(self, cb: Callable[[Event], None]) -> None:
        """``cb(event)`` once the event is launched (or failed), on the thread that gets it
        there — or now, if it is."""
        if not self.add_callback(lambda: cb(self)):
            cb(self)

    def block(self, scope: CancelScope, what: str, poll: float = POLL_FIRST_S) -> None:
        """Block this thread until the event is launched; raise if it failed, or if
        ``scope`` is cancelled first (looking again for up to ``poll`` seconds before
        sleeping: :mod:`overlap.polling`)."""
        block_on(self, scope, what, poll=poll)
        if self._error is not None:
            raise self._error

    async def wait(self) -> None:
        """Await the event from asyncio without blocking the loop; raises its error. On a GPU,
        until the device passed it (bounded by the backend's timeout)."""
        await wait_on(self, None, self.label)
        if self._error is not None:
            raise self._error
        if self.device_wait is not None and not self.done():
            await self.device_wait(self)

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self.done() else "pending")
        return f"Event({self.label!r}, {state})"


class DeviceWork(Protocol):
    """Work an op left in flight on its device when its host code returned — as a GPU runs
    a kernel after the host thread that launched it went on. On the CPU: a transfer's
    messages on the wire, which the progress engine completes
    (:mod:`overlap.backends.job.wire`). An op that returns one is *issued*, not done: what
    the stream runs after it waits for it, and an event recorded after it is done once it
    is."""

    @property
    def done(self) -> bool: ...
    @property
    def over(self) -> bool: ...  # done, or failed (its failure failed the call's scope)
    def add_callback(self, cb: Callable[[], None]) -> bool: ...
    def block(self, scope: CancelScope, what: str) -> None: ...
    async def wait(self) -> None: ...


class InFlight:
    """The device work an event was recorded after (its ``native``): done once all of it
    is; waited for on a thread (:meth:`block`) or awaited (:meth:`wait`), either raising
    what failed it."""

    __slots__ = ("works",)

    def __init__(self, works: list[DeviceWork]) -> None:
        self.works = works

    @property
    def done(self) -> bool:
        return all(w.done for w in self.works)

    def block(self, scope: CancelScope, what: str) -> None:
        for w in self.works:
            w.block(scope, what)

    async def wait(self, _: Event | None = None) -> None:
        for w in self.works:
            await w.wait()


_OP, _RECORD, _WAIT = 0, 1, 2
_STOP = None  # the item that ends a stream's thread


class Stream:
    """A FIFO of work run by one thread (see module doc)."""

    def __init__(self, backend: Any, device: int, name: str) -> None:
        self.backend = backend  # the Backend that owns it (its device kind, its events)
        self.kind = backend.devices
        self.device = device
        self.name = name
        # A C-level queue: a Ctrl-C landing in a launch (the caller's thread) cannot lose an
        # item nor the thread's wake-up, as it could between Python-level steps.
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._current: tuple[Any, float] | None = None  # (item, since): what runs now
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # (starting and closing the thread)
        self._closed = False
        # Set when the thread was left stuck in an op (see Backend.abandon): it runs nothing
        # more, and launching on this stream raises this text.
        self.lost: str | None = None
        self.native: Any = None  # the device kind's stream (CUDA: a CuPy stream)
        # Set by an op whose device work is timed apart from the stream's marks (the CUDA
        # loopback: the copy's own events): its trace span is that.
        self.data_span: tuple[Any, Any] | None = None
        self.tracing = False  # the op running now belongs to a call that records a trace
        # Device work the ops before left in flight (CPU: transfers' messages on the wire):
        # what runs next waits for it, a record after it is done once it is.
        self._inflight: list[DeviceWork] = []

    def __repr__(self) -> str:
        return f"Stream(device {self.device}, {self.name!r})"

    # ---- launching (any thread) ----------------------------------------------------------

    def launch(self, label: str, fn: Callable[[], Any], *, scope: CancelScope,
               category: str = "compute", op: int | None = None,
               report: OpReport | None = None) -> None:
        """Run ``fn()`` on this stream after everything launched before it, for ``scope``.

        ``category`` ("compute" or "comm") labels the NVTX range; ``op`` (a step-graph op
        id) puts the op in ``report``'s trace when the call records one."""
        self._put((_OP, label, fn, category, op, report, scope))

    def record(self, label: str = "", *, scope: CancelScope, event: Event | None = None
               ) -> Event:
        """An event that completes when the stream reaches this point. Pass ``event`` to
        record into one made earlier (``Backend.new_event``), that other streams may already
        have been told to wait for."""
        ev = event if event is not None else self.backend.new_event(
            label or f"d{self.device}/{self.name}")
        self._put((_RECORD, ev, scope))
        return ev

    def wait_event(self, event: Event, *, scope: CancelScope) -> None:
        """Later work on this stream waits until ``event`` completes (fails if it failed)."""
        self._put((_WAIT, event, scope))

    def _put(self, item: tuple[Any, ...]) -> None:
        if self.lost is not None:
            raise OverlapRuntimeError(self.lost)
        if self._closed:
            raise OverlapRuntimeError(f"device {self.device} stream {self.name!r} is closed")
        self._queue.put(item)
        if self._thread is None:
            self._start()

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None or self._closed:
                return
            thread = threading.Thread(target=self._run, name=f"overlap-d{self.device}-"
                                      f"{self.name}", daemon=True)
            self._thread = thread
            try:
                thread.start()
            except BaseException:
                # Ctrl-C while start() waited for the thread to run: a thread that did not
                # get going is forgotten, so that the next launch starts one (the queue
                # keeps what was launched).
                if not thread.is_alive():
                    self._thread = None
                raise

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        me = threading.current_thread()
        _local.stream = self
        try:
            self.kind.attach(self)
            broken: BaseException | None = None
        except BaseException as exc:  # (every item then fails, naming it: nothing hangs)
            broken = exc
        while True:
            item = self._next()
            if item is _STOP or self._thread is not me:
                return  # closed, or abandoned while it was stuck: run nothing more
            self._current = (item, time.perf_counter())
            try:
                if broken is not None:
                    self._refuse(item, broken)
                else:
                    self._do(item)
            except BaseException:  # (a bug here must not end the thread silently)
                log.exception("device %d stream %r: an item failed", self.device, self.name)
            finally:
                self._current = None

    def _next(self) -> Any:
        """The next item: looking again briefly before the thread sleeps for one, for as
        long as the device kind's ``poll_s`` (:mod:`overlap.polling`; measured,
        docs/benchmarks.md: on the CPU the next call's work often comes within that time)."""
        q = self._queue
        got: list[Any] = []

        def look() -> bool:
            try:
                got.append(q.get_nowait())
            except queue.Empty:
                return False
            return True

        if look() or poll_first(look, self.kind.poll_s):
            return got[0]
        return q.get()

    def _refuse(self, item: tuple[Any, ...], exc: BaseException) -> None:
        """An item of a stream whose device kind could not set its thread up (``attach``):
        its scope fails, naming that, and a record completes with the failure."""
        scope = item[-1]
        self._fail(scope, exc, "setting up its thread")
        if item[0] == _RECORD:
            item[1].finish(_failure(scope))

    def _do(self, item: tuple[Any, ...]) -> None:
        code, scope = item[0], item[-1]
        if code == _RECORD:
            ev: Event = item[1]
            if scope.cancelled:
                ev.finish(_failure(scope))
                return
            try:
                self.kind.record(self, ev)
            except BaseException as exc:
                self._fail(scope, exc, f"record {ev.label}")
                ev.finish(_failure(scope))
                return
            self._inflight = [w for w in self._inflight if not w.over]
            if self._inflight:  # done once the device work before it is (as on a GPU)
                ev.native = InFlight(list(self._inflight))
                ev.device_wait = ev.native.wait
            ev.finish()
            return
        if scope.cancelled:
            return  # the call failed or was cancelled: the rest of its work is skipped
        if code == _WAIT:
            ev = item[1]
            rng = range_start(f"wait {ev.label} (device {self.device})", "wait")
            try:
                what = f"device {self.device} stream {self.name!r} waiting for {ev.label}"
                ev.block(scope, what, self.kind.poll_s)
                self.kind.waited(self, ev, scope, what)
            except BaseException as exc:
                if not scope.cancelled:
                    self._fail(scope, exc, f"wait {ev.label}")
            finally:
                range_end(rng)
            return
        _, label, fn, category, op, report, _ = item
        trace = report.trace if op is not None and report is not None else None
        rng = range_start(label, category)
        self.data_span = None
        self.tracing = trace is not None
        try:
            if self._inflight:  # (what the op reads or writes may be the wire's yet)
                works, self._inflight = self._inflight, []
                for w in works:
                    w.block(scope, label)
            start = self.kind.mark(self) if trace is not None else None
            issued = self.kind.run(self, fn)
            if _is_work(issued):
                self._inflight.append(issued)
                if trace is not None:  # (its span ends when its device work does)
                    def ended(trace: Trace = trace, op: int = op, start: Any = start) -> None:
                        trace.records.append(TraceRecord(op, self.device, self.name, start,
                                                         self.kind.mark(self)))

                    if not issued.add_callback(ended):
                        ended()  # (over already: a send the socket took at once)
            elif trace is not None:
                # (A compute's own collectives set it too: its span stays the op's.)
                span = self.data_span if category == "comm" else None
                first, last = span or (start, self.kind.mark(self))
                trace.records.append(TraceRecord(op, self.device, self.name, first, last))
        except BaseException as exc:
            self._fail(scope, exc, label)
        else:
            if category == "compute" and report is not None:
                self._check_overran(scope, report)
        finally:
            range_end(rng)

    def _check_overran(self, scope: CancelScope, report: OpReport) -> None:
        """A compute op that returned only after the timeout fails its call, named as the
        hang it was. The call's watch names an op still running past the timeout — but not
        one that held the interpreter lock all along (a C extension that does not release
        it): nothing else could run meanwhile, and when it returns a peer's wait that timed
        out meanwhile could be seen first and blamed. The clock read here is the one the op
        could not stop, so whichever thread runs first, this failure names the op."""
        busy = self.busy()  # (the op that just returned: it is current until _run clears it)
        if busy is None or report.overran is None or self.lost is not None:
            return  # (abandoned: its call named it already)
        seconds = time.perf_counter() - busy.since
        if seconds >= self.backend.timeout:
            scope.fail(report.overran(busy, seconds))

    def _fail(self, scope: CancelScope, exc: BaseException, what: str) -> None:
        if self.lost is not None:
            return  # abandoned: what the stuck op did at last concerns nobody now
        if isinstance(exc, OverlapRuntimeError):
            scope.fail(exc)
            return
        err = StreamError(f"device {self.device} stream {self.name!r}: {what} failed: "
                          f"{type(exc).__name__}: {exc}", device=self.device, stream=self.name,
                          op=what)
        err.__cause__ = exc
        scope.fail(err)

    # ---- looking at it -------------------------------------------------------------------

    def busy(self) -> Busy | None:
        """What the thread is doing (None: nothing, or a record)."""
        current = self._current
        if current is not None:
            item, since = current
            if item[0] == _OP:
                return Busy(self.device, self.name, item[1], item[4], item[3], since,
                            scope=item[-1])
            if item[0] == _WAIT:
                return Busy(self.device, self.name, f"wait for {item[1].label}", None, "wait",
                            since, waiting=True, scope=item[-1])
            return None
        if not self._queue.empty() and self._thread is not None:
            # Queued work a live thread is about to take: draining, not stuck.
            return Busy(self.device, self.name, "queued work", None, "queue",
                        time.perf_counter(), waiting=True)
        return None

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    # ---- lifecycle -----------------------------------------------------------------------

    def abandon(self, reason: str) -> None:
        """Leave the thread stuck in its op: it is a daemon (it cannot keep the process
        alive), it runs nothing more when the op returns, and this stream refuses work. What
        was queued behind the op is dropped now (its records fail, naming ``reason``): the
        stuck thread keeps nothing of later work alive — nor, through it, its callers."""
        self.lost = reason
        self._closed = True
        with self._lock:
            self._thread = None
        dropped = []
        while True:
            try:
                dropped.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for item in dropped:
            if item is not _STOP and item[0] == _RECORD:
                item[1].finish(OverlapRuntimeError(reason))
        self._queue.put(_STOP)

    def close(self) -> threading.Thread | None:
        """Stop the thread once its queue is done (work of a cancelled scope is skipped);
        returns it, for the caller to join."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._queue.put(_STOP)
        return thread


def _is_work(value: Any) -> bool:
    """Whether an op returned device work in flight (``block`` and ``done``: see
    :class:`DeviceWork`), not a plain value."""
    return value is not None and hasattr(value, "block") and hasattr(value, "add_callback")


def _failure(scope: CancelScope) -> BaseException:
    """What an event of a cancelled scope completes with: its failure, as the waiters of a
    failed stream see it."""
    error = scope.error
    if isinstance(error, OverlapRuntimeError):
        return error
    return scope.aborted("the call's work")


__all__ = ["Busy", "Event", "OpReport", "Stream", "Trace", "TraceRecord", "current_stream"]
