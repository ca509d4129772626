"""Train Hugging Face-style decoder layers as pipeline stages, no wrapper: several tensors
cross each stage boundary.

The model is written here (no hub download), in the shape of a Llama decoder: an embedding
stage that returns a dict ``{"hidden_states", "position_ids"}``, decoder layers whose
``forward(hidden_states, position_ids)`` applies rotary position embeddings from the
position ids and returns ``(hidden_states, position_ids)``, and a head ``forward(
hidden_states, position_ids)`` returning the logits. ``TorchPipeline`` passes a dict as
keyword arguments and a tuple as positional ones; each tensor crosses on its own channel
with its own layout (the float hidden states get gradients back, the integer position ids
none; ids of shape ``(1, seq)`` stay whole on every device even when ``--dp 2`` splits the
batch).

Every step's losses and, at the end, every parameter are compared with the same modules
called one after the other in plain torch (same weights, the mean over microbatches); the
script exits non-zero if they differ.

    python examples/decoder_layers.py
    python examples/decoder_layers.py --schedule zb-h1 --dp 2
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import overlap
from overlap.torch import TorchPipeline, replicate
from scheduler import Cluster, DeviceMesh
from scheduler.cli.common import positive_float, positive_int


def rotate(x: torch.Tensor, position_ids: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Llama's ``rotate_half`` form) of ``x`` (batch, heads, seq,
    head dim) at ``position_ids`` (batch or 1, seq)."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angle = position_ids[:, None, :, None].to(torch.float32) * freq  # (b, 1, seq, half)
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(x.dtype), torch.cat([angle.sin()] * 2,
                                                                       -1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Embedding(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return {"hidden_states": self.embed_tokens(input_ids), "position_ids": position_ids}


class DecoderLayer(nn.Module):
    """Pre-norm attention with rotary positions, then a SiLU-gated MLP, as Llama's."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.input_layernorm = nn.RMSNorm(width)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(width, width, bias=False) for _ in range(4))
        self.post_attention_layernorm = nn.RMSNorm(width)
        self.gate_proj, self.up_proj = (nn.Linear(width, 2 * width, bias=False)
                                        for _ in range(2))
        self.down_proj = nn.Linear(2 * width, width, bias=False)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, w = hidden_states.shape
        h = self.input_layernorm(hidden_states)

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, w // self.num_heads).transpose(1, 2)
        q = rotate(heads(self.q_proj(h)), position_ids)
        k = rotate(heads(self.k_proj(h)), position_ids)
        a = F.scaled_dot_product_attention(q, k, heads(self.v_proj(h)), is_causal=True)
        hidden_states = hidden_states + self.o_proj(a.transpose(1, 2).reshape(b, t, w))
        h = self.post_attention_layernorm(hidden_states)
        hidden_states = hidden_states + self.down_proj(F.silu(self.gate_proj(h))
                                                       * self.up_proj(h))
        return hidden_states, position_ids


class Head(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.norm, self.lm_head = nn.RMSNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_states))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def call(module: nn.Module, x: object) -> object:
    """Plain torch's chaining, as the pipeline calls a stage on what crossed."""
    if isinstance(x, dict):
        return module(**x)
    if isinstance(x, tuple):
        return module(*x)
    return module(x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=positive_int, default=2)
    ap.add_argument("--layers", type=positive_int, default=2)
    ap.add_argument("--width", type=positive_int, default=32)
    ap.add_argument("--heads", type=positive_int, default=4)
    ap.add_argument("--vocab", type=positive_int, default=64)
    ap.add_argument("--seq", type=positive_int, default=16)
    ap.add_argument("--batch", type=positive_int, default=8)
    ap.add_argument("--microbatches", type=positive_int, default=2)
    ap.add_argument("--lr", type=positive_float, default=1e-2)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--dp", type=positive_int, default=1,
                    help="devices per stage, splitting the batch (data_parallel='dp')")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    modules = [Embedding(args.vocab, args.width),
               *(DecoderLayer(args.width, args.heads) for _ in range(args.layers)),
               Head(args.vocab, args.width)]
    reference = copy.deepcopy(modules)
    p, k = len(modules), args.dp
    meshes = [DeviceMesh([[k * s + i] for i in range(k)], ("dp", "tp")) for s in range(p)]
    pipe = TorchPipeline([replicate(m, k) for m in modules], meshes, lm_loss,
                         data_parallel="dp" if k > 1 else None)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    ref_opt = torch.optim.AdamW([q for m in reference for q in m.parameters()], lr=args.lr)
    data = torch.Generator().manual_seed(1)
    worst = 0.0
    print(f"decoder layers: embedding, {args.layers} layers, head as {p} stages (dp {k}), "
          f"{args.schedule}, batch {args.batch} in {args.microbatches} microbatches")
    with overlap.Runtime(Cluster.local(p * k)) as rt:
        for step in range(args.steps):
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=data)
            targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=data)
            opt.zero_grad()
            losses = pipe.train_step_sync(rt, ids, targets,
                                          num_microbatches=args.microbatches,
                                          schedule=args.schedule)
            opt.step()
            ref_opt.zero_grad()
            want = []
            for x, y in zip(ids.chunk(args.microbatches), targets.chunk(args.microbatches)):
                out: object = x
                for m in reference:
                    out = call(m, out)
                loss = lm_loss(out, y)  # type: ignore[arg-type]
                (loss / args.microbatches).backward()
                want.append(loss.item())
            ref_opt.step()
            diff = max(abs(a - b) for a, b in zip(losses, want))
            worst = max(worst, diff)
            print(f"  step {step}: mean loss {sum(losses) / len(losses):.4f}, "
                  f"vs plain torch {diff:.1e}")
    with torch.no_grad():  # (every replica of every stage: the optimizer kept them equal)
        for s, m in enumerate(reference):
            for replica in pipe.modules[s]:
                for a, b in zip(m.parameters(), replica.parameters()):
                    worst = max(worst, float((a - b).abs().max()))
    ok = worst <= 1e-4
    print(f"decoder layers {'match' if ok else 'DO NOT match'} plain torch (worst difference "
          f"{worst:.1e}, tolerance 1e-4)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
