"""A job started as Ray's actors or a scheduler's workers start one: plain ``python`` processes
(no launcher, none of torchrun's variables) that each make the ``torch.distributed`` default
process group themselves, then use the runtime as under a launcher.

    python tests/mpi_jobs/process_group.py RANK SIZE PORT OUT

Every rank calls ``dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT", rank=RANK,
world_size=SIZE)``, runs the toy pipeline of ``job.py``'s ``toy`` mode (three schedules) and
saves its arrays to ``OUT/rank<r>.npz``, its links to ``OUT/links<r>.json`` and the world it
found to ``OUT/world<r>.json``. ``JOB_HOSTS=a,a,b,b`` makes rank r's host name the r-th name
(``socket.gethostname``), as ranks on several hosts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import job

from overlap import Runtime
from scheduler import Cluster


def main() -> int:
    rank, size, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \
        Path(sys.argv[4])
    hosts = os.environ.get("JOB_HOSTS")
    if hosts:
        mine = hosts.split(",")[rank]
        socket.gethostname = lambda: mine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=60))
    try:
        with Runtime(Cluster.preset("p3.8xlarge", num_hosts=4), timeout=30.0) as rt:
            (out / f"world{rank}.json").write_text(json.dumps(dataclasses.asdict(rt.world)))
            saved: dict[str, np.ndarray] = {}
            for schedule in ("gpipe", "1f1b", "eager-1f1b"):
                saved.update(job.run_toy(rt, schedule))
            job.save_links(rt, out)
            np.savez(out / f"rank{rank}.npz", **job.savable(saved))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
