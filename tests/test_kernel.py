"""The event kernel (scheduler/kernel.py): SimPy's ordering — time, then priority, then the
order events were scheduled — and nothing scheduled is lost."""

from __future__ import annotations

import pytest

from scheduler.kernel import Kernel


def test_events_run_in_time_then_priority_then_insertion_order():
    k = Kernel()
    for time, prio, name in [(2.0, 0, "c"), (1.0, 1, "b2"), (1.0, 0, "b1"), (1.0, 1, "b3"),
                             (0.5, 9, "a")]:
        k.schedule(time, name, prio)
    seen = []
    k.run(lambda count, event: seen.append((k.now, event)))
    assert seen == [(0.5, "a"), (1.0, "b1"), (1.0, "b2"), (1.0, "b3"), (2.0, "c")]
    assert k.processed == 5 and len(k) == 0


def test_handlers_schedule_more_and_counts_name_each_scheduling():
    k = Kernel()
    first = k.schedule(1.0, "tick")
    assert k.schedule(1.0, "tock") == first + 1
    seen = []

    def handle(count, event):
        seen.append((k.now, event, count))
        if event == "tick" and k.now < 3:
            k.schedule(k.now + 1.0, "tick")

    k.run(handle)
    assert [(t, e) for t, e, _ in seen] == [(1.0, "tick"), (1.0, "tock"), (2.0, "tick"),
                                           (3.0, "tick")]
    assert len({c for _, _, c in seen}) == 4


def test_peek_and_pop_and_the_past_is_refused():
    k = Kernel()
    assert k.peek() is None
    k.schedule(3.0, "x", 2)
    assert k.peek() == (3.0, 2, 0, "x")
    assert k.pop() == (3.0, 2, 0, "x") and k.now == 3.0
    with pytest.raises(ValueError, match="time"):
        k.schedule(2.5, "late")
