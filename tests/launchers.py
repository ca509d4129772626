"""Starting a script on several processes as a user would: ``mpiexec -n N python script`` or
``torchrun --standalone --nproc-per-node N script`` (tests parametrize over both)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = ("mpiexec", "torchrun")
# Variables a launcher sets for its processes: none may leak from the test's own launcher.
_LAUNCHED = ("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA_", "JOB_", "RANK", "WORLD_SIZE",
             "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC_", "GROUP_")


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHED)}
    env["OPENBLAS_NUM_THREADS"] = "1"
    return env


def command(launcher: str, n: int, script: Path, *args: str) -> list[str]:
    """The command line that starts ``script`` on ``n`` processes (skips the test where the
    launcher is not installed)."""
    if launcher == "mpiexec":
        pytest.importorskip("mpi4py", reason="the mpi extra is not installed")
        mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or \
            shutil.which("mpiexec")
        if mpiexec is None:
            pytest.skip("no mpiexec (pip install mpich)")
        return [mpiexec, "-n", str(n), sys.executable, str(script), *args]
    if launcher == "torchrun":
        pytest.importorskip("torch.distributed.run", reason="torch is not installed")
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(n), str(script), *args]
    raise ValueError(f"launcher: expected one of {LAUNCHERS}, got {launcher!r}")


def launch(launcher: str, n: int, script: Path, *args: str, timeout: float = 120.0,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(launcher, n, script, *args), env=env or clean_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
