"""The runtime and the simulator execute the same step graph.

For every schedule and several plans — the planner's, send/recv, and a hand-made plan whose
second transfer must wait (``Transfer.after``) for its first although the two share no device
— a training step runs on the CPU backend with emulated links and device time, and the
simulator runs the same graph. The measured timeline must hold the same ops on the same
streams, in each lane's order, and respect every dependency of the graph: the end of what an
op waits for (on the device that records it) comes before the op starts (on the device that
waits), ``after`` included. These are orderings of measured timestamps, not durations.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict

import numpy as np
import pytest
from toy_mlp import CLUSTER, ToyMLP

from overlap import Runtime, Stage
from scheduler import (
    SCHEDULES,
    Boundary,
    Channel,
    Cluster,
    DeviceMesh,
    P,
    PlanOptions,
    Sharding,
    StepGraph,
    Timeline,
    lower,
    make_schedule,
    plan_resharding,
    simulate,
)

COMPUTE_S = {"F": 0.004, "B": 0.008}

# Two hosts of two GPUs at 0.02 Gbps: a 16 KiB half of the boundary crosses in ~6.6 ms.
SLOW = Cluster(2, 2, nic_gbps=0.02, nvlink_gbps=0.02, nic_latency_us=100.0,
               nvlink_latency_us=10.0)
M0, M1 = DeviceMesh([[0, 1]], ("host", "gpu")), DeviceMesh([[2, 3]], ("host", "gpu"))
SHAPE = (32, 128)  # float64, split by rows over each stage's two GPUs
BOUNDARY = Boundary(SHAPE, "float64", Sharding(M0, P("gpu")), Sharding(M1, P("gpu")))


def doubling_stages() -> list[Stage]:
    """y = 2 x on every device; the last stage's loss is 0.5 * sum(y**2) of its rows."""

    def fwd0(ctx, x):
        return 2.0 * x

    def bwd0(ctx, dy):
        return 2.0 * dy

    def fwd1(ctx, x):
        ctx.saved["y"] = 2.0 * x
        return 0.5 * float(np.sum(ctx.saved["y"] ** 2))

    def bwd1(ctx, dy):
        return 2.0 * ctx.saved["y"]

    return [Stage(M0, fwd0, bwd0), Stage(M1, fwd1, bwd1)]


def after_plan(direction: str):
    """send/recv plan of the boundary in one direction, its transfer 1 declared ``after``
    transfer 0: they share no device, so only the ``after`` orders them."""
    src, dst = ((BOUNDARY.producer, BOUNDARY.consumer) if direction == "fwd"
                else (BOUNDARY.consumer, BOUNDARY.producer))
    plan = plan_resharding(SHAPE, "float64", src, dst, SLOW,
                           PlanOptions(strategy="send_recv", balance="none"))
    first, second = plan.transfers
    assert not set(first.devices) & set(second.devices)
    return dataclasses.replace(plan, transfers=(first, dataclasses.replace(second, after=(0,))))


def run_both(cluster: Cluster, graph: StepGraph, stages, boundaries, microbatches,
             input_sharding) -> tuple[Timeline, Timeline]:
    def compute_time(stage: int, kind: str) -> float:
        return COMPUTE_S[kind]

    with Runtime(cluster, emulate_links=True, compute_time=compute_time, timeout=60) as rt:
        rt.train_step_sync(stages, boundaries, microbatches, input_sharding=input_sharding,
                           graph=graph)
        measured = rt.timeline()
    return measured, simulate(graph, cluster, compute_time)


def check_same_graph(graph: StepGraph, measured: Timeline, simulated: Timeline) -> None:
    key = lambda s: (s.op, s.device, s.stream)
    assert sorted(map(key, measured.spans)) == sorted(map(key, simulated.spans))
    assert len({key(s) for s in measured.spans}) == len(measured.spans)  # each op once
    by_lane: dict[tuple[int, str], list] = defaultdict(list)
    for s in measured.spans:
        by_lane[(s.device, s.stream)].append(s)
    for (d, stream), spans in by_lane.items():
        spans.sort(key=lambda s: s.start)
        assert [s.op for s in spans] == list(graph.lanes[(d, stream)]), (d, stream)
        for a, b in itertools.pairwise(spans):
            assert a.end <= b.start, (d, stream, a, b)  # FIFO
    span = {(s.op, s.device): s for s in measured.spans}
    for op in graph.ops:
        for dep in op.waits:
            assert span[(dep.op, dep.src)].end <= span[(op.id, dep.dst)].start, (op, dep)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_after_between_senders_is_honoured_like_the_simulator(schedule):
    m = 3
    plans = {Channel("fwd", 0): after_plan("fwd"), Channel("bwd", 0): after_plan("bwd")}
    graph = lower([M0, M1], [BOUNDARY], make_schedule(schedule, 2, m), SLOW, plans=plans)
    afters = [(op, dep) for op in graph.ops for dep in op.waits if dep.src != dep.dst]
    assert len(afters) == 2 * m  # one per resharding
    mbs = [np.random.default_rng(i).standard_normal(SHAPE) for i in range(m)]
    measured, simulated = run_both(SLOW, graph, doubling_stages(), [BOUNDARY], mbs,
                                   Sharding(M0, P("gpu")))
    check_same_graph(graph, measured, simulated)
    span = {(s.op, s.device): s for s in measured.spans}
    for op, dep in afters:  # the second transfer's sender starts only after the first ended
        assert span[(dep.op, dep.src)].end <= span[(op.id, dep.dst)].start


@pytest.mark.parametrize("options", [PlanOptions(), PlanOptions("send_recv", "size")],
                         ids=["broadcast-auto", "send_recv-size"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_toy_pipeline_runs_the_simulated_graph(schedule, options):
    toy = ToyMLP()
    mbs = toy.microbatches(3)
    graph = lower(toy.meshes, toy.boundaries, make_schedule(schedule, 4, len(mbs)), CLUSTER,
                  options)
    measured, simulated = run_both(CLUSTER, graph, toy.stages, toy.boundaries, mbs,
                                   toy.input_sharding)
    check_same_graph(graph, measured, simulated)
    assert measured.inputs == simulated.inputs == graph.data_inputs
