"""Whole model states with their real tensor shapes, in a trainer's and an inference
engine's layout: what ``benchmarks/state_reshard.py`` plans (and tests may build smaller).

**DeepSeek-V3** (its ``config.json``: hidden 7168, 61 layers of which the first 3 dense with
intermediate 18432, 256 routed experts of intermediate 2048 and 1 shared expert per MoE
layer, MLA attention with q LoRA rank 1536, kv LoRA rank 512, 128 heads of 128 + 64 (rope)
query/key dims and 128 value dims, vocabulary 129280; bfloat16; the multi-token-prediction
layer left out: 671 B parameters). Routed experts are **stacked per layer and projection**,
as vLLM's ``FusedMoE`` (``w13_weight``, ``w2_weight``) and Megatron's grouped-GEMM experts
keep them: ``experts.gate``/``experts.up`` of shape (256, 2048, 7168) and ``experts.down``
(256, 7168, 2048) — gate and up apart (vLLM fuses them into one ``w13``, whose TP split
takes each half alike: the same bytes to the same ranks). 1,025 tensors.

- Trainer, PP 16 × EP 16 (Megatron): 16 stages of 16 GPUs (2 hosts each), the layers cut as
  ``numpy.array_split`` cuts 61 into 16 (4 layers on stages 0–12, 3 on 13–15), embedding on
  the first stage, final norm and output head on the last; experts split over the 16 EP
  ranks of their stage (16 each), everything else replicated over them (TP 1: the EP ranks
  are the dense parts' data-parallel ranks).
- Engine, TP 32 × DP 8 (vLLM): 8 engines of 32 GPUs (4 hosts each); attention's q_b, kv_b
  split by rows (heads), o by columns, q_a and kv_a replicated (vLLM's ``ReplicatedLinear``
  in MLA); MLPs' gate/up by rows, down by columns; experts' intermediate dim split (each
  rank holds all 256 experts' slice: vLLM's TP MoE without expert parallelism); vocabulary
  split for the embedding and the head; norms, the router and its bias replicated.

**Llama-3-70B** (hidden 8192, 80 layers, 64 query and 8 key/value heads of 128, MLP 28672,
vocabulary 128256; bfloat16; 70.6 B parameters; 723 tensors).

- Trainer, FSDP 8 × TP 8 (torchtitan's FSDP2 over TP): 8 hosts; TP inside a host, FSDP
  across hosts, each TP shard further cut on dim 0 by FSDP (``P(("tp", "fsdp"), None)`` for
  column-parallel weights and the vocabulary-parallel embedding and head, ``P("fsdp",
  "tp")`` for row-parallel ones, ``P("fsdp")`` for norms).
- Engine, TP 8 × DP 8 (vLLM): 8 other hosts, one engine each.
"""

from __future__ import annotations

import math

import numpy as np

from scheduler import Cluster, DeviceMesh, P, Sharding, StateTensor

DTYPE = "bfloat16"


