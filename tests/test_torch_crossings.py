"""Several tensors between torch stages (overlap.torch.crossing): a tuple or dict of tensors
crosses as one boundary per tensor, gradients back for the floating ones; values that are
not tensors pass through; the Hugging Face-style example trains like plain torch.

Expected values come from plain torch calling the same modules in turn."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0")

from torch import nn  # noqa: E402
from torch_reference import load_example  # noqa: E402

from overlap import Runtime  # noqa: E402
from overlap.errors import StreamError  # noqa: E402
from overlap.torch import TorchPipeline  # noqa: E402
from scheduler import Cluster, DeviceMesh, P  # noqa: E402

CLUSTER = Cluster.local(4)
MESHES = [DeviceMesh([d], ("x",)) for d in range(3)]


class Split(nn.Module):
    """Two floating outputs that both reach the loss, an integer one, and a constant."""

    def __init__(self, extra: object = None) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
        self.extra = extra

    def forward(self, x):
        ids = torch.arange(x.shape[0])
        return self.a(x), self.b(x), ids, self.extra


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(4, 4).double()

    def forward(self, a, b, ids, extra):
        assert extra is None and ids.dtype == torch.int64
        return {"h": self.c(a * b) + ids[:, None], "scale": a.sum()}


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.d = nn.Linear(4, 1).double()

    def forward(self, h, scale):
        return self.d(h) * scale


def _loss(y):
    return y.pow(2).mean()


def _reference(mods, x):
    a = mods[0](x)
    mid = mods[1](*a)
    return mods[2](**mid)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_tuples_and_dicts_of_tensors_cross_with_their_gradients(schedule):
    torch.manual_seed(0)
    mods = [Split(), Join(), Last()]
    reference = copy.deepcopy(mods)
    pipe = TorchPipeline(mods, MESHES, _loss)
    x = torch.randn(8, 4, dtype=torch.float64)
    with Runtime(CLUSTER, timeout=30) as rt:
        losses = pipe.train_step_sync(rt, x, num_microbatches=2, schedule=schedule)
        groups = pipe.boundaries(x[:4])
    want = []
    for xm in x.chunk(2):
        loss = _loss(_reference(reference, xm))
        (loss / 2).backward()
        want.append(loss.item())
    assert losses == pytest.approx(want, rel=1e-12)
    for m, r in zip(mods, reference):
        for (name, p), q in zip(m.named_parameters(), r.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    # Boundary 0: three tensors (the constant None is not moved); boundary 1: two.
    assert [len(g) for g in groups] == [3, 2]
    assert [b.dtype for b in groups[0]] == ["float64", "float64", "int64"]


def test_a_value_passed_through_must_not_change():
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4).double()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x), self.calls

    class Take(nn.Module):
        def forward(self, h, n):
            return h

    pipe = TorchPipeline([Counter(), Take()], MESHES[:2], _loss)
    x = torch.randn(8, 4, dtype=torch.float64)
    with Runtime(CLUSTER, timeout=30) as rt, \
            pytest.raises(StreamError, match=r"modules\[0\] forward: entry 1 is \d+, where it "
                                             r"was 1 before; a value that is not a tensor is "
                                             r"passed through"):
        pipe.train_step_sync(rt, x, num_microbatches=2, schedule="1f1b")


@pytest.mark.parametrize("out, error, match", [
    ({1: "key"}, TypeError, r"modules\[0\] forward: returned a dict with key 1"),
    ((None, 3), TypeError, r"returned a tuple without a tensor"),
    ("nested", TypeError, r"entry 1 is a list; a stage's tuple or dict holds tensors"),
])
def test_bad_structures_are_named_before_any_work(out, error, match):
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4).double()

        def forward(self, x):
            return (self.lin(x), [x]) if out == "nested" else out

    pipe = TorchPipeline([Bad(), nn.Linear(4, 4).double()], MESHES[:2], _loss)
    with Runtime(CLUSTER, timeout=30) as rt:
        with pytest.raises(error, match=match):
            pipe.train_step_sync(rt, torch.randn(4, 4, dtype=torch.float64),
                                 num_microbatches=1)
        assert rt.backend.streams() == []


def test_positions_of_one_row_stay_whole_under_data_parallel():
    ex = load_example("decoder_layers.py")
    torch.manual_seed(0)
    mods = [ex.Embedding(16, 8), ex.DecoderLayer(8, 2), ex.Head(16, 8)]
    meshes = [DeviceMesh([[2 * s], [2 * s + 1]], ("dp", "tp")) for s in range(3)]
    from overlap.torch import replicate

    pipe = TorchPipeline([replicate(m, 2) for m in mods], meshes, ex.lm_loss,
                         data_parallel="dp")
    ids = torch.randint(0, 16, (4, 6))
    hidden, positions = pipe.boundaries(ids, ids)[0]
    assert hidden.producer.spec == P("dp") and positions.producer.spec == P()
    assert positions.shape == (1, 6) and positions.dtype == "int64"


@pytest.mark.parametrize("flags", [[], ["--schedule", "zb-h1"], ["--dp", "2"],
                                   ["--schedule", "gpipe", "--dp", "2"]])
def test_the_decoder_layers_example_trains_like_plain_torch(flags, capsys, monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # leave the suite's alone
    ex = load_example("decoder_layers.py")
    assert ex.main(flags) == 0
    assert "decoder layers match plain torch" in capsys.readouterr().out


def test_a_tensor_that_only_looks_batch_major_is_named_under_data_parallel():
    # A per-position table (T, 8) where T happens to equal the microbatch's batch: split as
    # the batch by the rule, and each device returns it whole — named, with what to do.
    class WithTable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8).double()
            self.table = nn.Parameter(torch.randn(4, 8, dtype=torch.float64))

        def forward(self, x):
            return self.lin(x), self.table

    class Use(nn.Module):
        def forward(self, h, table):
            return h + table.sum()

    from overlap.torch import replicate

    meshes = [DeviceMesh([[0], [1]], ("dp", "tp")), DeviceMesh([[2], [3]], ("dp", "tp"))]
    pipe = TorchPipeline([replicate(WithTable(), 2), replicate(Use(), 2)], meshes, _loss,
                         data_parallel="dp")
    x = torch.randn(8, 8, dtype=torch.float64)
    with Runtime(CLUSTER, timeout=30) as rt, \
            pytest.raises(StreamError, match=r"modules\[0\] forward: entry 1 has dimension 0 of "
                                             r"size 4, but data_parallel splits it as the batch "
                                             r".* needs a leading dimension of 1"):
        pipe.train_step_sync(rt, x, num_microbatches=2, schedule="1f1b")
