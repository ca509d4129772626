"""Resharding a whole state at once: plan_state_resharding through the public API."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import clusters, problems

from scheduler import (
    Cluster,
    ClusterError,
    CostModel,
    DeviceMesh,
    P,
    PlanError,
    PlanOptions,
    Sharding,
    ShardingError,
    StateOptions,
    StateReshardPlan,
    StateTensor,
    estimate,
    lower_bound,
    plan_resharding,
    plan_state_resharding,
    state_lower_bound,
)
from scheduler.regions import contains

P3 = Cluster.preset("p3.8xlarge", 4)  # 4 hosts x 4 GPUs, one NIC per host
DGX = Cluster.preset("dgx-h100", 2)  # one NIC per GPU
DGX3 = Cluster.preset("dgx-h100", 3)


def _box(region):
    return tuple(slice(a, b) for a, b in region)


def execute(plan: StateReshardPlan) -> None:
    """Run the plan on numpy arrays, bucket by bucket: every sender sends from its source
    shard or from what it already received; at the end every destination device holds its
    destination region, each element delivered once."""
    rng = np.random.default_rng(0)
    data = {n: rng.standard_normal(t.shape) for n, t in plan.tensors.items()}
    src = {n: t.src.device_regions(t.shape) for n, t in plan.tensors.items()}
    dst = {n: t.dst.device_regions(t.shape) for n, t in plan.tensors.items()}
    out = {n: {d: np.full(t.shape, np.nan) for d in dst[n]} for n, t in plan.tensors.items()}
    count = {n: {d: np.zeros(t.shape, int) for d in dst[n]} for n, t in plan.tensors.items()}
    seen = set()
    for bucket in plan.buckets:
        for name, i in bucket:
            assert (name, i) not in seen
            seen.add((name, i))
            t = plan.plans[name].transfers[i]
            box = _box(t.region)
            own = src[name].get(t.sender)
            if own is not None and contains(own, t.region):
                values = data[name][box]
            else:  # forwarding what it received: all of it must have arrived
                assert t.sender in out[name], (name, i, t)
                values = out[name][t.sender][box]
                assert not np.isnan(values).any(), (name, i, t)
            for r in t.receivers:
                assert contains(dst[name][r], t.region)
                out[name][r][box] = values
                count[name][r][box] += 1
    assert len(seen) == plan.num_transfers
    for name, regions in dst.items():
        for d, region in regions.items():
            box = _box(region)
            np.testing.assert_array_equal(out[name][d][box], data[name][box])
            assert (count[name][d][box] == 1).all(), (name, d)
            outside = np.ones(plan.tensors[name].shape, bool)
            outside[box] = False
            assert not count[name][d][outside].any()


def _mesh(devices, names=("a", "b")):
    return DeviceMesh(devices, names)


def _random_sharding(rng: random.Random, devices: list[int], rank: int) -> Sharding:
    n = len(devices)
    shape = (2, n // 2) if n % 2 == 0 and n > 2 and rng.random() < 0.6 else (1, n)
    mesh = _mesh(np.array(devices).reshape(shape).tolist())
    entries = [None] * rank
    for axis in rng.sample(["a", "b"], k=rng.randint(0, 2)):
        if rank == 0:
            break
        d = rng.randrange(rank)
        entries[d] = axis if entries[d] is None else (entries[d], axis)
    return Sharding(mesh, P(*entries))


def _random_state(rng: random.Random, cluster: Cluster, kind: str) -> dict[str, StateTensor]:
    n = cluster.num_devices
    size = rng.choice([2, 4, 6, 8])
    src_devs = rng.sample(range(n), size)
    if kind == "identical":
        dst_devs = list(src_devs)
    elif kind == "disjoint":
        dst_devs = rng.sample([d for d in range(n) if d not in src_devs], rng.choice([2, 4, 8]))
    else:  # overlapping
        keep = rng.sample(src_devs, size // 2)
        dst_devs = keep + rng.sample([d for d in range(n) if d not in src_devs], size // 2)
    tensors = {}
    for k in range(rng.randint(1, 4)):
        rank = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 11) for _ in range(rank))  # uneven shards
        tensors[f"t{k}"] = StateTensor(
            shape, rng.choice(["float32", "bfloat16", "int64"]),
            _random_sharding(rng, src_devs, rank), _random_sharding(rng, dst_devs, rank))
    return tensors


@pytest.mark.parametrize("kind", ["disjoint", "overlapping", "identical"])
@pytest.mark.parametrize("strategy", ["broadcast", "send_recv", "local_allgather"])
def test_random_states_deliver_every_element_once(kind, strategy):
    rng = random.Random(f"{kind}-{strategy}")
    for trial in range(6):
        cluster = P3 if trial % 2 else DGX
        tensors = _random_state(rng, cluster, kind)
        bucket = rng.choice([64, 256, 1 << 20])
        plan = plan_state_resharding(
            tensors, cluster, StateOptions(strategy=strategy, budget=20_000, bucket_bytes=bucket))
        plan.check()
        execute(plan)
        assert plan.estimate_seconds >= plan.bound_seconds - 1e-12
        assert plan.bound_seconds == pytest.approx(state_lower_bound(tensors, cluster))
        # The estimate is the cost model's run of the schedule the runtime launches.
        schedule = [t for _, t in plan.schedule()]
        assert plan.estimate_seconds == max(
            (x.end for x in CostModel(cluster).run(schedule)), default=0.0)
        for k, b in enumerate(plan.buckets):
            staged = plan.bucket_device_nbytes(k)
            assert max(staged.values(), default=0) <= bucket or len(b) == 1
            assert sum(staged.values()) >= plan.bucket_nbytes(k)  # every device counted
        assert set(plan.oversized) <= {b[0] for b in plan.buckets if len(b) == 1}
        assert max(plan.peak_staging_bytes.values(), default=0) <= max(
            bucket, *(plan.bucket_nbytes(k) for k in range(len(plan.buckets))))
        assert StateReshardPlan.from_json(plan.to_json()) == plan


def _tp_state(layers: int = 4):
    src = Sharding(P3.mesh([0]), P(None, ("host", "gpu")))  # TP 4 on host 0
    dst = Sharding(P3.mesh([1, 2]), P(None, "gpu"))  # TP 4 x DP 2 on hosts 1 and 2
    shapes = {"qkv": (96, 64), "o": (64, 64), "up": (130, 64), "down": (64, 130)}
    return {f"l{i}.{n}": StateTensor(s, "float32", src, dst)
            for i in range(layers) for n, s in shapes.items()}


def test_bound_sums_every_tensor_and_is_at_least_each_tensor_bound():
    tensors = _tp_state()
    total = state_lower_bound(tensors, P3)
    singles = [lower_bound(t.shape, t.dtype, t.src, t.dst, P3) for t in tensors.values()]
    latency = P3.nic_latency_s
    assert total >= max(singles)
    # Host 0 holds everything and its one NIC sends every byte out at least once.
    nbytes = sum(t.nbytes for t in tensors.values())
    assert total == pytest.approx(max(nbytes / P3.nic_bytes_per_s + latency,
                                      sum(s - latency for s in singles) + latency))


def test_joint_plan_beats_tensor_by_tensor():
    tensors = _tp_state()
    plan = plan_state_resharding(tensors, P3, StateOptions(budget=50_000))
    plan.check()
    sequential = sum(
        estimate(plan_resharding(t.shape, t.dtype, t.src, t.dst, P3,
                                 PlanOptions(budget=50_000)), P3)
        for t in tensors.values())
    assert plan.bound_seconds <= plan.estimate_seconds <= sequential


def test_joint_balancing_spreads_what_per_tensor_planning_piles_on_one_nic():
    # Two tensors, each replicated on GPUs 0 and 1 (different NICs on a DGX), each needed
    # whole by one GPU of host 1. Balanced alone (by size: one send, one sender), each picks
    # the first NIC; together the second tensor takes the other one.
    src = Sharding(_mesh([[0, 1]]), P())
    tensors = {"a": StateTensor((1024, 1024), "float32", src, Sharding(_mesh([[8]]), P())),
               "b": StateTensor((1024, 1024), "float32", src, Sharding(_mesh([[9]]), P()))}
    options = StateOptions(balance="size")
    joint = plan_state_resharding(tensors, DGX, options)
    joint.check()
    alone = [plan_resharding(t.shape, t.dtype, t.src, t.dst, DGX, PlanOptions(balance="size"))
             for t in tensors.values()]
    assert {p.transfers[0].sender for p in alone} == {0}  # piled on GPU 0's NIC
    assert {p.transfers[0].sender for p in joint.plans.values()} == {0, 1}
    model = CostModel(DGX)
    together = max(x.end for x in model.run([t for p in alone for t in p.transfers]))
    one_after_another = sum(model.plan_time(p) for p in alone)
    assert joint.estimate_seconds < 0.6 * together
    assert joint.estimate_seconds < 0.6 * one_after_another
    # Side by side: the two take what one takes alone.
    assert joint.estimate_seconds == pytest.approx(model.plan_time(alone[0]), rel=0.05)


def test_buckets_bound_staging_and_cut_large_transfers():
    tensors = _tp_state(2)
    cap = 4096
    plan = plan_state_resharding(tensors, P3, StateOptions(bucket_bytes=cap, budget=20_000))
    plan.check()
    execute(plan)
    assert len(plan.buckets) > 1
    assert not plan.oversized  # every box could be cut below 4 KiB
    assert all(max(plan.bucket_device_nbytes(k).values()) <= cap
               for k in range(len(plan.buckets)))
    assert 0 < max(plan.peak_staging_bytes.values()) <= cap
    # Smaller buckets cost barriers, never correctness; one big bucket is no slower.
    big = plan_state_resharding(tensors, P3, StateOptions(budget=20_000))
    assert len(big.buckets) == 1
    assert big.estimate_seconds <= plan.estimate_seconds
    assert "buckets of at most 4.00 KiB per device" in plan.to_text()


def test_a_row_larger_than_a_bucket_runs_alone_and_is_said():
    src = Sharding(_mesh([[0]]), P())
    dst = Sharding(_mesh([[4]]), P())
    # 48 B, cut along its longest dim (4) at most: 4 parts of 12 B, each over 10 B.
    tensors = {"w": StateTensor((4, 3), "float32", src, dst)}
    plan = plan_state_resharding(tensors, P3, StateOptions(bucket_bytes=10))
    plan.check()
    execute(plan)
    assert len(plan.oversized) == 4 and all(len(b) == 1 for b in plan.buckets)
    assert "larger than a bucket" in plan.to_text()


def test_identical_layouts_are_local_copies_and_stage_nothing():
    s = Sharding(P3.mesh([0, 1]), P("host", "gpu"))
    plan = plan_state_resharding({"w": StateTensor((8, 9), "float32", s, s)}, P3)
    plan.check()
    assert all(t.is_local_copy for t in plan.plans["w"].transfers)
    assert plan.network_bytes == 0 and not plan.peak_staging_bytes
    assert plan.bound_seconds == 0


def test_check_catches_a_broken_state_plan():
    plan = plan_state_resharding(_tp_state(1), P3, StateOptions(bucket_bytes=4096))
    flat = [k for b in plan.buckets for k in b]
    swapped = dict(plan.__dict__)
    swapped["buckets"] = ((flat[1], flat[0], *flat[2:]),) if flat[0][0] == flat[1][0] else (
        tuple(flat[1:]),)
    with pytest.raises(PlanError):
        StateReshardPlan(**swapped).check()
    merged = dict(plan.__dict__, buckets=(tuple(flat),))
    with pytest.raises(PlanError, match="bucket_bytes"):
        StateReshardPlan(**merged).check()


def test_input_errors_name_the_argument():
    good = _tp_state(1)
    with pytest.raises(TypeError, match="tensors"):
        plan_state_resharding([("w", good["l0.o"])], P3)
    with pytest.raises(ValueError, match="tensors: names"):
        plan_state_resharding({"": good["l0.o"]}, P3)
    with pytest.raises(TypeError, match=r"tensors\['w'\]"):
        plan_state_resharding({"w": (4, 4)}, P3)
    with pytest.raises(TypeError, match="cluster"):
        plan_state_resharding(good, "p3")
    with pytest.raises(TypeError, match="options"):
        plan_state_resharding(good, P3, {"bucket_bytes": 1})
    with pytest.raises(ValueError, match="bucket_bytes"):
        StateOptions(bucket_bytes=0)
    with pytest.raises(ClusterError, match=r"tensors\['w'\]\.dst"):
        plan_state_resharding({"w": StateTensor((4,), "float32", Sharding(_mesh([[0]]), P()),
                                                Sharding(_mesh([[99]]), P()))}, P3)
    s = Sharding(P3.mesh([0]), P(None, ("host", "gpu")))
    with pytest.raises(ShardingError, match="src"):
        StateTensor((8,), "float32", s, s)  # a 1-d tensor, a spec of two dims
    with pytest.raises(TypeError, match="dtype"):
        StateTensor((8,), None, s, s)
    with pytest.raises(TypeError, match="dst"):
        StateTensor((8, 8), "float32", s, "s")
    # PlanOptions are taken too, with the default buckets.
    plan = plan_state_resharding(good, P3, PlanOptions(balance="size"))
    assert plan.bucket_bytes == StateOptions().bucket_bytes


def test_empty_state_and_json_errors():
    plan = plan_state_resharding({}, P3)
    plan.check()
    assert plan.estimate_seconds == plan.bound_seconds == 0 and not plan.buckets
    with pytest.raises(ValueError, match="state plan JSON"):
        StateReshardPlan.from_json('{"tensors": {}}')


def test_a_state_too_large_to_cost_plans_in_linear_time_one_lane_per_tensor():
    # A budget too small to cost one candidate: auto builds its linear plan, every tensor's
    # transfers on one lane; the plan stays exact and no worse than spreading each tensor.
    tensors = _tp_state(4)
    plan = plan_state_resharding(tensors, DGX3, StateOptions(budget=1, bucket_bytes=1 << 30))
    plan.check()
    execute(plan)
    assert "over budget" in plan.stats["auto_choice"]
    # Both joint candidates (the linear balancing and the paced one) keep a tensor's sends
    # on one lane.
    assert plan.stats["choice"] in ("joint", "joint-paced")
    lanes = set()
    for p in plan.plans.values():
        sent = [t for t in p.transfers  # the balanced sends: across hosts
                if any(DGX3.host_of(r) != DGX3.host_of(t.sender) for r in t.receivers)]
        assert sent and len({t.lane for t in sent}) == 1
        lanes |= {t.lane for t in sent}
    assert len(lanes) > 1
    assert plan.bound_seconds <= plan.estimate_seconds


def test_buckets_cap_each_device_not_the_whole_bucket():
    # Two tensors on disjoint devices: each device stages one tensor's bytes, so a cap of
    # one tensor's bytes per device holds both in one bucket.
    tensors = {
        "a": StateTensor((64, 64), "float32", Sharding(_mesh([[0]]), P()),
                         Sharding(_mesh([[8]]), P())),
        "b": StateTensor((64, 64), "float32", Sharding(_mesh([[1]]), P()),
                         Sharding(_mesh([[9]]), P())),
    }
    plan = plan_state_resharding(tensors, DGX, StateOptions(bucket_bytes=64 * 64 * 4))
    plan.check()
    assert len(plan.buckets) == 1 and not plan.oversized
    assert plan.bucket_nbytes(0) == 2 * 64 * 64 * 4
    assert max(plan.peak_staging_bytes.values()) == 64 * 64 * 4


def test_real_model_shapes_count_their_parameters():
    # The benchmark's models, by their published sizes: DeepSeek-V3 671 B without its
    # multi-token-prediction layer, Llama-3-70B 70.6 B.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from state_models import deepseek_v3_shapes, llama3_70b_shapes

    def count(shapes):
        return sum(int(np.prod(s)) for s, _ in shapes.values())

    assert round(count(deepseek_v3_shapes()) / 1e9) == 671
    assert round(count(llama3_70b_shapes()) / 1e9, 1) == 70.6


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_states_check_and_never_lose_to_planning_tensor_by_tensor(data):
    cluster = data.draw(clusters())
    tensors = {}
    for k in range(data.draw(st.integers(1, 3))):
        shape, dtype, src, dst, _ = data.draw(problems(cluster))
        tensors[f"t{k}"] = StateTensor(shape, dtype, src, dst)
    bucket = data.draw(st.sampled_from([16, 256, 1 << 30]))
    options = StateOptions(budget=5_000, bucket_bytes=bucket, per_tensor=True)
    plan = plan_state_resharding(tensors, cluster, options)
    plan.check()
    execute(plan)
    assert plan.bound_seconds <= plan.estimate_seconds + 1e-12
    # The kept plan is the fastest candidate, the tensors' own plans concatenated among them
    # (asked for: per_tensor=True).
    assert plan.estimate_seconds == min(plan.stats["candidates"].values())
    assert plan.estimate_seconds <= plan.stats["candidates"]["per-tensor"]
    if bucket == 1 << 30:  # nothing cut, one bucket: no slower than one plan after another
        alone = sum(estimate(plan_resharding(t.shape, t.dtype, t.src, t.dst, cluster,
                                             PlanOptions(budget=5_000)), cluster)
                    for t in tensors.values())
        assert plan.estimate_seconds <= alone * (1 + 1e-9)


def _in_flight_peak(plan: StateReshardPlan, cluster: Cluster) -> dict[int, int]:
    """Per device, the most staged bytes of transfers running at once when the cost model
    runs the plan's schedule (start and end times of every transfer)."""
    schedule = [t for _, t in plan.schedule()]
    events: dict[int, list[tuple[float, int]]] = {}
    for t, x in zip(schedule, CostModel(cluster).run(schedule)):
        if t.is_local_copy:
            continue
        for d in t.devices:
            events.setdefault(d, []).extend([(x.start, t.nbytes), (x.end, -t.nbytes)])
    peak = {}
    for d, ev in events.items():
        level = top = 0
        for _, delta in sorted(ev, key=lambda e: (e[0], e[1])):  # ends first at a tie
            level += delta
            top = max(top, level)
        peak[d] = top
    return peak


