"""What a failed call says: the ops it names as hung, and the one root cause it raises.

:func:`overdue` finds a call's compute ops past the timeout; :func:`hang_error` names them
(the longest-running first) and :func:`overran_error` one that returned too late;
:func:`describe` says what an op is from the step graph. :func:`root_cause` picks, among a
call's failures, the one that explains the others (:func:`consequence`: those that never do).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from scheduler import Compute, StepGraph

from .errors import CallMismatch, CollectiveAborted, CollectiveTimeout, RankFailed, StageTimeout

if TYPE_CHECKING:
    from .backends import Backend, Busy
    from .scope import CancelScope


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


def consequence(exc: BaseException) -> bool:
    """Whether ``exc`` only follows from another failure (an abort, a timeout waiting for a
    peer, a peer that failed): never the root cause while another is known."""
    return isinstance(exc, (CollectiveAborted, CollectiveTimeout, RankFailed))


__all__ = ["consequence", "describe", "hang_error", "overdue", "overran_error", "root_cause"]
