"""The code's shape, as the project's conventions state it (docs/contributing.md, issue 11): small
functions, and modules whose imports form no cycle (no two modules import each other, even
lazily inside a function), with ``scheduler`` never importing ``overlap``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("scheduler", "overlap")
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Project modules ``name`` imports anywhere in its file (module level or inside a
    function), resolved to the longest known module name."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = here[: len(here) - node.level + 1]
                base = ".".join([*prefix, base] if base else prefix)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_module_list_is_real():
    assert {"scheduler.graph", "scheduler.lowering", "scheduler.validate", "scheduler.kernel",
            "scheduler.timeline", "scheduler.simulator", "overlap.launch",
            "overlap.runtime"} <= set(MODULES)
    assert "scheduler.graph" in GRAPH["scheduler.lowering"]  # imports are seen


def test_scheduler_never_imports_overlap():
    bad = {m: sorted(t for t in ts if t.startswith("overlap"))
           for m, ts in GRAPH.items() if m.startswith("scheduler")}
    assert {m: t for m, t in bad.items() if t} == {}


def test_overlap_imports_scheduler_through_its_faces_only():
    """``overlap`` uses ``scheduler`` through the package's face (``scheduler/__init__.py``)
    and its subpackages' faces (``partition``, ``traces``, ``cli``), never a module past
    them: what the runtime builds on is exported, and a module inside may move."""
    faces = {name for name, path in MODULES.items()
             if name.startswith("scheduler") and path.name == "__init__.py"}
    assert {"scheduler", "scheduler.partition", "scheduler.traces"} <= faces
    past = {}
    for name, path in MODULES.items():
        if not name.startswith("overlap"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # (The module an import names: ``from scheduler import validate`` is the face's
            # ``validate``, not the module ``scheduler.validate``.)
            named = [node.module] if isinstance(node, ast.ImportFrom) and not node.level \
                else [a.name for a in node.names] if isinstance(node, ast.Import) else []
            past[name] = past.get(name, []) + [m for m in named if m and m.split(".")[0]
                                               == "scheduler" and m not in faces]
    assert {m: t for m, t in past.items() if t} == {}


def test_no_import_cycles():
    """Depth-first search over the import graph; a back edge is a cycle, named in full."""
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                cycles.append([*stack[stack.index(t):], t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert cycles == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_functions_are_short(name):
    tree = ast.parse(MODULES[name].read_text())
    long = [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines in {name}"


def test_backends_devices_never_import_the_job_and_the_runtime_goes_through_the_face():
    """``overlap/backends/`` is two packages, one built on the other: the process's devices
    (``devices/``) and the multi-process job (``job/``, which builds on ``devices/``).

    - Nothing in ``devices/`` imports ``job/`` (nor the face ``overlap.backends``, which
      imports ``job/``): a device kind, its streams and the in-process transport stand on
      their own, and what spans processes is given to ``Backend`` as a ``Transport``.
    - The rest of ``overlap`` — the runtime's API modules (``runtime``, ``call``,
      ``pipeline``, ``reshard``, the torch adapter, ...) — imports neither package's modules,
      only the face ``overlap.backends`` (``make_backend`` and the names it exports): what the
      runtime builds on is exported, and a module inside may move. (The setup's collectives,
      ``overlap.bootstrap``, sit beneath both ``overlap.world`` — which gathers a caller's
      process group's host names with them — and the job package.)

    Tests and benchmarks may import the modules themselves (they test them)."""
    devices, job = "overlap.backends.devices", "overlap.backends.job"
    inside = {m for m in MODULES if m.startswith(f"{devices}.") or m == devices}
    assert {f"{devices}.backend", f"{devices}.streams", f"{job}.distributed",
            f"{job}.exit_guard"} <= set(MODULES)
    upward = {m: sorted(t for t in GRAPH[m] if t == "overlap.backends" or t.startswith(job))
              for m in inside}
    assert {m: t for m, t in upward.items() if t} == {}
    past = {m: sorted(t for t in GRAPH[m] if t.startswith(("overlap.backends.", devices, job)))
            for m in MODULES if m.startswith("overlap") and not m.startswith("overlap.backends")}
    assert {m: t for m, t in past.items() if t} == {}
