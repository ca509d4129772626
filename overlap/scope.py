"""Cancellation: one object that every wait of a call's work registers with.

A :class:`CancelScope` is made for each runtime call (and one for the runtime itself, the
parent of its calls). Work launched for the call carries the scope. The first failure
recorded in it (:meth:`CancelScope.fail`) cancels it, and cancelling wakes at once every
thread blocked on its behalf — a stream waiting for another stream's event, a collective's
rendezvous, a wait for a message on the wire — and every coroutine awaiting it. Nothing
polls a flag: every wait registers with the scope (:meth:`CancelScope.on_cancel`) through
the one blocking wait and the one awaiting wait of :mod:`overlap.waits` (trio's cancel
scopes, on threads).

Scopes nest: cancelling a parent cancels its children (a peer's failure, which ends the
whole multi-process job, cancels the runtime's scope and so the call in flight), while a
child's failure stays in the child (a failed call leaves a one-process runtime usable).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .errors import CollectiveAborted


class CancelScope:
    """One call's (or the runtime's) cancellation and failures (see module doc)."""

    __slots__ = ("__weakref__", "_callbacks", "_children", "_error", "_lock", "_next",
                 "failures", "parent", "what")

    def __init__(self, what: str, parent: CancelScope | None = None) -> None:
        self.what = what
        self.parent = parent
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next = 0
        self._children: list[CancelScope] = []
        self.failures: list[BaseException] = []  # in the order they were recorded
        if parent is not None:
            parent._adopt(self)

    def __repr__(self) -> str:
        state = f"cancelled: {self._error}" if self._error is not None else "active"
        return f"CancelScope({self.what!r}, {state})"

    @property
    def cancelled(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> BaseException | None:
        """Why the scope was cancelled (None: it was not)."""
        return self._error

    def fail(self, exc: BaseException) -> None:
        """Record a failure of the scope's work and cancel it (the first failure is why)."""
        with self._lock:
            self.failures.append(exc)
        self.cancel(exc)

    def cancel(self, error: BaseException) -> None:
        """Cancel the scope and its children: every registered wait is woken now. Only the
        first call counts."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            callbacks, self._callbacks = list(self._callbacks.values()), {}
            children = list(self._children)
        for cb in callbacks:
            cb()  # (wakers: they never raise)
        for child in children:
            child.cancel(error)

    def on_cancel(self, callback: Callable[[], None]) -> int | None:
        """Call ``callback()`` (from the cancelling thread) when the scope is cancelled;
        returns a handle for :meth:`remove`, or None if it is cancelled already — then
        nothing is registered and the caller sees :attr:`cancelled`."""
        with self._lock:
            if self._error is not None:
                return None
            handle = self._next
            self._next += 1
            self._callbacks[handle] = callback
            return handle

    def remove(self, handle: int | None) -> None:
        if handle is not None:
            with self._lock:
                self._callbacks.pop(handle, None)

    def check(self, what: str) -> None:
        """Raise :class:`CollectiveAborted` naming ``what`` if the scope is cancelled."""
        error = self._error
        if error is not None:
            raise CollectiveAborted(f"{what}: aborted ({_reason(error)})")

    def aborted(self, what: str) -> CollectiveAborted:
        """The error a wait of ``what`` raises when the scope is cancelled."""
        return CollectiveAborted(f"{what}: aborted ({_reason(self._error)})")

    def forget_failures(self) -> None:
        """The scope's call is over: keep that it was cancelled and why, in words, but not
        the exception objects — raised to the caller, their tracebacks reach the caller's
        frames, and work still holding this scope (an op stuck in user code) would keep
        those alive."""
        with self._lock:
            if self._error is not None and not isinstance(self._error, CollectiveAborted):
                self._error = CollectiveAborted(_reason(self._error))
            elif self._error is not None:
                self._error = CollectiveAborted(str(self._error))
            self.failures = []

    def close(self) -> None:
        """The scope's call is over: its parent forgets it (and cancels it no more)."""
        parent = self.parent
        if parent is not None:
            with parent._lock:
                if self in parent._children:
                    parent._children.remove(self)

    def _adopt(self, child: CancelScope) -> None:
        with self._lock:
            error = self._error
            if error is None:
                self._children.append(child)
        if error is not None:
            child.cancel(error)


def _reason(error: BaseException | None) -> str:
    if error is None:
        return "not cancelled"
    text = str(error) or type(error).__name__
    return text if isinstance(error, CollectiveAborted) else f"{type(error).__name__}: {text}"


__all__ = ["CancelScope"]
