"""bfloat16, float16 and float8 end to end: plans, their JSON, the cost model's bytes, the CPU
backend's bytes, NCCL's types, the torch adapter — and the named errors for dtypes that are
none of these."""

from __future__ import annotations

import copy

import ml_dtypes
import numpy as np
import pytest

from overlap import Runtime
from scheduler import (
    Boundary,
    Cluster,
    CostModel,
    DeviceMesh,
    P,
    ReshardPlan,
    Sharding,
    lower_bound,
    plan_resharding,
)
from scheduler.dtypes import NARROW_FLOATS, check_dtype

CLUSTER = Cluster.preset("p3.8xlarge", 2)
SRC = Sharding(CLUSTER.mesh([0], gpus=2), P("gpu"))
DST = Sharding(CLUSTER.mesh([1], gpus=4), P(None, "gpu"))
NARROW = ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]


def _bits(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Every bit pattern is fair game: the runtime moves bytes, it never reads values."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("name", NARROW)
def test_plans_carry_narrow_floats_at_their_size(name):
    plan = plan_resharding((8, 16), name, SRC, DST, CLUSTER)
    assert plan.dtype == name and plan.itemsize == np.dtype(name).itemsize
    assert sum(t.nbytes for t in plan.transfers) >= 8 * 16 * plan.itemsize // 2
    wide = plan_resharding((8, 16), "float32", SRC, DST, CLUSTER)
    assert [t.nbytes * 4 // plan.itemsize for t in plan.transfers] == \
        [t.nbytes for t in wide.transfers]
    # The cost model and the bound charge the element's bytes (2 or 1, not numpy's 4 or 8).
    model = CostModel(CLUSTER)
    assert model.plan_time(plan) < model.plan_time(wide)
    assert lower_bound((8, 16), name, SRC, DST, CLUSTER) < \
        lower_bound((8, 16), "float32", SRC, DST, CLUSTER)
    again = ReshardPlan.from_json(plan.to_json())
    assert again == plan and again.dtype == name


@pytest.mark.parametrize("name", NARROW)
def test_the_cpu_backend_moves_narrow_floats_bit_for_bit(name):
    dt = np.dtype(name)
    full = _bits(dt, (8, 16), seed=len(name))
    plan = plan_resharding(full.shape, dt, SRC, DST, CLUSTER)
    shards = {d: full[tuple(slice(a, b) for a, b in r)]
              for d, r in SRC.device_regions(full.shape).items()}
    with Runtime(CLUSTER, timeout=20) as rt:
        out = rt.reshard_sync(plan, shards)
    for d, region in DST.device_regions(full.shape).items():
        want = full[tuple(slice(a, b) for a, b in region)]
        assert out[d].dtype == dt
        assert out[d].tobytes() == want.tobytes(), f"device {d}"


@pytest.mark.parametrize("dtype, match", [
    ("V2", r"dtype: 'V2' \(\|V2\) is not a numeric or bool dtype"),
    (object, r"dtype: <class 'object'> \(object\) is not a numeric"),
    (">f4", r"dtype: '>f4' is big-endian, not this machine's byte order"),
    ("bfloat17", r"dtype: 'bfloat17' is not a numpy dtype or dtype name"),
])
def test_other_dtypes_get_the_named_error(dtype, match):
    with pytest.raises(TypeError, match=match):
        plan_resharding((4, 4), dtype, SRC, DST, CLUSTER)
    with pytest.raises(TypeError, match=match):
        check_dtype(dtype)


def test_narrow_float_names_canonicalize():
    for name, dt in NARROW_FLOATS.items():
        assert check_dtype(name) == dt == check_dtype(getattr(ml_dtypes, name))
    assert check_dtype("<f2") == np.dtype("float16")


def test_a_plan_json_with_a_bad_dtype_is_named():
    text = plan_resharding((4, 4), "bfloat16", SRC, DST, CLUSTER).to_json()
    with pytest.raises(ValueError, match=r"plan JSON: .*plan JSON dtype: 'V2' \(\|V2\) is not"):
        ReshardPlan.from_json(text.replace('"bfloat16"', '"V2"'))


def test_nccl_types_for_reductions_and_bytes_for_transfers():
    cupy_nccl = pytest.importorskip("cupy.cuda.nccl", reason="the cuda13 extra (real CuPy) is "
                                                           "not installed")
    from overlap.backends.devices.nccl_groups import nccl_bytes, nccl_dtype

    assert nccl_dtype(NARROW_FLOATS["bfloat16"]) == cupy_nccl.NCCL_BFLOAT16
    assert nccl_dtype(np.float16) == cupy_nccl.NCCL_FLOAT16
    with pytest.raises(TypeError, match=r"dtype: NCCL reduces and gathers no float8_e4m3fn"):
        nccl_dtype(NARROW_FLOATS["float8_e4m3fn"])
    # Sends and receives move bytes, so float8 crosses too.
    buf = np.zeros((3, 5), NARROW_FLOATS["float8_e5m2"])
    assert nccl_bytes(buf) == (15, cupy_nccl.NCCL_UINT8)
    assert nccl_bytes(np.zeros(4, NARROW_FLOATS["bfloat16"])) == (8, cupy_nccl.NCCL_UINT8)


# ---- the torch adapter -------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_a_torch_pipeline_in_half_precision_equals_plain_torch_bit_for_bit(dtype_name):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from torch import nn
    from torch_reference import reference_losses

    from overlap.torch import TorchPipeline

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    mods = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()).to(dtype) for _ in range(3)]
    ref = copy.deepcopy(mods)
    cluster = Cluster.preset("p3.8xlarge", 1)
    meshes = [DeviceMesh([d], ("gpu",)) for d in (0, 1, 2)]
    pipe = TorchPipeline(mods, meshes, nn.functional.mse_loss)
    x, y = torch.randn(8, 8).to(dtype), torch.randn(8, 8).to(dtype)
    with Runtime(cluster, timeout=20) as rt:
        boundaries = pipe.boundaries(x[:2], y[:2])
        assert all(isinstance(b, Boundary) and b.dtype == dtype_name for b in boundaries)
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=4, schedule="1f1b")
    want = reference_losses(ref, x.chunk(4), nn.functional.mse_loss, y.chunk(4))
    assert losses == want
    for a, b in zip(mods, ref):
        for p, q in zip(a.parameters(), b.parameters()):
            assert p.grad.dtype == dtype and torch.equal(p.grad, q.grad)


def test_torch_narrow_floats_cross_without_a_copy():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from overlap.torch.tensors import from_torch, numpy_dtype, to_torch

    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        t = torch.randn(3, 4).to(getattr(torch, name))
        a = from_torch(t)
        assert a.dtype == NARROW_FLOATS[name] == numpy_dtype(t.dtype)
        assert a.ctypes.data == t.data_ptr()
        back = to_torch(a)
        assert back.dtype == t.dtype and back.data_ptr() == t.data_ptr()
        assert np.array_equal(a.astype(np.float32), t.float().numpy())
