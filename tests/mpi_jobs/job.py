"""A job the MPI tests start with ``mpiexec -n N python tests/mpi_jobs/job.py MODE OUT [ARGS]``.

Every rank runs this same script (as a user's would). Modes:

- ``toy OUT``: the toy pipeline (examples/toy.py), two SGD steps per schedule; each rank saves the
  losses it got and its own devices' gradients and weights to ``OUT/rank<r>.npz``, and its
  host links (peers, messages) to ``OUT/links<r>.json``.

Every mode: ``JOB_HOSTS=a,a,b,b`` in the environment makes rank r say it runs on the r-th
host named (``MPI.Get_processor_name``), and ``OVERLAP_HOST_LINKS=0`` moves all data over MPI.
- ``reshard OUT CASES [cuda]``: every plan in the JSON file CASES, on shards made from the
  tensor ``arange`` (broadcasts cut in ``chunk_bytes`` pieces when CASES sets it); each rank
  saves its destination shards. With ``cuda``: on the CUDA
  backend across processes (one device per rank), run on the numpy stand-in for CuPy with
  links that move NCCL's bytes over MPI (``HostMpiLinks``), plus a 2-stage pipeline whose
  last stage all-reduces across ranks (saved as ``pipe/...``).
- ``raise OUT RANK``: as ``toy``, but rank RANK's stage 2/3 backward raises in step 1.
- ``kill OUT RANK``: as ``toy``, but rank RANK kills itself (SIGKILL) in a stage function.
- ``outside OUT RANK``: rank RANK raises in the script itself between two steps.
- ``differ OUT RANK [LATE]``: rank RANK runs another schedule than the others; rank LATE
  makes the call a second late, when the others have already reported the mismatch.
- ``silent OUT``: rank 1 waits on a broadcast rooted on rank 0, which never sends (backend
  level, through the documented backend protocol; timeout 2 s).
- ``nccl OUT``: NCCL communicators bootstrapped with a stand-in NCCL (no GPU) over what the
  runtime bootstraps them with (MPI, or the links under torchrun): each rank saves the
  (size, id, rank) its communicators were made with.
- ``stuck OUT RANK``: rank RANK is stuck in its own code (a minute) instead of making a
  resharding call the others make (their timeout: 2 s).
- ``leave OUT RANK HOW [seen]``: after one resharding call, rank RANK leaves — ``exit``
  (``sys.exit(0)``) or ``close`` (closes its runtime, then idles) — while the others make a
  second call (their timeout: 30 s, which must not be what finds it); with ``seen``, only
  once their host link to RANK has closed.
- ``pair OUT [differ]``: five resharding calls between rank 0's devices and rank 1's, made
  by every rank; each saves what it received, its call count and how many messages its host
  links moved meanwhile. With ``differ``, rank 1's plan differs from rank 0's (another
  destination layout on the same devices).
- ``ahead OUT``: a resharding call between ranks 0 and 1 where rank 0 passes a bad shard
  (its error ends its script), then a call on a new channel (its communicator is made by
  every rank): ranks 2 and 3, which had no part in the first call, reach the second.
- ``slow OUT``: a resharding call from a device of rank 0 to one of rank 1 in four pieces,
  whose sends each start 0.7 s late (2.8 s in all, past the 2 s timeout; no op near it), then a
  call among every rank, which ranks 2 and 3 reach long before 0 and 1.
- ``loops OUT``: resharding calls between rank 0's devices and rank 1's, alternately
  ``reshard_sync`` and ``reshard`` awaited on loops of ``asyncio.run`` (a new event loop
  each time); each rank saves what it received.
- ``hops OUT``: one resharding whose every cross-rank hop is timed (``hop_timings``).
- ``vary OUT [permute RANK]``: the toy pipeline on microbatches of different shapes, one step
  per schedule (see ``run_varied``); with ``permute RANK`` that rank's first two microbatches
  are swapped.
- ``faults OUT``: the fault matrix of ``tests/fault_pipeline.py`` on two ranks: for every
  planted fault, a runtime, the faulty step, close, then a fresh runtime's clean step; each
  rank writes what it saw per fault to ``OUT/faults<r>.json`` and exits 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # the toy model

import numpy as np
from toy import ToyMLP

from overlap import Runtime
from scheduler import Cluster, ReshardPlan
from scheduler.dtypes import NARROW_FLOATS

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)


def toy_inputs(step: int, batch: int = 8, hidden: int = 8, m: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return [rng.standard_normal((batch, hidden)) for _ in range(m)]


def run_toy(rt: Runtime, schedule: str, steps: int = 2, fault=None) -> dict[str, np.ndarray]:
    model = ToyMLP.build(rt.cluster, hidden=8, batch=8, seed=0)
    out: dict[str, np.ndarray] = {}
    for step in range(steps):
        model.zero_grad()
        stages = model.stages()
        if fault is not None:
            stages = fault(stages, step)
        losses = rt.train_step_sync(stages, model.boundaries(), toy_inputs(step),
                                    input_sharding=model.input_sharding(), schedule=schedule)
        out[f"{schedule}/losses{step}"] = np.array(losses)
        for (s, d), g in model.grads.items():
            out[f"{schedule}/grad{step}/{s}/{d}"] = g
        model.sgd(0.01)
    for (s, d), w in model.weights.items():
        if d in rt.local_devices:
            out[f"{schedule}/weight/{s}/{d}"] = w
    return out


VARIED_ROWS = (3, 8, 5, 1, 8, 2)  # ``vary``: each microbatch's rows


def run_varied(rt: Runtime, args: list[str]) -> dict[str, np.ndarray]:
    """``vary OUT [permute|fewer RANK]``: the toy pipeline on microbatches of different batch
    rows (``MicrobatchBoundaries``), one step per schedule; with ``permute RANK`` that rank
    swaps its first two microbatches (data and shapes), with ``fewer RANK`` it leaves out the
    last one: a different call, which must be named."""
    import dataclasses

    from scheduler import MicrobatchBoundaries

    rows = list(VARIED_ROWS)
    if args[:1] == ["permute"] and rt.world.rank == int(args[1]):
        rows[0], rows[1] = rows[1], rows[0]
    if args[:1] == ["fewer"] and rt.world.rank == int(args[1]):
        rows.pop()
    out: dict[str, np.ndarray] = {}
    for schedule in ("1f1b", "eager-1f1b", "zb-h1"):
        model = ToyMLP.build(rt.cluster, hidden=8, batch=8, seed=0)
        rng = np.random.default_rng(7)
        data = {n: rng.standard_normal((n, 8)) for n in sorted(set(rows))}
        mbs = [data[n] for n in rows]
        bounds = MicrobatchBoundaries(tuple(
            tuple(dataclasses.replace(b, shape=(n, 8)) for b in model.boundaries())
            for n in rows))
        stages = model.split_stages() if schedule == "zb-h1" else model.stages()
        losses = rt.train_step_sync(stages, bounds, mbs, input_sharding=model.input_sharding(),
                                    schedule=schedule)
        out[f"{schedule}/losses"] = np.array(losses)
        for (s, d), g in model.grads.items():
            out[f"{schedule}/grad/{s}/{d}"] = g
    return out


def arange_shards(plan: ReshardPlan, devices=None) -> dict[int, np.ndarray]:
    """Each source device's region (of ``devices``, default all) of ``arange`` in the plan's
    shape and dtype: the same input on every process and in the one-process run."""
    full = np.arange(int(np.prod(plan.shape)), dtype=plan.dtype).reshape(plan.shape)
    return {d: full[tuple(slice(a, b) for a, b in r)].copy()
            for d, r in plan.src.device_regions(plan.shape).items()
            if devices is None or d in devices}


def failing(rank_to_fail: int, rt: Runtime, how: str):
    """Stage functions where a stage backward on ``rank_to_fail``'s devices fails in step 1
    (microbatch 1)."""
    import dataclasses

    def wrap(stages, step):
        if step != 1 or rt.world.rank != rank_to_fail:
            return stages
        s = max(i for i, st in enumerate(stages)
                if set(st.mesh.device_ids) & set(rt.local_devices))
        inner = stages[s].backward

        def backward(ctx, dy):
            if ctx.microbatch == 1:
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError(f"injected failure on device {ctx.device}")
            return inner(ctx, dy)

        return [*stages[:s], dataclasses.replace(stages[s], backward=backward), *stages[s + 1:]]

    return wrap


def pretend_hosts() -> None:
    """``JOB_HOSTS=a,a,b,b``: rank r reports the r-th name as its host (links join only the
    ranks of one host; the others talk over MPI)."""
    names = os.environ.get("JOB_HOSTS")
    if names:
        from mpi4py import MPI

        mine = names.split(",")[MPI.COMM_WORLD.Get_rank()]
        MPI.Get_processor_name = lambda: mine


def save_links(rt: Runtime, out_dir: Path) -> None:
    """Which ranks this one is linked to, how many messages went over the links, and whether
    the runtime's own rounds (agreement, losses, end of call) went over them."""
    dist = rt.backend.dist
    links = dist.links
    info = None if links is None else {"peers": list(links.peers), "sent": links.frames_sent,
                                       "received": links.frames_received,
                                       "rounds": dist.rounds_linked,
                                       "tcp": list(links.network_peers)}
    (out_dir / f"links{rt.world.rank}.json").write_text(json.dumps(info))


