"""RL-style weight refit: train the GPT of ``gpt_pipeline.py`` in a pipeline and, after every
optimizer step, reshard its whole state in ONE call into an inference copy with another
layout; generate a few tokens greedily with the copy and check it against the trained model.

Training: 4 stages, tensor-parallel degrees 1, 2, 4, 2×2 (``--tp``), as ``gpt_pipeline.py``.
Inference engines (``--engine``):

- ``tp4``: the whole model on 4 other devices, TP 4 (disjoint meshes: trainer GPUs to
  inference GPUs);
- ``colocated``: the whole model on 8 of the training devices, TP 8 (the same GPUs: a
  colocated engine).

Each step the trained pipeline's shards (``pipe.local_shards()``) are moved by one
whole-state plan (``plan_state_dict(pipe.state_layout(), tensor_parallel_layout(model, mesh,
plan), cluster)``) straight into the engine's own parameters (``out=``). The script prints the
plan (its estimate / lower bound), the measured time and bytes of every refit, and checks
that every engine shard equals the trained weights bit for bit, that the engine's logits
equal plain torch's on the trained weights (rtol 1e-4), and that both generate the same
tokens. Exits non-zero otherwise.

    python examples/refit.py                        # float32, engine tp4
    python examples/refit.py --engine colocated --dtype bfloat16

One process (its checks read the whole trained state there); ``Runtime.reshard_state`` itself
runs under mpiexec and torchrun with each process giving only its own shards.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one BLAS thread per device thread

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpt_pipeline as gpt  # (the model, its plans and its data)

import overlap
from overlap.torch import (
    TorchPipeline,
    plan_state_dict,
    reshard_state_dict,
    tensor_parallel_layout,
    tensor_parallel_shards,
)
from scheduler import Cluster, DeviceMesh, StateOptions
from scheduler.cli.common import positive_int

LOGITS_RTOL = 1e-4  # float32: TP sums in another order than plain torch
ENGINES = ("tp4", "colocated")


def engine_mesh(engine: str, cluster: Cluster, train: list[DeviceMesh]) -> DeviceMesh:
    """``tp4``: a host no stage uses; ``colocated``: the last 8 devices the stages use."""
    used = sorted({d for m in train for d in m.device_ids})
    if engine == "tp4":
        g = cluster.gpus_per_host
        free = next(h for h in range(cluster.num_hosts)
                    if not any(h * g <= d < (h + 1) * g for d in used))
        return DeviceMesh(list(range(free * g, free * g + 4)), ("tp",))
    return DeviceMesh(used[-8:], ("tp",))


def whole_model(stage_fn, p: int) -> nn.Sequential:
    """The stages in one ``nn.Sequential``: its names are the pipeline's state_dict names."""
    return nn.Sequential(*(stage_fn(s) for s in range(p)))


def whole_plan(stages: nn.Sequential) -> dict[str, object]:
    """Each stage's plan under the whole model's names (Megatron's layout, over one mesh)."""
    return {f"{s}.{k}": style for s, stage in enumerate(stages)
            for k, style in gpt.stage_plan(stage, False).items()}


