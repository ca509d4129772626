"""MPI benchmark (not a test): resharding across 4 processes next to a raw ``MPI_Bcast``.

    mpiexec -n 4 python benchmarks/mpi_reshard.py      # (started that way if run plainly)

1. **Throughput**: the paper suite's layouts (benchmarks/suites.py, 5 × p3.8xlarge), every dim
   scaled so a tensor is about 64 MiB, planned with broadcast + auto. Host h's devices belong
   to rank h mod 4 (so hosts 0 and 4 share rank 0). For each case: GB/s of ``Runtime.reshard``
   (tensor bytes / wall time, median of 7 after a warm-up) next to a raw ``MPI_Bcast`` of the
   same bytes from the source's first rank to every rank holding destination devices (on a
   communicator of those ranks), measured in the same run, in turns (one of each variant per
   round, so load drift on the shared machine hits all alike); ratio = ours / raw.
   Destination buffers are made once and passed as ``out=`` (the raw broadcast reuses its
   buffer too); the "fresh" column lets every call allocate its destination arrays. A
   resharding writes every destination device's region into that device's own buffer, which
   the raw broadcast does not: "raw+copies" adds to it the copies a hand-written MPI program
   would make to give each local destination device its region (one device whose region is
   the whole tensor receives in place).
   The same kinds of layout change then run on 4 hosts of one device each (one device per
   rank, the default placement: a rank writes only its own buffer, as the raw broadcast
   does): one source to 1-3 replicated or split destinations, and 2 -> 2 devices rows ->
   rows, replicated -> rows, columns -> rows, rows -> replicated; 4096 x 4096 float32.
   Ours runs twice, in turns: over host links (the default: Unix sockets between the ranks of
   a host) and with every byte over MPI (``OVERLAP_HOST_LINKS=0``; column "MPI data/raw").
2. **Host overhead**: a resharding call moving 16 bytes between two ranks (agreement, launch,
   transfer, await) — every rank calling at once (the four processes' CPU shares the two
   cores), and its two ranks alone (the others made their calls ahead and sleep; also
   awaited on an asyncio loop of the caller's own instead of ``reshard_sync``) — and per
   transfer in one call of many tiny cross-rank transfers (12 here, over all four ranks),
   and what each additional transfer adds between two ranks alone (16 tiny transfers from
   rank 0 to rank 1 against the 16-byte call), over host links and
   over MPI, next to a raw 16-byte ``MPI_Bcast`` between two
   ranks and a raw wake-up round trip (1 byte each way over a Unix socket, both ranks
   asleep in ``recv``); then, rank by rank, where the tiny call's CPU goes: each thread's
   CPU and sleeps per call (event loop, progress engine, streams; ``thread_profile.py``),
   and the same for the many-transfer call.

Dropped with the runtime's redesign: **Progress** (``--progress``), the same cases over MPI
with the stream threads polling MPI requests four ways (spinning, a fixed 50 µs sleep, 64
tests before backing off, the default exponential backoff). Stream threads no longer poll:
the process's one progress engine (``overlap-engine-r<rank>``, ``overlap/backends/job/engine.py``)
tests every pending MPI request, with its ``Backoff`` (default 20 → 200 µs), and wakes the
stream thread blocked on it. ``Engine(name, poll)`` takes a ``Backoff``, but a runtime's
engine is made inside ``make_backend`` with the default, and neither ``Runtime`` nor
``make_backend`` takes one: no public way gives a runtime another policy, so the variants
cannot be run (``--progress`` says so and runs the rest).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark suites
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
from suites import Case, paper_suite
from thread_profile import role, thread_cpu

from overlap import Runtime
from overlap.world import Placement, detect_world
from scheduler import Cluster, DeviceMesh, PlanOptions, Sharding, ShardingSpec, plan_resharding
from scheduler.cli.common import line_buffered_stdout, machine_line

TARGET_BYTES = 64 << 20
REPS = 7


def scaled(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Divide the largest dims until the tensor is at most TARGET_BYTES."""
    dims = list(shape)
    while int(np.prod(dims)) * itemsize > TARGET_BYTES:
        i = int(np.argmax(dims))
        dims[i] //= 2
    return tuple(dims)


