"""Hangs that hold Python's interpreter lock (GIL): a stage in a C call that never releases
it, and stages spinning in pure Python on several devices at once. While such an op runs no
other thread may get to look at it; once it returns, it — not a peer that waited for it — is
named."""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest
from fault_pipeline import CLUSTER, FaultyMLP
from gil_pipeline import spinning_step

import overlap
from overlap import StageTimeout

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="holds the GIL through libc's usleep (ctypes.PyDLL)")

TIMEOUT = 0.5


def hold_the_gil(seconds: float) -> None:
    """A C call that keeps the interpreter lock all along (PyDLL does not release it)."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


class GilHolder(FaultyMLP):
    """The fault pipeline, one op of which holds the GIL for ``seconds`` and then returns."""

    def __init__(self, where: tuple[int, int, str], seconds: float) -> None:
        super().__init__()
        self.where, self.seconds = where, seconds

    def _planted(self, ctx):
        if (ctx.stage, ctx.microbatch, ctx.phase) == self.where \
                and ctx.device == self.meshes[ctx.stage].device_ids[0] and self.seconds:
            hold_the_gil(self.seconds)
        return None


@pytest.mark.parametrize("where", [(1, 0, "F"), (2, 1, "B"), (0, 1, "F")],
                         ids=["s1F0", "s2B1", "s0F1"])
def test_an_op_that_returns_after_holding_the_gil_past_the_timeout_is_the_one_named(where):
    reference = FaultyMLP()
    with overlap.Runtime(CLUSTER, timeout=TIMEOUT) as rt:
        expected = reference.step(rt)
        model = GilHolder(where, 3 * TIMEOUT)
        with pytest.raises(StageTimeout) as info:
            model.step(rt)
        err = info.value
        stage = where[0]
        assert (err.stage, err.microbatch, err.phase) == where, repr(err)
        assert err.device == model.meshes[stage].device_ids[0], repr(err)
        assert err.seconds >= TIMEOUT, repr(err)
        assert "interpreter lock" in str(err), str(err)
        # The op returned: its thread is not lost, and the same runtime works on.
        model.seconds = 0
        assert model.step(rt) == expected


def test_an_op_holding_the_gil_within_the_timeout_is_no_error():
    reference = FaultyMLP()
    with overlap.Runtime(CLUSTER, timeout=10.0) as rt:
        expected = reference.step(rt)
        assert GilHolder((1, 0, "F"), 0.2).step(rt) == expected


def test_stages_spinning_in_python_on_four_devices_are_named_and_closed():
    n = 4
    err = spinning_step(n, TIMEOUT, threading.Event())
    assert (err.stage, err.microbatch, err.phase) == (0, 1, "F"), repr(err)
    assert err.device in range(n)
    named = {d for d in range(n) if f"microbatch 1 on device {d}" in str(err)}
    assert named == set(range(n)), str(err)  # the others are listed as still running


FROZEN = """
import ctypes, sys
sys.path[:0] = [{tests!r}, {root!r}]
from fault_pipeline import CLUSTER, FaultyMLP
import overlap

class Frozen(FaultyMLP):
    def _planted(self, ctx):
        if (ctx.stage, ctx.microbatch, ctx.phase) == (1, 0, "F") and ctx.device == 4:
            frozen_in_c_code()
        return None

def frozen_in_c_code():
    ctypes.PyDLL(None).usleep(int({hold} * 1e6))  # the GIL held all along

with overlap.Runtime(CLUSTER, timeout={timeout}, hang_tracebacks={dump}) as rt:
    try:
        Frozen().step(rt)
    except overlap.StageTimeout as exc:
        print("named:", exc.stage, exc.microbatch, exc.phase, exc.device)
"""


@pytest.mark.parametrize("dump", [True, False])
def test_hang_tracebacks_show_where_a_process_frozen_by_an_op_holding_the_gil_is(dump):
    import subprocess
    from pathlib import Path
    tests = Path(__file__).parent
    script = FROZEN.format(tests=str(tests), root=str(tests.parent), timeout=TIMEOUT,
                           hold=5 * TIMEOUT, dump=dump)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "named: 1 0 F 4" in out.stdout  # named once it returned, either way
    # faulthandler's dump: every thread's frames, the frozen stage's among them.
    assert ("frozen_in_c_code" in out.stderr) is dump, out.stderr
    assert ("most recent call first" in out.stderr) is dump, out.stderr


@pytest.mark.parametrize("value", ["yes", 1, object()])
def test_hang_tracebacks_takes_a_bool_or_a_file(value):
    with pytest.raises(TypeError, match="hang_tracebacks"):
        overlap.Runtime(CLUSTER, hang_tracebacks=value)
