"""What the balancers work on and hand back: sends, and the pieces a plan is made of."""

from __future__ import annotations

from dataclasses import dataclass

from .regions import Region

Assignment = list[tuple[int, Region, int]]  # (send index, piece, sender), in launch order
# What the planner gets back, in launch order: (send index, piece, sender, receivers, after,
# lane), ``after`` naming earlier entries of the same list that must end first, ``lane`` the
# comm stream it runs on (``Transfer.lane``).
Pieces = list[tuple[int, Region, int, tuple[int, ...], tuple[int, ...], int]]


@dataclass(frozen=True)
class Send:
    """A box that must cross the network: any of ``holders`` may send it to ``receivers``."""

    region: Region
    nbytes: int
    holders: tuple[int, ...]
    receivers: tuple[int, ...]
