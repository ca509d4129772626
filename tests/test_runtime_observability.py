"""NVTX ranges, the measured trace, and `overlap trace report` on it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from toy import ToyMLP

import overlap.nvtx as nvtx_mod
from overlap import Runtime
from overlap.cli import main as overlap_main
from scheduler import Cluster, Timeline


@pytest.fixture
def toy():
    cluster = Cluster.preset("p3.8xlarge", 4)
    model = ToyMLP.build(cluster, hidden=8, batch=4)
    mbs = [np.random.default_rng(i).standard_normal((4, 8)) for i in range(3)]
    return cluster, model, mbs


def _step(rt, model, mbs, schedule="1f1b"):
    return rt.train_step_sync(model.stages(), model.boundaries(), mbs,
                              input_sharding=model.input_sharding(), schedule=schedule)


@pytest.fixture
def ranges() -> Iterator[tuple[list[tuple[str, str]], list[int]]]:
    """The NVTX ranges opened (message, category) and the handles closed, recorded."""
    opened: list[tuple[str, str]] = []
    closed: list[int] = []

    def start(message, category):
        opened.append((message, category))
        return len(opened)

    nvtx_mod.add_sink(start, closed.append)
    yield opened, closed
    nvtx_mod.remove_sink(start, closed.append)


def test_every_op_is_one_closed_nvtx_range(toy, ranges):
    cluster, model, mbs = toy
    opened, closed = ranges
    with Runtime(cluster) as rt:
        _step(rt, model, mbs)
        spans = rt.timeline().spans
    assert sorted(closed) == list(range(1, len(opened) + 1))  # every range ended, once
    compute = [m for m, c in opened if c == "compute"]
    comm = [m for m, c in opened if c == "comm"]
    # 9 devices run an F and a B per microbatch; every traced op has its range.
    assert len(compute) == 9 * len(mbs) * 2
    assert "F s1 mb2 on device 4" in compute
    assert any(m.startswith("reshard s0→s1 mb0") for m in comm)
    assert any(m.startswith("grad s3→s2 mb1") for m in comm)
    assert len(compute) + len(comm) == len(spans)
    assert all(c in ("compute", "comm", "wait", "step") for _, c in opened)
    assert [m for m, c in opened if c == "step"] == ["step 0"]


def test_nvtx_disable_makes_ranges_no_ops(monkeypatch):
    monkeypatch.setenv("NVTX_DISABLE", "1")
    start, end = nvtx_mod.nvtx_functions()
    assert start("x", "compute") is None
    end(None)


def test_measured_trace_round_trips_through_the_report(toy, tmp_path, capsys):
    cluster, model, mbs = toy
    with Runtime(cluster) as rt:
        _step(rt, model, mbs, "eager-1f1b")
        tl = rt.timeline()
        path = rt.write_trace(tmp_path / "step.json")
    data = json.loads(path.read_text())
    names = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert "device 4 (stage 1)" in names
    back = Timeline.from_chrome_trace(path)
    assert back.iteration_time == pytest.approx(tl.iteration_time, rel=1e-6)
    assert back.bubble_fraction == pytest.approx(tl.bubble_fraction, rel=1e-6)
    assert back.exposed_comm_fraction == pytest.approx(tl.exposed_comm_fraction, rel=1e-6,
                                                       abs=1e-12)
    assert back.transfer_wait_fraction == pytest.approx(tl.transfer_wait_fraction, rel=1e-6,
                                                        abs=1e-12)
    assert [back.peak_activations(s) for s in range(4)] == [3, 3, 3, 1]  # min(m, 2(p-s)-1)
    assert overlap_main(["trace", "report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "bubble" in out and "hidden" in out
    assert out.count("\n") >= 2 + 9  # a header and one line per device


def test_trace_report_on_a_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert overlap_main(["trace", "report", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: file: {bad} is not a trace")


def test_each_training_step_is_one_nvtx_range_and_categories_have_colours(ranges,
                                                                           monkeypatch):
    import nvtx as nvtx_module
    from fault_pipeline import CLUSTER, FaultyMLP

    import overlap
    import overlap.nvtx as ours

    opened, closed = ranges
    model = FaultyMLP()
    with overlap.Runtime(CLUSTER) as rt:
        model.step(rt)
        model.step(rt)
    steps = [(i + 1, m) for i, (m, c) in enumerate(opened) if c == "step"]
    assert [m for _, m in steps] == ["step 0", "step 1"]
    assert all(handle in closed for handle, _ in steps)  # each step's range is closed

    seen = {}
    monkeypatch.setattr(nvtx_module, "start_range", lambda **kw: seen.update(kw))
    monkeypatch.delenv("NVTX_DISABLE", raising=False)
    real_start, _ = ours.nvtx_functions()
    real_start("F s0 mb0 on device 0", "compute")
    assert seen["domain"] == "overlap" and seen["color"] == ours.COLORS["compute"]


# ---- capture windows ---------------------------------------------------------------------------


@pytest.mark.parametrize("steps, err, match", [
    ("3-5", ValueError, "profile_steps: expected 'A:B'"),
    ("5:3", ValueError, "profile_steps: expected consecutive steps"),
    (range(0, 6, 2), ValueError, "one capture is one contiguous window"),
    (range(-1, 2), ValueError, "profile_steps"),
    ([3, 4], TypeError, "profile_steps: expected a range"),
])
def test_a_bad_capture_window_is_refused_before_anything_starts(steps, err, match):
    import threading

    from fault_pipeline import CLUSTER

    before = threading.active_count()
    with pytest.raises(err, match=match):
        Runtime(CLUSTER, profile_steps=steps)
    assert threading.active_count() == before


def test_a_bad_capture_window_in_the_environment_is_named(monkeypatch):
    from fault_pipeline import CLUSTER

    monkeypatch.setenv("OVERLAP_PROFILE_STEPS", "three")
    with pytest.raises(ValueError, match="environment variable OVERLAP_PROFILE_STEPS"):
        Runtime(CLUSTER)
    with Runtime(CLUSTER, profile_steps="2") as rt:  # the argument wins over the environment
        assert rt.profile_steps == range(2, 3)


def test_a_capture_window_on_the_cpu_backend_still_opens_step_ranges(ranges):
    from fault_pipeline import CLUSTER, FaultyMLP

    opened, _ = ranges
    model = FaultyMLP()
    with Runtime(CLUSTER, profile_steps="0:1") as rt:
        model.step(rt)
        with rt.capture():
            model.step(rt)
    assert [m for m, c in opened if c == "step"] == ["step 0", "step 1"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_last_step_reports_the_step_from_the_runtimes_trace(toy, schedule):
    from overlap import StepStats
    from scheduler import make_schedule

    cluster, model, mbs = toy
    with Runtime(cluster) as rt:
        assert rt.last_step is None  # no step yet
        _step(rt, model, mbs, schedule)
        first = rt.last_step
        _step(rt, model, mbs, schedule)
        st = rt.last_step
        assert isinstance(st, StepStats) and st is rt.last_step  # made once per step
        tl = rt.timeline()
    assert (first.step, st.step) == (0, 1)
    assert 0 < st.iteration_time <= st.seconds
    assert st.bubble == pytest.approx(tl.bubble_fraction)
    assert st.exposed_comm == pytest.approx(tl.exposed_comm_fraction)
    assert st.transfer_wait == pytest.approx(tl.transfer_wait_fraction)
    assert 0 <= st.transfer_wait <= st.exposed_comm + 1e-12
    assert sorted(st.compute) == [0, 1, 2, 3] and all(t > 0 for t in st.compute.values())
    sched = make_schedule(schedule, 4, len(mbs))
    assert st.peak_activations == {s: sched.peak_activations(s) for s in range(4)}
    assert f"step 1: {st.seconds * 1e3:.1f} ms" in str(st)


def test_a_failed_step_leaves_no_last_step(toy):
    from overlap import Stage, StreamError

    cluster, model, mbs = toy
    stages = model.stages()

    def broken(ctx, x):
        raise RuntimeError("boom")

    stages[2] = Stage(stages[2].mesh, broken, stages[2].backward)
    with Runtime(cluster) as rt:
        _step(rt, model, mbs)
        assert rt.last_step is not None
        with pytest.raises(StreamError):
            rt.train_step_sync(stages, model.boundaries(), mbs,
                               input_sharding=model.input_sharding(), schedule="1f1b")
        assert rt.last_step is None


def test_step_hooks_get_every_successful_steps_figures_until_removed(toy):
    from overlap import Stage, StreamError

    cluster, model, mbs = toy
    seen: list[tuple[str, int]] = []
    with Runtime(cluster) as rt:
        first = rt.register_step_hook(lambda st: seen.append(("a", st.step)))
        rt.register_step_hook(lambda st: seen.append(("b", st.step)))
        _step(rt, model, mbs)
        assert seen == [("a", 0), ("b", 0)]
        stages = model.stages()
        stages[1] = Stage(stages[1].mesh, lambda ctx, x: 1 / 0, stages[1].backward)
        with pytest.raises(StreamError):
            rt.train_step_sync(stages, model.boundaries(), mbs,
                               input_sharding=model.input_sharding(), schedule="1f1b")
        assert seen == [("a", 0), ("b", 0)]  # a failed step calls no hook
        first.remove()
        first.remove()  # (twice: nothing)
        _step(rt, model, mbs)
        assert seen[-1] == ("b", 2) and ("a", 2) not in seen
        assert rt.last_step.step == 2


def test_a_step_hook_that_raises_makes_the_step_raise_and_a_bad_hook_is_named(toy):
    cluster, model, mbs = toy

    def logger(stats):
        raise OSError("the logging server is down")

    with Runtime(cluster) as rt:
        with pytest.raises(TypeError, match=r"hook: expected a callable"):
            rt.register_step_hook("print")
        rt.register_step_hook(logger)
        with pytest.raises(OSError, match="logging server is down"):
            _step(rt, model, mbs)
        assert rt.last_step is not None and rt.last_step.step == 0  # the step itself ran
