"""The progress engine: the one thread of a process that waits on the wire.

Everything a multi-process runtime receives or must see complete goes through it: the host
links' sockets (it reads every frame and writes what did not fit at once), MPI requests (it
tests them, backing off from 20 µs to 200 µs between looks while any is pending — MPI has
no completion a thread could sleep on, and a rendezvous send completes only while its
receiver's process calls into MPI), and timers (the control messages' look, every
``LISTEN_TICK_S``). What it completes is a :class:`Completion`: a stream thread blocked on
one wakes, an awaiting coroutine is called back on its loop. Nothing else reads a link's
socket or tests a request (but the NCCL bootstrap, which tests its few while it makes
communicators), and the engine never runs user code nor advances a stream.

Work is handed to it from any thread: a posting thread makes its MPI call itself (MPI is
initialised ``MPI_THREAD_MULTIPLE``) and gives the engine the request; a socket write that
did not fit is finished by the engine as the socket takes it. The engine sleeps in
``select`` (its timeout has microsecond resolution: epoll's has a millisecond's) until a
socket is ready, a wake-up comes through its socket pair (``socketpair``), a timer is due, or
it is time to test MPI again.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import CollectiveAborted
from ...polling import POLL_FIRST_S, poll_first
from ...scope import CancelScope
from ...waits import OneShot, block_on

log = logging.getLogger("overlap")


@dataclass(frozen=True)
class Backoff:
    """How the engine polls pending MPI requests: ``spin`` looks without sleeping, then
    sleeps from ``start`` doubling up to ``cap`` seconds; back to the start whenever one
    completes."""

    spin: int = 0
    start: float = 20e-6
    cap: float = 200e-6

    def __post_init__(self) -> None:
        if self.spin < 0 or not 0 <= self.start <= self.cap:
            raise ValueError(f"poll: need spin >= 0 and 0 <= start <= cap, got {self}")

    def delay(self, attempt: int) -> float:
        """Seconds to sleep before look number ``attempt + 1`` (0 while spinning)."""
        if attempt < self.spin:
            return 0.0
        return min(self.cap, self.start * 2.0 ** min(attempt - self.spin, 30))


class Completion(OneShot):
    """A nonblocking send or receive on the wire (a host link's or MPI's): pending until the
    thread that finishes it — the engine's, or the posting thread's when it finishes at
    once — completes it (``count``: the bytes a receive's message carried) or fails it."""

    __slots__ = ("keep", "peer", "what")

    def __init__(self, what: str = "", peer: int = -1) -> None:
        super().__init__()
        self.what = what
        self.keep: Any = None  # what must stay alive until it is over (a send's buffer)
        self.peer = peer

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self.done else "pending")
        return f"Completion({self.what!r}, {state})"

    @property
    def done(self) -> bool:
        return self._over and self._error is None

    @property
    def count(self) -> int:
        """The bytes a completed receive's message carried (-1: not known, or pending)."""
        return -1 if self._result is None else self._result

    def complete(self, count: int = -1) -> None:
        self.finish(None, count)

    def fail(self, error: BaseException) -> None:
        self.finish(error)

    def Cancel(self) -> None:
        """Take back a receive still pending (the wire's and MPI's receives do); a send, or
        a completion nothing can take back, stays as it is."""

    def Wait(self, timeout: float = 1.0) -> None:
        """(After :meth:`Cancel`.) Return once no bytes will land in the buffer any more:
        nothing was posted here to land."""

    def block(self, scope: CancelScope, what: str, timeout: float | None,
              overdue: Callable[[], bool] | None = None) -> bool:
        """Block this thread until it is done (True; raises what failed it), ``timeout``
        seconds pass (False; with ``overdue``, as it says: :func:`overlap.waits.block_on`), or
        ``scope`` is cancelled (raises)."""
        over = block_on(self, scope, what, timeout, overdue)
        if self._error is not None:
            raise self._error
        return over


