"""A step graph edited through its text form (``to_text`` / ``with_text``) either validates
and then runs to the reference numerics, or is refused by ``validate`` naming the op — never
a failure inside user code at run time (a backward before its own forward, a W before its I)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toy import ToyMLP, reference_step

from overlap import Runtime
from scheduler import Cluster, ProgramError, lower, make_schedule, validate

CLUSTER = Cluster.preset("p3.8xlarge", 4)


def _graph(name: str, m: int = 3):
    model = ToyMLP.build(CLUSTER, hidden=8, batch=8, seed=0)
    return model, lower(model.meshes, model.boundaries(), make_schedule(name, 4, m), CLUSTER)


def _swap(text: str, line: int, k: int) -> str:
    """Swap entries k and k+1 of the ``line``-th lane with two or more (their waits travel
    along)."""
    lines = text.splitlines()
    compute = [n for n, ln in enumerate(lines) if len(ln.split(":", 1)[1].split()) > 1]
    n = compute[line % len(compute)]
    head, body = lines[n].split(":", 1)
    toks = body.split()
    k %= len(toks) - 1
    toks[k], toks[k + 1] = toks[k + 1], toks[k]
    lines[n] = f"{head}: {' '.join(toks)}"
    return "\n".join(lines)


def test_a_last_stage_backward_moved_before_its_forward_is_refused_naming_it():
    _, graph = _graph("1f1b", 2)
    lines = graph.to_text().splitlines()
    n = next(i for i, ln in enumerate(lines) if ln.startswith("d12 compute:"))
    head, body = lines[n].split(":", 1)
    toks = body.split()  # 3F0<fwd2:0#0 3B0 ...
    toks[0], toks[1] = toks[1], toks[0]
    lines[n] = f"{head}: {' '.join(toks)}"
    with pytest.raises(ProgramError, match=r"lane d12 compute: B s3 mb0 \(3B0\) runs before "
                                           r"its F"):
        validate(graph.with_text("\n".join(lines)))


def test_a_w_before_its_i_is_refused():
    _, graph = _graph("zb-h1", 2)
    text = graph.to_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("d0 compute:"))
    toks = line.split(":", 1)[1].split()
    i = next(k for k, t in enumerate(toks) if t.startswith("0I0"))
    w = next(k for k, t in enumerate(toks) if t.startswith("0W0"))
    toks[i], toks[w] = toks[w], toks[i]
    edited = text.replace(line, "d0 compute: " + " ".join(toks))
    with pytest.raises(ProgramError, match=r"0W0\) runs before its I"):
        validate(graph.with_text(edited))


def test_devices_of_one_stage_running_its_computes_in_other_orders_are_refused():
    _, graph = _graph("gpipe", 2)
    text = graph.to_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("d12 compute:"))
    toks = line.split(":", 1)[1].split()
    toks[0], toks[1] = toks[1], toks[0]  # 3F0 <-> 3F1 on device 12 only
    with pytest.raises(ProgramError, match=r"stage 3: device 13 runs 3F0 where device 12 "
                                           r"runs 3F1"):
        validate(graph.with_text(text.replace(line, "d12 compute: " + " ".join(toks))))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["1f1b", "gpipe", "zb-h1"]), line=st.integers(0, 100),
       k=st.integers(0, 100))
def test_random_lane_edits_validate_and_run_right_or_are_refused(name, line, k):
    model, graph = _graph(name)
    edited = graph.with_text(_swap(graph.to_text(), line, k))
    try:
        validate(edited)
    except ProgramError:
        return  # refused before anything runs
    rng = np.random.default_rng(4)
    mbs = [rng.standard_normal((8, 8)) for _ in range(3)]
    stages = model.split_stages() if name == "zb-h1" else model.stages()
    with Runtime(CLUSTER, timeout=10) as rt:
        losses = rt.train_step_sync(stages, model.boundaries(), mbs,
                                    input_sharding=model.input_sharding(), graph=edited)
    ref_losses, ref_grads = reference_step(model.full_weights, mbs)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    model.check_against(model.full_weights, ref_grads)
