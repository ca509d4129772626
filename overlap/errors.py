"""Runtime errors. Each names the device, the operation and who is involved."""

from __future__ import annotations


class OverlapRuntimeError(RuntimeError):
    """Base class of the runtime's failures."""


class StreamError(OverlapRuntimeError):
    """An operation failed on a device stream; later work on that stream was abandoned."""

    def __init__(self, message: str, *, device: int, stream: str, op: str) -> None:
        super().__init__(message)
        self.device = device
        self.stream = stream
        self.op = op


class CollectiveTimeout(OverlapRuntimeError):
    """A collective waited longer than the timeout: some participants never arrived.

    ``missing``: the devices that never came; ``ranks``: across processes, the ranks the
    wait was for that, asked, said they were not at work in this call (behind it, done with
    it, past it) or did not answer — empty for a wait among this process's devices."""

    def __init__(self, message: str, *, op: str, devices: tuple[int, ...],
                 missing: tuple[int, ...], ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.op = op
        self.devices = devices
        self.missing = missing
        self.ranks = ranks


class CollectiveMismatch(OverlapRuntimeError):
    """Participants launched different collectives at the same position (inconsistent order)."""


class CollectiveAborted(OverlapRuntimeError):
    """A collective was abandoned because a participant failed or the run was cancelled."""


class CallMismatch(OverlapRuntimeError):
    """The processes of a multi-process job made different runtime calls (other step graphs,
    another plan, a skipped call). ``ranks`` are those whose call differs from this one's.

    It explains every other failure of that call, so the runtime raises it in preference to
    the failures it caused (and to other ranks' reports of theirs)."""

    def __init__(self, message: str, *, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks


class RankFailed(OverlapRuntimeError):
    """Another process of a multi-process job failed (or raised outside the runtime); this
    process stopped its work. ``rank`` is the failed one, ``error`` what it reported,
    ``calls`` how many runtime calls it had made when it failed."""

    def __init__(self, message: str, *, rank: int, error: str, calls: int = 0) -> None:
        super().__init__(message)
        self.rank = rank
        self.error = error
        self.calls = calls


class StageTimeout(OverlapRuntimeError):
    """An op ran longer than the runtime's ``timeout`` and never finished (user code that
    hangs, or a device that stopped): ``op`` names it, with its ``stage``, ``microbatch`` and
    ``phase`` (``F``/``B``; None for a transfer), the ``device`` and ``stream``, and how many
    ``seconds`` it had run when it was named. Its thread is abandoned (see
    :class:`DeviceThreadLost`)."""

    def __init__(self, message: str, *, op: str, device: int, stream: str,
                 stage: int | None, microbatch: int | None, phase: str | None,
                 seconds: float) -> None:
        super().__init__(message)
        self.op = op
        self.device = device
        self.stream = stream
        self.stage = stage
        self.microbatch = microbatch
        self.phase = phase
        self.seconds = seconds


class DeviceThreadLost(OverlapRuntimeError):
    """A device stream's thread is stuck in an op that never returned (named by ``stuck``:
    ``(device, stream, op)`` triples) and was abandoned: this runtime refuses further work.
    Close it and make a fresh ``Runtime`` (which works, in the same process)."""

    def __init__(self, message: str, *, stuck: tuple[tuple[int, str, str], ...]) -> None:
        super().__init__(message)
        self.stuck = stuck


class DeviceTimeout(OverlapRuntimeError):
    """Device work (a CUDA stream's, up to ``event``) was launched and never completed within
    the timeout: a kernel that never ends, or a device fault after which CUDA reports no
    event complete."""

    def __init__(self, message: str, *, event: str) -> None:
        super().__init__(message)
        self.event = event


class DeviceFault(OverlapRuntimeError):
    """The device failed before it reached ``event`` (CUDA's error from waiting for it, e.g.
    an illegal memory access: such errors are sticky, the GPU's context is unusable after
    one). The cause is chained."""

    def __init__(self, message: str, *, event: str) -> None:
        super().__init__(message)
        self.event = event
