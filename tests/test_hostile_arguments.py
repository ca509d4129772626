"""Arguments a hostile (or careless) caller passes: each named before any work, none read
silently as something else (issue 35's "silent acceptance" cases)."""

from __future__ import annotations

import numpy as np
import pytest

from overlap import Runtime
from scheduler import (
    Boundary,
    Cluster,
    DeviceMesh,
    P,
    Sharding,
    make_schedule,
    plan_resharding,
)

CLUSTER = Cluster.local(2)
MESH = DeviceMesh([0, 1], ("g",))
SRC, DST = Sharding(MESH, P()), Sharding(MESH, P("g"))


@pytest.mark.parametrize("shape, match", [
    (iter([8, 8]), r"shape: expected a sequence of ints \(a tuple or list\), got list_iterator"),
    ({8: 1}, r"shape: expected a sequence of ints \(a tuple or list\), got dict"),
    ({8, 4}, r"shape: expected a sequence of ints \(a tuple or list\), got set"),
    ("88", r"shape: expected a sequence of ints \(a tuple or list\), got str"),
])
def test_a_shape_must_be_a_sequence_not_any_iterable(shape, match):
    with pytest.raises(TypeError, match=match):
        plan_resharding(shape, "float32", SRC, DST, CLUSTER)
    assert plan_resharding(np.array([8, 8]), "float32", SRC, DST, CLUSTER).shape == (8, 8)


def test_a_dtype_is_named_explicitly():
    with pytest.raises(TypeError, match=r"dtype: None; name the dtype"):
        plan_resharding((8, 8), None, SRC, DST, CLUSTER)


def test_a_tensor_no_device_could_hold_is_refused_at_plan_and_boundary_time():
    with pytest.raises(ValueError, match=r"shape: \(4611686018427387904, 4\) float64 is "
                                         r"\d+ bytes, more than"):
        plan_resharding((2**62, 4), "float64", SRC, DST, CLUSTER)
    m0, m1 = DeviceMesh([0], ("g",)), DeviceMesh([1], ("g",))
    with pytest.raises(ValueError, match=r"Boundary shape: .* bytes, more than"):
        Boundary((2**62, 4), "float64", Sharding(m0, P()), Sharding(m1, P()))


@pytest.mark.parametrize("args, error, match", [
    (("ab", "float32"), TypeError, r"Boundary shape: expected a sequence of ints"),
    ((iter([4]), "float32"), TypeError, r"Boundary shape: expected a sequence of ints"),
    (((4, -1), "float32"), ValueError, r"Boundary shape"),
    (((4,), None), TypeError, r"Boundary dtype"),
    (((4,), ">f8"), (TypeError, ValueError), r"Boundary dtype"),
])
def test_a_boundary_is_checked_when_made(args, error, match):
    m0, m1 = DeviceMesh([0], ("g",)), DeviceMesh([1], ("g",))
    with pytest.raises(error, match=match):
        Boundary(*args, Sharding(m0, P()), Sharding(m1, P()))
    with pytest.raises(TypeError, match=r"Boundary consumer: expected a Sharding, got DeviceMesh"):
        Boundary((4,), "float32", Sharding(m0, P()), m1)
    made = Boundary([4, 2], np.float32, Sharding(m0, P()), Sharding(m1, P()))
    assert (made.shape, made.dtype) == ((4, 2), "float32")  # canonical: a tuple, a name


def test_an_out_buffer_whose_elements_share_memory_is_refused():
    plan = plan_resharding((4, 4), "float64", SRC, DST, CLUSTER)
    shards = {d: np.arange(16.0).reshape(4, 4) for d in (0, 1)}
    with Runtime(CLUSTER) as rt:
        good = {0: np.zeros((2, 4)), 1: np.zeros((2, 4))}
        rt.reshard_sync(plan, shards, out=good)
        bad = dict(good)
        bad[1] = np.lib.stride_tricks.as_strided(np.zeros(8), (2, 4), (8, 8))
        with pytest.raises(ValueError, match=r"out\[1\]: its strides \(8, 8\) make elements "
                                             r"share memory"):
            rt.reshard_sync(plan, shards, out=bad)
        transposed = {0: np.zeros((4, 2)).T, 1: np.zeros((4, 2)).T}  # strided, no overlap
        out = rt.reshard_sync(plan, shards, out=transposed)
        assert np.array_equal(out[1], shards[0][2:])


