"""Where a multi-process training step's time goes (a benchmark, not a test).

The toy pipeline of ``vs_torch_pipelining.py`` (4 stages of ``Linear(W, W) -> ReLU ->
Linear(W, W)``, batch 256 in 8 microbatches, SGD), one stage per process under ``mpiexec -n
4``, the CPU backend across processes. Every rank measures its own side of each step:

- **phases**: the call to its first op (graph from the cache, the call's agreement posted, the
  launch), its compute ops, its last op to the return (the drain, the agreement's end, the
  shared losses);
- **CPU and wake-ups per step by thread** (``thread_profile.py``'s roles): compute streams,
  comm streams (a transfer's part, blocked on its sends and receives until the engine
  completes them), the main thread (launch and optimizer), the event loop, the progress
  engine (``overlap-engine-r<rank>``: every wait on the wire — host-link sockets, MPI
  requests tested with backoff, the control messages' look) — read from
  ``/proc/self/task/*/schedstat`` (time on CPU, timeslices);
- **each hop of each transfer** (``rt.backend.remote.hop_timings``, the CPU data plane's
  ``WireTransport``): both sides posted → the receiver saw the message land (the engine's
  wake-up of its stream thread included) → the op returned → the compute that consumes it
  started (when its stream was idle);
- **raw MPI** between two ranks in the same job, for the boundary's message size: a blocking
  ``Send``/``Recv`` ping-pong (MPICH spins) and ``Irecv`` + ``Test`` with the engine's
  default backoff between tests (what the engine does for a request over MPI), as the floor
  a message sets.

Span times come from ``rt.timeline()`` (seconds since the call's trace started); they are
put on the ``perf_counter`` clock of the step's own marks and of the hop timings through
the hops: a transfer op ends after its hop is done, so the trace started at the latest
(hop done − its op's span end) — a few µs early (3–10 µs against the trace's own clock,
checked once on this machine).

Variants, one ``mpiexec`` job each: the data between ranks over host links (``host links``,
``OVERLAP_HOST_LINKS=1``, the default: Unix sockets, the engine woken by the message) and
over MPI (``MPI data``, ``OVERLAP_HOST_LINKS=0``: requests tested by the engine). (Before
the redesign the variants took turns step by step in one job; in separate jobs the shared
machine's drift between them is not evened out.)

Dropped with the runtime's redesign: the variant ``own threads`` (over MPI, every transfer
run by its comm stream's thread alone, against "helpers": the producer's thread posting a
send, the consumer's completing a receive) — helpers are gone and no thread polls on its
own: a transfer's part runs on its comm stream's thread, blocked until the process's one
progress engine completes its sends and receives. And "polls per receive" among the hop
figures: the engine tests every pending request in one loop; no count per receive is kept.

    python benchmarks/mpi_step_profile.py [--widths 64 1024] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from thread_profile import role, thread_cpu
from vs_torch_pipelining import STAGES, _mpiexec, make_batches, make_stages

from scheduler.cli.common import line_buffered_stdout, machine_line

MICROBATCHES, BATCH = 8, 256
# How the bytes between ranks move (one job each): variant -> OVERLAP_HOST_LINKS.
VARIANTS = {"host links": "1", "MPI data": "0"}


# ---- the worker (one per rank, under mpiexec) --------------------------------------------


def trace_origin(spans, hops) -> float:
    """The ``perf_counter`` time the step's trace started (its spans are seconds after it):
    every transfer op ends after its hop is done (a hop's ``tag`` is its op id), so the
    latest ``done - end`` over this rank's hops — a few µs early at most. NaN without hops."""
    ends: dict[int, float] = {}
    for x in spans:
        if x.stream != "compute":
            ends[x.op] = max(ends.get(x.op, float("-inf")), x.end)
    gaps = [h.done - ends[h.tag] for h in hops if h.tag in ends]
    return max(gaps) if gaps else float("nan")


def step_record(rt, t_call: float, t_ret: float, hops) -> dict:
    tl = rt.timeline()
    spans = sorted(tl.spans, key=lambda s: s.start)
    t0 = trace_origin(spans, hops)  # span times are seconds after this perf_counter mark
    compute = [s for s in spans if s.stream == "compute"]
    # A received transfer's consumer: F of the next stage (fwd), the backward of the
    # previous one (bwd); the gap counts only when the compute stream was idle meanwhile.
    # And a sent one's producer: F (fwd) or the backward (bwd) of its own stage.
    handoff, launch = [], []
    for x in spans:
        if x.stream == "compute":
            continue
        stage = x.stage + 1 if x.kind == "fwd" else x.stage - 1
        kinds = ("F",) if x.kind == "fwd" else ("B", "I")
        for i, c in enumerate(compute):
            if c.device != x.device or c.microbatch != x.microbatch:
                continue
            if c.stage == stage and c.kind in kinds:
                prev_end = max((p.end for p in compute[:i] if p.device == c.device),
                               default=-1.0)
                if c.start >= x.end and c.start >= prev_end:
                    handoff.append(c.start - max(x.end, prev_end))
            elif c.stage == x.stage and c.kind in (("F",) if x.kind == "fwd" else ("B", "I")) \
                    and x.start >= c.end:
                launch.append(x.start - c.end)
    return {
        "wall": t_ret - t_call,
        "pre": spans[0].start + t0 - t_call,
        "post": t_ret - (spans[-1].end + t0),
        "compute": sum(s.end - s.start for s in compute),
        "handoff": handoff,
        "launch": launch,
        "hops": [list(h) for h in hops],
    }


def raw_pingpong(comm, nbytes: int, rounds: int, poll) -> dict[str, float]:
    """Ranks 0 and 1: one-way time of an ``nbytes`` message, blocking and polled (``poll``:
    a ``Backoff``, slept between tests as the engine sleeps between its looks)."""
    import numpy as np
    from mpi4py import MPI

    rank = comm.Get_rank()
    buf = np.zeros(max(1, nbytes), np.uint8)
    out: dict[str, float] = {}
    for mode in ("blocking", "polled"):
        comm.Barrier()
        if rank > 1:
            continue
        peer = 1 - rank
        times = []
        for k in range(rounds + 3):
            t0 = time.perf_counter()
            for turn in (0, 1):
                if turn == rank:
                    comm.Send(buf, peer, 7)
                elif mode == "blocking":
                    comm.Recv(buf, peer, 7)
                else:
                    req, attempt = comm.Irecv(buf, peer, 7), 0
                    while not req.Test():
                        pause = poll.delay(attempt)
                        if pause:
                            time.sleep(pause)
                        attempt += 1
            if k >= 3:
                times.append((time.perf_counter() - t0) / 2)
        out[mode] = statistics.median(times)
    del MPI
    return out


def worker(cfg: dict, out: str) -> None:
    """One variant's job (its ``OVERLAP_HOST_LINKS`` set by :func:`main`); rank 0 writes
    every rank's result to ``out``."""
    import torch
    from mpi4py import MPI
    from torch import nn

    import overlap
    from overlap.backends.job.engine import Backoff
    from overlap.torch import TorchPipeline
    from scheduler import Cluster

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    cluster = Cluster.preset("p3.8xlarge", num_hosts=STAGES)
    meshes = [cluster.mesh([h], gpus=1) for h in range(STAGES)]
    pipe = TorchPipeline(make_stages(cfg["width"]), meshes, nn.functional.mse_loss)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    steps, warmup = cfg["steps"], cfg["warmup"]
    records: list[dict] = []
    cpu: dict[str, float] = {}
    wakes: dict[str, float] = {}
    span = 0.0
    batches = make_batches(warmup + steps, BATCH, cfg["width"])
    with overlap.Runtime(cluster) as rt:
        remote = rt.backend.remote  # the data plane across ranks (a WireTransport)
        for k, (x, y) in enumerate(batches):
            remote.hop_timings = []
            cpu0, c0 = thread_cpu(), time.perf_counter()
            opt.zero_grad()
            t_call = time.perf_counter()
            pipe.train_step_sync(rt, x, y, num_microbatches=MICROBATCHES, schedule="1f1b")
            t_ret = time.perf_counter()
            opt.step()
            cpu1, c1 = thread_cpu(), time.perf_counter()
            if k < warmup:
                continue
            records.append(step_record(rt, t_call, t_ret, remote.hop_timings))
            span += (c1 - c0) / steps
            for name, (secs, runs, _) in cpu1.items():
                r = role(name)
                was, ran, _ = cpu0.get(name, (0.0, 0, 0))
                cpu[r] = cpu.get(r, 0.0) + (secs - was) / steps
                wakes[r] = wakes.get(r, 0.0) + (runs - ran) / steps
        remote.hop_timings = None
        nbytes = BATCH // MICROBATCHES * cfg["width"] * 4
        # (the engine's own: make_backend gives every engine the default backoff)
        raw = raw_pingpong(rt.backend.dist.comm, nbytes, 50, Backoff())
    result = {"rank": rank, "records": records, "cpu": cpu, "wakes": wakes, "span": span,
              "raw": raw, "nbytes": nbytes, "linked": remote.links is not None}
    gathered = comm.gather(result, root=0)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


# ---- the report ----------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))] if values else float("nan")


def hop_latencies(ranks: list[dict]) -> dict[str, list[float]]:
    """Match each receive to its send (same tag, same pair of ranks, same step)."""
    out: dict[str, list[float]] = {"both posted -> landed seen": [], "receive posted early by": [],
                                   "landed seen -> op returned": [], "sender: posted -> done": []}
    steps = len(ranks[0]["records"])
    for k in range(steps):
        sends: dict[tuple[int, int, int], list] = {}
        for r in ranks:
            for tag, prev, nxt, _, posted, _, done in r["records"][k]["hops"]:
                if prev is None and nxt is not None:
                    sends[(tag, r["rank"], nxt)] = [posted, done]
        for r in ranks:
            for tag, prev, _, _, posted, landed, done in r["records"][k]["hops"]:
                if prev is None or (tag, prev, r["rank"]) not in sends:
                    continue
                s_posted, s_done = sends[(tag, prev, r["rank"])]
                out["both posted -> landed seen"].append(landed - max(posted, s_posted))
                out["receive posted early by"].append(max(0.0, s_posted - posted))
                out["landed seen -> op returned"].append(done - landed)
                out["sender: posted -> done"].append(s_done - s_posted)
    return out


def report(width: int, runs: dict[str, list[dict]]) -> str:
    """``runs``: variant -> every rank's result of that variant's job."""
    out, steps = [], {}
    for v, ranks in runs.items():
        out.append(variant_report(f"width {width}, {v}", ranks))
        steps[v] = (med([x["wall"] for x in ranks[0]["records"]]),
                    sum(sum(r["cpu"].values()) for r in ranks))
    first, *others = runs
    a_step, a_cpu = steps[first]
    for v in others:
        b_step, b_cpu = steps[v]
        out.append(f"{first} / {v}, separate jobs: rank 0's step {a_step / b_step:.3f}, "
                   f"CPU of all ranks {a_cpu / b_cpu:.3f}")
    return "\n".join(out)


def variant_report(title: str, ranks: list[dict]) -> str:
    ms = 1e3
    data = "over host links" if all(r["linked"] for r in ranks) else "over MPI"
    lines = [f"== {title}: 4 ranks, 1f1b, {MICROBATCHES} microbatches, "
             f"{len(ranks[0]['records'])} steps (medians), data between ranks {data} =="]
    lines.append(f"{'rank':<6}{'step ms':>9}{'to 1st op':>11}{'compute':>9}{'after last':>12}"
                 f"{'CPU ms/step':>13}")
    for r in ranks:
        recs = r["records"]
        lines.append(f"{r['rank']:<6}{med([x['wall'] for x in recs]) * ms:>9.1f}"
                     f"{med([x['pre'] for x in recs]) * ms:>11.2f}"
                     f"{med([x['compute'] for x in recs]) * ms:>9.1f}"
                     f"{med([x['post'] for x in recs]) * ms:>12.2f}"
                     f"{sum(r['cpu'].values()) * ms:>13.1f}")
    roles = sorted({k for r in ranks for k in r["cpu"]},
                   key=lambda k: -sum(r["cpu"].get(k, 0) for r in ranks))
    total = sum(sum(r["cpu"].values()) for r in ranks)
    span = med([r["span"] for r in ranks])
    lines.append(f"CPU per step, all ranks: {total * ms:.1f} ms in {span * ms:.1f} ms of wall "
                 f"(steps with their optimizer step) on {os.cpu_count()} cores "
                 f"= {total / span:.2f} cores busy")
    for k in roles:
        per = [r["cpu"].get(k, 0.0) * ms for r in ranks]
        runs = sum(r["wakes"].get(k, 0.0) for r in ranks)
        lines.append(f"  {k:<26}{sum(per):>7.1f} ms  (per rank: "
                     f"{', '.join(f'{v:.1f}' for v in per)}), {runs:.0f} wake-ups")
    lat = hop_latencies(ranks)
    lines.append(f"per transfer hop ({len(lat['sender: posted -> done'])} matched), median / "
                 "p90:")
    for k, v in lat.items():
        lines.append(f"  {k:<30}{med(v) * 1e6:>8.0f} / {p90(v) * 1e6:<8.0f} µs")
    sent = [h for r in ranks for x in r["records"] for h in x["launch"]]
    lines.append(f"  {'producer ends -> send op runs':<30}{med(sent) * 1e6:>8.0f} / "
                 f"{p90(sent) * 1e6:<8.0f} µs")
    hand = [h for r in ranks for x in r["records"] for h in x["handoff"]]
    lines.append(f"  {'op returned -> consumer runs':<30}{med(hand) * 1e6:>8.0f} / "
                 f"{p90(hand) * 1e6:<8.0f} µs   (its compute stream idle meanwhile)")
    raw = ranks[0]["raw"]
    lines.append(f"raw MPI, {ranks[0]['nbytes']} B one way (ranks 0-1, same job): blocking "
                 f"{raw['blocking'] * 1e6:.0f} µs (spins), Irecv + Test with the engine's "
                 f"backoff {raw['polled'] * 1e6:.0f} µs")
    return "\n".join(lines)


def main() -> int:
    line_buffered_stdout()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--worker", nargs=2, metavar=("CFG", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker[0]), args.worker[1])
        return 0
    mpiexec = _mpiexec()
    if mpiexec is None:
        print("needs mpi4py and mpiexec (pip install -e '.[mpi]')")
        return 1
    print(machine_line())
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA_"))}
    for width in args.widths:
        cfg = {"width": width, "steps": args.steps, "warmup": args.warmup}
        runs = {}
        for variant, links in VARIANTS.items():
            with tempfile.TemporaryDirectory() as tmp:
                out = str(Path(tmp) / "profile.json")
                job = subprocess.run([mpiexec, "-n", str(STAGES), sys.executable, __file__,
                                      "--worker", json.dumps(cfg), out],
                                     env={**env, "OVERLAP_HOST_LINKS": links}, timeout=900,
                                     capture_output=True, text=True)
                if job.returncode != 0:
                    print(f"width {width}, {variant}: the job failed ({job.returncode}):\n"
                          f"{job.stderr[-4000:]}")
                    return 1
                runs[variant] = json.loads(Path(out).read_text())
        print(report(width, runs))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
