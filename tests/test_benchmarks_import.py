"""Every benchmark script imports (its ``main`` is not run): a moved helper once left
``benchmarks/vs_torch_pipelining.py`` unable to start, unnoticed until someone ran it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py"))
NEEDS = {"vs_torch_pipelining.py": "torch", "mpi_step_profile.py": "torch"}


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.name for p in BENCHMARKS])
def test_benchmark_script_imports(path, monkeypatch):
    if path.name in NEEDS:
        pytest.importorskip(NEEDS[path.name], reason=f"{path.name} needs {NEEDS[path.name]}")
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (dataclasses look it up there)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts add their folders
    spec.loader.exec_module(module)  # __name__ is not "__main__": nothing runs
    assert callable(getattr(module, "main", None)) or path.stem in ("suites", "suite_report",
                                                                      "thread_profile",
                                                                      "state_models")
