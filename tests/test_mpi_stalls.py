"""A rank that stalls in a multi-process training step — stuck in its own code, or frozen by
``SIGSTOP``, before the step or inside one of its stage functions — is named by every other
rank within the timeout and a second, and the job ends with a non-zero status (the job:
``tests/mpi_jobs/stalls.py``). Before the redesign the others waited for good."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="the mpi extra is not installed: pip install -e '.[mpi]'")

JOB = Path(__file__).parent / "mpi_jobs" / "stalls.py"
MPIEXEC = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))
TIMEOUT_S = 3.0  # the job's Runtime(timeout=...)
JOB_BOUND_S = 90.0  # startup, the stall, the others' timeout, the exit's grace, the abort

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")


def _named(tmp_path, done, n):
    assert done.returncode != 0, "the job went on as if nothing happened"
    for r in (r for r in range(n) if r != 1):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} raised nothing:\n{done.stderr[-3000:]}"
        seen = json.loads(path.read_text())
        assert seen["error"] in ("CollectiveTimeout", "RankFailed"), seen
        assert re.search(r"\brank 1\b|\branks \[1\]", seen["message"]), seen
        # (never this rank's own device blamed for the peer's silence)
        assert "never launched it" not in seen["message"], seen
        assert seen["seconds"] <= TIMEOUT_S + 1.0, seen


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("how", ["sleep", "stop"])
def test_a_stalled_rank_is_named_by_the_others_within_the_timeout_and_a_second(
        tmp_path, how, when, n):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA_"))}
    env["OPENBLAS_NUM_THREADS"] = "1"
    done = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(JOB), how, when, "1",
                           str(tmp_path)], env=env, cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=JOB_BOUND_S)
    _named(tmp_path, done, n)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("how, when", [("sleep", "before"), ("stop", "during")])
def test_a_stalled_rank_is_named_under_torchrun(tmp_path, how, when, n):
    from launchers import launch

    done = launch("torchrun", n, JOB, how, when, "1", str(tmp_path), timeout=JOB_BOUND_S)
    _named(tmp_path, done, n)
