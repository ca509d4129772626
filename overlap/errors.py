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
    """A collective waited longer than the timeout: some participants never arrived."""

    def __init__(self, message: str, *, op: str, devices: tuple[int, ...],
                 missing: tuple[int, ...]) -> None:
        super().__init__(message)
        self.op = op
        self.devices = devices
        self.missing = missing


class CollectiveMismatch(OverlapRuntimeError):
    """Participants launched different collectives at the same position (inconsistent order)."""


class CollectiveAborted(OverlapRuntimeError):
    """A collective was abandoned because a participant failed or the run was cancelled."""


class RankFailed(OverlapRuntimeError):
    """Another process of a multi-process job failed (or raised outside the runtime); this
    process stopped its work. ``rank`` is the failed one, ``error`` what it reported."""

    def __init__(self, message: str, *, rank: int, error: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.error = error