def test_empty_and_sparse_torch_batches_are_named():
    torch = pytest.importorskip("torch")
    from torch import nn

    from overlap.torch import TorchPipeline

    pipe = TorchPipeline([nn.Linear(8, 8)], [DeviceMesh([0], ("g",))],
                         lambda y: y.pow(2).mean())
    with Runtime(Cluster.local(1)) as rt:
        with pytest.raises(ValueError, match=r"inputs: an empty batch \(shape \(0, 8\)\)"):
            pipe.train_step_sync(rt, torch.randn(0, 8), num_microbatches=1)
        with pytest.raises(TypeError, match=r"inputs: a torch.sparse_coo tensor"):
            pipe.train_step_sync(rt, torch.randn(4, 8).to_sparse(), num_microbatches=1)
        with pytest.raises(ValueError, match=r"microbatches\[1\]: an empty batch"):
            pipe.train_step_sync(rt, microbatches=[torch.randn(2, 8), torch.randn(0, 8)])
    assert all(p.grad is None for p in pipe.parameters())


def _diagonal_plan(cuts: int, rank: int):
    """A plan of ``cuts`` one-element transfers on the diagonal of a rank-``rank`` tensor:
    its regions cut every dimension ``cuts`` times, and most of the tensor is not moved."""
    import json

    from scheduler import ReshardPlan

    plan = plan_resharding((cuts,) * rank, "float32", Sharding(DeviceMesh([0], ("g",)), P()),
                           Sharding(DeviceMesh([1], ("g",)), P()), CLUSTER)
    data = json.loads(plan.to_json())
    data["transfers"] = [{"region": [[k, k + 1]] * rank, "sender": 0, "receivers": [1],
                          "nbytes": 4} for k in range(cuts)]
    return ReshardPlan.from_json(json.dumps(data))


def test_a_plan_whose_regions_cut_the_tensor_finely_is_checked_exactly_in_bounded_time():
    import time

    from scheduler import PlanError

    bad = _diagonal_plan(128, 4)  # 128**4 cells of a grid; 128 transfers
    start = time.perf_counter()
    with pytest.raises(PlanError, match=r"device 1: destination region \[0:128, 0:128, 0:128, "
                                        r"0:128\] not delivered exactly once \(268435328 "
                                        r"element\(s\) missing; first missing: \["):
        bad.check()
    assert time.perf_counter() - start < 5  # named at once, not after gigabytes


def test_a_plan_too_fragmented_to_check_within_the_work_budget_is_refused():
    from scheduler import PlanError

    with pytest.raises(PlanError, match=r"too many or too finely cut to check within \d+ box "
                                        r"operations"):
        _diagonal_plan(2, 40).check()  # each receiver's box has 2**40 corners


def _slab_plan(width: int):
    """A correct plan of few transfers whose regions cut a 5-d tensor into billions of grid
    cells: stage 0's device 0 holds it all; device d of 1..4 gets row d-1, in slabs
    ``width`` wide cut along dimension d (a different one for each device)."""
    from scheduler import ReshardPlan, Transfer

    shape = (4, 256, 256, 256, 256)
    src = Sharding(DeviceMesh([0], ("g",)), P())
    dst = Sharding(DeviceMesh([1, 2, 3, 4], ("g",)), P("g"))
    transfers = []
    for d in range(1, 5):
        for k in range(0, 256, width):
            region = [(d - 1, d), *((0, 256),) * 4]
            region[d] = (k, k + width)
            transfers.append(Transfer(tuple(region), 0, (d,), 4 * (256 ** 3) * width))
    return ReshardPlan(shape, "float32", src, dst, tuple(transfers), "send_recv", "none")


