"""The pipeline simulator (scheduler/simulator.py) against hand-worked timelines.

Semantics used for the expected values (module docs of simulator.py, graph.py, lowering.py,
cost.py):
every device runs a compute stream and one comm stream per channel (``fwd<s>``: activations
from stage s to s + 1, ``bwd<s>``: gradients back), all FIFO; a resharding follows the global
launch order (a dependency order of the schedule) on its channel's streams and its sender
waits for the compute producing the data; the consumer's compute waits for the transfer;
a point-to-point transfer alone takes Σ hop latency + bytes / bottleneck (+ pipeline fill, zero
for a single hop); in signal mode a transfer costs only its latency.

The small cases use two hosts with one GPU each, an 8 Gbps NIC (1e9 B/s) and zero latency, one
stage per GPU and a replicated int8 boundary of N bytes on both sides: each resharding is one
transfer of N bytes between the two GPUs taking N / 1e9 s.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from scheduler import (
    Channel,
    Cluster,
    DeviceMesh,
    P,
    PlanOptions,
    ProgramError,
    Sharding,
    Span,
    Timeline,
    estimate,
    lower,
    plan_resharding,
    reshard_graph,
    simulate,
    validate,
)
from scheduler.lowering import Boundary
from scheduler.schedules import SCHEDULES, Schedule, make_schedule

F_COST, B_COST = 1.0, 2.0
T_COST = 0.5  # seconds per activation / gradient transfer
NBYTES = int(T_COST * 1e9)


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-12)


def chain_pipeline(num_stages: int, nbytes: int = NBYTES, latency_us: float = 0.0):
    """One single-GPU host per stage; a replicated nbytes int8 boundary between stages."""
    cluster = Cluster(num_stages, 1, nic_gbps=8.0, nvlink_gbps=80.0, nic_latency_us=latency_us,
                      nvlink_latency_us=0.0)
    meshes = [DeviceMesh([s], ("gpu",)) for s in range(num_stages)]
    boundaries = [
        Boundary((nbytes,), "int8", Sharding(meshes[s], P()), Sharding(meshes[s + 1], P()))
        for s in range(num_stages - 1)
    ]
    return cluster, meshes, boundaries


def run_chain(name: str, m: int, *, signal: bool = False, latency_us: float = 0.0,
              costs=None, num_stages: int = 2) -> Timeline:
    cluster, meshes, boundaries = chain_pipeline(num_stages, latency_us=latency_us)
    graph = lower(meshes, boundaries, make_schedule(name, num_stages, m), cluster)
    if costs is None:
        costs = {"F": F_COST, "B": B_COST}
    return simulate(graph, cluster, costs, signal=signal)


def receivers(graph, channel: Channel) -> set[int]:
    return {r for t in graph.plans[channel].transfers for r in t.receivers}


def span_table(tl: Timeline) -> dict[tuple[int, str, int], tuple[float, float]]:
    """(device, kind, microbatch) -> (start, end); kinds F/B (compute), fwd/bwd (comm)."""
    out: dict[tuple[int, str, int], tuple[float, float]] = {}
    for s in tl.spans:
        key = (s.device, s.kind, s.microbatch)
        assert key not in out, key
        if s.kind in ("F", "B"):
            assert s.stream == "compute"
        else:  # the channel: fwd<boundary> from stage s, bwd<boundary> from stage s + 1
            assert s.stream == (f"fwd{s.stage}" if s.kind == "fwd" else f"bwd{s.stage - 1}")
        out[key] = (s.start, s.end)
    return out


# Worked by hand, f = 1, b = 2, transfer = 0.5, p = 2, m = 3. Activations (channel fwd0) and
# gradients (channel bwd0) use separate streams and opposite NIC directions, so they never
# wait for each other. Under 1f1b stage 0 runs F2 only after B0 (at [7, 8]), so stage 1 idles
# from 7.5 until mb2's activation lands at 8.5; eager-1f1b sent it at 3.
HAND = {
    "gpipe": dict(
        dev0=dict(F=[(0, 1), (1, 2), (2, 3)], B=[(7, 9), (9, 11), (11, 13)]),
        dev1=dict(F=[(1.5, 2.5), (2.5, 3.5), (3.5, 4.5)], B=[(4.5, 6.5), (6.5, 8.5),
                                                             (8.5, 10.5)]),
        fwd=[(1, 1.5), (2, 2.5), (3, 3.5)],
        bwd=[(6.5, 7), (8.5, 9), (10.5, 11)],
        iteration=13.0,
        waited=(0.5, 0.5),
        exposed=(1.0, 1.0),
    ),
    "1f1b": dict(
        dev0=dict(F=[(0, 1), (1, 2), (7, 8)], B=[(5, 7), (8, 10), (12, 14)]),
        dev1=dict(F=[(1.5, 2.5), (4.5, 5.5), (8.5, 9.5)], B=[(2.5, 4.5), (5.5, 7.5),
                                                             (9.5, 11.5)]),
        fwd=[(1, 1.5), (2, 2.5), (8, 8.5)],
        bwd=[(4.5, 5), (7.5, 8), (11.5, 12)],
        iteration=14.0,
        waited=(1.0, 1.0),
        exposed=(1.5, 2.0),
    ),
    "eager-1f1b": dict(
        dev0=dict(F=[(0, 1), (1, 2), (2, 3)], B=[(5, 7), (8, 10), (11, 13)]),
        dev1=dict(F=[(1.5, 2.5), (4.5, 5.5), (7.5, 8.5)], B=[(2.5, 4.5), (5.5, 7.5),
                                                             (8.5, 10.5)]),
        fwd=[(1, 1.5), (2, 2.5), (3, 3.5)],
        bwd=[(4.5, 5), (7.5, 8), (10.5, 11)],
        iteration=13.0,
        waited=(1.5, 0.5),
        exposed=(2.0, 1.0),
    ),
}

# The same in signal mode (zero latency: transfers take no time): the compute critical path.
HAND_SIGNAL = {
    "gpipe": dict(
        dev0=dict(F=[(0, 1), (1, 2), (2, 3)], B=[(6, 8), (8, 10), (10, 12)]),
        dev1=dict(F=[(1, 2), (2, 3), (3, 4)], B=[(4, 6), (6, 8), (8, 10)]),
        fwd=[1, 2, 3],
        bwd=[6, 8, 10],
        iteration=12.0,
    ),
    "1f1b": dict(
        dev0=dict(F=[(0, 1), (1, 2), (6, 7)], B=[(4, 6), (7, 9), (10, 12)]),
        dev1=dict(F=[(1, 2), (4, 5), (7, 8)], B=[(2, 4), (5, 7), (8, 10)]),
        fwd=[1, 2, 7],
        bwd=[4, 7, 10],
        iteration=12.0,
    ),
    "eager-1f1b": dict(
        dev0=dict(F=[(0, 1), (1, 2), (2, 3)], B=[(4, 6), (7, 9), (10, 12)]),
        dev1=dict(F=[(1, 2), (4, 5), (7, 8)], B=[(2, 4), (5, 7), (8, 10)]),
        fwd=[1, 2, 3],
        bwd=[4, 7, 10],
        iteration=12.0,
    ),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_hand_computed_timeline(name):
    want = HAND[name]
    tl = run_chain(name, 3)
    table = span_table(tl)
    # 6 computes per device + 6 transfers, each shown on both devices.
    assert len(tl.spans) == 2 * 6 + 2 * 6
    for dev in (0, 1):
        for kind in ("F", "B"):
            for i, (a, b) in enumerate(want[f"dev{dev}"][kind]):
                assert table[(dev, kind, i)] == (approx(a), approx(b)), (dev, kind, i)
        for kind in ("fwd", "bwd"):
            for i, (a, b) in enumerate(want[kind]):
                assert table[(dev, kind, i)] == (approx(a), approx(b)), (dev, kind, i)
    assert tl.iteration_time == approx(want["iteration"])
    for dev in (0, 1):
        assert tl.busy(dev) == approx(3 * F_COST + 3 * B_COST)
        assert tl.busy(dev, "fwd0") == approx(3 * T_COST)
        assert tl.busy(dev, "bwd0") == approx(3 * T_COST)
        assert tl.comm_time(dev) == approx(6 * T_COST)
        assert tl.streams(dev) == ("compute", "bwd0", "fwd0")
        assert tl.busy_fraction(dev) == approx(9.0 / want["iteration"])
        assert tl.exposed_comm(dev) == approx(want["exposed"][dev])
        assert tl.transfer_wait(dev) == approx(want["waited"][dev])
    assert tl.bubble_fraction == approx(1.0 - 9.0 / want["iteration"])
    assert tl.exposed_comm_fraction == approx(sum(want["exposed"]) / 2 / want["iteration"])
    assert tl.transfer_wait_fraction == approx(sum(want["waited"]) / 2 / want["iteration"])
    assert tl.summary() == {
        "iteration_s": approx(want["iteration"]),
        "bubble": approx(1.0 - 9.0 / want["iteration"]),
        "exposed_comm": approx(sum(want["exposed"]) / 2 / want["iteration"]),
        "transfer_wait": approx(sum(want["waited"]) / 2 / want["iteration"]),
    }


@pytest.mark.parametrize("name", SCHEDULES)
def test_hand_computed_signal_timeline(name):
    want = HAND_SIGNAL[name]
    tl = run_chain(name, 3, signal=True)
    table = span_table(tl)
    for dev in (0, 1):
        for kind in ("F", "B"):
            for i, (a, b) in enumerate(want[f"dev{dev}"][kind]):
                assert table[(dev, kind, i)] == (approx(a), approx(b)), (dev, kind, i)
        for kind in ("fwd", "bwd"):
            for i, t in enumerate(want[kind]):
                assert table[(dev, kind, i)] == (approx(t), approx(t)), (dev, kind, i)
        assert tl.exposed_comm(dev) == 0.0 and tl.transfer_wait(dev) == 0.0
        assert tl.comm_time(dev) == 0.0
    assert tl.iteration_time == approx(want["iteration"])
    assert tl.exposed_comm_fraction == 0.0


def test_eager_beats_1f1b():
    # From the hand-worked tables: eager-1f1b sends mb2's activation during warm-up.
    assert run_chain("1f1b", 3).iteration_time == approx(14.0)
    assert run_chain("eager-1f1b", 3).iteration_time == approx(13.0)


@pytest.mark.parametrize(
    ("name", "plain", "signal"),
    [
        # m = 2: 1f1b and eager-1f1b coincide (W = 2, 1). Worked by hand:
        # gpipe   d0 F[0,1][1,2]  fwd[1,1.5][2,2.5]  d1 F[1.5,2.5][2.5,3.5] B[3.5,5.5][5.5,7.5]
        #         bwd[5.5,6][7.5,8]  d0 B[6,8][8,10]                        -> 10
        # 1f1b    d1 F0[1.5,2.5] B0[2.5,4.5] F1[4.5,5.5] B1[5.5,7.5]  bwd[4.5,5][7.5,8]
        #         d0 B[5,7][8,10]                                           -> 10
        # signal: gpipe d1 F[1,2][2,3] B[3,5][5,7], d0 B[5,7][7,9] -> 9;
        #         1f1b  d1 F0[1,2] B0[2,4] F1[4,5] B1[5,7], d0 B[4,6][7,9] -> 9.
        ("gpipe", 10.0, 9.0),
        ("1f1b", 10.0, 9.0),
        ("eager-1f1b", 10.0, 9.0),
    ],
)
def test_hand_computed_two_microbatches(name, plain, signal):
    assert run_chain(name, 2).iteration_time == approx(plain)
    assert run_chain(name, 2, signal=True).iteration_time == approx(signal)


def test_signal_mode_pays_latency_only():
    # 1f1b, m = 2, NIC latency 0.25 s: a signal transfer takes 0.25 s whatever its size;
    # d0 F[0,1][1,2], fwd[1,1.25][2,2.25], d1 F0[1.25,2.25] B0[2.25,4.25] F1[4.25,5.25]
    # B1[5.25,7.25], bwd[4.25,4.5][7.25,7.5], d0 B[4.5,6.5][7.5,9.5].
    tl = run_chain("1f1b", 2, signal=True, latency_us=250_000.0)
    table = span_table(tl)
    assert table[(1, "F", 0)] == (approx(1.25), approx(2.25))
    assert table[(1, "F", 1)] == (approx(4.25), approx(5.25))
    assert table[(0, "fwd", 1)] == (approx(2.0), approx(2.25))
    assert table[(0, "bwd", 0)] == (approx(4.25), approx(4.5))
    assert table[(0, "B", 1)] == (approx(7.5), approx(9.5))
    assert tl.iteration_time == approx(9.5)
    # Without signal the same transfer costs latency + bytes / bandwidth = 0.75 s:
    # d1 F0 [1.75, 2.75], B0 [2.75, 4.75], F1 [4.75, 5.75] (fwd1 [2, 2.75]), B1 [5.75, 7.75];
    # bwd0 [4.75, 5.5], bwd1 [7.75, 8.5]; d0 B0 [5.5, 7.5], B1 [8.5, 10.5].
    plain = run_chain("1f1b", 2, latency_us=250_000.0)
    assert span_table(plain)[(0, "bwd", 1)] == (approx(7.75), approx(8.5))
    assert plain.iteration_time == approx(10.5)


@pytest.mark.parametrize("name", SCHEDULES)
def test_three_stage_chain_per_stage_costs(name):
    # m = 1: every schedule is the chain F0 F1 F2 B2 B1 B0 with four transfers between.
    costs = {(0, "F"): 1.0, (1, "F"): 2.0, (2, "F"): 3.0,
             (0, "B"): 2.0, (1, "B"): 4.0, (2, "B"): 6.0}
    tl = run_chain(name, 1, costs=costs, num_stages=3)
    table = {(s.device, s.kind, s.microbatch): (s.start, s.end)
             for s in tl.spans if s.stream == "compute"}
    comm = {(s.device, s.kind, s.stage): (s.start, s.end)
            for s in tl.spans if s.stream != "compute"}
    assert comm[(1, "fwd", 0)] == comm[(0, "fwd", 0)] == (approx(1.0), approx(1.5))
    assert comm[(2, "fwd", 1)] == (approx(3.5), approx(4.0))
    assert comm[(1, "bwd", 2)] == (approx(13.0), approx(13.5))
    assert comm[(0, "bwd", 1)] == (approx(17.5), approx(18.0))
    assert table[(0, "F", 0)] == (approx(0.0), approx(1.0))
    assert table[(1, "F", 0)] == (approx(1.5), approx(3.5))
    assert table[(2, "F", 0)] == (approx(4.0), approx(7.0))
    assert table[(2, "B", 0)] == (approx(7.0), approx(13.0))
    assert table[(1, "B", 0)] == (approx(13.5), approx(17.5))
    assert table[(0, "B", 0)] == (approx(18.0), approx(20.0))
    assert tl.iteration_time == approx(20.0)
    for d, busy in ((0, 3.0), (1, 6.0), (2, 9.0)):
        assert tl.busy(d) == approx(busy)
        assert tl.busy_fraction(d) == approx(busy / 20.0)
    assert tl.bubble_fraction == approx(1.0 - 18.0 / 60.0)
    assert run_chain(name, 1, costs=costs, num_stages=3, signal=True).iteration_time == approx(
        18.0
    )


def test_span_names_and_stages():
    tl = run_chain("1f1b", 2)
    names = {(s.device, s.stream, s.kind, s.microbatch): (s.name, s.stage) for s in tl.spans}
    assert names[(1, "compute", "F", 1)] == ("F s1 mb1", 1)
    assert names[(0, "compute", "B", 0)] == ("B s0 mb0", 0)
    assert names[(0, "fwd0", "fwd", 1)] == ("reshard s0→s1 mb1 #0", 0)
    assert names[(1, "bwd0", "bwd", 0)] == ("grad s1→s0 mb0 #0", 1)
    assert tl.devices == (0, 1)
    assert dict(tl.stage_of) == {0: 0, 1: 1}
    assert tl.num_stages == 2
    assert all(isinstance(s, Span) for s in tl.spans)


def test_channels_run_concurrently():
    # 3 single-GPU stages, gpipe m=2, f=1, b=2, transfers 1.5 s. Stage 1 receives mb1 (fwd0)
    # while it sends mb0 on (fwd1): separate channels, separate NIC directions.
    # fwd0: mb0 [1, 2.5], mb1 [2.5, 4] (FIFO behind mb0); stage 1 F [2.5, 3.5], [4, 5];
    # fwd1: mb0 [3.5, 5], mb1 [5, 6.5]; stage 2 F [5, 6], [6.5, 7.5], B [7.5, 9.5], [9.5, 11.5];
    # bwd1 [9.5, 11], [11.5, 13]; stage 1 B [11, 13], [13, 15]; bwd0 [13, 14.5], [15, 16.5];
    # stage 0 B [14.5, 16.5], [16.5, 18.5].
    cluster, meshes, boundaries = chain_pipeline(3, nbytes=1_500_000_000)
    graph = lower(meshes, boundaries, make_schedule("gpipe", 3, 2), cluster)
    tl = simulate(graph, cluster, {"F": F_COST, "B": B_COST})
    comm = {(s.device, s.stream, s.microbatch): (s.start, s.end)
            for s in tl.spans if s.stream != "compute"}
    comp = {(s.device, s.kind, s.microbatch): (s.start, s.end)
            for s in tl.spans if s.stream == "compute"}
    assert comm[(1, "fwd0", 0)] == (approx(1.0), approx(2.5))
    assert comm[(1, "fwd0", 1)] == (approx(2.5), approx(4.0))
    assert comm[(1, "fwd1", 0)] == (approx(3.5), approx(5.0))
    assert comm[(1, "fwd1", 1)] == (approx(5.0), approx(6.5))
    assert comp[(1, "F", 0)] == (approx(2.5), approx(3.5))
    assert comp[(1, "F", 1)] == (approx(4.0), approx(5.0))
    assert comp[(2, "F", 1)] == (approx(6.5), approx(7.5))
    assert comm[(1, "bwd1", 1)] == (approx(11.5), approx(13.0))
    assert comp[(1, "B", 1)] == (approx(13.0), approx(15.0))
    assert comm[(0, "bwd0", 1)] == (approx(15.0), approx(16.5))
    assert comp[(0, "B", 0)] == (approx(14.5), approx(16.5))
    assert comp[(0, "B", 1)] == (approx(16.5), approx(18.5))
    assert tl.iteration_time == approx(18.5)
    assert tl.streams(1) == ("compute", "bwd0", "bwd1", "fwd0", "fwd1")
    # Signal: the compute chain only: F [0,1],[1,2] / [1,2],[2,3] / [2,3],[3,4]; B on stage 2
    # [4,6],[6,8], stage 1 [6,8],[8,10], stage 0 [8,10],[10,12].
    assert simulate(graph, cluster, {"F": F_COST, "B": B_COST},
                    signal=True).iteration_time == approx(12.0)


def test_custom_schedule_timeline():
    # Stage 1 takes mb1 first. Dependency order: (0,F0) (0,F1) (1,F1) (1,F0) (1,B0) (1,B1)
    # (0,B1) (0,B0); channels: fwd0 mb0, mb1; bwd0 mb0, mb1.
    # d0 F [0,1] [1,2]; fwd mb0 [1,1.5], mb1 [2,2.5]; d1 F1 [2.5,3.5], F0 [3.5,4.5],
    # B0 [4.5,6.5], B1 [6.5,8.5]; bwd mb0 [6.5,7], mb1 [8.5,9]; d0 B1 [9,11], B0 [11,13].
    cluster, meshes, boundaries = chain_pipeline(2)
    sched = Schedule.from_text("s0: F0 F1 B1 B0\ns1: F1 F0 B0 B1")
    graph = lower(meshes, boundaries, sched, cluster)
    tl = simulate(graph, cluster, {"F": F_COST, "B": B_COST})
    table = span_table(tl)
    assert table[(1, "F", 1)] == (approx(2.5), approx(3.5))
    assert table[(1, "F", 0)] == (approx(3.5), approx(4.5))
    assert table[(0, "bwd", 1)] == (approx(8.5), approx(9.0))
    assert table[(0, "B", 1)] == (approx(9.0), approx(11.0))
    assert table[(0, "B", 0)] == (approx(11.0), approx(13.0))
    assert tl.iteration_time == approx(13.0)
    assert tl.peak_activations(0) == 2 and tl.peak_activations(1) == 2


def test_deadlocking_schedule_cannot_be_lowered():
    cluster, meshes, boundaries = chain_pipeline(2)
    sched = Schedule.from_text("s0: F0 B0 F1 B1\ns1: F0 F1 B0 B1")
    with pytest.raises(ValueError, match="deadlock"):
        lower(meshes, boundaries, sched, cluster)


def two_by_two(nbytes_per_gpu: int):
    """Two hosts of two GPUs (one NIC each); stage s = host s; a (2N,) int8 boundary split
    over the GPUs on both sides: each resharding is two N-byte transfers, GPU 0 -> 2 and
    1 -> 3 (or back), through the same pair of NIC ports."""
    cluster = Cluster(2, 2, nic_gbps=8.0, nvlink_gbps=80.0, nic_latency_us=0.0,
                      nvlink_latency_us=0.0)
    m0, m1 = DeviceMesh([0, 1], ("gpu",)), DeviceMesh([2, 3], ("gpu",))
    b = Boundary((2 * nbytes_per_gpu,), "int8", Sharding(m0, P("gpu")), Sharding(m1, P("gpu")))
    return cluster, [m0, m1], [b]


def test_concurrent_transfers_share_the_nic():
    # Two 0.25 s transfers at once through one NIC port pair: max-min fair, 0.5e9 B/s each,
    # both take 0.5 s. gpipe m=1: F [0,1] on 0,1; fwd [1,1.5]; F [1.5,2.5], B [2.5,4.5] on 2,3;
    # bwd [4.5,5]; B [5,7] on 0,1.
    cluster, meshes, boundaries = two_by_two(NBYTES // 2)
    graph = lower(meshes, boundaries, make_schedule("gpipe", 2, 1), cluster)
    assert [(t.sender, t.receivers) for t in graph.plans[Channel("fwd", 0)].transfers] == [
        (0, (2,)), (1, (3,))]
    tl = simulate(graph, cluster, {"F": F_COST, "B": B_COST})
    table = span_table(tl)
    for d in (0, 1):
        assert table[(d, "fwd", 0)] == (approx(1.0), approx(1.5))
        assert table[(d, "bwd", 0)] == (approx(4.5), approx(5.0))
        assert table[(d, "B", 0)] == (approx(5.0), approx(7.0))
    for d in (2, 3):
        assert table[(d, "F", 0)] == (approx(1.5), approx(2.5))
    assert tl.iteration_time == approx(7.0)
    # Signal mode: no bandwidth, no sharing: 1 + 1 + 2 + 2.
    assert simulate(graph, cluster, {"F": F_COST, "B": B_COST},
                    signal=True).iteration_time == approx(6.0)


def test_plan_after_dependencies_are_honoured():
    # A plan's Transfer.after names earlier transfers that must end before it starts (the
    # runtime waits on their completion events). With 1 -> 3 after 0 -> 2, the two run one
    # after the other at full rate: 0 -> 2 [1, 1.25], 1 -> 3 [1.25, 1.5]; so GPU 2 computes
    # F [1.25, 2.25] and GPU 3 F [1.5, 2.5].
    cluster, meshes, boundaries = two_by_two(NBYTES // 2)
    graph = lower(meshes, boundaries, make_schedule("gpipe", 2, 1), cluster)
    plan = graph.plans[Channel("fwd", 0)]
    first, second = plan.transfers
    serial = dataclasses.replace(plan, transfers=(first, dataclasses.replace(second, after=(0,))))
    serial.check()
    assert estimate(serial, cluster) == approx(0.5)
    graph = lower(meshes, boundaries, make_schedule("gpipe", 2, 1), cluster,
                  plans={Channel("fwd", 0): serial})
    tl = simulate(graph, cluster, {"F": F_COST, "B": B_COST})
    table = span_table(tl)
    assert table[(2, "fwd", 0)] == (approx(1.0), approx(1.25))
    assert table[(3, "fwd", 0)] == (approx(1.25), approx(1.5))
    assert table[(2, "F", 0)] == (approx(1.25), approx(2.25))
    assert table[(3, "F", 0)] == (approx(1.5), approx(2.5))
    # The spans of transfer 1 carry its op, which waits for transfer 0's op on device 1.
    ops = {s.op: graph.ops[s.op] for s in tl.spans if s.stream == "fwd0"}
    (t0,) = (op for op in ops.values() if op.body.index == 0)
    (t1,) = (op for op in ops.values() if op.body.index == 1)
    assert (t0.id, 0, 1) in t1.waits
    # The dry run also runs transfer 1 of the resharding only after transfer 0.
    step_of = {i: k for k, step in enumerate(validate(graph)) for i in step}
    assert step_of[t0.id] < step_of[t1.id]


def test_timeline_peak_with_zero_cost_computes():
    # The stream runs F0 B0 F1 B1 F2 B2 in order: never more than one live activation, even
    # when every compute takes no time (all start at t = 0).
    cluster = Cluster(1, 1, nic_gbps=8.0)
    graph = lower([DeviceMesh([0], ("gpu",))], [], make_schedule("1f1b", 1, 3), cluster)
    tl = simulate(graph, cluster, {"F": 0.0, "B": 0.0})
    assert tl.iteration_time == 0.0
    assert graph.schedule.peak_activations(0) == 1
    assert tl.peak_activations(0) == 1


def test_single_stage_timeline():
    cluster = Cluster(1, 2, nic_gbps=8.0)
    graph = lower([DeviceMesh([0, 1], ("gpu",))], [], make_schedule("gpipe", 1, 3), cluster)
    tl = simulate(graph, cluster, {"F": 1.0, "B": 2.0})
    assert tl.iteration_time == approx(9.0)
    assert tl.bubble_fraction == approx(0.0)
    assert tl.peak_activations(0) == 3
    assert all(s.stream == "compute" for s in tl.spans)
    with pytest.raises(ValueError, match="stage"):
        tl.peak_activations(1)


# ---- compute_costs forms and errors -----------------------------------------------------------


def test_compute_cost_forms_agree():
    cluster, meshes, boundaries = chain_pipeline(2)
    graph = lower(meshes, boundaries, make_schedule("eager-1f1b", 2, 3), cluster)
    by_stage = {(s, k): (F_COST if k == "F" else B_COST) for s in range(2) for k in "FB"}
    by_kind = {"F": F_COST, "B": B_COST}
    a = simulate(graph, cluster, by_stage)
    b = simulate(graph, cluster, by_kind)
    c = simulate(graph, cluster, lambda stage, kind: F_COST if kind == "F" else B_COST)
    assert a.spans == b.spans == c.spans
    assert a.iteration_time == approx(13.0)


def test_callable_costs_per_stage():
    tl = run_chain("gpipe", 1, costs=lambda s, k: (s + 1) * (1.0 if k == "F" else 2.0),
                   num_stages=3)
    assert tl.iteration_time == approx(20.0)


@pytest.mark.parametrize(
    "costs",
    [
        {"F": 1.0},  # no B
        {(0, "F"): 1.0, (0, "B"): 2.0},  # nothing for stage 1
        {"F": -1.0, "B": 2.0},
        {(0, "F"): 1.0, (0, "B"): 2.0, (1, "F"): 1.0, (1, "B"): -0.5},
        {"F": math.nan, "B": 1.0},
        lambda s, k: -1.0 if s == 1 else 1.0,
    ],
)
def test_bad_compute_costs(costs):
    cluster, meshes, boundaries = chain_pipeline(2)
    graph = lower(meshes, boundaries, make_schedule("1f1b", 2, 2), cluster)
    with pytest.raises(ValueError, match="compute_costs"):
        simulate(graph, cluster, costs)


def test_infinite_compute_cost_is_rejected():
    # A duration must be a finite number of seconds; inf is a bad argument, not a deadlock.
    cluster, meshes, boundaries = chain_pipeline(2)
    graph = lower(meshes, boundaries, make_schedule("1f1b", 2, 2), cluster)
    with pytest.raises(ValueError, match="compute_costs"):
        simulate(graph, cluster, {"F": math.inf, "B": 1.0})


def test_compute_cost_of_wrong_type():
    # Durations are numbers: a value of another type is a TypeError naming compute_costs, as
    # for every other argument of the project (Cluster, Action, make_schedule).
    cluster, meshes, boundaries = chain_pipeline(2)
    graph = lower(meshes, boundaries, make_schedule("1f1b", 2, 2), cluster)
    for value in ("1.0", None, True):
        with pytest.raises(TypeError, match="compute_costs"):
            simulate(graph, cluster, {"F": 1.0, "B": value})


def test_integer_and_numpy_compute_costs():
    # Any real number of seconds will do: ints, and numpy scalars (e.g. from a profile array).
    assert run_chain("gpipe", 2, costs={"F": 1, "B": 2}).iteration_time == approx(10.0)
    costs = {"F": np.float32(1.0), "B": np.int64(2)}
    assert run_chain("gpipe", 2, costs=costs).iteration_time == approx(10.0)


def test_zero_compute_costs_allowed():
    # Only the four transfers of m=1 remain: fwd [0, .5], bwd [.5, 1].
    tl = run_chain("1f1b", 1, costs={"F": 0.0, "B": 0.0})
    assert tl.iteration_time == approx(2 * T_COST)
    assert tl.bubble_fraction == approx(1.0)


def test_wrong_types():
    cluster, meshes, boundaries = chain_pipeline(2)
    graph = lower(meshes, boundaries, make_schedule("1f1b", 2, 2), cluster)
    with pytest.raises(TypeError, match="compute_costs"):
        simulate(graph, cluster, 1.0)
    with pytest.raises(TypeError, match="compute_costs"):
        simulate(graph, cluster, [1.0, 2.0])
    with pytest.raises(TypeError, match="graph"):
        simulate(graph.to_json(), cluster, {"F": 1.0, "B": 1.0})
    with pytest.raises(TypeError, match="cluster"):
        simulate(graph, "p3.8xlarge", {"F": 1.0, "B": 1.0})


# ---- larger configurations: invariants ------------------------------------------------------

BIG_CASES = [
    # (schedule, m, shape, dtype, producer spec, consumer spec, strategy, preset)
    ("gpipe", 3, (256, 1024), "float32", P("gpu", None), P(None, "gpu"), "broadcast",
     "p3.8xlarge"),
    ("1f1b", 5, (512, 512), "float16", P(None, "gpu"), P("gpu", None), "broadcast",
     "p3.8xlarge"),
    ("eager-1f1b", 6, (1024, 256), "float32", P("gpu"), P(), "broadcast", "p3.8xlarge"),
    ("1f1b", 4, (2048, 1024), "float32", P(), P("gpu"), "send_recv", "p3.8xlarge"),
    ("eager-1f1b", 2, (64, 64), "float32", P("gpu", None), P(None, "gpu"), "send_recv",
     "p3.8xlarge"),
    ("1f1b", 3, (1024, 512), "float32", P("gpu"), P(), "local_allgather", "p3.8xlarge"),
    ("eager-1f1b", 4, (4096, 512), "float16", P(None, "gpu"),
     P("gpu"), "broadcast", "dgx-h100"),
]
STAGE_COSTS = {(0, "F"): 2e-3, (1, "F"): 3e-3, (2, "F"): 1e-3, (3, "F"): 2.5e-3,
               (0, "B"): 4e-3, (1, "B"): 5e-3, (2, "B"): 3e-3, (3, "B"): 4e-3}


@pytest.fixture(scope="module", params=BIG_CASES,
                ids=lambda c: f"{c[0]}-m{c[1]}-{c[6]}-{c[7]}")
def big(request):
    name, m, shape, dtype, src, dst, strategy, preset = request.param
    cluster = Cluster.preset(preset, 4)
    meshes = [cluster.mesh([h]) for h in range(4)]
    boundaries = [
        Boundary(shape, dtype, Sharding(meshes[s], src), Sharding(meshes[s + 1], dst))
        for s in range(3)
    ]
    graph = lower(meshes, boundaries, make_schedule(name, 4, m), cluster,
                  PlanOptions(strategy=strategy))
    plain = simulate(graph, cluster, STAGE_COSTS)
    signal = simulate(graph, cluster, STAGE_COSTS, signal=True)
    return graph, plain, signal


def test_signal_is_a_lower_bound(big):
    _, plain, signal = big
    assert signal.iteration_time <= plain.iteration_time * (1 + 1e-12)
    # Both at least the busiest stage's compute and the m=1 chain through every stage.
    m = big[0].schedule.num_microbatches
    per_stage = [m * (STAGE_COSTS[(s, "F")] + STAGE_COSTS[(s, "B")]) for s in range(4)]
    chain = sum(STAGE_COSTS.values())
    assert signal.iteration_time >= max(max(per_stage), chain) * (1 - 1e-12)


def test_timeline_peaks_busy_and_bubbles(big):
    graph, plain, signal = big
    sched = graph.schedule
    m = sched.num_microbatches
    for tl in (plain, signal):
        for s in range(4):
            assert tl.peak_activations(s) == sched.peak_activations(s)
        for d in graph.devices:
            s = graph.stage_of(d)
            want = m * (STAGE_COSTS[(s, "F")] + STAGE_COSTS[(s, "B")])
            assert tl.busy(d) == approx(want)
            assert 0.0 <= tl.busy_fraction(d) <= 1.0
            f = tl.figures(d)  # (the definitions' order: waited ⊆ exposed ⊆ communication)
            assert 0.0 <= f.waited <= f.exposed + 1e-12 <= f.comm + 2e-12
            assert f.exposed == approx(tl.exposed_comm(d)) and f.comm == approx(tl.comm_time(d))
        assert 0.0 <= tl.bubble_fraction <= 1.0
        assert 0.0 <= tl.exposed_comm_fraction <= 1.0


def test_timeline_respects_streams_and_dependencies(big):
    graph, plain, signal = big
    p = graph.schedule.num_stages
    for tl in (plain, signal):
        by_dev_stream: dict[tuple[int, str], list] = {}
        for s in tl.spans:
            assert s.end >= s.start >= 0.0
            by_dev_stream.setdefault((s.device, s.stream), []).append(s)
        comp_start: dict[tuple[int, str, int], float] = {}
        comp_end: dict[tuple[int, str, int], float] = {}
        comm_end: dict[tuple[int, str, int, int], float] = {}
        comm_start: dict[tuple[int, str, int, int], float] = {}
        for (d, stream), spans in by_dev_stream.items():
            spans.sort(key=lambda x: (x.start, x.end))
            # One operation at a time per stream.
            for x, y in itertools.pairwise(spans):
                assert y.start >= x.end - 1e-12, (d, stream, x, y)
            for x in spans:
                if stream == "compute":
                    comp_start[(d, x.kind, x.microbatch)] = x.start
                    comp_end[(d, x.kind, x.microbatch)] = x.end
                else:
                    key = (d, x.kind, x.stage, x.microbatch)
                    comm_end[key] = max(comm_end.get(key, 0.0), x.end)
                    comm_start[key] = min(comm_start.get(key, math.inf), x.start)
        for d in graph.devices:
            s = graph.stage_of(d)
            # The compute stream runs the schedule's order.
            comp = sorted((x for x in by_dev_stream[(d, "compute")]), key=lambda x: x.start)
            assert [(x.kind, x.microbatch) for x in comp] == [
                (a.kind, a.microbatch) for a in graph.schedule.actions[s]
            ]
            for a in graph.schedule.actions[s]:
                i = a.microbatch
                # Input arrived before the compute that needs it.
                if a.kind == "F" and s > 0 and d in receivers(graph, Channel("fwd", s - 1)):
                    assert comp_start[(d, "F", i)] >= comm_end[(d, "fwd", s - 1, i)] - 1e-12
                if a.kind == "B" and s < p - 1 and d in receivers(graph, Channel("bwd", s)):
                    assert comp_start[(d, "B", i)] >= comm_end[(d, "bwd", s + 1, i)] - 1e-12
                # Output leaves only after the compute producing it.
                out = ("fwd", s) if a.kind == "F" else ("bwd", s)
                if (a.kind == "F" and s < p - 1) or (a.kind == "B" and s > 0):
                    key = (d, *out, i)
                    if key in comm_start:
                        assert comm_start[key] >= comp_end[(d, a.kind, i)] - 1e-12


def test_exposed_comm_when_transfers_dominate():
    # Tiny compute, 0.5 s transfers: stage 1 waits for every activation.
    tl = run_chain("1f1b", 4, costs={"F": 1e-3, "B": 1e-3})
    assert tl.transfer_wait(1) > 0.4
    assert tl.transfer_wait(0) > 0.4
    assert tl.exposed_comm(1) >= tl.transfer_wait(1) and tl.exposed_comm(0) >= tl.transfer_wait(0)
    assert tl.exposed_comm_fraction >= tl.transfer_wait_fraction > 0.0
    signal = run_chain("1f1b", 4, costs={"F": 1e-3, "B": 1e-3}, signal=True)
    assert signal.transfer_wait(1) == 0 and signal.exposed_comm(1) == 0


# ---- output ---------------------------------------------------------------------------------


def test_chrome_trace(tmp_path):
    tl = run_chain("1f1b", 3)
    path = tl.to_chrome_trace(tmp_path / "out" / "trace.json")
    assert path == tmp_path / "out" / "trace.json"
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(tl.spans)
    got = sorted((e["pid"], e["name"], round(e["ts"], 3), round(e["dur"], 3)) for e in xs)
    want = sorted((s.device, s.name, round(s.start * 1e6, 3), round((s.end - s.start) * 1e6, 3))
                  for s in tl.spans)
    assert got == want
    # Compute and comm on different tracks of the device's process.
    assert {e["tid"] for e in xs if e["cat"] == "compute"}.isdisjoint(
        {e["tid"] for e in xs if e["cat"] == "comm"})
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert set(procs) == {0, 1}
    for d in (0, 1):
        assert f"device {d}" in procs[d]
    # A named track per stream; every X event sits on the track of its span's stream.
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e["ph"] == "M" and e["name"] == "thread_name"}
    for d in (0, 1):
        assert sorted(n for (pid, _), n in tracks.items() if pid == d) == [
            "bwd0", "compute", "fwd0"]
    got_tracks = sorted((e["pid"], tracks[(e["pid"], e["tid"])], e["name"]) for e in xs)
    assert got_tracks == sorted((s.device, s.stream, s.name) for s in tl.spans)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    tl = run_chain("eager-1f1b", 3)
    path = tl.plot(tmp_path / "gantt.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- one graph, one engine --------------------------------------------------------------------


def test_simulating_a_resharding_is_the_plans_estimate():
    # The graph of a standalone resharding through the simulator costs what the planner's
    # estimate says: one engine for both.
    cluster = Cluster.preset("p3.8xlarge", 3)
    src = Sharding(cluster.mesh([0]), P("gpu"))
    dst = Sharding(cluster.mesh([1, 2]), P(None, ("host", "gpu")))
    for options in (PlanOptions(), PlanOptions(strategy="send_recv", balance="size")):
        plan = plan_resharding((512, 256), "float32", src, dst, cluster, options)
        tl = simulate(reshard_graph(plan), cluster, {})
        assert tl.iteration_time == approx(estimate(plan, cluster))
        assert {s.op for s in tl.spans} == set(range(len(plan.transfers)))
        lanes = {t.lane for t in plan.transfers}
        assert {s.stream for s in tl.spans} == {f"comm.{k}" if k else "comm" for k in lanes}
        assert all(s.kind == "comm" for s in tl.spans)


def test_spans_carry_op_ids_and_transfer_waits_follow_edges():
    cluster, meshes, boundaries = chain_pipeline(2)
    graph = lower(meshes, boundaries, make_schedule("1f1b", 2, 2), cluster)
    tl = simulate(graph, cluster, {"F": F_COST, "B": B_COST})
    for s in tl.spans:
        op = graph.ops[s.op]
        assert s.device in op.devices and s.stream == op.stream
        assert s.name == str(op.body)
    assert tl.inputs == graph.data_inputs
    # Without the edges no compute waited: the metric reads edges, not names (exposed
    # communication needs no edges: the same with or without them).
    bare = Timeline(tuple(tl.spans), tl.num_stages, tl.devices, tl.stage_of)
    assert tl.transfer_wait(1) > 0 and bare.transfer_wait(1) == 0.0
    assert bare.exposed_comm(1) == tl.exposed_comm(1) >= tl.transfer_wait(1)


def test_a_deadlocking_graph_is_reported_by_the_validator():
    cluster, meshes, boundaries = chain_pipeline(2)
    graph = lower(meshes, boundaries, make_schedule("1f1b", 2, 2), cluster)
    text = graph.to_text().replace("1F0<fwd0:0#0", "1F0<fwd0:0#0,bwd0:1#0")
    with pytest.raises(ProgramError, match="deadlock"):
        simulate(graph.with_text(text), cluster, {"F": F_COST, "B": B_COST})


def test_timeline_trace_round_trip_keeps_ops_and_edges(tmp_path):
    tl = run_chain("eager-1f1b", 3)
    back = Timeline.from_chrome_trace(tl.to_chrome_trace(tmp_path / "t.json"))
    assert sorted(s.op for s in back.spans) == sorted(s.op for s in tl.spans)
    assert dict(back.inputs) == {k: tuple(v) for k, v in tl.inputs.items()}
    for d in tl.devices:
        assert back.exposed_comm(d) == approx(tl.exposed_comm(d))
        assert back.transfer_wait(d) == approx(tl.transfer_wait(d))
        assert back.busy(d) == approx(tl.busy(d))
