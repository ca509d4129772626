"""The runtime executes resharding plans on the CPU backend and really moves the tensor.

Each source device starts with its shard of ``arange(size).reshape(shape)`` (float64); every
destination device must end with exactly numpy's slice of that array at its destination
region — for every strategy and balance, on clusters and layouts drawn by hypothesis.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from strategies import problems

from overlap.errors import OverlapRuntimeError, StreamError
from overlap.runtime import Runtime
from scheduler import (
    STRATEGIES,
    Cluster,
    CostModel,
    DeviceMesh,
    P,
    PlanOptions,
    ReshardPlan,
    Sharding,
    ShardingSpec,
    plan_resharding,
)
from scheduler.errors import PlanError

SETTLE_S = 10.0  # bound on waits that should end at once; reached only when something hangs


def _slices(region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def global_array(shape, offset: float = 0.0) -> np.ndarray:
    """``arange`` plus ``offset``: runs use different offsets, so a destination element that
    is never written cannot pass by holding a previous run's value in reused memory."""
    return (np.arange(math.prod(shape), dtype=np.float64) + offset).reshape(shape)


def cut_shards(glob: np.ndarray, sharding: Sharding, *, order: str = "C") -> dict:
    """Each device's region of ``glob`` (read-only: the runtime must not write its inputs)."""
    shards = {}
    for d, region in sharding.device_regions(glob.shape).items():
        a = np.array(glob[_slices(region)], order=order)
        a.setflags(write=False)
        shards[d] = a
    return shards


def assert_delivered(out: dict, glob: np.ndarray, dst: Sharding, what: str = "") -> None:
    regions = dst.device_regions(glob.shape)
    assert sorted(out) == sorted(regions), f"{what}: result devices"
    for d, region in regions.items():
        assert out[d].dtype == np.float64, what
        np.testing.assert_array_equal(out[d], glob[_slices(region)],
                                      err_msg=f"{what}: device {d}, region {region}")


# ---- every plan, really executed -------------------------------------------------------------


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(problems())
def test_runtime_delivers_every_destination_region(problem):
    shape, _dtype, src, dst, cluster = problem  # float64 so arange values stay exact
    runs = [(s, b) for s in STRATEGIES for b in ("none", "auto")]
    with Runtime(cluster, timeout=SETTLE_S) as rt:
        for k, (strategy, balance) in enumerate(runs):
            glob = global_array(shape, offset=1000.0 * k)
            shards = cut_shards(glob, src)
            plan = plan_resharding(shape, "float64", src, dst, cluster,
                                   PlanOptions(strategy=strategy, balance=balance))
            out = rt.reshard_sync(plan, shards)
            assert_delivered(out, glob, dst, f"{strategy}/{balance}")
            for d, region in src.device_regions(shape).items():  # inputs left untouched
                np.testing.assert_array_equal(shards[d], glob[_slices(region)])


# ---- a fixed case from asyncio ----------------------------------------------------------------

CLUSTER = Cluster(2, 2, nic_gbps=10)
SHAPE = (6, 4)
SRC = Sharding(DeviceMesh([0, 1], "a"), ShardingSpec("a"))
# Overlaps the source mesh on device 1 (a local copy) and replicates: broadcasts to 2 and 3.
DST = Sharding(DeviceMesh([1, 2, 3], "b"), ShardingSpec())
# The way back, sharded differently: local copies on 0 and 1, sends from 2 and 3.
DST2 = Sharding(DeviceMesh([[0, 1], [2, 3]], ("x", "y")), ShardingSpec("y", "x"))


def fixed_plan(strategy: str = "broadcast") -> ReshardPlan:
    plan = plan_resharding(SHAPE, "float64", SRC, DST, CLUSTER,
                           PlanOptions(strategy=strategy, balance="auto"))
    if strategy == "broadcast":  # the case covers what it claims to
        assert any(t.is_local_copy for t in plan.transfers), plan
        assert any(len(t.receivers) >= 2 for t in plan.transfers), plan
    return plan


