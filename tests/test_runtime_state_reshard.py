"""The runtime runs whole-state resharding plans (``Runtime.reshard_state``) on the CPU backend.

Every destination device must end with exactly its region of each full tensor (compared as
bytes: every dtype, NaN patterns included), for random states drawn by hypothesis — tensors
of several dtypes and ranks, uneven shards, empty ones, meshes disjoint, overlapping or the
same — and every bad input is refused, naming it, before anything moves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from launchers import LAUNCHERS, launch
from state_arrays import box, full_tensors
from strategies import problems

from overlap import Runtime
from overlap.errors import OverlapRuntimeError
from scheduler import (
    Cluster,
    DeviceMesh,
    P,
    PlanError,
    Sharding,
    StateOptions,
    StateTensor,
    plan_resharding,
    plan_state_resharding,
    state_graph,
    validate,
)

SETTLE_S = 10.0
P3 = Cluster.preset("p3.8xlarge", 2)  # 2 hosts x 4 GPUs


def source_shards(tensors, full, devices=None) -> dict[str, dict[int, np.ndarray]]:
    """Each source device's region (read-only: the runtime must not write its inputs)."""
    shards: dict[str, dict[int, np.ndarray]] = {}
    for name, t in tensors.items():
        shards[name] = {}
        for d, region in t.src.device_regions(t.shape).items():
            if devices is None or d in devices:
                a = np.array(full[name][box(region)])
                a.setflags(write=False)
                shards[name][d] = a
    return shards


def assert_state_delivered(out, tensors, full) -> None:
    assert sorted(out) == sorted(tensors)
    for name, t in tensors.items():
        regions = t.dst.device_regions(t.shape)
        assert sorted(out[name]) == sorted(regions), name
        for d, region in regions.items():
            want = full[name][box(region)]
            got = out[name][d]
            assert got.shape == want.shape and got.dtype == want.dtype, (name, d)
            np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.uint8),
                                          np.ascontiguousarray(want).view(np.uint8),
                                          err_msg=f"tensor {name!r}, device {d}")


@st.composite
def states(draw):
    """(tensors, cluster, bucket_bytes): 1-4 tensors on one drawn cluster, each with its own
    layouts (the meshes of :func:`strategies.problems`: disjoint or overlapping)."""
    first = draw(problems())
    cluster = first[-1]
    drawn = [first] + [draw(problems(cluster)) for _ in range(draw(st.integers(0, 3)))]
    tensors = {f"layer{k}.w": StateTensor(shape, dtype, src, dst)
               for k, (shape, dtype, src, dst, _) in enumerate(drawn)}
    if draw(st.booleans()):  # the same devices both sides: a colocated engine
        shape, dtype, src, _, _ = drawn[0]
        tensors["colocated"] = StateTensor(shape, dtype, src, Sharding(src.mesh, P()))
    return tensors, cluster, draw(st.sampled_from([16, 128, 1 << 20]))


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(states(), st.sampled_from(["broadcast", "send_recv", "local_allgather"]))
def test_every_element_equals_the_full_tensors(state, strategy):
    tensors, cluster, bucket = state
    plan = plan_state_resharding(tensors, cluster,
                                 StateOptions(strategy=strategy, bucket_bytes=bucket))
    validate(state_graph(plan))  # (the graph the runtime runs: no deadlock)
    full = full_tensors(tensors)
    with Runtime(cluster, timeout=SETTLE_S) as rt:
        out = rt.reshard_state_sync(plan, source_shards(tensors, full))
        assert_state_delivered(out, tensors, full)
        # Again, into the arrays of the first call: every element written again.
        full2 = full_tensors(tensors, seed=1)
        again = rt.reshard_state_sync(plan, source_shards(tensors, full2), out=out)
        assert_state_delivered(again, tensors, full2)
        for name in tensors:
            for d, a in again[name].items():
                assert a is out[name][d]


def _state(bucket: int = 64):
    m0 = DeviceMesh([[0, 1], [2, 3]], ("a", "b"))
    m1 = DeviceMesh([4, 5, 6, 7], ("t",))
    tensors = {
        "w": StateTensor((8, 6), "float32", Sharding(m0, P("a", "b")), Sharding(m1, P(None, "t"))),
        "b": StateTensor((7,), "bfloat16", Sharding(m0, P("b")), Sharding(m1, P())),
        "e": StateTensor((5, 3, 2), "int64", Sharding(m0, P()), Sharding(m0, P("a"))),
    }
    return tensors, plan_state_resharding(tensors, P3, StateOptions(bucket_bytes=bucket))