@pytest.mark.parametrize("cap", [4096, 20_000, 1 << 20])
def test_no_device_ever_has_more_than_a_bucket_in_flight(cap):
    # The staging window: whatever the lanes do, what a device has started and not
    # finished stays within bucket_bytes, and peak_staging_bytes says how much at most.
    tensors = _tp_state(3)
    plan = plan_state_resharding(tensors, DGX3, StateOptions(bucket_bytes=cap, budget=20_000))
    plan.check()
    assert not plan.oversized
    seen = _in_flight_peak(plan, DGX3)
    assert max(seen.values()) <= cap
    for d, v in seen.items():
        assert v <= plan.peak_staging_bytes[d] <= cap


def test_identical_tensors_on_renamed_hosts_are_planned_once():
    # Two pipeline stages on different hosts sending the same layer shape to the same
    # engine: one class, and the second tensor's plan is the first's with hosts renamed
    # (the same transfers, the same cost alone).
    engine = Sharding(P3.mesh([2, 3]), P("gpu", None))
    tensors = {f"stage{s}.w": StateTensor((64, 32), "float32",
                                          Sharding(P3.mesh([s]), P(None, "gpu")), engine)
               for s in (0, 1)}
    plan = plan_state_resharding(tensors, P3, StateOptions(budget=20_000))
    plan.check()
    execute(plan)
    assert plan.stats["tensor_classes"] == 1
    alone = {n: plan_resharding(t.shape, t.dtype, t.src, t.dst, P3, PlanOptions(budget=20_000))
             for n, t in tensors.items()}
    model = CostModel(P3)
    assert model.plan_time(alone["stage0.w"]) == pytest.approx(model.plan_time(alone["stage1.w"]))
    # Side by side (different source hosts): the two take less than one after the other.
    assert plan.estimate_seconds < sum(model.plan_time(p) for p in alone.values())