async def test_async_reshard_with_local_copies_and_broadcasts():
    assert asyncio.get_running_loop().get_debug()
    async with Runtime(CLUSTER, timeout=SETTLE_S) as rt:
        for k, strategy in enumerate(STRATEGIES):
            glob = global_array(SHAPE, offset=100.0 * k)
            out = await asyncio.wait_for(rt.reshard(fixed_plan(strategy), cut_shards(glob, SRC)),
                                         SETTLE_S)
            assert_delivered(out, glob, DST, strategy)
        # Non-contiguous (Fortran-ordered) input shards are read correctly too.
        glob = global_array(SHAPE, offset=-100.0)
        out = await rt.reshard(fixed_plan(), cut_shards(glob, SRC, order="F"))
        assert_delivered(out, glob, DST, "fortran shards")
    assert rt.backend.streams() != []  # it really ran on streams (joined by aclose)


async def test_concurrent_reshards_on_one_runtime():
    glob, glob2 = global_array(SHAPE), global_array(SHAPE, offset=0.5)
    back = plan_resharding(SHAPE, "float64", DST, DST2, CLUSTER)
    async with Runtime(CLUSTER, timeout=SETTLE_S) as rt:
        there, again = await asyncio.wait_for(asyncio.gather(
            rt.reshard(fixed_plan(), cut_shards(glob, SRC)),
            rt.reshard(back, cut_shards(glob2, DST)),
        ), SETTLE_S)
    assert_delivered(there, glob, DST, "src -> dst")
    assert_delivered(again, glob2, DST2, "dst -> dst2")


# ---- bad input is rejected before anything starts ---------------------------------------------


def _good_shards() -> dict:
    return cut_shards(global_array(SHAPE), SRC)


def _replace(d: int, value) -> dict:
    shards = _good_shards()
    shards[d] = value
    return shards


def _foreign_plan() -> ReshardPlan:
    big = Cluster(4, 2, nic_gbps=10)
    return plan_resharding(SHAPE, "float64", SRC, Sharding(DeviceMesh([6, 7], "b"),
                                                           ShardingSpec()), big)


BAD_INPUTS = {
    "missing device": (lambda: fixed_plan(), lambda: {0: _good_shards()[0]},
                       ValueError, r"no shard for source devices \[1\]"),
    "extra device": (lambda: fixed_plan(), lambda: {**_good_shards(), 3: np.zeros((3, 4))},
                     ValueError, r"devices \[3\] are not in the plan's source mesh"),
    "wrong shape": (lambda: fixed_plan(), lambda: _replace(1, np.zeros((4, 4))),
                    ValueError, r"shards\[1\]: got \(4, 4\)"),
    "wrong dtype": (lambda: fixed_plan(), lambda: _replace(0, np.zeros((3, 4), np.float32)),
                    ValueError, r"shards\[0\]: .*float32"),
    "not an ndarray": (lambda: fixed_plan(), lambda: _replace(1, [[0.0] * 4] * 3),
                       TypeError, r"shards\[1\]: expected a numpy array, got list"),
    "not a mapping": (lambda: fixed_plan(), lambda: list(_good_shards().values()),
                      TypeError, r"shards: expected a mapping"),
    "plan outside cluster": (_foreign_plan, _good_shards,
                             ValueError, r"plan: device 7 is outside the runtime's cluster"),
    "plan not a ReshardPlan": (lambda: fixed_plan().to_json(), _good_shards,
                               TypeError, r"plan: expected a ReshardPlan, got str"),
    # Plans the runtime did not make (edited JSON): checked before anything moves.
    "plan missing a transfer": (lambda: _tampered("drop"), _good_shards, PlanError,
                                r"not delivered exactly once .*first missing: \[\d+:\d+"),
    "plan with a bogus sender": (lambda: _tampered("sender"), _good_shards, PlanError,
                                 r"transfer 0 .*sender 3 does not hold the region"),
}


def _tampered(how: str) -> ReshardPlan:
    data = json.loads(fixed_plan("send_recv").to_json())
    if how == "drop":
        del data["transfers"][0]
    else:
        data["transfers"][0]["sender"] = 3
    return ReshardPlan.from_json(json.dumps(data))


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_rejected_before_anything_starts(case):
    make_plan, make_shards, exc, pattern = BAD_INPUTS[case]
    with Runtime(CLUSTER, timeout=SETTLE_S) as rt:
        with pytest.raises(exc, match=pattern):
            rt.reshard_sync(make_plan(), make_shards())
        assert rt.backend.streams() == [], "work was launched before the input was checked"
        assert_delivered(rt.reshard_sync(fixed_plan(), _good_shards()),
                         global_array(SHAPE), DST, "after rejected input")


