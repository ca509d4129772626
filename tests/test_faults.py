"""Faults and hangs: every planted fault of a 3-stage pipeline is named, within its bound, no
thread outlives close(), and the next step gives the reference result."""

from __future__ import annotations

import _thread
import dataclasses
import gc
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fault_pipeline import CLUSTER, MICROBATCHES, Fault, FaultyMLP, InjectedFault, every_fault

import overlap
from overlap import DeviceThreadLost, StageTimeout, StreamError
from scheduler import StepGraph, lower, make_schedule
from scheduler.errors import PlanError

TIMEOUT = 1.0
# A hang is named within the timeout plus this.
HANG_SLACK_S = 1.0
# A raise or a bad return value is named without waiting for any timeout: with this one, an
# error that took half of it waited for something (a bound that load on a shared machine
# cannot reach, unlike a fixed fraction of a second).
PATIENT_TIMEOUT = 10.0
# From the call's start: the ops before the hung one, on a loaded shared machine.
CALL_SLACK_S = 3.0


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict]:
    model = FaultyMLP()
    with overlap.Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        losses = model.step(rt)
    return losses, dict(model.grads)


def assert_reference(model: FaultyMLP, losses: list[float], reference) -> None:
    ref_losses, ref_grads = reference
    assert losses == ref_losses
    assert model.grads.keys() == ref_grads.keys()
    for key, g in ref_grads.items():
        np.testing.assert_array_equal(model.grads[key], g, err_msg=str(key))


def assert_named(err: BaseException, fault: Fault, device: int) -> None:
    phase = "forward" if fault.phase == "F" else "backward"
    if fault.kind == "hang":
        assert isinstance(err, StageTimeout), repr(err)
        assert (err.stage, err.microbatch, err.phase, err.device) == (
            fault.stage, fault.microbatch, fault.phase, device), repr(err)
        assert f"stage {fault.stage} {phase} of microbatch {fault.microbatch}" in str(err)
        return
    assert isinstance(err, StreamError), repr(err)
    assert err.device == device, repr(err)
    assert f"{fault.phase} s{fault.stage} mb{fault.microbatch}" in err.op, repr(err)
    if fault.kind == "raise":
        assert isinstance(err.__cause__, InjectedFault), repr(err.__cause__)
    else:  # the check where the value was produced names stage, microbatch and device
        assert f"stage {fault.stage} {phase} (mb {fault.microbatch}, device {device})" \
            in str(err), str(err)


