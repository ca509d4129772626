"""ReshardPlan.check (box arithmetic) against a dense reference: for small tensors, an array
of element counts per device says whether a plan — from the planner, or randomly corrupted —
is correct; check() must agree, and name a failure of the same kind."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import problems

from scheduler import PlanError, PlanOptions, ReshardPlan, plan_resharding
from scheduler.regions import Region, contains, intersect, volume


def _box(region: Region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def dense_verdict(plan: ReshardPlan) -> bool:
    """Whether ``plan`` is correct, by counting every element on every device."""
    shape, itemsize = plan.shape, plan.itemsize
    src = plan.src.device_regions(shape)
    dst = plan.dst.device_regions(shape)
    held: dict[int, np.ndarray] = {}
    got: dict[int, np.ndarray] = {}
    brought: dict[int, list[tuple[int, int, Region]]] = {}

    def holding(dev: int) -> np.ndarray:
        if dev not in held:
            held[dev] = np.zeros(shape, bool)
            if dev in src:
                held[dev][_box(src[dev])] = True
        return held[dev]

    for i, t in enumerate(plan.transfers):
        if t.nbytes != volume(t.region) * itemsize or any(not 0 <= j < i for j in t.after):
            return False
        if not all(0 <= a <= b <= n for (a, b), n in zip(t.region, shape)):
            return False
        if not holding(t.sender)[_box(t.region)].all():
            return False
        own = src.get(t.sender)
        if not (own is not None and contains(own, t.region)) and any(
                lane != t.lane and j not in t.after and intersect(where, t.region) is not None
                for j, lane, where in brought.get(t.sender, ())):
            return False
        if len(set(t.receivers)) != len(t.receivers) or (
                t.sender in t.receivers and not t.is_local_copy):
            return False
        for r in t.receivers:
            if r not in dst or not contains(dst[r], t.region):
                return False
            got.setdefault(r, np.zeros(shape, np.int64))[_box(t.region)] += 1
            holding(r)[_box(t.region)] = True
            brought.setdefault(r, []).append((i, t.lane, t.region))
    for dev, region in dst.items():
        want = np.zeros(shape, np.int64)
        want[_box(region)] = 1
        if not np.array_equal(got.get(dev, np.zeros(shape, np.int64)), want):
            return False
    return True


def corrupt(plan: ReshardPlan, rnd: random.Random) -> ReshardPlan:
    """One random edit a hand-edited plan file could carry."""
    ts = list(plan.transfers)
    if not ts:
        return plan
    i = rnd.randrange(len(ts))
    t = ts[i]
    kind = rnd.randrange(6)
    if kind == 0:
        del ts[i]  # a missing piece
    elif kind == 1:
        ts.append(dataclasses.replace(t, after=()))  # a piece twice
    elif kind == 2 and t.region:  # a region grown or shrunk by one element
        d = rnd.randrange(len(t.region))
        region = list(t.region)
        a, b = region[d]
        region[d] = (max(0, a - 1), b) if rnd.random() < 0.5 else (a, max(a, b - 1))
        ts[i] = dataclasses.replace(t, region=tuple(region),
                                    nbytes=volume(tuple(region)) * plan.itemsize)
    elif kind == 3:  # another sender
        ts[i] = dataclasses.replace(t, sender=rnd.choice(plan.src.mesh.device_ids))
    elif kind == 4:
        ts[i] = dataclasses.replace(t, lane=rnd.randrange(3))
    else:  # an order where a forward may come before what it forwards
        j = rnd.randrange(len(ts))
        ts[i], ts[j] = ts[j], ts[i]
        ts = [dataclasses.replace(x, after=tuple(k for k in x.after if k < n))
              for n, x in enumerate(ts)]
    return dataclasses.replace(plan, transfers=tuple(ts))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(problems(), st.sampled_from(["broadcast", "send_recv", "local_allgather"]),
       st.integers(0, 2**32))
def test_check_agrees_with_counting_every_element(problem, strategy, seed):
    shape, dtype, src, dst, cluster = problem
    plan = plan_resharding(shape, dtype, src, dst, cluster, PlanOptions(strategy=strategy))
    assert dense_verdict(plan)
    plan.check()
    rnd = random.Random(seed)
    for _ in range(3):
        edited = corrupt(plan, rnd)
        try:
            edited.check()
            accepted = True
        except PlanError:
            accepted = False
        assert accepted == dense_verdict(edited), edited.transfers