def barrier(comm, cap: float = 1e-3) -> None:
    """A barrier that sleeps while it waits: MPICH's blocking calls spin, and ranks spinning
    in a barrier would take the cores (2 here, 4 ranks) from the ranks being measured. The
    sleeps grow (50 us, doubling to ``cap``): a rank done early (one outside the call
    measured) that tested every 50 us took a fifth of a core from the two ranks still at
    work."""
    req = comm.Ibarrier()
    nap = 50e-6
    while not req.Test():
        time.sleep(nap)
        nap = min(2 * nap, cap)


def interleaved(variants: dict, comm) -> dict[str, float]:
    """Median seconds of each variant (slowest rank), measured in turns — one of each per
    round — so the shared machine's load drifts over all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up (and first-use allocations)
    for _ in range(REPS):
        for name, fn in variants.items():
            barrier(comm)
            t = time.perf_counter()
            fn()
            barrier(comm)
            times[name].append(time.perf_counter() - t)
    from mpi4py import MPI

    return {name: comm.allreduce(statistics.median(ts), op=MPI.MAX)
            for name, ts in times.items()}


def median_time(fn, comm) -> float:
    """Median seconds of ``fn`` (slowest rank of ``comm``)."""
    return interleaved({"fn": fn}, comm)["fn"]


def runtime(cluster: Cluster, world, placement, *, links: bool) -> Runtime:
    """A runtime whose data between the ranks of this host goes over host links, or over
    MPI (``links`` False); every rank makes the same."""
    os.environ["OVERLAP_HOST_LINKS"] = "1" if links else "0"
    try:
        return Runtime(cluster, world=world, placement=placement)
    finally:
        del os.environ["OVERLAP_HOST_LINKS"]


def measure(rts: dict[str, Runtime], comm, case: Case) -> tuple:
    """One case: ours over host links and over MPI (reused ``out=`` buffers), ours with
    fresh buffers, the raw broadcast and the raw broadcast plus copies, in turns."""
    rt = rts["links"]
    placement, rank = rt.backend.placement, comm.Get_rank()
    cluster = rt.cluster
    shape = scaled(case.shape, np.dtype(case.dtype).itemsize)
    plan = plan_resharding(shape, case.dtype, case.src, case.dst, cluster)
    full = np.arange(int(np.prod(shape)), dtype=case.dtype).reshape(shape)
    shards = {d: full[tuple(slice(a, b) for a, b in r)].copy()
              for d, r in case.src.device_regions(shape).items() if rt.backend.is_local(d)}
    nbytes = full.nbytes
    # Destination buffers made once and reused (``out=``), as the raw broadcast reuses
    # its buffer; "fresh" lets every call allocate (page faults on first touch).
    out = rt.reshard_sync(plan, shards)
    # Raw: broadcast the same bytes from the source's first rank to the ranks that
    # hold destination devices.
    root = placement.owners[case.src.mesh.device_ids[0]]
    members = sorted({root, *placement.ranks_of(case.dst.mesh.device_ids)})
    sub = comm.Create_group(comm.Get_group().Incl(members)) if rank in members else None
    at = members.index(root)
    buf = np.empty(shape, case.dtype)
    # What a hand-written MPI program does to give each destination device its region:
    # the broadcast, then a copy of each local device's region into its own buffer.
    regions = {d: r for d, r in case.dst.device_regions(shape).items()
               if placement.owners[d] == rank}
    whole = tuple((0, n) for n in shape)
    for d, r in regions.items():  # one device holding it all receives in place
        if tuple(r) == whole:
            del regions[d]
            break
    mine = {d: np.empty([b - a for a, b in r], case.dtype) for d, r in regions.items()}

    def raw_bcast(c=sub, b=buf, r=at) -> None:
        if c is not None:
            c.Bcast(b, root=r)

    def bcast_and_copy(c=sub, b=buf, r=at, regions=regions, mine=mine) -> None:
        if c is not None:
            c.Bcast(b, root=r)
            for d, reg in regions.items():
                np.copyto(mine[d], b[tuple(slice(x, y) for x, y in reg)])

    def ours_with(r, p=plan, s=shards, o=out):
        def call() -> None:
            r.reshard_sync(p, s, out=o)
        return call

    def fresh(p=plan, s=shards) -> None:
        rt.reshard_sync(p, s)

    variants = {"links": ours_with(rt), "MPI data": ours_with(rts["mpi"]), "fresh": fresh,
                "raw": raw_bcast, "raw_copy": bcast_and_copy}
    times = interleaved(variants, comm)
    if sub is not None:
        sub.Free()
    del mine, buf, out
    raw, raw_copy = times.pop("raw"), times.pop("raw_copy")
    return (case.name, shape, nbytes, len(members), len(case.dst.mesh.device_ids), times, raw,
            raw_copy)


def one_device_per_rank(size: int) -> list[Case]:
    """The suite's kinds of layout change on ``size`` hosts of one device each, so every rank
    holds one device (the default placement): no rank writes more than its own buffer, and the
    raw broadcast does the same work as a resharding to replicated destinations."""
    cluster = Cluster(size, 1, nic_gbps=100)
    shape = (4096, 4096)  # float32: 64 MiB

    def sh(hosts: range, *spec: object) -> Sharding:
        return Sharding(cluster.mesh(hosts, gpus=1), ShardingSpec(*spec))

    half = size // 2
    a, b = range(half), range(half, size)
    cases = [Case(f"1->{k} repl", shape, "float32", sh(range(1)), sh(range(1, 1 + k)), cluster)
             for k in range(1, size)]
    cases += [
        Case(f"1->{size - 1} split", shape, "float32", sh(range(1)),
             sh(range(1, size), "host", None), cluster),
        Case(f"{half}->{half} rows", shape, "float32", sh(a, "host", None), sh(b, "host", None),
             cluster),
        Case(f"{half}->{half} repl->rows", shape, "float32", sh(a), sh(b, "host", None),
             cluster),
        Case(f"{half}->{half} cols->rows", shape, "float32", sh(a, None, "host"),
             sh(b, "host", None), cluster),
        Case(f"{half}->{half} rows->repl", shape, "float32", sh(a, "host", None), sh(b),
             cluster),
    ]
    return cases


def table(say, rows: list[tuple]) -> None:
    """Print one throughput table and its geometric means."""
    if not rows:
        return
    say(f"{'case':<16} {'shape':>13} {'MiB':>5} {'ranks':>5} {'dst dev':>7} "
        f"{'ours GB/s':>9} {'raw GB/s':>8} {'ours/raw':>8} {'fresh/raw':>9} "
        f"{'ours/(raw+copies)':>17} {'MPI data/raw':>12}")
    ratios, fresh, fair, mpi = [], [], [], []
    for name, shape, nbytes, nranks, ndst, ours, raw, raw_copy in rows:
        t = ours["links"]
        ratios.append(raw / t)
        fresh.append(raw / ours["fresh"])
        fair.append(raw_copy / t)
        mpi.append(raw / ours["MPI data"])
        say(f"{name:<16} {'x'.join(map(str, shape)):>13} {nbytes >> 20:>5} {nranks:>5} "
            f"{ndst:>7} {nbytes / t / 1e9:>9.2f} {nbytes / raw / 1e9:>8.2f} {raw / t:>8.2f} "
            f"{fresh[-1]:>9.2f} {fair[-1]:>17.2f} {mpi[-1]:>12.2f}")
    say(f"ours/raw: geometric mean {statistics.geometric_mean(ratios):.2f}, worst "
        f"{min(ratios):.2f} (target >= 0.8); fresh buffers: geometric mean "
        f"{statistics.geometric_mean(fresh):.2f}; ours/(raw+copies): geometric mean "
        f"{statistics.geometric_mean(fair):.2f}, worst {min(fair):.2f}; over MPI instead "
        f"of host links: geometric mean {statistics.geometric_mean(mpi):.2f}")


def as_mpi_job(script: str) -> int:
    """Run ``script`` (started plainly) as a 4-process job under ``mpiexec``, with this
    process's arguments; its exit status."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", "4", sys.executable,
           script, *sys.argv[1:]]
    return subprocess.call(cmd)