def test_async_and_sync_calls_deliver_and_mix_with_one_tensor_calls():
    tensors, plan = _state()
    full = full_tensors(tensors)
    shards = source_shards(tensors, full)
    one = plan_resharding((8, 6), "float32", tensors["w"].src, tensors["w"].dst, P3)

    async def main(rt):
        first = await rt.reshard_state(plan, shards)
        single = await rt.reshard(one, shards["w"])
        second = await rt.reshard_state(plan, shards)
        return first, single, second

    with Runtime(P3, timeout=SETTLE_S) as rt:
        first, single, second = asyncio.run(main(rt))
    assert_state_delivered(first, tensors, full)
    assert_state_delivered(second, tensors, full)
    for d, a in single.items():
        np.testing.assert_array_equal(a, first["w"][d])


def test_each_device_stages_one_bucket_at_a_time():
    """Measured: on every device, each bucket's transfers end before any transfer of its next
    bucket there starts (the bucket barrier that bounds staging memory)."""
    tensors, plan = _state(bucket=32)
    assert len(plan.buckets) > 2
    full = full_tensors(tensors)
    with Runtime(P3, timeout=SETTLE_S, emulate_links=True) as rt:
        rt.reshard_state_sync(plan, source_shards(tensors, full), trace=True)
        spans = rt.timeline().spans
    bucket_of = {}
    for b, bucket in enumerate(plan.buckets):
        for key in bucket:
            bucket_of[plan.launch_order.index(key)] = b
    by_device: dict[tuple[int, int], list] = {}
    for sp in spans:
        by_device.setdefault((sp.device, bucket_of[sp.op]), []).append(sp)
    checked = 0
    for (d, b), mine in by_device.items():
        later = [sp for (e, c), sps in by_device.items() if e == d and c > b for sp in sps]
        if later:
            assert max(sp.end for sp in mine) <= min(sp.start for sp in later) + 1e-9, (d, b)
            checked += 1
    assert checked


def test_preallocated_out_may_cover_some_tensors_and_be_strided():
    tensors, plan = _state()
    full = full_tensors(tensors)
    regions = tensors["w"].dst.device_regions((8, 6))
    # Each destination a transposed view: writes land through its strides.
    out = {"w": {d: np.empty(tuple(reversed([b - a for a, b in r])), np.float32).T
                 for d, r in regions.items()}}
    with Runtime(P3, timeout=SETTLE_S) as rt:
        got = rt.reshard_state_sync(plan, source_shards(tensors, full), out=out)
    assert_state_delivered(got, tensors, full)
    assert all(got["w"][d] is out["w"][d] for d in regions)


# ---- bad inputs: refused, naming the argument, before anything moves --------------------------


@pytest.fixture(scope="module")
def rt():
    with Runtime(P3, timeout=SETTLE_S) as runtime:
        yield runtime


def _refused(rt, plan, shards, match, error=ValueError, out=None):
    with pytest.raises(error, match=match):
        rt.reshard_state_sync(plan, shards, out=out)


def test_a_missing_or_unknown_tensor_is_named(rt):
    tensors, plan = _state()
    shards = source_shards(tensors, full_tensors(tensors))
    _refused(rt, plan, {k: v for k, v in shards.items() if k != "b"},
             r"shards: no shards for tensors \['b'\]")
    _refused(rt, plan, {**shards, "extra": {}}, r"shards: tensors \['extra'\] are not in the plan")
    _refused(rt, plan, [shards], r"shards: expected a mapping", TypeError)


def test_a_wrong_shape_dtype_or_device_is_named(rt):
    tensors, plan = _state()
    full = full_tensors(tensors)
    shards = source_shards(tensors, full)
    bad = {**shards, "w": {**shards["w"], 0: np.zeros((3, 3), np.float32)}}
    _refused(rt, plan, bad, r"shards\['w'\]\[0\]: got \(3, 3\) float32.*needs \(4, 3\)")
    bad = {**shards, "e": {d: a.astype(np.int32) for d, a in shards["e"].items()}}
    _refused(rt, plan, bad, r"shards\['e'\]\[\d\]: got .* int32.* int64")
    bad = {**shards, "b": {**shards["b"], 5: shards["b"][0]}}
    _refused(rt, plan, bad, r"shards\['b'\]: devices \[5\] are not in the plan's source mesh")
    bad = {**shards, "w": {d: a for d, a in shards["w"].items() if d != 2}}
    _refused(rt, plan, bad, r"shards\['w'\]: no shard for source devices \[2\]")
    bad = {**shards, "w": {**shards["w"], 1: shards["w"][1].tolist()}}
    _refused(rt, plan, bad, r"shards\['w'\]\[1\]: expected a numpy array", TypeError)


