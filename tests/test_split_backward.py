"""The split backward (zb-h1's I and W) through the step graph, the CPU runtime and the
simulator; numerics against plain float64 numpy (examples/toy.py's reference)."""

from __future__ import annotations

import numpy as np
import pytest
from toy import ToyMLP, reference_step

from overlap import Runtime
from scheduler import Cluster, PlanOptions, lower, make_schedule, simulate

CLUSTER = Cluster.preset("p3.8xlarge", 4)


def _mbs(m):
    return [np.random.default_rng(i).standard_normal((4, 8)) for i in range(m)]


def assert_trains_like_numpy(model, mbs, losses):
    """The step's losses and every device's gradients against plain float64 numpy."""
    ref_losses, ref_grads = reference_step(model.full_weights, mbs)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-10)
    model.check_against(model.full_weights, ref_grads)


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b", "eager-1f1b"])
@pytest.mark.parametrize("m", [1, 3, 6])
def test_split_stages_train_like_plain_numpy(schedule, m):
    model = ToyMLP.build(CLUSTER, hidden=8, batch=4)
    mbs = _mbs(m)
    with Runtime(CLUSTER, timeout=20) as rt:
        losses = rt.train_step_sync(model.split_stages(), model.boundaries(), mbs,
                                    input_sharding=model.input_sharding(), schedule=schedule)
    assert_trains_like_numpy(model, mbs, losses)


def test_the_gradient_leaves_right_after_the_input_gradient_before_the_weight_gradient():
    model = ToyMLP.build(CLUSTER, hidden=8, batch=4)
    graph = lower(model.meshes, model.boundaries(), make_schedule("zb-h1", 4, 4), CLUSTER)
    ops = graph.ops
    for op in ops:
        body = op.body
        if getattr(body, "kind", None) == "I" and body.stage > 0:
            # The next op launched after this stage's I (on all its devices) is the
            # gradient's transfer on its channel — before any W.
            later = [o for o in ops[op.id + 1:] if not hasattr(o.body, "kind")
                     or o.body.stage != body.stage or o.body.kind != "I"]
            assert str(getattr(later[0].body, "channel", "")) == f"bwd{body.stage - 1}"
        if getattr(body, "kind", None) == "W":
            assert op.waits == ()  # a weight gradient waits for no transfer


def test_a_split_schedule_needs_split_stages():
    model = ToyMLP.build(CLUSTER, hidden=8, batch=4)
    with Runtime(CLUSTER) as rt, pytest.raises(ValueError, match="stages\\[0\\]: the schedule "
                                                                 "splits the backward"):
        rt.train_step_sync(model.stages(), model.boundaries(), _mbs(2),
                           input_sharding=model.input_sharding(), schedule="zb-h1")


def test_zb_h1_hides_the_gradient_transfer_under_the_weight_gradient_in_simulation():
    # A transfer about as long as a W: with zb-h1 the gradient travels while W computes.
    cluster = Cluster.preset("p3.8xlarge", 4)
    model = ToyMLP.build(cluster, hidden=8, batch=4)
    costs = {"F": 1e-3, "I": 1e-3, "W": 1e-3, "B": 2e-3}
    results = {}
    for name in ("1f1b", "zb-h1"):
        graph = lower(model.meshes, model.boundaries(), make_schedule(name, 4, 8), cluster,
                      PlanOptions(strategy="broadcast"))
        results[name] = simulate(graph, cluster, costs)
    assert results["zb-h1"].iteration_time < results["1f1b"].iteration_time
    assert results["zb-h1"].bubble_fraction < results["1f1b"].bubble_fraction


def test_schedule_auto_on_the_runtime_chooses_once_and_trains_like_numpy(monkeypatch):
    import overlap.step_graph_cache as cache_module

    calls = []
    real = cache_module.auto_schedule
    monkeypatch.setattr(cache_module, "auto_schedule",
                        lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    model = ToyMLP.build(CLUSTER, hidden=8, batch=4)
    mbs = _mbs(4)
    times = {"F": 1e-3, "B": 2e-3, "I": 1e-3, "W": 1e-3}
    with Runtime(CLUSTER, timeout=20, compute_time=lambda s, k: times[k]) as rt:
        for _ in range(2):
            model.zero_grad()
            losses = rt.train_step_sync(model.split_stages(), model.boundaries(), mbs,
                                        input_sharding=model.input_sharding(), schedule="auto")
        ran = rt.timeline()
    assert len(calls) == 1  # chosen once, then reused
    # The step ran the graph auto chose: each device's computes in its compute lane's order.
    graph = calls[0].graph
    for d in graph.devices:
        order = [s.op for s in sorted(ran.spans_of(d), key=lambda s: s.start)
                 if s.stream == "compute"]
        assert order == list(graph.program(d)["compute"]), d
    assert_trains_like_numpy(model, mbs, losses)


def test_schedule_auto_without_costs_uses_the_last_steps_or_says_what_it_needs():
    model = ToyMLP.build(CLUSTER, hidden=8, batch=4)
    mbs = _mbs(3)
    with Runtime(CLUSTER, timeout=20) as rt:
        with pytest.raises(ValueError, match="schedule: 'auto' chooses from compute costs"):
            rt.train_step_sync(model.stages(), model.boundaries(), mbs,
                               input_sharding=model.input_sharding(), schedule="auto")
        rt.train_step_sync(model.stages(), model.boundaries(), mbs,
                           input_sharding=model.input_sharding(), schedule="1f1b")
        model.zero_grad()
        losses = rt.train_step_sync(model.stages(), model.boundaries(), mbs,
                                    input_sharding=model.input_sharding(), schedule="auto")
        kinds = {s.kind for s in rt.timeline().spans if s.stream == "compute"}
    assert kinds == {"F", "B"}  # no backward_weight: the backward stays whole
    assert_trains_like_numpy(model, mbs, losses)


def test_schedule_auto_on_the_runtime_keeps_within_max_activations():
    model = ToyMLP.build(CLUSTER, hidden=8, batch=4)
    mbs = _mbs(6)
    times = {"F": 1e-3, "B": 2e-3, "I": 1e-3, "W": 1e-3}
    with Runtime(CLUSTER, timeout=20, compute_time=lambda s, k: times[k]) as rt:
        losses = rt.train_step_sync(model.split_stages(), model.boundaries(), mbs,
                                    input_sharding=model.input_sharding(), schedule="auto",
                                    max_activations=2)
        tl = rt.timeline()
    assert max(tl.peak_activations(s) for s in range(4)) <= 2
    assert_trains_like_numpy(model, mbs, losses)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"schedule": "1f1b", "max_activations": 2}, ValueError, "max_activations: only schedule"),
    ({"schedule": "auto", "max_activations": 0}, ValueError, "stage 0 allows 0"),
    ({"schedule": "auto", "max_activations": [2, 2]}, ValueError, "2 caps for 4 stages"),
    ({"schedule": "auto", "max_activations": 2.5}, TypeError, "max_activations: expected"),
])
def test_a_bad_max_activations_is_named_before_any_work(kwargs, exc, match):
    model = ToyMLP.build(CLUSTER, hidden=8, batch=4)
    ran = []
    stages = [type(st)(st.mesh, lambda ctx, x, f=st.forward: ran.append(1) or f(ctx, x),
                       st.backward, st.backward_weight) for st in model.split_stages()]
    with Runtime(CLUSTER, timeout=20, compute_time=lambda s, k: 1e-3) as rt, \
            pytest.raises(exc, match=match):
        rt.train_step_sync(stages, model.boundaries(), _mbs(3),
                           input_sharding=model.input_sharding(), **kwargs)
    assert ran == []
