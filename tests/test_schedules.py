"""Pipeline schedules (scheduler/schedules.py) against their documented shape.

Every schedule is a warm-up of W(s) forwards, then B/F alternating, then the remaining
backwards, with W = m (gpipe), min(m, p - s) (1f1b), min(m, 2(p - s) - 1) (eager-1f1b); the
peak number of live activations of stage s is exactly W(s). Dependencies: F(s, i) needs
F(s - 1, i); B(s, i) needs B(s + 1, i).
"""

from __future__ import annotations

import json

import pytest

from scheduler.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    dependency_order,
    make_schedule,
)

P_RANGE = range(1, 9)
M_RANGE = range(1, 33)


def expected_warmup(name: str, p: int, m: int, s: int) -> int:
    if name == "gpipe":
        return m
    if name == "1f1b":
        return min(m, p - s)
    assert name == "eager-1f1b"
    return min(m, 2 * (p - s) - 1)


def all_schedules():
    for name in SCHEDULES:
        for p in P_RANGE:
            for m in M_RANGE:
                yield name, p, m, make_schedule(name, p, m)


def test_schedule_names():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "eager-1f1b"}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b"])
def test_every_microbatch_once_forward_before_backward(name):
    for p in P_RANGE:
        for m in M_RANGE:
            sched = make_schedule(name, p, m)
            assert sched.name == name
            assert (sched.num_stages, sched.num_microbatches) == (p, m)
            assert len(sched.actions) == p
            for s, acts in enumerate(sched.actions):
                assert len(acts) == 2 * m, (name, p, m, s)
                fs = [a.microbatch for a in acts if a.kind == "F"]
                bs = [a.microbatch for a in acts if a.kind == "B"]
                assert sorted(fs) == list(range(m)), (name, p, m, s)
                assert sorted(bs) == list(range(m)), (name, p, m, s)
                for i in range(m):
                    assert acts.index(Action("F", i)) < acts.index(Action("B", i))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b"])
def test_documented_shape_warmup_then_alternate(name):
    for p in P_RANGE:
        for m in M_RANGE:
            sched = make_schedule(name, p, m)
            for s, acts in enumerate(sched.actions):
                w = expected_warmup(name, p, m, s)
                kinds = "".join(a.kind for a in acts)
                # W forwards, then (B F) while forwards remain, then the remaining backwards.
                assert kinds == "F" * w + "BF" * (m - w) + "B" * w, (name, p, m, s)
                # Microbatches run in increasing order within each kind.
                assert [a.microbatch for a in acts if a.kind == "F"] == list(range(m))
                assert [a.microbatch for a in acts if a.kind == "B"] == list(range(m))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b"])
def test_peak_activations_formula(name):
    for p in P_RANGE:
        for m in M_RANGE:
            sched = make_schedule(name, p, m)
            for s in range(p):
                assert sched.peak_activations(s) == expected_warmup(name, p, m, s), (p, m, s)


def test_peak_activations_spot_values():
    # Worked by hand: p=4, m=8.
    assert [make_schedule("gpipe", 4, 8).peak_activations(s) for s in range(4)] == [8] * 4
    assert [make_schedule("1f1b", 4, 8).peak_activations(s) for s in range(4)] == [4, 3, 2, 1]
    assert [make_schedule("eager-1f1b", 4, 8).peak_activations(s) for s in range(4)] == [
        7, 5, 3, 1,
    ]
    # m < p caps the warm-up.
    assert [make_schedule("eager-1f1b", 4, 2).peak_activations(s) for s in range(4)] == [
        2, 2, 2, 1,
    ]


def test_peak_activations_bad_stage():
    sched = make_schedule("1f1b", 3, 4)
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="stage"):
            sched.peak_activations(bad)


def test_dependency_order_respects_dependencies():
    for name, p, m, sched in all_schedules():
        order = dependency_order(sched)
        assert len(order) == 2 * p * m
        assert len(set(order)) == len(order)
        pos = {sa: i for i, sa in enumerate(order)}
        for s in range(p):
            # Each stage's actions appear in its own schedule order.
            assert [a for st, a in order if st == s] == list(sched.actions[s])
            for i in range(m):
                f, b = Action("F", i), Action("B", i)
                if s + 1 < p:
                    assert pos[(s, f)] < pos[(s + 1, f)], (name, p, m, s, i)
                    assert pos[(s + 1, b)] < pos[(s, b)], (name, p, m, s, i)
                assert pos[(s, f)] < pos[(s, b)]


def test_dependency_order_small_case_by_hand():
    # 1f1b, p=2, m=2: s0 = F0 F1 B0 B1, s1 = F0 B0 F1 B1; rounds advance every ready stage.
    order = dependency_order(make_schedule("1f1b", 2, 2))
    F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    assert order == [
        (0, F(0)),
        (0, F(1)), (1, F(0)),
        (1, B(0)),
        (0, B(0)), (1, F(1)),
        (1, B(1)),
        (0, B(1)),
    ]


def test_text_round_trip():
    for name, _p, _m, sched in all_schedules():
        text = sched.to_text()
        back = Schedule.from_text(text, name=name)
        assert back == sched
        assert back.to_text() == text


def test_text_format():
    sched = make_schedule("1f1b", 2, 2)
    assert sched.to_text() == "s0: F0 F1 B0 B1\ns1: F0 B0 F1 B1"
    assert Schedule.from_text("s0: F0 B0").name == "custom"


