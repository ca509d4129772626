"""Every ```python block of README.md and docs/ runs, as a reader would run it: each in its
own process, in a fresh temporary directory, within a time limit.

A block that cannot run here starts with the line ``# not run by the docs test: <why>`` —
visible to the reader too; a marker without a reason fails. Blocks that import torch are
skipped (and say so) where torch is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.S | re.M)
SKIP = re.compile(r"^# not run by the docs test:(.*)$")
TIMEOUT_S = 180  # a block is seconds of work; this is a hang, not a slow block


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return found


BLOCKS = _blocks()


def test_the_pages_have_blocks_to_run():
    """(The collection itself is checked: a change to the fence syntax must not make every
    page look empty.)"""
    pages = {where.split(":")[0] for where, _ in BLOCKS}
    assert "README.md" in pages and "docs/quickstart.md" in pages, pages
    assert len(BLOCKS) >= 10, [where for where, _ in BLOCKS]


def _env() -> dict[str, str]:
    """The caller's environment without a launcher's variables (a block is one process)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")  # (a block's device threads share the cores)
    return env


def not_run_reason(where: str, code: str) -> str | None:
    """Why the block must not run (its first line's marker), or None; ValueError for a
    marker without a reason."""
    marker = SKIP.match(code.splitlines()[0] if code.strip() else "")
    if marker is None:
        return None
    if not marker.group(1).strip():
        raise ValueError(f"{where}: '# not run by the docs test:' needs a reason")
    return marker.group(1).strip()


def test_a_not_run_marker_needs_a_reason():
    assert not_run_reason("x", "import numpy\n") is None
    assert not_run_reason("x", "# not run by the docs test: needs 4 GPUs\nimport cupy\n") \
        == "needs 4 GPUs"
    with pytest.raises(ValueError, match="needs a reason"):
        not_run_reason("x", "# not run by the docs test:  \nimport cupy\n")


@pytest.mark.parametrize("where, code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_the_block_runs(where, code, tmp_path):
    reason = not_run_reason(where, code)
    if reason is not None:
        pytest.skip(f"{where}: {reason}")
    if re.search(r"^\s*(import torch|from torch\b)", code, re.M) and \
            importlib.util.find_spec("torch") is None:
        pytest.skip(f"{where}: needs torch (pip install torch==2.13.0, then "
                    "pip install -e '.[torch]')")
    script = tmp_path / "block.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{where} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
