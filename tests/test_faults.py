"""Faults and hangs: every planted fault of a 3-stage pipeline is named, within its bound, no
thread outlives close(), and the next step gives the reference result."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fault_pipeline import CLUSTER, Fault, FaultyMLP, InjectedFault, every_fault

import overlap
from overlap import DeviceThreadLost, StageTimeout, StreamError

TIMEOUT = 1.0
# A hang is named within the timeout plus this; a raise or a bad return value needs no timeout.
HANG_SLACK_S = 1.0


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
    rt = overlap.Runtime(CLUSTER, timeout=TIMEOUT)
    try:
        start = time.perf_counter()
        if fault.harmless:
            assert_reference(model, model.step(rt), reference)
            return
        with pytest.raises(overlap.OverlapRuntimeError) as info:
            model.step(rt)
        elapsed = time.perf_counter() - start
        assert_named(info.value, fault, device)
        assert elapsed <= (TIMEOUT + HANG_SLACK_S if fault.kind == "hang" else TIMEOUT), elapsed
        model.fault = None
        if fault.kind != "hang":  # the same runtime recovered
            assert_reference(model, model.step(rt), reference)
            return
        with pytest.raises(DeviceThreadLost, match=f"device {device}'s 'compute' stream"):
            model.step(rt)
    finally:
        start = time.perf_counter()
        rt.close()
        assert time.perf_counter() - start <= TIMEOUT + HANG_SLACK_S
        model.release.set()
        assert_no_thread_left(before)
    # A hang: a fresh runtime in the same process works.
    with overlap.Runtime(CLUSTER, timeout=TIMEOUT) as fresh:
        assert_reference(model, model.step(fresh), reference)
    assert_no_thread_left(before)
