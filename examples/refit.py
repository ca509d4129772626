"""RL-style weight refit: train the GPT of ``gpt_pipeline.py`` in a pipeline and, after every
optimizer step, reshard its whole state in ONE call into an inference copy with another
layout; generate a few tokens greedily with the copy and check it against the trained model.

Training: 4 stages, tensor-parallel degrees 1, 2, 4, 2×2 (``--tp``), as ``gpt_pipeline.py``.
Inference engines (``--engine``):

- ``tp4``: the whole model on 4 other devices, TP 4 (disjoint meshes: trainer GPUs to
  inference GPUs);
- ``colocated``: the whole model on 8 of the training devices, TP 8 (the same GPUs: a
  colocated engine).

Each step the trained pipeline's shards (``pipe.local_shards()``: each process gives only its
own) are moved by one whole-state plan (``plan_state_dict(pipe.state_layout(),
tensor_parallel_layout(model, mesh, plan), cluster)``) straight into the engine's own
parameters (``out=``). The script prints the plan (its estimate / lower bound), the measured
time and bytes of every refit, and exits non-zero unless every check holds:

- every process: each engine shard it drives equals, bit for bit, the matching slice of the
  trained weights — which reach every process through the runtime, by a second plan that
  replicates the training state onto one device of each process (cross-checked against
  ``pipe.state_dict()`` for the stages that process gathers; nothing is pickled);
- the process that drives the engine's first device (where its outputs land): the engine
  generates the same tokens greedily as plain torch on the trained weights, its logits within
  rtol 1e-4 (float32). Every process takes part in the engine's forwards; the tokens each
  forward picks reach the others as small integers over the launcher's channel.

    python examples/refit.py                        # float32, engine tp4
    python examples/refit.py --engine colocated --dtype bfloat16
    torchrun --standalone --nproc-per-node 4 examples/refit.py
    mpiexec -n 4 python examples/refit.py --engine colocated

Any number of processes that divides the 16 devices (one host each with 4).
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
    TensorLayout,
    TorchPipeline,
    plan_state_dict,
    reshard_state_dict,
    tensor_parallel_layout,
    tensor_parallel_shards,
)
from overlap.world import max_over_ranks, sum_over_ranks
from scheduler import Cluster, DeviceMesh, P, Sharding, StateOptions
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


def greedy(forward, prompt: torch.Tensor, new: int,
           pick=lambda logits: logits[:, -1].argmax(-1)) -> tuple[torch.Tensor, torch.Tensor]:
    """``new`` tokens, each ``pick``'s choice from the last forward's logits (the last
    position's argmax); returns the tokens and the logits of the last forward."""
    x = prompt
    for _ in range(new):
        logits = forward(x)
        x = torch.cat([x, pick(logits)[:, None]], 1)
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


def gather_plan(rt: overlap.Runtime, layout: dict[str, TensorLayout]):
    """A plan that replicates every tensor of ``layout`` onto the first device of each
    process: how every process gets the trained weights, through the runtime."""
    placement = rt.backend.placement
    firsts = [0] if placement is None else \
        [placement.devices_of(r)[0] for r in range(rt.world.size)]
    everywhere = Sharding(DeviceMesh(firsts, ("rank",)), P())
    gathered = {k: TensorLayout(t.shape, t.dtype, everywhere) for k, t in layout.items()}
    return plan_state_dict(layout, gathered, rt.cluster)


def trained_weights(rt: overlap.Runtime, pipe: TorchPipeline, plan) -> tuple[dict, int]:
    """The whole trained state in this process (by ``plan``: :func:`gather_plan`), and how
    many of its tensors differ from ``pipe.state_dict()``'s (the stages it gathers here)."""
    got = reshard_state_dict(rt, plan, pipe.local_shards())
    full = {k: next(iter(by_device.values())) for k, by_device in got.items()}
    mine = pipe.state_dict()
    return full, sum(not torch.equal(full[k], v) for k, v in mine.items())


def check_engine(engine, trained: dict[str, torch.Tensor], local: set[int]) -> int:
    """Shards of the engine on this process's devices that differ from the trained weights
    (bit for bit)."""
    wrong = 0
    for d, module, comm in zip(engine.mesh.device_ids, engine.modules, engine.comms):
        if d not in local:
            continue
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
    data = torch.Generator().manual_seed(1)  # (the same batches in every process)
    failures = 0
    with overlap.Runtime(cluster, timeout=60) as rt:
        say = print if rt.world.rank == 0 else (lambda *a, **k: None)
        local = set(rt.local_devices)
        pipe = TorchPipeline(stage_fn, meshes, gpt.lm_loss, plans=plans, axis="tp", rt=rt,
                             seed=0)
        engine_pipe = TorchPipeline([whole_model(stage_fn, p)], [mesh], gpt.lm_loss,
                                    plans=[plan_tp], axis="tp", rt=rt)
        engine = engine_pipe.tp[0]
        plan = plan_state_dict(pipe.state_layout(),
                               tensor_parallel_layout(template, mesh, plan_tp, axis="tp"),
                               cluster, StateOptions(bucket_bytes=args.bucket_kib << 10))
        gather = gather_plan(rt, pipe.state_layout())
        say(f"refit {args.engine}: training TP {[t.degree for t in pipe.tp]} on "
            f"{[m.shape for m in meshes]} -> TP {engine.degree} on devices "
            f"{list(mesh.device_ids)}, {args.dtype}; {rt.world.size} process(es)")
        say("  " + plan.to_text().replace("\n", "\n  "))
        params = list(pipe.parameters())  # (none in a process that drives only the engine)
        opt = torch.optim.AdamW(params, lr=args.lr) if params else None
        for step in range(args.steps):
            mbs = gpt.batch_of(data, argparse.Namespace(**{**vars(args), "backend": "cpu",
                                                           "variable_lengths": False}))
            losses = pipe.train_step_sync(rt, microbatches=mbs, schedule="1f1b")
            if opt is not None:
                opt.step()
                opt.zero_grad()
            t0 = time.perf_counter()
            reshard_state_dict(rt, plan, pipe.local_shards(),
                               out=tensor_parallel_shards(engine, devices=local))
            seconds = max_over_ranks(time.perf_counter() - t0, rt.world)
            trained, differ = trained_weights(rt, pipe, gather)
            wrong = int(sum_over_ranks(check_engine(engine, trained, local) + differ,
                                       rt.world))
            failures += wrong
            say(f"  step {step}: loss {sum(losses) / len(losses):.4f}; refit "
                f"{seconds * 1e3:.1f} ms, {plan.nbytes / 2**20:.2f} MiB delivered "
                f"({plan.network_bytes / 2**20:.2f} MiB over the network), "
                f"{len(plan.buckets)} buckets; shards differing from the trained weights: "
                f"{wrong}")
        failures += generate_and_compare(rt, engine_pipe, trained, stage_fn, p, args, data)
    say("refit: OK" if not failures else f"refit: FAILED ({failures} checks)")
    return 0 if not failures else 1


def generate_and_compare(rt, engine_pipe, trained, stage_fn, p, args, data) -> int:
    """Greedy tokens from the engine and from plain torch on the trained weights: the same
    tokens, logits within LOGITS_RTOL (bfloat16: the tokens only). Checked where the
    engine's outputs land (the process of its first device); every process takes part in
    its forwards and learns each token picked (the sum of the job's failures returned)."""
    prompt = gpt.tokens(data, 2, 4, args.vocab)[:, :4]
    reference = whole_model(stage_fn, p)
    reference.load_state_dict(trained)
    holds = []  # (whether this process holds the engine's outputs: the same every forward)

    def engine_forward(x: torch.Tensor) -> torch.Tensor:
        _, outs = engine_pipe.eval_step_sync(rt, x, torch.zeros_like(x), num_microbatches=1,
                                             return_outputs=True)
        holds[:] = [outs is not None]
        return outs[0] if outs is not None else torch.zeros(*x.shape, args.vocab)

    def picked(logits: torch.Tensor) -> torch.Tensor:
        """The last position's argmax, from the process that has the engine's logits."""
        mine = logits[:, -1].argmax(-1) if holds[0] else torch.full((len(logits),), -1)
        return torch.tensor([int(max_over_ranks(float(t), rt.world)) for t in mine])
    with torch.no_grad():
        got, logits = greedy(engine_forward, prompt, args.new_tokens, picked)
        want, ref_logits = greedy(reference, prompt, args.new_tokens)
    bad = int(not torch.equal(got, want))  # (the same tokens in every process)
    logits_bad = 0
    if holds[0]:
        closeness = gpt.closeness(logits, ref_logits, LOGITS_RTOL, 1e-5)
        print(f"  generated {got[:, prompt.shape[1]:].tolist()} (plain torch: "
              f"{want[:, prompt.shape[1]:].tolist()}); logits vs plain torch {closeness:.2f} "
              f"of rtol {LOGITS_RTOL:g} (rank {rt.world.rank})")
        logits_bad = int(args.dtype == "float32" and closeness > 1)
    return bad + int(sum_over_ranks(logits_bad, rt.world))

if __name__ == "__main__":
    sys.exit(main())
