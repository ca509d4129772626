"""The CPU backend: virtual devices in one process that behave like CUDA streams + NCCL.

- A **stream** is a worker thread draining a FIFO of operations: work launched on one stream
  runs in launch order; different streams run concurrently. A **stepped** op (one whose
  steps never block: an MPI transfer's post, then tests) may be run by other threads where
  the backend allows it — the one that completes the event it waits for, the one that waits
  for the event after it (``CpuStream.launch``) — still in its stream's order.
- An **event** is recorded on a stream and completes when the stream reaches it; another
  stream may wait for it (``wait_event``), and asyncio code may await it — the host never
  blocks to find out.
- **Collectives** (broadcast, all-gather, all-reduce) rendezvous their participants on a
  communicator (one per device group) by launch position, as NCCL does: an operation completes
  only when every participant has launched it, so an inconsistent launch order really
  deadlocks — and the watchdog turns that into :class:`CollectiveTimeout` naming the devices
  that never arrived. Participants that launch *different* collectives at the same position
  get :class:`CollectiveMismatch` (NCCL would hang or corrupt data).
- Bytes really move: a broadcast copies the root's buffer into every receiver's buffer.
- Optional **link emulation**: a collective takes at least the time the cost model gives for
  it on a chosen cluster, so a 10 Gbps cluster can be played on one machine.

A failing operation fails its stream: later work on it is skipped and every event recorded
after it completes with the error; :meth:`CpuBackend.abort` wakes everything that waits, and
:meth:`CpuBackend.reset` makes the backend usable again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from scheduler.errors import check_seconds

from ..errors import (
    CollectiveAborted,
    CollectiveMismatch,
    CollectiveTimeout,
    OverlapRuntimeError,
    StreamError,
)
from ..loop_calls import call_soon_any_thread
from ..nvtx import range_end, range_start
from ..world import Placement

log = logging.getLogger("overlap")

# How often a blocked thread looks at the abort flag; a wait ends within this after abort().
_POLL_S = 0.02
# After abort(): how long a stream may take to notice it (a wait or a collective wakes within
# _POLL_S; an MPI transfer within its backoff). A stream still in a wait after this is stuck.
STOP_GRACE_S = 0.25


@dataclass(frozen=True)
class Busy:
    """What a stream's thread is doing now: an op (``op``: its step-graph id, if any) or a
    wait for another stream's event (``waiting``), since ``since`` (perf_counter seconds)."""

    device: int
    stream: str
    label: str
    op: int | None
    category: str
    since: float
    waiting: bool = False


class TraceRecord(NamedTuple):
    """One op as the trace saw it run: its step-graph op id, where, and two marks (the
    backend's: perf_counter seconds on the CPU, CUDA events on a GPU; see ``span_seconds``)."""

    op: int
    device: int
    stream: str
    start: Any
    end: Any


class _Flag:
    """``threading.Event``'s ``is_set``/``set``/``wait``, made for an event that is mostly
    looked at and seldom waited for: its condition is made by the first thread that blocks
    on it, not with every event (a call makes several events: a ``threading.Event`` costs a
    lock and a condition each, ~2 µs, and its ``set`` takes the condition's lock)."""

    __slots__ = ("_cond", "_set")

    def __init__(self) -> None:
        self._set = False
        self._cond: threading.Condition | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True  # (before _cond is read: a waiter that made it looks after this)
        cond = self._cond
        if cond is not None:
            with cond:
                cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        cond = self._cond
        if cond is None:
            with _FLAG_COND_LOCK:
                if self._cond is None:
                    self._cond = threading.Condition(threading.Lock())
                cond = self._cond
        with cond:
            if not self._set:  # (a set() that read no condition set the flag first)
                cond.wait(timeout)
            return self._set


_FLAG_COND_LOCK = threading.Lock()


