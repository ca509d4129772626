"""Waiting: the one blocking wait, the one awaiting wait, and the one-shot completion.

Every wait of the runtime is one of two functions, whatever it waits for:

- :func:`block_on` — a thread (a stream's, a worker's) blocks until its **source** is over;
- :func:`wait_on` — a coroutine on the event loop awaits it, never blocking the loop.

Both take the same five things: the **source** (a :class:`OneShot`, or anything with its
``over`` and ``add_callback``), the call's **scope** (:class:`~overlap.scope.CancelScope`;
None where the source's own failure is how a cancellation reaches it), **what** is awaited
(the text of the error a cancellation raises), the **timeout** and what to do when
**overdue**. After every wake-up they look, in this order, at the source (over: the wait
returns True — its own failure may be what cancelled the scope, so it comes first), at the
scope (cancelled: :class:`~overlap.errors.CollectiveAborted` naming ``what``), then at the
time: each time ``timeout`` seconds pass with the source still pending, ``overdue()`` is
called — it raises to end the wait with its error (a timeout naming who is late), returns
True to wait ``timeout`` more (the peer answered that it is at work), or False to give up
(the wait returns False). Without ``overdue`` the wait returns False at the timeout. A wait
never raises the source's own error: the source's ``block``/``wait`` does, knowing what it
means.

**How cancellation reaches a wait.** Nothing polls a flag. A blocked thread sleeps on a
:class:`Waiter` that both the source's completion and ``scope.on_cancel`` wake, from
whichever thread finishes the source or cancels the scope. An awaiting coroutine awaits a
loop future that a :class:`_LoopWake` resolves through ``call_soon_threadsafe``, registered
the same two ways: at most one wake-up of the loop is in flight per wait, and none is sent
once the wait ended — a source finishing after its wait was cancelled costs the loop
nothing. A timeout is a loop timer (not ``asyncio.wait_for``: on 3.11 that drops a cancel
that comes in the loop pass its wait ends, gh-86296 — Ctrl-C would go unseen).

A :class:`OneShot` is finished once — done with a result, or failed with an error — from any
thread; every callback registered before runs once, on the finishing thread (one that
raises is logged, not allowed to leave the others unwoken); one registered after is refused
(``add_callback`` returns False) so that the caller looks again instead of waiting.
``Event``, ``Completion``, ``WireWork`` and ``Round`` (and a rendezvous's slot) are ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from .polling import POLL_FIRST_S, poll_first
from .scope import CancelScope

log = logging.getLogger("overlap")


class Source(Protocol):
    """What a wait waits for (a :class:`OneShot` is one)."""

    @property
    def over(self) -> bool: ...
    def add_callback(self, cb: Callable[[], Any]) -> bool: ...


class OneShot:
    """Pending until finished once, from any thread (see module doc)."""

    __slots__ = ("_callbacks", "_error", "_lock", "_over", "_result")

    def __init__(self) -> None:
        self._over = False
        self._error: BaseException | None = None
        self._result: Any = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], Any]] = []

    @property
    def over(self) -> bool:
        """Finished: done, or failed."""
        return self._over

    @property
    def error(self) -> BaseException | None:
        """What failed it (None: pending, or done)."""
        return self._error

    @property
    def result(self) -> Any:
        """What it finished with (None until then, and when it failed)."""
        return self._result

    def finish(self, error: BaseException | None = None, result: Any = None) -> bool:
        """Done with ``result`` (or failed with ``error``), waking every waiter; only the
        first call counts (True: this one did)."""
        with self._lock:
            if self._over:
                return False
            self._error, self._result = error, result
            self._over = True  # (last: a thread that sees it over sees why)
            callbacks, self._callbacks = self._callbacks, []
        self._on_finish(error)
        for cb in callbacks:
            try:
                cb()
            except Exception:  # (one waiter's bug must not leave the others unwoken)
                log.exception("a callback of %r failed", self)
        return True

    def _on_finish(self, error: BaseException | None) -> None:
        """(Subclasses.) What finishing does before the waiters wake, on the same thread."""

    def add_callback(self, cb: Callable[[], Any]) -> bool:
        """``cb()`` once it is finished, on the thread that finishes it; False (and no call)
        if it is already — the caller looks again instead of waiting."""
        with self._lock:
            if self._over:
                return False
            self._callbacks.append(cb)
            return True


def when_all(sources: Sequence[Source], fn: Callable[[], Any]) -> None:
    """``fn()`` once, when every one of ``sources`` is over: on the thread that finishes
    the last — or now, if they all are."""
    left = [len(sources) + 1]  # (+1: not before every callback is registered)
    lock = threading.Lock()

    def one() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    for s in sources:
        if not s.add_callback(one):
            one()
    one()


class Waiter:
    """A one-shot wake-up a thread blocks on (a C lock used as a binary semaphore: waking
    from any thread, blocking with a timeout, no Python-level condition)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def wake(self, *_: Any) -> None:
        """Wake the blocked thread (or let its next :meth:`block` return at once). Any thread,
        any number of times."""
        with contextlib.suppress(RuntimeError):  # (woken already)
            self._lock.release()

    def block(self, timeout: float | None = None, poll: float = POLL_FIRST_S) -> bool:
        """Until woken (True), or ``timeout`` seconds (False) — looking again for up to
        ``poll`` seconds before it sleeps (:mod:`overlap.polling`)."""
        lock = self._lock
        if lock.acquire(blocking=False):
            return True
        budget = poll if timeout is None else min(poll, max(0.0, timeout))
        if poll_first(lambda: lock.acquire(blocking=False), budget):
            return True
        if timeout is None:
            return lock.acquire()
        return lock.acquire(timeout=max(0.0, timeout - budget))