# ---- failures: reported, recovered from ---------------------------------------------------------


def _causes(exc: BaseException):
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def test_failed_transfer_raises_then_runtime_is_reusable():
    cluster = Cluster(4, 1, nic_gbps=10)
    shape = (8, 6)
    src = Sharding(DeviceMesh([0, 1], "a"), ShardingSpec("a"))
    dst = Sharding(DeviceMesh([2, 3], "a"), ShardingSpec(None, "a"))
    glob = global_array(shape)
    plan = plan_resharding(shape, "float64", src, dst, cluster, PlanOptions(strategy="broadcast"))
    assert len(plan.transfers) >= 2
    calls = []

    def flaky_link(root, receivers, nbytes):
        calls.append(root)
        if len(calls) == 1:
            raise ValueError("link down")
        return 0.0

    with Runtime(cluster, timeout=SETTLE_S) as rt:
        rt.backend.link_time = flaky_link
        with pytest.raises(OverlapRuntimeError) as info:
            rt.reshard_sync(plan, cut_shards(glob, src))
        err = info.value
        assert re.search(r"device \d", str(err)), str(err)
        assert any(isinstance(e, ValueError) and str(e) == "link down" for e in _causes(err)), (
            f"the ValueError is not in the chain of {err!r}"
        )
        # Same runtime, same streams: works again (and the link keeps working).
        assert_delivered(rt.reshard_sync(plan, cut_shards(glob, src)), glob, dst, "retry")
        assert len(calls) > 1
        assert_delivered(rt.reshard_sync(plan, cut_shards(glob, src)), glob, dst, "again")


class UnreadableShard(np.ndarray):
    """Passes every check on the way in; reading any region of it raises."""

    def __getitem__(self, key):
        raise ValueError("shard unreadable")


@pytest.mark.parametrize("src_dev, dst_dev", [(2, 0), (1, 1)],
                         ids=["send-from-higher-device", "local-copy"])
def test_failing_sender_reports_its_device_and_cause(src_dev, dst_dev):
    cluster = Cluster(3, 1, nic_gbps=10)
    shape = (4, 2)
    src = Sharding(DeviceMesh([src_dev], "a"), ShardingSpec())
    dst = Sharding(DeviceMesh([dst_dev], "a"), ShardingSpec())
    plan = plan_resharding(shape, "float64", src, dst, cluster)
    glob = global_array(shape)
    with Runtime(cluster, timeout=SETTLE_S) as rt:
        with pytest.raises(StreamError) as info:
            rt.reshard_sync(plan, {src_dev: glob.copy().view(UnreadableShard)})
        err = info.value
        assert err.device == src_dev and err.stream == "comm" and "reshard" in err.op, err
        assert f"device {src_dev}" in str(err) and "shard unreadable" in str(err)
        assert isinstance(err.__cause__, ValueError), (
            f"StreamError.__cause__ should be the op's ValueError, got {err.__cause__!r}"
        )
        assert_delivered(rt.reshard_sync(plan, {src_dev: glob.copy()}), glob, dst, "retry")


async def test_cancelled_reshard_recovers():
    cluster = Cluster(2, 1, nic_gbps=0.08)  # 1e7 B/s: a 1 MB transfer takes 0.1 s
    shape = (125_000,)
    src = Sharding(DeviceMesh([0], "a"), ShardingSpec())
    dst = Sharding(DeviceMesh([1], "a"), ShardingSpec())
    plan = plan_resharding(shape, "float64", src, dst, cluster)
    glob = global_array(shape)
    async with Runtime(cluster, emulate_links=True, timeout=SETTLE_S) as rt:
        task = asyncio.ensure_future(rt.reshard(plan, cut_shards(glob, src)))
        await asyncio.sleep(0)  # the task launches its transfers, then awaits them
        assert rt.backend.streams() != []
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        out = await asyncio.wait_for(rt.reshard(plan, cut_shards(glob, src)), SETTLE_S)
        assert_delivered(out, glob, dst, "after cancel")


