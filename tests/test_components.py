"""Planning by independent host groups (scheduler/components.py): the plans stay exact, a
class of identical groups is planned once, and a group planned with the others costs what it
costs alone."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_properties import paint

from scheduler import (
    Cluster,
    PlanOptions,
    Sharding,
    ShardingSpec,
    estimate,
    lower_bound,
    plan_resharding,
)
from scheduler.components import interleave
from scheduler.tasks import dimension_overlaps

GPU_SPECS = (None, "gpu")


def _case(preset: str, pairs: int, shape, src_rest, dst_first, dst_rest, same_hosts: bool):
    """``pairs`` source hosts, dim 0 split by host on both sides (so host i's rows go to
    host i of the destination); the destination on the same hosts or on ``pairs`` others."""
    cluster = Cluster.preset(preset, pairs if same_hosts else 2 * pairs)
    src = Sharding(cluster.mesh(range(pairs)), ShardingSpec("host", *src_rest))
    dst_hosts = range(pairs) if same_hosts else range(pairs, 2 * pairs)
    dst = Sharding(cluster.mesh(dst_hosts), ShardingSpec(dst_first, *dst_rest))
    return cluster, src, dst


@settings(max_examples=40, deadline=None)
@given(preset=st.sampled_from(["p3.8xlarge", "dgx-h100"]), pairs=st.integers(2, 5),
       rows=st.integers(1, 6), cols=st.integers(1, 20), depth=st.integers(1, 3),
       src_rest=st.sampled_from([("gpu", None), (None, "gpu"), (None, None)]),
       dst_first=st.sampled_from(["host", ("host", "gpu")]),
       dst_rest=st.sampled_from([(None, None), ("gpu", None), (None, "gpu")]),
       same_hosts=st.booleans(), extra=st.integers(0, 7))
def test_plans_by_host_group_are_exact(preset, pairs, rows, cols, depth, src_rest, dst_first,
                                       dst_rest, same_hosts, extra):
    if dst_first != "host" and "gpu" in dst_rest:
        dst_rest = (None, None)  # gpu used twice
    # rows × 8 per host, plus a few: uneven splits make groups of different shapes.
    shape = (8 * pairs * rows + extra, cols, depth)
    cluster, src, dst = _case(preset, pairs, shape, src_rest, dst_first, dst_rest, same_hosts)
    plan = plan_resharding(shape, "int32", src, dst, cluster, PlanOptions())
    plan.check()
    paint(plan, shape, src, dst)
    again = plan_resharding(shape, "int32", src, dst, cluster, PlanOptions())
    assert again.transfers == plan.transfers  # same inputs, same plan


def test_identical_groups_are_planned_once_and_cost_what_one_costs_alone():
    # The scale benchmark's layouts at 8 host pairs: every pair the same up to renaming.
    cluster, src, dst = _case("dgx-h100", 8, (1024, 256, 4), ("gpu", None), ("host", "gpu"),
                              (None, None), same_hosts=False)
    plan = plan_resharding((1024, 256, 4), "float32", src, dst, cluster, PlanOptions())
    assert (plan.stats["components"], plan.stats["classes"]) == (8, 1)
    plan.check()
    # One pair alone: its 128 rows, from one host to one host.
    one_cluster, one_src, one_dst = _case("dgx-h100", 1, (128, 256, 4), ("gpu", None),
                                          ("host", "gpu"), (None, None), same_hosts=False)
    alone = plan_resharding((128, 256, 4), "float32", one_src, one_dst, one_cluster,
                            PlanOptions())
    assert "components" not in alone.stats
    assert len(plan.transfers) == 8 * len(alone.transfers)
    assert estimate(plan, cluster) == pytest.approx(estimate(alone, one_cluster), rel=1e-9)


def test_groups_of_different_shapes_get_classes_of_their_own():
    # 8·4 + 3 rows over 4 source hosts: the first three hosts get 9 rows, the last 5.
    cluster, src, dst = _case("p3.8xlarge", 4, (35, 8, 2), (None, "gpu"), "host",
                              (None, None), same_hosts=False)
    plan = plan_resharding((35, 8, 2), "float32", src, dst, cluster, PlanOptions())
    assert plan.stats["components"] == 4 and plan.stats["classes"] == 2
    paint(plan, (35, 8, 2), src, dst)


def test_a_resharding_that_couples_every_host_is_planned_whole():
    cluster = Cluster.preset("p3.8xlarge", 4)
    src = Sharding(cluster.mesh([0, 1]), ShardingSpec("host", "gpu"))
    dst = Sharding(cluster.mesh([2, 3]), ShardingSpec("gpu", "host"))  # every host to both
    plan = plan_resharding((16, 16), "float32", src, dst, cluster, PlanOptions())
    assert "components" not in plan.stats
    plan.check()


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 60), a=st.integers(1, 12), b=st.integers(1, 12), data=st.data())
def test_dimension_overlaps_match_the_double_loop(n, a, b, data):
    def tiles(k: int) -> list[tuple[int, int]]:
        cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=k))) if n > 1
                      else set())
        edges = [0, *cuts, n]
        return list(itertools.pairwise(edges))

    s_tiles, d_tiles = tiles(a), tiles(b)
    want = [((max(s[0], t[0]), min(s[1], t[1])), s, t) for s in s_tiles for t in d_tiles
            if max(s[0], t[0]) < min(s[1], t[1])]
    assert dimension_overlaps(s_tiles, d_tiles) == want


def test_interleaving_keeps_each_wait_on_the_same_piece():
    def part(tag: int, n: int):  # piece k of group `tag` waits for piece k - 1, lane k % 2
        return [(tag, ((tag, k),), tag, (tag + 10,), (k - 1,) if k else (), k % 2)
                for k in range(n)]

    parts = [part(0, 3), part(1, 1), part(2, 4)]
    merged = interleave(parts)
    keep = (0, 1, 2, 3, 5)  # all but the waits, which are renumbered
    assert sorted(tuple(p[k] for k in keep) for p in merged) == sorted(
        tuple(p[k] for k in keep) for q in parts for p in q)
    assert len(merged) == 8
    assert [p[1][0] for p in merged[:3]] == [(0, 0), (1, 0), (2, 0)]  # every group starts
    for n, (_, region, _, _, after, _) in enumerate(merged):
        tag, k = region[0]
        assert all(a < n for a in after)
        assert [merged[a][1][0] for a in after] == ([(tag, k - 1)] if k else [])


def test_the_scale_case_plans_exactly_with_lanes_at_256_gpus():
    # The scale benchmark's case (docs/benchmarks.md) at 32 DGX hosts: every transfer's
    # sender holds its region, every destination GPU gets its region once, on 8 lanes.
    cluster, src, dst = _case("dgx-h100", 16, (8192, 512, 4), ("gpu", None), ("host", "gpu"),
                              (None, None), same_hosts=False)
    plan = plan_resharding((8192, 512, 4), "float32", src, dst, cluster, PlanOptions())
    plan.check()
    assert (plan.stats["components"], plan.stats["classes"]) == (16, 1)
    assert len(plan.transfers) == 16 * 64 and {t.lane for t in plan.transfers} == set(range(8))
    assert estimate(plan, cluster) <= 1.01 * lower_bound((8192, 512, 4), "float32", src, dst,
                                                         cluster)
