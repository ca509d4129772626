"""MPI benchmark (not a test): a measured RL weight refit — a whole model state moved by one
planned ``Runtime.reshard_state`` call — next to the naive gather + broadcast a user writes,
in the same run, under ``mpiexec -n 4``.

    mpiexec -n 4 python benchmarks/state_reshard_mpi.py      # (started that way if run plainly)
        [--engine disjoint|colocated] [--layers 8] [--width 512] [--bucket-mib 8]

**The state**: a Llama-like model in bfloat16 — vocabulary-parallel embedding and output
head, per layer two RMSNorm weights, q/k/v (grouped-query: k and v a quarter of q), o, and a
SwiGLU MLP (gate, up, down) — 75 tensors, 59 MiB at the defaults.

**The layouts** (4 hosts of 2 devices, one rank per host, the default placement):

- trainer: PP 2 × TP 2 — stage 0 (embedding, first half of the layers) on devices 0, 1
  (rank 0), stage 1 (second half, final norm, head) on devices 2, 3 (rank 1); Megatron's
  split: q, k, v, gate, up, embedding and head by rows, o and down by columns, norms
  replicated;
- engine ``disjoint`` (the default): TP 2 on devices 4 and 6 (ranks 2 and 3), the same split;
- engine ``colocated``: TP 2 on devices 1 and 3 (ranks 0 and 1: the trainer's own GPUs).

**Per refit, in turns** (one of each per round, medians of 7 after a warm-up, the slowest
rank): (1) *planned*: ``rt.reshard_state_sync(plan, shards, out=out)`` over host links (the
default) and with every byte over MPI (``OVERLAP_HOST_LINKS=0``); (2) *naive*: what a user
writes with ``mpi4py`` (veRL's NCCL engine does the same with NCCL collectives): for every
tensor in turn, its stage assembles it whole (a copy of its TP shards) and sends it to rank
0, rank 0 broadcasts it to the engine's ranks, and each engine device copies its region out.
Both reuse their destination buffers. The destination of both is checked against the source
state, byte for byte, on every engine rank.

**Its own bound**: ``Runtime(emulate_links=...)`` is refused with more than one process, so
the plan's links are this machine's. Their rate is measured in the same run by a raw MPI
probe: a 32 MiB ``Send``/``Recv`` from each trainer rank to an engine rank (0 -> 2 and
1 -> 3; colocated: 0 -> 1 and 1 -> 0), both pairs at once, as the plan moves them, and one
pair alone; and a ``numpy.copyto`` of 32 MiB for a copy between two devices of one rank.
The plan is made for a cluster of those rates (one NIC per host at the both-pairs rate,
NVLink at the copy rate), so ``plan.bound_seconds`` is the state's lower bound
(``scheduler.state_lower_bound``) on this machine's measured links. Four processes share
the machine's cores (two here): the bound treats every rank's link as its own, which the
cores may not allow — the table says how far the planned refit is from it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # (state_arrays)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
from mpi_reshard import as_mpi_job, barrier, interleaved, rank0_print, runtime
from state_arrays import box, full_tensors
from thread_profile import role, thread_cpu

from overlap.world import detect_world
from scheduler import (
    Cluster,
    DeviceMesh,
    P,
    Sharding,
    StateOptions,
    StateTensor,
    plan_state_resharding,
)
from scheduler.cli.common import line_buffered_stdout, machine_line, positive_int
from scheduler.dtypes import check_dtype
from scheduler.plan import fmt_bytes

DTYPE = "bfloat16"
PROBE_BYTES = 32 << 20
GOAL = 0.5  # planned / naive
ENGINES = ("disjoint", "colocated")
State = dict[str, dict[int, np.ndarray]]


def llama_shapes(layers: int, width: int, vocab: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind) of a Llama-like model: kind ``col`` (rows split by TP), ``row``
    (columns split), ``rep`` (replicated)."""
    kv, mlp = width // 4, (11 * width) // 4
    out: dict[str, tuple[tuple[int, ...], str]] = {"embed_tokens": ((vocab, width), "col")}
    for i in range(layers):
        p = f"layers.{i}."
        out |= {p + "input_layernorm": ((width,), "rep"),
                p + "attn.q_proj": ((width, width), "col"),
                p + "attn.k_proj": ((kv, width), "col"), p + "attn.v_proj": ((kv, width), "col"),
                p + "attn.o_proj": ((width, width), "row"),
                p + "post_attention_layernorm": ((width,), "rep"),
                p + "mlp.gate_proj": ((mlp, width), "col"),
                p + "mlp.up_proj": ((mlp, width), "col"),
                p + "mlp.down_proj": ((width, mlp), "row")}
    return out | {"norm": ((width,), "rep"), "lm_head": ((vocab, width), "col")}