class CpuEvent:
    """A point in a stream's work; completes (or fails) when the stream gets there."""

    __slots__ = ("_callbacks", "_done", "_error", "_lock", "_stream", "label")

    def __init__(self, label: str = "") -> None:
        self.label = label
        self._stream: CpuStream | None = None  # the stream it is recorded on (helpers use it)
        self._done = _Flag()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[CpuEvent], None]] = []

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _complete(self, error: BaseException | None = None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb(self)
            except Exception:  # (one waiter's bug must not leave the others unwoken)
                log.exception("a callback of event %r failed", self.label)

    def add_done_callback(self, cb: Callable[[CpuEvent], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(cb)
                return
        cb(self)

    async def wait(self) -> None:
        """Await completion from asyncio without blocking the loop; raises the stream's error."""
        if not self.done():
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()

            def wake(_: CpuEvent) -> None:
                # A closed loop means nobody awaits this any more.
                with contextlib.suppress(RuntimeError):
                    call_soon_any_thread(loop, lambda: fut.done() or fut.set_result(None))

            self.add_done_callback(wake)
            await fut
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self.done() else "pending")
        return f"CpuEvent({self.label!r}, {state})"


# A stepped op (see ``CpuStream.launch``): each step returns — yields — the perf_counter time
# worth stepping it again; it ends when the iterator does.
Steps = Iterator[float]

_stepping = threading.local()  # .wake: see step_waker


@contextlib.contextmanager
def waking(wake: Callable[[], None]) -> Iterator[None]:
    """What :func:`step_waker` returns on this thread meanwhile (whoever takes a step)."""
    outer = getattr(_stepping, "wake", None)
    _stepping.wake = wake
    try:
        yield
    finally:
        _stepping.wake = outer


def step_waker() -> Callable[[], None] | None:
    """Inside a step of a stepped op: a function, callable from any thread, that has the op
    stepped again at once (whatever time its step yielded) — for a step that waits on
    something which signals its completion (a socket's message): it yields a late time and
    arranges this call instead of being polled. None outside a step."""
    return getattr(_stepping, "wake", None)


class _Parked:
    """A stepped op under way at the head of its stream."""

    __slots__ = ("label", "op", "pokes", "rng", "steps", "t0", "trace", "until")

    def __init__(self, label: str, steps: Steps, op: int | None, rng: Any,
                 trace: list[TraceRecord] | None, t0: Any) -> None:
        self.label, self.steps, self.op = label, steps, op
        # The trace it was started under (None: none recorded then), as a plain op keeps it.
        self.rng, self.trace, self.t0 = rng, trace, t0
        self.until = 0.0  # no step before this perf_counter time (what the last one yielded)
        self.pokes = 0  # step_waker calls (one during a step makes the next one due at once)


_PLAIN = object()  # _advance stopped at a plain op: only the stream's own thread runs it


def _reraise_interrupt(exc: BaseException) -> None:
    """An op's failure is its stream's (recorded); but a Ctrl-C that landed in a step the
    launcher took on the main thread (``CpuStream._put``) is the caller's too."""
    if not isinstance(exc, Exception) and threading.current_thread() is threading.main_thread():
        raise exc


def _close(steps: Steps) -> None:
    """End a stepped op early (a generator's ``finally`` and ``except`` run: its requests are
    cancelled)."""
    close = getattr(steps, "close", None)
    if close is not None:
        close()


class CpuStream:
    """A FIFO of operations run by one worker thread (started on first use)."""

    # How long a helper waits when the stream's own thread holds it for a step.
    _HELP_RETRY_S = 20e-6

    def __init__(self, backend: CpuBackend, device: int, name: str) -> None:
        self.backend = backend
        self.device = device
        self.name = name
        self._queue: deque[tuple[str, Any]] = deque()
        # A C-level lock as the context manager, the condition built on it: Ctrl-C can land
        # inside Condition.__enter__ (Python code) after it acquired, leaking the lock
        # (bpo-29988) and freezing this stream; ``with`` on a Lock cannot leak it.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._closing = False
        self._current: tuple[str, Any, float] | None = None  # (kind, payload, since) running
        self._idle = False  # the thread waits for work (untimed: only _put wakes it)
        self._paused_on: Any = None  # the head (parked op, wait's event) it pauses on
        self._hooked: CpuEvent | None = None  # a wait's event hooked early (see _hook_next)
        self._drive = threading.Lock()  # held by whoever advances the stream (see _advance)
        self._parked: _Parked | None = None  # the stepped op at the head, under way
        self._helpers = 0  # threads stepping it while they wait for what follows (help)
        self._waiters: list[CpuStream] = []  # the streams of those threads (to wake them)
        self._wait_rng: Any = None  # the NVTX range of the pending wait at the head
        # Set when the thread was left stuck in an op (see CpuBackend.abandon): it runs
        # nothing more, and launching on this stream raises this text.
        self.lost: str | None = None
        # Set by an op whose device work is timed apart from the stream's marks (the CUDA
        # loopback: the copy's start and end events): its trace span is that.
        self.data_span: tuple[Any, Any] | None = None

    # ---- launching (any thread) ----------------------------------------------------------

    def launch(self, label: str, fn: Callable[[], Any], *, category: str = "compute",
               op: int | None = None, stepped: bool = False) -> None:
        """Run ``fn()`` on this stream after everything launched before it.

        ``category`` ("compute" or "comm") labels the NVTX range; ``op`` (a step-graph op
        id) puts the op in the backend's trace when one is recorded.

        ``stepped``: ``fn()`` returns an iterator of steps (:data:`Steps`). Each step does a
        bounded piece of host work and never blocks: where it must wait for something
        outside (a message) it yields the ``perf_counter`` time worth trying again. Then the
        op need not run on the stream's own thread: on a backend that allows it
        (``CpuBackend.helping``) the thread that completes the event this stream waits for
        starts it (a send is posted by the producer, no hand-off), and a thread that waits
        for an event recorded after it steps it (a receive is completed by its consumer).
        """
        self._put(("op", (label, fn, category, op, stepped)))

    def record(self, label: str = "", *, event: CpuEvent | None = None) -> CpuEvent:
        """An event that completes when the stream reaches this point.

        Pass ``event`` to record into one created earlier (so other streams could already be
        told to wait for it, as a step graph launched lane by lane needs).
        """
        ev = event if event is not None else CpuEvent(label or f"d{self.device}/{self.name}")
        ev._stream = self
        self._put(("record", ev))
        return ev

    def wait_event(self, event: CpuEvent) -> None:
        """Later work on this stream waits until ``event`` completes (fails if it failed)."""
        self._put(("wait", event))

    def _put(self, item: tuple[str, Any]) -> None:
        with self._lock:
            if self.lost is not None:
                raise OverlapRuntimeError(self.lost)
            if self._closing:
                raise OverlapRuntimeError(f"device {self.device} stream {self.name!r} is closed")
            stale = self._pause_is_stale()
            # On a stream with nothing under way, what a helper may run (a record, a wait, a
            # stepped op's steps: see ``launch``) is run by the launching thread itself
            # where helpers are allowed: a send is posted, a receive posted before its
            # sender sends, an event recorded — with no thread woken, and no other thread
            # taking the interpreter's lock meanwhile.
            helpable = self.backend.helping and (item[0] != "op" or item[1][4])
            here = (helpable and self._idle and not self._queue and self._parked is None
                    and self._current is None and threading.current_thread() is not self._thread)
            # Nor is the idle thread woken for such an item behind an op that waits on its
            # waker: whoever completes that op runs what follows (``_kick``).
            behind = (helpable and self._idle and self._parked is not None
                      and self._parked.until - time.perf_counter() > _POLL_S)
            self._queue.append(item)
            if self._thread is None:
                thread = threading.Thread(
                    target=self._run, name=f"overlap-d{self.device}-{self.name}", daemon=True
                )
                self._thread = thread
                try:
                    thread.start()
                except BaseException:
                    # Ctrl-C while starting it (start() waits, in Python, for the thread to
                    # run): one that did not get going is forgotten, so the stream counts as
                    # idle (reset() drops its queue) and the next launch starts a thread —
                    # else the stream looked stuck in queued work for good. (One that did
                    # start and finds it is not the stream's thread exits at once.)
                    if not thread.is_alive():
                        self._thread = None
                    raise
            if (self._idle or stale) and not here and not behind:
                # Only a thread idle for want of work needs waking: one busy, or stopped by
                # the head (a wait, a parked op), finds the tail when it gets there — a
                # launch of a whole step would otherwise wake it once per item. (Not "the
                # queue was empty": a helper may have taken the head while this thread
                # went idle, and its untimed wait would then miss aborts.) Nor one paused
                # on a head a helper has since finished: it would sleep out its pause.
                self._cv.notify()
        if here:
            # As a helper would: the thread is woken only for what is left to it (a plain
            # op, a parked op due soon). A Ctrl-C landing in a step is raised here (_step).
            self._kick()

    # ---- the worker ----------------------------------------------------------------------
    #
    # Whoever holds ``_drive`` advances the stream from its head (``_advance``): the stream's
    # own thread, or — on a backend that allows it, and only through records, finished waits
    # and stepped ops — a helper thread (see ``launch``). Waits never block inside
    # ``_advance``: a wait whose event is pending stops it, and the event's completion kicks
    # the stream (``_kick``).

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                while not self._queue and self._parked is None and not self._closing:
                    self._idle = True  # (what _put looks at to wake it)
                    try:
                        self._cv.wait()
                    finally:
                        self._idle = False
                if (not self._queue and self._parked is None) or self._thread is not me:
                    return  # closed, or abandoned while it was stuck: run nothing more
            with self._drive:
                if self._thread is not me:
                    return
                blocked = self._advance(own=True)
            self._pause(blocked)

    def _advance(self, own: bool, upto: CpuEvent | None = None, kicked: bool = False) -> Any:
        """Run what can run now from the head: records, waits whose event completed, stepped
        ops' steps and (``own``: on the stream's thread) plain ops. Returns what stops it:
        None (nothing queued), the parked stepped op, the event a pending wait waits for, or
        ``_PLAIN`` (a plain op, which only the stream's thread runs). A helper waiting for
        ``upto`` begins no op once it recorded that (returns ``_PLAIN``): the waiter's own
        work comes first; the rest is the stream thread's business. ``kicked``: work behind
        a parked op just became ready — worth a step of it at once, whenever it said."""
        begin = True
        looked = False  # looked once more at a parked op because what follows was ready
        while True:
            parked = self._parked
            if parked is not None:
                # A thread that waits for what follows steps it (see ``help``): the stream's
                # own thread leaves it to that one, so that the waiter sees it land.
                if (own and self._helpers) or not self._step(parked, kicked):
                    # (Hooked by whoever leaves it parked, the kicked too: a step that waits
                    # on a step_waker may never be looked at by its own thread.)
                    if self._hook_next() and not looked:
                        # What follows it is ready already (its event completed during this
                        # step, or its kick found the stream held): look once more now.
                        kicked = looked = True
                        continue
                    return parked
                kicked = looked = False
                continue
            with self._lock:
                if not self._queue or self.lost is not None:
                    return None
                kind, payload = self._queue[0]
                if kind == "op" and not own and (not payload[4] or begin is False):
                    return _PLAIN
                pending = kind == "wait" and self._failed is None and not payload._done.is_set()
                if not pending:
                    self._queue.popleft()
                    if kind != "wait" or self._current is None:
                        # What runs, since when — a tuple (cheap: every op pays it); busy()
                        # makes the Busy value when someone asks.
                        self._current = (kind, payload, time.perf_counter())
                else:
                    begins = self._current is None
                    if begins:  # a wait begins: since now
                        self._current = (kind, payload, time.perf_counter())
            if pending:
                if begins:
                    self._wait_rng = self._wait_range(payload)
                    if payload is not self._hooked:  # (hooked already behind a parked op)
                        payload.add_done_callback(self._kick)  # (may run at once: no lock held)
                if self.backend.abort_reason is None or payload._done.is_set():
                    return payload
                with self._lock:
                    self._queue.popleft()  # aborted: the wait fails the stream
            try:
                self._run_item(kind, payload)
            finally:
                if self._parked is None:
                    self._current = None  # (one store: busy() sees the item or nothing)
            if payload is upto:
                begin = False  # (records and finished waits after it still run: they are cheap)

    def _run_item(self, kind: str, payload: Any) -> None:
        if kind == "record":
            self._on_record(payload)
            return
        rng = None
        if kind == "wait":
            rng, self._wait_rng = self._wait_rng, None
        if self._failed is not None:
            range_end(rng)
            return  # a failed stream skips work until reset()
        try:
            if kind == "wait":
                if rng is None:
                    rng = self._wait_range(payload)
                try:
                    if not payload._done.is_set():  # (only when aborted: see _advance)
                        self.backend._check_abort(f"device {self.device} stream {self.name!r} "
                                                  f"waiting for {payload.label}")
                    self._wait_for(payload)
                finally:
                    range_end(rng)
                return
            label, fn, category, op, stepped = payload
            if stepped:
                self._start(label, fn, category, op)
                return
            rng, trace, t0 = self._open(label, category, op)
            self.data_span = None
            try:
                self._execute(fn)
            finally:
                range_end(rng)
            if trace is not None:
                # (A compute's own collectives set it too: its span stays the op's.)
                span = self.data_span if category == "comm" else None
                start, end = span or (t0, self._mark())
                trace.append(TraceRecord(op, self.device, self.name, start, end))
        except BaseException as exc:
            self._fail(exc, payload[0] if kind == "op" else f"wait {payload.label}")
            _reraise_interrupt(exc)

    def _open(self, label: str, category: str, op: int | None
              ) -> tuple[Any, list[TraceRecord] | None, Any]:
        """An op begins: its NVTX range, the trace it goes to (None: none recorded, or no op
        id) and its start mark there."""
        rng = range_start(label, category)
        trace = self.backend.trace if op is not None else None
        return rng, trace, self._mark() if trace is not None else None

    def _wait_range(self, event: CpuEvent) -> Any:
        return range_start(f"wait {event.label} (device {self.device})", "wait")

    def _fail(self, exc: BaseException, op: str) -> None:
        if self.lost is not None:
            return  # abandoned: what the stuck op did at last concerns nobody now
        if isinstance(exc, OverlapRuntimeError):
            self._failed = exc
        else:
            err = StreamError(
                f"device {self.device} stream {self.name!r}: {op} failed: "
                f"{type(exc).__name__}: {exc}",
                device=self.device, stream=self.name, op=op,
            )
            err.__cause__ = exc
            self._failed = err
        self.backend.note_failure(self._failed)

    # ---- stepped ops ---------------------------------------------------------------------

    def _start(self, label: str, fn: Callable[[], Steps], category: str,
               op: int | None) -> None:
        """Begin a stepped op: it stays parked at the head until its steps are done. (Host
        code only: no ``_execute`` context, so it may run on any thread.)"""
        rng, trace, t0 = self._open(label, category, op)
        try:
            steps = iter(fn())
        except BaseException:
            range_end(rng)
            raise
        self._parked = _Parked(label, steps, op, rng, trace, t0)

    def _step(self, p: _Parked, now: bool = False) -> bool:
        """Take a step of the parked op if it is worth trying now (``now``: whatever it said);
        True once it is over."""
        if not now and time.perf_counter() < p.until and self.backend.abort_reason is None:
            return False
        try:
            pokes = p.pokes
            # (What ``waking`` does, spelled out: every step of every op pays for it.)
            outer = getattr(_stepping, "wake", None)
            _stepping.wake = self._poke
            try:
                until = next(p.steps)
            finally:
                _stepping.wake = outer
            with self._lock:  # (_poke writes both under it)
                # Poked while it stepped: what it waits for may have come after it looked.
                p.until = until if p.pokes == pokes else 0.0
            # Its steps should see an abort themselves (naming what they waited for); one
            # that does not is ended here, so that no wait outlives abort().
            reason = self.backend.abort_reason
            if reason is None:
                return False
            _close(p.steps)
            raise CollectiveAborted(f"{p.label} on device {self.device}: aborted ({reason})")
        except StopIteration:
            self._parked = None
            range_end(p.rng)
            if p.trace is not None:
                p.trace.append(TraceRecord(p.op, self.device, self.name, p.t0, self._mark()))
        except BaseException as exc:
            self._parked = None
            range_end(p.rng)
            self._fail(exc, p.label)
            self._current = None
            _reraise_interrupt(exc)
        self._current = None
        return True

    def _pause(self, blocked: Any) -> None:
        """The stream's thread, stopped by ``blocked`` (see ``_advance``), waits."""
        if isinstance(blocked, _Parked):
            with self._lock:
                # While a waiter steps it (``help``; its steps see aborts too), this thread
                # only waits for that one to leave.
                left = _POLL_S if self._helpers else blocked.until - time.perf_counter()
                if left > 0 and self._parked is blocked:
                    self._pause_on(blocked, min(left, _POLL_S))
        elif isinstance(blocked, CpuEvent):
            src = blocked._stream
            if self.backend.helping and src is not None and src is not self:
                src.help(blocked, self)
            with self._lock:
                if not blocked._done.is_set() and self._queue and self._queue[0][1] is blocked:
                    self._pause_on(blocked, _POLL_S)  # (kicked when it completes; aborts too)

    def _pause_on(self, head: Any, seconds: float) -> None:
        """(Under ``_lock``.) Wait up to ``seconds`` on ``head``, saying so (``_put`` wakes
        the thread once a helper has moved past it)."""
        self._paused_on = head
        try:
            self._cv.wait(seconds)
        finally:
            self._paused_on = None

    def _pause_is_stale(self) -> bool:
        """(Under ``_lock``.) The thread waits for a head that a helper has since moved
        past: new work behind it must wake it (it would sleep out its pause otherwise)."""
        on = self._paused_on
        if on is None:
            return False
        if isinstance(on, _Parked):
            return on is not self._parked
        return not self._queue or self._queue[0][1] is not on

    def _hook_next(self) -> bool:
        """Behind a parked op, the next wait's event kicks this stream too (once): its
        completion means work is ready behind the op — the kick steps the op at once and, if
        it is over, begins that work on the completing thread (a producer posts its send even
        while the send before it is still under way). True: that event completed already
        (while the op took its step), so the op is worth a step now."""
        if not self.backend.helping:
            return False
        with self._lock:
            ev = None
            for kind, payload in self._queue:
                if kind != "record":
                    if kind == "wait":
                        if payload._done.is_set():
                            return True
                        ev = payload
                    break
            if ev is None or ev is self._hooked:
                return False
            self._hooked = ev
        ev.add_done_callback(self._kick)  # (runs at once if it completed meanwhile)
        return False

    def _kick(self, _: CpuEvent | None = None) -> None:
        """An event this stream waits for completed (or its launcher queued helper work on
        it while it was idle: ``_put``): advance the stream right here, on this thread,
        where the backend allows helpers; else wake its thread."""
        if (self.backend.helping and threading.current_thread() is not self._thread
                and self._drive.acquire(blocking=False)):
            try:
                blocked = self._advance(own=False, kicked=True)
            finally:
                self._drive.release()
            if blocked is None or isinstance(blocked, CpuEvent):
                return  # nothing for its thread now (a new wait kicks it in turn)
            self._wake_if_needed()
            return
        with self._lock:
            # (Whoever holds the stream sees the event done when it next looks behind its
            # parked op: _hook_next.) Threads stepping it for what follows wait on their
            # own stream's condition: woken too.
            self._cv.notify()
            waiters = list(self._waiters)
        for w in waiters:
            with w._lock:
                w._cv.notify()

    def _poke(self) -> None:
        """The parked op's step_waker: due at once, stepped here (a helper) or by whoever
        waits for it, woken."""
        with self._lock:
            p = self._parked
            if p is None:
                return  # (a late completion of an op over already)
            p.pokes += 1
            p.until = 0.0
        self._kick()

    def _wake_if_needed(self) -> None:
        """After a helper advanced this stream: wake its thread where work is left — a parked
        op to step (MPI's rendezvous needs both sides to progress: a receive polled only when
        its consumer comes would hold its sender up), an op to begin (a plain op only it may
        run; a stepped one, so that a receive is posted before its sender sends). Not for a
        parked op that asked to be stepped only much later (it waits on a step_waker): its
        completion steps it, and an idle thread is woken by ``abort`` and by ``busy`` once
        that time has come."""
        with self._lock:
            p = self._parked
            if p is None:
                if self._queue:
                    self._cv.notify()
            elif p.until - time.perf_counter() <= _POLL_S:
                self._cv.notify()

    def help(self, event: CpuEvent, waiter: CpuStream) -> None:
        """Called by ``waiter``'s thread, which waits for ``event``, recorded on this stream:
        step this stream's parked op meanwhile (and run what follows it, up to the event) —
        the waiter sees the message land itself, one thread hand-off fewer. Returns when the
        event completed, or when the stream needs its own thread (a plain op, a wait)."""
        if self._parked is None:
            return  # nothing to step (its thread runs a plain op, or waits itself)
        with self._lock:
            self._helpers += 1
            self._waiters.append(waiter)
        try:
            while not event._done.is_set() and self.backend.abort_reason is None:
                if self._parked is None:
                    return
                if not self._drive.acquire(blocking=False):
                    time.sleep(self._HELP_RETRY_S)  # its thread is taking a step
                    continue
                try:
                    blocked = self._advance(own=False, upto=event)
                finally:
                    self._drive.release()
                if not isinstance(blocked, _Parked):
                    return
                left = blocked.until - time.perf_counter()
                if left > 0:
                    with waiter._lock:  # (woken early if this stream's thread completes it)
                        if not event._done.is_set():
                            waiter._cv.wait(min(left, _POLL_S))
        finally:
            with self._lock:
                self._helpers -= 1
                self._waiters.remove(waiter)
            self._wake_if_needed()  # its thread takes over where it has work

    def busy(self) -> Busy | None:
        """What the thread is doing (None: idle, nothing queued)."""
        with self._lock:
            p = self._parked
            if p is not None and self._idle and p.until <= time.perf_counter():
                # Begun by its launcher and left to its waker (``_put``): its own
                # time to look again (a timeout to name) has come; the idle thread looks.
                self._cv.notify()
            current = self._current
            if current is not None and current[0] != "record":
                kind, payload, since = current
                if kind == "op":
                    label, _, category, op, _ = payload
                    return Busy(self.device, self.name, label, op, category, since)
                return Busy(self.device, self.name, f"wait for {payload.label}", None, "wait",
                            since, waiting=True)
            if self._queue and self._thread is not None:
                # Queued work a live thread is about to take: draining, not stuck. Kick it
                # too: a Ctrl-C landing inside the launcher's notify() (Python code) can lose
                # the wakeup, and the thread would sleep on beside its queue for good.
                self._cv.notify()
                return Busy(self.device, self.name, "queued work", None, "queue",
                            time.perf_counter(), waiting=True)
            return None

    # ---- hooks a device backend overrides (the CUDA backend does) -------------------------

    def _mark(self) -> Any:
        """A timestamp for the trace (CUDA: an event recorded on the stream)."""
        return time.perf_counter()

    def _execute(self, fn: Callable[[], Any]) -> None:
        """Run one op's host code (CUDA: with this stream current, so its kernels land here)."""
        fn()

    def _on_record(self, event: CpuEvent) -> None:
        """The stream reached a record point (CUDA: enqueue a device event there)."""
        event._complete(self._failed)

    def _wait_for(self, event: CpuEvent) -> None:
        while not event._done.wait(_POLL_S):
            self.backend._check_abort(f"device {self.device} stream {self.name!r} waiting for "
                                      f"{event.label}")
        if event.error is not None:
            raise event.error

    # ---- lifecycle -----------------------------------------------------------------------

    def _reset(self) -> None:
        """Drop queued work and clear the failure (the thread stays, idle: reset() runs only
        once every stream stopped)."""
        with self._lock:
            pending = list(self._queue)
            self._queue.clear()
            self._failed = None
            self._current = None
        self._drop_parked()  # (its steps failed on the abort: normally none is left)
        for kind, payload in pending:
            if kind == "record":
                payload._complete(CollectiveAborted("work dropped by reset()"))

    def _drop_parked(self) -> None:
        """End the stepped op under way, if any, and the pending wait's range: its generator
        closed (its requests cancelled), its NVTX ranges ended."""
        with self._lock:
            parked, self._parked = self._parked, None
            rng, self._wait_rng = self._wait_rng, None
        range_end(rng)
        if parked is not None:
            range_end(parked.rng)
            with contextlib.suppress(BaseException):
                _close(parked.steps)

    def _abandon(self, reason: str) -> None:
        """Leave the thread stuck in its op: it is a daemon (it cannot keep the process
        alive), it runs nothing more when the op returns, and this stream refuses work."""
        with self._lock:
            self.lost = reason
            self._closing = True
            pending = list(self._queue)
            self._queue.clear()
            self._thread = None
        self._drop_parked()
        for kind, payload in pending:
            if kind == "record":
                payload._complete(CollectiveAborted(reason))

    def _close(self) -> threading.Thread | None:
        with self._lock:
            self._closing = True
            self._cv.notify_all()
            return self._thread


class _Rendezvous:
    """One collective position on a communicator: waits for every participant."""

    def __init__(self, devices: tuple[int, ...]) -> None:
        self.devices = devices
        self.arrived: dict[int, tuple[str, Any]] = {}
        self.done = False
        self.error: BaseException | None = None
        self.start = 0.0
        self.deadline_after = 0.0  # seconds the emulated link keeps every participant busy
        self.result: Any = None


class Communicator:
    """Collectives among a fixed group of devices, matched by launch position."""

    def __init__(self, backend: CpuBackend, devices: tuple[int, ...]) -> None:
        self.backend = backend
        self.devices = devices
        self._lock = threading.Condition()
        self._next: dict[int, int] = dict.fromkeys(devices, 0)
        self._slots: dict[int, _Rendezvous] = {}
        # The launch position whose ``combine`` is running (read by combines that need it:
        # the same op has the same position on every process, so it can name the op there).
        self.position = -1

    def run(self, device: int, desc: str, contribution: Any,
            combine: Callable[[dict[int, Any]], Any]) -> Any:
        """Join the device's next collective; the last to arrive runs ``combine``.

        ``combine`` gets every participant's contribution, moves the data, and returns the
        seconds the emulated link should take (0 without emulation), or a pair (seconds,
        result) whose result every participant gets back (the CUDA backend's done event).
        """
        backend = self.backend
        with self._lock:
            seq = self._next[device]
            self._next[device] = seq + 1
            rv = self._slots.get(seq)
            if rv is None:
                rv = self._slots[seq] = _Rendezvous(self.devices)
            rv.arrived[device] = (desc, contribution)
            if len(rv.arrived) == len(self.devices):
                rv.start = time.perf_counter()  # the wire time counts from the last arrival
                descs = {d: a[0] for d, a in rv.arrived.items()}
                if len(set(descs.values())) > 1:
                    rv.error = CollectiveMismatch(
                        "collective launch order differs between devices "
                        f"{list(self.devices)} at position {seq}: "
                        + "; ".join(f"device {d} launched {s}" for d, s in sorted(descs.items()))
                    )
                else:
                    try:
                        self.position = seq
                        out = combine({d: a[1] for d, a in rv.arrived.items()})
                        rv.deadline_after, rv.result = out if isinstance(out, tuple) else (out,
                                                                                          None)
                    except BaseException as exc:
                        rv.error = exc
                rv.done = True
                del self._slots[seq]
                self._lock.notify_all()
            else:
                started = time.perf_counter()
                while not rv.done:
                    self._lock.wait(_POLL_S)
                    if rv.done:
                        break
                    reason = backend.abort_reason
                    if reason is not None:
                        raise CollectiveAborted(f"{desc} on device {device}: aborted ({reason})")
                    if time.perf_counter() - started > backend.timeout:
                        missing = tuple(d for d in self.devices if d not in rv.arrived)
                        raise CollectiveTimeout(
                            f"{desc}: device {device} waited {backend.timeout:g} s; devices "
                            f"{list(missing)} of {list(self.devices)} never launched it "
                            "(inconsistent launch order, or a failed peer)",
                            op=desc, devices=self.devices, missing=missing,
                        )
        if rv.error is not None:
            raise rv.error
        remaining = rv.start + rv.deadline_after - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)  # the emulated wire time
        return rv.result


class CpuBackend:
    """Virtual devices on the CPU (see module doc)."""

    name = "cpu"
    xp = np  # the array module stage functions and transfers use
    stream_class: type[CpuStream] = CpuStream
    # Whether threads that complete or wait for an event may advance another stream through
    # its stepped ops (see ``CpuStream.launch``): only a backend that launches stepped ops
    # gains from it (the MPI one); elsewhere every stream runs on its own thread only.
    helping = False
    # Whether an event completes when its stream's work up to it is done (here: the host
    # ran it), so that a callback on the call's end events may tell peers the work ended
    # (``Agreement.hurry_after``). Not on CUDA, where it completes once launched.
    events_end_work = True

    def current_stream(self) -> Any:
        """The native stream of the calling op (None: CPU streams are threads)."""
        return None

    def receives_strided(self, group: Sequence[int]) -> bool:
        """Whether a broadcast among ``group`` may receive into a strided view of the
        destination (one copy lands the data in place); where the transport needs contiguous
        memory (NCCL) receivers stage and unpack."""
        return True

    def steps_broadcast(self, devices: Sequence[int], device: int) -> bool:
        """Whether ``device``'s part of a broadcast among ``devices`` runs as a stepped op
        (:meth:`broadcast_steps`; see ``CpuStream.launch``). Not in one process: a
        collective there is a rendezvous of threads, which blocks."""
        return False

    def broadcast_steps(self, devices: Sequence[int], device: int, root: int,
                        buffer: np.ndarray, desc: str, namespace: str = "",
                        tag: int | None = None) -> Steps:
        """:meth:`broadcast` as steps, for a part :meth:`steps_broadcast` allows."""
        raise OverlapRuntimeError(f"broadcast[{desc}]: device {device}'s part is not stepped "
                                  "on this backend")

    def new_event(self, label: str = "") -> CpuEvent:
        """An event to record later (``stream.record(event=...)``) that others may already be
        told to wait for — of this backend's kind."""
        return CpuEvent(label)

    def caller_events(self) -> list[CpuEvent]:
        """Events a call's streams wait for first: the caller's own device work so far (the
        CUDA backend: its current CuPy and torch streams). None on the CPU: the caller's
        work is done when it calls."""
        return []

    def release_to_caller(self, ends: Sequence[CpuEvent]) -> None:
        """After a call: order the caller's later device work after the call's (CUDA: its
        current streams wait for the lanes' end events). Nothing on the CPU."""

    def hold(self, *buffers: Any) -> None:
        """Called by an op done with ``buffers``: keep them alive until the device has run
        what the op launched on its stream (CUDA: CuPy's pool would hand a freed block to
        the next allocation while a kernel still reads it). On the CPU the work is done when
        the op returns: nothing to keep."""

    def declare_group(self, namespace: str, devices: Sequence[int]) -> None:
        """Every device that collectives of ``namespace`` (a channel) may involve. The CPU
        backend needs nothing; the CUDA backend builds one NCCL communicator per group."""

    def declare_subgroups(self, namespace: str, groups: Sequence[Sequence[int]]) -> None:
        """Device groups that stage collectives of ``namespace`` may use (the multi-process
        backend numbers them to name their messages; one process needs nothing)."""

    def is_local(self, device: int) -> bool:
        """Whether this process drives ``device`` (every device, in a one-process run)."""
        if self.placement is None:
            return 0 <= device < self.num_devices
        return device in self._owned  # type: ignore[operator]

    def start_trace(self) -> None:
        """Record every op launched with an op id from now on (see ``trace``)."""
        self._trace_t0 = time.perf_counter()
        self.trace = []

    def profiler(self, on: bool) -> None:
        """Start or stop the device profiler's capture (CUDA: ``cudaProfilerStart/Stop``);
        nothing on CPU, whose activity no GPU profiler records."""

    def span_seconds(self, mark: Any) -> float:
        """A trace mark as seconds since :meth:`start_trace` (after the work completed)."""
        return mark - self._trace_t0

    # A multi-process flavour's messaging layer (overlap.backends.distributed.Distributed);
    # None in one process.
    dist: Any = None

    def __init__(self, num_devices: int, *, timeout: float = 30.0,
                 link_time: Callable[[int, Sequence[int], int], float] | None = None,
                 placement: Placement | None = None, rank: int = 0) -> None:
        """
        Args:
            num_devices: device ids are 0..num_devices-1.
            timeout: seconds a collective or event wait may block before it raises.
            link_time: ``(root, receivers, nbytes) -> seconds`` a broadcast must take at least
                (link emulation); None moves data as fast as memcpy.
            placement, rank: which rank drives which device, and this process's rank (a
                multi-process job); None: this process drives every device.
        """
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
            raise ValueError(f"num_devices: expected an int >= 1, got {num_devices!r}")
        self.timeout = check_seconds("timeout", timeout)
        self.num_devices = num_devices
        self.link_time = link_time
        self.placement = placement
        self.rank = rank
        self._owned = frozenset(placement.devices_of(rank)) if placement is not None else None
        self._streams: dict[tuple[int, str], CpuStream] = {}
        self._comms: dict[tuple[str, tuple[int, ...]], Communicator] = {}
        self._lock = threading.Lock()
        self._abort_reason: str | None = None
        self._failures: list[BaseException] = []
        self._closed = False
        self._lost: list[Busy] = []
        # When a list, every op launched with an op id appends its TraceRecord to it; the
        # runtime's trace recorder.
        self.trace: list[TraceRecord] | None = None
        # Called (on the failing stream's thread) with every stream failure; the runtime uses
        # it to abort all in-flight work at once, so a failed step ends fast.
        self.on_failure: Callable[[BaseException], None] | None = None

    # ---- streams and events --------------------------------------------------------------

    def stream(self, device: int, name: str = "compute") -> CpuStream:
        if not 0 <= device < self.num_devices:
            raise ValueError(f"device: {device} is not in 0..{self.num_devices - 1}")
        if not self.is_local(device):
            raise ValueError(f"device: {device} is owned by rank "
                             f"{self.placement.owners[device]}, not by this process (rank "
                             f"{self.rank})")
        with self._lock:
            if self._closed:
                raise OverlapRuntimeError("backend is closed")
            key = (device, name)
            if key not in self._streams:
                self._streams[key] = self.stream_class(self, device, name)
            return self._streams[key]

    def streams(self) -> list[CpuStream]:
        with self._lock:
            return list(self._streams.values())

    # ---- collectives (called on stream threads) ------------------------------------------

    def communicator(self, devices: Sequence[int], namespace: str = "") -> Communicator:
        """The communicator of a device group; ``namespace`` separates groups used from
        different streams (NCCL needs one communicator per concurrently used stream too)."""
        group = tuple(sorted(set(devices)))
        with self._lock:
            if (namespace, group) not in self._comms:
                self._comms[(namespace, group)] = Communicator(self, group)
            return self._comms[(namespace, group)]

    def broadcast(self, devices: Sequence[int], device: int, root: int,
                  buffer: np.ndarray, desc: str, namespace: str = "",
                  tag: int | None = None) -> None:
        """The root's ``buffer`` is copied into every other participant's ``buffer``.

        ``tag`` names the collective across processes (the multi-process backend's match key);
        one process matches by launch position and ignores it."""
        group = tuple(sorted(set(devices)))

        def combine(bufs: dict[int, np.ndarray]) -> float:
            src = bufs[root]
            for d, b in bufs.items():
                if d != root:
                    if b.shape != src.shape or b.dtype != src.dtype:
                        raise CollectiveMismatch(
                            f"{desc}: device {d} buffer {b.shape} {b.dtype} != root {root} "
                            f"buffer {src.shape} {src.dtype}"
                        )
                    np.copyto(b, src)
            if self.link_time is None:
                return 0.0
            return self.link_time(root, [d for d in group if d != root], src.nbytes)

        self.communicator(group, namespace).run(device, f"broadcast[{desc}] root {root}", buffer,
                                                combine)

    def all_reduce(self, devices: Sequence[int], device: int, buffer: np.ndarray,
                   desc: str, op: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.add,
                   namespace: str = "", tag: int | None = None) -> None:
        """Every participant's ``buffer`` becomes the reduction of all of them (in place)."""
        group = tuple(sorted(set(devices)))

        def combine(bufs: dict[int, np.ndarray]) -> float:
            total = bufs[group[0]].copy()
            for d in group[1:]:
                total = op(total, bufs[d])
            for b in bufs.values():
                np.copyto(b, total)
            return 0.0

        self.communicator(group, namespace).run(device, f"all_reduce[{desc}]", buffer, combine)

    def all_gather(self, devices: Sequence[int], device: int, buffer: np.ndarray,
                   out: np.ndarray, desc: str, namespace: str = "",
                   tag: int | None = None) -> None:
        """``out`` (on every participant) = the participants' buffers stacked in group order."""
        group = tuple(sorted(set(devices)))

        def combine(pairs: dict[int, tuple[np.ndarray, np.ndarray]]) -> float:
            stacked = np.stack([pairs[d][0] for d in group])
            for _, o in pairs.values():
                np.copyto(o, stacked)
            return 0.0

        self.communicator(group, namespace).run(device, f"all_gather[{desc}]", (buffer, out),
                                                combine)

    # ---- failure, abort, lifecycle -------------------------------------------------------

    def note_failure(self, exc: BaseException) -> None:
        """Record a failure (a stream's, or one reported from elsewhere) and tell
        ``on_failure`` (the runtime aborts everything in flight)."""
        with self._lock:
            self._failures.append(exc)
        if self.on_failure is not None:
            self.on_failure(exc)

    @property
    def abort_reason(self) -> str | None:
        """Why the work in flight was aborted (None: it was not)."""
        return self._abort_reason

    def _check_abort(self, what: str) -> None:
        if self._abort_reason is not None:
            raise CollectiveAborted(f"{what}: aborted ({self._abort_reason})")

    def abort(self, reason: str) -> None:
        """Wake every blocked wait and collective with :class:`CollectiveAborted`."""
        self._abort_reason = reason
        for s in self.streams():
            # (An idle thread beside an op its launcher began: it steps the op, which sees
            # the abort. Others look within _POLL_S anyway.)
            with s._lock:
                s._cv.notify()

    def quiesce(self, timeout: float | None = None) -> bool:
        """Wait (blocking) until every stream's queue is empty and its op finished."""
        deadline = time.perf_counter() + (self.timeout if timeout is None else timeout)
        if self.stop(lambda b: deadline):
            return False
        for s in self.streams():
            ev = s.record("quiesce")
            while not ev.done():
                if time.perf_counter() > deadline:
                    return False
                if ev._done.is_set():
                    time.sleep(0.0005)  # launched; a device is still working (CUDA)
                else:
                    ev._done.wait(_POLL_S)
        return True

    def busy(self) -> list[Busy]:
        """What every stream still doing something is doing (empty: all idle)."""
        return [b for b in (s.busy() for s in self.streams()) if b is not None]

    def stop(self, until: Callable[[Busy], float]) -> list[Busy]:
        """Wait (blocking) until every stream is idle, or until each one still busy is past
        ``until(its Busy)`` (a perf_counter time); returns those (empty: all stopped). Call
        after :meth:`abort`, so that waits and collectives end."""
        while True:
            busy = self.busy()
            now = time.perf_counter()
            if not busy or all(now >= until(b) for b in busy):
                return busy
            time.sleep(0.002)

    def stop_hung(self, grace: float = STOP_GRACE_S) -> list[Busy]:
        """Abort-and-wait policy of the runtime and of :meth:`close`: a wait or a collective
        gets ``grace`` to notice the abort; an op may run until it has run ``timeout`` (it may
        be slow, not hung). Returns the ops still running then — hung — for :meth:`abandon`.
        Never longer than ``max(timeout, grace)``."""
        start = time.perf_counter()

        def until(b: Busy) -> float:
            if b.waiting:
                # A wait (or the queue draining behind an op that just ended) gets the grace
                # from when it began — it may begin late, after a slow op — within the bound.
                return min(max(start, b.since) + grace, start + max(self.timeout, grace))
            hung = self.op_since(b) + self.timeout
            if b.category != "compute":
                # A transfer sees the abort itself at its next look (its waits are bounded
                # and look every 0.1 s at most: mpi.LINK_RECHECK_S): the grace, past its bound.
                return min(max(hung, start + grace), start + max(self.timeout, grace))
            return hung if hung <= start else max(hung, start + grace)  # hung already: done

        return self.stop(until)

    def op_since(self, b: Busy) -> float:
        """When op ``b``'s time bound starts: when it began — or, for a transfer of a
        multi-process call, when every member of the call was known to be in it
        (``Distributed.agreed_at``; not yet: now). A rank outside the call before may begin
        this one long before the others; until they are all in it, the agreement's own
        wait bounds it."""
        if b.category == "compute" or self.dist is None:
            return b.since
        return self.dist.bound_start(b.since)

    def abandon(self, stuck: Sequence[Busy], reason: str) -> None:
        """Give up the threads of ``stuck`` streams (see ``CpuStream._abandon``)."""
        for b in stuck:
            with self._lock:
                stream = self._streams.pop((b.device, b.stream), None)
            if stream is not None:
                stream._abandon(reason)
                self._lost.append(b)

    @property
    def lost(self) -> list[Busy]:
        """The ops whose stream threads were abandoned, stuck in them."""
        return list(self._lost)

    def reset(self) -> None:
        """After a failure, once every stream stopped (:meth:`stop`): drop queued work, clear
        failed state and the abort, forget rendezvous."""
        for s in self.streams():
            s._reset()
        with self._lock:
            self._comms.clear()
            self._failures.clear()
        self._abort_reason = None

    def close(self) -> None:
        """Stop every stream thread: blocked waits are aborted; an op still running gets
        until it has run ``timeout`` seconds, then its thread is abandoned (a daemon that runs
        nothing more). Returns within ``timeout`` + a fraction of a second, whatever the
        ops do."""
        with self._lock:
            self._closed = True
        self.abort("backend closed")
        stuck = self.stop_hung()
        self.abandon(stuck, "backend closed while this stream's thread was stuck in "
                     + ", ".join(b.label for b in stuck))
        threads = [t for t in (s._close() for s in self.streams()) if t is not None]
        for t in threads:
            t.join(STOP_GRACE_S)  # idle: they exit at once
        if self.dist is not None:
            self.dist.close()

    @property
    def failures(self) -> list[BaseException]:
        with self._lock:
            return list(self._failures)
