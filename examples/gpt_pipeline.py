"""Train a small GPT split into pipeline stages of different tensor-parallel degrees, checked
against the same model in plain single-process torch.

The model: token embedding and learned positions, pre-LayerNorm blocks (causal multi-head
self-attention with separate q/k/v projections, a GELU MLP), a final LayerNorm and an LM head
with cross-entropy. It is cut into 4 stages (8 for ``interleaved-1f1b`` and ``zbv``, two per
rank) on meshes of different shapes — by default tensor-parallel degrees 1, 2, 4, 2 on meshes
1×1, 1×2, 1×4 and 2×2 (axes ``dp`` × ``tp``: the ``dp`` axis replicates) — each sharded by a
plan in torch's vocabulary (``ColwiseParallel`` q/k/v and fc1, ``RowwiseParallel`` out and
fc2, a vocabulary-parallel embedding, a column-parallel head gathered for the loss; with
``--sequence-parallel`` the LayerNorms run on sequence blocks). Every boundary between two
layouts is planned by the resharding planner; the script prints each one's plan/bound ratio.

It trains with ``torch.optim.AdamW`` on a synthetic token stream and checks itself: every
step's losses (relative 5e-5) and, at the end, every parameter shard equal plain torch's
within rtol 5e-5 (atol 1e-6) in float32, or 4 bfloat16 ulps (atol 2·lr per step) in bfloat16
against torch's own bfloat16 run (see TOLERANCE). It exits non-zero otherwise, and
prints tokens/s and the exposed communication of the last step.

    python examples/gpt_pipeline.py                       # float32, 1f1b
    python examples/gpt_pipeline.py --dtype bfloat16 --schedule zb-h1 --sequence-parallel
    torchrun --standalone --nproc-per-node 4 examples/gpt_pipeline.py   # each rank builds
    mpiexec -n 4 python examples/gpt_pipeline.py          # and trains only its devices
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one BLAS thread per device thread

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import overlap
from overlap.torch import (
    ColwiseParallel,
    PrepareModuleInput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    TorchPipeline,
    build_stage,
)
from overlap.world import max_over_ranks
from scheduler import Cluster, DeviceMesh, make_schedule
from scheduler.cli.common import output_dir, positive_float, positive_int

# (rtol, atol) as in torch.testing.assert_close: |a - b| <= atol + rtol * |b| per element.
# float32: atol covers parameters that start at zero (biases, LayerNorm shifts), which after
# a few AdamW steps are all update: an element whose gradient is rounding noise there is a
# relative difference of the update, not of the model. bfloat16: rtol is 4 ulps (2^-5), and
# an element's update (about ±lr) can round the other way in one run than in the other, so
# atol is 2·lr per step (None here: set from --lr and --steps).
TOLERANCE: dict[str, tuple[float, float | None]] = {"float32": (5e-5, 1e-6),
                                                    "bfloat16": (2 ** -5, None)}
SCHEDULES = ("gpipe", "1f1b", "eager-1f1b", "zb-h1", "interleaved-1f1b", "zbv")


# ---- the model ---------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal multi-head self-attention. Heads come from the projections' width: a shard
    whose q/k/v are column-parallel computes its own ``num_heads`` (set per shard)."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        # No key bias: softmax ignores it (its gradient is rounding noise, which AdamW's
        # first steps would blow up to ±lr and the self-check would read as a difference).
        self.q, self.k = nn.Linear(width, width), nn.Linear(width, width, bias=False)
        self.v, self.out = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)),
                                           heads(self.v(x)), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), Attention(width, num_heads)
        self.ln2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTStage(nn.Module):
    """A contiguous piece of the GPT: the embeddings if first, ``blocks`` blocks, the final
    LayerNorm and the LM head if last."""

    def __init__(self, vocab: int, seq: int, width: int, num_heads: int, blocks: int,
                 first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, num_heads) for _ in range(blocks))
        if last:
            self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def stage_plan(stage: GPTStage, sequence_parallel: bool) -> dict[str, object]:
    """The tensor-parallel plan of one stage (torch's Megatron-style layout)."""
    plan: dict[str, object] = {}
    seq = Shard(1)
    if stage.first:
        # Vocabulary-parallel token embedding; positions are replicated.
        plan["tok"] = RowwiseParallel()
        if sequence_parallel:
            plan["blocks.0"] = PrepareModuleInput(Replicate(), seq)
    for i in range(len(stage.blocks)):
        p = f"blocks.{i}"
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1"):
            plan[f"{p}.{name}"] = ColwiseParallel()
        out = RowwiseParallel(output_layouts=seq) if sequence_parallel else RowwiseParallel()
        plan[f"{p}.attn.out"] = plan[f"{p}.mlp.fc2"] = out
        if sequence_parallel:
            plan[f"{p}.ln1"] = plan[f"{p}.ln2"] = SequenceParallel()
            plan[f"{p}.attn"] = plan[f"{p}.mlp"] = PrepareModuleInput(seq, Replicate())
    if stage.last:
        if sequence_parallel:
            plan["ln_f"] = SequenceParallel()
        # The logits gathered: cross-entropy reads the whole vocabulary on every device.
        plan["head"] = ColwiseParallel(input_layouts=seq if sequence_parallel else Replicate(),
                                       output_layouts=Replicate())
    return plan


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ---- placement ---------------------------------------------------------------------------


def parse_meshes(text: str) -> list[tuple[int, int]]:
    """``"1,2,4,2x2"``: each rank's mesh, ``dp`` × ``tp`` (a bare degree d is 1 × d)."""
    shapes = []
    for part in text.split(","):
        a, _, b = part.strip().partition("x")
        try:
            shape = (int(a), int(b)) if b else (1, int(a))
        except ValueError:
            raise ValueError(f"--tp: {part!r} is not a degree (4) or a dp×tp mesh (2x2)") from None
        if min(shape) < 1:
            raise ValueError(f"--tp: {part!r}: sizes are positive")
        shapes.append(shape)
    return shapes


def meshes_for(shapes: list[tuple[int, int]], stages_per_rank: int, placement: str
               ) -> tuple[Cluster, list[DeviceMesh]]:
    """One mesh per rank (axes ``dp`` × ``tp``: ``tp`` splits, ``dp`` replicates), each on one
    host of 4 devices where it fits; the stages placed on the ranks as the schedule says."""
    per_host = 4
    meshes, next_free = [], 0
    for a, b in shapes:
        n = a * b
        if next_free // per_host != (next_free + n - 1) // per_host:  # keep a mesh on a host
            next_free = (next_free // per_host + 1) * per_host
        ids = list(range(next_free, next_free + n))
        meshes.append(DeviceMesh([ids[r * b:(r + 1) * b] for r in range(a)], ("dp", "tp")))
        next_free += n
    cluster = Cluster.preset("p3.8xlarge", num_hosts=math.ceil(next_free / per_host))
    ranks = len(shapes)
    if placement == "loop":
        order = [s % ranks for s in range(ranks * stages_per_rank)]
    else:  # "v": rank k holds stages k and 2·ranks − 1 − k
        order = [*range(ranks), *reversed(range(ranks))]
    return cluster, [meshes[r] for r in order]


# ---- the run -----------------------------------------------------------------------------


def tokens(generator: torch.Generator, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """A learnable stream: each token a fixed function of the one before, sometimes noise."""
    x = torch.empty(batch, seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(vocab, (batch,), generator=generator)
    for t in range(1, seq + 1):
        noise = torch.rand(batch, generator=generator) < 0.1
        x[:, t] = torch.where(noise, torch.randint(vocab, (batch,), generator=generator),
                              (x[:, t - 1] * 5 + 3) % vocab)
    return x


def lengths(generator: torch.Generator, count: int, seq: int, step: int = 4) -> list[int]:
    """``count`` sequence lengths, long-tailed between ``seq / 4`` and ``seq`` (most short, a
    few long, as real text is), multiples of ``step`` (sequence-parallel blocks split them)."""
    low = max(step, seq // 4 // step * step)
    u = torch.rand(count, generator=generator)
    raw = low * (seq / low) ** (u ** 3)  # log-uniform, skewed towards the short end
    return [int(min(seq, max(low, round(float(n) / step) * step))) for n in raw]


def batch_of(data: torch.Generator, args: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's microbatches (input, target): all ``--seq`` long, or with
    ``--variable-lengths`` each of its own length."""
    mb = args.batch // args.microbatches
    sizes = lengths(data, args.microbatches, args.seq) if args.variable_lengths else \
        [args.seq] * args.microbatches
    out = []
    for n in sizes:
        stream = tokens(data, mb, n, args.vocab)
        if args.backend == "cuda":
            stream = stream.cuda()
        out.append((stream[:, :-1], stream[:, 1:]))
    return out


def closeness(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> float:
    """The largest |a - b| / (atol + rtol |b|): at most 1 where ``a`` is close to ``b``."""
    a, b = a.detach().float(), b.detach().float()
    return float(((a - b).abs() / (atol + rtol * b.abs())).max())


def add_model_flags(ap: argparse.ArgumentParser) -> None:
    """The model's size and the run's length (also gpt_auto_partition.py's)."""
    ap.add_argument("--layers", type=positive_int, default=4, help="transformer blocks in all")
    ap.add_argument("--width", type=positive_int, default=64)
    ap.add_argument("--heads", type=positive_int, default=4)
    ap.add_argument("--seq", type=positive_int, default=32, help="sequence length")
    ap.add_argument("--vocab", type=positive_int, default=256)
    ap.add_argument("--batch", type=positive_int, default=16)
    ap.add_argument("--microbatches", type=positive_int, default=4)
    ap.add_argument("--steps", type=positive_int, default=3)
    ap.add_argument("--lr", type=positive_float, default=1e-3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(ap)
    ap.add_argument("--tp", default="1,2,4,2x2",
                    help="each rank's mesh: a tensor-parallel degree d (a 1×d mesh) or dp×tp "
                         "(2x2: tensor-parallel over 2, replicated over 2)")
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    ap.add_argument("--dtype", default="float32", choices=tuple(TOLERANCE))
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="LayerNorms on sequence blocks (Megatron's sequence parallelism)")
    ap.add_argument("--variable-lengths", action="store_true",
                    help="each microbatch a sequence of its own length (long-tailed between "
                         "seq/4 and seq), handed over already split")
    ap.add_argument("--backend", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: each stage on its first device's GPU (a tensor-parallel "
                         "device needs a GPU of its own)")
    ap.add_argument("--trace-dir", type=output_dir, default="traces")
    ap.add_argument("--quiet", action="store_true", help="only the verdict line")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # many device threads share the cores
    dtype = getattr(torch, args.dtype)
    try:
        shapes = parse_meshes(args.tp)
    except ValueError as exc:
        ap.error(str(exc))
    sched = make_schedule(args.schedule, len(shapes) * (
        2 if args.schedule in ("interleaved-1f1b", "zbv") else 1), args.microbatches)
    p = sched.num_stages
    if args.batch % args.microbatches:
        ap.error(f"--batch: {args.batch} does not split into {args.microbatches} microbatches")
    if args.layers < p:
        ap.error(f"--layers: {args.layers} blocks for {p} stages")
    cluster, meshes = meshes_for(shapes, sched.stages_per_rank, sched.placement)

    data = torch.Generator().manual_seed(1)
    worst, times, counts = 0.0, [], []
    with overlap.Runtime(cluster, backend=args.backend) as rt:
        per = [args.layers // p + (s < args.layers % p) for s in range(p)]

        def stage_fn(s: int) -> GPTStage:
            return GPTStage(args.vocab, args.seq, args.width, args.heads, per[s], s == 0,
                            s == p - 1).to(dtype)
        with torch.device("meta"):  # (a plan needs only the stage's structure)
            plans = [stage_plan(stage_fn(s), args.sequence_parallel) for s in range(p)]
        # Each process builds only its stages' shards (on their GPUs with --backend cuda).
        pipe = TorchPipeline(stage_fn, meshes, lm_loss, plans=plans, axis="tp", rt=rt, seed=0)
        # Plain torch, every stage, with the pipeline's initial weights.
        reference = [build_stage(stage_fn, s, seed=0) for s in range(p)]
        if args.backend == "cuda":  # each reference stage on its first device's GPU
            reference = [m.to(torch.device("cuda", rt.backend.physical(mesh.device_ids[0])))
                         for m, mesh in zip(reference, meshes)]
        # eps 1e-5, not 1e-8: a parameter whose gradient is rounding noise (~1e-9: two sums in
        # another order) would move by ±lr in one run and not the other at AdamW's default, and
        # no reordered float32 computation could match that to 5e-5.
        opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, eps=1e-5)
        ref_opt = torch.optim.AdamW([q for m in reference for q in m.parameters()], lr=args.lr,
                                    eps=1e-5)
        say = (lambda *a: None) if args.quiet else print
        rtol, atol_or_none = TOLERANCE[args.dtype]
        atol = 2 * args.lr * args.steps if atol_or_none is None else atol_or_none
        if rt.world.rank:  # (under a launcher, one rank speaks)
            say = lambda *a: None
        say(f"GPT pipeline: {args.layers} blocks, width {args.width}, {args.heads} heads, "
            f"sequence {args.seq}, vocab {args.vocab}; {p} stages, TP degrees "
            f"{[pipe.tp[s].degree for s in range(p)]} on meshes {[m.shape for m in meshes]}; "
            f"batch {args.batch} in {args.microbatches} microbatches, {args.schedule}, "
            f"{args.dtype}{', sequence-parallel' if args.sequence_parallel else ''}")
        for step in range(args.steps):
            mbs = batch_of(data, args)
            if step == 0:
                for row in pipe.boundary_report(rt, *mbs[0]):
                    say(f"  {row}")
            opt.zero_grad()
            t0 = time.perf_counter()
            losses = pipe.train_step_sync(rt, microbatches=mbs, schedule=sched)
            times.append(time.perf_counter() - t0)
            counts.append(sum(x.numel() for x, _ in mbs))
            opt.step()

            ref_opt.zero_grad()
            ref_losses = []
            for xm, ym in mbs:
                h = xm
                for m in reference:
                    h = m(h.to(next(m.parameters()).device))
                loss = lm_loss(h, ym.to(h.device))
                # The mean over the microbatches, as the pipeline's gradients are by default
                # (torch's schedules' scale_grads=True).
                (loss * (1.0 / len(mbs))).backward()
                ref_losses.append(loss.item())
            ref_opt.step()
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            worst = max(worst, diff / rtol)
            stats = rt.last_step  # the runtime's own figures of the step (its trace)
            say(f"  step {step}: mean loss {sum(losses) / len(losses):.4f}, loss vs torch "
                f"{diff:.2g}; {stats.seconds * 1e3:.0f} ms, bubble {stats.bubble:.0%}, "
                f"exposed communication {stats.exposed_comm:.1%}")
        tl = rt.timeline()
        rank = rt.world.rank
        suffix = f".rank{rank}" if rt.world.distributed else ""
        trace = rt.write_trace(Path(args.trace_dir) / f"gpt-{args.schedule}{suffix}.json")
        local = set(rt.local_devices)
        # Every shard this process trained against the same block of the reference.
        for s, tp in enumerate(pipe.tp):
            full = dict(reference[s].named_parameters())
            for module, comm in zip(tp.modules, tp.comms):
                if comm.device not in local:
                    continue
                for name, param in module.named_parameters():
                    want = full[name]
                    if name in tp.split:
                        want = want.chunk(comm.size, tp.split[name])[comm.index]
                    worst = max(worst, closeness(param, want, rtol, atol))
        worst = max_over_ranks(worst, rt.world)  # every process: the worst of all of them
    within = f"rtol {rtol:g}, atol {atol:g}"
    if worst > 1 and not rank:
        print(f"FAILED: the pipeline differs from plain torch by {worst:.3g} × the tolerance "
              f"({within}; {args.schedule}, {args.dtype})")
        return 1
    if worst > 1:
        return 1
    if rank:
        return 0
    print(f"gpt {args.schedule} {args.dtype}: losses of {args.steps} steps and every "
          f"parameter match plain torch ({within}: worst {worst:.2f} of it); "
          f"{sum(counts[1:] or counts) / sum(times[1:] or times):.0f} tokens/s, exposed "
          f"communication "
          f"{tl.exposed_comm_fraction:.1%} of the last step")
    say(f"trace: {trace} (overlap trace report {trace})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
