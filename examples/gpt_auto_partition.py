"""Partition the GPT example automatically, then train it and check it against plain torch.

The model is the one of ``examples/gpt_pipeline.py`` — token and position embeddings,
pre-LayerNorm blocks (causal attention, GELU MLP), a final LayerNorm and an LM head — as a
list of blocks: the embeddings, each transformer block, the head. Each block has its
tensor-parallel plan in torch's vocabulary (vocabulary-parallel embedding; column-parallel
q/k/v and fc1, row-parallel out and fc2; a column-parallel head gathered for the loss).

``overlap.torch.auto_partition`` times every block on this machine (forward, backward and
its split halves, warm-up excluded; tensor-parallel degrees on one shard, their collectives
costed by the cost model), and ``scheduler.partition`` chooses the stages, each one's
devices and degree, and the schedule for ``--devices`` virtual devices. The chosen pipeline
then trains with AdamW and checks itself: every step's losses (relative 5e-5) and at the end
every parameter shard equal plain torch's within rtol 5e-5 (atol 1e-6), as the GPT example's
check does. It exits non-zero otherwise.

    python examples/gpt_auto_partition.py                    # 8 devices, degrees 1, 2, 4
    python examples/gpt_auto_partition.py --degrees 2        # every stage TP 2
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one BLAS thread per device thread

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_pipeline import TOLERANCE, Block, add_model_flags, closeness, lm_loss, tokens

import overlap
from overlap.torch import ColwiseParallel, Replicate, RowwiseParallel, auto_partition
from scheduler import Cluster
from scheduler.cli.common import positive_int


class Embed(nn.Module):
    def __init__(self, vocab: int, seq: int, width: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def block_plan(block: nn.Module) -> dict[str, Any]:
    """Each block's tensor-parallel plan (the GPT example's, block by block)."""
    if isinstance(block, Embed):
        return {"tok": RowwiseParallel()}  # vocabulary-parallel; positions replicated
    if isinstance(block, Head):
        return {"head": ColwiseParallel(output_layouts=Replicate())}  # logits gathered
    plan: dict[str, Any] = {name: ColwiseParallel()
                            for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1")}
    plan["attn.out"] = plan["mlp.fc2"] = RowwiseParallel()
    return plan


def build(args: argparse.Namespace) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Embed(args.vocab, args.seq, args.width),
            *(Block(args.width, args.heads) for _ in range(args.layers)),
            Head(args.width, args.vocab)]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(ap)
    ap.add_argument("--devices", type=positive_int, default=8, help="virtual devices (one host)")
    ap.add_argument("--degrees", default="1,2,4",
                    help="tensor-parallel degrees a stage may take, comma-separated")
    ap.add_argument("--quiet", action="store_true", help="only the verdict line")
    args = ap.parse_args(argv)
    if args.batch % args.microbatches:
        ap.error(f"--batch: {args.batch} does not split into {args.microbatches} microbatches")
    try:
        args.degrees = [int(t) for t in args.degrees.split(",")]
    except ValueError:
        ap.error(f"--degrees: expected comma-separated ints, got {args.degrees!r}")
    if min(args.degrees) < 1:
        ap.error(f"--degrees: TP degrees are >= 1, got {args.degrees}")
    return args


def train(args: argparse.Namespace, auto: Any, reference: nn.Sequential,
          cluster: Cluster, say: Any) -> tuple[float, Any]:
    """The chosen pipeline and plain torch, step by step; the worst loss difference (in
    tolerances) and the pipeline."""
    rtol = TOLERANCE["float32"][0]
    data = torch.Generator().manual_seed(1)
    mb = args.batch // args.microbatches
    worst = 0.0
    with overlap.Runtime(cluster) as rt:
        pipe = auto.pipeline(lm_loss)
        opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, eps=1e-5)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, eps=1e-5)
        for step in range(args.steps):
            mbs = []
            for _ in range(args.microbatches):
                stream = tokens(data, mb, args.seq, args.vocab)
                mbs.append((stream[:, :-1], stream[:, 1:]))
            opt.zero_grad()
            losses = pipe.train_step_sync(rt, microbatches=mbs, schedule=auto.schedule)
            opt.step()
            ref_opt.zero_grad()
            ref_losses = []
            for xm, ym in mbs:
                loss = lm_loss(reference(xm), ym)
                (loss * (1.0 / len(mbs))).backward()  # the mean, as the pipeline's
                ref_losses.append(loss.item())
            ref_opt.step()
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            worst = max(worst, diff / rtol)
            stats = rt.last_step
            say(f"  step {step}: mean loss {sum(losses) / len(losses):.4f}, loss vs torch "
                f"{diff:.2g}; {stats.seconds * 1e3:.0f} ms, bubble {stats.bubble:.0%}")
    return worst, pipe


def parameters_worst(auto: Any, pipe: Any, reference: nn.Sequential) -> float:
    """Every parameter (each shard) against the same block of plain torch, in tolerances."""
    rtol, atol = TOLERANCE["float32"]
    full = dict(reference.named_parameters())
    worst = 0.0
    for s, stage in enumerate(auto.plan.stages):
        tp = pipe.tp[s]
        shards = [(m, None) for m in pipe.modules[s]] if tp is None else \
            list(zip(tp.modules, tp.comms))
        for module, comm in shards:
            for name, param in module.named_parameters():
                k, rest = name.split(".", 1)  # block k of the stage, block start + k overall
                want = full[f"{stage.layers.start + int(k)}.{rest}"]
                if comm is not None and name in tp.split:
                    want = want.chunk(comm.size, tp.split[name])[comm.index]
                worst = max(worst, closeness(param, want, rtol, atol))
    return worst


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)  # many device threads share the cores
    say = (lambda *a: None) if args.quiet else print
    blocks = build(args)
    reference = nn.Sequential(*copy.deepcopy(blocks))  # plain torch, the same weights
    cluster = Cluster.local(args.devices)
    mb = args.batch // args.microbatches
    sample = tokens(torch.Generator().manual_seed(2), mb, args.seq, args.vocab)
    auto = auto_partition(blocks, cluster, args.microbatches, sample[:, :-1],
                          target=sample[:, 1:], loss_fn=lm_loss, tp_plans=block_plan,
                          degrees=args.degrees, optimizer_states=2)
    say(f"GPT: {args.layers} blocks + embeddings + head, width {args.width}; partitioned "
        f"for {args.devices} devices (degrees {args.degrees}) from costs measured here:")
    say(auto.plan.to_text())
    worst, pipe = train(args, auto, reference, cluster, say)
    worst = max(worst, parameters_worst(auto, pipe, reference))
    rtol, atol = TOLERANCE["float32"]
    layout = " ".join(f"{st.layers.start}-{st.layers.stop - 1}@{st.tp}"
                      for st in auto.plan.stages)
    if worst > 1:
        print(f"FAILED: the automatically partitioned pipeline [{layout}] differs from plain "
              f"torch by {worst:.3g} × the tolerance (rtol {rtol:g}, atol {atol:g})")
        return 1
    print(f"gpt auto-partitioned [{layout}] {auto.schedule.name}: losses of {args.steps} "
          f"steps and every parameter match plain torch (rtol {rtol:g}, atol {atol:g}: worst "
          f"{worst:.2f} of it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
