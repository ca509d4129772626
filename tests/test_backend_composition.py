"""A backend composed in its constructor: a device kind (``DeviceKind``), and across processes
a transport (``Transport``, or a factory that makes it for the backend) and a control plane —
given to ``Backend`` when it is made, nothing set on it afterwards. A recording transport
stands in for the job package's (``WireTransport``, ``NcclTransport``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from overlap.backends import Backend, CpuDevices, DeviceKind, Transport
from overlap.scope import CancelScope
from overlap.world import Placement


class Recording:
    """A transport across processes that records what reaches it (devices 2 and 3 are
    another process's)."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def spans(self, group: Sequence[int]) -> bool:
        return any(d >= 2 for d in group)

    def prepared(self, channels: dict[str, tuple[int, ...]],
                 groups: Sequence[tuple[str, tuple[int, ...]]]) -> bool:
        return True

    def prepare(self, channels: dict[str, tuple[int, ...]],
                groups: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        self.log.append("prepare")

    def broadcast(self, order: tuple[int, ...], device: int, root: int, buffer: Any,
                  desc: str, namespace: str, tag: int | None, scope: CancelScope) -> None:
        self.log.append(f"broadcast {order} tag {tag}")

    def all_reduce(self, group: tuple[int, ...], device: int, buffer: Any, desc: str,
                   op: Callable[[Any, Any], Any], namespace: str, tag: int | None,
                   scope: CancelScope) -> None:
        self.log.append(f"all_reduce {group}")

    def all_gather(self, group: tuple[int, ...], device: int, buffer: Any, out: Any,
                   desc: str, namespace: str, tag: int | None, scope: CancelScope) -> None:
        self.log.append(f"all_gather {group}")

    def receives_strided(self, group: Sequence[int]) -> bool:
        return False

    def hop(self, order: tuple[int, ...], device: int, root: int, namespace: str,
            nbytes: int) -> Any:
        return ("hop", order)

    def transfer(self, route: Any, buffer: Any, tag: int, scope: CancelScope) -> Any:
        self.log.append(f"transfer tag {tag}")

    def forget(self) -> None:
        self.log.append("forget")

    def close(self) -> None:
        self.log.append("transport closed")


class ControlPlane:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def close(self) -> None:
        self.log.append("control plane closed")


def _joined(log: list[str], transport: Any) -> Backend:
    return Backend(CpuDevices(), 4, timeout=5.0, placement=Placement((0, 0, 1, 1)), rank=0,
                   dist=ControlPlane(log), transport=transport)


def test_the_device_kinds_and_the_recording_transport_meet_their_protocols():
    assert isinstance(CpuDevices(), DeviceKind)
    assert isinstance(Recording([]), Transport)
    assert not isinstance(object(), DeviceKind)


def test_a_factory_gets_the_backend_with_everything_else_in_place():
    log: list[str] = []
    seen = {}

    def make(backend: Backend) -> Recording:
        seen.update(local=backend.local, dist=backend.dist, rank=backend.rank,
                    placement=backend.placement)
        return Recording(log)

    backend = _joined(log, make)
    try:
        assert isinstance(backend.remote, Recording)
        assert seen["local"] is backend.local and seen["dist"] is backend.dist
        assert (seen["rank"], seen["placement"]) == (0, Placement((0, 0, 1, 1)))
    finally:
        backend.close()


def test_a_transport_given_as_is_carries_what_spans_processes_then_closes_before_dist():
    log: list[str] = []
    transport = Recording(log)
    backend = _joined(log, transport)
    scope = CancelScope("test")
    buf = np.zeros(3)
    backend.broadcast([0, 2, 3], 0, 0, buf, "b", tag=7, scope=scope)
    backend.all_reduce([0, 1, 2], 0, buf, "r", scope=scope)
    backend.all_gather([1, 3], 1, buf, np.zeros((2, 3)), "g", scope=scope)
    route = backend.route([2], 0, 0, "t", "ns", buf.nbytes)
    assert route.hop == ("hop", (0, 2)) and not route.strided
    backend.transfer(route, buf, 9, scope)
    backend.forget()
    assert backend.remote is transport
    backend.close()
    assert log == ["broadcast (0, 2, 3) tag 7", "all_reduce (0, 1, 2)", "all_gather (1, 3)",
                   "transfer tag 9", "forget", "transport closed", "control plane closed"]


def test_collectives_within_the_process_stay_in_process():
    log: list[str] = []
    backend = _joined(log, Recording(log))
    try:
        route = backend.route([1], 0, 0, "t", "ns", 8)
        assert route.hop is None and route.strided
        assert not backend.remote.spans(route.group)  # type: ignore[union-attr]
    finally:
        backend.close()
    assert log == ["transport closed", "control plane closed"]


def test_one_process_has_no_transport_across_processes():
    backend = Backend(CpuDevices(), 2)
    try:
        assert backend.remote is None and backend.dist is None
        backend.forget()  # (nothing across processes to forget)
    finally:
        backend.close()


@pytest.mark.parametrize("kwargs, name", [
    ({"devices": object()}, "devices"),
    ({"devices": "cpu"}, "devices"),
    ({"transport": object()}, "transport"),
    ({"transport": 3}, "transport"),
])
def test_bad_parts_are_named(kwargs, name):
    args = {"devices": CpuDevices(), **kwargs}
    with pytest.raises(TypeError, match=name):
        Backend(args.pop("devices"), 2, **args)
