"""Running ``python -m overlap`` as a user would, and what a refused input must look like:
one ``error:`` line on stderr, exit 2, no traceback, nothing on stdout (no work was done)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_overlap(*argv: str, memory: int | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m overlap ARGV``; ``memory``: its address space capped at that many bytes
    (a hostile input must be refused before it allocates: past the cap it would fail with
    a MemoryError traceback, never take the machine's memory)."""
    def cap() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run([sys.executable, "-m", "overlap", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          preexec_fn=cap if memory is not None else None)


def assert_one_line_error(done: subprocess.CompletedProcess[str], match: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert re.search(match, lines[0]), lines[0]
    assert done.stdout == ""  # (refused before any work: nothing was printed)
