"""Several tensors across one stage boundary: a channel (its own layouts, plan and stream) per
tensor, gradients back for the floating-point ones only; lowered, validated, run."""

from __future__ import annotations

import numpy as np
import pytest

from overlap import Runtime, Stage
from overlap.errors import StreamError
from scheduler import (
    Boundary,
    Channel,
    Cluster,
    DeviceMesh,
    MicrobatchBoundaries,
    P,
    StepGraph,
    lower,
    make_schedule,
)
from scheduler.sharding import Sharding
from scheduler.validate import validate

M0 = DeviceMesh([0], ("x",))
M1 = DeviceMesh([1, 2], ("x",))
CLUSTER = Cluster.preset("p3.8xlarge", num_hosts=1)


def _group(rows: int = 4) -> tuple[Boundary, Boundary]:
    return (Boundary((rows, 3), "float64", Sharding(M0, P()), Sharding(M1, P("x"))),
            Boundary((rows,), "int64", Sharding(M0, P()), Sharding(M1, P())))


def test_a_channel_per_tensor_and_gradients_for_floats_only():
    graph = lower([M0, M1], [_group()], make_schedule("1f1b", 2, 2), CLUSTER)
    validate(graph)
    assert set(graph.channel_sets) == {("fwd", 0), ("bwd", 0)}
    assert graph.channel_sets[("fwd", 0)] == (Channel("fwd", 0), Channel("fwd", 0, 1))
    assert graph.channel_sets[("bwd", 0)] == (Channel("bwd", 0),)
    assert "fwd0_1" in {lane.stream for lane in graph.lanes}
    # The consumer's forward waits for both tensors' transfers.
    assert "1F0<fwd0:0#0,fwd0_1:0#0" in graph.to_text()
    assert StepGraph.from_json(graph.to_json()).to_json() == graph.to_json()
    assert Channel.parse("fwd0_1") == Channel("fwd", 0, 1)


def test_the_validator_sees_every_tensors_transfer():
    graph = lower([M0, M1], [_group()], make_schedule("1f1b", 2, 2), CLUSTER)
    text = graph.to_text().replace("1F0<fwd0:0#0,fwd0_1:0#0", "1F0<fwd0:0#0")
    with pytest.raises(ValueError, match=r"device 1 runs F s1 mb0 .* before .*fwd0_1:0#0"):
        validate(graph.with_text(text))


def _stages(bad_count: bool = False):
    def f0(ctx, x):
        ctx.saved["x"] = x
        a = x * 2
        return (a,) if bad_count else (a, np.arange(x.shape[0], dtype=np.int64) + 10)

    def b0(ctx, dy):
        a, pos = dy
        assert pos is None  # (an integer tensor has no gradient)
        ctx.saved["dx"] = a
        return None

    def f1(ctx, xs):
        a, pos = xs
        ctx.saved["a"] = a
        return float(a.sum() + pos.sum())

    def b1(ctx, dy):
        return (np.ones_like(ctx.saved.pop("a")), None)

    return [Stage(M0, f0, b0), Stage(M1, f1, b1)]


def test_the_runtime_moves_each_tensor_in_its_own_layout():
    x = np.arange(12.0).reshape(4, 3)
    with Runtime(CLUSTER) as rt:
        losses = rt.train_step_sync(_stages(), [_group()], [x, x + 1],
                                    input_sharding=Sharding(M0, P()), schedule="1f1b")
    # Device 1 holds rows 0-1 of 2x (split over x), and all positions 10..13 (replicated).
    for k, loss in enumerate(losses):
        assert loss == pytest.approx(float((2 * (x + k))[:2].sum()) + 46)


def test_variable_shapes_of_several_tensors():
    rows = [4, 6]
    per = MicrobatchBoundaries(tuple((_group(r),) for r in rows))
    xs = [np.ones((r, 3)) for r in rows]
    with Runtime(CLUSTER) as rt:
        losses = rt.train_step_sync(_stages(), per, xs, input_sharding=Sharding(M0, P()),
                                    schedule="gpipe")
    want = [2 * 3 * r // 2 + sum(range(10, 10 + r)) for r in rows]
    assert losses == pytest.approx(want)


def test_a_stage_returning_the_wrong_number_of_tensors_is_named():
    with Runtime(CLUSTER) as rt, pytest.raises(StreamError, match=r"stage 0 forward .* returned "
                                               r"1 values; this boundary carries 2 tensors"):
        rt.train_step_sync(_stages(bad_count=True), [_group()], [np.ones((4, 3))],
                           input_sharding=Sharding(M0, P()), schedule="1f1b")


@pytest.mark.parametrize("bad, error, match", [
    ((), ValueError, r"boundaries\[0\]: an empty tuple"),
    ((_group()[0], "x"), TypeError, r"boundaries\[0\]\[1\]: expected a Boundary"),
])
def test_bad_groups_are_named(bad, error, match):
    with pytest.raises(error, match=match):
        lower([M0, M1], [bad], make_schedule("1f1b", 2, 2), CLUSTER)


def test_microbatches_must_keep_the_number_of_tensors():
    with pytest.raises(ValueError, match=r"per\[1\]\[0\]: 1 tensors, microbatch 0's boundary 0 "
                                         r"has 2"):
        MicrobatchBoundaries(((_group(),), ((_group()[0],),)))
