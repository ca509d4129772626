"""What the job really has, for :meth:`scheduler.Cluster.detect`: how many hosts and how many
processes per host its launcher started, and how many GPUs this host shows.

Read from the launcher's variables (no process is contacted): torchrun
(``GROUP_WORLD_SIZE`` nodes, ``LOCAL_WORLD_SIZE`` processes each), Slurm (``SLURM_NNODES``,
``SLURM_NTASKS``), Open MPI (``OMPI_COMM_WORLD_SIZE`` / ``_LOCAL_SIZE``) and MPICH's hydra
(``PMI_SIZE``, ``MPI_LOCALNRANKS``); without a launcher, one host and one process. GPUs: the
entries of ``CUDA_VISIBLE_DEVICES`` where it is set, else what CuPy (or an already imported
torch) counts, else none.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an integer, got {raw!r}") \
            from None
    if value < 1:
        raise ValueError(f"environment variable {name}: expected an integer >= 1, got {raw!r}")
    return value


def job_hosts(env: Mapping[str, str]) -> tuple[int, int]:
    """(hosts, processes per host) of the job this process belongs to."""
    for size, local in (("WORLD_SIZE", "LOCAL_WORLD_SIZE"),  # torchrun
                        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                        ("PMI_SIZE", "MPI_LOCALNRANKS")):  # MPICH's hydra
        if size in env and local in env:
            n, k = _int(env, size), _int(env, local)
            if n % k:
                raise ValueError(f"environment: {size}={n} processes are not whole hosts of "
                                 f"{local}={k}; Cluster.detect needs as many on every host "
                                 "(describe the cluster with Cluster(...) instead)")
            return n // k, k
    if "SLURM_NNODES" in env and "SLURM_NTASKS" in env:
        hosts, n = _int(env, "SLURM_NNODES"), _int(env, "SLURM_NTASKS")
        if n % hosts:
            raise ValueError(f"environment: SLURM_NTASKS={n} tasks do not split evenly over "
                             f"SLURM_NNODES={hosts} nodes; Cluster.detect needs as many on "
                             "every node")
        return hosts, n // hosts
    return 1, 1


def visible_gpus(env: Mapping[str, str]) -> int:
    """The GPUs this process may use on its host (see module doc)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        # CUDA stops at the first invalid entry ("-1": none).
        count = 0
        for e in entries:
            if e.startswith("-"):
                break
            count += 1
        return count
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            return int(torch.cuda.device_count())
        except Exception:
            return 0
    return 0


__all__ = ["job_hosts", "visible_gpus"]
