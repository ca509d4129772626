"""Shared hypothesis generators: clusters, meshes, shardings and resharding problems.

The test modules import them (pytest puts ``tests/`` on ``sys.path``):
``from strategies import problems``.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from scheduler import Cluster, DeviceMesh, Sharding, ShardingSpec

DTYPES = ("int8", "float16", "bfloat16", "float8_e5m2", "int32", "float32", "int64")


@st.composite
def clusters(draw) -> Cluster:
    hosts = draw(st.integers(1, 8))
    gpus = draw(st.integers(1, 8))
    nics = draw(st.sampled_from([n for n in (1, 2) if gpus % n == 0]))
    return Cluster(
        hosts,
        gpus,
        nic_gbps=draw(st.sampled_from([10.0, 100.0, 400.0])),
        nics_per_host=nics,
        nvlink_gbps=draw(st.sampled_from([300.0, 640.0, 2960.0])),
        nic_latency_us=draw(st.sampled_from([0.0, 5.0, 40.0])),
        nvlink_latency_us=draw(st.sampled_from([0.0, 3.0, 5.0])),
    )


def _mesh(draw, cluster: Cluster, names: tuple[str, ...], preferred: tuple[int, ...] = ()):
    """A 1–3 axis mesh of distinct cluster devices; ``preferred`` devices are used first."""
    ndim = draw(st.integers(1, 3))
    sizes, room = [], cluster.num_devices
    for _ in range(ndim):
        s = draw(st.integers(1, min(8, room)))
        sizes.append(s)
        room //= s
    total = math.prod(sizes)
    rest = [d for d in range(cluster.num_devices) if d not in preferred]
    pool = list(draw(st.permutations(list(preferred)))) + list(draw(st.permutations(rest)))
    devices = np.array(pool[:total], dtype=int).reshape(sizes)
    return DeviceMesh(devices, names[:ndim])


def _spec(draw, mesh: DeviceMesh, rank: int) -> ShardingSpec:
    """Each mesh axis splits at most one dim; specs may be shorter than the rank."""
    free = list(draw(st.permutations(list(mesh.axis_names))))
    entries = []
    for _ in range(draw(st.integers(0, rank))):
        k = draw(st.integers(0, len(free)))
        used, free = free[:k], free[k:]
        entries.append(None if k == 0 else used[0] if k == 1 else tuple(used))
    return ShardingSpec(*entries)


@st.composite
def problems(draw, cluster: Cluster | None = None):
    """(shape, dtype, src, dst, cluster); on ``cluster`` when given, else on a drawn one."""
    cluster = draw(clusters()) if cluster is None else cluster
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    src_mesh = _mesh(draw, cluster, ("a", "b", "c"))
    overlap = draw(st.sampled_from(["independent", "overlapping"]))
    preferred = src_mesh.device_ids if overlap == "overlapping" else ()
    dst_names = draw(st.sampled_from([("a", "b", "c"), ("x", "y", "z"), ("c", "b", "a")]))
    dst_mesh = _mesh(draw, cluster, dst_names, preferred)
    src = Sharding(src_mesh, _spec(draw, src_mesh, len(shape)))
    dst = Sharding(dst_mesh, _spec(draw, dst_mesh, len(shape)))
    return shape, dtype, src, dst, cluster
