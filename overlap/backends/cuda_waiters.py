"""Host waits for CUDA events, without polling and without spinning a core.

The CUDA backend's events are created with ``block=True`` (``cudaEventBlockingSync``): a thread
that calls ``synchronize()`` on one sleeps in the driver until the GPU passes the event. A few
daemon threads here do that on behalf of the asyncio loop and wake it
(``call_soon_threadsafe``) the moment the event completes.

Why not poll: uvloop's timers tick in whole milliseconds, so polling ``Event.done`` with backoff
saw a 0.5 ms transfer complete up to ~1.5 ms late; on an H200 (gpu_check, 2026-11-30) a 1 GiB
device copy measured end to end ran at 24 % of the copy engine's peak for that reason alone.

Why daemon threads of our own (not ``asyncio.to_thread``): a kernel that never ends keeps its
waiter in ``synchronize()`` forever. The awaiting coroutine is bounded anyway (the backend's
timeout, its abort), and a stranded daemon thread can hang neither ``close()`` nor the
interpreter's exit, where an executor's threads are joined.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from typing import Any

WAITER_THREADS = 4  # several: one event that completes late does not delay the others'
MAX_WAITER_THREADS = 64  # spares, started while every thread is busy (stuck kernels)


class EventWaiters:
    """``watch(event, loop, future)``: ``future`` gets ``None`` (or the exception
    ``event.synchronize()`` raised, e.g. a device fault) once the GPU has passed ``event``.

    ``threads`` wait at once; when every one is busy — stuck behind kernels that never end,
    say — a job starts one more (up to ``MAX_WAITER_THREADS``), so one stuck wait never
    delays another's answer. (The awaiting side also looks at ``event.done`` itself.)"""

    def __init__(self, threads: int = WAITER_THREADS) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, asyncio.AbstractEventLoop, asyncio.Future]] = (
            queue.SimpleQueue())
        self._threads = threads
        self._started = 0
        self._idle = 0
        self._lock = threading.Lock()

    def watch(self, event: Any, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        with self._lock:  # started on first use: importing overlap starts no thread
            want = self._threads if self._started < self._threads else self._started + 1
            if self._idle == 0 and self._started < min(want, MAX_WAITER_THREADS):
                self._started += 1
                self._idle += 1
                threading.Thread(target=self._serve, name=f"cuda-event-waiter-{self._started}",
                                 daemon=True).start()
            self._idle -= 1  # (a thread takes this job; negative: jobs are queued)
        self._jobs.put((event, loop, future))

    def _serve(self) -> None:
        while True:
            event, loop, future = self._jobs.get()
            error: BaseException | None = None
            try:
                event.synchronize()
            except BaseException as exc:  # a device fault: the awaiting coroutine raises it
                error = exc
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(_settle, future, error)
            with self._lock:
                self._idle += 1


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the waiter gave up (timeout, abort) and cancelled it
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


WAITERS = EventWaiters()  # one set per process: each waits for any backend's events
