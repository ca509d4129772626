"""A transfer's hop over a host link in one piece (``MpiBackend._link_steps``, the lean path
most transfers of a step take): its steps driven by hand on two ``HostLinks`` joined by a
socket pair, as two ranks' transfers are. What it delivers, the mismatch it names, and a
wait that gives up: named, its receive taken back. (Across processes: tests/test_mpi.py.)"""

from __future__ import annotations

import time

import numpy as np
import pytest

from overlap.backends.host_links import HostLinks
from overlap.backends.mpi import MpiBackend, _Hop
from overlap.errors import CollectiveMismatch, CollectiveTimeout

BOUND_S = 10.0


class _Dist:
    """The part of ``Distributed`` a hop asks: whether to give up (after ``patience``
    looks), with what it would name."""

    def __init__(self, patience: int = 10**9) -> None:
        self.patience = patience
        self.named: list[tuple[str, int | None]] = []

    def check_transfer(self, what: str, started: float, who: str, peer: int | None) -> None:
        self.named.append((who, peer))
        if len(self.named) >= self.patience:
            raise CollectiveTimeout(f"{what}: {who}", op=what, devices=(), missing=())


def _rank(links: HostLinks, rank: int, dist: _Dist | None = None):
    """An MpiBackend's state as far as its link steps go (no MPI)."""
    b = object.__new__(MpiBackend)
    b.links, b.rank, b.dist = links, rank, dist or _Dist()
    return b


def _hop(prev: int | None, nxt: int | None) -> _Hop:
    return _Hop("broadcast[#3] root 0", None, 7, prev, nxt, 3, 1)


def _run(steps) -> None:
    """Drive steps by hand (no step waker: each asks to be looked at again soon)."""
    deadline = time.monotonic() + BOUND_S
    for _ in steps:
        assert time.monotonic() < deadline, "the hop never ended"
        time.sleep(0.0005)


def test_a_piece_sent_by_the_root_lands_in_the_last_ranks_buffer(pair):
    sent = np.arange(16, dtype=np.uint8)
    got = np.zeros(16, np.uint8)
    _run(MpiBackend._link_steps(_rank(pair[0], 0), _hop(None, 1), sent))
    _run(MpiBackend._link_steps(_rank(pair[1], 1), _hop(0, None), got))
    np.testing.assert_array_equal(got, sent)


def test_a_piece_of_another_size_is_named_as_a_mismatch(pair):
    _run(MpiBackend._link_steps(_rank(pair[0], 0), _hop(None, 1), np.ones(16, np.uint8)))
    with pytest.raises(CollectiveMismatch, match=r"broadcast\[#3\] root 0: rank 1 received 16 "
                       r"bytes from rank 0 where 8 were expected"):
        _run(MpiBackend._link_steps(_rank(pair[1], 1), _hop(0, None), np.zeros(8, np.uint8)))


def test_a_receive_that_gives_up_names_its_sender_and_is_taken_back(pair):
    dist = _Dist(patience=3)
    late = np.zeros(4, np.uint8)
    with pytest.raises(CollectiveTimeout, match="rank 0 never sent it"):
        _run(MpiBackend._link_steps(_rank(pair[1], 1, dist), _hop(0, None), late))
    assert dist.named[-1] == ("rank 0 never sent it", 0)
    # The message that comes after goes to the next receive, not the abandoned buffer.
    _run(MpiBackend._link_steps(_rank(pair[0], 0), _hop(None, 1), np.full(4, 9, np.uint8)))
    again = np.zeros(4, np.uint8)
    _run(MpiBackend._link_steps(_rank(pair[1], 1), _hop(0, None), again))
    assert late.tolist() == [0] * 4 and again.tolist() == [9] * 4