class Engine:
    """The progress engine of one process (see module doc)."""

    def __init__(self, name: str, poll: Backoff | None = None) -> None:
        self.poll = poll or Backoff()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # Touched by the engine's thread only (registered through call_soon):
        self._readers: dict[int, Callable[[], None]] = {}
        self._writers: dict[int, Callable[[], None]] = {}
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        # Handed over from other threads, under the lock:
        self._lock = threading.Lock()
        self._calls: list[Callable[[], None]] = []
        self._mpi: list[tuple[Any, Any, Callable[[Any], None]]] = []  # (request, status, done)
        self._asleep = False  # in select with no MPI request to look at again
        self._closing = False
        self.failure: BaseException | None = None  # what stopped the thread, if anything
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- handing work over (any thread) --------------------------------------------------

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the engine's thread soon."""
        with self._lock:
            self._calls.append(fn)
        self._poke()

    def watch_mpi(self, request: Any, done: Callable[[Any], None], status: Any = None) -> None:
        """Test ``request`` until it completes, then call ``done(status)`` on the engine's
        thread (``status``: an ``MPI.Status`` to fill, or None)."""
        with self._lock:
            if self._closing:
                raise CollectiveAborted("the process's progress engine is closed")
            self._mpi.append((request, status, done))
            asleep = self._asleep
        if asleep:
            self._poke()

    def watch_reader(self, fd: int, on_ready: Callable[[], None]) -> None:
        """Call ``on_ready()`` on the engine's thread whenever ``fd`` has bytes to read."""
        self.call_soon(lambda: self._readers.__setitem__(fd, on_ready))

    def watch_writer(self, fd: int, on_ready: Callable[[], None] | None) -> None:
        """Call ``on_ready()`` whenever ``fd`` has room to write (None: no longer). From the
        engine's thread it takes effect at once."""
        if threading.current_thread() is self._thread:
            self._set_writer(fd, on_ready)
        else:
            self.call_soon(lambda: self._set_writer(fd, on_ready))

    def forget(self, fd: int, wait: float = 1.0) -> None:
        """No more callbacks for ``fd``: at once on the engine's thread; from another, once
        the engine has dropped it (waited for, at most ``wait``) — so that the caller may
        close the descriptor, which the engine must never be left waiting on."""
        def drop() -> None:
            self._readers.pop(fd, None)
            self._writers.pop(fd, None)

        if threading.current_thread() is self._thread or not self._thread.is_alive():
            drop()
            return
        dropped = OneShot()

        def drop_and_say() -> None:
            drop()
            dropped.finish()

        self.call_soon(drop_and_say)
        block_on(dropped, None, f"the engine dropping descriptor {fd}", wait)

    def every(self, seconds: float, fn: Callable[[], None]) -> None:
        """Call ``fn()`` on the engine's thread every ``seconds`` — also after a call that
        raised (logged): one bad tick must not end the control messages' look for good."""
        def again() -> None:
            try:
                fn()
            finally:
                self._at(time.perf_counter() + seconds, again)

        self.call_soon(lambda: self._at(time.perf_counter() + seconds, again))

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # ---- the thread ----------------------------------------------------------------------

    def _set_writer(self, fd: int, on_ready: Callable[[], None] | None) -> None:
        if on_ready is None:
            self._writers.pop(fd, None)
        else:
            self._writers[fd] = on_ready

    def _at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), fn))

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        wake = self._wake_r.fileno()
        attempt = 0
        try:
            while not self._closing:
                with self._lock:
                    polling = bool(self._mpi)
                    self._asleep = not polling
                timeout = self.poll.delay(attempt) if polling else None
                if self._timers:
                    due = max(0.0, self._timers[0][0] - time.perf_counter())
                    timeout = due if timeout is None else min(timeout, due)
                readers = [wake, *self._readers]
                writers = list(self._writers)
                try:
                    ready_r, ready_w = self._wait(readers, writers, timeout)
                except OSError:  # a descriptor closed under it (not forgotten first): dropped
                    self._drop_closed()
                    continue
                with self._lock:
                    self._asleep = False
                for fd in ready_r:
                    if fd == wake:
                        self._drain_pokes()
                        continue
                    cb = self._readers.get(fd)
                    if cb is not None:
                        self._guarded(cb)
                for fd in ready_w:
                    cb = self._writers.get(fd)
                    if cb is not None:
                        self._guarded(cb)
                with self._lock:
                    calls, self._calls = self._calls, []
                for fn in calls:
                    self._guarded(fn)
                if polling:
                    attempt = 0 if self._test_mpi() else attempt + 1
                now = time.perf_counter()
                while self._timers and self._timers[0][0] <= now:
                    _, _, fn = heapq.heappop(self._timers)
                    self._guarded(fn)
        except BaseException as exc:  # a bug here must not pass for a silent wire
            self.failure = exc
            log.exception("the progress engine stopped")

    def _wait(self, readers: list[int], writers: list[int], timeout: float | None
              ) -> tuple[list[int], list[int]]:
        """``select``, looking again briefly first when it would sleep longer than that
        (:mod:`overlap.polling`)."""
        ready = _select(readers, writers, 0)
        if ready[0] or ready[1] or (timeout is not None and timeout <= POLL_FIRST_S):
            return ready if (ready[0] or ready[1] or not timeout) else \
                _select(readers, writers, timeout)
        found: list[tuple[list[int], list[int]]] = []

        def look() -> bool:
            got = _select(readers, writers, 0)
            if got[0] or got[1]:
                found.append(got)
                return True
            return False

        if poll_first(look):
            return found[0]
        return _select(readers, writers, None if timeout is None
                       else max(0.0, timeout - POLL_FIRST_S))

    def _drop_closed(self) -> None:
        for table in (self._readers, self._writers):
            for fd in list(table):
                try:
                    os.fstat(fd)
                except OSError:
                    log.warning("the progress engine: descriptor %d closed while watched", fd)
                    table.pop(fd, None)

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # (one source's bug must not stop the others)
            log.exception("the progress engine: a callback failed")

    def _drain_pokes(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass

    def _test_mpi(self) -> bool:
        """Test every pending MPI request; call back those that completed. True: one did."""
        with self._lock:
            pending = list(self._mpi)
        finished = []
        for entry in pending:
            request, status, _ = entry
            try:
                ok = request.Test(status) if status is not None else request.Test()
            except Exception as exc:  # (an error of MPI's: that request's waiter learns it)
                ok, status = True, exc
                entry = (request, exc, entry[2])
            if ok:
                finished.append(entry)
        if not finished:
            return False
        with self._lock:
            gone = {id(e[0]) for e in finished}
            self._mpi = [e for e in self._mpi if id(e[0]) not in gone]
        for _, status, done in finished:
            self._guarded(lambda done=done, status=status: done(status))
        return True

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self, timeout: float = 1.0) -> None:
        """Stop the thread (within ``timeout``); MPI requests still pending are dropped (the
        communicators they belong to are freed by their owners)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._mpi.clear()
        self._poke()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with contextlib.suppress(OSError):
            self._wake_r.close()
            self._wake_w.close()


def _select(readers: list[int], writers: list[int], timeout: float | None
            ) -> tuple[list[int], list[int]]:
    """``select.select`` (microsecond timeouts); ``poll`` (milliseconds) for descriptors
    beyond ``FD_SETSIZE``, which ``select`` refuses."""
    try:
        r, w, _ = select.select(readers, writers, [], timeout)
        return r, w
    except ValueError:
        p = select.poll()
        for fd in readers:
            p.register(fd, select.POLLIN)
        for fd in writers:
            p.register(fd, select.POLLOUT | (select.POLLIN if fd in readers else 0))
        ms = None if timeout is None else max(0, int(timeout * 1e3 + 0.999))
        events = p.poll(ms)
        return ([fd for fd, ev in events if ev & (select.POLLIN | select.POLLHUP | select.POLLERR)
                 and fd in readers],
                [fd for fd, ev in events if ev & select.POLLOUT])


__all__ = ["Backoff", "Completion", "Engine"]
