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


# ---- split backward, several stages per rank, torch's format --------------------------------

from scheduler.schedules import (  # noqa: E402
    ALL_SCHEDULES,
    compute_only_time,
    interleaved_warmup,
)

UNIT = {"F": 1.0, "I": 1.0, "W": 1.0}  # F = I = W (a full B = 2)


def test_zb_h1_keeps_1f1b_peak_memory_and_cuts_the_bubble_to_a_third():
    for p in P_RANGE:
        for m in M_RANGE:
            zb = make_schedule("zb-h1", p, m)
            assert len(dependency_order(zb)) == 3 * m * p
            one = make_schedule("1f1b", p, m)
            # The same peak as 1f1b's largest (stage 0's), on every stage.
            assert [zb.peak_activations(s) for s in range(p)] == [min(m, p)] * p
            assert max(zb.peak_activations(s) for s in range(p)) == one.peak_activations(0)
            zb_bubble = compute_only_time(zb, UNIT)[0] - 3 * m
            one_bubble = compute_only_time(one, UNIT)[0] - 3 * m
            assert zb_bubble <= one_bubble, (p, m)
            if m >= p:  # (p - 1)(F + I - W) against (p - 1)(F + I + W)
                assert zb_bubble == pytest.approx((p - 1) * 1.0)
                assert one_bubble == pytest.approx((p - 1) * 3.0)


def test_interleaved_1f1b_places_stage_s_on_rank_s_mod_ranks_and_peaks_at_its_warmup():
    for ranks in range(1, 6):
        for v in (2, 3, 4):
            for m in range(ranks, 5 * ranks + 1, ranks):
                sched = make_schedule("interleaved-1f1b", ranks * v, m, stages_per_rank=v)
                assert sched.num_ranks == ranks
                assert [sched.rank_of(s) for s in range(ranks * v)] == [
                    s % ranks for s in range(ranks * v)]
                assert len(dependency_order(sched)) == 2 * m * ranks * v
                for r in range(ranks):
                    assert {a.stage for a in sched.actions[r]} == set(sched.stages_of(r))
                    assert sched.peak_rank_activations(r) == min(
                        m * v, interleaved_warmup(ranks, v, m, r) + 1)


def test_zbv_places_a_v_keeps_1f1b_peak_memory_and_cuts_zb_h1s_bubble():
    # 2r half-size stages on r ranks: the same model as 1f1b's r stages.
    for ranks in range(1, 9):
        for m in M_RANGE:
            zbv = make_schedule("zbv", 2 * ranks, m)
            assert (zbv.num_ranks, zbv.stages_per_rank, zbv.placement) == (ranks, 2, "v")
            for r in range(ranks):
                assert zbv.stages_of(r) == (r, 2 * ranks - 1 - r)
                assert {a.stage for a in zbv.actions[r]} == {r, 2 * ranks - 1 - r}
                assert zbv.peak_rank_activations(r) <= min(2 * m, 2 * ranks)
            assert max(map(zbv.peak_rank_activations, range(ranks))) == min(2 * m, 2 * ranks)
            assert len(dependency_order(zbv)) == 3 * m * 2 * ranks  # no deadlock
            bubble = compute_only_time(zbv, UNIT)[0] - 6 * m  # half stages: F = I = W = 1
            zb = compute_only_time(make_schedule("zb-h1", ranks, m),
                                   {"F": 2.0, "I": 2.0, "W": 2.0})[0] - 6 * m
            one = compute_only_time(make_schedule("1f1b", ranks, m),
                                    {"F": 2.0, "B": 4.0})[0] - 6 * m
            assert bubble <= zb <= one, (ranks, m)
            if m >= ranks:
                assert bubble <= ranks + 3 and (ranks == 1 or bubble <= 0.8 * zb), (ranks, m)


def test_interleaving_shrinks_the_bubble_of_1f1b():
    # 4 ranks, 8 stages of half the work each against 4 stages of 1f1b.
    inter = compute_only_time(make_schedule("interleaved-1f1b", 8, 8),
                              {"F": 0.5, "B": 1.0})
    one = compute_only_time(make_schedule("1f1b", 4, 8), {"F": 1.0, "B": 2.0})
    assert inter[0] < one[0] and inter[1] < one[1]


