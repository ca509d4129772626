"""The refit of ``refit.py`` where RL jobs run: in Ray actors (a local Ray cluster), which are
started by Ray — no torchrun, no mpiexec — and make their ``torch.distributed`` process group
themselves, as RL frameworks' trainer and rollout actors do. overlap finds that group
(``overlap.world``: the "process_group" source) and runs the same one-plan refit over it.

    pip install ray      # (an example: nothing in the tests needs ray)
    python examples/refit_ray.py                     # 4 actors, engine tp4
    python examples/refit_ray.py --actors 2 -- --engine colocated

Each actor calls ``dist.init_process_group("gloo", init_method="tcp://<driver's node
address>:<port>", rank=r, world_size=n)`` and then ``refit.main`` with the arguments after
``--``; the driver prints what each actor printed and exits non-zero unless every actor
passed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import socket
import sys
from pathlib import Path

import ray

EXAMPLES = Path(__file__).resolve().parent


@ray.remote(num_cpus=0)  # (the actors share this machine's cores: refit.py uses one thread)
class RefitActor:
    """One process of the job: its group, then refit.py's main."""

    def run(self, rank: int, size: int, address: str, port: int, argv: list[str]
            ) -> tuple[int, str]:
        from datetime import timedelta

        import torch.distributed as dist

        sys.path[:0] = [str(EXAMPLES.parent), str(EXAMPLES)]
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                                world_size=size, timeout=timedelta(seconds=120))
        import refit

        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                code = refit.main(argv)
        finally:
            dist.destroy_process_group()
        return code, out.getvalue()


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actors", type=int, default=4, choices=(1, 2, 4, 8, 16),
                    help="processes (a divisor of refit.py's 16 devices)")
    ap.add_argument("refit_args", nargs="*", help="refit.py's arguments (after --)")
    args = ap.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        address = ray.util.get_node_ip_address()
        port = free_port(address)
        actors = [RefitActor.remote() for _ in range(args.actors)]
        results = ray.get([a.run.remote(r, args.actors, address, port, args.refit_args)
                           for r, a in enumerate(actors)], timeout=600)
    finally:
        ray.shutdown()
    for r, (code, text) in enumerate(results):
        if text:
            print(f"actor {r} (exit {code}):\n{text.rstrip()}")
    return max(code for code, _ in results)


if __name__ == "__main__":
    sys.exit(main())
