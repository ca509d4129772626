"""PlanOptions (one value for how to plan), PlanCache, and auto's shared work budget."""

from __future__ import annotations

import pytest

from scheduler import (
    Cluster,
    P,
    PlanCache,
    PlanOptions,
    Sharding,
    plan_resharding,
)
from scheduler import balance as balance_module

CLUSTER = Cluster.preset("p3.8xlarge", 4)
SRC = Sharding(CLUSTER.mesh([0, 1]), P("host", None))
DST = Sharding(CLUSTER.mesh([2, 3]), P(None, ("host", "gpu")))


def test_options_are_a_value():
    a = PlanOptions()
    assert (a.strategy, a.balance, a.seed) == ("broadcast", "auto", 0)
    assert a == PlanOptions("broadcast", "auto", 0, a.budget) and hash(a) == hash(PlanOptions())
    assert a != PlanOptions(seed=1)
    assert "broadcast/auto" in str(a)
    with pytest.raises(AttributeError):
        a.seed = 3  # type: ignore[misc]


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"strategy": "carrier-pigeon"}, ValueError, "strategy: unknown 'carrier-pigeon'"),
    ({"balance": "psychic"}, ValueError, "balance: unknown 'psychic'"),
    ({"seed": 1.5}, TypeError, "seed"),
    ({"seed": True}, TypeError, "seed"),
    ({"budget": 0}, ValueError, "budget"),
    ({"budget": 10.0}, ValueError, "budget"),
])
def test_bad_options_are_named(kw, exc, match):
    with pytest.raises(exc, match=match):
        PlanOptions(**kw)


def test_plan_resharding_takes_options_only_as_a_value():
    with pytest.raises(TypeError, match="options: expected a PlanOptions"):
        plan_resharding((8, 8), "float32", SRC, DST, CLUSTER, {"strategy": "send_recv"})
    sr = plan_resharding((8, 8), "float32", SRC, DST, CLUSTER, PlanOptions("send_recv", "size"))
    assert (sr.strategy, sr.balance) == ("send_recv", "size")
    assert all(len(t.receivers) == 1 for t in sr.transfers)


def test_cache_returns_the_same_plan_and_keeps_the_most_recent():
    cache = PlanCache(CLUSTER, size=2)
    a = cache.plan((8, 8), "float32", SRC, DST)
    assert cache.plan((8, 8), "float32", SRC, DST, PlanOptions()) is a
    assert a == plan_resharding((8, 8), "float32", SRC, DST, CLUSTER)
    b = cache.plan((8, 8), "float32", SRC, DST, PlanOptions("send_recv"))
    assert b is not a and len(cache) == 2
    cache.plan((8, 8), "float32", SRC, DST)  # a is now the most recently used
    cache.plan((16, 8), "float32", SRC, DST)  # drops b, the least recently used
    assert len(cache) == 2
    assert cache.plan((8, 8), "float32", SRC, DST) is a
    assert cache.plan((8, 8), "float32", SRC, DST, PlanOptions("send_recv")) is not b


def test_cache_arguments_are_checked():
    with pytest.raises(TypeError, match="cluster"):
        PlanCache("p3.8xlarge")
    with pytest.raises(ValueError, match="size"):
        PlanCache(CLUSTER, size=0)


@pytest.mark.parametrize("budget", [5_000, 40_000, 600_000])
def test_auto_divides_its_budget_among_its_candidates(budget, monkeypatch):
    """What auto hands each candidate to build with, plus what costing it takes (3 replays
    of the variant's k sends: 3 (k^2 // 64 + k) units), adds up to at most the budget — no
    candidate gets the whole budget."""
    spent: list[tuple[int, int]] = []  # (build budget, costing units) per candidate built
    real = balance_module.auto_builders

    def recording(vsends, *args):
        k = len(vsends)
        for name, build in real(vsends, *args):
            def wrapped(b, _build=build):
                spent.append((b, 3 * (k * k // 64 + k)))
                return _build(b)
            yield name, wrapped

    monkeypatch.setattr(balance_module, "auto_builders", recording)
    src = Sharding(CLUSTER.mesh([0, 1]), P("host", "gpu"))
    dst = Sharding(CLUSTER.mesh([2, 3]), P("gpu", "host"))
    plan = plan_resharding((64, 64), "int32", src, dst, CLUSTER, PlanOptions(budget=budget))
    plan.check()
    assert len(spent) > 1
    assert sum(b + c for b, c in spent) <= budget
    assert max(b for b, _ in spent) < budget / 2
