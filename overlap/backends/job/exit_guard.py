"""How a multi-process job's process ends: a failed job must end, on every rank, with a
non-zero status — and with every rank's error printed.

MPI cannot take back messages in flight, so a failed multi-process runtime does not recover.
While a control plane (:class:`~.distributed.Distributed`) is live — from when it is made
until it leaves — this module's guards are installed (once per process):

- **an uncaught exception** is printed whole (:func:`print_whole`, or by the user's own
  hook) and, unless it is a peer's failure, told to the peers: the job cannot go on;
- **at exit** a process whose control plane saw no failure says it left (the script ended
  without closing its runtime); a failed one flushes its output, tells its peers it is
  exiting, waits (bounded by its ``grace``) until every peer has reported — said it is
  exiting too, or left — so that they print their errors, lingers so the launcher forwards
  them, then calls ``MPI_Abort`` (without MPI, under torchrun: ``os._exit(1)``): the
  launcher ends the job with a non-zero status.

:func:`report` tells ``python -m overlap.guard`` (when it wraps this rank) what the runtime
is doing, so that a rank killed by a signal is named with its call.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
import traceback
import weakref
from typing import Any, Protocol

from ...errors import RankFailed
from ...world import World
from .control_messages import ControlTag

_LINGER_S = 0.5  # after every peer reported: time for the launcher to forward their output


class Guarded(Protocol):
    """What the guards use of a live control plane (:class:`~.distributed.Distributed`)."""

    rank: int
    world: World
    grace: float  # how long a failed rank waits at exit for its peers' reports
    broken: BaseException | None  # the job's failure, as this rank knows it
    exiting: set[int]  # the ranks that said they are exiting (or left)
    MPI: Any  # mpi4py's MPI (None: a job without MPI)
    engine: Any

    def announce_failure(self, during: str, error: BaseException) -> None: ...
    def say_left(self, how: str) -> None: ...
    def tell_all(self, tag: int, msg: dict[str, Any], wait: float = 1.0) -> None: ...


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # the control planes not yet left
_GUARDS: list[bool] = []  # installed (once per process)


def watch(dist: Guarded) -> None:
    """``dist`` is live: the guards (installed now, if not yet) end the job through it."""
    _LIVE.add(dist)
    if not _GUARDS:
        _GUARDS.append(True)
        _install()


def release(dist: Guarded) -> None:
    """``dist`` left (its runtime closed, nothing failed or the failure was handled)."""
    _LIVE.discard(dist)


def report(doing: str) -> None:
    """Tell the ``overlap.guard`` wrapping this rank, if any, what the runtime does now."""
    from ...guard import report as to_guard  # (here: ``python -m overlap.guard`` runs it)

    to_guard(doing)


def print_whole(tp: type[BaseException], value: BaseException, tb: Any) -> None:
    """Print a traceback as Python does, but in one write: the default hook writes it in
    pieces, and with unbuffered output (PYTHONUNBUFFERED) the launcher interleaves the
    pieces of several ranks' errors mid-line."""
    text = "".join(traceback.format_exception(tp, value, tb))
    with contextlib.suppress(Exception):
        sys.stderr.write(text)
        sys.stderr.flush()


def _install() -> None:
    previous = sys.excepthook

    def excepthook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        if previous is sys.__excepthook__:
            print_whole(tp, value, tb)
        else:  # the user's own hook (IPython, rich, ...) prints it their way
            previous(tp, value, tb)
        for d in list(_LIVE):
            if d.broken is None and not isinstance(value, RankFailed):
                d.announce_failure("the script (an uncaught exception)", value)
            d.broken = d.broken or value
            break

    sys.excepthook = excepthook
    atexit.register(_at_exit)


def _at_exit() -> None:
    live = list(_LIVE)
    broken = [d for d in live if d.broken is not None]
    if not broken:
        for d in live:
            d.say_left("exited")  # the script ended without closing its runtime
            d.engine.close()
        return
    b = broken[0]
    # Let the peers print their own errors before the launcher takes the job down: every
    # rank flushes what it printed, then says so, and the first MPI_Abort waits until every
    # peer has reported (said it is exiting too, or left), bounded by the grace.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    b.tell_all(ControlTag.EXITING, {"rank": b.rank})
    deadline = time.perf_counter() + b.grace
    others = set(range(b.world.size)) - {b.rank}
    while not others <= b.exiting and time.perf_counter() < deadline:
        time.sleep(0.01)
    # What a rank wrote sits in a pipe until the launcher forwards it, and the launcher drops
    # what it has not read when MPI_Abort tears the job down (seen under load: a rank's
    # error, and the aborting ranks' own "Abort(1)" lines, missing from the job's output).
    time.sleep(min(_LINGER_S, b.grace))
    if b.MPI is None:  # (torchrun: the agent ends the other workers of a failed one)
        os._exit(1)
    b.MPI.COMM_WORLD.Abort(1)


__all__ = ["Guarded", "print_whole", "release", "report", "watch"]
