"""Pipeline training on the CPU runtime: numerics, reuse, faults and bad arguments.

The toy model (``toy_mlp.ToyMLP``) is a 4-stage tanh MLP on meshes of different shapes
(one device; 2 devices column-parallel; 2×2 data-parallel × replicated; 2 devices
row-parallel), so every boundary is a real multicast with a layout change. Expected values come
from ``toy_mlp.reference`` — plain float64 numpy — never from the runtime.
"""

from __future__ import annotations

import gc
import re
import threading
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_mlp import CLUSTER, ToyMLP, reference, reference_inputs, split

from overlap.errors import CollectiveTimeout, OverlapRuntimeError, StreamError
from overlap.pipeline import Stage
from overlap.runtime import Runtime
from scheduler import (
    SCHEDULES,
    Boundary,
    DeviceMesh,
    P,
    PlanOptions,
    Sharding,
    lower,
    make_schedule,
)

TOL = 1e-10
# Generous: a deadlock fails the test after this long instead of hanging it.
TIMEOUT = 20.0


def _step(rt: Runtime, toy: ToyMLP, mbs, **kw) -> list[float]:
    return rt.train_step_sync(toy.stages, toy.boundaries, mbs,
                              input_sharding=toy.input_sharding, **kw)


def _order(schedule: str, p: int, m: int, s: int) -> list[tuple[str, int]]:
    """Stage s's documented compute order: W(s) forwards, then B/F alternating, then Bs."""
    w = {"gpipe": m, "1f1b": min(m, p - s), "eager-1f1b": min(m, 2 * (p - s) - 1)}[schedule]
    out = [("F", i) for i in range(w)]
    nxt = w
    for b in range(m):
        out.append(("B", b))
        if nxt < m:
            out.append(("F", nxt))
            nxt += 1
    return out


def _check(toy: ToyMLP, losses, mbs, *, steps: int = 1, schedule: str | None = None) -> None:
    """Losses, every device's gradient block, the calls made and the stage-2 inputs seen."""
    ref_losses, ref_grads = reference(toy.weights, mbs)
    assert len(losses) == len(mbs)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=TOL)
    expected = toy.expected_grads(ref_grads)
    assert sorted(toy.grads) == sorted(expected)
    for (s, d), want in expected.items():
        np.testing.assert_allclose(toy.grads[(s, d)], steps * want, rtol=0, atol=TOL,
                                   err_msg=f"gradient of stage {s} on device {d}")
    assert toy.bad_ctx == []
    # Every device ran F and B of every microbatch exactly once per step.
    want_calls = Counter({(s, d, i, ph): steps
                          for s, mesh in enumerate(toy.meshes) for d in mesh.device_ids
                          for i in range(len(mbs)) for ph in "FB"})
    assert Counter(toy.calls) == want_calls
    if schedule is not None and steps == 1:
        for s, mesh in enumerate(toy.meshes):
            want = _order(schedule, len(toy.meshes), len(mbs), s)
            for d in mesh.device_ids:
                got = [(ph, i) for (s_, d_, i, ph) in toy.calls if d_ == d]
                assert got == want, f"device {d} (stage {s}) ran {got}"
    # Stage 2 all-gathers its input rows over "a": the full stage-2 input, in row order.
    for d in toy.meshes[2].device_ids:
        for i, x in enumerate(mbs):
            np.testing.assert_allclose(toy.seen_inputs[(d, i)],
                                       reference_inputs(toy.weights, x, 2), rtol=0, atol=TOL)


def _overlap_threads(exclude: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith("overlap-") and t not in exclude and t.is_alive())


# ---- numerics ----------------------------------------------------------------------------

NUMERIC_CASES = [(sched, strat) for sched in SCHEDULES for strat in ("broadcast", "send_recv")]
NUMERIC_CASES.append(("eager-1f1b", "local_allgather"))


