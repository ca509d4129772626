"""schedule "auto" (scheduler/auto.py): comm-aware lists and the choice among candidates, in
simulation; the figures it is compared with come from the same simulator, never typed in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from toy import ToyMLP

from scheduler import (
    Boundary,
    Cluster,
    P,
    PlanOptions,
    Sharding,
    estimate,
    lower,
    make_schedule,
    plan_resharding,
    simulate,
)
from scheduler.auto import auto_schedule, comm_aware_actions
from scheduler.schedules import SCHEDULES, Schedule, dependency_order

CLUSTER = Cluster.preset("p3.8xlarge", 4)
COSTS = {"F": 1e-3, "I": 1e-3, "W": 1e-3, "B": 2e-3}


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), split=st.booleans(),
       xfer=st.floats(0.0, 3.0), extra=st.integers(0, 6), data=st.data())
def test_comm_aware_lists_are_valid_deadlock_free_and_within_their_caps(p, m, split, xfer,
                                                                        extra, data):
    caps = [data.draw(st.integers(1, p - s + extra)) for s in range(p)]
    dur = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    acts = comm_aware_actions(p, m, lambda s, k: dur[k], [xfer] * (p - 1), [xfer] * (p - 1),
                              caps, split)
    sched = Schedule("x", p, m, acts)  # checks every rank's list
    assert len(dependency_order(sched)) == sum(map(len, acts))
    assert sched.kinds == (frozenset("FIW") if split else frozenset("FB"))
    for s in range(p):
        assert sched.peak_activations(s) <= caps[s]


@pytest.mark.parametrize("strategy", ["broadcast", "send_recv"])
@pytest.mark.parametrize("cap", [None, 2, 4])
def test_auto_is_never_slower_than_a_fixed_schedule_that_fits_the_same_memory(strategy, cap):
    model = ToyMLP.build(CLUSTER, hidden=512, batch=256)  # transfers about one W each
    options = PlanOptions(strategy=strategy)
    choice = auto_schedule(model.meshes, model.boundaries(), 8, CLUSTER, COSTS, options,
                           max_activations=cap)
    assert choice.seconds == simulate(choice.graph, CLUSTER, COSTS).iteration_time
    for s in range(4):
        assert cap is None or choice.schedule.peak_activations(s) <= cap
    for name in (*SCHEDULES, "zb-h1"):
        sched = make_schedule(name, 4, 8)
        if cap is not None and any(sched.peak_activations(s) > cap for s in range(4)):
            continue
        graph = lower(model.meshes, model.boundaries(), sched, CLUSTER, options)
        assert choice.seconds <= simulate(graph, CLUSTER, COSTS).iteration_time * (1 + 1e-9)


def test_auto_hides_transfers_a_fixed_1f1b_exposes():
    # With transfers about as long as a W, auto (split backward, a little more warm-up) beats
    # every fixed schedule in simulation, and its compute waits less for transfers than 1f1b's.
    model = ToyMLP.build(CLUSTER, hidden=512, batch=256)
    options = PlanOptions(strategy="broadcast")
    choice = auto_schedule(model.meshes, model.boundaries(), 16, CLUSTER, COSTS, options)
    fixed = {n: simulate(lower(model.meshes, model.boundaries(), make_schedule(n, 4, 16),
                               CLUSTER, options), CLUSTER, COSTS)
             for n in (*SCHEDULES, "zb-h1")}
    assert choice.seconds < min(tl.iteration_time for tl in fixed.values())
    tl = simulate(choice.graph, CLUSTER, COSTS)
    assert tl.wait_fraction("bwd") < fixed["1f1b"].wait_fraction("bwd")
    assert tl.transfer_wait_fraction < fixed["1f1b"].transfer_wait_fraction
    assert "I" in choice.schedule.kinds


def test_without_split_costs_auto_keeps_the_full_backward():
    model = ToyMLP.build(CLUSTER, hidden=64, batch=16)
    choice = auto_schedule(model.meshes, model.boundaries(), 6, CLUSTER,
                           {"F": 1e-3, "B": 2e-3})
    assert choice.schedule.kinds == frozenset("FB")


@pytest.mark.parametrize("cap, exc, match", [
    (0, ValueError, "max_activations: stage 0 allows 0 microbatches, but every schedule keeps "
                    "at least 1"),
    ([2, 2, 0, 2], ValueError, "stage 2 allows 0"),
    ([2, 2], ValueError, "2 caps for 4 stages"),
    ([2, 2, 2.5, 2], TypeError, "stage 2's cap 2.5"),
])
def test_a_cap_nothing_can_meet_is_refused_naming_the_stage(cap, exc, match):
    model = ToyMLP.build(CLUSTER, hidden=8, batch=4)
    with pytest.raises(exc, match=match):
        auto_schedule(model.meshes, model.boundaries(), 4, CLUSTER, COSTS,
                      max_activations=cap)


def _chain(p: int):
    cluster = Cluster.preset("p3.8xlarge", p)
    meshes = [cluster.mesh([h]) for h in range(p)]
    boundaries = [Boundary((1024, 4096), "float16", Sharding(meshes[s], P()),
                           Sharding(meshes[s + 1], P())) for s in range(p - 1)]
    seconds = estimate(plan_resharding(boundaries[0].shape, boundaries[0].dtype,
                                       boundaries[0].producer, boundaries[0].consumer, cluster,
                                       PlanOptions(strategy="broadcast")), cluster)
    return cluster, meshes, boundaries, seconds


def _waited_bwd(schedule, cluster, meshes, boundaries, costs) -> tuple[float, float]:
    graph = lower(meshes, boundaries, schedule, cluster, PlanOptions(strategy="broadcast"))
    tl = simulate(graph, cluster, costs)
    return sum(tl.transfer_wait(d, "bwd") for d in graph.devices), tl.iteration_time


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("ratio", [0.3, 0.45, 0.6, 0.8])
def test_zb_h1_hides_gradient_transfers_when_they_take_at_most_half_a_w(p, ratio):
    # At zb-h1's memory (p activations on stage 0, each held from its F to its W) a microbatch
    # holds a slot of stage 0 for at least H = p·F + p·I + W + 2(p − 1)·T, and stage 0 starts
    # one every F + I + W in a compute-bound steady state: p slots hold that rate only while
    # 2(p − 1)·T ≤ (p − 1)·W, i.e. T ≤ W / 2, for every p. Below it, gradient waits come only
    # from the ramps (the same for 8 more microbatches); above it, they grow with every
    # microbatch — and no list within zb-h1's memory (auto with max_activations=p) beats
    # m·H / p.
    cluster, meshes, boundaries, t = _chain(p)
    w = t / ratio
    costs = {"F": w, "I": w, "W": w, "B": 2 * w}
    m = 2 * p + 4
    short = _waited_bwd(make_schedule("zb-h1", p, m), cluster, meshes, boundaries, costs)
    long = _waited_bwd(make_schedule("zb-h1", p, m + 8), cluster, meshes, boundaries, costs)
    if ratio <= 0.5:
        assert long[0] == pytest.approx(short[0], rel=1e-6)
        assert long[1] - short[1] == pytest.approx(8 * 3 * w, rel=1e-6)
    else:
        assert long[0] - short[0] > 8 * 0.5 * (2 * t - w)  # at least half the shortfall each
        hold = 2 * p * w + w + 2 * (p - 1) * t
        for mb in (m, m + 8):
            choice = auto_schedule(meshes, boundaries, mb, cluster, costs,
                                   PlanOptions(strategy="broadcast"), max_activations=p)
            assert choice.seconds >= mb * hold / p