@pytest.mark.parametrize("args, kwargs, match", [
    (("interleaved-1f1b", 8, 6), {}, "num_microbatches: .* multiple"),
    (("interleaved-1f1b", 4, 4), {"stages_per_rank": 1}, "at least 2 stages per rank"),
    (("interleaved-1f1b", 9, 3), {"stages_per_rank": 2}, "num_stages: 9 stages"),
    (("1f1b", 4, 4), {"stages_per_rank": 2}, "stages_per_rank: 1f1b runs one stage"),
    (("zbv-unknown", 4, 4), {}, "unknown schedule"),
    (("zbv", 5, 4), {}, "num_stages: zbv .* 5 is odd"),
    (("zbv", 8, 4), {"stages_per_rank": 4}, "stages_per_rank: zbv runs two"),
])
def test_make_schedule_refuses_what_a_schedule_cannot_do(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_schedule(*args, **kwargs)


@pytest.mark.parametrize("rows, match", [
    ([[Action("F", 0), Action("W", 0), Action("I", 0)]], "W0 comes before I0"),
    ([[Action("F", 0), Action("I", 0), Action("B", 0)]], "B0 is one too many"),
    ([[Action("F", 0), Action("I", 0)]], "needs an F and a B \\(or an I and a W\\)"),
    ([[Action("F", 0, 1), Action("B", 0, 1)]], "on stage 1, which runs on rank"),
])
def test_split_backward_actions_are_checked(rows, match):
    with pytest.raises(ValueError, match=match):
        Schedule("x", 1, 1, tuple(tuple(r) for r in rows))


def test_several_stages_per_rank_need_the_stage_named():
    with pytest.raises(ValueError, match="names no stage"):
        Schedule("x", 2, 1, ((Action("F", 0), Action("B", 0)),), stages_per_rank=2)
    with pytest.raises(ValueError, match="'v' places two stages per rank"):
        Schedule("x", 3, 1, ((),), stages_per_rank=3, placement="v")


@pytest.mark.parametrize("name", ALL_SCHEDULES)
def test_text_json_and_torch_csv_round_trip(name):
    for p, m in ((2, 2), (4, 8), (6, 6)):
        sched = make_schedule(name, p, m)
        assert Schedule.from_json(sched.to_json()) == sched
        back = Schedule.from_text(sched.to_text(), name,
                                  stages_per_rank=sched.stages_per_rank,
                                  placement=sched.placement)
        assert back.actions == sched.actions
        csv = Schedule.from_torch_csv(sched.to_torch_csv(), name)
        assert csv.to_torch_csv() == sched.to_torch_csv()
        assert (csv.num_stages, csv.num_microbatches, csv.stages_per_rank) == (
            sched.num_stages, m, sched.stages_per_rank)


def test_torch_csv_cells_and_idle_steps():
    sched = make_schedule("zb-h1", 2, 2)
    assert sched.to_torch_csv().splitlines() == ["0F0,0F1,0I0,0W0,0I1,0W1",
                                            "1F0,1I0,1F1,1I1,1W0,1W1"]  # 1 W held back
    # torch writes idle steps as empty cells: skipped.
    text = "0F0,0F1,,0I0,0W0,0I1,0W1\r\n,1F0,1I0,1W0,1F1,1I1,1W1\r\n"
    assert Schedule.from_torch_csv(text).actions[0][2] == Action("I", 0, 0)


@pytest.mark.parametrize("text, match", [
    ("", "no ranks"),
    ("0F0,0SEND_F0,0B0\r\n", "cell 1: '0SEND_F0' is not a compute action"),
    ("F0,B0\r\n", "cell 0: 'F0' names no stage"),
    ("0F0,0B0\r\n0F0,0B0\r\n", "on stage 0, which runs on rank 0"),
])
def test_torch_csv_errors_name_the_cell(text, match):
    with pytest.raises(ValueError, match=match):
        Schedule.from_torch_csv(text)


def test_a_deadlock_across_ranks_names_each_ranks_blocker():
    # Rank 0 wants stage 0's gradient before running stage 4, which that gradient comes from.
    text = "0F0,0B0,4F0,4B0\r\n1F0,5F0,5B0,1B0\r\n2F0,6F0,6B0,2B0\r\n3F0,7F0,7B0,3B0\r\n"
    sched = Schedule.from_torch_csv(text)
    with pytest.raises(ValueError, match="schedule deadlocks: rank 0 at 0B0 waits for B0 of "
                                         "stage 1; rank 1 at 5F0 waits for F0 of stage 4"):
        dependency_order(sched)


# ---- forward-only schedules (evaluation steps) -----------------------------------------------

@pytest.mark.parametrize("name, p", [("1f1b", 4), ("eager-1f1b", 3), ("zb-h1", 4),
                                     ("interleaved-1f1b", 4), ("zbv", 4)])
def test_forward_order_keeps_each_ranks_forwards_in_order(name, p):
    full = make_schedule(name, p, 6)
    fwd = full.forward_order()
    assert fwd.forward_only and fwd.kinds == {"F"} and fwd.name == f"{name}/forward"
    for r in range(full.num_ranks):
        assert fwd.actions[r] == tuple(a for a in full.actions[r] if a.kind == "F")
    assert fwd.forward_order() is fwd
    assert Schedule.from_json(fwd.to_json()) == fwd
    assert [a for _, a in dependency_order(fwd)]  # (it lowers: no deadlock)
    assert all(fwd.peak_activations(s) == 6 for s in range(full.num_stages))


def test_a_forward_only_schedule_takes_forwards_alone_once_each():
    Schedule("eval", 2, 2, (acts("F0 F1"), acts("F0 F1")), forward_only=True)
    with pytest.raises(ValueError, match=r"actions\[0\]: 0B0 in a forward-only schedule"):
        Schedule("eval", 1, 1, (acts("F0 B0"),), forward_only=True)
    with pytest.raises(ValueError, match=r"microbatch 1 of stage 0 needs one F"):
        Schedule("eval", 1, 2, (acts("F0"),), forward_only=True)
    with pytest.raises(ValueError, match=r"needs an F and a B"):  # (a training schedule)
        Schedule("train", 1, 1, (acts("F0"),))
    with pytest.raises(TypeError, match=r"forward_only: expected a bool"):
        Schedule("eval", 1, 1, (acts("F0"),), forward_only=1)