def refit_state(layers: int, width: int, vocab: int, engine: str) -> dict[str, StateTensor]:
    """The state from the trainer's PP 2 x TP 2 (devices 0-3) to the engine's TP 2."""
    specs = {"col": P("tp", None), "row": P(None, "tp"), "rep": P()}
    stages = [DeviceMesh([0, 1], ("tp",)), DeviceMesh([2, 3], ("tp",))]
    infer = DeviceMesh([4, 6] if engine == "disjoint" else [1, 3], ("tp",))
    out = {}
    for name, (shape, kind) in llama_shapes(layers, width, vocab).items():
        if name.startswith("layers."):
            stage = int(int(name.split(".")[1]) >= layers // 2)
        else:
            stage = 0 if name == "embed_tokens" else 1
        out[name] = StateTensor(shape, DTYPE, Sharding(stages[stage], specs[kind]),
                                Sharding(infer, specs[kind]))
    return out


def local_shards(tensors, full, local: set[int], side: str) -> State:
    """This rank's shards of every tensor, of the source (``side`` "src") or a fresh zeroed
    destination ("dst")."""
    out: State = {}
    for name, t in tensors.items():
        regions = getattr(t, side).device_regions(t.shape)
        out[name] = {d: (np.ascontiguousarray(full[name][box(r)]) if side == "src" else
                         np.zeros([b - a for a, b in r], full[name].dtype))
                     for d, r in regions.items() if d in local}
    return out


def as_bytes(a: np.ndarray) -> Any:
    from mpi4py import MPI

    return [a.view(np.uint8), MPI.BYTE]


@dataclass
class Naive:
    """The naive refit of one rank: per tensor, gather to rank 0, broadcast to the engine."""

    tensors: dict[str, StateTensor]
    shards: State
    out: State
    owner: Any  # device -> rank
    comm: Any
    bcast: Any  # communicator of rank 0 and the engine's ranks (None elsewhere)
    whole: dict[str, np.ndarray]  # one buffer per tensor, on the ranks that need it
    moved: int  # bytes between ranks: the gather's sends to rank 0, the broadcasts' copies

    def __call__(self) -> None:
        rank = self.comm.Get_rank()
        for name, t in self.tensors.items():
            src = t.src.device_regions(t.shape)
            stage = self.owner(next(iter(src)))
            buf = self.whole.get(name)
            if rank == stage:  # the stage assembles it (its TP shards are its own)
                for d, r in src.items():
                    np.copyto(buf[box(r)], self.shards[name][d])
                if rank != 0:
                    self.comm.Send(as_bytes(buf), dest=0, tag=7)
            elif rank == 0:
                self.comm.Recv(as_bytes(buf), source=stage, tag=7)
            if self.bcast is not None:
                self.bcast.Bcast(as_bytes(buf), root=0)
                for d, r in t.dst.device_regions(t.shape).items():
                    if d in self.out[name]:
                        np.copyto(self.out[name][d], buf[box(r)])


def naive_refit(tensors, shards: State, out: State, rt, comm) -> Naive:
    owner = rt.backend.placement.owners.__getitem__
    rank = comm.Get_rank()
    engine = sorted({owner(d) for t in tensors.values() for d in t.dst.mesh.device_ids})
    members = sorted({0, *engine})
    bcast = comm.Create_group(comm.Get_group().Incl(members)) if rank in members else None
    stages = {owner(d) for t in tensors.values() for d in t.src.mesh.device_ids}
    needs = rank in members or rank in stages
    whole = {n: np.empty(t.shape, check_dtype(t.dtype)) for n, t in tensors.items()} \
        if needs else {}
    moved = sum(t.nbytes * ((owner(t.src.mesh.device_ids[0]) != 0) + len(members) - 1)
                for t in tensors.values())
    return Naive(tensors, shards, out, owner, comm, bcast, whole, moved)


def probe(comm, pairs: list[tuple[int, int]]) -> tuple[float, float, float]:
    """Bytes/s of a raw MPI Send/Recv of PROBE_BYTES on every pair at once, on the first pair
    alone, and of a local ``numpy.copyto`` of as many bytes (medians, slowest rank)."""
    rank = comm.Get_rank()
    buf = np.ones(PROBE_BYTES, np.uint8)
    dst = np.empty_like(buf)

    def move(chosen: list[tuple[int, int]]):
        def go() -> None:
            for a, b in chosen:
                if rank == a:
                    comm.Send(buf, dest=b, tag=9)
                elif rank == b:
                    comm.Recv(dst, source=a, tag=9)
        return go

    def copy() -> None:
        np.copyto(dst, buf)

    t = interleaved({"all": move(pairs), "alone": move(pairs[:1]), "copy": copy}, comm)
    return PROBE_BYTES / t["all"], PROBE_BYTES / t["alone"], PROBE_BYTES / t["copy"]


def rated_cluster(link: float, copy: float) -> Cluster:
    """4 hosts of 2 devices whose NIC runs at ``link`` bytes/s and NVLink at ``copy``."""
    return Cluster(4, 2, nic_gbps=link * 8 / 1e9, nvlink_gbps=copy * 8 / 1e9)


def wrong_shards(tensors, full, out: State) -> int:
    """Destination shards of this rank that differ from the source state, byte for byte."""
    wrong = 0
    for name, t in tensors.items():
        for d, r in t.dst.device_regions(t.shape).items():
            if d in out[name]:
                want = np.ascontiguousarray(full[name][box(r)]).view(np.uint8)
                wrong += not np.array_equal(out[name][d].view(np.uint8), want)
    return wrong


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=ENGINES, default="disjoint")
    ap.add_argument("--layers", type=positive_int, default=8)
    ap.add_argument("--width", type=positive_int, default=512)
    ap.add_argument("--vocab", type=positive_int, default=8192)
    ap.add_argument("--bucket-mib", type=positive_int, default=8,
                    help="the plan's bucket: most staged bytes per device at a time")
    ap.add_argument("--phases", action="store_true",
                    help="also time the phases of one traced planned refit per rank")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    line_buffered_stdout()
    args = parse(argv)
    world = detect_world()
    if not world.distributed:  # started plainly: start the 4-process job
        return as_mpi_job(__file__)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    say = rank0_print(comm)
    if comm.Get_size() != 4:
        say("state_reshard_mpi.py: run it with 4 processes (mpiexec -n 4)")
        return 2
    tensors = refit_state(args.layers, args.width, args.vocab, args.engine)
    full = full_tensors(tensors, seed=48)  # (the same on every rank)
    pairs = [(0, 2), (1, 3)] if args.engine == "disjoint" else [(0, 1), (1, 0)]
    link, alone, copy = probe(comm, pairs)
    cluster = rated_cluster(link, copy)
    t0 = time.perf_counter()
    plan = plan_state_resharding(tensors, cluster, StateOptions(bucket_bytes=args.bucket_mib << 20))
    planning = time.perf_counter() - t0
    rts = {"links": runtime(cluster, world, None, links=True),
           "mpi": runtime(cluster, world, None, links=False)}
    with rts["links"], rts["mpi"]:
        rt = rts["links"]
        local = set(rt.local_devices)
        shards = local_shards(tensors, full, local, "src")
        outs = {k: local_shards(tensors, full, local, "dst") for k in ("links", "mpi", "naive")}
        naive = naive_refit(tensors, shards, outs["naive"], rt, comm)

        def planned(name: str):
            return lambda: rts[name].reshard_state_sync(plan, shards, out=outs[name])

        times = interleaved({"planned": planned("links"), "planned over MPI": planned("mpi"),
                             "naive": naive}, comm)
        wrong = comm.allreduce(sum(wrong_shards(tensors, full, o) for o in outs.values()),
                               op=MPI.SUM)
        if args.phases:
            found = phases(rt, plan, shards, outs["links"], comm)
            barrier(comm)
            cpu = time.process_time()
            naive()
            found["naive's process CPU"] = time.process_time() - cpu
            profiles = comm.gather(found, root=0)
        barrier(comm)
    report(say, args, tensors, plan, planning, times, (link, alone, copy), wrong, naive.moved)
    if args.phases:
        say("\none traced planned refit (host links), per rank: ms from the call's start "
            "(GB/s: the rank's transfer bytes over its summed op time)")
        for r, ph in enumerate(profiles or []):
            say(f"  rank {r}: " + "; ".join(
                f"{k} {v:.2f}" if k == "op GB/s" else f"{k} {v:.0f}" if k == "ops"
                else f"{k} {v * 1e3:.1f}" for k, v in ph.items()))
    return 1 if wrong else 0