def test_json_round_trip():
    for _name, _p, _m, sched in all_schedules():
        text = sched.to_json()
        data = json.loads(text)
        assert data["name"] == sched.name
        assert data["num_stages"] == sched.num_stages
        assert data["num_microbatches"] == sched.num_microbatches
        back = Schedule.from_json(text)
        assert back == sched
        assert Schedule.from_json(text.encode()) == sched


@pytest.mark.parametrize(
    ("args", "exc", "word"),
    [
        (("zigzag", 2, 2), ValueError, "name"),
        (("GPipe", 2, 2), ValueError, "name"),
        (("gpipe", 0, 2), ValueError, "num_stages"),
        (("1f1b", -1, 2), ValueError, "num_stages"),
        (("1f1b", 2, 0), ValueError, "num_microbatches"),
        (("eager-1f1b", 2, -3), ValueError, "num_microbatches"),
        (("gpipe", 2.0, 2), TypeError, "num_stages"),
        (("gpipe", "2", 2), TypeError, "num_stages"),
        (("gpipe", True, 2), TypeError, "num_stages"),
        (("1f1b", 2, 2.5), TypeError, "num_microbatches"),
        (("1f1b", 2, True), TypeError, "num_microbatches"),
        (("1f1b", 2, None), TypeError, "num_microbatches"),
    ],
)
def test_make_schedule_bad_arguments(args, exc, word):
    with pytest.raises(exc, match=word):
        make_schedule(*args)


def acts(text: str) -> tuple[Action, ...]:
    return tuple(Action.parse(t) for t in text.split())


def test_schedule_rejects_missing_backward():
    with pytest.raises(ValueError, match=r"actions\[1\]"):
        Schedule("custom", 2, 2, (acts("F0 F1 B0 B1"), acts("F0 F1 B0")))


def test_schedule_rejects_duplicate_action():
    with pytest.raises(ValueError, match=r"actions\[0\]"):
        Schedule("custom", 1, 2, (acts("F0 F1 B0 B0"),))


def test_schedule_rejects_backward_before_forward():
    with pytest.raises(ValueError, match=r"actions\[0\].*B1"):
        Schedule("custom", 2, 2, (acts("F0 B1 F1 B0"), acts("F0 B0 F1 B1")))


def test_schedule_rejects_wrong_stage_count():
    with pytest.raises(ValueError, match="actions"):
        Schedule("custom", 3, 1, (acts("F0 B0"), acts("F0 B0")))


def test_schedule_rejects_bad_counts():
    with pytest.raises(ValueError, match="num_stages"):
        Schedule("custom", 0, 1, ())
    with pytest.raises(TypeError, match="num_microbatches"):
        Schedule("custom", 1, True, (acts("F0 B0"),))


def test_from_text_rejects_bad_lines():
    with pytest.raises(ValueError, match="s1"):
        Schedule.from_text("s0: F0 B0\ns2: F0 B0")
    with pytest.raises(ValueError, match="action"):
        Schedule.from_text("s0: F0 X0")
    with pytest.raises(ValueError, match="text"):
        Schedule.from_text("  \n ")


def test_action_validation():
    with pytest.raises(ValueError, match="kind"):
        Action("X", 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="microbatch"):
        Action("F", True)
    with pytest.raises(ValueError, match="microbatch"):
        Action("F", -1)
    assert str(Action("B", 12)) == "B12"
    assert Action.parse(" F7 ") == Action("F", 7)


def test_deadlocking_schedule_is_reported():
    # Stage 0 runs B0 before F1, so it waits for B0 of stage 1; stage 1 runs F1 before B0,
    # so it waits for F1 of stage 0: neither can advance after their F0.
    sched = Schedule.from_text("s0: F0 B0 F1 B1\ns1: F0 F1 B0 B1")
    assert sched.num_microbatches == 2
    with pytest.raises(ValueError, match="deadlock") as info:
        dependency_order(sched)
    msg = str(info.value)
    assert "stage 0" in msg and "stage 1" in msg
    assert "B0" in msg and "F1" in msg


def test_deadlock_three_stages():
    # Stage 1 waits for B0 of stage 2 before running F1; stage 2 needs F1 of stage 1 first.
    text = "s0: F0 F1 B0 B1\ns1: F0 B0 F1 B1\ns2: F0 F1 B0 B1"
    with pytest.raises(ValueError, match="deadlock") as info:
        dependency_order(Schedule.from_text(text))
    assert "stage 1" in str(info.value) and "stage 2" in str(info.value)


def test_hand_written_out_of_order_schedules():
    # Legal: stage 1 takes mb1 first; stage 0's B1 waits until stage 1's B1 (its last action).
    sched = Schedule.from_text("s0: F0 F1 B1 B0\ns1: F1 F0 B0 B1")
    order = dependency_order(sched)
    assert order[-2:] == [(0, Action("B", 1)), (0, Action("B", 0))]
    # Deadlock: stage 0 waits at B0 for stage 1's B0; stage 1 waits at F1 for stage 0's F1.
    with pytest.raises(ValueError, match="deadlock") as info:
        dependency_order(Schedule.from_text("s0: F0 B0 F1 B1\ns1: F1 B1 F0 B0"))
    assert "stage 0" in str(info.value) and "stage 1" in str(info.value)
