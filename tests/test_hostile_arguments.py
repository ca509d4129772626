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
    lower,
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


def test_a_tensor_no_device_could_hold_is_refused_at_plan_and_lowering_time():
    with pytest.raises(ValueError, match=r"shape: \(4611686018427387904, 4\) float64 is "
                                         r"\d+ bytes, more than"):
        plan_resharding((2**62, 4), "float64", SRC, DST, CLUSTER)
    m0, m1 = DeviceMesh([0], ("g",)), DeviceMesh([1], ("g",))
    b = Boundary((2**62, 4), "float64", Sharding(m0, P()), Sharding(m1, P()))
    with pytest.raises(ValueError, match=r"boundaries\[0\].shape: .* bytes, more than"):
        lower((m0, m1), [b], make_schedule("1f1b", 2, 1), CLUSTER)


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