def test_a_plan_for_another_cluster_or_a_broken_plan_is_refused(rt):
    tensors, plan = _state()
    shards = source_shards(tensors, full_tensors(tensors))
    big = Cluster.preset("p3.8xlarge", 4)
    far = {"w": StateTensor((4,), "float32", Sharding(big.mesh([3]), P()),
                            Sharding(DeviceMesh([9, 12], ("t",)), P("t")))}
    other = plan_state_resharding(far, big)
    _refused(rt, other, {"w": {}}, r"plan: device 15 is outside the runtime's cluster")
    w = plan.plans["w"]
    broken = dataclasses.replace(plan, plans={**plan.plans, "w": dataclasses.replace(
        w, transfers=w.transfers[:-1])})
    _refused(rt, broken, shards, "tensor 'w'", PlanError)
    _refused(rt, plan.plans["w"], shards, "plan: expected a StateReshardPlan", TypeError)


def test_bad_out_arrays_are_named(rt):
    tensors, plan = _state()
    full = full_tensors(tensors)
    shards = source_shards(tensors, full)
    regions = tensors["b"].dst.device_regions((7,))
    good = {d: np.empty(7, shards["b"][0].dtype) for d in regions}
    _refused(rt, plan, shards, r"out: tensors \['nope'\] are not in the plan", out={"nope": {}})
    _refused(rt, plan, shards, r"out\['b'\]: no array for destination devices \[7\]",
             out={"b": {d: a for d, a in good.items() if d != 7}})
    ro = np.empty(7, good[4].dtype)
    ro.setflags(write=False)
    _refused(rt, plan, shards, r"out\['b'\]\[4\]: the array is read-only",
             out={"b": {**good, 4: ro}})
    # A destination of one tensor that is a source shard of another: refused.
    e_shard = np.zeros((5, 3, 2), np.int64)
    alias = {**shards, "e": {**shards["e"], 0: e_shard}}
    view = e_shard.reshape(-1)[:7].view(np.uint8)[:14].view(good[4].dtype)
    _refused(rt, plan, alias, r"out\['b'\]\[4\]: overlaps shards\['e'\]\[0\]",
             out={"b": {**good, 4: view}})
    _refused(rt, plan, shards, "out: expected a mapping", TypeError, out=[good])


def test_a_closed_runtime_and_a_cancelled_call():
    tensors, plan = _state(bucket=16)
    shards = source_shards(tensors, full_tensors(tensors))
    slow = Cluster(2, 4, nic_gbps=1e-6, nvlink_gbps=1e-6)  # emulated: each transfer seconds

    async def cancelled(rt):
        task = asyncio.ensure_future(rt.reshard_state(plan, shards))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, SETTLE_S)

    with Runtime(slow, timeout=SETTLE_S, emulate_links=True) as rt:
        asyncio.run(cancelled(rt))
    rt.close()
    with pytest.raises(OverlapRuntimeError, match="closed"):
        rt.reshard_state_sync(plan, shards)


# ---- several processes, each with only its own shards ------------------------------------------


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_four_processes_each_give_their_own_shards_and_receive_exact_ones(launcher):
    job = Path(__file__).parent / "mpi_jobs" / "state_reshard.py"
    done = launch(launcher, 4, job)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = sorted(int(m.group(1)) for m in re.finditer(r"STATE OK (\d) (\d+)", done.stdout))
    assert ranks == [0, 1, 2, 3], done.stdout[-3000:]
    assert all(int(n) > 0 for n in re.findall(r"STATE OK \d (\d+)", done.stdout))


# ---- the CUDA backend's host logic, on the numpy stand-in for CuPy ----------------------------


def test_a_state_through_the_cuda_backend_on_a_stand_in_gpu(monkeypatch):
    import sys

    import fake_cupy

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake_cupy.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", fake_cupy.nccl)
    fake_cupy.launches.clear()
    tensors, plan = _state(bucket=32)
    full = full_tensors(tensors)
    shards = {n: {d: fake_cupy.asarray(a) for d, a in by.items()}
              for n, by in source_shards(tensors, full).items()}
    with Runtime(P3, backend="cuda", timeout=SETTLE_S) as rt:
        assert rt.backend.name == "cuda"
        out = rt.reshard_state_sync(plan, shards)
        with pytest.raises(TypeError,
                           match=r"shards\['w'\]\[0\]: expected a numpy or \w*cupy array"):
            rt.reshard_state_sync(plan, {**shards, "w": {**shards["w"], 0: [0.0]}})
    assert_state_delivered({n: {d: fake_cupy.asnumpy(a) for d, a in by.items()}
                            for n, by in out.items()}, tensors, full)
    assert any(x.startswith("wait") for x in fake_cupy.launches)  # device-side waits used
