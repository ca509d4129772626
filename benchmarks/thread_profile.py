"""Where a process's CPU goes, thread by thread (for the MPI benchmarks, not a benchmark):
each live thread's CPU time and how often it ran and slept, read from ``/proc/self/task``.

The runtime's threads, by role (:func:`role`): one stream thread per (device, stream) —
compute and comm — that runs only its own queue; the process's one progress engine
(``overlap-engine-r<rank>``), which owns every wait on the wire (host-link sockets, MPI
requests tested with backoff, the control messages' look); the main thread and the event
loop. (Before the redesign a link reader thread and a failure-notice listener did parts of
the engine's work; neither exists now.)"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def thread_cpu() -> dict[str, tuple[float, int, int]]:
    """Each live thread of this process, by thread name: CPU seconds so far, how many times
    it was given a CPU (schedstat's third field: every wake-up counts one), and how many
    times it went to sleep of its own accord (voluntary context switches: each is a wake-up
    to pay later). Threads of the same name (two runtimes in one process each have an
    ``overlap-d0-compute`` and an ``overlap-engine-r0``) are summed."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, tuple[float, int, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        task = Path("/proc/self/task", tid)
        try:
            ns, _, runs = (task / "schedstat").read_text().split()[:3]
            status = (task / "status").read_text()
        except (OSError, ValueError):
            continue  # ended meanwhile
        sleeps = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        name = names.get(int(tid), f"thread {tid}")
        cpu, ran, slept = out.get(name, (0.0, 0, 0))
        out[name] = (cpu + int(ns) / 1e9, ran + int(runs), slept + sleeps)
    return out


def role(name: str, main: str = "main (launch, optimizer)") -> str:
    """What a thread of the runtime does, by its name (``main``: the main thread's)."""
    if name.startswith("overlap-d") and name.endswith("-compute"):
        return "compute streams"
    if name.startswith("overlap-d"):
        return "comm streams"
    if name == "MainThread":
        return main
    if name.startswith(("uvloop", "asyncio")):
        return "event loop"
    if name.startswith("overlap-engine"):
        return "progress engine"
    return "other"