def _moe_state(layers: int = 2, width: int = 128):
    """A small MoE refit: per layer, stacked experts split over the 8 GPUs of its stage
    (one host per stage), a replicated router and norm; to TP 16 x DP 2 on four other
    hosts (each expert's intermediate dim split, the router and norm on every GPU)."""
    cluster = Cluster.preset("dgx-h100", 2 + 4)
    engine = DeviceMesh(np.arange(16, 48).reshape(2, 16).tolist(), ("dp", "tp"))
    out = {}
    for i in range(layers):
        stage = DeviceMesh(list(range(8 * (i % 2), 8 * (i % 2) + 8)), ("ep",))
        experts = Sharding(stage, P("ep", None, None))
        for name, spec in (("gate", P(None, "tp", None)), ("up", P(None, "tp", None)),
                           ("down", P(None, None, "tp"))):
            shape = (16, 2 * width, width) if name != "down" else (16, width, 2 * width)
            out[f"l{i}.experts.{name}"] = StateTensor(shape, "bfloat16", experts,
                                                      Sharding(engine, spec))
        for name, shape in (("router", (16, width)), ("norm", (width,))):
            out[f"l{i}.{name}"] = StateTensor(shape, "bfloat16", Sharding(stage, P()),
                                              Sharding(engine, P()))
    return out, cluster


