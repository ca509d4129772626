"""A transfer's part on one device, resolved once: what a transport is handed.

A plan's transfer is a broadcast from its sender to its receivers, on the comm stream of its
lane. :meth:`Backend.route <overlap.backends.Backend.route>` resolves each device's part of it
once per step graph — the participants in chain order, the communicator (its stream's name),
whether the destination may be a strided view — and, where the participants span processes,
the remote transport's own frozen value for it (this rank's place in the chain over ranks,
the piece size, the channel's id). Every step then hands the route, a buffer and the
transfer's tag to :meth:`Backend.transfer <overlap.backends.Backend.transfer>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Route:
    """One device's part of one transfer (see module doc)."""

    desc: str  # the transfer's name ("#3", "reshard s0→s1 mb2 #0")
    namespace: str  # the comm stream it runs on, whose communicator it uses
    root: int
    order: tuple[int, ...]  # the participants: the root first, then its receivers in order
    device: int  # this part's device
    nbytes: int
    strided: bool = True  # a receiver may land the bytes in a strided view (else: staged)
    hop: Any = None  # across processes: the remote transport's value (None: in-process)

    @property
    def what(self) -> str:
        """How errors and messages name it: ``broadcast[#3] root 4``."""
        return f"broadcast[{self.desc}] root {self.root}"

    @property
    def local_copy(self) -> bool:
        """The root copies to itself (its destination region lies in its own source)."""
        return self.order == (self.root,)

    @property
    def group(self) -> tuple[int, ...]:
        return tuple(sorted(self.order))


__all__ = ["Route"]
