"""A pipeline against plain torch on the same hardware (not a test): what a user compares.

The stages are ``GPTStage`` modules of ``examples/gpt_pipeline.py`` (embedding, pre-LN
blocks, LM head). Both sides do the same device work:

- **plain torch**: the same stage modules called one after the other, microbatch by
  microbatch, ``(loss / microbatches).backward()`` after each (the mean, as the pipeline's
  default);
- **the pipeline**: ``TorchPipeline.train_step_sync`` with each schedule, every stage on a
  virtual device of its own — on ONE GPU with ``--device cuda`` (so every ratio above 1 is
  host cost and serialization, not physics), on the CPU backend with ``--device cpu``.

A **one-stage** pipeline (no transfer, no other stage) measures the runtime's own cost per
op. A row's variants are timed in rounds, alternating (plain, then each schedule), after
warm-up steps; each figure is the median step, ``torch.cuda.synchronize()`` around it on a
GPU. Gradients are set to None before every step on both sides, as a training loop's
``zero_grad`` does; no optimizer step (it is the same on both sides).

The **split backward** rows (``--split``) compare one stage's backward split in ``I`` and
``W`` with the fused backward (in one thread), and per stage the runtime's own compute time
of a zb-h1 step with a 1f1b step's, from the runtime's trace: ``≤ 1.05`` when the split
costs one backward.

    python benchmarks/vs_plain_torch.py                  # CPU: one stage, 32 microbatches
    python benchmarks/vs_plain_torch.py --split          # CPU: zb-h1 against 1f1b compute
    python benchmarks/vs_plain_torch.py --device cuda --rows gpu   # the GPU table
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Size:
    """One model: ``blocks`` GPT blocks of ``width`` over sequences of ``seq`` tokens, cut in
    ``stages`` stages; a step is ``batch`` sequences in ``microbatches`` microbatches."""

    width: int
    seq: int
    blocks: int
    stages: int
    batch: int
    microbatches: int
    heads: int = 8
    vocab: int = 8192

    @property
    def label(self) -> str:
        return (f"width {self.width}, seq {self.seq}, {self.blocks} blocks, {self.stages} "
                f"stage{'s' if self.stages > 1 else ''}, {self.microbatches} microbatches")


SCHEDULES = ("1f1b", "eager-1f1b", "gpipe", "zb-h1")
# The GPU table: three sizes × four schedules on 4 virtual stages of one GPU, and the
# one-stage pipeline at widths 256 and 1024 (the runtime's own cost).
GPU_ROWS = (
    (Size(256, 256, 8, 4, 16, 8), SCHEDULES),
    (Size(1024, 1024, 8, 4, 16, 8), SCHEDULES),
    (Size(4096, 2048, 4, 4, 16, 8), SCHEDULES),
    (Size(256, 256, 8, 1, 16, 8), ("1f1b",)),
    (Size(1024, 1024, 8, 1, 16, 8), ("1f1b",)),
)
# The CPU goal: a one-stage pipeline of a small GPT stage, 32 microbatches (and a smaller
# one, where the runtime's cost per op shows).
CPU_ROWS = ((Size(128, 64, 2, 1, 64, 32, heads=4, vocab=512), ("1f1b",)),
            (Size(64, 32, 2, 1, 64, 32, heads=4, vocab=512), ("1f1b",)))
# --self-test: tiny, every schedule, on whatever device is asked for.
SELF_ROWS = ((Size(32, 16, 4, 4, 8, 4, heads=2, vocab=64), SCHEDULES),
             (Size(32, 16, 2, 1, 8, 4, heads=2, vocab=64), ("1f1b",)))


def gpt_module() -> Any:
    spec = importlib.util.spec_from_file_location("gpt_pipeline",
                                                  ROOT / "examples" / "gpt_pipeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stage_sizes(size: Size) -> list[int]:
    p, n = size.stages, size.blocks
    return [n // p + (s < n % p) for s in range(p)]


@dataclass
class Row:
    size: Size
    plain: float  # median seconds of a plain torch step
    steps: dict[str, float]  # schedule -> median seconds of a pipeline step

    def ratio(self, schedule: str) -> float:
        return self.steps[schedule] / self.plain


@dataclass(frozen=True)
class Model:
    """One size's GPT stages, built the same way for the pipeline and for plain torch, and
    a step's microbatches (input, target) on ``where``."""

    gpt: Any  # examples/gpt_pipeline.py as a module
    stage_fn: Callable[[int], Any]
    meshes: list[Any]
    cluster: Any
    mbs: list[tuple[Any, Any]]
    where: Any  # the torch device