def greedy(forward, prompt: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``new`` tokens, each the argmax of the last position's logits; returns the tokens and
    the logits of the last forward."""
    x = prompt
    for _ in range(new):
        logits = forward(x)
        x = torch.cat([x, logits[:, -1:].argmax(-1)], 1)
    return x, logits


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpt.add_model_flags(ap)
    ap.set_defaults(heads=8, layers=4, steps=3)
    ap.add_argument("--tp", default="1,2,4,2x2", help="the training meshes (gpt_pipeline.py's)")
    ap.add_argument("--engine", choices=ENGINES, default="tp4")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--bucket-kib", type=positive_int, default=256,
                    help="the plan's bucket: most staged bytes per device at a time")
    ap.add_argument("--new-tokens", type=positive_int, default=4)
    return ap.parse_args(argv)


def check_engine(engine, trained: dict[str, torch.Tensor]) -> int:
    """Shards of the engine that differ from the trained weights (bit for bit)."""
    wrong = 0
    for module, comm in zip(engine.modules, engine.comms):
        for key, value in module.state_dict().items():
            want = trained[key]
            if key in engine.split:
                want = want.chunk(comm.size, engine.split[key])[comm.index]
            wrong += not torch.equal(value, want)
    return wrong


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    shapes = gpt.parse_meshes(args.tp)
    p = len(shapes)
    _, meshes = gpt.meshes_for(shapes, 1, "loop")
    cluster = Cluster.preset("p3.8xlarge", 4)  # the training hosts and one more
    per = [args.layers // p + (s < args.layers % p) for s in range(p)]

    def stage_fn(s: int) -> nn.Module:
        return gpt.GPTStage(args.vocab, args.seq, args.width, args.heads, per[s], s == 0,
                            s == p - 1).to(dtype)
    with torch.device("meta"):
        plans = [gpt.stage_plan(stage_fn(s), False) for s in range(p)]
        template = whole_model(stage_fn, p)
    mesh = engine_mesh(args.engine, cluster, meshes)
    plan_tp = whole_plan(template)
    data = torch.Generator().manual_seed(1)
    failures = 0
    with overlap.Runtime(cluster, timeout=60) as rt:
        if rt.world.distributed:  # (its checks read the whole trained state in one process)
            print("refit.py runs in one process; tests/mpi_jobs/state_reshard.py shows "
                  "reshard_state across processes", file=sys.stderr)
            return 2
        pipe = TorchPipeline(stage_fn, meshes, gpt.lm_loss, plans=plans, axis="tp", rt=rt,
                             seed=0)
        engine_pipe = TorchPipeline([whole_model(stage_fn, p)], [mesh], gpt.lm_loss,
                                    plans=[plan_tp], axis="tp")
        engine = engine_pipe.tp[0]
        plan = plan_state_dict(pipe.state_layout(),
                               tensor_parallel_layout(template, mesh, plan_tp, axis="tp"),
                               cluster, StateOptions(bucket_bytes=args.bucket_kib << 10))
        print(f"refit {args.engine}: training TP {[t.degree for t in pipe.tp]} on "
              f"{[m.shape for m in meshes]} -> TP {engine.degree} on devices "
              f"{list(mesh.device_ids)}, {args.dtype}")
        print("  " + plan.to_text().replace("\n", "\n  "))
        opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
        for step in range(args.steps):
            mbs = gpt.batch_of(data, argparse.Namespace(**{**vars(args), "backend": "cpu",
                                                           "variable_lengths": False}))
            opt.zero_grad()
            losses = pipe.train_step_sync(rt, microbatches=mbs, schedule="1f1b")
            opt.step()
            t0 = time.perf_counter()
            reshard_state_dict(rt, plan, pipe.local_shards(), out=tensor_parallel_shards(engine))
            seconds = time.perf_counter() - t0
            trained = pipe.state_dict()
            wrong = check_engine(engine, trained)
            failures += wrong
            print(f"  step {step}: loss {sum(losses) / len(losses):.4f}; refit "
                  f"{seconds * 1e3:.1f} ms, {plan.nbytes / 2**20:.2f} MiB delivered "
                  f"({plan.network_bytes / 2**20:.2f} MiB over the network), "
                  f"{len(plan.buckets)} buckets; shards differing from the trained weights: "
                  f"{wrong}")
        failures += generate_and_compare(rt, engine_pipe, trained, stage_fn, p, args, data)
    print("refit: OK" if not failures else f"refit: FAILED ({failures} checks)")
    return 0 if not failures else 1


def generate_and_compare(rt, engine_pipe, trained, stage_fn, p, args, data) -> int:
    """Greedy tokens from the engine and from plain torch on the trained weights: the same
    tokens, logits within LOGITS_RTOL (bfloat16: the tokens only)."""
    prompt = gpt.tokens(data, 2, 4, args.vocab)[:, :4]
    reference = whole_model(stage_fn, p)
    reference.load_state_dict(trained)

    def engine_forward(x: torch.Tensor) -> torch.Tensor:
        _, outs = engine_pipe.eval_step_sync(rt, x, torch.zeros_like(x), num_microbatches=1,
                                             return_outputs=True)
        return outs[0]
    with torch.no_grad():
        got, logits = greedy(engine_forward, prompt, args.new_tokens)
        want, ref_logits = greedy(reference, prompt, args.new_tokens)
    closeness = gpt.closeness(logits, ref_logits, LOGITS_RTOL, 1e-5)
    print(f"  generated {got[:, prompt.shape[1]:].tolist()} (plain torch: "
          f"{want[:, prompt.shape[1]:].tolist()}); logits vs plain torch {closeness:.2f} of "
          f"rtol {LOGITS_RTOL:g}")
    bad = int(not torch.equal(got, want))
    if args.dtype == "float32":
        bad += int(closeness > 1)
    return bad


if __name__ == "__main__":
    sys.exit(main())