@pytest.mark.parametrize("m", [1, 3, 6])
@pytest.mark.parametrize(("schedule", "strategy"), NUMERIC_CASES)
def test_losses_and_gradients_match_reference(schedule, strategy, m):
    toy = ToyMLP()
    mbs = toy.microbatches(m, seed=m)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = _step(rt, toy, mbs, schedule=schedule, options=PlanOptions(strategy=strategy))
    _check(toy, losses, mbs, schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_even_sizes_and_other_widths(schedule):
    toy = ToyMLP(batch=4, dims=(3, 4, 8, 2, 5), seed=7)
    mbs = toy.microbatches(5, seed=3)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = _step(rt, toy, mbs, schedule=schedule, options=PlanOptions(strategy="send_recv"))
    _check(toy, losses, mbs, schedule=schedule)


async def test_train_step_awaited():
    toy = ToyMLP(seed=3)
    mbs = toy.microbatches(4, seed=5)
    async with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = await rt.train_step(toy.stages, toy.boundaries, mbs,
                                     input_sharding=toy.input_sharding, schedule="1f1b")
        _check(toy, losses, mbs, schedule="1f1b")
        toy.reset()
        losses = await rt.train_step(toy.stages, toy.boundaries, mbs,
                                     input_sharding=toy.input_sharding, schedule="eager-1f1b",
                                     options=PlanOptions(strategy="send_recv"))
    _check(toy, losses, mbs, schedule="eager-1f1b")


def test_sharded_input_on_data_parallel_first_stage():
    """Stage 0 holds row blocks of each microbatch (5 rows over 2 devices: 3 + 2)."""
    rng = np.random.default_rng(11)
    w = [rng.standard_normal((4, 6)), rng.standard_normal((6, 3))]
    m0 = DeviceMesh([[0, 1]], ("host", "gpu"))
    m1 = DeviceMesh([[4]], ("host", "gpu"))
    grads: dict[int, np.ndarray] = {}

    def f0(ctx, x):
        ctx.saved.update(x=x, y=np.tanh(x @ w[0]))
        return ctx.saved["y"]

    def b0(ctx, dy):
        x, y = ctx.saved["x"], ctx.saved["y"]
        g = ctx.all_reduce(x.T @ (dy * (1 - y * y)), axis="gpu")
        grads[ctx.device] = grads.get(ctx.device, 0.0) + g

    def f1(ctx, x):
        ctx.saved.update(x=x, y=np.tanh(x @ w[1]))
        return 0.5 * float(np.sum(ctx.saved["y"] ** 2))

    def b1(ctx, dy):
        x, y = ctx.saved["x"], ctx.saved["y"]
        dz = y * (1 - y * y)
        grads[ctx.device] = grads.get(ctx.device, 0.0) + x.T @ dz
        return dz @ w[1].T

    stages = [Stage(m0, f0, b0), Stage(m1, f1, b1)]
    bounds = [Boundary((5, 6), "float64", Sharding(m0, P("gpu")), Sharding(m1, P()))]
    mbs = [rng.standard_normal((5, 4)) for _ in range(3)]
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = rt.train_step_sync(stages, bounds, mbs, input_sharding=Sharding(m0, P("gpu")),
                                    schedule="1f1b")
    ref_losses, ref_grads = reference(w, mbs)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=TOL)
    for d, want in ((0, ref_grads[0]), (1, ref_grads[0]), (4, ref_grads[1])):
        np.testing.assert_allclose(grads[d], want, rtol=0, atol=TOL)