def main() -> int:
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    pretend_hosts()
    cluster = Cluster.preset("p3.8xlarge", num_hosts=4)
    if mode == "reshard":
        cases = json.loads(Path(sys.argv[3]).read_text())
        cluster = Cluster(cases["hosts"], cases["gpus"], nic_gbps=cases["nic_gbps"])
    if mode == "collectives":  # (test_mpi's CLUSTER4: one device per process of 4)
        cluster = Cluster(2, 2, nic_gbps=100.0)
    timeout = 2.0 if mode in ("stuck", "silent", "slow") else 30.0
    backend = "cpu"
    if mode == "reshard" and sys.argv[4:] == ["cuda"]:
        backend = "cuda"
        use_fake_gpu()
    if mode == "faults":
        return fault_matrix(out_dir)
    if mode == "kill":
        # As the docs tell a user who wants the launcher's pids tied to ranks: the runtime's
        # rank line, at DEBUG of the "overlap" logger.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("overlap: %(message)s"))
        logging.getLogger("overlap").addHandler(handler)
        logging.getLogger("overlap").setLevel(logging.DEBUG)
    with Runtime(cluster, backend, timeout=timeout) as rt:
        rank = rt.world.rank
        saved: dict[str, np.ndarray] = {}
        if mode == "toy":
            for schedule in ("gpipe", "1f1b", "eager-1f1b"):
                saved.update(run_toy(rt, schedule))
            save_links(rt, out_dir)
        elif mode in ("raise", "kill"):
            run_toy(rt, "eager-1f1b", fault=failing(int(sys.argv[3]), rt, mode))
        elif mode == "differ":
            if sys.argv[4:] and rank == int(sys.argv[4]):
                time.sleep(1.0)  # the others' reports of the mismatch arrive before this call
            run_toy(rt, "1f1b" if rank == int(sys.argv[3]) else "eager-1f1b", steps=1)
        elif mode == "silent":
            from overlap.scope import CancelScope

            backend = rt.backend
            rt.run_sync(backend.prepare({"silent": (0, 4)}, []))  # (every rank: collective)
            if rank == 1:
                buf = np.zeros(4)
                scope = CancelScope("silent")
                s = backend.stream(4, "silent")
                s.launch("wait for rank 0", lambda: backend.broadcast(
                    (0, 4), 4, 0, buf, "silent", "silent", tag=7, scope=scope), scope=scope)
                ev = s.record(scope=scope)
                deadline = time.monotonic() + 10.0
                while not ev.launched() and time.monotonic() < deadline:
                    time.sleep(0.01)
                raise scope.failures[0]
            time.sleep(60)
        elif mode == "nccl":
            saved.update(nccl_bootstrap_check(rt))
        elif mode == "outside":
            model = ToyMLP.build(cluster, hidden=8, batch=8)
            for step in range(3):
                if step == 1 and rank == int(sys.argv[3]):
                    raise RuntimeError(f"rank {rank}: the script failed between steps")
                rt.train_step_sync(model.stages(), model.boundaries(), toy_inputs(step),
                                   input_sharding=model.input_sharding())
        elif mode == "stuck":
            plan, shards = small_plan(cluster, rt)
            rt.reshard_sync(plan, shards)
            if rank != int(sys.argv[3]):
                rt.reshard_sync(plan, shards)
            else:
                time.sleep(60)  # stuck elsewhere: the others must not wait for this

        elif mode == "leave":
            plan, shards = small_plan(cluster, rt)
            rt.reshard_sync(plan, shards)
            if rank == int(sys.argv[3]):
                if sys.argv[4] == "exit":
                    sys.exit(0)
                rt.close()
                time.sleep(60)  # idle: the others must not wait for it
            links = rt.backend.dist.links
            if sys.argv[5:] == ["seen"] and links is not None:
                # The second call only once this rank's link to the leaver has closed
                # (~20 ms after its notice was sent: before this rank's listener read it).
                deadline = time.monotonic() + 10.0
                while not links.closed_to(int(sys.argv[3])) and time.monotonic() < deadline:
                    time.sleep(0.0005)
            rt.reshard_sync(plan, shards)
        elif mode == "ahead":
            plan, shards = pair_plan(cluster, rt, False)
            if rank == 0:
                shards = {d: a[:-1] for d, a in shards.items()}  # wrong shape: raises
            rt.reshard_sync(plan, shards)
            rt.run_sync(rt.reshard(plan, shards, stream="other"))
        elif mode == "slow":
            saved.update(slow_then_everyone(cluster, rt))
        elif mode == "loops":
            import asyncio

            plan, shards = pair_plan(cluster, rt, False)
            for k in range(7):  # (sync, async, ..., sync)
                out = (rt.reshard_sync(plan, shards) if k % 2 == 0
                       else asyncio.run(rt.reshard(plan, shards)))
                saved.update({f"{k}/{d}": np.asarray(a) for d, a in out.items()})
        elif mode == "pair":
            saved.update(pair_calls(cluster, rt, sys.argv[3:] == ["differ"]))
        elif mode == "vary":
            saved.update(run_varied(rt, sys.argv[3:]))
        elif mode == "hops":  # every cross-rank hop of one resharding, timed
            plan, shards = small_plan(cluster, rt)
            rt.backend.remote.hop_timings = []
            rt.reshard_sync(plan, shards)
            saved["hops"] = np.array(
                [[h.tag, -1 if h.prev is None else h.prev, -1 if h.nxt is None else h.nxt,
                  h.nbytes, h.posted, -1.0 if h.landed is None else h.landed, h.done]
                 for h in rt.backend.remote.hop_timings], dtype=np.float64).reshape(-1, 7)
        elif mode == "reshard":
            if cases.get("chunk_bytes") is not None:  # many pieces even for small tensors
                rt.backend.remote.chunk_bytes = int(cases["chunk_bytes"])
            for i, text in enumerate(cases["plans"]):
                plan = ReshardPlan.from_json(text)
                shards = arange_shards(plan, rt.local_devices)
                for d, a in rt.reshard_sync(plan, shards).items():
                    saved[f"{i}/{d}"] = np.asarray(a)
            if backend == "cuda":
                saved.update(small_pipeline(rt))
            save_links(rt, out_dir)
        elif mode == "collectives":  # stage collectives across processes, bf16 too
            saved.update(small_pipeline(rt, narrow=True))
        elif mode == "abandon":
            saved.update(abandoned_round(rt))
        else:
            raise SystemExit(f"mode: unknown {mode!r}")
        np.savez(out_dir / f"rank{rank}.npz", **savable(saved))
    return 0


