"""Name a rank that dies: ``mpiexec -n N python -m overlap.guard SCRIPT [ARGS...]``.

A rank killed by a signal (the OOM killer, ``kill -9``, a crash in native code) cannot say
anything, and MPICH ends every other rank within about a second — before any of them could
notice. The guard is the one process that can still speak: it runs the script as its child
(which inherits the launcher's PMI connection and environment, so the child *is* the MPI
rank), learns from the runtime what it is doing (one line per runtime call, over a pipe), and
when the child dies by a signal prints

    overlap: rank 1 (pid 4242 on node7) was killed by SIGKILL during train_step: the
    step graph (call 12)

and exits with the child's status (128 + signal), which makes the launcher end the job. It
is not a launcher: ``mpiexec``/``srun`` start the processes as always; the guard only wraps
each one, like ``python -m mpi4py``. Signals the guard receives (SIGINT, SIGTERM) are passed
to the child.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import threading

from .world import MPI_LAUNCHER_VARS

ENV_FD = "OVERLAP_GUARD_FD"  # the pipe the runtime reports its activity on


def _rank(env: dict[str, str]) -> str:
    for name in (*MPI_LAUNCHER_VARS, "SLURM_PROCID", "RANK"):
        if name in env:
            return env[name]
    return "?"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    read_fd, write_fd = os.pipe()
    os.set_inheritable(write_fd, True)  # pipes are not inherited by default (PEP 446)
    # "<fd>:<guard pid>": the child writes to the fd only while this guard is its parent.
    env = dict(os.environ, **{ENV_FD: f"{write_fd}:{os.getpid()}"})
    cmd = args if args[0].endswith(("python", "python3")) else [sys.executable, *args]
    # close_fds=False: the child keeps the launcher's PMI socket (PMI_FD) as the rank would.
    child = subprocess.Popen(cmd, env=env, close_fds=False)
    os.close(write_fd)
    doing = ["starting"]

    def listen() -> None:
        with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace") as f:
            for line in f:
                doing[0] = line.rstrip("\n") or doing[0]

    reader = threading.Thread(target=listen, name="overlap-guard", daemon=True)
    reader.start()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    reader.join(1.0)
    if code < 0:
        name = signal.Signals(-code).name
        sys.stderr.write(f"overlap: rank {_rank(env)} (pid {child.pid} on "
                         f"{socket.gethostname()}) was killed by {name} during {doing[0]}\n")
        sys.stderr.flush()
        return 128 - code
    return code


def guard_fd(value: str | None) -> int | None:
    """The pipe to report on, from ``OVERLAP_GUARD_FD``: only ``"<fd>:<pid>"`` where pid is
    this process's parent (the guard that started it) and fd a pipe — a value set by hand, or
    inherited from a guard further up, names nothing (no write ever reaches another file)."""
    if not value:
        return None
    fd, sep, pid = value.partition(":")
    if not sep or not fd.isdigit() or not pid.isdigit() or int(pid) != os.getppid():
        return None
    try:
        if not stat.S_ISFIFO(os.fstat(int(fd)).st_mode):
            return None
    except OSError:
        return None
    return int(fd)


def report(doing: str) -> None:
    """Tell the guard (if the process runs under one) what the runtime is doing now."""
    fd = guard_fd(os.environ.get(ENV_FD))
    if fd is None:
        return
    # No guard listening any more: nothing to tell.
    with contextlib.suppress(OSError):
        os.write(fd, (doing.replace("\n", " ") + "\n").encode())


if __name__ == "__main__":
    sys.exit(main())
