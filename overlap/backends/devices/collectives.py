"""What a collective means, written once for every transport: matching the participants of
this process by launch position (as NCCL matches a communicator's calls), the checks that
name a mismatch, and the order of reductions.

A :class:`Communicator` joins the participants of one device group that live in this process:
each collective call on it takes the device's next launch position, and the last participant
to arrive runs the collective's data movement (a transport's ``combine``) for all of them, so
an inconsistent launch order really deadlocks — and the wait turns that into
:class:`CollectiveTimeout` naming the devices that never arrived, while participants that
launched *different* collectives at one position get :class:`CollectiveMismatch`. Every wait
is bounded by the backend's timeout and ends at once when the call's scope is cancelled.

Reductions add contributions in device order, on every transport that computes them itself,
so a multi-process result equals the one-process one bit for bit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...errors import CollectiveMismatch, CollectiveTimeout
from ...scope import CancelScope
from ...waits import OneShot, block_on, sleep
from .bound import Bound, Bounded, bound_of


class _Slot(OneShot):
    """One launch position of a communicator: who arrived; finished, with the collective's
    result or error, once the last to arrive has run it."""

    __slots__ = ("arrived", "hold", "running", "start")

    def __init__(self) -> None:
        super().__init__()
        self.arrived: dict[int, tuple[str, Any]] = {}
        self.running = False
        self.start = 0.0
        self.hold = 0.0  # seconds from ``start`` every participant stays (link emulation)


class Communicator(Bounded):
    """Collectives among a fixed group of this process's devices (see module doc)."""

    def __init__(self, devices: tuple[int, ...], timeout: float | Bound) -> None:
        self.devices = devices
        self.bound = bound_of(timeout)
        self._lock = threading.Lock()  # (launch positions and slots)
        self._next: dict[int, int] = dict.fromkeys(devices, 0)
        self._slots: dict[int, _Slot] = {}
        # The launch position whose ``combine`` is running (the same op has the same
        # position on every process: combines that cross processes name their messages by it)
        self.position = -1

    def run(self, device: int, desc: str, contribution: Any,
            combine: Callable[[dict[int, Any]], Any], scope: CancelScope) -> Any:
        """Join the device's next collective; the last to arrive runs ``combine`` with every
        participant's contribution. ``combine`` moves the data and returns the seconds every
        participant must stay (link emulation; 0), or (seconds, result), whose result every
        participant gets back."""
        with self._lock:
            seq = self._next[device]
            self._next[device] = seq + 1
            slot = self._slots.get(seq)
            if slot is None:
                slot = self._slots[seq] = _Slot()
            slot.arrived[device] = (desc, contribution)
            last = len(slot.arrived) == len(self.devices)
            if last:
                slot.running = True
                slot.start = time.perf_counter()  # (the wire time counts from the last arrival)
        if last:
            self._combine(seq, slot, combine)
        else:
            self._await(device, desc, slot, scope)
        if slot.error is not None:
            raise slot.error
        left = slot.start + slot.hold - time.perf_counter()
        if left > 0:  # the emulated wire time (cancellable)
            sleep(left, scope, desc)
        return slot.result

    def _combine(self, seq: int, slot: _Slot, combine: Callable[[dict[int, Any]], Any]) -> None:
        descs = {d: a[0] for d, a in slot.arrived.items()}
        error: BaseException | None = None
        hold, result = 0.0, None
        try:
            if len(set(descs.values())) > 1:
                raise CollectiveMismatch(
                    f"collective launch order differs between devices {list(self.devices)} at "
                    f"position {seq}: "
                    + "; ".join(f"device {d} launched {s}" for d, s in sorted(descs.items())))
            self.position = seq
            out = combine({d: a[1] for d, a in slot.arrived.items()})
            hold, result = out if isinstance(out, tuple) else (out, None)
        except BaseException as exc:
            error = exc
        slot.hold = hold
        with self._lock:
            del self._slots[seq]
        slot.finish(error, result)  # (wakes the participants waiting for it)

    def _await(self, device: int, desc: str, slot: _Slot, scope: CancelScope) -> None:
        def overdue() -> bool:
            with self._lock:
                if slot.running:
                    return True  # (every participant arrived: the combine's waits are bounded)
                missing = tuple(d for d in self.devices if d not in slot.arrived)
            raise CollectiveTimeout(
                f"{desc}: device {device} waited {self.timeout:g} s; devices "
                f"{list(missing)} of {list(self.devices)} never launched it "
                "(inconsistent launch order, or a failed peer)",
                op=desc, devices=self.devices, missing=missing)

        # (poll=0: a participant sleeps at once, as on the condition variable it once was.)
        block_on(slot, scope, f"{desc} on device {device}", self.timeout, overdue, poll=0.0)


class Communicators:
    """The communicators of one process, one per (namespace, device group): a namespace is
    a stream's (a channel's, a lane's), so collectives issued from different streams never
    share launch positions (NCCL needs a communicator per concurrently used stream too)."""

    def __init__(self, timeout: float | Bound) -> None:
        self.bound = bound_of(timeout)
        self._lock = threading.Lock()
        self._comms: dict[tuple[str, tuple[int, ...]], Communicator] = {}

    def get(self, namespace: str, group: Sequence[int]) -> Communicator:
        key = (namespace, tuple(sorted(set(group))))
        with self._lock:
            comm = self._comms.get(key)
            if comm is None:
                comm = self._comms[key] = Communicator(key[1], self.bound)
            return comm

    def forget(self) -> None:
        """Drop every communicator (after a call that failed part-way: positions restart)."""
        with self._lock:
            self._comms.clear()


# ---- the checks and the orders -------------------------------------------------------------


def check_broadcast(bufs: Mapping[int, Any], root: int, what: str) -> None:
    """Every receiver's buffer has the root's shape and dtype."""
    src = bufs[root]
    for d, b in bufs.items():
        if d != root and (b.shape != src.shape or b.dtype != src.dtype):
            raise CollectiveMismatch(f"{what}: device {d} buffer {b.shape} {b.dtype} != root "
                                     f"{root} buffer {src.shape} {src.dtype}")


def check_alike(bufs: Mapping[int, Any], what: str) -> None:
    """Every contribution has the first one's shape and dtype (all-reduce, all-gather)."""
    first = min(bufs)
    shape, dtype = bufs[first].shape, bufs[first].dtype
    for d, b in bufs.items():
        if b.shape != shape or b.dtype != dtype:
            raise CollectiveMismatch(f"{what}: device {d} buffer {b.shape} {b.dtype} != device "
                                     f"{first} buffer {shape} {dtype}")


def reduce_in_order(parts: Mapping[int, Any], group: Sequence[int],
                    op: Callable[[Any, Any], Any]) -> Any:
    """``op`` folded over the contributions in device order (a new array)."""
    total = parts[group[0]].copy()
    for d in group[1:]:
        total = op(total, parts[d])
    return total


__all__ = ["Communicator", "Communicators", "check_alike", "check_broadcast",
           "reduce_in_order"]
