"""The step graph (scheduler/graph.py), its lowering (lowering.py) and the validator (validate.py).

Documented semantics: every device has a compute lane and one comm lane per channel it takes
part in (``fwd<s>``: activations from stage s to s + 1; ``bwd<s>``: their gradients back); one
op per compute per device and one per plan transfer; a transfer's sender in the producing stage
waits for the compute that made its data, on its device; a compute waits for every transfer
of its input's resharding its device takes part in; each plan ``after`` is a wait between the
two senders; ops are numbered in one global launch order and every lane lists its ops in that
order. The validator dry-runs the graph and names what blocks (a grid of lanes × steps) or the
missing data dependency.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from scheduler import (
    COMPUTE,
    SCHEDULES,
    Channel,
    Cluster,
    ClusterError,
    Compute,
    Dep,
    DeviceMesh,
    Lane,
    P,
    PlanCache,
    PlanOptions,
    ProgramError,
    Sharding,
    StepGraph,
    TransferOp,
    lower,
    make_schedule,
    plan_resharding,
    reshard_graph,
    validate,
)
from scheduler.lowering import Boundary
from scheduler.schedules import dependency_order

NUM_STAGES = 3
NUM_MB = 4


def pipeline(num_stages: int = NUM_STAGES, shape=(8, 8)):
    cluster = Cluster.preset("p3.8xlarge", num_stages)
    meshes = [cluster.mesh([h]) for h in range(num_stages)]
    boundaries = [
        Boundary(shape, "float32", Sharding(meshes[s], P("gpu", None)),
                 Sharding(meshes[s + 1], P(None, "gpu")))
        for s in range(num_stages - 1)
    ]
    return cluster, meshes, boundaries


@pytest.fixture(scope="module")
def lowered():
    cluster, meshes, boundaries = pipeline()
    return {name: lower(meshes, boundaries, make_schedule(name, NUM_STAGES, NUM_MB), cluster)
            for name in SCHEDULES}


def transfers_of(graph: StepGraph, channel: Channel, mb: int) -> list[int]:
    return [op.id for op in graph.ops if isinstance(op.body, TransferOp)
            and (op.body.channel, op.body.microbatch) == (channel, mb)]


def compute_of(graph: StepGraph, stage: int, mb: int, kind: str, device: int) -> int:
    return graph.by_key[f"{stage}{kind}{mb}@{device}"]


# ---- values ----------------------------------------------------------------------------


def test_channel_value():
    ch = Channel("fwd", 2)
    assert str(ch) == "fwd2" and Channel.parse("fwd2") == ch
    assert (ch.src_stage, ch.dst_stage, ch.kind) == (2, 3, "F")
    back = Channel("bwd", 2)
    assert (back.src_stage, back.dst_stage, back.kind) == (3, 2, "B")
    assert len({ch, Channel("fwd", 2), back}) == 2
    with pytest.raises(ValueError, match="direction"):
        Channel("up", 0)
    with pytest.raises(ValueError, match="boundary"):
        Channel("fwd", -1)
    with pytest.raises(ValueError, match="channel"):
        Channel.parse("fwd")


# ---- lowering ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_op_runs_once_in_lane_order(lowered, name):
    graph = lowered[name]
    steps = validate(graph)
    step_of = {i: k for k, step in enumerate(steps) for i in step}
    assert sorted(step_of) == list(range(len(graph.ops)))
    for ids in graph.lanes.values():
        assert [step_of[i] for i in ids] == sorted(step_of[i] for i in ids)
        assert len(set(step_of[i] for i in ids)) == len(ids)  # one op per lane per step
    for op in graph.ops:  # after every op it waits for
        assert all(step_of[d.op] < step_of[op.id] for d in op.waits)


@pytest.mark.parametrize("name", SCHEDULES)
def test_devices_stages_and_compute_lanes(lowered, name):
    graph = lowered[name]
    sched = make_schedule(name, NUM_STAGES, NUM_MB)
    assert graph.schedule == sched
    assert graph.devices == tuple(range(4 * NUM_STAGES))
    assert graph.stages == tuple(Cluster.preset("p3.8xlarge", 3).mesh([h]) for h in range(3))
    for d in graph.devices:
        s = graph.stage_of(d)
        assert s == d // 4  # stage s is host s: devices 4s..4s+3
        computes = [graph.ops[i] for i in graph.lanes[Lane(d, COMPUTE)]]
        assert [op.body for op in computes] == [Compute(s, a.microbatch, a.kind)
                                                for a in sched.actions[s]]
        assert all(op.devices == (d,) and op.stream == COMPUTE for op in computes)
        for lane, ids in graph.lanes.items():
            if lane.device == d and lane.stream != COMPUTE:
                assert all(isinstance(graph.ops[i].body, TransferOp) for i in ids)


@pytest.mark.parametrize("name", SCHEDULES)
def test_one_transfer_op_per_plan_transfer(lowered, name):
    graph = lowered[name]
    assert set(graph.plans) == {Channel(d, b) for d in ("fwd", "bwd") for b in range(2)}
    for channel, plan in graph.plans.items():
        for mb in range(NUM_MB):
            ops = [graph.ops[i] for i in transfers_of(graph, channel, mb)]
            assert [op.body.transfer for op in ops] == list(plan.transfers)
            assert [op.body.index for op in ops] == list(range(len(plan.transfers)))
            for op in ops:  # the channel's stream, or its lane's
                lane = op.body.transfer.lane
                assert op.stream == (f"{channel}.{lane}" if lane else str(channel))
                assert op.devices == op.body.transfer.devices
        assert plan.src.mesh == graph.stages[channel.src_stage]
        assert plan.dst.mesh == graph.stages[channel.dst_stage]
    n_transfers = sum(len(p.transfers) for p in graph.plans.values()) * NUM_MB
    assert len(graph.ops) == n_transfers + 2 * NUM_MB * 12


@pytest.mark.parametrize("name", SCHEDULES)
def test_ids_follow_one_dependency_order(lowered, name):
    graph = lowered[name]
    first = {}
    for op in graph.ops:
        b = op.body
        key = (("C", b.stage, b.kind, b.microbatch) if isinstance(b, Compute)
               else ("T", b.channel, b.microbatch))
        first.setdefault(key, op.id)
    order = [("C", s, a.kind, a.microbatch) for s, a in dependency_order(graph.schedule)]
    assert sorted(order, key=first.__getitem__) == order
    for i in range(NUM_MB):
        for b in range(NUM_STAGES - 2):
            assert first[("T", Channel("fwd", b), i)] < first[("T", Channel("fwd", b + 1), i)]
            assert first[("T", Channel("bwd", b + 1), i)] < first[("T", Channel("bwd", b), i)]
    for b in range(NUM_STAGES - 1):  # activations leave in the producer's forward order
        fwd = sorted(range(NUM_MB), key=lambda i: first[("T", Channel("fwd", b), i)])
        assert fwd == [a.microbatch for a in graph.schedule.actions[b] if a.kind == "F"]
    for ids in graph.lanes.values():  # every lane: a subsequence of the global order
        assert list(ids) == sorted(ids)


@pytest.mark.parametrize("name", SCHEDULES)
def test_lanes_per_device(lowered, name):
    graph = lowered[name]
    for d in graph.devices:
        s = graph.stage_of(d)
        want = {f"{k}{b}" for k in ("fwd", "bwd") for b in (s - 1, s) if 0 <= b < NUM_STAGES - 1}
        streams = list(graph.program(d))
        assert streams[0] == COMPUTE and streams[1:] == sorted(streams[1:])
        # A channel's stream, and one per lane of its plan ("fwd0.2"): named after it.
        assert {x.split(".")[0] for x in streams[1:]} == want
        for stream, ids in graph.program(d).items():
            if stream != COMPUTE:
                assert {str(graph.ops[i].body.channel) for i in ids} == {stream.split(".")[0]}


@pytest.mark.parametrize("name", SCHEDULES)
def test_collectives_have_one_order_on_every_device(lowered, name):
    graph = lowered[name]
    for (la, ia), (lb, ib) in itertools.combinations(graph.lanes.items(), 2):
        if la.stream == lb.stream != COMPUTE:
            common = set(ia) & set(ib)
            assert [i for i in ia if i in common] == [i for i in ib if i in common]


@pytest.mark.parametrize("name", SCHEDULES)
def test_data_dependencies_are_waits_on_one_device(lowered, name):
    graph = lowered[name]
    p = NUM_STAGES
    for op in graph.ops:
        b = op.body
        if isinstance(b, Compute):
            d = op.devices[0]
            assert all(dep.src == dep.dst == d for dep in op.waits)
            into = (Channel("fwd", b.stage - 1) if b.kind == "F" and b.stage > 0 else
                    Channel("bwd", b.stage) if b.kind == "B" and b.stage < p - 1 else None)
            want = set() if into is None else {
                i for i in transfers_of(graph, into, b.microbatch) if d in graph.ops[i].devices}
            assert {dep.op for dep in op.waits} == want, (op.key, op.waits)
        else:
            t, ch = b.transfer, b.channel
            want = set()
            if t.sender in graph.stages[ch.src_stage].device_ids:
                want.add((compute_of(graph, ch.src_stage, b.microbatch, ch.kind, t.sender),
                          t.sender, t.sender))
            base = op.id - b.index
            want |= {(base + j, graph.plans[ch].transfers[j].sender, t.sender) for j in t.after}
            assert set(op.waits) == want
    assert graph.recorded == {(d.op, d.src) for op in graph.ops for d in op.waits}
    assert graph.labels == tuple(str(op.body) for op in graph.ops)
    for c, ins in graph.data_inputs.items():
        assert set(ins) == {d.op for d in graph.ops[c].waits}


def test_plan_after_becomes_a_wait_between_senders():
    cluster, meshes, boundaries = pipeline(2)
    plan = plan_resharding((8, 8), "float32", boundaries[0].producer, boundaries[0].consumer,
                           cluster, PlanOptions(strategy="send_recv", balance="none"))
    a = 0
    b = next(k for k, t in enumerate(plan.transfers) if t.sender != plan.transfers[0].sender)
    ts = list(plan.transfers)
    ts[b] = dataclasses.replace(ts[b], after=(a,))
    serial = dataclasses.replace(plan, transfers=tuple(ts))
    graph = lower(meshes, boundaries, make_schedule("1f1b", 2, 2), cluster,
                  plans={Channel("fwd", 0): serial})
    assert graph.plans[Channel("fwd", 0)] is serial
    for mb in range(2):
        ids = transfers_of(graph, Channel("fwd", 0), mb)
        waits = graph.ops[ids[b]].waits
        assert Dep(ids[a], ts[a].sender, ts[b].sender) in waits
    steps = validate(graph)
    step_of = {i: k for k, step in enumerate(steps) for i in step}
    ids = transfers_of(graph, Channel("fwd", 0), 0)
    assert step_of[ids[a]] < step_of[ids[b]]


def test_given_plans_are_checked():
    cluster, meshes, boundaries = pipeline(2)
    fwd = plan_resharding((8, 8), "float32", boundaries[0].producer, boundaries[0].consumer,
                          cluster)
    sched = make_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match=r"plans\[bwd0\]: the plan moves"):
        lower(meshes, boundaries, sched, cluster, plans={Channel("bwd", 0): fwd})
    with pytest.raises(ValueError, match=r"plans: channels \['fwd1'\]"):
        lower(meshes, boundaries, sched, cluster, plans={Channel("fwd", 1): fwd})
    with pytest.raises(TypeError, match=r"plans\[fwd0\]"):
        lower(meshes, boundaries, sched, cluster, plans={Channel("fwd", 0): "plan"})


def test_cache_plans_each_boundary_once_per_options():
    cluster, meshes, boundaries = pipeline()
    cache = PlanCache(cluster)
    a = lower(meshes, boundaries, make_schedule("1f1b", 3, 2), cluster, cache=cache)
    assert len(cache) == 4
    b = lower(meshes, boundaries, make_schedule("eager-1f1b", 3, 5), cluster, cache=cache)
    assert len(cache) == 4
    assert all(a.plans[k] is b.plans[k] for k in a.plans)
    c = lower(meshes, boundaries, make_schedule("1f1b", 3, 2), cluster,
              PlanOptions(strategy="send_recv"), cache=cache)
    assert len(cache) == 8
    assert all(len(t.receivers) == 1 for p in c.plans.values() for t in p.transfers)
    with pytest.raises(ValueError, match="cache"):
        lower(meshes, boundaries, make_schedule("1f1b", 3, 2), Cluster.preset("dgx-h100", 3),
              cache=cache)


# ---- text form and JSON ------------------------------------------------------------------


def test_sender_only_devices_do_not_wait_for_data():
    # Two hosts, stage 0 = GPU 0 of host 0, stage 1 = GPU 0 of host 1; replicated boundary.
    cluster = Cluster.preset("p3.8xlarge", 2)
    m0, m1 = DeviceMesh([0], ("gpu",)), DeviceMesh([4], ("gpu",))
    b = Boundary((16,), "float32", Sharding(m0, P()), Sharding(m1, P()))
    graph = lower([m0, m1], [b], make_schedule("gpipe", 2, 2), cluster)
    assert graph.to_text() == "\n".join([
        "d0 compute: 0F0 0F1 0B0<bwd0:0#0 0B1<bwd0:1#0",
        "d0 bwd0: bwd0:0#0 bwd0:1#0",
        "d0 fwd0: fwd0:0#0<0F0 fwd0:1#0<0F1",
        "d4 compute: 1F0<fwd0:0#0 1F1<fwd0:1#0 1B0 1B1",
        "d4 bwd0: bwd0:0#0<1B0 bwd0:1#0<1B1",
        "d4 fwd0: fwd0:0#0 fwd0:1#0",
    ])
    validate(graph)


@pytest.mark.parametrize("name", SCHEDULES)
def test_text_and_json_round_trip(lowered, name):
    graph = lowered[name]
    assert graph.with_text(graph.to_text()) == graph
    back = StepGraph.from_json(graph.to_json())
    assert back == graph
    assert back.digest() == graph.digest()
    assert validate(back) == validate(graph)
    text = graph.to_text()
    for d in graph.devices:
        assert f"d{d} compute:" in text


def test_text_form_names_after_waits_on_other_devices():
    cluster, meshes, boundaries = pipeline(2)
    plan = plan_resharding((8, 8), "float32", boundaries[0].producer, boundaries[0].consumer,
                           cluster, PlanOptions(strategy="send_recv", balance="none"))
    ts = list(plan.transfers)
    k = next(k for k, t in enumerate(ts) if t.sender != ts[0].sender)
    ts[k] = dataclasses.replace(ts[k], after=(0,))
    graph = lower(meshes, boundaries, make_schedule("gpipe", 2, 1), cluster,
                  plans={Channel("fwd", 0): dataclasses.replace(plan, transfers=tuple(ts))})
    line = next(ln for ln in graph.to_text().splitlines()
                if ln.startswith(f"d{ts[k].sender} fwd0"))
    assert f"fwd0:0#{k}<0F0,fwd0:0#0@{ts[0].sender}" in line
    assert graph.with_text(graph.to_text()) == graph


def test_with_text_rejects_unknown_ops_and_bad_lines(lowered):
    graph = lowered["1f1b"]
    with pytest.raises(ValueError, match=r"line 1.*'9F0'"):
        graph.with_text("d0 compute: 9F0")
    with pytest.raises(ValueError, match="line 1 should start with"):
        graph.with_text("compute 0F0")
    with pytest.raises(ValueError, match="neither a compute"):
        graph.with_text("d0 compute: 0X0")


def test_digest_differs_when_a_plan_differs():
    cluster, meshes, boundaries = pipeline(2)
    sched = make_schedule("1f1b", 2, 2)
    a = lower(meshes, boundaries, sched, cluster)
    b = lower(meshes, boundaries, sched, cluster, PlanOptions(strategy="send_recv"))
    assert a.digest() == lower(meshes, boundaries, sched, cluster).digest()
    assert a.digest() != b.digest()


def test_single_stage_has_no_transfers():
    cluster = Cluster.preset("p3.8xlarge", 1)
    graph = lower([cluster.mesh([0])], [], make_schedule("1f1b", 1, 3), cluster)
    assert graph.plans == {}
    assert all(isinstance(op.body, Compute) for op in graph.ops)
    assert graph.to_text().splitlines()[0] == "d0 compute: 0F0 0B0 0F1 0B1 0F2 0B2"
    assert sum(len(s) for s in validate(graph)) == 4 * 6


def test_reshard_graph_is_the_plan_in_order():
    cluster, _, boundaries = pipeline(2)
    plan = plan_resharding((8, 8), "float32", boundaries[0].producer, boundaries[0].consumer,
                           cluster)
    graph = reshard_graph(plan, "comm")
    assert [op.body.transfer for op in graph.ops] == list(plan.transfers)
    assert all(op.stream == (f"comm.{op.body.transfer.lane}" if op.body.transfer.lane
                             else "comm") and op.body.channel is None for op in graph.ops)
    assert graph.plans == {None: plan}
    validate(graph)
    assert StepGraph.from_json(graph.to_json()) == graph
    with pytest.raises(ValueError, match="stream"):
        reshard_graph(plan, COMPUTE)
    with pytest.raises(TypeError, match="plan"):
        reshard_graph("plan")


# ---- bad inputs ----------------------------------------------------------------------------


def test_wrong_number_of_boundaries():
    cluster, meshes, boundaries = pipeline()
    sched = make_schedule("1f1b", 3, 2)
    with pytest.raises(ValueError, match="boundaries"):
        lower(meshes, boundaries[:1], sched, cluster)
    with pytest.raises(ValueError, match="boundaries"):
        lower(meshes, [*boundaries, boundaries[0]], sched, cluster)


def test_producer_mesh_not_stage_mesh():
    cluster, meshes, boundaries = pipeline()
    bad = dataclasses.replace(boundaries[1], producer=Sharding(meshes[0], P("gpu", None)))
    with pytest.raises(ValueError, match=r"boundaries\[1\]\.producer"):
        lower(meshes, [boundaries[0], bad], make_schedule("1f1b", 3, 2), cluster)


def test_consumer_mesh_not_next_stage_mesh():
    cluster, meshes, boundaries = pipeline()
    bad = dataclasses.replace(boundaries[0], consumer=Sharding(meshes[2], P(None, "gpu")))
    with pytest.raises(ValueError, match=r"boundaries\[0\]\.consumer"):
        lower(meshes, [bad, boundaries[1]], make_schedule("1f1b", 3, 2), cluster)


def test_overlapping_stage_meshes():
    cluster = Cluster.preset("p3.8xlarge", 2)
    m0 = DeviceMesh([[0, 1]], ("host", "gpu"))
    m1 = DeviceMesh([[1, 2]], ("host", "gpu"))
    b = Boundary((4, 4), "float32", Sharding(m0, P("gpu")), Sharding(m1, P(None, "gpu")))
    with pytest.raises(ValueError, match="stages") as info:
        lower([m0, m1], [b], make_schedule("gpipe", 2, 2), cluster)
    assert "device 1" in str(info.value)


def test_schedule_with_other_stage_count():
    cluster, meshes, boundaries = pipeline()
    with pytest.raises(ValueError, match="schedule"):
        lower(meshes, boundaries, make_schedule("1f1b", 2, 2), cluster)
    with pytest.raises(ValueError, match="schedule"):
        lower(meshes, boundaries, make_schedule("1f1b", 4, 2), cluster)


def test_device_outside_cluster():
    cluster = Cluster.preset("p3.8xlarge", 2)  # devices 0..7
    m0 = cluster.mesh([0])
    m1 = DeviceMesh([[8, 9, 10, 11]], ("host", "gpu"))
    b = Boundary((8, 8), "float32", Sharding(m0, P("gpu")), Sharding(m1, P(None, "gpu")))
    with pytest.raises(ClusterError, match=r"stages\[1\]") as info:
        lower([m0, m1], [b], make_schedule("1f1b", 2, 2), cluster)
    assert "device 8" in str(info.value)


def test_wrong_types():
    cluster, meshes, boundaries = pipeline()
    sched = make_schedule("1f1b", 3, 2)
    with pytest.raises(TypeError, match="schedule"):
        lower(meshes, boundaries, "1f1b", cluster)
    with pytest.raises(TypeError, match="cluster"):
        lower(meshes, boundaries, sched, "p3.8xlarge")
    with pytest.raises(TypeError, match=r"stages\[1\]"):
        lower([meshes[0], [4, 5, 6, 7], meshes[2]], boundaries, sched, cluster)
    with pytest.raises(TypeError, match=r"boundaries\[0\]"):
        lower(meshes, [None, boundaries[1]], sched, cluster)
    with pytest.raises(TypeError, match="options"):
        lower(meshes, boundaries, sched, cluster, {"strategy": "send_recv"})
    with pytest.raises(ValueError, match="stages"):
        lower([], [], make_schedule("1f1b", 1, 1), cluster)
    with pytest.raises(TypeError, match="graph"):
        validate("d0 compute: 0F0")


# ---- the validator catches broken graphs --------------------------------------------------

STAGE1_DEVICE = 4


def edit_lane(graph: StepGraph, lane: str, edit) -> StepGraph:
    """The graph with one line of its text form changed by ``edit(tokens) -> tokens``."""
    lines = []
    for ln in graph.to_text().splitlines():
        head, _, body = ln.partition(": ")
        lines.append(f"{head}: {' '.join(edit(body.split()))}" if head == lane else ln)
    return graph.with_text("\n".join(lines))


@pytest.mark.parametrize("name", SCHEDULES)
def test_swapped_collectives_deadlock_naming_both_orders(lowered, name):
    graph = lowered[name]
    a, b = "fwd0:0#", "fwd0:1#"

    def swap(tokens):
        ia = next(i for i, t in enumerate(tokens) if t.startswith(a))
        ib = next(i for i, t in enumerate(tokens) if t.startswith(b))
        tokens[ia], tokens[ib] = tokens[ib], tokens[ia]
        return tokens

    broken = edit_lane(graph, f"d{STAGE1_DEVICE} fwd0", swap)
    with pytest.raises(ProgramError, match="deadlock") as info:
        validate(broken)
    msg = str(info.value)
    assert "lane" in msg and "step 0" in msg  # the grid's header
    assert f"d{STAGE1_DEVICE} fwd0" in msg and ">fwd0:" in msg  # stuck lanes, marked
    assert "launched in different orders" in msg and "cycle:" in msg
    assert any(f"d{e} fwd0 runs" in msg for e in range(4))  # a stage-0 peer's order
    validate(graph)  # the original is untouched


@pytest.mark.parametrize("name", SCHEDULES)
def test_missing_wait_is_a_dependency_violation(lowered, name):
    graph = lowered[name]
    broken = edit_lane(graph, f"d{STAGE1_DEVICE} compute",
                       lambda ts: [t.split("<")[0] if t.startswith("1F0") else t for t in ts])
    with pytest.raises(ProgramError, match="dependency violation") as info:
        validate(broken)
    assert f"device {STAGE1_DEVICE} runs F s1 mb0" in str(info.value)


def test_sender_without_its_compute_wait_is_a_dependency_violation(lowered):
    graph = lowered["eager-1f1b"]
    broken = edit_lane(graph, "d2 fwd0", lambda ts: [t.split("<")[0] for t in ts])
    with pytest.raises(ProgramError, match="dependency violation: device 2 sends"):
        validate(broken)


def test_wait_for_a_later_op_on_the_same_lane(lowered):
    graph = lowered["gpipe"]
    broken = edit_lane(graph, "d0 compute",
                       lambda ts: ["0F0<0F1" if t == "0F0" else t for t in ts])
    with pytest.raises(ProgramError, match="later on the same stream"):
        validate(broken)


def test_wait_for_an_op_that_never_runs_deadlocks(lowered):
    graph = lowered["1f1b"]
    # Device 4's F of mb0 waits for its own B of mb0: a cycle through its compute lane.
    broken = edit_lane(graph, "d4 fwd0",
                       lambda ts: [t + "<1B0" if t.startswith("fwd0:0#") else t for t in ts])
    with pytest.raises(ProgramError, match="deadlock") as info:
        validate(broken)
    assert "cycle:" in str(info.value)


def test_op_missing_from_a_lane(lowered):
    graph = lowered["1f1b"]
    broken = edit_lane(graph, "d5 fwd0", lambda ts: ts[1:])
    with pytest.raises(ProgramError, match=r"appears 0 times on lane d5 fwd0"):
        validate(broken)


def test_op_on_a_lane_it_does_not_run_on(lowered):
    graph = lowered["1f1b"]
    lanes = dict(graph.lanes)
    lanes[Lane(0, COMPUTE)] = (*lanes[Lane(0, COMPUTE)], compute_of(graph, 1, 0, "F", 4))
    with pytest.raises(ProgramError, match=r"lane d0 compute: holds F s1 mb0"):
        validate(dataclasses.replace(graph, lanes=lanes))


def test_data_wait_across_devices_is_refused(lowered):
    graph = lowered["1f1b"]
    op = graph.ops[compute_of(graph, 1, 0, "F", 4)]
    transfer = graph.ops[op.waits[0].op]
    other = next(d for d in transfer.devices if d != 4)  # e.g. its sender
    bad = dataclasses.replace(op, waits=(*op.waits, Dep(transfer.id, other, 4)))
    ops = tuple(bad if o.id == op.id else o for o in graph.ops)
    broken = StepGraph(ops, graph.lanes, graph.stages, graph.schedule, graph.plans)
    with pytest.raises(ProgramError, match="a data dependency is an event of one device"):
        validate(broken)


def test_deadlock_report_limits_the_grid_to_recent_steps():
    # A long pipeline deadlocked late: the grid shows the last steps, not all of them.
    cluster, meshes, boundaries = pipeline(3)
    graph = lower(meshes, boundaries, make_schedule("gpipe", 3, 8), cluster)
    # Stage 2's B of mb0 waits for the gradient of mb7, which leaves only after its B of mb7.
    late = next(t for ln in graph.to_text().splitlines() if ln.startswith("d8 bwd1:")
                for t in ln.split()[2:] if t.startswith("bwd1:7#"))
    broken = edit_lane(graph, "d8 compute",
                       lambda ts: [f"{t},{late.split('<')[0]}" if t.startswith("2B0<") else
                                   (f"{t}<{late.split('<')[0]}" if t == "2B0" else t)
                                   for t in ts])
    with pytest.raises(ProgramError) as info:
        validate(broken)
    lines = str(info.value).splitlines()
    header = lines[1]
    assert header.split()[0] == "lane"
    assert header.count("step") == 6 and header.rstrip().endswith("stops at")
    assert any(ln.startswith("d8 compute") and ">2B0" in ln for ln in lines)
    assert any("cycle:" in ln and "2B0@8" in ln and "bwd1:7#" in ln for ln in lines)


def test_a_plan_transfer_the_graph_never_moves_is_named(lowered):
    graph = lowered["1f1b"]
    channel = next(c for c in graph.plans if c is not None)
    plan = graph.plans[channel]
    grown = dataclasses.replace(plan, transfers=(*plan.transfers, plan.transfers[0]))
    broken = dataclasses.replace(graph, plans={**graph.plans, channel: grown})
    n = len(plan.transfers)
    with pytest.raises(ProgramError, match=rf"{channel} microbatch 0: .* of its plan's {n + 1}"
                                           rf"; missing #{n}"):
        validate(broken)