def phases(rt, plan, shards: State, out: State, comm) -> dict[str, float]:
    """Where one traced planned refit's time goes on this rank (seconds): the call's wall
    time; the process's CPU, in all and per thread role (event loop, progress engine, comm
    streams); from the call's start, its first transfer's start (the gate, the agreement
    across ranks, the launch) and its last transfer's end; the seconds its devices' comm
    streams were busy (the union of their spans, summed over devices) and its ops' summed
    time (more than the busy time: a device's ops overlap, a receive waits for its sender);
    and the bytes/s of its transfers while they ran (this rank's transfer bytes over their
    summed op time)."""
    barrier(comm)
    t, cpu, threads = time.perf_counter(), time.process_time(), thread_cpu()
    rt.reshard_state_sync(plan, shards, out=out, trace=True)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    roles: dict[str, float] = {}
    for name, (seconds, _, _) in thread_cpu().items():
        r = f"CPU {role(name, main='event loop')}"
        roles[r] = roles.get(r, 0.0) + seconds - threads.get(name, (0.0, 0, 0))[0]
    roles = {r: c for r, c in roles.items() if c >= 1e-4}
    spans = [s for s in rt.timeline().spans if s.end > s.start]
    if not spans:
        return {"wall": wall, "process CPU": cpu, **roles}
    order = plan.launch_order
    moved = sum(plan.plans[order[s.op][0]].transfers[order[s.op][1]].nbytes for s in spans)
    busy = sum(_union([(s.start, s.end) for s in spans if s.device == d])
               for d in {s.device for s in spans})
    ops = sum(s.end - s.start for s in spans)
    return {"wall": wall, "process CPU": cpu, **roles, "first start": min(s.start for s in spans),
            "last end": max(s.end for s in spans), "busy (devices summed)": busy,
            "op time summed": ops, "op GB/s": moved / ops / 1e9, "ops": float(len(spans))}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        total += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    return total


