"""The in-process transport: collectives whose participants all live in this process.

The participants meet on a :class:`~overlap.backends.devices.collectives.Communicator` (by launch
position); the last to arrive moves the bytes for all of them with its device kind's copies —
``numpy.copyto`` on the CPU, device-to-device copies on the last arriver's CUDA stream after
every participant's ready event on a GPU (the "loopback") — and every participant's stream
then waits for that work. Link emulation makes a broadcast last at least the cost model's
time for it (``link_time``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...scope import CancelScope
from .collectives import check_alike, check_broadcast, reduce_in_order

if TYPE_CHECKING:
    from .backend import Backend


class LocalTransport:
    """Collectives among this process's devices (see module doc), moved by ``backend``'s
    device kind (its ``arrive``/``loopback``/``joined``/``copy``)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.kind = backend.devices

    def prepare(self, channels: dict[str, tuple[int, ...]]) -> None:
        """Before a call: the channels its collectives use (nothing to make in-process)."""

    def broadcast(self, group: tuple[int, ...], device: int, root: int, buffer: Any,
                  desc: str, namespace: str, scope: CancelScope) -> None:
        """The root's ``buffer`` is copied into every other participant's ``buffer``."""
        kind, link_time = self.kind, self.backend.link_time
        what = f"broadcast[{desc}] root {root}"

        def combine(arrivals: dict[int, tuple[Any, Any]]) -> tuple[float, Any]:
            bufs = {d: b for d, (_, b) in arrivals.items()}
            check_broadcast(bufs, root, desc)

            def work(b: dict[int, Any]) -> None:
                for d, dst in b.items():
                    if d != root:
                        kind.copy(dst, b[root])

            done = kind.loopback(arrivals, work)
            seconds = 0.0 if link_time is None else link_time(
                root, [d for d in group if d != root], bufs[root].nbytes)
            return seconds, done

        done = self.backend.comms.get(namespace, group).run(
            device, what, (kind.arrive(), buffer), combine, scope)
        kind.joined(done)

    def all_reduce(self, group: tuple[int, ...], device: int, buffer: Any, desc: str,
                   op: Callable[[Any, Any], Any], namespace: str, scope: CancelScope) -> None:
        """Every participant's ``buffer`` becomes ``op`` folded over all of them, in device
        order (in place)."""
        kind = self.kind
        what = f"all_reduce[{desc}]"

        def combine(arrivals: dict[int, tuple[Any, Any]]) -> tuple[float, Any]:
            check_alike({d: b for d, (_, b) in arrivals.items()}, what)

            def work(b: dict[int, Any]) -> None:
                total = reduce_in_order(b, group, op)
                for dst in b.values():
                    kind.copy(dst, total)

            return 0.0, kind.loopback(arrivals, work)

        done = self.backend.comms.get(namespace, group).run(
            device, what, (kind.arrive(), buffer), combine, scope)
        kind.joined(done)

    def all_gather(self, group: tuple[int, ...], device: int, buffer: Any, out: Any,
                   desc: str, namespace: str, scope: CancelScope) -> None:
        """``out`` (on every participant) = the participants' buffers stacked in device
        order."""
        kind = self.kind
        what = f"all_gather[{desc}]"

        def combine(arrivals: dict[int, tuple[Any, Any]]) -> tuple[float, Any]:
            check_alike({d: p[0] for d, (_, p) in arrivals.items()}, what)

            def work(pairs: dict[int, Any]) -> None:
                for _, o in pairs.values():
                    for k, d in enumerate(group):
                        kind.copy(o[k], pairs[d][0])

            return 0.0, kind.loopback(arrivals, work)

        done = self.backend.comms.get(namespace, group).run(
            device, what, (kind.arrive(), (buffer, out)), combine, scope)
        kind.joined(done)


__all__ = ["LocalTransport"]
