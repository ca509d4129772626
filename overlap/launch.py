"""Launching a step graph on a backend: the runtime's one interpreter of the IR.

Training steps and standalone reshardings go through :func:`launch`: for each lane of the
graph that this process drives, in lane order, every op's waits become ``wait_event`` on the
lane's stream (events pre-created, so a wait may be launched before its record), the op
itself is launched with its id (the trace and NVTX ranges name it), and an event is recorded
after it when another lane waits for it — exactly the dependencies the validator checked and
the simulator costed, ``Transfer.after`` included. Nothing here waits: the host enqueues
everything, for the call's scope, then awaits the lanes' end events.

Across processes each rank launches its own devices' lanes. A data dependency is an event of
one device, always local; an ``after`` between senders on different ranks is not enforced (it
only orders NIC use, never data).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scheduler import COMPUTE, Op, StepGraph

if TYPE_CHECKING:
    from .backends import Backend, Event, OpReport
    from .scope import CancelScope

Bind = Callable[[Op, int], Callable[[], Any]]  # (op, device) -> that device's part of it


def launch(backend: Backend, graph: StepGraph, bind: Bind, scope: CancelScope,
           report: OpReport | None = None) -> list[Event]:
    """Enqueue this process's lanes of ``graph`` for ``scope`` (see module doc); returns each
    lane's end event. ``bind(op, device)`` makes the callable that runs ``op``'s part on
    ``device``; ``report``: what the streams report of each op to the call (its trace, an
    op that overran)."""
    events: dict[tuple[int, int], Event] = {}

    def event(op: int, device: int) -> Event:
        ev = events.get((op, device))
        if ev is None:
            ev = events[(op, device)] = backend.new_event(f"{graph.ops[op]} on device {device}")
        return ev

    recorded, labels = graph.recorded, graph.labels
    # What the caller launched before this call (its inputs, an optimizer step) comes first:
    # every lane starts with a wait on the caller's stream (a GPU's; nothing on the CPU).
    entry = backend.caller_events()
    ends = []
    for lane, ids in graph.lanes.items():
        d = lane.device
        if not backend.is_local(d):
            continue  # another process runs this lane
        stream = backend.stream(d, lane.stream)
        for ev in entry:
            stream.wait_event(ev, scope=scope)
        category = "compute" if lane.stream == COMPUTE else "comm"
        for i in ids:
            op = graph.ops[i]
            for dep in op.waits:
                if dep.dst == d and backend.is_local(dep.src):
                    stream.wait_event(event(dep.op, dep.src), scope=scope)
            stream.launch(f"{labels[i]} on device {d}", bind(op, d), category=category, op=i,
                          scope=scope, report=report)
            if (i, d) in recorded:
                stream.record(event=event(i, d), scope=scope)
        ends.append(stream.record(f"{lane} end", scope=scope))
    return ends