Overdue = Callable[[], bool]


def block_on(source: Source, scope: CancelScope | None, what: str, timeout: float | None = None,
          overdue: Overdue | None = None, poll: float = POLL_FIRST_S) -> bool:
    """Block this thread until ``source`` is over (True), ``scope`` is cancelled (raises
    :class:`~overlap.errors.CollectiveAborted` naming ``what``) or, past ``timeout``, as
    ``overdue`` says (module doc) — looking again for up to ``poll`` seconds before each
    sleep (:mod:`overlap.polling`)."""
    if source.over:
        return True
    waiter = Waiter()
    if not source.add_callback(waiter.wake):
        return True
    handle = None if scope is None else scope.on_cancel(waiter.wake)
    try:
        deadline = None if timeout is None else time.perf_counter() + timeout
        while not source.over:
            if scope is not None and scope.cancelled:
                raise scope.aborted(what)
            left = None
            if deadline is not None:
                left = deadline - time.perf_counter()
                if left <= 0:
                    if overdue is None or not overdue():
                        return source.over
                    deadline = time.perf_counter() + timeout  # type: ignore[operator]
                    continue
            waiter.block(left, poll)
        return True
    finally:
        if scope is not None:
            scope.remove(handle)


class _LoopWake:
    """Wakes one awaiting wait on its loop (module doc): at most one wake-up in flight, none
    once the wait ended."""

    __slots__ = ("_lock", "_loop", "_sent", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._sent = False
        self.future: asyncio.Future[None] = loop.create_future()

    def __call__(self, *_: Any) -> None:
        with self._lock:
            if self._sent:
                return
            self._sent = True
        with contextlib.suppress(RuntimeError):  # (the loop closed: nobody waits)
            self._loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        settle(self.future)

    def end(self) -> None:
        with self._lock:
            self._sent = True


async def wait_on(source: Source, scope: CancelScope | None, what: str,
               timeout: float | None = None,
               overdue: Callable[[], bool | Awaitable[bool]] | None = None) -> bool:
    """Await ``source`` on the event loop: True once it is over; raises
    :class:`~overlap.errors.CollectiveAborted` naming ``what`` when ``scope`` is cancelled;
    past ``timeout``, as ``overdue`` says (module doc) — it may be a coroutine function (a
    liveness ask, run off the loop)."""
    if source.over:
        return True
    loop = asyncio.get_running_loop()
    wake = _LoopWake(loop)
    if not source.add_callback(wake):
        return True
    handle = None if scope is None else scope.on_cancel(wake)
    try:
        while not source.over:
            if scope is not None and scope.cancelled:
                raise scope.aborted(what)
            if timeout is None:
                await wake.future
                continue
            timer = loop.call_later(timeout, settle, wake.future)
            try:
                await wake.future
            finally:
                timer.cancel()
            if wake.future.done() and not wake._sent:  # (the timer, not a wake-up)
                wake.future = loop.create_future()
                if source.over or (scope is not None and scope.cancelled):
                    continue
                answer = overdue() if overdue is not None else False
                if inspect.isawaitable(answer):
                    answer = await answer
                if not answer:
                    return source.over
        return True
    finally:
        wake.end()
        if scope is not None:
            scope.remove(handle)


def settle(future: asyncio.Future[Any], error: BaseException | None = None) -> None:
    """Set ``future``'s result (or ``error``) unless it is done already (given up on)."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def sleep(seconds: float, scope: CancelScope, what: str) -> None:
    """Sleep ``seconds`` on this thread, or raise at once when ``scope`` is cancelled."""
    block_on(OneShot(), scope, what, seconds)


__all__ = ["OneShot", "Source", "Waiter", "block_on", "settle", "sleep", "wait_on", "when_all"]