def test_stage_inputs_are_per_device_copies():
    """Each device owns its input shard, as on real devices: a stage function that updates its
    input in place changes neither another device's input nor the caller's microbatches."""
    m0 = DeviceMesh([[0, 1]], ("host", "gpu"))  # stage 0 replicated on two devices
    m1 = DeviceMesh([[4]], ("host", "gpu"))
    seen: dict[tuple[int, int], np.ndarray] = {}

    def f0(ctx, x):
        x += 1.0  # in place, on this device's own input
        seen[(ctx.device, ctx.microbatch)] = x.copy()
        return x

    stages = [Stage(m0, f0, lambda ctx, dy: None),
              Stage(m1, lambda ctx, x: float(np.sum(x)), lambda ctx, dy: np.zeros((2, 3)))]
    bounds = [Boundary((2, 3), "float64", Sharding(m0, P()), Sharding(m1, P()))]
    mbs = [np.arange(6.0).reshape(2, 3), np.full((2, 3), -1.0)]
    originals = [mb.copy() for mb in mbs]
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        for _ in range(2):
            losses = rt.train_step_sync(stages, bounds, mbs, input_sharding=Sharding(m0, P()),
                                        schedule="gpipe")
            for i, mb in enumerate(originals):
                for d in (0, 1):
                    np.testing.assert_array_equal(seen[(d, i)], mb + 1.0,
                                                  err_msg=f"device {d} mb {i}")
            assert losses == [float(np.sum(mb + 1.0)) for mb in originals]
    for mb, orig in zip(mbs, originals):
        np.testing.assert_array_equal(mb, orig)


# ---- reuse and the program cache ---------------------------------------------------------


def test_two_steps_on_one_runtime_are_identical():
    toy = ToyMLP(seed=1)
    mbs = toy.microbatches(4, seed=2)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        first = _step(rt, toy, mbs)
        second = _step(rt, toy, mbs)
    assert first == second  # same weights, same inputs: bit-identical
    _check(toy, second, mbs, steps=2)  # the gradients accumulated over both steps


def test_program_cache_across_configurations():
    """Alternating schedules, microbatch counts, strategies and models on one runtime."""
    a, b = ToyMLP(seed=1), ToyMLP(seed=2)  # same layouts, different weights and functions
    plan = [(a, "gpipe", 3, "broadcast"), (a, "1f1b", 5, "broadcast"),
            (b, "gpipe", 3, "broadcast"), (a, "gpipe", 3, "send_recv"),
            (b, "eager-1f1b", 1, "broadcast"), (a, "gpipe", 3, "broadcast"),
            (b, "gpipe", 3, "broadcast"), (a, "1f1b", 5, "broadcast")]
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        for k, (toy, schedule, m, strategy) in enumerate(plan):
            toy.reset()
            mbs = toy.microbatches(m, seed=k)
            losses = _step(rt, toy, mbs, schedule=schedule, options=PlanOptions(strategy=strategy))
            _check(toy, losses, mbs, schedule=schedule)


def test_fresh_single_stage_pipelines_on_one_runtime():
    """New Stage objects every step, alternating between two meshes (p = 1, no boundaries).

    A graph cache keyed by ``id(stage)`` can hand a new stage (which may reuse a freed
    stage's id) the graph lowered for another mesh.
    """
    meshes = [DeviceMesh([[0]], ("host", "gpu")), DeviceMesh([[4]], ("host", "gpu"))]
    ran: list[tuple[int, int]] = []

    def fwd(ctx, x):
        ran.append((ctx.device, ctx.microbatch))
        return 0.5 * float(np.sum(x * x))

    mbs = [np.full((2, 3), 1.0), np.full((2, 3), 2.0)]
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        for k in range(60):
            mesh = meshes[k % 2]
            stage = Stage(mesh, fwd, lambda ctx, dy: None)
            ran.clear()
            try:
                losses = rt.train_step_sync([stage], [], mbs,
                                            input_sharding=Sharding(mesh, P()), schedule="gpipe")
            except OverlapRuntimeError as exc:
                pytest.fail(f"step {k} (stage on devices {mesh.device_ids}): {exc!r}")
            assert losses == [3.0, 12.0], f"step {k}"
            assert sorted(ran) == [(mesh.device_ids[0], 0), (mesh.device_ids[0], 1)], \
                f"step {k}: stage on mesh {mesh.device_ids} ran on {ran}"
            del stage
            gc.collect()


# ---- faults ------------------------------------------------------------------------------


class InjectedFault(Exception):
    """Raised by a stage function on purpose."""