def rank0_print(comm):
    """``print`` on rank 0, nothing elsewhere."""
    return print if comm.Get_rank() == 0 else (lambda *a, **k: None)


def main() -> int:
    line_buffered_stdout()
    world = detect_world()
    if not world.distributed:  # started plainly: start the 4-process job
        return as_mpi_job(__file__)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    say = rank0_print(comm)
    only = [a for a in sys.argv[1:] if not a.startswith("--")]  # case names (e.g. "case 1")
    suite = [c for c in paper_suite() if not only or c.name in only]
    cluster = paper_suite()[0].cluster
    g = cluster.gpus_per_host
    placement = Placement.explicit([(d // g) % size for d in range(cluster.num_devices)],
                                   cluster.num_devices, size)
    say(f"mpi_reshard: {size} ranks; {machine_line()}; {time.strftime('%Y-%m-%d')}")
    say(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}; mpi4py "
        f"{__import__('mpi4py').__version__}; tensors scaled to <= {TARGET_BYTES >> 20} MiB; "
        f"medians of {REPS}")
    if "--progress" in sys.argv:
        say("--progress: no longer available (the progress engine polls MPI, with no public "
            "way to give it another backoff; see the module doc)")
    rows, overhead = [], {}
    rts = {"links": runtime(cluster, world, placement, links=True),
           "mpi": runtime(cluster, world, placement, links=False)}
    with rts["links"], rts["mpi"]:
        for case in suite:
            rows.append(measure(rts, comm, case))
        for name, rt in rts.items():
            overhead[name] = host_overhead(rt, cluster, placement)
        busy = busy_ranks(rts["links"], cluster)
        raw_tiny = raw_tiny_bcast(comm)
        wake = raw_wake_round_trip(comm)
        profiles = comm.gather(overhead["links"][3], root=0)
    # The same kinds of layout change with one device per rank (second runtimes, their own
    # cluster): each rank writes only its own device's buffer, as the raw broadcast does.
    cases = [c for c in one_device_per_rank(size) if not only or c.name in only]
    single = []
    if cases:
        rts = {"links": runtime(cases[0].cluster, world, None, links=True),
               "mpi": runtime(cases[0].cluster, world, None, links=False)}
        with rts["links"], rts["mpi"]:
            for case in cases:
                single.append(measure(rts, comm, case))

    say("\n1. the paper suite's layouts (5 hosts x 4 devices on 4 ranks)")
    table(say, rows)
    say(f"\n   one device per rank ({size} hosts x 1 device, the default placement)")
    table(say, single)
    say("\nhost overhead            host links   MPI data")
    per_call = {k: v[0] for k, v in overhead.items()}
    per_transfer = {k: v[1] for k, v in overhead.items()}
    crossing = overhead["links"][2]
    say(f"  reshard call moving 16 B between 2 ranks: {per_call['links'] * 1e6:8.1f} us "
        f"{per_call['mpi'] * 1e6:8.1f} us")
    alone = {k: v[4] for k, v in overhead.items()}
    say(f"    the same, the 2 ranks' own time (the other 2 made their calls ahead, then "
        f"slept): {alone['links'] * 1e6:8.1f} us {alone['mpi'] * 1e6:8.1f} us")
    own = {k: v[6] for k, v in overhead.items()}
    say(f"    the same, awaited on the caller's own asyncio loop (not reshard_sync): "
        f"{own['links'] * 1e6:8.1f} us {own['mpi'] * 1e6:8.1f} us")
    say(f"  per transfer, {crossing} tiny cross-rank transfers in one call: "
        f"{per_transfer['links'] * 1e6:8.1f} us {per_transfer['mpi'] * 1e6:8.1f} us")
    # What each transfer adds to a call: the many-transfer call less the one-transfer one.
    extra = {k: (per_transfer[k] * crossing - per_call[k]) / max(1, crossing - 1)
             for k in overhead}
    say(f"  each additional transfer (that call less the 16 B one): {extra['links'] * 1e6:8.1f}"
        f" us {extra['mpi'] * 1e6:8.1f} us")
    pair = {k: v[5] for k, v in overhead.items()}
    say(f"  each additional transfer between 2 ranks alone ({PAIR_TRANSFERS} x 16 B, rank 0's "
        f"4 devices to rank 1's, less the 16 B call): {pair['links'] * 1e6:8.1f} us "
        f"{pair['mpi'] * 1e6:8.1f} us")
    say(f"  raw MPI_Bcast of 16 B between 2 ranks:    {raw_tiny * 1e6:8.1f} us")
    say("  one 16 B transfer sent and one received by each rank of a call (host links): "
        "wall per call, the members' CPU per call")
    for name, (took, cpu) in busy.items():
        say(f"    {name}: {took * 1e6:8.1f} us, {cpu * 1e6:6.1f} us a rank")
    say(f"  raw wake-up round trip between 2 ranks (1 B each way over a Unix socket, both "
        f"asleep in recv): {wake * 1e6:.1f} us")
    print_profiles(say, profiles or [])
    return 0


def send_recv_plan(cluster: Cluster, shape: tuple[int, ...], src: Any, src_spec: tuple,
                   dst: Any, dst_spec: tuple):
    """A float64 plan whose every overlap of a source and a destination region is one
    transfer as it is (``send_recv``, no balancing): meshes of device ids over ("host",
    "gpu"), specs as :class:`ShardingSpec`'s entries."""
    return plan_resharding(shape, "float64",
                           Sharding(DeviceMesh(src, ("host", "gpu")), ShardingSpec(*src_spec)),
                           Sharding(DeviceMesh(dst, ("host", "gpu")), ShardingSpec(*dst_spec)),
                           cluster, PlanOptions(strategy="send_recv", balance="none"))


def host_overhead(rt: Runtime, cluster: Cluster, placement
                  ) -> tuple[float, float, int, dict, float, float, float]:
    """Seconds per resharding call moving 16 bytes between two ranks, seconds per transfer
    in one call of many tiny cross-rank transfers, how many those are, where this rank's
    CPU goes in the tiny call and in the many-transfer one (:func:`call_profile`), the
    tiny call's seconds on its two ranks alone (:func:`members_alone`), the seconds each
    additional transfer adds on two ranks alone (:func:`pair_per_transfer`), and the tiny
    call's seconds on its two ranks alone awaited on an event loop of the caller's own."""
    comm = rt.backend.dist.comm
    a = Sharding(DeviceMesh([[0]], ("host", "gpu")), ShardingSpec())
    b = Sharding(DeviceMesh([[4]], ("host", "gpu")), ShardingSpec())
    tiny = plan_resharding((2,), "float64", a, b, cluster)
    tiny_shards = {0: np.ones(2)} if rt.backend.is_local(0) else {}
    # (200 calls a sample: the closing barrier's wake-up, up to a millisecond, is 2% of it)
    per_call = median_time(lambda: [rt.reshard_sync(tiny, tiny_shards) for _ in range(200)],
                           comm) / 200
    grid = np.arange(16).reshape(4, 4)
    many = send_recv_plan(cluster, (16, 16), grid, ("host", "gpu"), grid, ("gpu", "host"))
    crossing = sum(1 for t in many.transfers if len(placement.ranks_of(t.devices)) > 1)
    full = np.arange(256.0).reshape(16, 16)
    many_shards = {d: full[tuple(slice(x, y) for x, y in r)].copy()
                   for d, r in many.src.device_regions((16, 16)).items()
                   if rt.backend.is_local(d)}
    per_transfer = median_time(lambda: [rt.reshard_sync(many, many_shards) for _ in range(20)],
                               comm) / 20 / crossing
    alone = members_alone(rt, tiny, tiny_shards)
    own = asyncio.new_event_loop()  # (an async trainer's loop: not the runtime's)
    try:
        awaited = members_alone(rt, tiny, tiny_shards, loop=own)
    finally:
        own.close()
    return per_call, per_transfer, crossing, {
        "tiny call": call_profile(rt, tiny, tiny_shards),
        f"{len(many.transfers)}-transfer call": call_profile(rt, many, many_shards, 200)}, \
        alone, pair_per_transfer(rt, cluster, alone), awaited


PAIR_TRANSFERS = 16


def pair_per_transfer(rt: Runtime, cluster: Cluster, tiny_alone: float) -> float:
    """Seconds each additional transfer adds to a call between two ranks alone, as a raw
    message between two ranks is measured: rank 0's four devices hold column blocks of a
    4 x 8 float64 tensor, rank 1's four take row blocks — 16 transfers of 16 contiguous
    bytes, all from rank 0 to rank 1 — timed on those two ranks alone
    (:func:`members_alone`), less the 16 B call (``tiny_alone``), over the 15 more.

    The many-transfer call above spreads its transfers over all four ranks, three peers
    each, and every rank is busy: four processes share the two cores there, and each
    rank's CPU per message grows with that (docs/benchmarks.md)."""
    plan = send_recv_plan(cluster, (4, 8), [[0, 1, 2, 3]], (None, "gpu"), [[4, 5, 6, 7]],
                          ("gpu",))
    assert len(plan.transfers) == PAIR_TRANSFERS
    shards = {d: np.full((4, 2), float(d)) for d in range(4) if rt.backend.is_local(d)}
    took = members_alone(rt, plan, shards, calls=300)
    return (took - tiny_alone) / (PAIR_TRANSFERS - 1)


def swap_plan(cluster: Cluster):
    """16 B each way between host 0's first device and host 1's."""
    return send_recv_plan(cluster, (4,), [[0], [4]], ("host",), [[4], [0]], ("host",))


def ring_plan(cluster: Cluster, ranks: int):
    """16 B from each of ``ranks`` hosts' first device to the next host's (the last to the
    first): a send and a receive on every member."""
    firsts = [[4 * h] for h in range(ranks)]
    return send_recv_plan(cluster, (2 * ranks,), firsts, ("host",), [*firsts[1:], firsts[0]],
                          ("host",))


def busy_ranks(rt: Runtime, cluster: Cluster, calls: int = 300
               ) -> dict[str, tuple[float, float]]:
    """The same work on each rank — one 16 B transfer sent, one received — in a call of two
    ranks (0 and 1 swap; the other two made their calls ahead and sleep) and of all four (a
    ring: 0 -> 1 -> 2 -> 3 -> 0): seconds per call (slowest rank) and the members' mean main-
    thread CPU seconds per call. Four busy processes share the two cores in the ring; the
    swap is measured again with the other two ranks in a CPU-bound loop (the cores shared
    as much, with processes that hand no messages around)."""
    from mpi4py import MPI

    comm = rt.backend.dist.comm
    swap, ring = swap_plan(cluster), ring_plan(cluster, 4)
    out = {}
    for name, p, hog in (("2 ranks (a swap)", swap, False),
                         ("2 ranks (a swap), the other 2 in a CPU-bound loop", swap, True),
                         ("4 ranks (a ring)", ring, False)):
        shards = {d: np.ones(2) for d in p.src.mesh.device_ids if rt.backend.is_local(d)}
        owners = rt.backend.placement.ranks_of(p.src.mesh.device_ids)
        member = comm.Get_rank() in owners
        cpu = time.thread_time()
        took = members_alone(rt, p, shards, calls, hog=hog)
        cpu = (time.thread_time() - cpu) / ((REPS + 1) * calls) if member else 0.0
        out[name] = took, comm.allreduce(cpu, op=MPI.SUM) / len(owners)
    return out


def members_alone(rt: Runtime, plan, shards, calls: int = 1000, hog: bool = False,
                  loop: asyncio.AbstractEventLoop | None = None) -> float:
    """Seconds per call of ``plan`` on its members (slowest), the other ranks idle: they make
    their ``calls`` first — a rank outside a call goes on without waiting for its members —
    and sleep in the barrier (20 ms naps) while the members make theirs. Four processes
    share two cores here; with every rank calling at once (the figure above) the others'
    CPU (~30 us a call each) is spent on the members' cores too. ``hog``: the others spin a
    CPU-bound loop instead of sleeping (the cores shared, but not with runtime processes).
    ``loop``: the members await their calls on this event loop of their own (an async
    trainer's), not through ``reshard_sync``."""

    async def awaited() -> None:
        for _ in range(calls):
            await rt.reshard(plan, shards)

    def make_calls() -> None:
        if loop is None:
            for _ in range(calls):
                rt.reshard_sync(plan, shards)
        else:
            loop.run_until_complete(awaited())

    comm = rt.backend.dist.comm
    owners = rt.backend.placement.ranks_of((*plan.src.mesh.device_ids,
                                            *plan.dst.mesh.device_ids))
    member = comm.Get_rank() in owners
    times = []
    for _ in range(REPS + 1):  # (the first: a warm-up)
        if not member:
            for _ in range(calls):
                rt.reshard_sync(plan, shards)
        barrier(comm)
        t = time.perf_counter()
        if member:
            make_calls()
        times.append((time.perf_counter() - t) / calls)
        # Idle: the others test the barrier every 20 ms, not every millisecond (a wake-up
        # of theirs a millisecond put the members' two-process ping-pong off by ~25 %).
        if hog and not member:
            busy_barrier(comm)
        else:
            barrier(comm, cap=20e-3)
    from mpi4py import MPI

    return comm.allreduce(statistics.median(times[1:]), op=MPI.MAX)


def busy_barrier(comm) -> None:
    """A barrier waited for in a CPU-bound loop of plain Python arithmetic."""
    req = comm.Ibarrier()
    x = 0
    while not req.Test():
        for i in range(20000):
            x += i


def call_profile(rt: Runtime, plan, shards, calls: int = 600) -> dict[str, tuple[float, float]]:
    """Per thread of this rank (grouped by role): CPU microseconds and sleeps per tiny call."""
    barrier(rt.backend.dist.comm)
    before = thread_cpu()
    for _ in range(calls):
        rt.reshard_sync(plan, shards)
    after = thread_cpu()
    roles: dict[str, tuple[float, float]] = {}
    for name, (cpu, _, n) in after.items():
        c0, _, n0 = before.get(name, (0.0, 0, 0))
        r = role(name, main="event loop (main thread)")
        c, k = roles.get(r, (0.0, 0.0))
        roles[r] = (c + (cpu - c0) / calls * 1e6, k + (n - n0) / calls)
    return roles


def print_profiles(say, profiles: list[dict[str, dict[str, tuple[float, float]]]]) -> None:
    """Rank 0's table of :func:`call_profile` for every rank, per call measured."""
    for call in (profiles[0] if profiles else {}):
        say(f"  where the {call}'s CPU goes (host links), per rank: CPU us / sleeps per call")
        for r, by_call in enumerate(profiles):
            roles = by_call[call]
            total = sum(c for c, _ in roles.values())
            say(f"    rank {r}: {total:6.0f} us in all; " + "; ".join(
                f"{role} {c:.0f} us / {k:.1f}" for role, (c, k) in sorted(roles.items())
                if c >= 1 or k >= 0.1))


def raw_wake_round_trip(comm, n: int = 2000) -> float:
    """Seconds of a 1-byte ping-pong between ranks 0 and 1 over a Unix socket, each side
    asleep in a blocking receive: two wake-ups across processes and nothing else — the floor
    under every hop that sleeps instead of spinning."""
    import socket

    from mpi4py import MPI

    rank = comm.Get_rank()
    addr = comm.bcast(f"\0overlap-bench-{os.getpid()}" if rank == 0 else None, root=0)
    sock = None
    if rank == 0:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(addr)
        server.listen(1)
        comm.Barrier()
        sock, _ = server.accept()
        server.close()
    else:
        comm.Barrier()
        if rank == 1:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(addr)
    took = 0.0
    if sock is not None:
        t = time.perf_counter()
        for _ in range(n):
            if rank == 0:
                sock.sendall(b"x")
                sock.recv(1)
            else:
                sock.recv(1)
                sock.sendall(b"x")
        took = (time.perf_counter() - t) / n
        sock.close()
    barrier(comm)  # (ranks 2 and 3 sleep meanwhile: MPICH's allreduce would spin)
    return comm.allreduce(took, op=MPI.MAX)


def raw_tiny_bcast(comm) -> float:
    """Seconds per raw 16-byte ``MPI_Bcast`` between ranks 0 and 1 (slowest rank)."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    pair = comm.Create_group(comm.Get_group().Incl([0, 1])) if rank < 2 else None
    tiny_buf = np.ones(2)
    raw_tiny = 0.0
    if pair is not None:
        # (5000 a sample: the closing sleepy barrier's wake-up, up to a few milliseconds,
        # is then under a microsecond a message — with 50 it was most of the figure)
        raw_tiny = median_time(lambda: [pair.Bcast(tiny_buf, root=0) for _ in range(5000)],
                               pair) / 5000
        pair.Free()
    barrier(comm, cap=20e-3)  # (ranks 2 and 3 sleep meanwhile: MPICH's allreduce would spin)
    return comm.allreduce(raw_tiny, op=MPI.MAX)


if __name__ == "__main__":
    sys.exit(main())
