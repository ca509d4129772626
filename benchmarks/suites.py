"""Benchmark cases: the paper's microbenchmark suite and a seeded random suite.

A case is :class:`scheduler.cli.common.Case` (shape, dtype, two shardings, a cluster: what
``overlap plan --case FILE`` reads too); the benchmarks and the tests share these lists.
"""

from __future__ import annotations

import random

from scheduler import Cluster, Sharding, ShardingSpec
from scheduler.cli.common import Case


def paper_suite() -> list[Case]:
    """The microbenchmark suite of arXiv 2211.05322 (Table 2 / Fig. 7) on 5 × p3.8xlarge."""
    cluster = Cluster.preset("p3.8xlarge", 5)
    big = (1024, 1024, 512)
    hg = ("host", "gpu")
    rows = [
        ("1", (2, 4), (2, 4), big, ("host", None, None), ("host", None, None)),
        ("2", (2, 4), (2, 4), big, (None, None, None), ("host", None, None)),
        ("3", (2, 4), (2, 4), big, (None, "host", None), ("host", None, None)),
        ("4", (2, 4), (2, 4), big, (None, hg, None), (hg, None, None)),
        ("5", (2, 4), (2, 4), big, ("gpu", None, None), ("host", None, None)),
        ("6", (2, 4), (3, 4), (3072, 1024, 170), ("host", None, None), ("host", None, None)),
        ("7", (1, 4), (2, 4), big, ("gpu", None, None), (None, None, None)),
        ("9", (2, 4), (2, 4), big, (None, "host", None), (None, None, "host")),
    ]
    cases = []
    for name, (sh, sg), (dh, dg), shape, s_spec, d_spec in rows:
        src = Sharding(cluster.mesh(range(sh), gpus=sg), ShardingSpec(*s_spec))
        dst = Sharding(cluster.mesh(range(sh, sh + dh), gpus=dg), ShardingSpec(*d_spec))
        cases.append(Case(f"case {name}", shape, "int32", src, dst, cluster))
    for dh, dg in ((1, 1), (1, 2), (1, 3), (1, 4), (2, 2), (3, 2), (4, 2)):
        src = Sharding(cluster.mesh(range(1), gpus=1), ShardingSpec())
        dst = Sharding(cluster.mesh(range(1, 1 + dh), gpus=dg), ShardingSpec())
        cases.append(Case(f"1->({dh},{dg})", (2**28,), "int32", src, dst, cluster))
    return cases


def scale_case(num_hosts: int = 128) -> Case:
    """``num_hosts`` DGX H100 hosts (128 by default): the first half's (h/2, 8) mesh, fully
    sharded, -> the second half's, differently sharded."""
    half = num_hosts // 2
    cluster = Cluster.preset("dgx-h100", num_hosts)
    src = Sharding(cluster.mesh(range(half)), ShardingSpec("host", "gpu", None))
    dst = Sharding(cluster.mesh(range(half, num_hosts)),
                   ShardingSpec(("host", "gpu"), None, None))
    return Case(f"scale dgx-h100 ×{num_hosts}", (8192, 8192, 64), "float32", src, dst, cluster)


_SPEC_CHOICES: tuple[object, ...] = (None, "host", "gpu", ("host", "gpu"), ("gpu", "host"))


def _random_spec(rng: random.Random, rank: int) -> ShardingSpec:
    while True:
        entries = [rng.choice(_SPEC_CHOICES) for _ in range(rank)]
        axes = [a for e in entries if e for a in ((e,) if isinstance(e, str) else e)]
        if len(axes) == len(set(axes)):
            return ShardingSpec(*entries)


def random_suite(num_cases: int = 24, seed: int = 0) -> list[Case]:
    """Seeded random cases: 2–8 source hosts -> 2–8 destination hosts of 4 GPUs (p3.8xlarge),
    3-d int32 tensors of 64 MiB – 3 GiB (the paper suite's sizes) whose dims are not always
    divisible by the splits."""
    rng = random.Random(seed)
    cases = []
    for k in range(num_cases):
        ns, nd = rng.randint(2, 8), rng.randint(2, 8)
        cluster = Cluster.preset("p3.8xlarge", ns + nd)
        shape = (
            rng.choice([512, 768, 1000, 1024, 1536]),
            rng.choice([512, 600, 1024, 2048]),
            rng.choice([64, 100, 128, 170, 256]),
        )
        src = Sharding(cluster.mesh(range(ns)), _random_spec(rng, 3))
        dst = Sharding(cluster.mesh(range(ns, ns + nd)), _random_spec(rng, 3))
        cases.append(Case(f"random {k}", shape, "int32", src, dst, cluster))
    return cases