def model_of(size: Size, device: str, dtype: str) -> Model:
    import torch

    from scheduler import Cluster, DeviceMesh

    gpt = gpt_module()
    dt = getattr(torch, dtype)
    per = stage_sizes(size)
    p = size.stages

    def stage_fn(s: int) -> Any:
        return gpt.GPTStage(size.vocab, size.seq, size.width, size.heads, per[s], s == 0,
                            s == p - 1).to(dt)

    gen = torch.Generator().manual_seed(0)
    mb = size.batch // size.microbatches
    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    data = [torch.randint(size.vocab, (mb, size.seq + 1), generator=gen).to(where)
            for _ in range(size.microbatches)]
    return Model(gpt, stage_fn, [DeviceMesh([[s]], ("host", "gpu")) for s in range(p)],
                 Cluster(p, 1, nic_gbps=400.0), [(x[:, :-1], x[:, 1:]) for x in data], where)


def measure(size: Size, schedules: Sequence[str], device: str, dtype: str, rounds: int,
            warmup: int, log: Callable[[str], None] = print,
            polls: Sequence[float] = (), two_walks: bool = False) -> Row:
    """Plain torch and the pipeline under each schedule, alternating, on ``device``; with
    ``polls``, each schedule also with the device kind's look-before-sleeping budget set to
    each of them (an A/B, as ``"<schedule> poll <µs>"``); with ``two_walks``, each split
    schedule also with the plain split (``W`` one more backward from the output: the
    activation path walked twice), as ``"<schedule> two walks"``."""
    import torch

    import overlap
    from overlap.torch import TorchPipeline, build_stage

    cuda = device == "cuda"
    model = model_of(size, device, dtype)
    gpt, mbs = model.gpt, model.mbs

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with overlap.Runtime(model.cluster, backend=device) as rt:
        pipe = TorchPipeline(model.stage_fn, model.meshes, gpt.lm_loss, rt=rt, seed=0)
        reference = [build_stage(model.stage_fn, s, seed=0).to(model.where)
                     for s in range(size.stages)]

        def plain() -> None:  # (the mean over the microbatches, as the pipeline's default)
            for xm, ym in mbs:
                h = xm
                for m in reference:
                    h = m(h)
                (gpt.lm_loss(h, ym) * (1.0 / len(mbs))).backward()

        kind = rt.backend.devices
        default_poll = kind.poll_s

        def piped(schedule: str, poll: float) -> Callable[[], None]:
            def step() -> None:
                kind.poll_s = poll
                try:
                    pipe.train_step_sync(rt, microbatches=mbs, schedule=schedule)
                finally:
                    kind.poll_s = default_poll
            return step

        variants: dict[str, Callable[[], None]] = {"plain": plain}
        variants.update({s: piped(s, default_poll) for s in schedules})
        variants.update({f"{s} poll {p * 1e6:g}": piped(s, p) for s in schedules
                         for p in polls})
        if two_walks:
            from overlap.torch import split_backward

            def walked_twice(step: Callable[[], None]) -> Callable[[], None]:
                def run() -> None:
                    was = split_backward._EDGES_IN_BACKWARD
                    split_backward._EDGES_IN_BACKWARD = False  # (the plain split)
                    try:
                        step()
                    finally:
                        split_backward._EDGES_IN_BACKWARD = was
                return run
            variants.update({f"{s} two walks": walked_twice(piped(s, default_poll))
                             for s in schedules if s in ("zb-h1", "zbv")})
        params = [q for m in reference for q in m.parameters()] + list(pipe.parameters())

        def timed(fn: Callable[[], None]) -> float:
            for q in params:
                q.grad = None
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - t0

        for fn in variants.values():
            for _ in range(warmup):
                timed(fn)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(rounds):
            for k, fn in variants.items():
                times[k].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    row = Row(size, med.pop("plain"), med)
    log(f"  {size.label}: plain {row.plain * 1e3:.1f} ms; " + ", ".join(
        f"{s} {row.ratio(s):.3f} x" for s in row.steps))
    return row


