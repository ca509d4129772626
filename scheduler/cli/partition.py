"""``overlap partition``: choose a pipeline's stages, submeshes, TP degrees, layouts and
schedule for a model given as a case file, print the plan as a table, and write it as JSON
(``--json``) that ``overlap simulate --case`` and :meth:`scheduler.PartitionPlan.from_json`
read.

A case file (``examples/cases/partition_case.json``)::

    {"cluster": {"preset": "p3.8xlarge", "num_hosts": 2},
     "microbatches": 16,
     "memory_per_device_gib": 16,                       # optional: no limit without it
     "layers": [{"name": "block",                       # optional
                 "forward_ms": {"1": 40, "2": 21, "4": 11},   # TP degree -> ms
                 "backward_ms": {"1": 80, "2": 42, "4": 22},
                 "input_grad_ms": {...}, "weight_grad_ms": {...},   # optional, both or none
                 "output_shape": [1024, 8192], "dtype": "float16",
                 "params_bytes": 3221225472, "activation_bytes": 285212672,
                 "output_spec": [], "input_spec": [],   # optional: layouts over axis "tp"
                 "repeat": 24}, ...]}                    # optional: this layer 24 times
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..cluster import Cluster
from ..partition import Layer, partition
from ..sharding import ShardingSpec
from .common import (
    add_plan_options,
    interpret_case,
    parser,
    plan_options,
    read_json_file,
    write_output,
)

# Layers in all, repeats counted: the list is made before the search sizes its tables
# (scheduler.partition.search.search_bytes, refused past MAX_SEARCH_BYTES: layers² × stage
# shapes); 4096 layers of one TP degree on one host fit them.
MAX_LAYERS = 4096


def _ms(value: Any, argument: str) -> dict[int, float]:
    if not isinstance(value, dict):
        raise TypeError(f"{argument}: expected an object of TP degree -> milliseconds, got "
                        f"{type(value).__name__}")
    out = {}
    for k, v in value.items():
        try:
            degree = int(k)
        except ValueError:
            raise ValueError(f"{argument}: TP degree {k!r} is not an int") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{argument}[{k}]: expected milliseconds, got {v!r}")
        out[degree] = v / 1e3
    return out


def layer_from_json(data: Any, i: int) -> tuple[Layer, int]:
    """One entry of ``layers``: the layer and how many times it repeats."""
    if not isinstance(data, dict):
        raise TypeError(f"layers[{i}]: expected an object, got {type(data).__name__}")
    known = {"name", "forward_ms", "backward_ms", "input_grad_ms", "weight_grad_ms",
             "output_shape", "dtype", "params_bytes", "activation_bytes", "output_spec",
             "input_spec", "repeat"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"layers[{i}]: unknown fields {unknown}; known: {sorted(known)}")
    repeat = data.get("repeat", 1)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or not 1 <= repeat <= MAX_LAYERS:
        raise ValueError(f"layers[{i}].repeat: expected an int in 1..{MAX_LAYERS}, got "
                         f"{repeat!r}")
    kwargs: dict[str, Any] = {"name": str(data.get("name", ""))}
    for key in ("input_grad", "weight_grad"):
        if f"{key}_ms" in data:
            kwargs[key] = _ms(data[f"{key}_ms"], f"layers[{i}].{key}_ms")
    for key in ("output_spec", "input_spec"):
        if key in data:
            kwargs[key] = ShardingSpec.from_json(data[key])
    try:
        layer = Layer(_ms(data["forward_ms"], f"layers[{i}].forward_ms"),
                      _ms(data["backward_ms"], f"layers[{i}].backward_ms"),
                      tuple(data["output_shape"]), data["dtype"], data["params_bytes"],
                      data["activation_bytes"], **kwargs)
    except (ValueError, TypeError) as exc:
        if str(exc).startswith(f"layers[{i}]"):
            raise
        raise type(exc)(f"layers[{i}]: {exc}") from None
    return layer, repeat


def case_from_json(data: dict[str, Any]) -> dict[str, Any]:
    missing = {"cluster", "microbatches", "layers"} - set(data)
    if missing:
        raise ValueError(f"case file: missing keys {sorted(missing)}")
    if not isinstance(data["layers"], list) or not data["layers"]:
        raise ValueError("layers: expected a non-empty list of layers")
    layers: list[Layer] = []
    for i, entry in enumerate(data["layers"]):
        layer, repeat = layer_from_json(entry, i)
        if len(layers) + repeat > MAX_LAYERS:
            raise ValueError(f"layers: more than {MAX_LAYERS} layers in all")
        layers += [layer] * repeat
    m = data["microbatches"]
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"microbatches: expected an int >= 1, got {m!r}")
    memory = data.get("memory_per_device_gib")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float))):
        raise TypeError(f"memory_per_device_gib: expected a number, got {memory!r}")
    return {"layers": layers, "cluster": Cluster.from_dict(data["cluster"]),
            "microbatches": m,
            "memory": None if memory is None else memory * (1 << 30)}


def build_parser() -> argparse.ArgumentParser:
    p = parser("overlap partition", "Choose a pipeline's stages, submeshes, TP degrees, "
               "layouts and schedule for a model (a case file), by simulation.")
    p.add_argument("--case", type=Path, required=True,
                   help="a partition case file: JSON with cluster, microbatches, layers "
                        "(examples/cases/partition_case.json)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step (None: the case file's)")
    p.add_argument("--json", type=Path, default=None,
                   help="write the plan here: a pipeline case 'overlap simulate --case' "
                        "reads, with the schedule")
    add_plan_options(p)
    return p


def partition_main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.json is not None and args.json.is_dir():
            raise ValueError(f"--json: {args.json} is a directory; name the file to write")
        if args.microbatches is not None and args.microbatches < 1:
            raise ValueError(f"--microbatches: expected an int >= 1, got {args.microbatches}")
        case = interpret_case(args.case, read_json_file(args.case, "--case"), case_from_json)
        m = case["microbatches"] if args.microbatches is None else args.microbatches
        plan = partition(case["layers"], case["cluster"], m,
                         memory_per_device=case["memory"], options=plan_options(args))
    except (ValueError, TypeError) as exc:  # (PartitionError is a ValueError)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    c = plan.cluster
    print(f"{len(case['layers'])} layers on {c.num_hosts} hosts × {c.gpus_per_host} GPUs, "
          f"{plan.num_microbatches} microbatches; transfers {plan.options.strategy}/"
          f"{plan.options.balance}; search: {plan.search['runs']} runs, gap "
          f"{plan.search['gap']:.3g}, {len(plan.search['finalists'])} simulated")
    print(plan.to_text())
    if args.json is not None:
        if not write_output(args.json, plan.to_json(), "--json"):
            return 2
        print(f"plan written to {args.json} (overlap simulate --case {args.json})")
    return 0
