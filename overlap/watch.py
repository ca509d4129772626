"""Watching a call's work: every wait bounded, a hung op named, and nothing left behind.

A call launches its whole step graph, then :func:`wait_all` awaits every lane's end at
once, looking every tick at what each stream's thread is doing: an op that has run longer
than the runtime's ``timeout`` is hung, and becomes a :class:`~overlap.errors.StageTimeout`
naming it (stage, microbatch, phase, device) — user code cannot be interrupted, so the
runtime cannot wait for it. Collectives time out on their own, naming who never arrived.

After a failure, :class:`Recovery` aborts what is in flight and waits for the streams to stop
(:meth:`~overlap.backends.CpuBackend.stop_hung`: a wait gets a fraction of a second to see the
abort; an op, until it has run ``timeout``). A stream whose op still runs then is abandoned
— its thread is a daemon that runs nothing more — and the runtime says so on every later
call (:class:`~overlap.errors.DeviceThreadLost`) until a fresh ``Runtime`` is made. Otherwise
the backend is reset, and the next call starts clean: no error of one call reaches a later
one, and an interrupted call (Ctrl-C) that could not wait for its streams leaves the cleanup
to the next call's :meth:`Recovery.ready`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from scheduler import Compute, StepGraph

from .backends.cpu import STOP_GRACE_S, Busy
from .errors import DeviceThreadLost, StageTimeout
from .loop_calls import call_soon_any_thread

if TYPE_CHECKING:
    from .backends import Backend

TICK_S = 0.1  # how often a waiting call looks for hung ops (at most; less for small timeouts)
# A comm op gets this much longer than ``timeout``: its collective raises CollectiveTimeout
# itself at ``timeout``, naming the devices that never arrived — the better message.
COMM_SLACK_S = 2 * STOP_GRACE_S


def describe(busy: Busy, graph: StepGraph | None) -> tuple[str, int | None, int | None,
                                                           str | None]:
    """(what the op is, its stage, microbatch, phase) from the step graph when it is known."""
    body = graph.ops[busy.op].body if graph is not None and busy.op is not None else None
    if isinstance(body, Compute):
        phase = "forward" if body.kind == "F" else "backward"
        return (f"stage {body.stage} {phase} of microbatch {body.microbatch} on device "
                f"{busy.device}", body.stage, body.microbatch, body.kind)
    if body is not None:
        return f"{body} on device {busy.device}", None, getattr(body, "microbatch", None), None
    return busy.label, None, None, None


def hang_error(stuck: Sequence[Busy], graph: StepGraph | None, timeout: float) -> StageTimeout:
    """The error naming ``stuck`` ops, the longest-running first (the likeliest culprit: the
    others may be waiting inside it, e.g. in a stage collective)."""
    ordered = sorted(stuck, key=lambda b: b.since)
    first = ordered[0]
    what, stage, mb, phase = describe(first, graph)
    now = time.perf_counter()
    seconds = now - first.since
    others = [f"{describe(b, graph)[0]} ({now - b.since:.1f} s)" for b in ordered[1:]]
    text = (f"{what} never finished: it has run {seconds:.1f} s on device {first.device}'s "
            f"{first.stream!r} stream (timeout {timeout:g} s)")
    if others:
        text += "; also still running: " + ", ".join(others)
    text += (". Its thread is abandoned and this runtime refuses further work: close it and "
             "make a fresh Runtime")
    return StageTimeout(text, op=what, device=first.device, stream=first.stream, stage=stage,
                        microbatch=mb, phase=phase, seconds=seconds)


def overdue(backend: Backend, timeout: float) -> list[Busy]:
    """Ops (not waits) running past their bound now (from ``backend.op_since``: a transfer
    of a multi-process call is bounded from when every member of the call was in it)."""
    now = time.perf_counter()
    return [b for b in backend.busy() if not b.waiting and now >= backend.op_since(b)
            + timeout + (0.0 if b.category == "compute" else COMM_SLACK_S)]


def name_hang(backend: Backend, graph: StepGraph | None) -> StageTimeout | None:
    """The error naming the ops running past their bound now, recorded as the backend's
    failure (which aborts the rest of the work at once); None when there are none."""
    hung = overdue(backend, backend.timeout)
    if not hung:
        return None
    err = hang_error(hung, graph, backend.timeout)
    backend.note_failure(err)
    return err


async def wait_all(backend: Backend, events: Sequence[Any], graph: StepGraph | None) -> None:
    """Await every event at once; raise the first failure, or a :class:`StageTimeout` as
    soon as an op runs longer than the backend's ``timeout``."""
    timeout = backend.timeout
    tick = min(TICK_S, timeout / 4)
    await _all_ended(backend, events, graph, tick)
    # What is left: failures (raised below) and, on a GPU, device work after its launch.
    events = [ev for ev in events if not ev.done() or ev.error is not None]
    tasks = [asyncio.ensure_future(ev.wait()) for ev in events]
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, timeout=tick,
                                               return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if pending:
                err = name_hang(backend, graph)
                if err is not None:
                    raise err
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
            elif not t.cancelled():
                t.exception()  # retrieved: the first failure is raised, the rest follow it