def report(say, args, tensors, plan, planning: float, times: dict[str, float],
           rates: tuple[float, float, float], wrong: int, naive_moved: int) -> None:
    """Rank 0's table."""
    link, alone, copy = rates
    nbytes = sum(t.nbytes for t in tensors.values())
    say(f"state_reshard_mpi: 4 ranks; {machine_line()}; {time.strftime('%Y-%m-%d')}")
    say(f"state: Llama-like, {args.layers} layers, width {args.width}, vocabulary {args.vocab}, "
        f"{DTYPE}: {len(tensors)} tensors, {fmt_bytes(nbytes)}; trainer PP 2 x TP 2 (ranks 0-1)"
        f" -> engine TP 2 ({args.engine}: ranks "
        f"{'2-3' if args.engine == 'disjoint' else '0-1'}); medians of 7, slowest rank")
    say(f"links measured in this run (raw MPI Send/Recv of {PROBE_BYTES >> 20} MiB): "
        f"{link / 1e9:.2f} GB/s a pair with both pairs at once, {alone / 1e9:.2f} GB/s one pair "
        f"alone; local copy {copy / 1e9:.2f} GB/s")
    say(f"plan: {plan.num_transfers} transfers in {len(plan.buckets)} buckets of <= "
        f"{fmt_bytes(plan.bucket_bytes)}, {fmt_bytes(plan.network_bytes)} over the network, "
        f"peak staging {fmt_bytes(max(plan.peak_staging_bytes.values(), default=0))} a device; "
        f"bound {plan.bound_seconds * 1e3:.1f} ms at the measured rates; planned in "
        f"{planning:.2f} s; the naive refit moves {fmt_bytes(naive_moved)} between ranks")
    say(f"\n{'refit':<18} {'ms':>8} {'GB/s':>6} {'/ naive':>8} {'/ bound':>8}")
    naive = times["naive"]
    for name, t in times.items():
        say(f"{name:<18} {t * 1e3:>8.1f} {nbytes / t / 1e9:>6.2f} {t / naive:>8.3f} "
            f"{t / plan.bound_seconds:>8.2f}")
    ratio = times["planned"] / naive
    verdict = "met" if ratio <= GOAL else "NOT met"
    say(f"\nplanned / naive: {ratio:.3f} x (goal <= {GOAL}: {verdict}); planned / its bound: "
        f"{times['planned'] / plan.bound_seconds:.2f} x")
    exact = f"{wrong} shards WRONG" if wrong else "every destination shard equals the source"
    say(f"exactness: {exact} (planned over links, over MPI, and naive)")


if __name__ == "__main__":
    sys.exit(main())