def test_a_moe_state_of_identical_layers_plans_near_its_bound():
    # Every stage's experts reach every TP rank of both replicas: the paced candidate sends
    # each tensor in rounds over all the lanes, and the plan delivers every element once.
    small, cluster = _moe_state(4)
    plan = plan_state_resharding(small, cluster)
    plan.check()
    execute(plan)  # small enough to run on arrays
    tensors, cluster = _moe_state(4, width=1024)  # 1.5 GiB: bandwidth, not latency, counts
    plan = plan_state_resharding(tensors, cluster)
    plan.check()
    assert "joint-paced" in plan.stats["candidates"]
    assert "per-tensor" not in plan.stats["candidates"]  # not asked for
    # Kept over the joint balancing (each tensor on one lane, tensor after tensor: the
    # stages' experts pile on a few lanes), well within twice the bound.
    assert plan.stats["choice"] == "joint-paced"
    assert plan.estimate_seconds <= 0.9 * plan.stats["candidates"]["joint"]
    assert plan.bound_seconds <= plan.estimate_seconds <= 1.8 * plan.bound_seconds


def test_per_tensor_candidates_are_asked_for_and_the_option_checked():
    tensors, cluster = _moe_state(2)
    plan = plan_state_resharding(tensors, cluster, StateOptions(per_tensor=True))
    plan.check()
    assert {"joint", "joint-paced", "per-tensor", "per-tensor-interleaved"} == set(
        plan.stats["candidates"])
    assert plan.estimate_seconds == min(plan.stats["candidates"].values())
    assert "per-tensor candidates" in plan.stats["options"]
    with pytest.raises(TypeError, match="per_tensor"):
        StateOptions(per_tensor=1)


def test_the_bound_adds_a_network_latency_only_to_what_crosses_a_nic():
    # The busiest GPU is fed over NVLink on its own host (36 B), while one byte crosses
    # hosts: the GPU's term pays no network latency, so the bound stays under the plan.
    cluster = Cluster(2, 7, nic_gbps=10.0, nvlink_gbps=300.0, nic_latency_us=5.0,
                      nvlink_latency_us=0.0)
    tensors = {
        "far": StateTensor((1,), "int8", Sharding(_mesh([[7, 8, 9]]), P()),
                           Sharding(_mesh([[7, 8, 9, 2]]), P())),
        "near": StateTensor((1, 3, 6), "float16", Sharding(_mesh([[0]]), P()),
                            Sharding(_mesh([[1]]), P())),
    }
    plan = plan_state_resharding(tensors, cluster, StateOptions(bucket_bytes=16))
    plan.check()
    assert plan.bound_seconds <= plan.estimate_seconds
    assert plan.bound_seconds == pytest.approx(cluster.nic_latency_s + 1 / cluster.nic_bytes_per_s)