async def _all_ended(backend: Backend, events: Sequence[Any], graph: StepGraph | None,
                     tick: float) -> None:
    """Until every event has ended (completed; on a GPU, launched) or one failed, looking
    for hung ops every ``tick``. The event loop is woken once, by the last of them (or the
    first failure), not once per event: each wake-up from another thread costs tens of
    microseconds of CPU on a busy machine, a call has an event per lane."""
    if all(ev.done() or ev.error is not None for ev in events):
        return  # (ended during the launch: no future, no timer, no pass of the loop)
    loop = asyncio.get_running_loop()
    left = [len(events)]
    lock = threading.Lock()
    # Completed by the last event (or the first failure), else by the tick: a future and a
    # timer a look, not asyncio.wait's sets and callbacks (twice the cost, every call).
    waiter = [loop.create_future()]

    def wake() -> None:
        if not waiter[0].done():
            waiter[0].set_result(None)

    def one(ev: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last or ev.error is not None:
            with contextlib.suppress(RuntimeError):  # (the loop closed: nobody waits now)
                call_soon_any_thread(loop, wake)

    for ev in events:
        ev.add_done_callback(one)
    while left[0] > 0 and not any(ev.error is not None for ev in events):
        tick_handle = loop.call_later(tick, wake)
        try:
            await waiter[0]
        finally:
            tick_handle.cancel()
        waiter[0] = loop.create_future()
        if left[0] > 0:
            err = name_hang(backend, graph)
            if err is not None:
                raise err


class Recovery:
    """A runtime's failure handling (see module doc): stop, then reset or abandon."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._lock = threading.Lock()  # one recovery at a time (concurrent calls may fail)
        self._epoch = 0  # resets so far: a failure already recovered from is not again
        self.lost: DeviceThreadLost | None = None

    @property
    def epoch(self) -> int:
        return self._epoch

    def check(self) -> None:
        """Raise :class:`DeviceThreadLost` once a stream thread was abandoned."""
        if self.lost is not None:
            raise self.lost

    async def ready(self) -> None:
        """Before a call launches: finish a recovery an interrupted call left (its streams
        had not stopped), so that no earlier error reaches this call."""
        self.check()
        if self.backend.abort_reason is not None:
            await self.settle("an earlier call was interrupted", None, self._epoch)
            self.check()

    def stop_now(self, reason: str, epoch: int) -> None:
        """:meth:`settle` for an interrupted call, on the calling thread: at most the grace."""
        self._settle(reason, None, epoch, cancelled=True)

    async def settle(self, reason: str, graph: StepGraph | None, epoch: int, *,
                     cancelled: bool = False) -> StageTimeout | None:
        """Abort what is in flight and stop every stream (off the event loop). Returns the
        error naming hung ops when some were abandoned. ``cancelled``: the call was
        interrupted and must return at once — a stream that did not stop within the grace
        is left for the next call's :meth:`ready`; this waits on the loop's thread, at most
        the grace, because an interrupted task may be interrupted again at any await."""
        if cancelled:
            self.stop_now(reason, epoch)
            return None
        return await asyncio.to_thread(self._settle, reason, graph, epoch, cancelled)

    def _settle(self, reason: str, graph: StepGraph | None, epoch: int,
                cancelled: bool) -> StageTimeout | None:
        backend = self.backend
        # An interrupted call waits at most the grace, here too: a recovery already running
        # (another call's) stops this call's work as well.
        if not self._lock.acquire(timeout=STOP_GRACE_S if cancelled else -1):
            return None
        try:
            if epoch != self._epoch:
                return None  # another call recovered from this failure already
            backend.abort(reason)
            if cancelled:
                start = time.perf_counter()
                if backend.stop(lambda b: start + STOP_GRACE_S):
                    return None  # still busy: the next call finishes this
            else:
                stuck = backend.stop_hung()
                if stuck:
                    return self._abandon(stuck, graph)
            backend.reset()
            self._epoch += 1
            return None
        finally:
            self._lock.release()

    def _abandon(self, stuck: list[Busy], graph: StepGraph | None) -> StageTimeout:
        err = hang_error(stuck, graph, self.backend.timeout)
        names = tuple((b.device, b.stream, describe(b, graph)[0]) for b in stuck)
        self.backend.abandon(stuck, f"device {stuck[0].device} stream {stuck[0].stream!r}: "
                                    f"its thread is stuck in {names[0][2]}")
        self.lost = DeviceThreadLost(
            "this runtime lost the thread of "
            + "; ".join(f"device {d}'s {s!r} stream (stuck in {op})" for d, s, op in names)
            + f": it ran past the timeout ({self.backend.timeout:g} s) and was abandoned. "
            "Close this runtime and make a fresh Runtime", stuck=names)
        self.backend.note_failure(err)
        return err