def _inject(toy: ToyMLP, target: tuple[int, int, str, int]) -> list[InjectedFault]:
    raised: list[InjectedFault] = []

    def hook(ctx):
        if (ctx.stage, ctx.microbatch, ctx.phase, ctx.device) == target:
            exc = InjectedFault("boom")
            raised.append(exc)
            raise exc

    toy.hook = hook
    return raised


def _assert_names(msg: str, stage: int, mb: int, phase: str | None, device: int) -> None:
    assert re.search(rf"\b(s|stage ){stage}\b", msg), msg
    assert re.search(rf"\bmb ?{mb}\b", msg), msg
    assert re.search(rf"\bdevice {device}\b", msg), msg
    if phase is not None:
        assert re.search(rf"\b{phase}\b", msg), msg


@settings(max_examples=25, deadline=None)
@given(schedule=st.sampled_from(SCHEDULES), m=st.integers(1, 4), data=st.data())
def test_fault_aborts_step_and_runtime_recovers(schedule, m, data):
    toy = ToyMLP()
    stage = data.draw(st.integers(0, 3), label="stage")
    mb = data.draw(st.integers(0, m - 1), label="microbatch")
    phase = data.draw(st.sampled_from("FB"), label="phase")
    ids = toy.meshes[stage].device_ids
    device = ids[data.draw(st.integers(0, len(ids) - 1), label="device index")]
    raised = _inject(toy, (stage, mb, phase, device))
    mbs = toy.microbatches(m)
    before = set(threading.enumerate())
    rt = Runtime(CLUSTER, timeout=30)
    try:
        with pytest.raises(OverlapRuntimeError) as info:
            _step(rt, toy, mbs, schedule=schedule)
        err = info.value
        assert not isinstance(err, CollectiveTimeout), err  # aborted, not timed out
        assert isinstance(err, StreamError), repr(err)
        assert len(raised) == 1 and err.__cause__ is raised[0]
        assert err.device == device
        _assert_names(str(err), stage, mb, phase, device)
        # The same runtime (and its cached graph) runs a clean step.
        toy.hook = None
        toy.reset()
        losses = _step(rt, toy, mbs, schedule=schedule)
        _check(toy, losses, mbs, schedule=schedule)
    finally:
        rt.close()
    assert _overlap_threads(before) == []


async def test_fault_through_await_then_clean_step():
    toy = ToyMLP()
    raised = _inject(toy, (1, 1, "B", 5))
    mbs = toy.microbatches(3)
    async with Runtime(CLUSTER, timeout=30) as rt:
        with pytest.raises(StreamError) as info:
            await rt.train_step(toy.stages, toy.boundaries, mbs,
                                input_sharding=toy.input_sharding, schedule="eager-1f1b")
        assert info.value.__cause__ is raised[0]
        _assert_names(str(info.value), 1, 1, "B", 5)
        toy.hook = None
        toy.reset()
        losses = await rt.train_step(toy.stages, toy.boundaries, mbs,
                                     input_sharding=toy.input_sharding, schedule="eager-1f1b")
    _check(toy, losses, mbs, schedule="eager-1f1b")


def test_closed_runtime_refuses_steps():
    toy = ToyMLP()
    rt = Runtime(CLUSTER, timeout=TIMEOUT)
    rt.close()
    rt.close()  # idempotent
    with pytest.raises(OverlapRuntimeError, match="closed"):
        _step(rt, toy, toy.microbatches(1))


# ---- wrong shapes from stage functions ----------------------------------------------------

B6, D = 6, (5, 7, 6, 9, 4)  # ToyMLP's default sizes


