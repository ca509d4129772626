"""The CuPy stand-in (tests/fake_cupy.py) against the real CuPy: every class, method, field and
constant the CUDA backend touches exists in both, with the real one's parameters.

Real CuPy installs and imports without a GPU (``pip install -e '.[cuda13]'``; CI does);
only device work fails. Where it is not installed, this file is skipped and says so — the
stand-in's fidelity then rests on the versions cited in its docstring.
"""

from __future__ import annotations

import inspect
import re

import fake_cupy
import pytest

cupy = pytest.importorskip("cupy", reason="the real CuPy is not installed (pip install -e "
                                          "'.[cuda13]'): the stand-in is not compared with it")
nccl = pytest.importorskip("cupy.cuda.nccl", reason="CuPy without its NCCL module")


def params(fn) -> list[str]:
    """Parameter names (without self), from the signature or a Cython docstring's first line."""
    try:
        return [p for p in inspect.signature(fn).parameters if p != "self"]
    except (TypeError, ValueError):
        first = (fn.__doc__ or "").strip().splitlines()[0]
        inside = re.search(r"\((.*)\)", first).group(1)
        names = [part.split("=")[0].strip().split()[-1] for part in inside.split(",") if part]
        return [n for n in names if n not in ("self", "*")]


def real_and_fake(path: str):
    real, fake = cupy, fake_cupy
    for part in path.split("."):
        real, fake = getattr(real, part), getattr(fake, part)
    return real, fake


CALLABLES = [
    "asarray", "array", "ascontiguousarray", "asnumpy", "empty", "zeros", "ones",
    "cuda.Stream", "cuda.ExternalStream", "cuda.Event", "cuda.Device",
    "cuda.Stream.wait_event", "cuda.Stream.launch_host_func", "cuda.Event.record",
    "cuda.runtime.getDeviceCount", "cuda.runtime.getDevice", "cuda.runtime.setDevice",
    "cuda.get_current_stream", "cuda.profiler.start", "cuda.profiler.stop",
    "cuda.get_elapsed_time", "ndarray.get", "get_default_memory_pool",
    "cuda.MemoryPool.free_all_blocks", "cuda.Event.synchronize",
    "cuda.nccl.NcclCommunicator.send", "cuda.nccl.NcclCommunicator.recv",
    "cuda.nccl.NcclCommunicator.allReduce", "cuda.nccl.NcclCommunicator.allGather",
    "cuda.nccl.NcclCommunicator.initAll",
]


@pytest.mark.parametrize("path", CALLABLES)
def test_what_the_stand_in_accepts_the_real_one_accepts(path):
    real, fake = real_and_fake(path)
    want, have = params(real), params(fake)
    # What the backend may pass to the stand-in, the real one takes, in the same order.
    assert have == want[:len(have)], (want, have)


@pytest.mark.parametrize("path, names", [
    ("ndarray", ["shape", "dtype", "size", "nbytes", "flags", "data", "device", "get",
                 "copy", "reshape", "T", "ndim", "astype", "view", "__array_ufunc__",
                 "__array_function__"]),
    ("cuda.Stream", ["ptr", "device_id", "wait_event", "record", "null", "done", "synchronize",
                     "use", "launch_host_func"]),
    ("cuda.Event", ["record", "done", "synchronize"]),
    ("cuda.Device", ["id", "use", "synchronize"]),
    ("cuda.nccl.NcclCommunicator", ["send", "recv", "allReduce", "allGather", "abort",
                                    "destroy", "initAll", "device_id", "rank_id", "size"]),
    ("cuda.nccl", ["groupStart", "groupEnd", "get_unique_id", "NcclCommunicator"]),
    ("cuda.runtime", ["getDeviceCount", "getDevice", "setDevice", "memcpyPeerAsync"]),
    ("cuda.profiler", ["start", "stop"]),
])
def test_the_backend_touches_nothing_the_real_one_lacks(path, names):
    real, fake = real_and_fake(path)
    documented = real.__doc__ or ""  # instance attributes: listed under "Attributes:"
    assert [n for n in names if not hasattr(real, n) and f".{n} (" not in documented] == []
    assert [n for n in names if not hasattr(fake, n)] == []


def test_flags_have_cupys_fields_and_no_writeable():
    from cupy._core.flags import Flags

    real = {n for n in dir(Flags) if not n.startswith("_")}
    assert set(fake_cupy.Flags._fields) <= real and "writeable" not in real


def test_nccl_constants_are_cupys():
    names = [n for n in dir(fake_cupy.nccl) if n.startswith("NCCL_")]
    assert names and {n: getattr(fake_cupy.nccl, n) for n in names} == {
        n: getattr(cupy.cuda.nccl, n) for n in names}


def test_the_unique_id_and_communicator_take_the_real_types():
    if not nccl.available:
        pytest.skip("the NCCL library is not installed (pip install nvidia-nccl-cu13)")
    uid = nccl.get_unique_id()  # works without a GPU
    assert type(uid) is type(fake_cupy.get_unique_id()) and len(uid) == 128
    assert params(nccl.NcclCommunicator)[:4] == ["ndev", "commId", "rank", "config"]
    assert params(fake_cupy.NcclCommunicator)[:4] == ["ndev", "commId", "rank", "config"]


def test_default_streams_belong_to_no_device_as_in_cupy():
    # Seen on an H200: ``Device(Stream.null.device_id)`` is ``Device(-1)``, an invalid ordinal.
    # The stand-in once said 0 there, which hid that crash in the backend's caller events.
    for name in ("null", "ptds"):
        real = getattr(cupy.cuda.Stream, name).device_id
        assert getattr(fake_cupy.cuda.Stream, name).device_id == real
