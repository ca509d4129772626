"""Property tests: every plan, for every strategy and balance, really moves the tensor.

Correctness is checked twice: by ``ReshardPlan.check()`` and, independently of it, by painting
numpy arrays — each source device starts with its shard of ``arange(size).reshape(shape)``,
the transfers are replayed in plan order, and every destination device must end with exactly
its destination region, each element delivered once.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from strategies import problems

from scheduler import (
    BALANCES,
    STRATEGIES,
    Cluster,
    DeviceMesh,
    PlanOptions,
    ReshardPlan,
    Sharding,
    ShardingSpec,
    estimate,
    lower_bound,
    plan_resharding,
)

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---- the independent replay ---------------------------------------------------------------


def _slices(region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def paint(plan: ReshardPlan, shape, src: Sharding, dst: Sharding) -> None:
    """Replay ``plan`` on real arrays; assert it delivers every destination shard exactly."""
    size = math.prod(shape)
    glob = np.arange(size, dtype=np.int64).reshape(shape)
    src_regions = src.device_regions(shape)
    dst_regions = dst.device_regions(shape)
    itemsize = np.dtype(plan.dtype).itemsize
    # What each device holds (values, mask): its source shard plus everything it received.
    held: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def state(dev: int):
        if dev not in held:
            vals = np.full(shape, -1, dtype=np.int64)
            mask = np.zeros(shape, dtype=bool)
            if dev in src_regions:
                sl = _slices(src_regions[dev])
                vals[sl] = glob[sl]
                mask[sl] = True
            held[dev] = (vals, mask)
        return held[dev]

    out = {d: np.full(shape, -1, dtype=np.int64) for d in dst_regions}
    count = {d: np.zeros(shape, dtype=np.int64) for d in dst_regions}
    for i, t in enumerate(plan.transfers):
        where = f"transfer {i} ({t})"
        assert all(0 <= j < i for j in t.after), f"{where}: 'after' names a later transfer"
        assert len(t.region) == len(shape), where
        assert all(0 <= a < b <= n for (a, b), n in zip(t.region, shape)), (
            f"{where}: empty region or outside shape {shape}"
        )
        vol = math.prod(b - a for a, b in t.region)
        assert t.nbytes == vol * itemsize, where
        assert t.receivers, f"{where}: no receivers"
        assert len(set(t.receivers)) == len(t.receivers), f"{where}: repeated receiver"
        assert t.is_local_copy or t.sender not in t.receivers, where
        sl = _slices(t.region)
        vals, mask = state(t.sender)
        assert mask[sl].all(), f"{where}: sender {t.sender} does not hold the whole region"
        data = vals[sl].copy()
        for r in t.receivers:
            assert r in dst_regions, f"{where}: receiver {r} is not a destination device"
            out[r][sl] = data
            count[r][sl] += 1
            if r != t.sender:
                rv, rm = state(r)
                rv[sl] = data
                rm[sl] = True
    for d, region in dst_regions.items():
        want = np.zeros(shape, dtype=np.int64)
        want[_slices(region)] = 1
        bad = count[d] != want
        assert not bad.any(), (
            f"device {d}: destination region {region}: {int((count[d] == 0)[want == 1].sum())} "
            f"element(s) missing, {int((count[d] > 1).sum())} delivered more than once, "
            f"{int((count[d] > 0)[want == 0].sum())} outside its region"
        )
        sl = _slices(region)
        np.testing.assert_array_equal(out[d][sl], glob[sl], err_msg=f"device {d}: wrong values")


# ---- properties ---------------------------------------------------------------------------


@SETTINGS
@given(problems())
def test_every_plan_is_correct_and_above_lower_bound(problem):
    shape, dtype, src, dst, cluster = problem
    lb = lower_bound(shape, dtype, src, dst, cluster)
    assert lb >= 0.0
    for strategy in STRATEGIES:
        for balance in BALANCES:
            plan = plan_resharding(shape, dtype, src, dst, cluster,
                                   PlanOptions(strategy=strategy, balance=balance))
            assert (plan.strategy, plan.balance) == (strategy, balance)
            plan.check()
            paint(plan, shape, src, dst)
            if strategy == "send_recv":
                assert all(len(t.receivers) == 1 for t in plan.transfers)
            est = estimate(plan, cluster)
            assert est >= lb - 1e-12, (strategy, balance, est, lb)
            if math.prod(shape) == 0:
                assert plan.transfers == () and est == 0.0


@SETTINGS
@given(problems())
def test_json_round_trip_preserves_plan(problem):
    shape, dtype, src, dst, cluster = problem
    plan = plan_resharding(shape, dtype, src, dst, cluster,
                           PlanOptions(strategy="broadcast", balance="auto"))
    back = ReshardPlan.from_json(plan.to_json())
    assert back == plan
    assert back.transfers == plan.transfers
    assert estimate(back, cluster) == estimate(plan, cluster)


# Known hard inputs, always tried: a holder that also needs the tensor is busy with its local
# copy, so it is the worst sender for the remote receiver.
_BUSY_HOLDER = (
    (1024,), "float32",
    Sharding(DeviceMesh([4, 0], "x"), ShardingSpec()),
    Sharding(DeviceMesh([0, 8], "x"), ShardingSpec()),
    Cluster.preset("p3.8xlarge", 3),
)
_BUSY_HOLDER_TINY = (
    (1,), "int8",
    Sharding(DeviceMesh([0, 1], "a"), ShardingSpec()),
    Sharding(DeviceMesh([1, 2], "a"), ShardingSpec()),
    Cluster(3, 1, nic_gbps=10.0, nvlink_gbps=300.0, nic_latency_us=0.0, nvlink_latency_us=0.0),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
@example(_BUSY_HOLDER)
@example(_BUSY_HOLDER_TINY)
def test_broadcast_auto_no_worse_than_other_balances(problem):
    shape, dtype, src, dst, cluster = problem
    est = {
        balance: estimate(plan_resharding(shape, dtype, src, dst, cluster,
                                          PlanOptions(strategy="broadcast", balance=balance)),
                          cluster)
        for balance in BALANCES
    }
    others = min(v for k, v in est.items() if k != "auto")
    assert est["auto"] <= others * (1 + 1e-9) + 1e-15, est


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(STRATEGIES), st.sampled_from(["greedy", "auto"]))
def test_same_inputs_same_plan(problem, strategy, balance):
    shape, dtype, src, dst, cluster = problem
    a = plan_resharding(shape, dtype, src, dst, cluster,
                        PlanOptions(strategy=strategy, balance=balance))
    b = plan_resharding(shape, dtype, src, dst, cluster,
                        PlanOptions(strategy=strategy, balance=balance))
    assert a.transfers == b.transfers


# ---- the oracle itself ----------------------------------------------------------------------


def test_paint_rejects_broken_plans():
    cluster = Cluster(2, 2, nic_gbps=10)
    src = Sharding(DeviceMesh([0, 1], "a"), ShardingSpec("a"))
    dst = Sharding(DeviceMesh([2, 3], "a"), ShardingSpec(None, "a"))
    shape = (4, 6)
    plan = plan_resharding(shape, "int32", src, dst, cluster,
                           PlanOptions(strategy="send_recv", balance="none"))
    paint(plan, shape, src, dst)
    ts = list(plan.transfers)
    assert len(ts) >= 2

    def broken(transfers):
        return dataclasses.replace(plan, transfers=tuple(transfers))

    with pytest.raises(AssertionError, match="missing"):
        paint(broken(ts[1:]), shape, src, dst)
    with pytest.raises(AssertionError, match="more than once"):
        paint(broken([*ts, ts[0]]), shape, src, dst)
    wrong = 1 if ts[0].sender == 0 else 0
    with pytest.raises(AssertionError, match="does not hold"):
        paint(broken([dataclasses.replace(ts[0], sender=wrong), *ts[1:]]), shape, src, dst)
    with pytest.raises(AssertionError, match="not a destination"):
        paint(broken([*ts, dataclasses.replace(ts[0], receivers=(1,))]), shape, src, dst)