# ---- link emulation ---------------------------------------------------------------------------


def test_emulated_links_take_at_least_the_cost_model_time():
    cluster = Cluster(2, 1, nic_gbps=0.08)  # 1e7 B/s
    shape = (125_000,)  # float64: 1e6 bytes host 0 -> host 1
    src = Sharding(DeviceMesh([0], "a"), ShardingSpec())
    dst = Sharding(DeviceMesh([1], "a"), ShardingSpec())
    plan = plan_resharding(shape, "float64", src, dst, cluster)
    assert [(t.sender, t.receivers, t.nbytes) for t in plan.transfers] == [(0, (1,), 1_000_000)]
    expected = CostModel(cluster).alone_time(plan.transfers[0])
    assert expected == pytest.approx(0.1 + cluster.nic_latency_s)
    glob = global_array(shape)
    with Runtime(cluster, emulate_links=True, timeout=SETTLE_S) as rt:
        t0 = time.perf_counter()
        out = rt.reshard_sync(plan, cut_shards(glob, src))
        elapsed = time.perf_counter() - t0
    assert elapsed >= expected, (elapsed, expected)
    assert_delivered(out, glob, dst, "emulated")


def test_timeline_covers_the_last_traced_call_and_says_when_there_is_none():
    cluster = Cluster(2, 2, nic_gbps=100)
    src = Sharding(DeviceMesh([0, 1], "a"), ShardingSpec("a"))
    dst = Sharding(DeviceMesh([2, 3], "a"), ShardingSpec())
    plan = plan_resharding((4, 2), "float64", src, dst, cluster)
    glob = global_array((4, 2))
    with Runtime(cluster, timeout=SETTLE_S) as rt:
        with pytest.raises(OverlapRuntimeError, match=r"timeline: no traced call has run"):
            rt.timeline()
        rt.reshard_sync(plan, cut_shards(glob, src))  # not traced: still nothing to show
        with pytest.raises(OverlapRuntimeError, match=r"reshard with trace=True"):
            rt.timeline()
        out = rt.reshard_sync(plan, cut_shards(glob, src), trace=True)
        assert_delivered(out, glob, dst, "traced")
        spans = rt.timeline().spans
        # one span per transfer on each device it involves
        assert {s.op for s in spans} == set(range(len(plan.transfers)))
        devices = {d for t in plan.transfers for d in (t.sender, *t.receivers)}
        assert {s.device for s in spans} == devices


def test_emulated_links_cover_local_copies():
    """``emulate_links`` promises every transfer at least its cost-model time; a local copy is
    a transfer too (the model charges it NVLink latency + bytes / NVLink bandwidth)."""
    cluster = Cluster(1, 1, nic_gbps=10, nvlink_gbps=0.08, nvlink_latency_us=0.0)
    shape = (125_000,)  # 1e6 bytes copied on device 0 at 1e7 B/s
    src = Sharding(DeviceMesh([0], "a"), ShardingSpec())
    plan = plan_resharding(shape, "float64", src, src, cluster)
    assert [t.is_local_copy for t in plan.transfers] == [True]
    expected = CostModel(cluster).alone_time(plan.transfers[0])
    assert expected == pytest.approx(0.1)
    glob = global_array(shape)
    with Runtime(cluster, emulate_links=True, timeout=SETTLE_S) as rt:
        t0 = time.perf_counter()
        out = rt.reshard_sync(plan, cut_shards(glob, src))
        elapsed = time.perf_counter() - t0
    assert_delivered(out, glob, src, "emulated local copy")
    assert elapsed >= expected, (
        f"a local copy the cost model times at {expected:g} s took {elapsed:.4f} s under "
        "emulate_links=True"
    )


# ---- misuse ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cluster", [None, "p3.8xlarge", 4, {"num_hosts": 1}])
def test_runtime_needs_a_cluster(cluster):
    with pytest.raises(TypeError, match="cluster"):
        Runtime(cluster)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        Runtime(CLUSTER, backend="tpu")


