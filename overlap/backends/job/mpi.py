"""A wire over MPI point-to-point: nonblocking sends and receives whose requests the
process's progress engine tests.

The posting thread makes the MPI call itself (MPI is initialised ``MPI_THREAD_MULTIPLE``:
stream threads post) and hands the request to the engine, which tests every pending request
with backoff and completes its :class:`~overlap.backends.job.engine.Completion` — a waiting
stream thread wakes then. No other thread tests a request. A channel is a communicator of its
own (every rank makes it, in the same order: :meth:`MpiWire.add_channel`), and messages of a
channel are matched by source and tag, never by order: threads of different ranks reach a
channel's transfers in different orders, and tags make that harmless.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ...errors import CollectiveAborted, OverlapRuntimeError
from .engine import Completion, Engine


class MpiReceive(Completion):
    """A receive's completion, with what taking it back needs."""

    __slots__ = ("_request",)

    def __init__(self, what: str, peer: int, request: Any, buffer: Any) -> None:
        super().__init__(what, peer)
        self._request = request
        self.keep = buffer  # (alive while MPI may write it)

    def Cancel(self) -> None:
        """Take the receive back (MPI's cancel; the engine's next test sees it end)."""
        with contextlib.suppress(Exception):
            self._request.Cancel()

    def Wait(self, timeout: float = 1.0) -> None:
        """(After ``Cancel``.) Until MPI is done with the buffer (bounded)."""
        from ...scope import CancelScope

        with contextlib.suppress(Exception):
            self.block(CancelScope("taking a receive back"), self.what, timeout)


class MpiWire:
    """Messages over MPI between the ranks of ``comm``'s world (see module doc)."""

    def __init__(self, comm: Any, engine: Engine) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.engine = engine
        self.tag_ub = int(comm.Get_attr(MPI.TAG_UB))
        self._comms: dict[int, Any] = {}  # channel id -> its communicator

    def add_channel(self, channel: int, comm: Any) -> None:
        self._comms[channel] = comm

    def has_channel(self, channel: int) -> bool:
        return channel in self._comms

    def _comm(self, channel: int) -> Any:
        try:
            return self._comms[channel]
        except KeyError:
            raise OverlapRuntimeError(f"channel {channel} has no MPI communicator on this "
                                      "rank (never prepared)") from None

    def tag(self, tag: int) -> int:
        return tag % (self.tag_ub + 1)

    def isend(self, channel: int, peer: int, tag: int, buf: Any) -> Completion:
        """Send ``buf`` (untouched until it completes) to ``peer``."""
        done = Completion(f"MPI message to rank {peer}", peer)
        request = self._comm(channel).Isend(buf, peer, self.tag(tag))

        def finished(status: Any) -> None:
            if isinstance(status, BaseException):
                done.fail(CollectiveAborted(f"MPI send to rank {peer} failed: {status}"))
            else:
                done.complete()

        done.keep = buf
        self.engine.watch_mpi(request, finished)
        return done

    def irecv(self, channel: int, peer: int, tag: int, buf: Any) -> MpiReceive:
        """Receive the next message from ``peer`` with this tag into ``buf``; its completion's
        ``count`` is the bytes the message carried."""
        MPI = self.MPI
        status = MPI.Status()
        request = self._comm(channel).Irecv(buf, peer, self.tag(tag))
        done = MpiReceive(f"MPI message from rank {peer}", peer, request, buf)

        def finished(st: Any) -> None:
            if isinstance(st, BaseException):
                done.fail(CollectiveAborted(f"MPI receive from rank {peer} failed: {st}"))
            elif st.Is_cancelled():
                done.fail(CollectiveAborted(f"MPI receive from rank {peer} taken back"))
            else:
                done.complete(st.Get_count(MPI.BYTE))

        self.engine.watch_mpi(request, finished, status)
        return done

    def close(self) -> None:
        comms, self._comms = list(self._comms.values()), {}
        for c in comms:
            with contextlib.suppress(Exception):
                c.Free()


__all__ = ["MpiReceive", "MpiWire"]
