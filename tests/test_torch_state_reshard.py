"""overlap.torch's whole-state resharding: a TorchPipeline's training layout to an inference
layout from a module, a mesh and a tensor-parallel plan, moved by ``reshard_state_dict`` —
every tensor equal to the pipeline's own ``state_dict``, written straight into the inference
shards, bfloat16 included; and every bad input named."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0 "
                                            "(the 'torch' extra) to test overlap.torch")

from torch import nn  # noqa: E402

from overlap import Runtime  # noqa: E402
from overlap.torch import (  # noqa: E402
    ColwiseParallel,
    RowwiseParallel,
    TensorLayout,
    TorchPipeline,
    parallelize,
    plan_state_dict,
    reshard_state_dict,
    tensor_parallel_layout,
    tensor_parallel_shards,
)
from scheduler import Cluster, DeviceMesh, P, Sharding, StateOptions  # noqa: E402

CLUSTER = Cluster.preset("p3.8xlarge", 2)  # 8 devices
STAGE_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}
# The inference engine: the whole model (the stages in one nn.Sequential) on 4 devices.
ENGINE_PLAN = {f"{s}.0": ColwiseParallel() for s in range(3)} | \
              {f"{s}.2": RowwiseParallel() for s in range(3)}


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8))
                           for _ in range(3))).to(dtype)


def _pipe(model):
    meshes = [DeviceMesh([0], ("tp",)), DeviceMesh([1, 2], ("tp",)),
              DeviceMesh([[4, 5], [6, 7]], ("dp", "tp"))]
    return TorchPipeline([copy.deepcopy(m) for m in model], meshes, nn.functional.mse_loss,
                         plans=[None, STAGE_PLAN, STAGE_PLAN], axis="tp",
                         data_parallel="dp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("engine_devices", [[[3, 4, 5, 6]], [[0, 1, 2, 3], [4, 5, 6, 7]]],
                         ids=["tp4-overlapping", "dp2xtp4-colocated"])
def test_a_trained_pipeline_refits_an_inference_engine_in_place(dtype, engine_devices):
    model = _model(dtype)
    pipe = _pipe(model)
    layout = pipe.state_layout()
    assert list(layout) == list(pipe.state_dict())
    assert layout["1.0.weight"].sharding == Sharding(pipe.meshes[1], P("tp"))
    assert layout["2.2.weight"].sharding == Sharding(pipe.meshes[2], P(None, "tp"))
    assert layout["0.0.bias"].sharding == Sharding(pipe.meshes[0], P())
    engine_mesh = DeviceMesh(engine_devices, ("dp", "tp"))
    engine = parallelize(copy.deepcopy(model), engine_mesh, ENGINE_PLAN, axis="tp")
    for m in engine.modules:  # (stale weights: the refit must overwrite every element)
        for p in m.parameters():
            p.data.fill_(7)
    dst = tensor_parallel_layout(model, engine_mesh, ENGINE_PLAN, axis="tp")
    plan = plan_state_dict(layout, dst, CLUSTER, StateOptions(bucket_bytes=512))
    plan.check()
    x = torch.randn(16, 8).to(dtype)
    with Runtime(CLUSTER, timeout=30) as rt:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad()
            pipe.train_step_sync(rt, x, torch.zeros(16, 8, dtype=dtype), num_microbatches=2)
            opt.step()
            out = reshard_state_dict(rt, plan, pipe.local_shards(),
                                     out=tensor_parallel_shards(engine))
            trained = pipe.state_dict()
            assert engine.state_dict().keys() == trained.keys()
            for key, value in engine.state_dict().items():
                assert torch.equal(value, trained[key]), (step, key)
            for k, m in enumerate(engine.modules):  # every shard, each replica's too
                index = engine_mesh.coords()[engine_mesh.device_ids[k]][1]
                for key, value in m.state_dict().items():
                    want = trained[key] if key not in engine.split else \
                        trained[key].chunk(4, engine.split[key])[index]
                    assert torch.equal(value, want), (step, k, key)
    # The tensors returned are the engine's own (written in place).
    first = engine.modules[0].state_dict()
    d0 = engine_mesh.device_ids[0]
    assert out["1.0.weight"][d0].data_ptr() == first["1.0.weight"].data_ptr()


def test_new_destination_tensors_when_no_out_is_given():
    model = _model(torch.bfloat16)
    pipe = _pipe(model)
    mesh = DeviceMesh([3, 4], ("tp",))
    plan = plan_state_dict(pipe.state_layout(), tensor_parallel_layout(model, mesh, ENGINE_PLAN),
                           CLUSTER)
    with Runtime(CLUSTER, timeout=30) as rt:
        out = reshard_state_dict(rt, plan, pipe.local_shards())
    full = pipe.state_dict()
    w = full["2.2.weight"]  # RowwiseParallel: columns split
    assert out["2.2.weight"][3].dtype == torch.bfloat16
    assert torch.equal(out["2.2.weight"][3], w[:, :6]) and torch.equal(out["2.2.weight"][4],
                                                                       w[:, 6:])
    assert torch.equal(out["0.0.bias"][4], full["0.0.bias"][6:])


def test_bad_layouts_and_shards_are_named():
    model = _model()
    pipe = _pipe(model)
    src = pipe.state_layout()
    mesh = DeviceMesh([3, 4], ("tp",))
    dst = tensor_parallel_layout(model, mesh, ENGINE_PLAN)
    with pytest.raises(ValueError,
                       match=r"dst: its names differ from src's: missing \['0.0.bias'\]"):
        plan_state_dict(src, {k: v for k, v in dst.items() if k != "0.0.bias"}, CLUSTER)
    wrong = {**dst, "0.0.bias": TensorLayout((12,), "float64", dst["0.0.bias"].sharding)}
    with pytest.raises(ValueError, match=r"dst\['0.0.bias'\]: \(12,\) float64, but src"):
        plan_state_dict(src, wrong, CLUSTER)
    with pytest.raises(TypeError, match=r"src\['0.0.bias'\]: expected a TensorLayout"):
        plan_state_dict({**src, "0.0.bias": 3}, dst, CLUSTER)
    with pytest.raises(ValueError, match=r"plan\['nope'\]: Sequential has no submodule"):
        tensor_parallel_layout(model, mesh, {"nope": ColwiseParallel()})
    plan = plan_state_dict(src, dst, CLUSTER)
    shards = pipe.local_shards()
    with Runtime(CLUSTER, timeout=30) as rt:
        with pytest.raises(TypeError, match=r"local_tensors\['0.0.bias'\]\[0\]: expected a "
                                            r"torch.Tensor"):
            reshard_state_dict(rt, plan, {**shards, "0.0.bias": {0: [1.0]}})
        with pytest.raises(ValueError, match=r"local_tensors\['0.0.bias'\]\[0\]: got \(3,\)"):
            reshard_state_dict(rt, plan, {**shards, "0.0.bias": {0: torch.zeros(3)}})
        with pytest.raises(ValueError,
                           match=r"local_tensors: no shards for tensors \['1.0.bias'\]"):
            reshard_state_dict(rt, plan, {k: v for k, v in shards.items() if k != "1.0.bias"})
        with pytest.raises(TypeError, match=r"rt: expected an overlap\.Runtime"):
            reshard_state_dict(None, plan, shards)
