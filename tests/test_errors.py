"""Bad inputs: each raises the documented exception type with a message naming the argument."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from overlap import Runtime, Stage
from scheduler import (
    BALANCES,
    STRATEGIES,
    Cluster,
    ClusterError,
    CostModel,
    DeviceMesh,
    P,
    PlanError,
    PlanOptions,
    ReshardPlan,
    Schedule,
    Sharding,
    ShardingError,
    ShardingSpec,
    StepGraph,
    Transfer,
    estimate,
    lower_bound,
    plan_resharding,
)

C2 = Cluster.preset("p3.8xlarge", 2)
C3 = Cluster.preset("p3.8xlarge", 3)
H0 = C2.mesh([0])
H1 = C2.mesh([1])
SRC = Sharding(H0, P("gpu"))
DST = Sharding(H1, P("gpu"))


def _plan(**kw):
    """plan_resharding with defaults; strategy/balance/seed/budget go into PlanOptions
    (which is where a bad one is caught, naming it)."""
    args = dict(shape=(8, 4), dtype="int32", src=SRC, dst=DST, cluster=C2)
    args.update(kw)
    options = {k: args.pop(k) for k in ("strategy", "balance", "seed", "budget") if k in args}
    return plan_resharding(args.pop("shape"), args.pop("dtype"), args.pop("src"),
                           args.pop("dst"), args.pop("cluster"),
                           PlanOptions(**options) if options else None)


def test_error_hierarchy():
    for exc in (ShardingError, ClusterError, PlanError):
        assert issubclass(exc, ValueError)


# ---- specs ----------------------------------------------------------------------------------


def test_unknown_mesh_axis_in_spec():
    with pytest.raises(ShardingError, match=r"spec P\('tp'\).*'tp'.*\('host', 'gpu'\)"):
        Sharding(H0, P("tp"))


def test_unknown_mesh_axis_in_tuple_entry():
    with pytest.raises(ShardingError, match="'tp'"):
        Sharding(H0, P(("host", "tp")))


@pytest.mark.parametrize(
    "entries, axis",
    [(("host", "host"), "host"), ((("host", "gpu"), "gpu"), "gpu"), ((None, ("a", "a")), "a")],
)
def test_repeated_axis_in_spec(entries, axis):
    with pytest.raises(ShardingError, match=f"spec .*'{axis}'.*dims"):
        ShardingSpec(*entries)


def test_spec_longer_than_rank_device_regions():
    sh = Sharding(H0, P("host", None, "gpu"))
    with pytest.raises(ShardingError, match=r"spec P\('host', None, 'gpu'\).*3 entries.*rank 2"):
        sh.device_regions((4, 4))


@pytest.mark.parametrize("side", ["src", "dst"])
def test_spec_longer_than_rank_in_planner_names_side(side):
    long = Sharding(H0 if side == "src" else H1, P(None, None, "gpu"))
    kw = {side: long}
    with pytest.raises(ShardingError, match=f"{side}.*rank 2"):
        _plan(**kw)


def test_bad_spec_entry_type():
    with pytest.raises(TypeError, match="spec entry 1"):
        P(None, 3)
    with pytest.raises(TypeError, match="spec entry 0"):
        P("")


def test_sharding_bad_spec_argument():
    with pytest.raises(TypeError, match="spec"):
        Sharding(H0, "host")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mesh"):
        Sharding([[0, 1]], P())  # type: ignore[arg-type]


# ---- meshes and devices ---------------------------------------------------------------------


@pytest.mark.parametrize("side", ["src", "dst"])
def test_device_outside_cluster_names_side(side):
    outside = Sharding(C3.mesh([2]), P())  # devices 8..11; C2 has 0..7
    with pytest.raises(ClusterError, match=f"^{side}: .*device 8.*0..7"):
        _plan(**{side: outside})


def test_device_outside_cluster_lower_bound():
    with pytest.raises(ClusterError, match="dst"):
        lower_bound((4,), "int32", SRC, Sharding(C3.mesh([2]), P()), C2)


def test_repeated_device_in_mesh():
    with pytest.raises(ValueError, match="devices: device 3 appears more than once"):
        DeviceMesh([[0, 3], [3, 4]], ("a", "b"))


@pytest.mark.parametrize("bad", [1.0, "1", True, None, np.float32(1)])
def test_non_int_device_ids(bad):
    with pytest.raises(TypeError, match="devices"):
        DeviceMesh([0, bad], "x")


def test_negative_device_id():
    with pytest.raises(ValueError, match=r"devices.*-1"):
        DeviceMesh([0, -1], "x")


def test_ragged_or_empty_mesh():
    with pytest.raises(TypeError, match="devices"):
        DeviceMesh([[0, 1], [2]], ("a", "b"))
    with pytest.raises(ValueError, match="devices"):
        DeviceMesh([], ("a",))
    with pytest.raises(ValueError, match="devices"):
        DeviceMesh(5, ())


@pytest.mark.parametrize("names", [("x",), ("x", "y", "z"), ()])
def test_wrong_number_of_axis_names(names):
    with pytest.raises(ValueError, match=r"axis_names: .*2-d mesh"):
        DeviceMesh([[0, 1], [2, 3]], names)


def test_repeated_axis_name():
    with pytest.raises(ValueError, match=r"axis_names.*repeated"):
        DeviceMesh([[0, 1], [2, 3]], ("x", "x"))


def test_bad_axis_name_type():
    with pytest.raises(TypeError, match="axis_names"):
        DeviceMesh([[0, 1], [2, 3]], ("x", 1))


def test_cluster_mesh_bad_host():
    with pytest.raises(ValueError, match="hosts: 2"):
        C2.mesh([0, 2])


# ---- planner arguments ----------------------------------------------------------------------


def test_negative_dim_in_shape():
    with pytest.raises(ValueError, match=r"shape\[1\] = -1"):
        _plan(shape=(8, -1))


def test_non_int_dim_in_shape():
    with pytest.raises(TypeError, match=r"shape\[0\]"):
        _plan(shape=(2.5, 4))


def test_shape_not_a_sequence():
    with pytest.raises(TypeError, match="shape"):
        _plan(shape=8)


@pytest.mark.parametrize("dtype", ["float42", "not-a-dtype", object, "V0"])
def test_unknown_dtype(dtype):
    with pytest.raises(TypeError, match="dtype"):
        _plan(dtype=dtype)


def test_unknown_strategy():
    with pytest.raises(ValueError, match="strategy: unknown 'ring'"):
        _plan(strategy="ring")


def test_unknown_balance():
    with pytest.raises(ValueError, match="balance: unknown 'best'"):
        _plan(balance="best")


def test_bad_seed_and_budget():
    with pytest.raises(TypeError, match="seed"):
        _plan(seed=1.5)
    with pytest.raises(ValueError, match="budget"):
        _plan(budget=0)


def test_wrong_argument_types():
    with pytest.raises(TypeError, match="src"):
        _plan(src=H0)
    with pytest.raises(TypeError, match="dst"):
        _plan(dst=P())
    with pytest.raises(TypeError, match="cluster"):
        _plan(cluster="p3.8xlarge")
    with pytest.raises(TypeError, match="cluster"):
        CostModel("p3.8xlarge")  # type: ignore[arg-type]


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown cluster preset 'a100'"):
        Cluster.preset("a100", 2)


# ---- PlanError from check() on hand-broken plans ---------------------------------------------


@pytest.fixture
def plan() -> ReshardPlan:
    p = _plan(strategy="send_recv", balance="none")
    p.check()
    # 4 point-to-point transfers: device g of host 0 -> device 4 + g, rows [2g, 2g + 2).
    assert sorted((t.sender, t.receivers) for t in p.transfers) == [
        (0, (4,)), (1, (5,)), (2, (6,)), (3, (7,))
    ]
    return p


def _with(plan: ReshardPlan, transfers) -> ReshardPlan:
    return dataclasses.replace(plan, transfers=tuple(transfers))


def _first(plan: ReshardPlan, device: int) -> int:
    return next(i for i, t in enumerate(plan.transfers) if t.sender == device)


def test_check_dropped_transfer(plan):
    i = _first(plan, 2)
    broken = _with(plan, plan.transfers[:i] + plan.transfers[i + 1:])
    with pytest.raises(PlanError, match=r"device 6: .*not delivered exactly once.*missing"):
        broken.check()


def test_check_duplicated_transfer(plan):
    broken = _with(plan, (*plan.transfers, plan.transfers[0]))
    with pytest.raises(PlanError, match="more than once"):
        broken.check()


@pytest.mark.parametrize("new_sender", [1, 5])  # 1 holds other rows; 5 holds nothing yet
def test_check_sender_without_region(plan, new_sender):
    i = _first(plan, 0)
    ts = list(plan.transfers)
    ts[i] = dataclasses.replace(ts[i], sender=new_sender)
    with pytest.raises(PlanError, match=f"transfer {i} .*sender {new_sender} does not hold"):
        _with(plan, ts).check()


def test_check_sender_holds_after_receiving(plan):
    # Device 4 may forward rows [0:2) once it has received them: not an error by itself, but
    # the rows then reach device 5, which does not need them.
    i = _first(plan, 0)
    extra = Transfer(plan.transfers[i].region, 4, (5,), plan.transfers[i].nbytes)
    with pytest.raises(PlanError, match="receiver 5 does not need"):
        _with(plan, (*plan.transfers, extra)).check()


def test_check_wrong_nbytes(plan):
    ts = list(plan.transfers)
    ts[0] = dataclasses.replace(ts[0], nbytes=ts[0].nbytes + 1)
    with pytest.raises(PlanError, match=r"transfer 0 .*nbytes"):
        _with(plan, ts).check()


def test_check_region_outside_shape(plan):
    ts = list(plan.transfers)
    t = ts[0]
    a = t.region[0][0]
    ts[0] = dataclasses.replace(t, region=((a, 9), (0, 4)), nbytes=(9 - a) * 4 * 4)
    with pytest.raises(PlanError, match=r"transfer 0 .*outside shape \(8, 4\)"):
        _with(plan, ts).check()


def test_check_wrong_rank(plan):
    ts = list(plan.transfers)
    ts[0] = dataclasses.replace(ts[0], region=ts[0].region[:1])
    with pytest.raises(PlanError, match="rank"):
        _with(plan, ts).check()


def test_check_repeated_receiver(plan):
    ts = list(plan.transfers)
    r = ts[0].receivers[0]
    ts[0] = dataclasses.replace(ts[0], receivers=(r, r))
    with pytest.raises(PlanError, match="repeated receiver"):
        _with(plan, ts).check()


def test_check_sender_in_broadcast_receivers(plan):
    ts = list(plan.transfers)
    t = ts[0]
    ts[0] = dataclasses.replace(t, receivers=(*t.receivers, t.sender))
    with pytest.raises(PlanError, match="sender also listed"):
        _with(plan, ts).check()


def test_check_after_names_later_transfer(plan):
    ts = list(plan.transfers)
    ts[0] = dataclasses.replace(ts[0], after=(1,))
    with pytest.raises(PlanError, match="after"):
        _with(plan, ts).check()


def test_cost_model_rejects_bad_after(plan):
    ts = list(plan.transfers)
    ts[1] = dataclasses.replace(ts[1], after=(1,))
    with pytest.raises(ValueError, match="after"):
        estimate(_with(plan, ts), C2)


# ---- inputs that used to escape with internal errors -------------------------------------------

NON_NATIVE = np.dtype("f4").newbyteorder("S")  # the other byte order, whatever this machine's


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("balance", BALANCES)
def test_a_0d_tensor_across_hosts_is_planned(strategy, balance):
    src = Sharding(C2.mesh([0]), P())
    dst = Sharding(C2.mesh([1]), P())
    plan = plan_resharding((), "float32", src, dst, C2, PlanOptions(strategy, balance))
    plan.check()
    assert {r for t in plan.transfers for r in t.receivers} == set(dst.mesh.device_ids)
    assert all(t.region == () and t.nbytes == 4 for t in plan.transfers)


def test_a_0d_tensor_moves_across_hosts():
    src, dst = Sharding(C2.mesh([0]), P()), Sharding(C2.mesh([1]), P())
    plan = plan_resharding((), "float32", src, dst, C2)
    with Runtime(C2) as rt:
        out = rt.reshard_sync(plan, {d: np.array(3.5, np.float32) for d in src.mesh.device_ids})
    assert sorted(out) == sorted(dst.mesh.device_ids)
    assert all(a.shape == () and a.dtype == np.float32 and a == 3.5 for a in out.values())


@pytest.mark.parametrize("dtype, canonical", [
    ("bool", "bool"), ("int8", "int8"), ("uint16", "uint16"), ("float16", "float16"),
    ("=f4", "float32"), (np.dtype("f8").newbyteorder("="), "float64"),
    ("complex64", "complex64"),
])
def test_native_numeric_and_bool_dtypes_are_accepted_by_their_canonical_name(dtype, canonical):
    plan = plan_resharding((8,), dtype, SRC, DST, C2)
    assert plan.dtype == canonical
    ReshardPlan.from_json(plan.to_json()).check()


@pytest.mark.parametrize("dtype, match", [
    (NON_NATIVE, "endian, not this machine's byte order"),
    ([("a", "f4"), ("b", "i4")], "not a numeric or bool dtype"),
    ("U3", "not a numeric or bool dtype"),
    ("S2", "not a numeric or bool dtype"),
    ("datetime64[s]", "not a numeric or bool dtype"),
    (object, "not a numeric or bool dtype"),
])
def test_other_dtypes_are_refused_naming_the_argument(dtype, match):
    with pytest.raises(TypeError, match=rf"dtype: .*{match}"):
        plan_resharding((8,), dtype, SRC, DST, C2)


def test_device_ids_beyond_int64_are_refused():
    top = 2**63 - 1
    with pytest.raises(ValueError, match=rf"devices: device ids are in 0\.\.{top}, got {top + 1}"):
        DeviceMesh([2**63], "a")


@pytest.mark.parametrize("cls, what", [(ReshardPlan, "plan JSON"), (StepGraph, "step graph JSON"),
                                       (Schedule, "schedule JSON")])
@pytest.mark.parametrize("text, match", [
    ("{}", r"missing field '\w+'"), ("[]", "malformed"), ("{oops", "not valid JSON"),
])
def test_malformed_json_names_the_document_and_field(cls, what, text, match):
    with pytest.raises(ValueError, match=rf"{what}: {match}"):
        cls.from_json(text)


@pytest.mark.parametrize("timeout, exc", [("5", TypeError), (True, TypeError), (0, ValueError),
                                          (-1.0, ValueError), (float("nan"), ValueError),
                                          (float("inf"), ValueError)])
def test_runtime_timeout_is_finite_positive_seconds(timeout, exc):
    with pytest.raises(exc, match="timeout: expected"):
        Runtime(C2, timeout=timeout)


def test_microbatches_must_be_indexable():
    stage = Stage(H0, lambda ctx, x: 0.0, lambda ctx, dy: None)
    mbs = (np.zeros((2, 2)) for _ in range(2))
    with Runtime(C2) as rt, pytest.raises(TypeError, match="microbatches: expected a sequence"):
        rt.train_step_sync([stage], [], mbs, input_sharding=Sharding(H0, P()))
    assert rt.backend.streams() == []
