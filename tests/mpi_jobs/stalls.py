"""A job the MPI tests start: one rank stalls, the others must name it in bounded time.

    mpiexec -n 4 python tests/mpi_jobs/stalls.py HOW WHEN RANK OUT

Every rank trains the toy pipeline (examples/toy.py) with ``Runtime(timeout=TIMEOUT_S)``; rank
RANK stalls ``WHEN`` = ``before`` its second training step (between two calls, in its own
code) or ``during`` it (inside one of its stage functions), ``HOW`` = ``sleep`` (stuck in its
own code for a minute: its process still answers) or ``stop`` (frozen by ``SIGSTOP``: nothing
of it runs). Each other rank writes ``OUT/rank<r>.json``: the error it raised and how long
after the start of the stalled step it raised it; then the error leaves its script, and the
job must end with a non-zero status.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # the toy model

import numpy as np
from toy import ToyMLP

from overlap import OverlapRuntimeError, Runtime
from scheduler import Cluster

TIMEOUT_S = 3.0


def stall(how: str) -> None:
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60.0)


def main() -> int:
    how, when, who, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    cluster = Cluster.preset("p3.8xlarge", num_hosts=4)
    with Runtime(cluster, timeout=TIMEOUT_S) as rt:
        rank = rt.world.rank
        model = ToyMLP.build(cluster, hidden=8, batch=8, seed=0)
        rng = np.random.default_rng(0)
        mbs = [rng.standard_normal((8, 8)) for _ in range(4)]
        for step in range(2):
            stages = model.stages()
            if step == 1 and rank == who:
                if when == "before":
                    stall(how)
                else:  # the first stage function of this rank stalls
                    import dataclasses

                    s = min(i for i, st in enumerate(stages)
                            if set(st.mesh.device_ids) & set(rt.local_devices))
                    inner = stages[s].forward

                    def forward(ctx, x, inner=inner):
                        if ctx.microbatch == 1:
                            stall(how)
                        return inner(ctx, x)

                    stages[s] = dataclasses.replace(stages[s], forward=forward)
            started = time.perf_counter()
            try:
                rt.train_step_sync(stages, model.boundaries(), mbs,
                                   input_sharding=model.input_sharding(), schedule="1f1b")
            except OverlapRuntimeError as exc:
                (out / f"rank{rank}.json").write_text(json.dumps({
                    "error": type(exc).__name__, "message": str(exc),
                    "seconds": time.perf_counter() - started}))
                raise
            model.zero_grad()
    return 0


if __name__ == "__main__":
    sys.exit(main())
