"""Under ``mpiexec -n N`` or ``torchrun --nproc-per-node N`` (N divides 8): whole-state
reshardings where each process gives only its own devices' source shards. Every destination
shard this process receives must equal the full tensor's region, byte for byte; a shard of a
device another process drives is refused on every process alike (nothing moves). Exits 0 when
all of that holds and prints ``STATE OK <rank> <tensors checked>``."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (tests/: state_arrays)

from state_arrays import box, full_tensors

import overlap
from scheduler import (
    Cluster,
    DeviceMesh,
    P,
    Sharding,
    StateOptions,
    StateTensor,
    plan_state_resharding,
)

CLUSTER = Cluster.preset("p3.8xlarge", 2)  # 8 devices: 2 hosts x 4 GPUs


def _sharding(rng: random.Random, devices: list[int], rank: int) -> Sharding:
    n = len(devices)
    shape = (2, n // 2) if n % 2 == 0 and n > 2 else (1, n)
    mesh = DeviceMesh(np.array(devices).reshape(shape).tolist(), ("a", "b"))
    entries: list = [None] * rank
    for axis in rng.sample(["a", "b"], k=rng.randint(0, 2)):
        d = rng.randrange(rank)
        entries[d] = axis if entries[d] is None else (entries[d], axis)
    return Sharding(mesh, P(*entries))


def states() -> list[dict[str, StateTensor]]:
    """Seeded random states (the same on every process): disjoint, overlapping and the same
    meshes, uneven shards, float32 / bfloat16 / int64 — and a training -> inference refit:
    TP 4 on host 0 to TP 2 x DP 2 on host 1."""
    rng = random.Random(48)
    out = []
    for kind in ("disjoint", "overlapping", "identical"):
        src_devs = rng.sample(range(8), 4)
        others = [d for d in range(8) if d not in src_devs]
        dst_devs = {"disjoint": others, "identical": list(src_devs),
                    "overlapping": src_devs[:2] + others[:2]}[kind]
        tensors = {}
        for k in range(4):
            rank = rng.randint(1, 3)
            shape = tuple(rng.randint(1, 11) for _ in range(rank))
            tensors[f"{kind}.t{k}"] = StateTensor(
                shape, rng.choice(["float32", "bfloat16", "int64"]),
                _sharding(rng, src_devs, rank), _sharding(rng, dst_devs, rank))
        out.append(tensors)
    tp4 = Sharding(DeviceMesh([0, 1, 2, 3], ("tp",)), P("tp"))
    infer = DeviceMesh([[4, 5], [6, 7]], ("dp", "tp"))
    out.append({f"layers.{i}.{w}": StateTensor((16, 12), "bfloat16", tp4,
                                                Sharding(infer, P("tp") if w == "fc1" else
                                                         P(None, "tp")))
                for i in range(3) for w in ("fc1", "fc2")})
    return out


def mine(tensors, full, local) -> dict[str, dict[int, np.ndarray]]:
    """This process's source shards only."""
    return {name: {d: np.ascontiguousarray(full[name][box(r)])
                   for d, r in t.src.device_regions(t.shape).items() if d in local}
            for name, t in tensors.items()}


def check(out, tensors, full, local) -> int:
    checked = 0
    for name, t in tensors.items():
        want = {d: r for d, r in t.dst.device_regions(t.shape).items() if d in local}
        assert sorted(out[name]) == sorted(want), (name, sorted(out[name]), sorted(want))
        for d, region in want.items():
            got, exp = out[name][d], full[name][box(region)]
            assert got.shape == exp.shape and got.dtype == exp.dtype, (name, d)
            assert np.array_equal(np.ascontiguousarray(got).view(np.uint8),
                                  np.ascontiguousarray(exp).view(np.uint8)), (name, d)
            checked += 1
    return checked


def refused_elsewhere(rt, plan, tensors, full, local) -> None:
    """Every process passes, beside its own, a shard of a device another process drives."""
    name, t = next((n, t) for n, t in tensors.items()
                   if any(d not in local for d in t.src.device_regions(t.shape)))
    shards = mine(tensors, full, local)
    away = next(d for d in t.src.device_regions(t.shape) if d not in local)
    shards[name] = {**shards[name], away: full[name][box(t.src.device_regions(t.shape)[away])]}
    try:
        rt.reshard_state_sync(plan, shards)
    except ValueError as exc:
        assert f"shards[{name!r}]: devices [{away}] belong to other processes" in str(exc), exc
    else:
        raise AssertionError("a shard of another process's device was accepted")


def main() -> int:
    checked = 0
    with overlap.Runtime(CLUSTER, timeout=30) as rt:
        local = set(rt.local_devices)
        for k, tensors in enumerate(states()):
            plan = plan_state_resharding(tensors, CLUSTER, StateOptions(bucket_bytes=96))
            full = full_tensors(tensors, k)
            out = rt.reshard_state_sync(plan, mine(tensors, full, local))
            checked += check(out, tensors, full, local)
            # Again into the same arrays, with other values: every element written again.
            full = full_tensors(tensors, 100 + k)
            again = rt.reshard_state_sync(plan, mine(tensors, full, local), out=out)
            checked += check(again, tensors, full, local)
            if k == 0:
                refused_elsewhere(rt, plan, tensors, full, local)
        print(f"STATE OK {rt.world.rank} {checked}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
