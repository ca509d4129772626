"""Admission to a runtime's calls: one at a time, in order, never from inside one.

:class:`CallGate` queues the callers of one runtime, whichever thread or event loop they call
from; :func:`refuse_reentry` refuses a call made from one of the runtime's own stream threads
(a stage function), which would wait for the very streams it runs on. The call itself
(:mod:`overlap.call`) passes both before anything else.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import TYPE_CHECKING

from .backends import current_stream
from .errors import OverlapRuntimeError

if TYPE_CHECKING:
    from .backends import Backend


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


__all__ = ["CallGate", "refuse_reentry"]
