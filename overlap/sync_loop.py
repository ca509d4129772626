"""The event loop a runtime's ``*_sync`` methods run on, kept between calls, and
:func:`run` (a coroutine on a loop of its own).

A new loop per call (``asyncio.run``) also makes and joins a thread pool each time; a
:class:`SyncLoop` keeps one loop per runtime. On the main thread it is stock asyncio's (with
:class:`~overlap.polling.PollFirstSelector`), elsewhere uvloop's when installed
(:func:`new_loop` says why).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from .polling import PollFirstSelector

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a new event loop (see ``new_loop``), then close it."""
    loop = SyncLoop()
    try:
        return loop.run(coro, "overlap.run")
    finally:
        loop.close()


def new_loop() -> asyncio.AbstractEventLoop:
    """The loop for synchronous calls made on this thread: uvloop's, but on the main thread,
    where uvloop arms its signal wake-up at every run (a socket pair, ``set_wakeup_fd``, a
    watch on it, then all undone: ~12 µs each call of every process, twice stock asyncio's
    whole run). There stock asyncio's loop: a Ctrl-C interrupts its wait as any system call
    (EINTR), and a whole training step takes as long on either (measured) — and its
    selector looks again briefly before it sleeps (:mod:`overlap.polling`)."""
    if threading.current_thread() is threading.main_thread():
        return asyncio.SelectorEventLoop(PollFirstSelector())
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def cancel_pending(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on ``loop`` and let it finish, so nothing runs on later."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


class SyncLoop:
    """The event loop a runtime's ``*_sync`` methods run on, kept between calls: a new loop
    per call (``asyncio.run``) also makes and joins a new thread pool each time — about 0.4 ms
    a call on one process, 2.5 ms with four processes sharing two cores."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        # Calls from several threads take turns (one loop runs one call at a time; a second
        # thread running the same loop would fail, or cancel the first call).
        self._turn = threading.Lock()

    def run(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise RuntimeError(f"{what}: called from inside a running event loop; await the "
                               "async method instead")
        with self._turn:
            return self._run(coro)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None or self._loop.is_closed():
            self._loop = new_loop()
        loop = self._loop
        task = loop.create_task(coro)
        try:
            return loop.run_until_complete(task)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: nothing of this call may run on during a later one.
            cancel_pending(loop)
            raise

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the ``*_sync`` calls run on (None: none made yet, or closed)."""
        return self._loop

    def close(self) -> None:
        with self._turn:
            self._close()

    def _close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return

        def shut() -> None:
            cancel_pending(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            shut()
            return
        # Closed from async code: another loop runs on this thread, so finish ours elsewhere.
        t = threading.Thread(target=shut, name="overlap-sync-loop-close")
        t.start()
        t.join()


__all__ = ["SyncLoop", "cancel_pending", "new_loop", "run"]
