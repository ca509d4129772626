"""``python -m overlap.guard``: runs a rank's script as its child and names it if a signal
kills it (no MPI needed to check that)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def guard(tmp_path: Path, body: str, env: dict[str, str] | None = None):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "overlap.guard", str(script)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                          capture_output=True, text=True, timeout=60)


def test_the_exit_status_passes_through(tmp_path):
    done = guard(tmp_path, "import sys; print('hi'); sys.exit(3)")
    assert done.returncode == 3 and done.stdout == "hi\n" and "killed" not in done.stderr


def test_a_killed_child_is_named_with_its_rank_signal_and_last_activity(tmp_path):
    done = guard(tmp_path, """
        import os, signal
        from overlap.guard import report
        report("reshard: the plan (call 7)")
        os.kill(os.getpid(), signal.SIGKILL)
        """, env={"PMI_RANK": "5"})
    assert done.returncode == 128 + 9
    assert "overlap: rank 5 (pid " in done.stderr
    assert "was killed by SIGKILL during reshard: the plan (call 7)" in done.stderr


def test_without_a_script_it_says_how_to_use_it():
    done = subprocess.run([sys.executable, "-m", "overlap.guard"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "mpiexec -n N python -m overlap.guard" in done.stderr
    assert "RuntimeWarning" not in done.stderr


def test_report_writes_one_line_to_the_guard_and_nothing_without_one(monkeypatch):
    from overlap.guard import ENV_FD, report

    r, w = os.pipe()
    try:
        monkeypatch.setenv(ENV_FD, f"{w}:{os.getppid()}")  # (as a guard that is our parent)
        report("train_step\nthe programs (call 2)")
        assert os.read(r, 100) == b"train_step the programs (call 2)\n"
        monkeypatch.delenv(ENV_FD)
        report("nobody listens")  # no guard: nothing written, no error
        os.set_blocking(r, False)
        assert _nothing(r)
    finally:
        os.close(r)
        os.close(w)


def _nothing(fd: int) -> bool:
    try:
        os.read(fd, 100)
    except BlockingIOError:
        return True
    return False


def test_a_guard_fd_set_by_hand_names_no_file(tmp_path):
    import os

    from overlap.guard import guard_fd

    target = tmp_path / "victim.txt"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT)
    try:
        for value in (str(fd), f"{fd}:{os.getppid()}", f"{fd}:1", "x:y", ""):
            assert guard_fd(value) is None, value  # a regular file, or not our guard's
        r, w = os.pipe()
        assert guard_fd(f"{w}:{os.getppid()}") == w  # a pipe from our parent: reported on
        assert guard_fd(f"{w}:{os.getppid() + 1}") is None
        os.close(r)
        os.close(w)
    finally:
        os.close(fd)
    assert target.read_bytes() == b""