@pytest.mark.parametrize(("stage", "mb", "phase", "device", "want"), [
    (0, 1, "F", 0, (B6, D[1])),  # replicated output
    (1, 2, "F", 5, (B6, len(range(D[2])[split(D[2], 2, 1)]))),  # column block 1: 3 of 6
    (2, 0, "F", 9, (len(range(B6)[split(B6, 2, 0)]), D[3])),  # row block 0 (a=0)
    (1, 0, "B", 4, (B6, D[1])),  # input gradient, replicated layout
    (2, 2, "B", 11, (len(range(B6)[split(B6, 2, 1)]), D[2])),  # row block 1 (a=1)
    (3, 1, "B", 13, (B6, len(range(D[3])[split(D[3], 2, 1)]))),  # column block 1: 4 of 9
])
def test_wrong_output_shape_is_named(stage, mb, phase, device, want):
    toy = ToyMLP()
    toy.shape_bug = (stage, mb, phase, device)
    mbs = toy.microbatches(3)
    with Runtime(CLUSTER, timeout=30) as rt:
        with pytest.raises(Exception) as info:
            _step(rt, toy, mbs, schedule="1f1b")
        err = info.value
        assert not isinstance(err, CollectiveTimeout), err
        msg = f"{err} {err.__cause__}"
        _assert_names(msg, stage, mb, None, device)
        assert str(want) in msg, msg
        toy.shape_bug = None
        toy.reset()
        losses = _step(rt, toy, mbs, schedule="1f1b")
    _check(toy, losses, mbs, schedule="1f1b")


# ---- bad arguments: rejected before anything is launched ----------------------------------


def _bad(toy: ToyMLP, mbs: list[np.ndarray], what: str) -> tuple[tuple, dict]:
    args = [toy.stages, toy.boundaries, mbs]
    kw: dict = {"input_sharding": toy.input_sharding}
    if what == "empty stages":
        args[0], args[1] = [], []
    elif what == "input sharding on stage 1's mesh":
        kw["input_sharding"] = Sharding(toy.meshes[1], P())
    elif what == "microbatches of different shapes":
        args[2] = [mbs[0], mbs[1][:4]]
    elif what == "list microbatch":
        args[2] = [mbs[0], mbs[1].tolist()]
    elif what == "no microbatches":
        args[2] = []
    elif what == "unknown schedule":
        kw["schedule"] = "zero-bubble"
    elif what == "options not PlanOptions":
        kw["options"] = {"strategy": "send_recv"}
    elif what == "schedule of another size":
        kw["schedule"] = make_schedule("1f1b", 4, len(mbs) + 1)
    elif what == "graph of another size":
        kw["graph"] = lower(toy.meshes, toy.boundaries, make_schedule("1f1b", 4, len(mbs) + 1),
                            CLUSTER)
    elif what == "graph and schedule":
        kw["graph"] = lower(toy.meshes, toy.boundaries, make_schedule("1f1b", 4, len(mbs)),
                            CLUSTER)
        kw["schedule"] = "1f1b"
    elif what == "graph of other boundaries":
        b = toy.boundaries[0]
        other = [Boundary(b.shape, b.dtype, b.producer, Sharding(b.consumer.mesh, P(None, "gpu"))),
                 *toy.boundaries[1:]]
        kw["graph"] = lower(toy.meshes, other, make_schedule("1f1b", 4, len(mbs)), CLUSTER)
    elif what == "too few boundaries":
        args[1] = toy.boundaries[:2]
    elif what == "too many boundaries":
        args[1] = [*toy.boundaries, toy.boundaries[-1]]
    elif what == "not a Stage":
        args[0] = [*toy.stages[:2], (toy.meshes[2], toy.stages[2].forward), toy.stages[3]]
    elif what == "boundary on the wrong mesh":
        b = toy.boundaries[1]
        args[1] = [toy.boundaries[0], Boundary(b.shape, b.dtype, b.producer,
                                               Sharding(toy.meshes[3], P())), toy.boundaries[2]]
    return tuple(args), kw


