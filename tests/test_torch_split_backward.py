"""The split backward (``I`` then ``W``) of torch stages: the same gradients as one fused
backward, each activation gradient computed once, parameter hooks as in a fused backward."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from overlap.torch import stage_backward_input, stage_backward_weight  # noqa: E402


class Counted(torch.autograd.Function):
    """Identity whose backward counts its runs: a node on the activation path."""

    runs = 0

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        Counted.runs += 1
        return g


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        # q, k and v read one input: none below another (one call of the engine in W).
        self.q = nn.Linear(width, width, bias=False)
        self.k, self.v = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = self.ln(x)
        a = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), dim=-1) @ self.v(h)
        return x + self.fc2(Counted.apply(torch.nn.functional.gelu(self.fc1(a))))


def stage(width: int = 16, blocks: int = 3, dtype=torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(Block(width) for _ in range(blocks))).to(dtype)


def fused_and_split(make, x, dy):  # type: ignore[no-untyped-def]
    """(input grad, parameter grads) of a fused backward and of I then W, on two copies."""
    out = []
    for split in (False, True):
        m = make()
        xi = x.detach().clone().requires_grad_(True)
        y = m(xi)
        if split:
            dx, pending = stage_backward_input(y, dy, xi, list(m.parameters()))
            stage_backward_weight(pending)
        else:
            torch.autograd.backward(y, dy)
            dx = xi.grad
        out.append((dx, [p.grad for p in m.parameters()]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_i_then_w_gives_the_fused_backwards_gradients(dtype):
    x = torch.randn(2, 5, 16, dtype=dtype)
    dy = torch.randn(2, 5, 16, dtype=dtype)
    (dx_f, g_f), (dx_s, g_s) = fused_and_split(lambda: stage(dtype=dtype), x, dy)
    torch.testing.assert_close(dx_s, dx_f, rtol=0, atol=0)
    assert len(g_f) == len(g_s) == 3 * 11
    for a, b in zip(g_s, g_f):
        assert a is not None
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_each_activation_gradient_is_computed_once():
    m = stage(blocks=4)
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = m(x)
    Counted.runs = 0
    dx, pending = stage_backward_input(y, torch.ones_like(y), x, list(m.parameters()))
    assert Counted.runs == 4 and dx is not None
    # I leaves the products (weights) to W; it finishes the reductions (norms) itself.
    assert all(p.grad is None for p in m.parameters() if p.dim() >= 2)
    assert all(p.grad is not None for b in m for p in b.ln.parameters())
    stage_backward_weight(pending)
    assert Counted.runs == 4  # W walked none of the activation path again
    assert all(p.grad is not None for p in m.parameters())


def test_gradients_accumulate_over_microbatches_like_repeated_backwards():
    xs = [torch.randn(2, 5, 16) for _ in range(3)]
    ref, split = stage(), stage()
    for x in xs:
        torch.autograd.backward(ref(x.requires_grad_(True)), torch.ones(2, 5, 16))
        xi = x.detach().requires_grad_(True)
        y = split(xi)
        _, pending = stage_backward_input(y, torch.ones_like(y), xi, list(split.parameters()))
        stage_backward_weight(pending)
    for a, b in zip(split.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


class Tied(nn.Module):
    """One weight used by two layers (and a layer called twice): the plain split's case."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.b.weight = self.a.weight

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.a(torch.tanh(self.b(torch.tanh(self.a(x)))))


def test_a_weight_used_twice_still_gets_its_whole_gradient():
    def make():  # type: ignore[no-untyped-def]
        torch.manual_seed(1)
        return Tied()
    x, dy = torch.randn(4, 16), torch.randn(4, 16)
    (dx_f, g_f), (dx_s, g_s) = fused_and_split(make, x, dy)
    torch.testing.assert_close(dx_s, dx_f)
    for a, b in zip(g_s, g_f):
        torch.testing.assert_close(a, b)


def test_parameter_hooks_run_once_per_backward_as_in_a_fused_one():
    m = stage(blocks=2)
    seen: list[str] = []
    accumulated: list[str] = []
    for name, p in m.named_parameters():
        p.register_hook(lambda g, name=name: (seen.append(name), g * 2)[1])
        p.register_post_accumulate_grad_hook(lambda p, name=name: accumulated.append(name))
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = m(x)
    _, pending = stage_backward_input(y, torch.ones_like(y), x, list(m.parameters()))
    stage_backward_weight(pending)
    names = [n for n, _ in m.named_parameters()]
    assert sorted(seen) == sorted(names) and sorted(accumulated) == sorted(names)
    ref = stage(blocks=2)
    for p in ref.parameters():
        p.register_hook(lambda g: g * 2)
    torch.autograd.backward(ref(x.detach().requires_grad_(True)), torch.ones_like(y))
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_an_input_that_does_not_reach_the_output_leaves_everything_to_w():
    m = nn.Linear(4, 1)
    x = torch.randn(3, 4, requires_grad=True)
    loss = m(torch.ones(3, 4)).sum()  # (x unused)
    dx, pending = stage_backward_input(loss, None, x, list(m.parameters()))
    assert dx is None and m.weight.grad is None
    stage_backward_weight(pending)
    torch.testing.assert_close(m.weight.grad, torch.full((1, 4), 3.0))
    # Stage 0: no input gradient asked for.
    m.zero_grad()
    dx, pending = stage_backward_input(m(x).sum(), None, None, list(m.parameters()))
    stage_backward_weight(pending)
    assert dx is None and x.grad is None
    torch.testing.assert_close(m.weight.grad, x.detach().sum(0, keepdim=True))
