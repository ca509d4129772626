"""A missing optional dependency names an install command that works from a checkout.

``overlap`` is installed from its repository (README: ``pip install -e '.[dev]'``); a
different package called ``overlap`` exists on PyPI, so ``pip install 'overlap[mpi]'`` would
install someone else's project. Each hint must be ``pip install -e '.[<extra>]'``.
"""

from __future__ import annotations

import re
import sys

import pytest

from overlap.errors import OverlapRuntimeError

HINT = re.compile(r"pip install -e '\.\[(\w+)\]'")


def _extra(message: str) -> str:
    found = HINT.search(message)
    assert found, message
    assert "'overlap[" not in message, message
    return found.group(1)


def test_missing_mpi4py_names_the_mpi_extra(monkeypatch):
    from overlap.world import mpi_world_comm

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py -> ImportError
    with pytest.raises(RuntimeError) as err:
        mpi_world_comm("the process was started by an MPI launcher (PMI_RANK is set)")
    assert _extra(str(err.value)) == "mpi"


def test_missing_torch_distributed_under_torchrun_names_the_torch_extra(monkeypatch):
    from overlap.bootstrap import TorchBootstrap

    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(RuntimeError) as err:
        TorchBootstrap(0, 2, timeout=1.0)
    assert _extra(str(err.value)) == "torch"


def test_missing_cupy_names_the_cuda_extra(monkeypatch):
    from overlap import Runtime
    from scheduler import Cluster

    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(OverlapRuntimeError) as err:
        Runtime(Cluster.local(2), backend="cuda")
    assert _extra(str(err.value)) == "cuda12"


def test_missing_torch_names_the_torch_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    for name in [m for m in sys.modules if m == "overlap.torch" or
                 m.startswith("overlap.torch.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError) as err:
        import overlap.torch  # noqa: F401
    assert _extra(str(err.value)) == "torch"