def deepseek_v3_shapes(layers: int = 61, experts: int = 256, dense_layers: int = 3
                       ) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind) of DeepSeek-V3's weights; kind says how TP splits it:
    ``col`` (rows split), ``row`` (columns split), ``rep`` (replicated), ``vocab`` (rows),
    ``experts-col`` / ``experts-row`` (a stacked expert weight's intermediate dim)."""
    h, inter, moe, vocab = 7168, 18432, 2048, 129280
    heads, q_rank, kv_rank, nope, rope, v = 128, 1536, 512, 128, 64, 128
    out: dict[str, tuple[tuple[int, ...], str]] = {"embed_tokens": ((vocab, h), "vocab")}
    for i in range(layers):
        p = f"layers.{i}."
        out |= {
            p + "input_layernorm": ((h,), "rep"),
            p + "attn.q_a_proj": ((q_rank, h), "rep"),
            p + "attn.q_a_layernorm": ((q_rank,), "rep"),
            p + "attn.q_b_proj": ((heads * (nope + rope), q_rank), "col"),
            p + "attn.kv_a_proj_with_mqa": ((kv_rank + rope, h), "rep"),
            p + "attn.kv_a_layernorm": ((kv_rank,), "rep"),
            p + "attn.kv_b_proj": ((heads * (nope + v), kv_rank), "col"),
            p + "attn.o_proj": ((h, heads * v), "row"),
            p + "post_attention_layernorm": ((h,), "rep"),
        }
        if i < dense_layers:
            out |= {p + "mlp.gate_proj": ((inter, h), "col"),
                    p + "mlp.up_proj": ((inter, h), "col"),
                    p + "mlp.down_proj": ((h, inter), "row")}
        else:
            out |= {p + "mlp.gate": ((experts, h), "rep"),
                    p + "mlp.gate.e_score_correction_bias": ((experts,), "rep"),
                    p + "mlp.shared_experts.gate_proj": ((moe, h), "col"),
                    p + "mlp.shared_experts.up_proj": ((moe, h), "col"),
                    p + "mlp.shared_experts.down_proj": ((h, moe), "row"),
                    p + "mlp.experts.gate": ((experts, moe, h), "experts-col"),
                    p + "mlp.experts.up": ((experts, moe, h), "experts-col"),
                    p + "mlp.experts.down": ((experts, h, moe), "experts-row")}
    out |= {"norm": ((h,), "rep"), "lm_head": ((vocab, h), "vocab")}
    return out


def _tp_spec(kind: str, axis: str) -> P:
    return {"col": P(axis, None), "vocab": P(axis, None), "row": P(None, axis), "rep": P(),
            "experts-col": P(None, axis, None), "experts-row": P(None, None, axis)}[kind]


def _engines(cluster: Cluster, first_host: int, engines: int, tp: int) -> DeviceMesh:
    """``engines`` inference engines of ``tp`` GPUs each, from host ``first_host`` on."""
    first = first_host * cluster.gpus_per_host
    ids = np.arange(first, first + engines * tp).reshape(engines, tp)
    return DeviceMesh(ids.tolist(), ("dp", "tp"))


def deepseek_v3_state(cluster: Cluster, *, layers: int = 61, experts: int = 256,
                      stages: int = 16, ep: int = 16, tp: int = 32, dp: int = 8,
                      colocated: bool = False) -> dict[str, StateTensor]:
    """DeepSeek-V3 from PP ``stages`` × EP ``ep`` (devices 0.. in stage order) to TP ``tp`` ×
    DP ``dp`` on the next devices (``colocated``: on the same devices). Smaller arguments
    give a smaller model of the same structure."""
    shapes = deepseek_v3_shapes(layers, experts, min(3, layers))
    per_stage = [list(c) for c in np.array_split(np.arange(layers), stages)]
    stage_of = {i: s for s, ls in enumerate(per_stage) for i in ls}
    meshes = [DeviceMesh(list(range(s * ep, (s + 1) * ep)), ("ep",)) for s in range(stages)]
    gpus = cluster.gpus_per_host
    engine = _engines(cluster, 0 if colocated else -(-stages * ep // gpus), dp, tp)
    out = {}
    for name, (shape, kind) in shapes.items():
        if name.startswith("layers."):
            stage = stage_of[int(name.split(".")[1])]
        else:
            stage = 0 if name == "embed_tokens" else stages - 1
        src = P("ep", None, None) if kind.startswith("experts") else P()
        out[name] = StateTensor(shape, DTYPE, Sharding(meshes[stage], src),
                                Sharding(engine, _tp_spec(kind, "tp")))
    return out


def llama3_70b_shapes(layers: int = 80) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind) of Llama-3-70B's weights (kinds as :func:`deepseek_v3_shapes`)."""
    h, inter, vocab, kv = 8192, 28672, 128256, 8 * 128
    out: dict[str, tuple[tuple[int, ...], str]] = {"embed_tokens": ((vocab, h), "vocab")}
    for i in range(layers):
        p = f"layers.{i}."
        out |= {p + "input_layernorm": ((h,), "rep"),
                p + "attn.q_proj": ((h, h), "col"), p + "attn.k_proj": ((kv, h), "col"),
                p + "attn.v_proj": ((kv, h), "col"), p + "attn.o_proj": ((h, h), "row"),
                p + "post_attention_layernorm": ((h,), "rep"),
                p + "mlp.gate_proj": ((inter, h), "col"), p + "mlp.up_proj": ((inter, h), "col"),
                p + "mlp.down_proj": ((h, inter), "row")}
    out |= {"norm": ((h,), "rep"), "lm_head": ((vocab, h), "vocab")}
    return out


def llama3_70b_state(cluster: Cluster, *, layers: int = 80, fsdp: int = 8, tp: int = 8,
                     dp: int = 8) -> dict[str, StateTensor]:
    """Llama-3-70B from FSDP ``fsdp`` × TP ``tp`` on the first hosts to TP ``tp`` × DP ``dp``
    on the hosts after them (one host per ``tp`` GPUs)."""
    gpus = cluster.gpus_per_host
    train = DeviceMesh(np.arange(fsdp * tp).reshape(fsdp, tp).tolist(), ("fsdp", "tp"))
    engine = _engines(cluster, -(-fsdp * tp // gpus), dp, tp)
    fsdp_spec = {"col": P(("tp", "fsdp"), None), "vocab": P(("tp", "fsdp"), None),
                 "row": P("fsdp", "tp"), "rep": P("fsdp")}
    return {name: StateTensor(shape, DTYPE, Sharding(train, fsdp_spec[kind]),
                              Sharding(engine, _tp_spec(kind, "tp")))
            for name, (shape, kind) in llama3_70b_shapes(layers).items()}


def parameters(tensors: dict[str, StateTensor]) -> int:
    """Elements of a state (its parameter count)."""
    return sum(math.prod(t.shape) for t in tensors.values())