def split_backward(width: int, seq: int, batch: int, blocks: int, rounds: int,
                   log: Callable[[str], None] = print) -> dict[str, float]:
    """One GPT stage's backward on the CPU, in this thread: fused (``loss.backward``) against
    ``I`` then ``W`` (:mod:`overlap.torch.split_backward`) and against the plain split that
    walks the graph twice (``autograd.grad`` to the input, then a backward restricted to
    the parameters), alternating; medians of the backward alone."""
    import torch

    from overlap.backends.devices.host_memory import keep_freed_host_memory
    from overlap.torch.split_backward import stage_backward_input, stage_backward_weight

    # (What every CPU backend sets up in its process; here no runtime is made.)
    kept = keep_freed_host_memory()
    gpt = gpt_module()
    torch.manual_seed(0)
    module = gpt.GPTStage(512, seq, width, 4, blocks, False, False)
    params = list(module.parameters())

    def forward() -> tuple[Any, Any, Any]:
        x = torch.randn(batch, seq, width, requires_grad=True)
        y = module(x)
        return x, y, torch.randn_like(y)

    def fused() -> float:
        _, y, g = forward()
        t0 = time.perf_counter()
        torch.autograd.backward(y, g)
        return time.perf_counter() - t0

    def split() -> float:
        x, y, g = forward()
        t0 = time.perf_counter()
        _, pending = stage_backward_input(y, g, x, params)
        stage_backward_weight(pending)
        return time.perf_counter() - t0

    def twice() -> float:
        x, y, g = forward()
        t0 = time.perf_counter()
        torch.autograd.grad(y, (x,), g, retain_graph=True)
        torch.autograd.backward(y, g, inputs=params)
        return time.perf_counter() - t0

    def against_fused(other: Callable[[], float]) -> tuple[float, float]:
        """(fused, other) medians, alternating. Each split is paired with the fused
        backward on its own: the plain split keeps more alive and left the heap to the
        next backward in a shape that cost it page faults (``ru_minflt``) when all three
        took turns."""
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(rounds + 2):
            for t, fn in zip(times, (fused, other)):
                seconds = fn()
                if i >= 2:
                    t.append(seconds)
        return statistics.median(times[0]), statistics.median(times[1])

    f1, one_walk = against_fused(split)
    f2, two_walks = against_fused(twice)
    log(f"  one stage's backward ({blocks} blocks, width {width}, seq {seq}, batch {batch}): "
        f"fused {f1 * 1e3:.1f} ms; I + W {one_walk / f1:.3f} x; "
        f"the graph walked twice {two_walks / f2:.3f} x; freed host memory "
        f"{'kept, as the CPU backend keeps it' if kept else 'handed back (glibc not asked)'}")
    return {"split": one_walk / f1, "twice": two_walks / f2}


