"""The seconds a wait may last, shared by everything of one backend that waits.

Every wait the runtime makes — a collective's rendezvous, a peer's answer, the device, a
stage op running on — is bounded by the backend's timeout. The parts that wait (the
communicators, the CUDA kind, the control plane, the wire, NCCL's links) hold this one
:class:`Bound` and read it at each wait, so a call may widen it for its own duration
(``Runtime.train_step(timeout=...)``: a first step that compiles) and every wait of that call
sees it — on every process, since each process's call sets the same value.
"""

from __future__ import annotations


class Bound:
    """``seconds``: how long a wait may last now (see module doc)."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __repr__(self) -> str:
        return f"Bound({self.seconds:g} s)"


class Bounded:
    """A part that waits: ``timeout`` is its ``bound``'s seconds now (read at each wait)."""

    bound: Bound

    @property
    def timeout(self) -> float:
        return self.bound.seconds


def bound_of(timeout: float | Bound) -> Bound:
    """``timeout`` itself if it is a :class:`Bound` (shared), else a new one of its own."""
    return timeout if isinstance(timeout, Bound) else Bound(timeout)


__all__ = ["Bound", "Bounded", "bound_of"]