def savable(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``arrays`` as ``np.savez`` can write them: a narrow float (bfloat16, float8; numpy
    stores them as opaque bytes) as its bits in an unsigned integer of its size, its dtype
    name under ``<key>.dtype`` (``tests/test_mpi.outputs`` puts it back)."""
    out: dict[str, np.ndarray] = {}
    for key, a in arrays.items():
        a = np.asarray(a)
        if a.dtype.name in NARROW_FLOATS:
            out[f"{key}.dtype"] = np.array(a.dtype.name)
            a = a.view(f"u{a.dtype.itemsize}")
        out[key] = a
    return out


def fault_matrix(out_dir: Path) -> int:
    """See module doc (``faults``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fault_pipeline import CLUSTER, FaultyMLP, every_fault

    from overlap import OverlapRuntimeError

    timeout = 1.0
    with Runtime(CLUSTER, timeout=timeout) as rt:
        reference = FaultyMLP().step(rt)
        rank = rt.world.rank
    seen = []
    for fault in every_fault():
        before = set(threading.enumerate())
        model = FaultyMLP(fault)
        # A hang is named after the timeout; anything else without waiting for one (a long
        # timeout shows that, whatever the load).
        rt = Runtime(CLUSTER, timeout=timeout if fault.kind == "hang" else 10 * timeout)
        start = time.perf_counter()
        try:
            model.step(rt)
            error = None
        except OverlapRuntimeError as exc:
            error = exc
        seconds = time.perf_counter() - start
        rt.close()  # handled: not from inside the except block
        closed = time.perf_counter() - start - seconds
        model.release.set()
        for t in set(threading.enumerate()) - before:
            t.join(5.0)
        left = sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive())
        with Runtime(CLUSTER, timeout=timeout) as fresh:
            after = FaultyMLP().step(fresh)
        seen.append({"fault": str(fault), "error": type(error).__name__ if error else None,
                     "message": str(error) if error else "", "seconds": seconds,
                     "close_seconds": closed, "threads_left": left,
                     "next_step_ok": after == reference,
                     **({"stage": error.stage, "microbatch": error.microbatch,
                         "phase": error.phase, "device": error.device,
                         "hung_seconds": error.seconds}
                        if hasattr(error, "stage") else {})})
    (out_dir / f"faults{rank}.json").write_text(json.dumps(seen, indent=1))
    return 0


def use_fake_gpu() -> None:
    """The numpy stand-in for CuPy, and NCCL's operations done over MPI on host arrays."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fake_cupy

    sys.modules["cupy"] = fake_cupy
    fake_cupy.DEVICES = 4  # one GPU per rank on this "node"
    from overlap.backends.job.nccl import NcclTransport

    NcclTransport.links_class = HostMpiLinks


class HostMpiLinks:
    """``NcclLinks`` with MPI underneath (same matching: by order per communicator)."""

    def __init__(self, comm, rank, *, timeout):
        self.world, self.rank, self.comms = comm, rank, {}

    def open(self, key, members):
        import fake_cupy

        gpu = self.rank % fake_cupy.DEVICES  # the rank's GPU: its local rank, one node here
        if fake_cupy._current_device() != gpu:  # NCCL would bind the communicator there
            raise RuntimeError(f"rank {self.rank}: communicator {key} made with GPU "
                               f"{fake_cupy._current_device()} current, not its GPU {gpu}")
        old = self.comms.pop(key, None)
        if old is not None:
            old.Free()
        group = self.world.Get_group().Incl(list(members))
        self.comms[key] = self.world.Create_group(group)

    def send_many(self, key, buf, peers, stream):
        for p in peers:
            self.comms[key].Send(np.ascontiguousarray(buf), dest=p)

    def recv(self, key, buf, peer, stream):
        self.comms[key].Recv(buf, source=peer)

    def all_reduce(self, key, buf, stream):
        from mpi4py import MPI

        self.comms[key].Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def all_gather(self, key, buf, out, stream):
        self.comms[key].Allgather(np.ascontiguousarray(buf), out)

    def abort(self):
        """(NCCL's abort of every communicator when a call is cancelled: nothing to end.)"""

    def close(self):
        for c in self.comms.values():
            c.Free()
        self.comms = {}


def small_pipeline(rt: Runtime, narrow: bool = False) -> dict[str, np.ndarray]:
    """2 stages on a 2 × 2 cluster: device 0 → devices (2, 3), which all-reduce a gradient
    and all-gather their outputs across processes. Losses and gradients are saved; with
    ``narrow``, also a bfloat16 all-gather and all-reduce of each (a torch bf16 stage's)."""
    import ml_dtypes

    from overlap import Stage
    from scheduler import Boundary, DeviceMesh, P, Sharding

    w = [np.random.default_rng(7 + s).standard_normal((6, 6)) for s in range(2)]
    grads: dict[tuple[int, int], np.ndarray] = {}
    m0, m1 = DeviceMesh([[0]], ("h", "g")), DeviceMesh([[2, 3]], ("h", "g"))

    def forward(s):
        def f(ctx, x):
            y = np.tanh(np.asarray(x) @ w[s])
            ctx.saved["x"], ctx.saved["y"] = np.asarray(x), y
            if s == 1:
                both = np.asarray(ctx.all_gather(y))  # every device's (equal) output
                if narrow:
                    half = np.asarray(ctx.all_gather(y.astype(ml_dtypes.bfloat16)))
                    grads[("bf16-gather", ctx.device)] = half.astype(np.float64)
                return 0.5 * float(np.sum(both * both)) / len(both)
            return y
        return f

    def backward(s):
        def b(ctx, dy):
            x, y = ctx.saved["x"], ctx.saved["y"]
            dz = (y if dy is None else np.asarray(dy)) * (1 - y * y)
            g = x.T @ dz
            if s == 1:
                g = np.asarray(ctx.all_reduce(g)) / 2  # data-parallel style average
                if narrow:
                    half = np.asarray(ctx.all_reduce(g.astype(ml_dtypes.bfloat16)))
                    grads[("bf16-reduce", ctx.device)] = half.astype(np.float64)
            grads[(s, ctx.device)] = grads.get((s, ctx.device), 0) + g
            return dz @ w[s].T
        return b

    stages = [Stage(m, forward(s), backward(s)) for s, m in enumerate((m0, m1))]
    boundary = Boundary((4, 6), "float64", Sharding(m0, P()), Sharding(m1, P()))
    mbs = [np.random.default_rng(20 + i).standard_normal((4, 6)) for i in range(3)]
    losses = rt.train_step_sync(stages, [boundary], mbs, input_sharding=Sharding(m0, P()))
    out = {"pipe/losses": np.array(losses)}
    for (s, d), g in grads.items():
        out[f"pipe/grad/{s}/{d}"] = g
    return out


class FakeNccl:
    """The two NCCL calls the bootstrap makes, recorded (ids differ per process and call)."""

    NCCL_UNIQUE_ID_BYTES = 128

    def get_unique_id(self):
        return tuple(int(b) - 128 for b in os.urandom(128))

    class NcclCommunicator:
        def __init__(self, n, uid, rank):
            if not isinstance(uid, tuple):  # CuPy 13 takes the tuple it made
                raise TypeError(f"uid: CuPy 13 takes a tuple, got {type(uid).__name__}")
            self.args = (n, uid, rank)


class FakeNccl14(FakeNccl):
    """CuPy 14's API: the id is bytes, the communicator takes bytes (and an optional
    NcclConfig)."""

    def get_unique_id(self):
        return os.urandom(128)

    class NcclCommunicator:
        def __init__(self, n, uid, rank, config=None):
            if not isinstance(uid, bytes):
                raise TypeError(f"commId: CuPy 14 takes bytes, got {type(uid).__name__}")
            self.args = (n, tuple(uid), rank)


def nccl_bootstrap_check(rt: Runtime) -> dict[str, np.ndarray]:
    from overlap.backends.job.nccl_bootstrap import bootstrap_nccl

    rank = rt.world.rank
    comm = rt.backend.dist.bootstrap_comm()  # (MPI's, or the links' under torchrun)
    out = {}
    for name, members, nccl in (("all", [0, 1, 2, 3], FakeNccl()), ("pair", [2, 1], FakeNccl()),
                                ("tail", [1, 3], FakeNccl()), ("v14", [3, 0, 2], FakeNccl14())):
        if rank in members:
            c = bootstrap_nccl(comm, members, rank, nccl, timeout=10.0)
            n, uid, r = c.args
            out[f"{name}/n"], out[f"{name}/id"], out[f"{name}/rank"] = (
                np.array(n), np.array(uid), np.array(r))
    if hasattr(comm, "Free"):
        comm.Free()
    return out


def pair_plan(cluster: Cluster, rt: Runtime, differ: bool):
    """A plan from rank 0's devices to rank 1's (another layout on rank 1 if ``differ``),
    and this rank's shards of ``arange``."""
    from scheduler import P, Sharding, plan_resharding

    src = Sharding(cluster.mesh([0]), P("gpu"))
    dst = Sharding(cluster.mesh([1]), P(None, "gpu") if differ and rt.world.rank == 1 else P())
    plan = plan_resharding((64, 8), "float32", src, dst, cluster)
    return plan, arange_shards(plan, rt.local_devices)


def pair_calls(cluster: Cluster, rt: Runtime, differ: bool) -> dict[str, np.ndarray]:
    """See module doc (``pair``)."""
    plan, shards = pair_plan(cluster, rt, differ)
    links = rt.backend.dist.links
    moved = (lambda: 0) if links is None else (lambda: links.frames_sent
                                               + links.frames_received)
    before = moved()
    out: dict[str, np.ndarray] = {}
    for _ in range(5):
        out = {f"pair/{d}": np.asarray(a) for d, a in rt.reshard_sync(plan, shards).items()}
    out["calls"] = np.array(rt.backend.dist.calls)
    out["moved"] = np.array(moved() - before)
    if not differ:  # one traced call more: the transfers this rank's devices ran, as spans
        rt.reshard_sync(plan, shards, trace=True)
        out["spans"] = np.array(sorted((s.op, s.device) for s in rt.timeline().spans),
                                dtype=np.int64).reshape(-1, 2)
        out["transfers"] = np.array([(t.sender, *t.receivers) for t in plan.transfers],
                                    dtype=np.int64).reshape(len(plan.transfers), -1)
    return out


def slow_then_everyone(cluster: Cluster, rt: Runtime) -> dict[str, np.ndarray]:
    """See module doc (``slow``)."""
    from scheduler import DeviceMesh, P, Sharding, plan_resharding

    plan = plan_resharding((64, 8), "float32", Sharding(DeviceMesh([[0]], ("host", "gpu")), P()),
                           Sharding(DeviceMesh([[4]], ("host", "gpu")), P()), cluster)
    # In four pieces, one after another on both devices' streams.
    (t,) = plan.transfers
    plan = dataclasses.replace(plan, transfers=tuple(
        dataclasses.replace(t, region=((16 * k, 16 * k + 16), (0, 8)), nbytes=t.nbytes // 4)
        for k in range(4)))
    shards = {0: np.ones((64, 8), np.float32)} if rt.world.rank == 0 else {}
    if rt.world.rank == 0:  # each of its sends starts 0.7 s late
        remote = rt.backend.remote
        send = remote.transfer

        def late(*args, **kwargs):
            time.sleep(0.7)
            return send(*args, **kwargs)

        remote.transfer = late
    started = time.perf_counter()
    rt.reshard_sync(plan, shards)
    first = time.perf_counter() - started
    plan, shards = small_plan(cluster, rt)
    rt.reshard_sync(plan, shards)
    return {"first": np.array(first), "both": np.array(time.perf_counter() - started)}


def small_plan(cluster: Cluster, rt: Runtime):
    from scheduler import P, Sharding, plan_resharding

    src = Sharding(cluster.mesh([0]), P("host"))
    dst = Sharding(cluster.mesh([1, 2, 3]), P())
    plan = plan_resharding((64, 8), "float32", src, dst, cluster)
    full = np.ones((64, 8), np.float32)
    shards = {d: full[tuple(slice(a, b) for a, b in r)]
              for d, r in src.device_regions((64, 8)).items() if d in rt.local_devices}
    return plan, shards


def abandoned_round(rt: Runtime) -> dict[str, np.ndarray]:
    """``abandon OUT`` (4 ranks, every byte over MPI): rank 0 makes call 1 between ranks 0
    and 1, fails and abandons it; only then does rank 1 make it (its row comes late). Then
    call 2 between them. Ranks 0 and 1 save call 2's end-of-call table; rank 0 whether the
    abandoned call's agreement completed, and whether an ``Iprobe`` finds rank 1's late row
    still unmatched after call 2."""
    from mpi4py import MPI

    from overlap.scope import CancelScope

    dist = rt.backend.dist
    rank = rt.world.rank
    sync = MPI.COMM_WORLD.Dup()  # (every rank, in the same order)

    def begin(what: str, digest: bytes):
        return dist.begin_call(what, digest, (0, 1), CancelScope(what, rt.scope))

    out: dict[str, np.ndarray] = {}
    first = None
    if rank == 0:
        first = begin("abandon: call 1", b"plan")
        first.scope.fail(RuntimeError("op failed"))
        first.abandon()
        dist.end_call()
    sync.Barrier()  # (rank 1's row of call 1 goes only now)
    if rank != 0:
        theirs = begin("abandon: call 1", b"plan")
        if theirs is not None:
            rt.run_sync(theirs.agreed())  # (rank 0's row went before it failed)
        dist.end_call()
    second = begin("abandon: call 2", b"plan 2")
    if second is not None:
        async def both() -> dict[int, bytes]:
            await second.agreed()
            return await second.finish(bytes([20 + rank]))

        table = rt.run_sync(both())
        out["table"] = np.array([list(table[r]) for r in (0, 1)])
    dist.end_call()
    if first is not None:
        status = MPI.Status()
        waits = dist.runtime_comm.Iprobe(1, MPI.ANY_TAG, status)
        out["stray_waits"] = np.array(waits)
        out["stray_source"] = np.array(status.Get_source() if waits else -1)
        out["abandoned_over"] = np.array(first.agreement.over)
    sync.Barrier()
    sync.Free()
    return out


if __name__ == "__main__":
    sys.exit(main())
