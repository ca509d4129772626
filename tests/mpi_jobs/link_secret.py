"""A job whose ranks disagree on the link secret: ``OVERLAP_LINK_SECRET_FILE`` set on rank 0
only (the file is ``argv[1]``). Every rank must refuse at setup, naming the variable and the
ranks without it, and write ``REFUSED <message>`` to ``OUT/rank<r>.txt`` (a file per rank: two
processes printing at once interleave their lines); none may wait on another.

    torchrun --standalone --nproc-per-node 2 tests/mpi_jobs/link_secret.py SECRET_FILE OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from overlap import Runtime
from scheduler import Cluster

rank = os.environ.get("RANK", os.environ.get("PMI_RANK"))
if rank == "0":
    os.environ["OVERLAP_LINK_SECRET_FILE"] = sys.argv[1]
verdict = Path(sys.argv[2]) / f"rank{rank}.txt"
try:
    Runtime(Cluster.preset("p3.8xlarge", num_hosts=1)).close()
except ValueError as exc:
    verdict.write_text(f"REFUSED {exc}")
    sys.exit(3)
verdict.write_text("LINKED")
