"""The cost model (scheduler/cost.py) against hand-computed values.

Every cluster here has round rates: an 8 Gbps NIC moves 1e9 B/s per direction and an 80 Gbps
NVLink port 1e10 B/s, so expected times can be worked out on paper from docs/architecture.md
("Cost model (one, shared)", "Lower bound") and the docstrings of cost.py.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from scheduler import Cluster, DeviceMesh, P, Sharding, Transfer, estimate, plan_resharding
from scheduler.cost import (
    GPU_IN,
    GPU_MEM,
    GPU_OUT,
    NIC_IN,
    NIC_OUT,
    CostModel,
    Hop,
    TransferTiming,
    lower_bound_for,
    paper_model_time,
)

NIC = 1e9  # bytes/s of an 8 Gbps NIC port
NVL = 1e10  # bytes/s of an 80 Gbps NVLink port
REGION = ((0, 1),)  # the cost model never looks at the region


def cl(num_hosts: int, gpus_per_host: int, **kw) -> Cluster:
    params = dict(
        nic_gbps=8.0, nics_per_host=1, nvlink_gbps=80.0, nic_latency_us=0, nvlink_latency_us=0
    )
    params.update(kw)
    return Cluster(num_hosts, gpus_per_host, **params)


def tr(sender: int, receivers, nbytes: float, after=()) -> Transfer:
    return Transfer(REGION, sender, tuple(receivers), int(nbytes), tuple(after))


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-12)


def spans(timings):
    return [(t.start, t.end) for t in timings]


# ---- chain --------------------------------------------------------------------------------


def test_chain_sender_host_first_then_hosts_in_receiver_order():
    model = CostModel(cl(4, 4))
    # Hosts: 0 = {0..3}, 1 = {4..7}, 2 = {8..11}. Receivers list host 2 before host 1, and
    # the sender's own host in between: the home host still goes first, then 2, then 1.
    hops = model.chain(0, [9, 1, 5, 2, 10, 6])
    assert hops == [
        Hop(0, 1, False),
        Hop(1, 2, False),
        Hop(2, 9, True),
        Hop(9, 10, False),
        Hop(10, 5, True),
        Hop(5, 6, False),
    ]


def test_chain_without_receivers_on_sender_host():
    model = CostModel(cl(3, 4))
    assert model.chain(4, [8, 0]) == [Hop(4, 8, True), Hop(8, 0, True)]
    assert model.chain(4, [5]) == [Hop(4, 5, False)]
    assert model.chain(4, [1]) == [Hop(4, 1, True)]


def test_local_copy_has_no_hops():
    model = CostModel(cl(2, 4))
    assert model.chain(3, [3]) == []
    tc = model.cost_of(3, [3], 10**9)
    assert tc.ports == ((GPU_MEM, 3),)
    # A local copy runs at the NVLink rate: 1e9 B / 1e10 B/s.
    (t,) = model.run([tr(3, [3], 1e9)])
    assert (t.start, t.end) == approx((0.0, 0.1))


# ---- one transfer -------------------------------------------------------------------------


@pytest.mark.parametrize("latency_us", [0, 40])
def test_point_to_point_network_transfer(latency_us):
    model = CostModel(cl(2, 4, nic_latency_us=latency_us, nvlink_latency_us=7))
    nbytes = 3 * 10**9
    tc = model.cost_of(1, [6], nbytes)
    # One network hop: host 0's NIC out, host 1's NIC in; no pipeline fill for one hop.
    assert set(tc.ports) == {(NIC_OUT, 0), (NIC_IN, 1)}
    assert tc.alone_bw == approx(NIC)
    expected = latency_us * 1e-6 + nbytes / NIC
    assert model.alone_time(tr(1, [6], nbytes)) == approx(expected)
    (t,) = model.run([tr(1, [6], nbytes)])
    assert t.start == 0.0
    assert t.end == approx(expected)


def test_point_to_point_nvlink_transfer():
    model = CostModel(cl(1, 4, nvlink_latency_us=3))
    tc = model.cost_of(0, [2], 10**9)
    assert set(tc.ports) == {(GPU_OUT, 0), (GPU_IN, 2)}
    (t,) = model.run([tr(0, [2], 1e9)])
    assert t.end == approx(3e-6 + 1e9 / NVL)


def test_chained_broadcast_to_two_remote_hosts():
    chunk = 10**6
    model = CostModel(cl(3, 4, nic_latency_us=10, nvlink_latency_us=2), chunk_bytes=chunk)
    nbytes = 10**9
    # Two network hops 0 -> 4 -> 8: bottleneck NIC; the last chunk still crosses one more hop.
    lat = 2 * 10e-6
    expected = lat + nbytes / NIC + (chunk / NIC + chunk / NIC) - chunk / NIC
    assert expected == approx(0.001020 + 1.0)
    assert model.alone_time(tr(0, [4, 8], nbytes)) == approx(expected)
    (t,) = model.run([tr(0, [4, 8], nbytes)])
    assert t.end == approx(expected)


def test_chained_broadcast_with_nvlink_hop_inside_a_host():
    chunk = 10**6
    model = CostModel(cl(3, 4, nic_latency_us=10, nvlink_latency_us=2), chunk_bytes=chunk)
    nbytes = 10**9
    # 0 -> 4 (network), 4 -> 5 (NVLink), 5 -> 8 (network).
    tc = model.cost_of(0, [4, 5, 8], nbytes)
    assert set(tc.ports) == {
        (NIC_OUT, 0), (NIC_IN, 1), (GPU_OUT, 4), (GPU_IN, 5), (NIC_OUT, 1), (NIC_IN, 2)
    }
    lat = 10e-6 + 2e-6 + 10e-6
    fill = (chunk / NIC + chunk / NVL + chunk / NIC) - chunk / NIC  # 1.1 ms
    expected = lat + nbytes / NIC + fill
    assert expected == approx(1.0 + 22e-6 + 1.1e-3)
    assert tc.fixed_s == approx(lat + fill)
    assert tc.alone_bw == approx(NIC)
    assert model.alone_time(tr(0, [4, 5, 8], nbytes)) == approx(expected)


def test_chunk_is_capped_by_transfer_size():
    # A transfer smaller than a chunk pipelines as one chunk of its own size.
    model = CostModel(cl(3, 4), chunk_bytes=10**6)
    nbytes = 500_000
    expected = nbytes / NIC + 2 * nbytes / NIC - nbytes / NIC  # = 2 × nbytes / NIC
    assert model.alone_time(tr(0, [4, 8], nbytes)) == approx(expected)
    assert expected == approx(1e-3)


# ---- sharing ------------------------------------------------------------------------------


def test_two_flows_share_sender_nic_egress_equally():
    model = CostModel(cl(3, 4))
    b = 10**9
    # Devices 0 and 1 are on host 0 (one NIC): both leave through NIC 0's egress.
    timings = model.run([tr(0, [4], b), tr(1, [8], b)])
    assert spans(timings) == [approx((0.0, 2 * b / NIC)), approx((0.0, 2 * b / NIC))]


def test_max_min_small_flow_ends_then_big_flow_gets_full_rate():
    model = CostModel(cl(3, 4))
    b = 10**9
    small, big = model.run([tr(0, [4], b), tr(1, [8], 3 * b)])
    # Both at NIC/2 until the small one is done (2B/NIC); the big one has 3B - B = 2B left,
    # now at the full rate: 2B/NIC + 2B/NIC.
    assert small.end == approx(2 * b / NIC)
    assert big.end == approx(4 * b / NIC)
    assert small.start == big.start == 0.0


def test_max_min_three_flows_over_two_shared_ports():
    model = CostModel(cl(4, 4))
    b = 10**9
    # A: host0 -> host1, B: host0 -> host2, C: host3 -> host2.
    # host0 egress holds A, B (1/2 each); host2 ingress holds B, C (1/2 each): B = 1/2;
    # A then gets what is left on host0 egress (1/2), C what is left on host2 ingress (1/2).
    a, bb, c = model.run([tr(0, [4], b), tr(1, [8], b), tr(12, [9], b)])
    for t in (a, bb, c):
        assert t.start == 0.0
        assert t.end == approx(b / (NIC / 2))


def test_max_min_gives_unequal_rates():
    model = CostModel(cl(5, 4))
    b = 10**9
    # A: 0 -> host1, D: 2 -> host4, B: 1 -> host2 (all out of host 0's NIC: 1/3 each);
    # C: host3 -> host2 shares host2 ingress with B only, so it gets 1 - 1/3 = 2/3.
    # C ends at B/(2/3) = 1.5 s. Then A, B, D stay at 1/3 (host 0 egress is still the
    # bottleneck) with 1 - 1.5/3 = 0.5 GB left each: 1.5 + 0.5/(1/3) = 3 s.
    timings = model.run([tr(0, [4], b), tr(2, [16], b), tr(1, [8], b), tr(12, [9], b)])
    a, d, bb, c = (t.end for t in timings)
    assert c == approx(1.5 * b / NIC)
    assert a == approx(3 * b / NIC)
    assert d == approx(3 * b / NIC)
    assert bb == approx(3 * b / NIC)


def test_ingress_is_shared_too():
    model = CostModel(cl(3, 4))
    b = 10**9
    # Different source hosts, one destination host: host 2's NIC ingress is shared.
    x, y = model.run([tr(0, [8], b), tr(4, [9], b)])
    assert x.end == approx(2 * b / NIC)
    assert y.end == approx(2 * b / NIC)


def test_disjoint_ports_run_in_parallel_at_full_rate():
    model = CostModel(cl(4, 4))
    b = 10**9
    x, y = model.run([tr(0, [4], b), tr(8, [12], 2 * b)])
    assert spans([x, y]) == [approx((0.0, b / NIC)), approx((0.0, 2 * b / NIC))]


# ---- ordering: FIFO streams, after, ready -------------------------------------------------


def test_fifo_per_device_even_when_ports_differ():
    model = CostModel(cl(2, 4))
    b = 10**9
    # Same sender 0: a network send, then an NVLink send using none of the same ports.
    first, second = model.run([tr(0, [4], b), tr(0, [1], b)])
    assert (first.start, first.end) == approx((0.0, b / NIC))
    assert (second.start, second.end) == approx((b / NIC, b / NIC + b / NVL))


def test_fifo_on_receiver_device():
    model = CostModel(cl(3, 4))
    b = 10**9
    # Device 8 receives twice: the second transfer waits although its sender is idle.
    first, second = model.run([tr(0, [8], b), tr(4, [8], b)])
    assert first.end == approx(b / NIC)
    assert (second.start, second.end) == approx((b / NIC, 2 * b / NIC))


def test_after_delays_transfer_on_disjoint_devices():
    model = CostModel(cl(4, 4))
    b = 10**9
    free = model.run([tr(0, [4], b), tr(8, [12], 2 * b)])
    assert free[1].start == 0.0
    first, second = model.run([tr(0, [4], b), tr(8, [12], 2 * b, after=(0,))])
    assert first.end == approx(b / NIC)
    assert (second.start, second.end) == approx((b / NIC, 3 * b / NIC))


def test_after_waits_for_all_listed_transfers():
    model = CostModel(cl(4, 4))
    b = 10**9
    timings = model.run([tr(0, [4], b), tr(8, [12], 3 * b), tr(1, [2], b, after=(0, 1))])
    assert timings[2].start == approx(3 * b / NIC)
    assert timings[2].end == approx(3 * b / NIC + b / NVL)


@pytest.mark.parametrize("after", [[(), (1,)], [(1,), ()], [(), (-1,)], [(), (5,)]])
def test_run_costs_rejects_after_that_is_not_earlier(after):
    model = CostModel(cl(4, 4))
    costs = [model.cost_of(0, [4], 10**6), model.cost_of(8, [12], 10**6)]
    with pytest.raises(ValueError, match="after"):
        model.run_costs(costs, [(0, 4), (8, 12)], after=after)


def test_ready_time_delays_start():
    model = CostModel(cl(4, 4))
    b = 10**9
    costs = [model.cost_of(0, [4], b), model.cost_of(8, [12], b)]
    timings = model.run_costs(costs, [(0, 4), (8, 12)], ready=[0.0, 0.5])
    assert spans(timings) == [approx((0.0, 1.0)), approx((0.5, 1.5))]


def test_ready_time_of_lone_transfer_and_with_fifo():
    model = CostModel(cl(3, 4))
    b = 10**9
    (t,) = model.run_costs([model.cost_of(0, [4], b)], [(0, 4)], ready=[0.25])
    assert (t.start, t.end) == approx((0.25, 1.25))
    # Same sender: the second is ready at 0.5 but its stream is busy until 1.0.
    costs = [model.cost_of(0, [4], b), model.cost_of(0, [8], b)]
    timings = model.run_costs(costs, [(0, 4), (0, 8)], ready=[0.0, 0.5])
    assert spans(timings) == [approx((0.0, 1.0)), approx((1.0, 2.0))]
    # Ready later than the stream frees: ready wins.
    timings = model.run_costs(costs, [(0, 4), (0, 8)], ready=[0.0, 2.5])
    assert spans(timings) == [approx((0.0, 1.0)), approx((2.5, 3.5))]


def test_plan_time_is_makespan_and_empty_plan_is_zero():
    model = CostModel(cl(4, 4))
    plan = _tiny_plan(cl(4, 4))
    assert model.plan_time(dataclasses.replace(plan, transfers=())) == 0.0
    b = 10**9
    plan2 = dataclasses.replace(plan, transfers=(tr(0, [4], b), tr(8, [12], 2 * b)))
    assert model.plan_time(plan2) == approx(2 * b / NIC)


# ---- list scheduling -----------------------------------------------------------------------

# (sender, receivers, nbytes) on a 3-host × 2-GPU cluster: hosts {0,1}, {2,3}, {4,5}.
_LS = [
    (0, (2,), 3e8),
    (1, (4,), 5e8),
    (0, (1,), 2e9),
    (2, (4, 5), 4e8),
    (3, (0,), 6e8),
    (5, (1, 3), 1e8),
    (4, (4,), 7e8),
    (1, (2,), 2.5e8),
    (3, (5,), 9e8),
    (0, (3, 4), 1.5e8),
]


def test_list_schedule_replays_to_same_timings():
    model = CostModel(cl(3, 2, nic_latency_us=5, nvlink_latency_us=1), chunk_bytes=10**6)
    transfers = [tr(s, r, n) for s, r, n in _LS]
    costs = [model.transfer_cost(t) for t in transfers]
    devices = [t.devices for t in transfers]
    nbytes = [t.nbytes for t in transfers]
    started: list[int] = []
    order, timings = model.list_schedule(
        costs, devices, key=lambda i: -nbytes[i], on_start=started.append
    )
    assert sorted(order) == list(range(len(_LS)))
    assert started == order
    # At time 0 every device is free: largest first, skipping those whose devices are taken:
    # 2 (2e9, devs 0,1), 8 (9e8, devs 3,5), 6 (7e8, dev 4); nothing else fits.
    assert order[:3] == [2, 8, 6]
    assert [timings[i].start for i in order[:3]] == [0.0, 0.0, 0.0]
    assert all(timings[i].start > 0 for i in order[3:])
    # A device is in one transfer at a time.
    for dev in range(6):
        on = sorted((timings[i].start, timings[i].end) for i in range(10) if dev in devices[i])
        for (_, e1), (s2, _) in itertools.pairwise(on):
            assert s2 >= e1 - 1e-12
    replay = model.run_costs([costs[i] for i in order], [devices[i] for i in order])
    for k, i in enumerate(order):
        assert replay[k].start == approx(timings[i].start)
        assert replay[k].end == approx(timings[i].end)


def test_list_schedule_and_run_costs_agree_with_hand_values():
    # Two transfers out of host 0 plus one NVLink copy: list order by key; all start at 0.
    model = CostModel(cl(3, 4))
    b = 10**9
    costs = [model.cost_of(0, [4], b), model.cost_of(1, [8], 3 * b), model.cost_of(2, [3], b)]
    devices = [(0, 4), (1, 8), (2, 3)]
    order, timings = model.list_schedule(costs, devices, key=lambda i: i)
    assert order == [0, 1, 2]
    assert all(isinstance(t, TransferTiming) for t in timings)
    assert spans(timings) == [approx((0.0, 2.0)), approx((0.0, 4.0)), approx((0.0, 0.1))]


# ---- the paper's simple model --------------------------------------------------------------


def _tiny_plan(cluster: Cluster):
    g = cluster.gpus_per_host
    src = Sharding(DeviceMesh([list(range(g))], ("host", "gpu")), P())
    dst = Sharding(DeviceMesh([list(range(g, 2 * g))], ("host", "gpu")), P())
    return plan_resharding((8,), "float32", src, dst, cluster)


def _paper(cluster: Cluster, transfers) -> float:
    plan = dataclasses.replace(_tiny_plan(cluster), transfers=tuple(transfers))
    return paper_model_time(plan, cluster)


def test_paper_model_serializes_transfers_sharing_a_host():
    c = cl(3, 2, nic_latency_us=40)  # latency plays no part in the paper's model
    b = 10**9
    # 0 -> 2 and 1 -> 4 both use host 0's NIC: 1 s then 2 s.
    assert _paper(c, [tr(0, [2], b), tr(1, [4], 2 * b)]) == approx(3.0)


def test_paper_model_runs_disjoint_hosts_in_parallel():
    c = cl(4, 2)
    b = 10**9
    assert _paper(c, [tr(0, [2], b), tr(4, [6], 2 * b)]) == approx(2.0)


def test_paper_model_respects_after():
    c = cl(4, 2)
    b = 10**9
    assert _paper(c, [tr(0, [2], b), tr(4, [6], 2 * b, after=(0,))]) == approx(3.0)


def test_paper_model_broadcast_costs_one_hop_and_holds_all_its_nics():
    c = cl(4, 2, nvlink_latency_us=5)
    b = 10**9
    # 0 -> 2 -> 4 holds NICs 0, 1, 2 for b / NIC (not twice that).
    assert _paper(c, [tr(0, [2, 4], b)]) == approx(1.0)
    # 3 -> 5 (host 1 -> host 2) waits for both NICs; 6 -> 7 stays inside host 3: parallel.
    assert _paper(c, [tr(0, [2, 4], b), tr(3, [5], b), tr(6, [7], 2 * b)]) == approx(2.0)


def test_paper_model_nvlink_transfers():
    c = cl(3, 2)
    b = 10**9
    # Inside a host: bytes / NVLink, after earlier transfers sharing a device.
    assert _paper(c, [tr(0, [1], 10 * b)]) == approx(1.0)
    assert _paper(c, [tr(0, [2], b), tr(0, [1], 10 * b)]) == approx(2.0)
    assert _paper(c, [tr(0, [2], b), tr(4, [5], 10 * b)]) == approx(1.0)


# ---- network bytes -------------------------------------------------------------------------


def test_network_bytes_counts_each_network_hop():
    c = cl(3, 2)
    model = CostModel(c)
    plan = _tiny_plan(c)
    b = 1000

    def nb(transfers) -> int:
        p = dataclasses.replace(plan, transfers=tuple(transfers))
        return model.network_bytes(p)

    assert nb([tr(0, [2, 4], b)]) == 2 * b
    assert nb([tr(0, [2, 3, 4], b)]) == 2 * b  # the NVLink hop 2 -> 3 is free
    assert nb([tr(0, [1, 2], b)]) == b
    assert nb([tr(0, [0], b), tr(1, [1], b)]) == 0  # local copies
    assert nb([tr(0, [1], b)]) == 0  # NVLink only
    assert nb([tr(0, [2], b), tr(3, [4, 5], 3 * b), tr(4, [4], b)]) == b + 3 * b


# ---- lower bound ---------------------------------------------------------------------------


def _mesh(cluster: Cluster, hosts) -> DeviceMesh:
    return cluster.mesh(hosts)


def test_lower_bound_replicated_to_two_hosts():
    c = cl(3, 2, nic_latency_us=10, nvlink_latency_us=1)
    shape, nbytes = (250_000_000,), 10**9  # int32
    src = Sharding(_mesh(c, [0]), P())
    dst = Sharding(_mesh(c, [1, 2]), P())
    # Each destination host ingests all bytes; host 0 sends them out at least once.
    expected = nbytes / NIC + 10e-6
    lb = lower_bound_for(shape, "int32", src, dst, c)
    assert lb == approx(expected)
    plan = plan_resharding(shape, "int32", src, dst, c)
    plan.check()
    assert estimate(plan, c) >= lb


def test_lower_bound_source_egress_dominates():
    c = cl(4, 2, nic_latency_us=10, nvlink_latency_us=1)
    shape, nbytes = (300_000_000,), 12 * 10**8  # int32
    src = Sharding(_mesh(c, [0]), P())
    dst = Sharding(_mesh(c, [1, 2, 3]), P("host"))
    # Ingress: a third (4e8 B) per host = 0.4 s; source host egress: all 1.2e9 B = 1.2 s.
    lb = lower_bound_for(shape, "int32", src, dst, c)
    assert lb == approx(nbytes / NIC + 10e-6)
    plan = plan_resharding(shape, "int32", src, dst, c)
    plan.check()
    assert estimate(plan, c) >= lb


def test_lower_bound_inside_one_host_uses_gpu_ingress_and_nvlink_latency():
    c = cl(2, 4, nic_latency_us=10, nvlink_latency_us=3)
    nbytes = 11 * 10**8
    src = Sharding(DeviceMesh([[0]], ("host", "gpu")), P())
    dst = Sharding(DeviceMesh([[1]], ("host", "gpu")), P())
    # Nothing crosses hosts; GPU 1 ingests everything at most at NVLink + NIC rate.
    lb = lower_bound_for((nbytes,), "int8", src, dst, c)
    assert lb == approx(nbytes / (NVL + NIC) + 3e-6)
    plan = plan_resharding((nbytes,), "int8", src, dst, c)
    assert estimate(plan, c) >= lb


def test_lower_bound_zero_when_nothing_moves():
    c = cl(2, 4, nic_latency_us=10, nvlink_latency_us=3)
    s = Sharding(_mesh(c, [0]), P("gpu"))
    assert lower_bound_for((1024,), "float32", s, s, c) == 0.0


def test_a_run_stopped_at_until_keeps_what_ended_and_leaves_the_rest_nan():
    cluster = Cluster.preset("dgx-h100", 2)
    model = CostModel(cluster)
    # Four transfers one after another on GPU 0's stream, then one more on another GPU.
    transfers = [Transfer(((0, 1 << 20),), 0, (8,), 1 << 20) for _ in range(4)]
    transfers.append(Transfer(((0, 1 << 20),), 1, (9,), 1 << 20))
    full = model.run(transfers)
    assert model.run(transfers, until=max(x.end for x in full)) == full
    cut = model.run(transfers, until=full[1].end)
    assert cut[:2] == full[:2] and cut[4] == full[4]  # ended by then: the same times
    assert all(x.end != x.end for x in cut[2:4])  # not ended: nan
