"""overlap.torch.auto_partition (issue 36, point 5): per-block costs measured here, the
partition built into stage modules, meshes and tensor-parallel plans, and the GPT example
partitioned automatically training with plain torch's numerics."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0")

from torch import nn  # noqa: E402
from torch_reference import load_example  # noqa: E402

from overlap.torch import (  # noqa: E402
    ColwiseParallel,
    RowwiseParallel,
    auto_partition,
    measure_layers,
)
from scheduler import Cluster, Layer, P  # noqa: E402
from scheduler.partition.model import all_reduce_seconds  # noqa: E402

MEGATRON = {"0": ColwiseParallel(), "2": RowwiseParallel()}  # Linear, ReLU, Linear


def _mlp(width: int = 32) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))


@pytest.fixture
def example(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave the suite's alone
    return load_example("gpt_auto_partition.py")


SMALL = ["--layers", "2", "--width", "32", "--heads", "4", "--seq", "8", "--vocab", "64",
         "--batch", "8", "--microbatches", "4", "--steps", "2"]


@pytest.mark.parametrize("extra", [["--devices", "4"], ["--devices", "2", "--degrees", "2"]])
def test_the_gpt_example_partitioned_automatically_trains_like_plain_torch(example, extra,
                                                                           capsys):
    # Whatever the measured costs choose (stages, degrees, schedule), the numerics are
    # torch's; with degrees 2 alone every stage is tensor-parallel (all blocks in one
    # stage on 2 devices: the blocks' plans joined under the stage's names).
    assert example.main([*SMALL, *extra]) == 0
    out = capsys.readouterr().out
    assert "match plain torch" in out and "simulated iteration" in out
    if "--degrees" in extra:
        assert "[0-3@2]" in out


@pytest.mark.parametrize("flag, value", [("--devices", "0"), ("--layers", "-1"),
                                         ("--lr", "0"), ("--degrees", "0,2"),
                                         ("--degrees", "two")])
def test_the_examples_bad_flags_are_refused_by_name(example, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        example.main([flag, value])
    assert exit_.value.code == 2 and f"{flag}:" in capsys.readouterr().err


def test_the_example_fails_when_a_tensor_parallel_gradient_is_wrong(example, monkeypatch,
                                                                    capsys):
    from overlap.torch import comm

    real = comm.AxisComm.run

    def partial(self, op, t, dim, what):
        if op == "all_reduce" and "(backward)" in what and self.ctx is not None \
                and hasattr(self.ctx, "mesh"):  # (a step, not the measuring rehearsal)
            return t
        return real(self, op, t, dim, what)

    monkeypatch.setattr(comm.AxisComm, "run", partial)
    assert example.main([*SMALL, "--devices", "2", "--degrees", "2"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_measured_layers_say_what_the_blocks_are():
    cluster = Cluster.local(4)
    blocks = [_mlp(), _mlp(), nn.Linear(32, 10)]
    x, y = torch.randn(4, 32), torch.randn(4, 10)
    plans = [MEGATRON, MEGATRON, None]
    layers = measure_layers(blocks, x, target=y, loss_fn=nn.functional.mse_loss,
                            tp_plans=plans, degrees=(1, 2, 4), cluster=cluster, repeat=2,
                            optimizer_states=2)
    assert [type(x) for x in layers] == [Layer] * 3
    assert layers[0].degrees == (1, 2, 4) and layers[2].degrees == (1,)  # no plan: 1 only
    assert layers[0].output_shape == (4, 32) and layers[2].output_shape == (4, 10)
    assert layers[0].dtype == "float32"
    params = sum(p.numel() for p in blocks[0].parameters()) * 4
    assert layers[0].params_bytes == params * (2 + 2)  # weights, gradients, Adam's two
    assert layers[0].activation_bytes >= 4 * 128 * 4  # (at least the hidden activation)
    assert layers[0].output_spec == P() and layers[0].input_spec == P()
    for layer in layers:
        for table in (layer.forward, layer.backward, layer.input_grad, layer.weight_grad):
            assert all(v > 0 for v in table.values())
    # A degree's collectives are costed, not run: the forward's all-reduce of the output
    # over 2 devices is at least in it.
    slow = Cluster(1, 4, nic_gbps=1.0, nvlink_gbps=0.01)  # an all-reduce takes ~ms here
    again = measure_layers(nn.Sequential(_mlp()), x, tp_plans=[MEGATRON], degrees=(2,),
                           cluster=slow, repeat=1)  # (an nn.Sequential: its children)
    assert again[0].degrees == (2,)
    assert again[0].forward[2] >= all_reduce_seconds(4 * 32 * 4, 2, slow)


def test_a_column_parallel_output_is_a_sharded_layout():
    layers = measure_layers([nn.Sequential(nn.Linear(16, 32))], torch.randn(4, 16),
                            tp_plans=[{"0": ColwiseParallel()}], degrees=(1, 2),
                            cluster=Cluster.local(2), repeat=1)
    assert layers[0].output_spec == P(None, "tp")  # Shard(-1) of a rank-2 output


def test_measuring_leaves_the_blocks_grads_and_rng_as_they_were():
    blocks = [_mlp(), nn.Dropout(0.5), _mlp()]
    before = [{k: v.clone() for k, v in b.state_dict().items()} for b in blocks]
    x = torch.randn(4, 32)
    state = torch.random.get_rng_state()
    measure_layers(blocks, x, tp_plans=[MEGATRON, None, MEGATRON],
                   degrees=(1, 2), cluster=Cluster.local(2), repeat=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    for b, saved in zip(blocks, before):
        assert all(torch.equal(v, saved[k]) for k, v in b.state_dict().items())
        assert all(p.grad is None for p in b.parameters())


def test_auto_partition_hands_the_blocks_themselves_with_stage_plans():
    blocks = [_mlp() for _ in range(4)]
    cluster = Cluster.local(2)
    # Given costs (no measuring): every block only at degree 2 — one stage of 2 devices.
    layers = [Layer({2: 0.01}, {2: 0.02}, (4, 32), "float32", 0, 0) for _ in blocks]
    auto = auto_partition(blocks, cluster, 4, torch.randn(4, 32), tp_plans=lambda block: MEGATRON,
                          layers=layers)
    assert len(auto.modules) == 1 and list(auto.modules[0]) == blocks  # not copies
    assert auto.plans[0] == {f"{k}.{n}": s for k in range(4) for n, s in MEGATRON.items()}
    assert auto.meshes[0].device_ids == (0, 1) and auto.schedule is auto.plan.schedule
    pipe = auto.pipeline(nn.functional.mse_loss)
    assert pipe.tp[0] is not None and pipe.tp[0].degree == 2


def test_a_data_parallel_partition_trains_like_plain_torch():
    # Given costs: blocks that only run at degree 1 with no parameters to reduce, on 4
    # devices — the partition splits the batch over "dp" (all four devices compute).
    import copy

    from overlap import Runtime

    torch.manual_seed(0)
    blocks = [_mlp(8).double() for _ in range(2)]
    reference = nn.Sequential(*copy.deepcopy(blocks))
    layers = [Layer({1: 0.01}, {1: 0.02}, (8, 8), "float64", 0, 0) for _ in blocks]
    auto = auto_partition(blocks, Cluster.local(4), 2, torch.randn(8, 8, dtype=torch.float64),
                          layers=layers)
    assert any(st.dp > 1 for st in auto.plan.stages), auto.plan.to_text()
    pipe = auto.pipeline(nn.functional.mse_loss)
    assert pipe.data_parallel.axis == "dp"
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    with Runtime(Cluster.local(4), timeout=30) as rt:
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=2, schedule=auto.schedule)
    want = []
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        loss = nn.functional.mse_loss(reference(xm), ym)
        (loss / 2).backward()
        want.append(loss.item())
    assert losses == pytest.approx(want, rel=1e-12)
    stage0 = [p for p in pipe.local_stages[0].modules[0].parameters()]
    first = auto.plan.stages[0].layers
    ref0 = [p for b in list(reference)[first.start:first.stop] for p in b.parameters()]
    for got, ref in zip(stage0, ref0):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-10, atol=1e-12)


class _Raises(nn.Module):
    def forward(self, x):
        raise AssertionError("measured: the arguments were not checked first")


@pytest.mark.parametrize("call, error, match", [
    (lambda: measure_layers([], torch.randn(2, 2)), TypeError, r"blocks: expected"),
    (lambda: measure_layers([nn.ReLU(), 3], torch.randn(2, 2)), TypeError, r"blocks\[1\]"),
    (lambda: measure_layers([nn.ReLU()], [1.0]), TypeError, r"sample: expected a tensor"),
    (lambda: measure_layers([nn.ReLU()], torch.randn(2, 2), tp_plans=[None, None]), ValueError,
     r"tp_plans: 2 plans for 1 blocks"),
    (lambda: measure_layers([nn.ReLU()], torch.randn(2, 2), tp_plans={"": None}), TypeError,
     r"tp_plans: expected a callable"),
    (lambda: measure_layers([nn.ReLU()], torch.randn(2, 2), degrees=(1, 2)), ValueError,
     r"degrees: \[1, 2\] needs a cluster="),
    (lambda: measure_layers([nn.ReLU()], torch.randn(2, 2), degrees=(0,)), ValueError,
     r"degrees: expected an int >= 1"),
    (lambda: measure_layers([nn.ReLU()], torch.randn(2, 2), warmup=-1), ValueError,
     r"warmup: expected an int >= 0"),
    (lambda: measure_layers([nn.ReLU()], torch.randn(2, 2), repeat=0), ValueError,
     r"repeat: expected an int >= 1"),
    (lambda: measure_layers([nn.ReLU()], torch.randn(2, 2), cluster="local"), TypeError,
     r"cluster: expected a scheduler.Cluster"),
    (lambda: measure_layers([nn.ReLU()], torch.randn(2, 2), degrees=(2,),
                            cluster=Cluster.local(2)), ValueError,
     r"blocks\[0\] \(ReLU\): supports none of degrees \[2\] \(it has no tensor-parallel"),
    (lambda: auto_partition([nn.ReLU()], "local", 2, torch.randn(2, 2)), TypeError,
     r"cluster: expected a scheduler.Cluster"),
    (lambda: auto_partition([nn.ReLU()], Cluster.local(1), 2, torch.randn(2, 2),
                            layers=[]), ValueError, r"layers: 0 layers for 1 blocks"),
    # (refused before any block is timed: a block that raises would say otherwise)
    (lambda: auto_partition([_Raises()], Cluster.local(1), 0, torch.randn(2, 2)),
     ValueError, r"num_microbatches: expected an int >= 1"),
    (lambda: auto_partition([_Raises()], Cluster.local(1), 2, torch.randn(2, 2),
                            memory_per_device=-1), ValueError, r"memory_per_device"),
    (lambda: auto_partition([_Raises()], Cluster.local(1), 2, torch.randn(2, 2),
                            options="broadcast"), TypeError, r"options: expected a PlanOptions"),
    (lambda: auto_partition([_Raises()], Cluster.local(1), 2, torch.randn(2, 2), budget=3),
     TypeError, r"budget: expected a SearchBudget"),
])
def test_bad_arguments_are_named_before_any_work(call, error, match):
    with pytest.raises(error, match=match):
        call()