def test_reshard_after_close_is_an_error():
    rt = Runtime(CLUSTER)
    assert_delivered(rt.reshard_sync(fixed_plan(), _good_shards()), global_array(SHAPE), DST)
    rt.close()
    rt.close()  # idempotent
    with pytest.raises(OverlapRuntimeError, match="closed"):
        rt.reshard_sync(fixed_plan(), _good_shards())


async def test_async_reshard_after_aclose_is_an_error():
    rt = Runtime(CLUSTER)
    await rt.aclose()
    with pytest.raises(OverlapRuntimeError, match="closed"):
        await rt.reshard(fixed_plan(), _good_shards())


# ---- destination buffers supplied by the caller ----------------------------------------------

def test_reshard_into_supplied_buffers_fills_and_returns_them():
    plan = fixed_plan()
    regions = DST.device_regions(SHAPE)
    with Runtime(CLUSTER, timeout=SETTLE_S) as rt:
        out = {d: np.full([b - a for a, b in r], -1.0) for d, r in regions.items()}
        for k in range(2):  # the same buffers, reused: every element rewritten each time
            glob = global_array(SHAPE, offset=100.0 * k)
            got = rt.reshard_sync(plan, cut_shards(glob, SRC), out=out)
            assert all(got[d] is out[d] for d in regions)
            assert_delivered(got, glob, DST, f"round {k}")


@pytest.mark.parametrize("change, error, match", [
    (lambda out, shards: out.pop(2), ValueError, r"out: no array for destination devices \[2\]"),
    (lambda out, shards: out.update({0: np.zeros(3)}), ValueError,
     r"out: devices \[0\] are not destination devices"),
    (lambda out, shards: out.update({3: np.zeros((6, 4), np.float32)}), ValueError,
     r"out\[3\]: got \(6, 4\) float32"),
    (lambda out, shards: out.update({3: [[0.0] * 4] * 6}), TypeError,
     r"out\[3\]: expected an array, got list"),
    (lambda out, shards: out[2].setflags(write=False), ValueError,
     r"out\[2\]: the array is read-only"),
    (lambda out, shards: out.update({1: shards[1]}), ValueError,
     r"out\[1\]: got \(3, 4\)"),
    (lambda out, shards: out.update({3: out[2]}), ValueError, r"out\[3\]: overlaps out\[2\]"),
])
def test_bad_out_buffers_are_named_before_any_work(change, error, match):
    plan = fixed_plan()
    glob = global_array(SHAPE)
    shards = cut_shards(glob, SRC)
    regions = DST.device_regions(SHAPE)
    out = {d: np.full([b - a for a, b in r], -7.0) for d, r in regions.items()}
    change(out, shards)
    before = {d: np.array(a, copy=True) for d, a in out.items() if isinstance(a, np.ndarray)}
    with Runtime(CLUSTER, timeout=SETTLE_S) as rt:
        with pytest.raises(error, match=match):
            rt.reshard_sync(plan, shards, out=out)
        assert rt.backend.streams() == []  # nothing was launched
    for d, a in before.items():  # nothing was written
        np.testing.assert_array_equal(out[d], a)


def test_an_out_buffer_overlapping_a_shard_is_refused():
    plan = fixed_plan()
    glob = global_array(SHAPE)
    shards = cut_shards(glob, SRC)
    regions = DST.device_regions(SHAPE)
    out = {d: np.zeros([b - a for a, b in r]) for d, r in regions.items()}
    backing = np.zeros((12, 4))
    shards[1] = backing[:3]
    out[1] = backing[:6]  # device 1's destination region is the whole tensor
    with Runtime(CLUSTER, timeout=SETTLE_S) as rt, pytest.raises(
            ValueError, match=r"out\[1\]: overlaps shards\[1\]"):
        rt.reshard_sync(plan, shards, out=out)


# ---- the synchronous API's event loop -------------------------------------------------------

