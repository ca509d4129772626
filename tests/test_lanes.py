"""Lanes: a resharding's transfers spread over several comm streams per device
(``Transfer.lane``), so a device that receives many small pieces pays their latencies at once.
The plan value, its check, the cost model, the planner's choice, and the runtime running
them (one process here; across processes in test_mpi's hypothesis reshardings)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from overlap import Runtime
from scheduler import (
    Cluster,
    DeviceMesh,
    P,
    PlanOptions,
    ReshardPlan,
    Sharding,
    ShardingSpec,
    StepGraph,
    Transfer,
    estimate,
    lower_bound,
    paper_model_time,
    plan_resharding,
    reshard_graph,
    validate,
)
from scheduler.errors import PlanError

# Slow, high-latency links: 4 senders, one receiver needing a piece from each.
SLOW = Cluster(5, 1, nic_gbps=1.0, nic_latency_us=400.0)
GATHER_SRC = Sharding(DeviceMesh([0, 1, 2, 3], "x"), ShardingSpec("x"))
GATHER_DST = Sharding(DeviceMesh([4], "x"), ShardingSpec())


def gather_plan(lanes: bool) -> ReshardPlan:
    plan = plan_resharding((64, 16), "float32", GATHER_SRC, GATHER_DST, SLOW,
                           PlanOptions(balance="none"))
    assert len(plan.transfers) == 4 and {t.receivers for t in plan.transfers} == {(4,)}
    if not lanes:
        return plan
    return dataclasses.replace(plan, transfers=tuple(
        dataclasses.replace(t, lane=k) for k, t in enumerate(plan.transfers)))


def relay_plan(first_lane: int, second_lane: int, after: tuple[int, ...] = ()) -> ReshardPlan:
    """Device 0 sends the tensor to 1, which forwards it to 2."""
    src = Sharding(DeviceMesh([0], "x"), ShardingSpec())
    dst = Sharding(DeviceMesh([1, 2], "x"), ShardingSpec())
    region = ((0, 8),)
    return ReshardPlan((8,), "float32", src, dst, (
        Transfer(region, 0, (1,), 32, lane=first_lane),
        Transfer(region, 1, (2,), 32, after, lane=second_lane),
    ), "send_recv", "none")


def test_a_lane_round_trips_through_json_and_shows_in_text():
    plan = gather_plan(lanes=True)
    again = ReshardPlan.from_json(plan.to_json())
    assert again == plan and [t.lane for t in again.transfers] == [0, 1, 2, 3]
    assert "lane 3" in str(plan.transfers[3]) and "lane" not in str(plan.transfers[0])
    assert "lane" not in json.loads(plan.to_json())["transfers"][0]  # lane 0: as before


@pytest.mark.parametrize("lanes, after, ok", [
    ((0, 0), (), True),    # one FIFO: the forward runs after what it forwards
    ((1, 1), (), True),
    ((1, 0), (0,), True),  # another lane, but it waits for it
    ((1, 0), (), False),   # another lane, nothing orders them: it could read nothing yet
    ((0, 2), (), False),
])
def test_a_forward_on_another_lane_must_wait_for_what_it_forwards(lanes, after, ok):
    plan = relay_plan(*lanes, after)
    if ok:
        plan.check()
    else:
        with pytest.raises(PlanError, match=f"sender 1 forwards what transfer 0 brought it on "
                                            f"lane {lanes[0]}, but runs on lane {lanes[1]}"):
            plan.check()


@pytest.mark.parametrize("lane", [-1, 1.5, True])
def test_a_bad_lane_is_refused_by_the_check(lane):
    plan = relay_plan(0, 0)
    bad = dataclasses.replace(plan, transfers=(dataclasses.replace(plan.transfers[0], lane=lane),
                                               plan.transfers[1]))
    with pytest.raises(PlanError, match="lane must be an int >= 0"):
        bad.check()


def test_lanes_pay_a_receivers_latencies_at_once_in_the_cost_model():
    one, four = gather_plan(lanes=False), gather_plan(lanes=True)
    one.check()
    four.check()
    t_one, t_four = estimate(one, SLOW), estimate(four, SLOW)
    latency = SLOW.nic_latency_s
    # One lane: four latencies in a row; four lanes: the bytes share the NIC, one latency.
    assert t_one - t_four >= 3 * latency * 0.99
    assert t_four <= lower_bound((64, 16), "float32", GATHER_SRC, GATHER_DST, SLOW) * 1.01
    # The paper's sequential model does not see lanes: a host takes part in one transfer at
    # a time either way.
    assert paper_model_time(four, SLOW) == pytest.approx(paper_model_time(one, SLOW))


def test_each_lane_is_a_stream_of_its_own_in_the_step_graph():
    graph = reshard_graph(gather_plan(lanes=True))
    validate(graph)
    assert {lane.stream for lane in graph.lanes if lane.device == 4} == {
        "comm", "comm.1", "comm.2", "comm.3"}
    assert StepGraph.from_json(graph.to_json()) == graph  # the lanes survive a round trip


def test_the_planner_uses_lanes_where_latencies_dominate():
    # 8 sources x 8 destinations, every destination needs a small piece of every source.
    cluster = Cluster(4, 4, nic_gbps=10.0, nic_latency_us=100.0)
    src = Sharding(cluster.mesh([0, 1]), P(("host", "gpu"), None))
    dst = Sharding(cluster.mesh([2, 3]), P(None, ("host", "gpu")))
    plan = plan_resharding((64, 64), "float32", src, dst, cluster)
    plan.check()
    assert "lanes" in plan.stats["auto_choice"]
    assert max(t.lane for t in plan.transfers) > 0
    bound = lower_bound((64, 64), "float32", src, dst, cluster)
    unlaned = dataclasses.replace(plan, transfers=tuple(
        dataclasses.replace(t, lane=0) for t in plan.transfers))
    assert estimate(plan, cluster) < estimate(unlaned, cluster)
    assert max(estimate(plan, cluster), paper_model_time(plan, cluster)) <= 1.10 * bound


@pytest.mark.parametrize("emulate", [False, True])
def test_a_laned_plan_runs_and_delivers_on_the_cpu_backend(emulate):
    plan = gather_plan(lanes=True)
    glob = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    shards = {d: glob[r[0][0]:r[0][1]].copy()
              for d, r in GATHER_SRC.device_regions((64, 16)).items()}
    with Runtime(SLOW, emulate_links=emulate) as rt:
        out = rt.reshard_sync(plan, shards, trace=True)
        streams = {sp.stream for sp in rt.timeline().spans if sp.device == 4}
    np.testing.assert_array_equal(out[4], glob)
    assert streams == {"comm", "comm.1", "comm.2", "comm.3"}


def test_a_pipeline_with_laned_plans_trains_like_the_unlaned_one():
    from toy_mlp import CLUSTER, ToyMLP

    from scheduler import lower, make_schedule

    results = []
    for laned in (False, True):
        toy = ToyMLP()
        sched = make_schedule("1f1b", 4, 4)
        base = lower(toy.meshes, toy.boundaries, sched, CLUSTER)
        plans = {}
        for channel, plan in base.plans.items():
            # Laned: the transfers that cross devices over three lanes; else all on lane 0.
            plans[channel] = dataclasses.replace(plan, transfers=tuple(
                dataclasses.replace(t, lane=k % 3 + 1 if laned and not t.is_local_copy else 0)
                for k, t in enumerate(plan.transfers)))
        graph = lower(toy.meshes, toy.boundaries, sched, CLUSTER, plans=plans)
        validate(graph)
        assert any("." in lane.stream for lane in graph.lanes) == laned
        with Runtime(CLUSTER) as rt:
            losses = rt.train_step_sync(toy.stages, toy.boundaries, toy.microbatches(4),
                                        input_sharding=toy.input_sharding, graph=graph)
        results.append((losses, {k: v.copy() for k, v in toy.grads.items()}))
    (l0, g0), (l1, g1) = results
    assert l0 == l1 and sorted(g0) == sorted(g1)
    for k in g0:
        np.testing.assert_array_equal(g0[k], g1[k])


def test_a_sender_that_holds_the_region_itself_needs_no_wait_across_lanes():
    # Device 1 holds the tensor in the source layout and also receives it (on lane 1): it
    # sends from its own shard (as the runtime does), so its lane-0 send waits for nothing.
    src = Sharding(DeviceMesh([0, 1], "x"), ShardingSpec())
    dst = Sharding(DeviceMesh([1, 2], "x"), ShardingSpec())
    region = ((0, 8),)
    plan = ReshardPlan((8,), "float32", src, dst, (
        Transfer(region, 0, (1,), 32, lane=1),
        Transfer(region, 1, (2,), 32),
    ), "send_recv", "none")
    plan.check()
    glob = np.arange(8, dtype=np.float32)
    with Runtime(Cluster(3, 1, nic_gbps=10.0)) as rt:
        out = rt.reshard_sync(plan, {0: glob.copy(), 1: glob.copy()})
    for d in (1, 2):
        np.testing.assert_array_equal(out[d], glob)


def test_a_forward_must_also_wait_for_its_senders_own_local_copy_on_another_lane():
    # Device 0 holds half the tensor and forwards all of it: the half it copies locally into
    # its destination buffer (lane 1) must land first (found by review: it was not checked).
    src = Sharding(DeviceMesh([0, 1], "x"), ShardingSpec("x"))
    dst = Sharding(DeviceMesh([0, 2], "x"), ShardingSpec())
    lo, hi, whole = ((0, 4),), ((4, 8),), ((0, 8),)
    transfers = [Transfer(lo, 0, (0,), 16, lane=1), Transfer(hi, 1, (0,), 16),
                 Transfer(whole, 0, (2,), 32)]
    plan = ReshardPlan((8,), "float32", src, dst, tuple(transfers), "send_recv", "none")
    with pytest.raises(PlanError, match="forwards what transfer 0 brought it on lane 1"):
        plan.check()
    transfers[2] = dataclasses.replace(transfers[2], after=(0,))
    dataclasses.replace(plan, transfers=tuple(transfers)).check()


def test_stream_names_that_look_like_a_lane_are_refused():
    with pytest.raises(ValueError, match="ends like a lane's stream"):
        reshard_graph(gather_plan(lanes=False), "comm.1")


def test_two_lanes_of_one_device_make_its_receive_buffer_once(monkeypatch):
    # Each lane is a thread; two of one device may ask for the (channel, microbatch) buffer
    # first at once. A slow allocation (a device allocator can release the GIL) widens that
    # window: a second buffer would lose what landed in the first (found by review).
    import time as _time

    from toy_mlp import CLUSTER, ToyMLP

    from scheduler import lower, make_schedule

    empty = np.empty

    def run(slow: bool) -> list[float]:
        toy = ToyMLP()
        sched = make_schedule("1f1b", 4, 4)
        base = lower(toy.meshes, toy.boundaries, sched, CLUSTER)
        plans = {ch: dataclasses.replace(plan, transfers=tuple(
            dataclasses.replace(t, lane=0 if t.is_local_copy else k % 3 + 1)
            for k, t in enumerate(plan.transfers))) for ch, plan in base.plans.items()}
        graph = lower(toy.meshes, toy.boundaries, sched, CLUSTER, plans=plans)
        with Runtime(CLUSTER) as rt:
            if slow:
                monkeypatch.setattr(rt.backend.xp, "empty",
                                    lambda *a, **k: (_time.sleep(0.005), empty(*a, **k))[1])
            return rt.train_step_sync(toy.stages, toy.boundaries, toy.microbatches(4),
                                      input_sharding=toy.input_sharding, graph=graph)

    want = run(slow=False)
    for _ in range(3):
        assert run(slow=True) == want