BAD = [
    ("empty stages", ValueError, r"stages"),
    ("input sharding on stage 1's mesh", ValueError, r"input_sharding"),
    ("microbatches of different shapes", ValueError, r"microbatches\[1\]"),
    ("list microbatch", TypeError, r"microbatches\[1\]"),
    ("no microbatches", ValueError, r"microbatches"),
    ("unknown schedule", ValueError, r"zero-bubble"),
    ("options not PlanOptions", TypeError, r"options"),
    ("schedule of another size", ValueError, r"schedule: built for 4 stages × 3"),
    ("graph of another size", ValueError, r"graph: lowered for 3 microbatches"),
    ("graph and schedule", ValueError, r"graph: give a step graph, or a schedule"),
    ("graph of other boundaries", ValueError, r"graph: its plan for fwd0"),
    ("too few boundaries", ValueError, r"boundaries"),
    ("too many boundaries", ValueError, r"boundaries"),
    ("not a Stage", TypeError, r"stages\[2\]"),
    ("boundary on the wrong mesh", ValueError, r"boundaries\[1\]"),
]


@pytest.mark.parametrize(("what", "exc", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_rejected_before_any_work(what, exc, match):
    toy = ToyMLP()
    mbs = toy.microbatches(2)
    args, kw = _bad(toy, mbs, what)
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        with pytest.raises(exc, match=match):
            rt.train_step_sync(*args, **kw)
        assert rt.backend.streams() == []
        assert toy.calls == []
        # Nothing half-done: the runtime then runs a valid step.
        losses = _step(rt, toy, mbs)
    _check(toy, losses, mbs)


# ---- where and how often planning happens ---------------------------------------------------


def test_lowering_runs_off_the_event_loop_and_plans_are_reused(monkeypatch):
    import threading

    import overlap.step_graph_cache as cache_module

    threads: list[threading.Thread] = []
    real_lower = cache_module.lower

    def recording_lower(*args, **kwargs):
        threads.append(threading.current_thread())
        return real_lower(*args, **kwargs)

    monkeypatch.setattr(cache_module, "lower", recording_lower)
    toy = ToyMLP()

    async def steps(rt: Runtime) -> threading.Thread:
        loop_thread = threading.current_thread()
        for m in (2, 3, 2):  # a new microbatch count lowers anew, the same one does not
            toy.reset()
            mbs = toy.microbatches(m)
            losses = await rt.train_step(toy.stages, toy.boundaries, mbs,
                                         input_sharding=toy.input_sharding)
            _check(toy, losses, mbs)
        return loop_thread

    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        loop_thread = rt.run_sync(steps(rt))
        assert len(threads) == 2 and loop_thread not in threads
        assert len(rt.plans) == 2 * (len(toy.boundaries))  # each channel planned once
        rt.train_step_sync(toy.stages, toy.boundaries, toy.microbatches(2),
                           input_sharding=toy.input_sharding, options=PlanOptions("send_recv"))
        assert len(threads) == 3 and len(rt.plans) == 4 * len(toy.boundaries)


def _pass_through_pipeline(keep: list, saved: list) -> tuple[list[Stage], list[Boundary]]:
    """4 one-device stages whose F copies its input and B its gradient (nothing aliases the
    runtime's buffers); each stage's F saves a fresh array in ``ctx.saved`` and never pops
    it. ``keep`` gets (stage, weakref) of every boundary buffer a stage receives, ``saved``
    (stage, weakref) of every saved array."""
    import weakref

    meshes = [DeviceMesh([d], "a") for d in range(4)]
    shape = (8, 4)

    def fwd(s):
        def f(ctx, x):
            if x is not None and s > 0:
                keep.append((s, weakref.ref(x)))
            ctx.saved["big"] = big = np.ones(shape)
            saved.append((s, weakref.ref(big)))
            return float(x.sum()) if s == 3 else x * 1.0
        return f

    def bwd(s):
        def b(ctx, dy):
            if dy is not None:
                keep.append((s, weakref.ref(dy)))
            return None if s == 0 else (np.ones(shape) if dy is None else dy * 1.0)
        return b

    stages = [Stage(m, fwd(s), bwd(s)) for s, m in enumerate(meshes)]
    bounds = [Boundary(shape, "float64", Sharding(meshes[s], P()), Sharding(meshes[s + 1], P()))
              for s in range(3)]
    return stages, bounds


@pytest.mark.parametrize("schedule", ["1f1b", "eager-1f1b"])
def test_a_step_frees_each_boundary_buffer_after_its_last_user(schedule):
    # 1F1B exists to bound activation memory: stage s holds at most min(m, warm-up + 1)
    # microbatches. The runtime once kept every received activation and gradient, and every
    # ctx.saved dict, until the step ended — all m of them — whatever the schedule.
    keep: list = []
    saved: list = []
    stages, bounds = _pass_through_pipeline(keep, saved)
    m, p = 12, 4
    peak = {s: 0 for s in range(4)}
    peak_saved = {s: 0 for s in range(4)}
    orig = [st.forward for st in stages]

    def watching(s):
        def f(ctx, x):
            # At each forward: how many of this stage's earlier buffers are still alive.
            peak[s] = max(peak[s], sum(1 for t, r in keep if t == s and r() is not None))
            peak_saved[s] = max(peak_saved[s],
                                sum(1 for t, r in saved if t == s and r() is not None))
            return orig[s](ctx, x)
        return f

    stages = [Stage(st.mesh, watching(s), st.backward) for s, st in enumerate(stages)]
    mbs = [np.full((8, 4), float(i)) for i in range(m)]
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        rt.train_step_sync(stages, bounds, mbs, input_sharding=Sharding(stages[0].mesh, P()),
                           schedule=schedule)
    sched = make_schedule(schedule, p, m)
    for s in range(p):
        in_flight = sched.peak_activations(s)  # microbatches between their F and their B
        assert peak_saved[s] <= in_flight, (s, peak_saved, in_flight)
        # Activations in flight, plus the gradients landed or landing for them.
        assert peak[s] <= 2 * in_flight, (s, peak, in_flight)
    assert max(peak_saved.values()) < m and max(peak.values()) < m
    assert all(r() is None for _, r in keep + saved)  # nothing outlives the step


def test_a_transfer_span_starts_when_its_last_participant_arrived():
    # A receiver's comm stream reaches the transfer long before its producer computed the
    # data: that wait is a bubble, not communication. Every participant's span of one
    # transfer starts at the same time, the latest arrival.
    keep: list = []
    stages, bounds = _pass_through_pipeline(keep, [])
    with Runtime(CLUSTER, timeout=TIMEOUT,
                 compute_time=lambda s, kind: 2e-3 if kind == "F" else 4e-3) as rt:
        rt.train_step_sync(stages, bounds, [np.ones((8, 4))] * 4,
                           input_sharding=Sharding(stages[0].mesh, P()), schedule="1f1b")
        tl = rt.timeline()
    starts: dict[int, set[float]] = {}
    for span in tl.spans:
        if span.stream != "compute":  # a transfer's part on one of its devices
            starts.setdefault(span.op, set()).add(span.start)
    assert len(starts) == 2 * 3 * 4  # every boundary, both ways, every microbatch
    assert all(len(s) == 1 for s in starts.values()), starts


def test_a_schedule_by_name_is_made_once_per_size(monkeypatch):
    # Making and checking a schedule is ~0.06 s at 64 stages × 256 microbatches: a step by
    # name must not pay it every call.
    import overlap.step_graph_cache as cache_module
    from overlap.runtime import resolve_schedule

    made = []
    real = cache_module.make_schedule
    monkeypatch.setattr(cache_module, "make_schedule",
                        lambda *a, **k: made.append(a) or real(*a, **k))
    toy = ToyMLP()
    with Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        # Sizes no other test makes (the schedules are kept for the whole process).
        for _ in range(3):
            _step(rt, toy, toy.microbatches(11), schedule="1f1b")
        _step(rt, toy, toy.microbatches(13), schedule="1f1b")
    assert made == [("1f1b", 4, 11), ("1f1b", 4, 13)]
    with pytest.raises(ValueError, match="unknown schedule"):
        resolve_schedule("nope", 4, 3)