def split_compute(size: Size, device: str, dtype: str, steps: int, warmup: int,
                  log: Callable[[str], None] = print) -> dict[str, float]:
    """Per stage, the runtime's own compute seconds of a zb-h1 step over a 1f1b step's
    (medians over ``steps`` steps, alternating), and the step's wall time ratio."""
    import overlap
    from overlap.torch import TorchPipeline

    model = model_of(size, device, dtype)
    p = size.stages
    per_stage: dict[str, list[list[float]]] = {"1f1b": [], "zb-h1": []}
    wall: dict[str, list[float]] = {"1f1b": [], "zb-h1": []}
    with overlap.Runtime(model.cluster, backend=device) as rt:
        pipe = TorchPipeline(model.stage_fn, model.meshes, model.gpt.lm_loss, rt=rt, seed=0)
        for i in range(warmup + steps):
            for schedule in per_stage:
                for q in pipe.parameters():
                    q.grad = None
                t0 = time.perf_counter()
                pipe.train_step_sync(rt, microbatches=model.mbs, schedule=schedule)
                seconds = time.perf_counter() - t0
                if i < warmup:
                    continue
                tl = rt.timeline()  # (stage s is device s)
                per_stage[schedule].append([tl.busy(s) for s in range(p)])
                wall[schedule].append(seconds)
    ratios = [statistics.median(b[s] for b in per_stage["zb-h1"]) /
              statistics.median(b[s] for b in per_stage["1f1b"]) for s in range(p)]
    out = {"worst": max(ratios), "step": statistics.median(wall["zb-h1"]) /
           statistics.median(wall["1f1b"])}
    log(f"  {size.label}: zb-h1 compute / 1f1b compute per stage "
        + ", ".join(f"{r:.3f}" for r in ratios)
        + f"; step {out['step']:.3f} x")
    return out


def table(rows: Sequence[Row], log: Callable[[str], None] = print) -> None:
    scheds = [s for s in SCHEDULES if any(s in r.steps for r in rows)]
    log(f"{'model':<58} {'plain torch':>11} " + " ".join(f"{s:>10}" for s in scheds))
    for r in rows:
        cells = [f"{r.ratio(s):>9.3f}x" if s in r.steps else f"{'':>10}" for s in scheds]
        log(f"{r.size.label:<58} {r.plain * 1e3:>8.1f} ms " + " ".join(cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rows", choices=("cpu", "gpu", "self"), default=None,
                    help="which table (default: cpu on the CPU, gpu with --device cuda)")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--width", type=int, default=None, help="only the rows of this width")
    ap.add_argument("--stages", type=int, default=None, help="only the rows of these stages")
    ap.add_argument("--poll-us", type=float, action="append", default=[],
                    help="also each schedule with the device kind's look-before-sleeping "
                         "budget set to this (µs): an A/B")
    ap.add_argument("--schedules", default=None,
                    help="comma-separated: only these schedules of each row")
    ap.add_argument("--two-walks", action="store_true",
                    help="also each split schedule with the plain split (an A/B)")
    ap.add_argument("--split", action="store_true",
                    help="zb-h1's compute against 1f1b's, per stage (a 2-block GPT stage)")
    args = ap.parse_args(argv)
    import torch

    from scheduler.cli.common import line_buffered_stdout, machine_line

    line_buffered_stdout()
    if args.device == "cpu":
        torch.set_num_threads(1)  # (the pipeline's stage threads get the caller's setting)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    print(f"{machine_line()}, torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name(0)}" if args.device == "cuda" else "")
          + f"; {dtype}; {time.strftime('%Y-%m-%d %H:%M')}")
    if args.split:
        if args.device == "cpu":  # (the case: a 2-block GPT stage)
            split_backward(256, 128, 8, 2, args.rounds or 10)
        # Two stages: one stage thread per core here (more would share cores and stretch
        # every op's span by the others' work).
        size = Size(256, 128, 4, 2, 32, 8, heads=4, vocab=512)
        split_compute(size, args.device, dtype, args.rounds or 5, args.warmup)
        return 0
    which = args.rows or ("gpu" if args.device == "cuda" else "cpu")
    spec = [(size, scheds) for size, scheds in
            {"gpu": GPU_ROWS, "cpu": CPU_ROWS, "self": SELF_ROWS}[which]
            if args.width in (None, size.width) and args.stages in (None, size.stages)]
    keep = None if args.schedules is None else args.schedules.split(",")
    rows = [measure(size, [s for s in scheds if keep is None or s in keep], args.device, dtype,
                    args.rounds or 5, args.warmup, polls=[us * 1e-6 for us in args.poll_us],
                    two_walks=args.two_walks) for size, scheds in spec]
    table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
