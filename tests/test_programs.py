"""Lowering schedules to per-device stream programs, and the validator (scheduler/programs.py).

Documented semantics: each device has a compute stream and one comm stream per channel it takes
part in (``fwd<s>``: activations from stage s to s + 1; ``bwd<s>``: their gradients back); a
resharding runs on its channel right after the compute producing its input (the channel waits
for that compute's event) and the consumer's compute stream waits right before the compute that
needs it; all reshardings follow one global launch order of which each device's channel stream
takes its subsequence; events are per device. ``validate`` dry-runs the programs and raises
ProgramError naming devices on deadlock or on a data dependency violation.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from scheduler import Cluster, ClusterError, DeviceMesh, P, Sharding
from scheduler.programs import (
    Boundary,
    Compute,
    DeviceProgram,
    ProgramError,
    Programs,
    Record,
    Reshard,
    Step,
    Wait,
    compute_event,
    lower,
    reshard_event,
    validate,
)
from scheduler.schedules import SCHEDULES, Action, dependency_order, make_schedule

NUM_STAGES = 3
NUM_MB = 4


def pipeline(num_stages: int = NUM_STAGES, shape=(8, 8)):
    cluster = Cluster.preset("p3.8xlarge", num_stages)
    meshes = [cluster.mesh([h]) for h in range(num_stages)]
    boundaries = [
        Boundary(
            shape,
            "float32",
            Sharding(meshes[s], P("gpu", None)),
            Sharding(meshes[s + 1], P(None, "gpu")),
        )
        for s in range(num_stages - 1)
    ]
    return cluster, meshes, boundaries


@pytest.fixture(scope="module")
def lowered():
    cluster, meshes, boundaries = pipeline()
    return {
        name: lower(meshes, boundaries, make_schedule(name, NUM_STAGES, NUM_MB), cluster)
        for name in SCHEDULES
    }


def comm_ids(prog: DeviceProgram, channel: str) -> list[int]:
    return [ins.id for ins in prog.streams.get(channel, ()) if isinstance(ins, Reshard)]


def all_channels(num_stages: int = NUM_STAGES) -> list[str]:
    return [f"{d}{b}" for d in ("fwd", "bwd") for b in range(num_stages - 1)]


def plan_devices(programs: Programs, rid: int) -> set[int]:
    return {d for t in programs.plan_of(rid).transfers for d in t.devices}


# ---- lowering ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULES)
def test_lowered_programs_validate(lowered, name):
    programs = lowered[name]
    steps = validate(programs)
    assert all(isinstance(s, Step) for s in steps)
    for d, prog in programs.devices.items():
        # Every compute instruction runs exactly once, in stream order.
        computes = [i for i, ins in enumerate(prog.compute) if isinstance(ins, Compute)]
        got = [s.index for s in steps if s.device == d and s.stream == "compute"]
        assert got == computes
        # A step per transfer of each reshard that involves the device, in stream order.
        for ch in prog.channels:
            want = []
            for i, ins in enumerate(prog.streams[ch]):
                if isinstance(ins, Reshard):
                    n = sum(d in t.devices for t in programs.plan_of(ins.id).transfers)
                    want += [i] * n
            assert [s.index for s in steps if s.device == d and s.stream == ch] == want
        assert {s.stream for s in steps if s.device == d} <= {"compute", *prog.channels}


@pytest.mark.parametrize("name", SCHEDULES)
def test_devices_and_stages(lowered, name):
    programs = lowered[name]
    assert sorted(programs.devices) == list(range(4 * NUM_STAGES))
    for d, prog in programs.devices.items():
        assert prog.device == d
        assert prog.stage == d // 4  # stage s is host s: devices 4s..4s+3
    assert programs.stages == tuple(Cluster.preset("p3.8xlarge", 3).mesh([h]) for h in range(3))


@pytest.mark.parametrize("name", SCHEDULES)
def test_compute_stream_follows_schedule(lowered, name):
    programs = lowered[name]
    sched = programs.schedule
    assert sched == make_schedule(name, NUM_STAGES, NUM_MB)
    for prog in programs.devices.values():
        s = prog.stage
        computes = [ins for ins in prog.compute if isinstance(ins, Compute)]
        assert computes == [Compute(s, a.microbatch, a.kind) for a in sched.actions[s]]
        # The compute stream never runs a reshard; the comm streams never compute.
        assert not any(isinstance(ins, Reshard) for ins in prog.compute)
        for ch in prog.channels:
            assert not any(isinstance(ins, Compute) for ins in prog.streams[ch])


@pytest.mark.parametrize("name", SCHEDULES)
def test_one_reshard_per_boundary_direction_microbatch(lowered, name):
    programs = lowered[name]
    keys = [(r.direction, r.boundary, r.microbatch) for r in programs.reshards]
    want = {
        (d, b, i) for d in ("fwd", "bwd") for b in range(NUM_STAGES - 1) for i in range(NUM_MB)
    }
    assert len(keys) == len(want) == 2 * (NUM_STAGES - 1) * NUM_MB
    assert set(keys) == want
    assert len({r.id for r in programs.reshards}) == len(keys)
    for r in programs.reshards:
        assert r.plan_key == f"{r.direction}{r.boundary}"
        assert programs.find(r.direction, r.boundary, r.microbatch) == r
        assert programs.op(r.id) == r
        if r.direction == "fwd":
            assert (r.src_stage, r.dst_stage) == (r.boundary, r.boundary + 1)
        else:
            assert (r.src_stage, r.dst_stage) == (r.boundary + 1, r.boundary)
    assert set(programs.plans) == {f"{d}{b}" for d in ("fwd", "bwd") for b in range(2)}


@pytest.mark.parametrize("name", SCHEDULES)
def test_launch_order_follows_dependencies(lowered, name):
    programs = lowered[name]
    pos = {(r.direction, r.boundary, r.microbatch): i for i, r in enumerate(programs.reshards)}
    last = NUM_STAGES - 2
    for i in range(NUM_MB):
        for b in range(last):
            # F(b+1, i) follows F(b, i): its output leaves later. Gradients run backwards.
            assert pos[("fwd", b, i)] < pos[("fwd", b + 1, i)]
            assert pos[("bwd", b + 1, i)] < pos[("bwd", b, i)]
        # B(p-1, i) runs after F(p-1, i), which needs the last forward resharding.
        assert pos[("fwd", last, i)] < pos[("bwd", last, i)]
    # Each boundary's activations leave in the producer stage's forward order.
    for b in range(NUM_STAGES - 1):
        fwd = [r.microbatch for r in programs.reshards if r.direction == "fwd" and r.boundary == b]
        bwd = [r.microbatch for r in programs.reshards if r.direction == "bwd" and r.boundary == b]
        sched = programs.schedule
        assert fwd == [a.microbatch for a in sched.actions[b] if a.kind == "F"]
        assert bwd == [a.microbatch for a in sched.actions[b + 1] if a.kind == "B"]


@pytest.mark.parametrize("name", SCHEDULES)
def test_channels_per_device(lowered, name):
    programs = lowered[name]
    for prog in programs.devices.values():
        s = prog.stage
        # A channel per boundary direction next to the stage: four in the middle, two at ends.
        want = {f"{k}{b}" for k in ("fwd", "bwd") for b in (s - 1, s) if 0 <= b < NUM_STAGES - 1}
        assert set(prog.channels) == want
        assert set(prog.streams) == {"compute", *want}
        assert list(prog.channels) == sorted(want)
        for ch in prog.channels:
            # Each channel carries only its own boundary and direction.
            assert {programs.op(i).channel for i in comm_ids(prog, ch)} == {ch}


@pytest.mark.parametrize("name", SCHEDULES)
def test_comm_streams_share_one_launch_order(lowered, name):
    programs = lowered[name]
    global_pos = {r.id: i for i, r in enumerate(programs.reshards)}
    for d, prog in programs.devices.items():
        mine = []
        for ch in prog.channels:
            ids = comm_ids(prog, ch)
            # A subsequence of the global order.
            assert [global_pos[i] for i in ids] == sorted(global_pos[i] for i in ids), (d, ch)
            assert len(ids) == len(set(ids))
            mine += ids
        # Exactly the reshards the device takes part in.
        assert sorted(mine) == sorted(
            r.id for r in programs.reshards if d in plan_devices(programs, r.id))
    for ch in all_channels():
        for a, b in itertools.combinations(sorted(programs.devices), 2):
            ia, ib = comm_ids(programs.devices[a], ch), comm_ids(programs.devices[b], ch)
            common = set(ia) & set(ib)
            assert [i for i in ia if i in common] == [i for i in ib if i in common], (ch, a, b)


@pytest.mark.parametrize("name", SCHEDULES)
def test_waits_are_for_events_recorded_on_the_same_device(lowered, name):
    programs = lowered[name]
    for d, prog in programs.devices.items():
        for st, instrs in prog.streams.items():
            # Another stream of the same device records what this one waits for.
            others = {ins.event for other, ins_list in prog.streams.items() if other != st
                      for ins in ins_list if isinstance(ins, Record)}
            for ins in instrs:
                if isinstance(ins, Wait):
                    assert ins.event in others, (d, st, ins)
        # Every recorded event is unique on its device.
        events = [ins.event for instrs in prog.streams.values() for ins in instrs
                  if isinstance(ins, Record)]
        assert len(events) == len(set(events))


@pytest.mark.parametrize("name", SCHEDULES)
def test_waits_and_records_sit_next_to_their_instructions(lowered, name):
    programs = lowered[name]
    p = NUM_STAGES
    for d, prog in programs.devices.items():
        s = prog.stage
        for k, ins in enumerate(prog.compute):
            if not isinstance(ins, Compute):
                continue
            a = Action(ins.kind, ins.microbatch)
            # Input: the consumer waits right before the compute that needs it.
            needs = None
            if ins.kind == "F" and s > 0:
                needs = programs.find("fwd", s - 1, ins.microbatch)
            if ins.kind == "B" and s < p - 1:
                needs = programs.find("bwd", s, ins.microbatch)
            if needs is not None and d in programs.receivers(needs.plan_key):
                assert prog.compute[k - 1] == Wait(reshard_event(needs.id)), (d, k)
            # Output: recorded right after, if this device sends it.
            out = None
            if ins.kind == "F" and s < p - 1:
                out = programs.find("fwd", s, ins.microbatch)
            if ins.kind == "B" and s > 0:
                out = programs.find("bwd", s - 1, ins.microbatch)
            if out is not None and d in {t.sender for t in programs.plan_of(out.id).transfers}:
                assert prog.compute[k + 1] == Record(compute_event(s, a)), (d, k)
        for ch in prog.channels:
            check_channel(programs, d, s, prog.streams[ch])


def check_channel(programs: Programs, d: int, s: int, stream: tuple) -> None:
    for k, ins in enumerate(stream):
        if isinstance(ins, Reshard):
            op = programs.op(ins.id)
            senders = {t.sender for t in programs.plan_of(ins.id).transfers}
            if d in senders and op.src_stage == s:
                kind = "F" if op.direction == "fwd" else "B"
                want = Wait(compute_event(s, Action(kind, op.microbatch)))
                assert stream[k - 1] == want, (d, k)
            if d in programs.receivers(op.plan_key):
                assert stream[k + 1] == Record(reshard_event(ins.id)), (d, k)


@pytest.mark.parametrize("name", SCHEDULES)
def test_json_round_trip(lowered, name):
    programs = lowered[name]
    back = Programs.from_json(programs.to_json())
    assert back.to_text() == programs.to_text()
    assert back.devices == programs.devices
    assert back.reshards == programs.reshards
    assert back.schedule == programs.schedule
    assert back.stages == programs.stages
    assert set(back.plans) == set(programs.plans)
    for k in programs.plans:
        assert back.plans[k].transfers == programs.plans[k].transfers
        assert back.plans[k].src == programs.plans[k].src
        assert back.plans[k].dst == programs.plans[k].dst
    assert validate(back) == validate(programs)


def test_to_text_names_every_device_and_reshard(lowered):
    programs = lowered["1f1b"]
    text = programs.to_text()
    assert "1f1b" in text
    for d, prog in programs.devices.items():
        assert f"device {d} (stage {prog.stage})" in text
    for r in programs.reshards:
        assert f"#{r.id}" in text


def test_single_stage_has_no_reshards():
    cluster = Cluster.preset("p3.8xlarge", 1)
    programs = lower([cluster.mesh([0])], [], make_schedule("1f1b", 1, 3), cluster)
    assert programs.reshards == ()
    assert programs.plans == {}
    for prog in programs.devices.values():
        assert prog.channels == ()
        assert prog.compute == tuple(
            Compute(0, i, k) for k, i in [("F", 0), ("B", 0), ("F", 1), ("B", 1),
                                          ("F", 2), ("B", 2)]
        )
    assert len(validate(programs)) == 4 * 6


def test_sender_only_devices_do_not_wait_for_data():
    # Two hosts, stage 0 = GPU 0 of host 0, stage 1 = GPU 0 of host 1; replicated boundary.
    cluster = Cluster.preset("p3.8xlarge", 2)
    m0 = DeviceMesh([0], ("gpu",))
    m1 = DeviceMesh([4], ("gpu",))
    b = Boundary((16,), "float32", Sharding(m0, P()), Sharding(m1, P()))
    programs = lower([m0, m1], [b], make_schedule("gpipe", 2, 2), cluster)
    f0, f1, b0, b1 = (programs.find(*k) for k in
                      [("fwd", 0, 0), ("fwd", 0, 1), ("bwd", 0, 0), ("bwd", 0, 1)])
    F = lambda s, i: compute_event(s, Action("F", i))
    B = lambda s, i: compute_event(s, Action("B", i))
    assert programs.devices[0].compute == (
        Compute(0, 0, "F"), Record(F(0, 0)), Compute(0, 1, "F"), Record(F(0, 1)),
        Wait(reshard_event(b0.id)), Compute(0, 0, "B"),
        Wait(reshard_event(b1.id)), Compute(0, 1, "B"),
    )
    assert programs.devices[4].compute == (
        Wait(reshard_event(f0.id)), Compute(1, 0, "F"),
        Wait(reshard_event(f1.id)), Compute(1, 1, "F"),
        Compute(1, 0, "B"), Record(B(1, 0)), Compute(1, 1, "B"), Record(B(1, 1)),
    )
    assert programs.devices[0].channels == ("bwd0", "fwd0")
    assert programs.devices[0].streams["fwd0"] == (
        Wait(F(0, 0)), Reshard(f0.id), Wait(F(0, 1)), Reshard(f1.id),
    )
    assert programs.devices[0].streams["bwd0"] == (
        Reshard(b0.id), Record(reshard_event(b0.id)),
        Reshard(b1.id), Record(reshard_event(b1.id)),
    )
    assert programs.devices[4].streams["fwd0"] == (
        Reshard(f0.id), Record(reshard_event(f0.id)),
        Reshard(f1.id), Record(reshard_event(f1.id)),
    )
    assert programs.devices[4].streams["bwd0"] == (
        Wait(B(1, 0)), Reshard(b0.id), Wait(B(1, 1)), Reshard(b1.id),
    )
    validate(programs)


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
    with pytest.raises(ValueError, match="stages"):
        lower([], [], make_schedule("1f1b", 1, 1), cluster)


# ---- the validator catches broken programs -----------------------------------------------


def groups(stream: tuple) -> list[list]:
    """Split a comm stream into [waits..., Reshard, records...] groups."""
    out: list[list] = []
    for ins in stream:
        if not out or (not isinstance(ins, Record) and any(isinstance(x, Reshard)
                                                           for x in out[-1])):
            out.append([])
        out[-1].append(ins)
    return out


def with_stream(programs: Programs, device: int, stream: str, instrs) -> Programs:
    prog = programs.devices[device]
    streams = {**prog.streams, stream: tuple(instrs)}
    devices = {**programs.devices, device: dataclasses.replace(prog, streams=streams)}
    return dataclasses.replace(programs, devices=devices)


STAGE1_DEVICE = 4


@pytest.mark.parametrize("name", SCHEDULES)
def test_swapped_collectives_deadlock(lowered, name):
    programs = lowered[name]
    d = STAGE1_DEVICE
    stream = programs.devices[d].streams["fwd0"]
    r0 = programs.find("fwd", 0, 0).id
    r1 = programs.find("fwd", 0, 1).id
    gs = groups(stream)
    assert [ins for g in gs for ins in g] == list(stream)
    idx = {next(x.id for x in g if isinstance(x, Reshard)): k for k, g in enumerate(gs)}
    i, j = idx[r0], idx[r1]
    gs[i], gs[j] = gs[j], gs[i]
    broken = with_stream(programs, d, "fwd0", (ins for g in gs for ins in g))
    with pytest.raises(ProgramError, match="deadlock") as info:
        validate(broken)
    msg = str(info.value)
    assert f"device {d} fwd0" in msg
    # Its stage-0 peers are stuck at the other collective, waiting for device d.
    assert any(f"device {e} " in msg for e in range(4))
    # The original programs are untouched.
    validate(programs)


@pytest.mark.parametrize("name", SCHEDULES)
def test_missing_wait_is_a_dependency_violation(lowered, name):
    programs = lowered[name]
    d = STAGE1_DEVICE
    prog = programs.devices[d]
    k = prog.compute.index(Compute(1, 0, "F"))
    assert prog.compute[k - 1] == Wait(reshard_event(programs.find("fwd", 0, 0).id))
    broken = with_stream(programs, d, "compute", prog.compute[: k - 1] + prog.compute[k:])
    with pytest.raises(ProgramError, match="dependency violation") as info:
        validate(broken)
    assert f"device {d} " in str(info.value)


@pytest.mark.parametrize("name", SCHEDULES)
def test_missing_record_deadlocks(lowered, name):
    programs = lowered[name]
    d = STAGE1_DEVICE
    stream = programs.devices[d].streams["fwd0"]
    event = reshard_event(programs.find("fwd", 0, 0).id)
    kept = tuple(ins for ins in stream if ins != Record(event))
    assert len(kept) == len(stream) - 1
    broken = with_stream(programs, d, "fwd0", kept)
    with pytest.raises(ProgramError, match="deadlock") as info:
        validate(broken)
    msg = str(info.value)
    assert f"device {d} " in msg
    assert repr(event) in msg or f" {event}" in msg


def test_missing_compute_record_deadlocks_the_comm_stream(lowered):
    programs = lowered["eager-1f1b"]
    d = 2  # stage 0: its fwd0 stream waits for F0:0 before sending mb0's activation
    prog = programs.devices[d]
    event = compute_event(0, Action("F", 0))
    compute = tuple(ins for ins in prog.compute if ins != Record(event))
    assert len(compute) == len(prog.compute) - 1
    broken = with_stream(programs, d, "compute", compute)
    with pytest.raises(ProgramError, match="deadlock") as info:
        validate(broken)
    assert "device 2 fwd0" in str(info.value)
    assert event in str(info.value)


def test_programs_accessors(lowered):
    programs = lowered["gpipe"]
    order = dependency_order(programs.schedule)
    assert len(order) == 2 * NUM_STAGES * NUM_MB
    for r in programs.reshards:
        assert programs.op(r.id) is r
        assert programs.plan_of(r.id) is programs.plans[r.plan_key]
    assert programs.find("fwd", 5, 0) is None
    assert programs.receivers("fwd0") == frozenset(range(4, 8))
    assert programs.receivers("bwd1") == frozenset(range(4, 8))