async def test_a_sync_method_inside_a_running_loop_names_the_async_one():
    plan = fixed_plan()
    glob = global_array(SHAPE)
    async with Runtime(CLUSTER, timeout=SETTLE_S) as rt:
        with pytest.raises(RuntimeError, match="reshard_sync: called from inside a running "
                                               "event loop; await the async method instead"):
            rt.reshard_sync(plan, cut_shards(glob, SRC))
        assert rt.backend.streams() == []  # refused before any work


def test_sync_calls_share_one_loop_that_close_shuts():
    plan = fixed_plan()
    glob = global_array(SHAPE)
    rt = Runtime(CLUSTER, timeout=SETTLE_S)
    try:
        rt.reshard_sync(plan, cut_shards(glob, SRC))
        loop = rt.sync_loop
        out = rt.reshard_sync(plan, cut_shards(glob, SRC))
        assert rt.sync_loop is loop and not loop.is_closed()
        assert_delivered(out, glob, DST, "second call")
    finally:
        rt.close()
    assert loop.is_closed() and rt.sync_loop is None
    with pytest.raises(OverlapRuntimeError, match="runtime is closed"):
        rt.reshard_sync(plan, cut_shards(glob, SRC))
    assert rt.sync_loop is None  # no loop made for a refused call


def test_the_sync_loop_is_uvloops_except_on_the_main_thread():
    """uvloop arms its signal wake-up at every run on the main thread (a socket pair,
    ``set_wakeup_fd``, undone after: ~12 µs a call): the sync calls' loop there is stock
    asyncio's; made by a call on another thread, uvloop's. Both deliver."""
    import asyncio
    import threading

    uvloop = pytest.importorskip("uvloop")
    plan = fixed_plan()
    glob = global_array(SHAPE)
    loops = {}

    def call(where: str) -> None:
        with Runtime(CLUSTER, timeout=SETTLE_S) as rt:
            out = rt.reshard_sync(plan, cut_shards(glob, SRC))
            loops[where] = type(rt.sync_loop)
            assert_delivered(out, glob, DST, where)

    call("main thread")
    worker = threading.Thread(target=call, args=("worker thread",))
    worker.start()
    worker.join(60)
    assert issubclass(loops["main thread"], asyncio.BaseEventLoop)
    assert not issubclass(loops["main thread"], uvloop.Loop)
    assert issubclass(loops["worker thread"], uvloop.Loop)


def test_transfer_after_orders_senders_that_share_no_device():
    """A plan's ``after`` is kept even when only it orders two transfers (different senders,
    different receivers): the second's sender starts once the first has ended."""
    import dataclasses

    slow = Cluster(2, 2, nic_gbps=0.02, nvlink_gbps=0.02, nic_latency_us=100.0,
                   nvlink_latency_us=10.0)
    src = Sharding(DeviceMesh([[0, 1]], ("host", "gpu")), P("gpu"))
    dst = Sharding(DeviceMesh([[2, 3]], ("host", "gpu")), P("gpu"))
    plan = plan_resharding((32, 128), "float64", src, dst, slow,
                           PlanOptions(strategy="send_recv", balance="none"))
    first, second = plan.transfers
    assert not set(first.devices) & set(second.devices)
    plan = dataclasses.replace(plan, transfers=(first, dataclasses.replace(second, after=(0,))))
    glob = global_array((32, 128))
    with Runtime(slow, emulate_links=True) as rt:
        out = rt.reshard_sync(plan, cut_shards(glob, src), trace=True)
        span = {(sp.op, sp.device): sp for sp in rt.timeline().spans}
    assert_delivered(out, glob, dst)
    assert span[(0, first.sender)].end <= span[(1, second.sender)].start


async def test_when_one_of_several_concurrent_reshards_fails_the_others_say_why():
    cluster = Cluster(3, 1, nic_gbps=10)
    shape = (4, 2)
    src = Sharding(DeviceMesh([2], "a"), ShardingSpec())
    dst = Sharding(DeviceMesh([0], "a"), ShardingSpec())
    plan = plan_resharding(shape, "float64", src, dst, cluster)
    glob = global_array(shape)
    async with Runtime(cluster, timeout=SETTLE_S) as rt:
        calls = [rt.reshard(plan, {2: glob.copy().view(UnreadableShard)})]
        calls += [rt.reshard(plan, {2: glob.copy()}) for _ in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True),
                                         SETTLE_S)
        assert isinstance(results[0], StreamError), results[0]
        for r in results[1:]:  # done before the failure, or stopped by it — and saying so
            if isinstance(r, BaseException):
                assert "closed" not in str(r) and "shard unreadable" in str(r), repr(r)
            else:
                assert_delivered(r, glob, dst, "a concurrent call")
        assert_delivered(await rt.reshard(plan, {2: glob.copy()}), glob, dst, "afterwards")