def test_a_correct_plan_of_billions_of_cells_is_accepted_and_a_gap_in_it_named():
    import dataclasses

    from scheduler import PlanError

    plan = _slab_plan(2)  # 512 transfers; a dense grid would hold 4 * 129**4 cells
    plan.check()
    gap = dataclasses.replace(plan, transfers=plan.transfers[:200] + plan.transfers[201:])
    missing = plan.transfers[200]  # device 2's slab [144:146] of dimension 2
    with pytest.raises(PlanError, match=r"device 2: .* not delivered exactly once \(33554432 "
                                        r"element\(s\) missing; first missing: \[1:2, 0:256, "
                                        r"144:146, 0:256, 0:256\]"):
        gap.check()
    assert missing.region == ((1, 2), (0, 256), (144, 146), (0, 256), (0, 256))
    twice = dataclasses.replace(plan, transfers=(*plan.transfers, plan.transfers[5]))
    with pytest.raises(PlanError, match=r"device 1: .*transfers 5 and 512 both deliver "
                                        r"\[0:1, 10:12, 0:256, 0:256, 0:256\]"):
        twice.check()


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update(nbytes=float("inf")), r"plan JSON: malformed \(OverflowError"),
    (lambda t: t.update(region=[[0, 1]] * 5), r"region rank != tensor rank 2"),
])
def test_a_plan_file_of_impossible_values_is_named(edit, match):
    import json

    from scheduler import PlanError, ReshardPlan

    data = json.loads(plan_resharding((4, 4), "float32", SRC, DST, CLUSTER).to_json())
    edit(data["transfers"][0])
    with pytest.raises((ValueError, PlanError), match=match):
        ReshardPlan.from_json(json.dumps(data)).check()


def test_a_plan_of_more_lanes_than_a_device_runs_is_refused():
    import json

    from scheduler import PlanError, ReshardPlan
    from scheduler.balance import MAX_LANES

    data = json.loads(plan_resharding((4, 4), "float32", SRC, DST, CLUSTER).to_json())
    data["transfers"][0]["lane"] = 2000
    with pytest.raises(PlanError, match=rf"lane 2000; a plan runs on at most {MAX_LANES} "
                                        r"lanes"):
        ReshardPlan.from_json(json.dumps(data)).check()
    with Runtime(CLUSTER) as rt, pytest.raises(PlanError, match=r"lane 2000"):
        rt.reshard_sync(ReshardPlan.from_json(json.dumps(data)),
                        {d: np.zeros((4, 4), np.float32) for d in (0, 1)})


def test_a_schedule_too_big_to_list_is_refused_at_once():
    import time

    from scheduler.schedules import MAX_STAGE_MICROBATCHES

    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"num_microbatches: 4 stages × 10000000 microbatches "
                                         r"is more than"):
        make_schedule("gpipe", 4, 10**7)
    assert time.perf_counter() - start < 1
    make_schedule("1f1b", 4, MAX_STAGE_MICROBATCHES // 64)  # (well within: fine)


def test_a_partition_too_big_to_search_is_refused_at_once():
    import time

    from scheduler import Layer, PartitionError, partition
    from scheduler.partition.search import MAX_DEVICES

    layer = Layer({1: 1e-3}, {1: 2e-3}, (8, 8), "float32", 1024, 1024)
    start = time.perf_counter()
    with pytest.raises(PartitionError, match=rf"cluster: .* devices; a partition searches at "
                                             rf"most {MAX_DEVICES}$"):
        partition([layer], Cluster.preset("p3.8xlarge", 10**9), 4)
    with pytest.raises(PartitionError, match=r"layers: 8000 layers on 1 devices .* need about "
                                             r"[\d.]+ GiB of search tables"):
        partition([layer] * 8000, Cluster.local(1), 4)
    assert time.perf_counter() - start < 5  # named before any table is built


def test_event_times_no_float_holds_are_named_not_raised():
    from scheduler.intervals import check_id, scaled_interval

    with pytest.raises(ValueError, match=r"e: its start is 1000.*\(401 characters\), not a "
                                         r"time within a capture"):
        scaled_interval(10**400, 1, 1e-6, "e")
    with pytest.raises(ValueError, match=r"e: its tid is True, not an integer in 0\.\.2\*\*63-1"):
        check_id(True, "e", "tid")
    assert scaled_interval(2, 3, 1e-6, "e") == pytest.approx((2e-6, 5e-6))