def threads_started_since(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


def assert_no_thread_left(before: set[threading.Thread]) -> None:
    for t in threads_started_since(before):
        t.join(5.0)  # an abandoned thread ends as soon as its op returns
    assert threads_started_since(before) == []


@pytest.mark.parametrize("fault", list(every_fault()), ids=str)
def test_fault_matrix(fault: Fault, reference) -> None:
    before = set(threading.enumerate())
    model = FaultyMLP(fault)
    device = model.meshes[fault.stage].device_ids[0]
    timeout = TIMEOUT if fault.kind == "hang" else PATIENT_TIMEOUT
    rt = overlap.Runtime(CLUSTER, timeout=timeout)
    try:
        start = time.perf_counter()
        if fault.harmless:
            assert_reference(model, model.step(rt), reference)
            return
        with pytest.raises(overlap.OverlapRuntimeError) as info:
            model.step(rt)
        elapsed = time.perf_counter() - start
        assert_named(info.value, fault, device)
        if fault.kind == "hang":  # named within timeout + 1 s of the hang's start
            assert info.value.seconds <= timeout + HANG_SLACK_S, info.value.seconds
            assert elapsed <= timeout + CALL_SLACK_S, elapsed  # the ops before it included
        else:
            assert elapsed <= timeout / 2, elapsed
        model.fault = None
        if fault.kind != "hang":  # the same runtime recovered
            assert_reference(model, model.step(rt), reference)
            return
        with pytest.raises(DeviceThreadLost, match=f"device {device}'s 'compute' stream"):
            model.step(rt)
    finally:
        start = time.perf_counter()
        rt.close()
        assert time.perf_counter() - start <= timeout + HANG_SLACK_S
        model.release.set()
        assert_no_thread_left(before)
    # A hang: a fresh runtime in the same process works.
    with overlap.Runtime(CLUSTER, timeout=TIMEOUT) as fresh:
        assert_reference(model, model.step(fresh), reference)
    assert_no_thread_left(before)


# ---- interrupted calls, lifecycle, threads -------------------------------------------------


class Gate:
    """A stage hook that holds one op until ``release``, telling the test it has started."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def hold(self, model: FaultyMLP, stage: int = 1):
        forward = model.stages[stage].forward

        def held(ctx, x):
            if ctx.microbatch == 0 and ctx.device == model.meshes[stage].device_ids[0]:
                self.entered.set()
                self.release.wait(60)
            return forward(ctx, x)
        model.stages[stage] = dataclasses.replace(model.stages[stage], forward=held)


def interrupt_when(event: threading.Event) -> None:
    """Ctrl-C in the main thread once ``event`` is set."""
    threading.Thread(target=lambda: event.wait(60) and _thread.interrupt_main(),
                     daemon=True).start()


@pytest.mark.parametrize("op_outlives_timeout", [False, True], ids=["slow-op", "hung-op"])
def test_ctrl_c_leaves_no_stale_error(reference, op_outlives_timeout):
    before = set(threading.enumerate())
    model, gate = FaultyMLP(), Gate()
    gate.hold(model)
    # Ctrl-C must land before the held op is named as hung: the timeout leaves it time on a
    # loaded machine (the hung-op case then waits it out).
    rt = overlap.Runtime(CLUSTER, timeout=3.0 if op_outlives_timeout else PATIENT_TIMEOUT)
    try:
        interrupt_when(gate.entered)
        with pytest.raises(KeyboardInterrupt):
            model.step(rt)
        clean = FaultyMLP()
        if not op_outlives_timeout:
            gate.release.set()  # the op ends within the timeout: the next call just works
            assert_reference(clean, clean.step(rt), reference)
        else:  # the op outlives the timeout: named as lost, not as the interrupted error
            with pytest.raises(DeviceThreadLost, match="device 4's 'compute' stream"):
                clean.step(rt)
    finally:
        rt.close()
        gate.release.set()
    assert_no_thread_left(before)


def test_a_hung_stage_does_not_keep_the_process_alive(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import overlap
        from fault_pipeline import CLUSTER, Fault, FaultyMLP
        model = FaultyMLP(Fault(1, 0, "F", "hang"))
        model.release = threading.Event()  # never set: the stage hangs for good
        with overlap.Runtime(CLUSTER, timeout=0.5) as rt:
            try:
                model.step(rt)
            except overlap.StageTimeout as e:
                print("named:", e.op)
        print("closed")
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["named: stage 1 forward of microbatch 0 on device 4",
                                        "closed"]


def test_a_runtime_dropped_without_close_ends_its_threads(reference):
    before = set(threading.enumerate())
    model = FaultyMLP()
    rt = overlap.Runtime(CLUSTER, timeout=TIMEOUT)
    assert_reference(model, model.step(rt), reference)
    assert threads_started_since(before)  # it did start threads
    with pytest.warns(ResourceWarning, match="unclosed overlap.Runtime"):
        del rt
        gc.collect()
    assert_no_thread_left(before)


def test_sync_calls_from_several_threads_take_turns(reference):
    models = [FaultyMLP() for _ in range(3)]
    start = threading.Barrier(len(models))
    results: dict[int, object] = {}

    def call(i: int) -> None:
        start.wait(10)
        try:
            results[i] = models[i].step(rt)
        except BaseException as exc:
            results[i] = exc

    with overlap.Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(models))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    for i, model in enumerate(models):
        assert results[i] == reference[0], results[i]
        assert_reference(model, results[i], reference)


@pytest.mark.parametrize("loss", [None, "0.5", np.ones(3), 1 + 2j, True],
                         ids=["None", "str", "array", "complex", "bool"])
def test_a_loss_that_is_not_a_real_scalar_is_named_where_it_is_made(loss):
    model = FaultyMLP()
    last = model.stages[2]
    model.stages[2] = dataclasses.replace(last, forward=lambda ctx, x: (last.forward(ctx, x),
                                                                        loss)[1])
    named = r"stage 2 forward \(mb 0, device [89]\) returned"  # either device of stage 2
    with overlap.Runtime(CLUSTER, timeout=TIMEOUT) as rt, \
            pytest.raises(StreamError, match=named) as info:
        model.step(rt)
    assert isinstance(info.value.__cause__, (TypeError, ValueError))
    assert "real scalar" in str(info.value) or "real number" in str(info.value)


def test_a_tampered_step_graph_is_refused_before_any_work():
    model = FaultyMLP()
    graph = lower(tuple(model.meshes), model.boundaries,
                  make_schedule("eager-1f1b", 3, MICROBATCHES), CLUSTER)
    data = json.loads(graph.to_json())
    data["plans"]["fwd0"]["transfers"][0]["sender"] = 5  # holds nothing of stage 0's output
    tampered = StepGraph.from_json(json.dumps(data))
    with overlap.Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        with pytest.raises(PlanError, match=r"graph: its plan for fwd0: transfer 0 .*sender 5 "
                                            "does not hold"):
            rt.train_step_sync(model.stages, model.boundaries, model.microbatches(),
                               input_sharding=model.input_sharding, graph=tampered)
        assert rt.backend.streams() == []


def test_close_returns_within_its_bound_while_a_stage_hangs():
    before = set(threading.enumerate())
    model, gate = FaultyMLP(), Gate()
    gate.hold(model)
    rt = overlap.Runtime(CLUSTER, timeout=TIMEOUT)
    outcome: list[BaseException] = []

    def step() -> None:
        try:
            model.step(rt)
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=step)
    caller.start()
    try:
        assert gate.entered.wait(10)
        start = time.perf_counter()
        rt.close()  # from another thread, the step in flight, its stage stuck
        assert time.perf_counter() - start <= TIMEOUT + HANG_SLACK_S
        caller.join(10)
        assert not caller.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], overlap.OverlapRuntimeError), outcome
    finally:
        gate.release.set()
    assert_no_thread_left(before)


# ---- the MPI control channel carries plain data ----------------------------------------------


def test_control_messages_are_json_of_fixed_fields_never_pickles():
    import pickle

    from overlap.backends.job.control_messages import ControlTag, parse_control

    ok = {"rank": 1, "during": "train_step", "error": "boom", "calls": 3}
    assert parse_control(ControlTag.FAILED, json.dumps(ok).encode()) == ok
    assert parse_control(ControlTag.LEFT, b'{"rank": 2, "calls": 0, "how": "exited"}') == {
        "rank": 2, "calls": 0, "how": "exited"}

    class Boom:
        def __reduce__(self):
            return (print, ("unpickled!",))

    refused = [
        pickle.dumps(ok), pickle.dumps(Boom()),  # pickles are never read
        b"not json", b"[1, 2]", json.dumps({**ok, "extra": 1}).encode(),  # other shapes
        json.dumps({**ok, "calls": "3"}).encode(), json.dumps({**ok, "rank": True}).encode(),
        b'{"rank": 1, "during": "' + b"x" * (1 << 17) + b'", "error": "", "calls": 0}',
    ]
    for data in refused:
        assert parse_control(ControlTag.FAILED, data) is None, data[:60]
    assert parse_control(99, json.dumps(ok).encode()) is None  # unknown kind


# ---- the call scope ends the concurrency defects an adversarial run found -------------------


def _step_error(model: FaultyMLP, rt: overlap.Runtime) -> str:
    """The step's error, by name only: the exception object (its traceback reaches this
    frame and the runtime's) is not kept."""
    try:
        model.step(rt)
    except overlap.OverlapRuntimeError as exc:
        return type(exc).__name__
    return "no error"


def test_a_runtime_dropped_after_a_hang_is_collected_and_its_other_threads_end():
    """After a StageTimeout, a runtime dropped without close() is collected (before, what
    the hung thread held kept it alive, and every one of its threads stayed): only the hung
    op's thread is left, until its op returns."""
    import weakref

    before = set(threading.enumerate())
    model, gate = FaultyMLP(), Gate()
    gate.hold(model)
    rt = overlap.Runtime(CLUSTER, timeout=0.5)
    assert _step_error(model, rt) == "StageTimeout"
    assert _step_error(FaultyMLP(), rt) == "DeviceThreadLost"
    alive = weakref.ref(rt)
    try:
        with pytest.warns(ResourceWarning, match="unclosed overlap.Runtime"):
            del rt
            gc.collect()
        assert alive() is None, "the runtime was not collected"
        left = [t.name for t in threads_started_since(before)]
        assert left == ["overlap-d4-compute"], left  # the hung op's thread, nothing else
    finally:
        gate.release.set()
    assert_no_thread_left(before)


def test_a_stage_that_closes_the_runtime_is_refused_and_leaves_no_thread(reference):
    before = set(threading.enumerate())
    model = FaultyMLP()
    rt = overlap.Runtime(CLUSTER, timeout=PATIENT_TIMEOUT)
    forward = model.stages[1].forward

    def closing(ctx, x):
        if ctx.microbatch == 0:
            rt.close()
        return forward(ctx, x)

    model.stages[1] = dataclasses.replace(model.stages[1], forward=closing)
    try:
        with pytest.raises(overlap.OverlapRuntimeError,
                           match=r"close: called from inside this runtime.s work"):
            model.step(rt)
        clean = FaultyMLP()  # the runtime is still usable: the call closed nothing
        assert_reference(clean, clean.step(rt), reference)
    finally:
        rt.close()
    assert_no_thread_left(before)


def test_a_runtime_call_from_inside_a_stage_is_refused_not_a_deadlock(reference):
    model = FaultyMLP()
    with overlap.Runtime(CLUSTER, timeout=PATIENT_TIMEOUT) as rt:
        forward = model.stages[0].forward

        def reentrant(ctx, x):
            if ctx.microbatch == 0:
                FaultyMLP().step(rt)  # another call, from the stream thread of this one
            return forward(ctx, x)

        model.stages[0] = dataclasses.replace(model.stages[0], forward=reentrant)
        start = time.perf_counter()
        with pytest.raises(overlap.OverlapRuntimeError,
                           match=r"train_step_sync: called from inside this "
                                              r"runtime's work \(device 0's 'compute' stream"):
            model.step(rt)
        assert time.perf_counter() - start < PATIENT_TIMEOUT  # refused, not timed out
        clean = FaultyMLP()
        assert_reference(clean, clean.step(rt), reference)