def test_the_one_pass_shard_check_accepts_exactly_what_check_shards_accepts():
    """``shards_match`` (a call's check of a plan seen before) says yes only to a dict of
    exactly the plan's source devices, each an array of its region's shape and the plan's
    dtype: every shape of mistake goes to ``check_shards``, which names it."""
    from collections import UserDict

    from overlap.reshard import check_shards, shards_match
    from scheduler.regions import region_shape

    plan = fixed_plan()
    glob = global_array(SHAPE)
    good = cut_shards(glob, SRC)
    expected = {d: region_shape(r) for d, r in SRC.device_regions(SHAPE).items()}
    dtype = np.dtype(plan.dtype)
    assert shards_match(expected, good, dtype, (np.ndarray,))
    check_shards(plan, good)
    first = min(good)
    bad = {
        "missing": {d: a for d, a in good.items() if d != first},
        "extra": {**good, 9: good[first]},
        "shape": {**good, first: good[first][:-1]},
        "dtype": {**good, first: good[first].astype(np.float32)},
        "type": {**good, first: good[first].tolist()},
    }
    for why, shards in bad.items():
        assert not shards_match(expected, shards, dtype, (np.ndarray,)), why
        with pytest.raises((ValueError, TypeError)):
            check_shards(plan, shards)
    # Another kind of mapping: left to check_shards, which takes it.
    assert not shards_match(expected, UserDict(good), dtype, (np.ndarray,))
    check_shards(plan, UserDict(good))


# ---- calls from several event loops -------------------------------------------------------------


def test_calls_awaited_on_several_threads_loops_each_get_their_own_tensors():
    """Two threads, each awaiting ``reshard`` on an event loop of its own against one
    runtime: the calls take turns (one call at a time per runtime), and every call returns
    exactly the tensor it was given — never the other thread's (before, 7 runs in 8 mixed
    them)."""
    plan = fixed_plan("broadcast")
    runs, errors = {}, []

    def worker(k: int) -> None:
        async def calls() -> None:
            for i in range(20):
                glob = global_array(SHAPE, offset=1000.0 * (2 * i + k))
                out = await rt.reshard(plan, cut_shards(glob, SRC))
                runs[(k, i)] = (out, glob)

        try:
            asyncio.run(calls())
        except BaseException as exc:  # (shown by the assertion below)
            errors.append(exc)

    with Runtime(CLUSTER, timeout=SETTLE_S) as rt:
        threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60.0)
    assert errors == [] and len(runs) == 40, errors
    for (k, i), (out, glob) in runs.items():
        assert_delivered(out, glob, DST, f"thread {k}, call {i}")


def test_training_steps_awaited_on_two_loops_are_each_the_one_asked_for():
    from toy_mlp import CLUSTER as TOY_CLUSTER
    from toy_mlp import ToyMLP

    model = ToyMLP(seed=0)
    inputs = {k: [np.random.default_rng(10 * k + i).standard_normal((model.batch, model.dims[0]))
                  for i in range(4)] for k in (0, 1)}
    with Runtime(TOY_CLUSTER, timeout=SETTLE_S) as rt:
        alone = {k: rt.train_step_sync(model.stages, model.boundaries, inputs[k],
                                       input_sharding=model.input_sharding) for k in (0, 1)}
        together, errors = {}, []

        def worker(k: int) -> None:
            async def steps() -> None:
                for i in range(3):
                    together[(k, i)] = await rt.train_step(
                        model.stages, model.boundaries, inputs[k],
                        input_sharding=model.input_sharding)

            try:
                asyncio.run(steps())
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60.0)
    assert errors == [], errors
    for (k, _), losses in together.items():
        assert losses == alone[k], (k, losses, alone[k])
