"""The intra-op threads a torch stage runs with.

Stage functions run on the runtime's stream threads, not on the thread that called the
runtime. Torch's intra-op setting does not follow them there: ``torch.set_num_threads(1)`` in
the caller's thread leaves each new thread's OpenMP team at its default size, and on a host
where several processes (ranks) each run several stream threads those teams spin against
each other — measured on 2 cores, 4 ranks, a width-64 pipeline: 14–16 × slower than the same
run with ``OMP_NUM_THREADS=1`` (docs/benchmarks.md). So every stage function runs torch with
one setting, made once per stream thread (``torch.set_num_threads`` there):

- ``TorchPipeline(..., num_threads=k)``: ``k``;
- else the calling thread's own setting (``torch.get_num_threads()`` when the step is made:
  ``OMP_NUM_THREADS`` if set, else what ``torch.set_num_threads`` set, else torch's default),
- except that under a launcher that puts several ranks of the job on one host, without
  ``OMP_NUM_THREADS`` in the environment, the default is the host's cores divided by the
  ranks on it (at least 1, and never more than the caller's) — what torchrun arranges by
  setting ``OMP_NUM_THREADS=1`` for its workers.
"""

from __future__ import annotations

import os
import threading

import torch

from ..world import World

_local = threading.local()  # .threads: what this thread's torch was set to


def default_threads(world: World) -> int:
    """The intra-op threads stage functions get by default (see module doc)."""
    caller = torch.get_num_threads()
    if world.local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        return max(1, min(caller, host_cores() // world.local_size))
    return caller


def host_cores() -> int:
    """The cores this process may run on (its affinity where the system says)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def run_with(threads: int) -> None:
    """Have torch on the calling thread use ``threads`` intra-op threads (set once per
    thread: ``torch.set_num_threads`` also sizes this thread's OpenMP team)."""
    if getattr(_local, "threads", None) != threads:
        torch.set_num_threads(threads)
        _local.threads = threads


def check_threads(value: object) -> int | None:
    """``num_threads``: None or an int >= 1 (ValueError/TypeError naming it)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"num_threads: expected an int >= 1 or None, got {value!r}")
    if value < 1:
        raise ValueError(f"num_threads: expected an int >= 1 or None, got {value!r}")
    return value


__all__ = ["check_threads", "default_threads", "host_cores", "run_with"]
