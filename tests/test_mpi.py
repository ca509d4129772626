"""Multi-process runs under ``mpiexec`` (the ``mpi`` extra: mpi4py and the mpich wheel).

Each test starts ``tests/mpi_jobs/job.py`` on several processes, exactly as a user would start
a script, and checks what the processes wrote or printed: results equal to the one-process
run bit for bit (float64 and the tensors' own dtypes), and every failure ending the whole job
with a non-zero status and the failed rank named. ``JOB_BOUND_S`` bounds each job: a job that
runs past it has hung, and the test fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from job_results import assert_same_as_single, links_of, outputs, verdicts
from strategies import problems

pytest.importorskip("mpi4py", reason="the mpi extra is not installed: pip install -e '.[mpi]'")

from overlap import Runtime
from scheduler import Cluster, DeviceMesh, PlanOptions, Sharding, ShardingSpec, plan_resharding

JOB = Path(__file__).parent / "mpi_jobs" / "job.py"
MPIEXEC = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))
JOB_BOUND_S = 60.0  # startup of 4 interpreters on 2 cores included; failures end within ~6 s

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")

sys.path.insert(0, str(JOB.parent))
import job as toy_job  # noqa: E402


def mpiexec(n: int, *args: str, flags: tuple[str, ...] = (), guard: bool = False,
            bound: float = JOB_BOUND_S, data: str = "links", hosts: str | None = None
            ) -> tuple[subprocess.CompletedProcess[str], float]:
    """``data``: "links" (the default: host links between ranks of a host) or "mpi" (every
    byte over MPI); ``hosts``: the host each rank pretends to run on (JOB_HOSTS)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA_", "JOB_"))}
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["OVERLAP_HOST_LINKS"] = {"links": "1", "mpi": "0"}[data]
    if hosts is not None:
        env["JOB_HOSTS"] = hosts
    start = time.perf_counter()
    wrap = ["-m", "overlap.guard"] if guard else []
    done = subprocess.run([MPIEXEC, *flags, "-n", str(n), sys.executable, *wrap, str(JOB),
                           *args], env=env, cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=bound)
    return done, time.perf_counter() - start


# ---- results equal the one-process run -------------------------------------------------------

def toy_single() -> dict[str, np.ndarray]:
    with Runtime(Cluster.preset("p3.8xlarge", num_hosts=4)) as rt:
        single: dict[str, np.ndarray] = {}
        for schedule in ("gpipe", "1f1b", "eager-1f1b"):
            single.update(toy_job.run_toy(rt, schedule))
    return single


@pytest.mark.parametrize("data", ["links", "mpi"])
@pytest.mark.parametrize("n", [4, 2])
def test_toy_pipeline_equals_one_process_bit_for_bit(tmp_path, n, data):
    done, _ = mpiexec(n, "toy", str(tmp_path), data=data)
    assert done.returncode == 0, verdicts(done.stderr)
    single = toy_single()
    ranks = outputs(tmp_path, n)
    links = links_of(tmp_path, n)
    if data == "links":  # one host: every rank linked to every other, the data over them
        for r, info in enumerate(links):
            assert info["peers"] == [q for q in range(n) if q != r] and info["rounds"]
        assert all(info["sent"] > 0 and info["received"] > 0 for info in links)
        assert sum(i["sent"] for i in links) == sum(i["received"] for i in links)
    else:
        assert links == [None] * n
    assert_same_as_single(ranks, single, replicated=("/losses",))
    for arrays in ranks:  # every process got every loss
        assert sum("/losses" in k for k in arrays) == sum("/losses" in k for k in single)
    # The line tying rank, pid and devices together is at DEBUG: not shown at INFO.
    assert not re.search(r"overlap: rank \d/\d \(pid \d+", done.stderr), done.stderr


def test_ranks_on_two_hosts_link_within_a_host_and_use_mpi_between(tmp_path):
    """Ranks 0, 1 on one host, 2, 3 on another: links only join ranks of a host, and the
    pipeline's hop from stage 2 to 3 (rank 1 to 2) goes over MPI — one transfer's two sides
    of different kinds. The training is the one-process one, bit for bit."""
    done, _ = mpiexec(4, "toy", str(tmp_path), hosts="a,a,b,b")
    assert done.returncode == 0, verdicts(done.stderr)
    assert_same_as_single(outputs(tmp_path, 4), toy_single(), replicated=("/losses",))
    links = links_of(tmp_path, 4)
    assert [i["peers"] for i in links] == [[1], [0], [3], [2]]
    assert all(i["sent"] > 0 and i["received"] > 0 for i in links)
    assert not any(i["rounds"] for i in links)  # (they need every rank: over MPI)


# 4 devices: one per process with -n 4, two per process with -n 2.
CLUSTER4 = Cluster(2, 2, nic_gbps=100.0)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(problems(cluster=CLUSTER4), min_size=3, max_size=3))
def test_hypothesis_reshardings_equal_one_process_bit_for_bit(tmp_path_factory, cases):
    plans = [plan_resharding(shape, dtype, src, dst, CLUSTER4, PlanOptions(strategy=strategy))
             for shape, dtype, src, dst, _ in cases
             for strategy in ("send_recv", "broadcast", "local_allgather")]
    out = tmp_path_factory.mktemp("reshard")
    spec = out / "cases.json"
    single = one_process(plans, spec)
    # 7-byte pieces: every chain forwards, and every local copy follows, piece by piece.
    for n, chunk in ((4, None), (2, None), (4, 7)):
        write_cases(plans, spec, chunk)
        done, _ = mpiexec(n, "reshard", str(out), str(spec))
        assert done.returncode == 0, verdicts(done.stderr)
        assert_same_as_single(outputs(out, n), single)


def fixed_plans() -> list:
    """Transfers whose regions are strided views of the destination buffers (columns of a
    row block), on ranks with one and with two destination devices."""
    cases = [(SHAPE_A, "float32", SRC_A, DST_A), (SHAPE_A, "int64", DST_A, SRC_A)]
    return [plan_resharding(shape, dtype, src, dst, CLUSTER4, PlanOptions(strategy=strategy))
            for shape, dtype, src, dst in cases
            for strategy in ("send_recv", "broadcast", "local_allgather")]


def write_cases(plans: list, spec: Path, chunk_bytes: int | None = None) -> None:
    """The job's case file: the plans, and the broadcasts' piece size (None: the model's)."""
    spec.write_text(json.dumps({"hosts": 2, "gpus": 2, "nic_gbps": 100.0,
                                "plans": [p.to_json() for p in plans],
                                "chunk_bytes": chunk_bytes}))


def one_process(plans: list, spec: Path, chunk_bytes: int | None = None
                ) -> dict[str, np.ndarray]:
    """Write the job's case file; return the one-process run's destination shards."""
    write_cases(plans, spec, chunk_bytes)
    single: dict[str, np.ndarray] = {}
    with Runtime(CLUSTER4) as rt:
        for i, plan in enumerate(plans):
            for d, a in rt.reshard_sync(plan, toy_job.arange_shards(plan)).items():
                single[f"{i}/{d}"] = a
    return single


@pytest.mark.parametrize("n", [4, 2])
def test_laned_plans_across_processes_equal_one_process_bit_for_bit(tmp_path, n):
    """Every transfer that crosses devices moved to a lane of its own (1-3): each lane is a
    stream and a communicator of its own on every rank, and the data arrives as in one
    process (with 2 ranks, two devices of a rank share each lane's namespace)."""
    import dataclasses

    plans = [dataclasses.replace(p, transfers=tuple(
        t if t.is_local_copy or t.after else dataclasses.replace(t, lane=k % 3 + 1)
        for k, t in enumerate(p.transfers))) for p in fixed_plans()]
    for p in plans:
        p.check()
    assert any(t.lane for p in plans for t in p.transfers)
    single = one_process(plans, tmp_path / "cases.json")
    done, _ = mpiexec(n, "reshard", str(tmp_path), str(tmp_path / "cases.json"))
    assert done.returncode == 0, verdicts(done.stderr)
    assert_same_as_single(outputs(tmp_path, n), single)


@pytest.mark.parametrize("n,chunk,data", [(4, None, "links"), (2, None, "links"),
                                          (2, 5, "links"), (4, None, "mpi"), (2, 5, "mpi")])
def test_strided_destinations_across_processes(tmp_path, n, chunk, data):
    single = one_process(fixed_plans(), tmp_path / "cases.json", chunk)
    done, _ = mpiexec(n, "reshard", str(tmp_path), str(tmp_path / "cases.json"), data=data)
    assert done.returncode == 0, verdicts(done.stderr)
    assert_same_as_single(outputs(tmp_path, n), single)


def test_cuda_backend_across_processes_on_a_stand_in_gpu(tmp_path):
    """The CUDA backend with one process per device, on the numpy stand-in for CuPy and with
    NCCL's operations done over MPI: the backend's own logic (communicators per channel and
    group, who sends and who receives, stage collectives) against the one-process CPU run.
    Its control path is the CPU flavour's: the runtime's rounds go over host links (the data
    is NCCL's: no messages of its own on them). Calls among some ranks only (two ranks; one
    rank alone, which has no round) run there too."""
    one = [Sharding(DeviceMesh([[d]], ("h", "g")), ShardingSpec()) for d in range(4)]
    some = [plan_resharding(SHAPE_A, "float32", a, b, CLUSTER4)
            for a, b in ((one[1], one[2]), (one[3], one[3]))]
    single = one_process(fixed_plans() + some, tmp_path / "cases.json")
    with Runtime(CLUSTER4) as rt:
        single.update(toy_job.small_pipeline(rt))
    done, _ = mpiexec(4, "reshard", str(tmp_path), str(tmp_path / "cases.json"), "cuda")
    assert done.returncode == 0, verdicts(done.stderr)
    ranks = outputs(tmp_path, 4)
    assert_same_as_single(ranks, single, replicated=("pipe/losses",))
    assert all("pipe/losses" in r for r in ranks)
    links = links_of(tmp_path, 4)
    assert all(i["rounds"] and i["sent"] > 0 and i["received"] > 0 for i in links)


def test_stage_collectives_across_processes_in_bfloat16_equal_one_process(tmp_path):
    """A stage whose devices are on two processes all-gathers and all-reduces float64 and
    bfloat16 arrays (a torch bf16 tensor-parallel stage's): the bytes cross as bytes (MPI
    reads numpy arrays through DLPack, which has no bfloat16)."""
    with Runtime(CLUSTER4) as rt:
        single = toy_job.small_pipeline(rt, narrow=True)
    done, _ = mpiexec(4, "collectives", str(tmp_path))
    assert done.returncode == 0, verdicts(done.stderr)
    ranks = outputs(tmp_path, 4)
    assert any(k.startswith("pipe/grad/bf16-") for r in ranks for k in r)
    assert_same_as_single(ranks, single, replicated=("pipe/losses",))


SHAPE_A = (6, 5)
SRC_A = Sharding(DeviceMesh([[0, 1]], ("h", "g")), ShardingSpec(None, "g"))
DST_A = Sharding(DeviceMesh([[0, 1], [2, 3]], ("h", "g")), ShardingSpec("h"))


# ---- failures end the whole job, naming the failed rank --------------------------------------

def assert_failed_job(done: subprocess.CompletedProcess[str], failed: int, n: int = 4) -> str:
    text = done.stdout + done.stderr
    assert done.returncode != 0, verdicts(text)
    return text


def test_a_rank_that_raises_mid_step_ends_the_job_naming_it(tmp_path):
    done, _ = mpiexec(4, "raise", str(tmp_path), "2")
    text = assert_failed_job(done, 2)
    assert re.search(r"injected failure on device (8|9|10|11)\b", text)  # rank 2's devices
    # Every other rank stopped with an error naming rank 2 and what it was doing.
    for r in (0, 1, 3):
        assert re.search(r"RankFailed: rank 2 failed during train_step: StreamError: device "
                         rf"\d+ stream 'compute': B s2 mb1 .*\(rank {r} stopped its work\)",
                         text), verdicts(text)
    assert not list(tmp_path.glob("rank*.npz"))  # nobody went on as if nothing happened


def test_a_killed_rank_ends_the_job(tmp_path):
    """MPICH ends every rank at once when one is killed (nothing survives to report it, with
    or without hydra's -disable-auto-cleanup); the job exits non-zero and hydra prints the pid
    of a terminated process, which the runtime's log lines tie to a rank."""
    done, _ = mpiexec(4, "kill", str(tmp_path), "1")
    text = assert_failed_job(done, 1)
    assert "BAD TERMINATION" in text and not list(tmp_path.glob("rank*.npz"))
    pids = dict(re.findall(r"overlap: rank (\d)/4 \(pid (\d+)", text))
    reported = re.search(r"PID (\d+) RUNNING AT", text).group(1)
    assert reported in pids.values(), (reported, pids)


def test_a_killed_rank_is_named_with_what_it_was_doing_under_the_guard(tmp_path):
    """``python -m overlap.guard`` wraps each rank: the killed one is named, with its signal and
    the runtime call it was in, and the job exits non-zero."""
    done, _ = mpiexec(4, "kill", str(tmp_path), "1", guard=True)
    text = assert_failed_job(done, 1)
    pid = re.search(r"overlap: rank 1/4 \(pid (\d+)", text).group(1)
    assert re.search(rf"overlap: rank 1 \(pid {pid} on [^)]+\) was killed by SIGKILL during "
                     r"train_step: the step graph \(call 2\)", text), verdicts(text)


def test_the_guard_passes_a_clean_run_through(tmp_path):
    done, _ = mpiexec(2, "toy", str(tmp_path), guard=True)
    assert done.returncode == 0, verdicts(done.stderr)
    assert len(list(tmp_path.glob("rank*.npz"))) == 2
    assert "was killed" not in done.stderr


def test_an_exception_outside_the_runtime_ends_the_job(tmp_path):
    done, _ = mpiexec(4, "outside", str(tmp_path), "1")
    text = assert_failed_job(done, 1)
    for r in (0, 2, 3):
        assert (f"RankFailed: rank 1 failed during the script (an uncaught exception): "
                f"RuntimeError: rank 1: the script failed between steps (rank {r} stopped"
                ) in text, verdicts(text)


def test_a_rank_stuck_elsewhere_times_the_call_out_naming_it(tmp_path):
    done, _ = mpiexec(4, "stuck", str(tmp_path), "1")
    text = assert_failed_job(done, 1)
    assert re.search(r"CollectiveTimeout: reshard: the plan \(call 2\): rank \d waited 2 s; "
                     r"ranks \[1\] never made this call", text), verdicts(text)


def test_a_transfer_whose_sender_never_sends_times_out_naming_it(tmp_path):
    done, _ = mpiexec(4, "silent", str(tmp_path))
    text = assert_failed_job(done, 0)
    assert ("CollectiveTimeout: broadcast[silent] root 0: rank 1 waited 2 s; rank 0 never "
            "sent it") in text, verdicts(text)


@pytest.mark.parametrize("late", [(), ("0",)], ids=["together", "rank0-late"])
def test_ranks_that_lower_different_programs_are_named(tmp_path, late):
    done, _ = mpiexec(4, "differ", str(tmp_path), "3", *late)
    text = assert_failed_job(done, 3)
    # Each rank raises its own finding, not another rank's report of the mismatch nor the
    # failures it caused, even when those reach it first (rank0-late).
    for r in (0, 1, 2):
        assert re.search(rf"CallMismatch: train_step: the step graph \(call 1\): ranks \[3\] "
                         rf"made a different call than rank {r} ", text), verdicts(text)
    assert ("CallMismatch: train_step: the step graph (call 1): ranks [0, 1, 2] made a different "
            "call than rank 3 ") in text, verdicts(text)


@pytest.mark.parametrize("data", ["links", "mpi"])
def test_a_call_between_two_ranks_leaves_the_others_out(tmp_path, data):
    """A resharding between rank 0's devices and rank 1's: every rank makes the calls (and
    counts them), but only ranks 0 and 1 check and end them together — ranks 2 and 3 move no
    message; the data arrives as in one process, over host links or all over MPI."""
    done, _ = mpiexec(4, "pair", str(tmp_path), data=data)
    assert done.returncode == 0, verdicts(done.stderr)
    ranks = outputs(tmp_path, 4)
    assert [int(r["calls"]) for r in ranks] == [5] * 4
    # A traced call: each rank's timeline has a span for every transfer on each of its
    # devices — the sender's too, whose messages the socket took at once.
    transfers = ranks[0]["transfers"]
    for r, devices in ((0, range(4)), (1, range(4, 8)), (2, ()), (3, ())):
        want = sorted((op, d) for op, row in enumerate(transfers) for d in set(row.tolist())
                      if d in devices)
        assert ranks[r]["spans"].tolist() == [list(x) for x in want], r
    full = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    got = {k: a for r in ranks for k, a in r.items() if k.startswith("pair/")}
    assert sorted(got) == [f"pair/{d}" for d in range(4, 8)]
    assert all(a.tobytes() == full.tobytes() for a in got.values())
    if data == "links":
        assert int(ranks[0]["moved"]) > 0
        assert [int(r["moved"]) for r in ranks[2:]] == [0, 0]


def test_ranks_of_a_call_that_make_different_calls_are_named_and_no_other(tmp_path):
    done, _ = mpiexec(4, "pair", str(tmp_path), "differ")
    text = assert_failed_job(done, 1)
    for r, other in ((0, 1), (1, 0)):
        assert re.search(rf"CallMismatch: reshard: the plan \(call 1\): ranks \[{other}\] made a "
                         rf"different call than rank {r} ", text), verdicts(text)
    assert not re.search(r"than rank [23] ", text), verdicts(text)


def test_ranks_that_ran_ahead_of_a_failed_call_are_told_not_left_blocked(tmp_path):
    """Ranks 2 and 3 have no part in a call that fails on rank 0, and go on to a call whose
    channel every rank must make (a collective): their wait there ends at rank 0's failure
    notice, naming it — not blocked until the job is torn down."""
    done, _ = mpiexec(4, "ahead", str(tmp_path))
    text = assert_failed_job(done, 0)
    assert "ValueError: shards[0]" in text, verdicts(text)
    for r in (2, 3):
        assert re.search(rf"RankFailed: rank 0 failed during the script \(an uncaught "
                         rf"exception\): ValueError: shards\[0\].*\(rank {r} stopped its work\)",
                         text), verdicts(text)


def test_ranks_ahead_wait_past_the_timeout_for_members_still_in_an_earlier_call(tmp_path):
    """Ranks 2 and 3 have no part in a call that takes ranks 0 and 1 longer than the 2 s
    timeout (no op near it), and wait for them in the next call: past the timeout they ask,
    hear that ranks 0 and 1 are still inside an earlier call, and wait on."""
    done, _ = mpiexec(4, "slow", str(tmp_path))
    assert done.returncode == 0, verdicts(done.stdout + done.stderr)
    ranks = outputs(tmp_path, 4)
    assert all(float(r["first"]) > 2.0 for r in ranks[:2])
    assert all(float(r["first"]) < 1.0 and float(r["both"]) > 2.0 for r in ranks[2:])


def test_calls_from_new_event_loops_each_time_deliver(tmp_path):
    """Calls alternately through ``reshard_sync`` (the runtime's kept loop) and awaited on a
    new ``asyncio.run`` loop each time: the process's engine reads the wire whatever loop
    awaits, and every call delivers."""
    done, _ = mpiexec(4, "loops", str(tmp_path))
    assert done.returncode == 0, verdicts(done.stdout + done.stderr)
    ranks = outputs(tmp_path, 4)
    full = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    got = {k: a for r in ranks for k, a in r.items() if "/" in k}
    assert sorted(got) == sorted(f"{k}/{d}" for k in range(7) for d in range(4, 8))
    assert all(a.tobytes() == full.tobytes() for a in got.values())


def test_nccl_ids_travel_over_mpi_to_every_member_only(tmp_path):
    """The NCCL bootstrap with a stand-in NCCL (there is no GPU here): every member of a
    communicator gets the root's id and its own NCCL rank; non-members take no part."""
    done, _ = mpiexec(4, "nccl", str(tmp_path))
    assert done.returncode == 0, verdicts(done.stderr)
    ranks = outputs(tmp_path, 4)
    for name, members in (("all", [0, 1, 2, 3]), ("pair", [2, 1]), ("tail", [1, 3]),
                          ("v14", [3, 0, 2])):  # CuPy 14's bytes ids too
        ids = [ranks[r][f"{name}/id"] for r in members]
        assert len(ids[0]) == 128 and all(np.array_equal(i, ids[0]) for i in ids)
        assert [int(ranks[r][f"{name}/rank"]) for r in members] == list(range(len(members)))
        assert all(int(ranks[r][f"{name}/n"]) == len(members) for r in members)
        assert all(f"{name}/id" not in ranks[r] for r in range(4) if r not in members)
    assert not np.array_equal(ranks[1]["pair/id"], ranks[1]["tail/id"])


@pytest.mark.parametrize("uid", [bytes(range(128)), tuple(range(-128, 0)),
                                 tuple(int(b) - 128 for b in bytes(range(0, 256, 2)))],
                         ids=["cupy14-bytes", "cupy13-tuple", "cupy13-mixed"])
def test_an_nccl_id_arrives_as_the_type_it_left(uid):
    from overlap.backends.job.nccl_bootstrap import from_wire, to_wire

    back = from_wire(to_wire(uid).copy())
    assert type(back) is type(uid) and back == uid


def test_nccl_bootstrap_refuses_a_rank_outside_its_members():
    from overlap.backends.job.nccl_bootstrap import bootstrap_nccl

    with pytest.raises(ValueError, match=r"members: rank 5 is not one of \[0, 1\]"):
        bootstrap_nccl(None, [0, 1], 5, None)
    with pytest.raises(ValueError, match="members: expected distinct ranks"):
        bootstrap_nccl(None, [1, 1], 1, None)


def test_every_cross_rank_hop_is_timed_in_order(tmp_path):
    """``WireTransport.hop_timings`` (what benchmarks/mpi_step_profile.py reads): each hop of
    the plan's broadcast appears on its sender and on its receiver, with the same tag and
    bytes, and the marks come in order on the host's one clock (a relay sends what landed)."""
    done, _ = mpiexec(4, "hops", str(tmp_path))
    assert done.returncode == 0, verdicts(done.stderr)
    sent, received = {}, {}
    for r, arrays in enumerate(outputs(tmp_path, 4)):
        for tag, prev, nxt, nbytes, posted, landed, finished in arrays["hops"]:
            assert posted <= finished
            if prev >= 0:
                assert posted <= landed <= finished
                received[(int(tag), int(prev), r)] = (nbytes, landed)
            if nxt >= 0:  # the root sends when it starts; a relay what landed
                sent[(int(tag), r, int(nxt))] = (nbytes, posted if prev < 0 else landed)
    # Rank 0's device broadcasts to one device on each of ranks 1, 2 and 3.
    assert sorted(k[2] for k in received) == [1, 2, 3]
    assert set(sent) == set(received)
    for key, (nbytes, landed) in received.items():
        assert sent[key][0] == nbytes and sent[key][1] <= landed, key


# ---- ranks that leave, and the fault matrix across processes -------------------------------


@pytest.mark.parametrize("how, said, seen", [("exit", "exited", ()),
                                             ("close", "closed its runtime", ()),
                                             ("close", "closed its runtime", ("seen",))])
def test_a_rank_that_leaves_is_named_at_once(tmp_path, how, said, seen):
    """A rank that ends its script cleanly (or closes its runtime) before a call the others
    make: they fail naming it within a second, not after their 30 s timeout, and the job
    exits non-zero. (``seen``: their call begins once its host link has closed — its
    notice may not have been read yet: the closed link must not be what they report.)"""
    done, elapsed = mpiexec(4, "leave", str(tmp_path), "1", how, *seen)
    text = assert_failed_job(done, 1)
    for r in (0, 2, 3):
        assert (f"RankFailed: rank 1 {said} after 1 runtime calls; this rank's call 2 needs it "
                f"(rank {r} stopped its work)") in text, verdicts(text)
    assert "CollectiveTimeout" not in text, verdicts(text)
    assert elapsed < 25.0, elapsed  # far below the 30 s timeout (startup included)


def test_fault_matrix_on_two_ranks(tmp_path):
    from fault_pipeline import CLUSTER, every_fault

    done, _ = mpiexec(2, "faults", str(tmp_path), bound=180.0)
    assert done.returncode == 0, verdicts(done.stdout + done.stderr)
    rows = [json.loads((tmp_path / f"faults{r}.json").read_text()) for r in (0, 1)]
    half = CLUSTER.num_devices // 2  # Placement.blocks: devices 0-5 on rank 0, 6-11 on rank 1
    for i, fault in enumerate(every_fault()):
        device = (0, 4, 8)[fault.stage]
        owner = device // half
        mine, other = rows[owner][i], rows[1 - owner][i]
        assert mine["fault"] == other["fault"] == str(fault)
        for row in (mine, other):
            assert row["next_step_ok"] and row["threads_left"] == [], row
            assert row["close_seconds"] <= 2.0, row  # timeout (1 s) + 1 s
            # From the call's start: a hang's timeout (1 s) + 1 s + the ops before it on a
            # loaded machine; the rest well before their timeout (10 s).
            assert row["seconds"] <= 5.0, row
        if fault.harmless:
            assert mine["error"] is other["error"] is None, (mine, other)
            continue
        if fault.kind == "hang":
            assert mine["error"] == "StageTimeout", mine
            assert mine["hung_seconds"] <= 2.0, mine  # named within timeout + 1 s of the hang
            assert (mine["stage"], mine["microbatch"], mine["phase"], mine["device"]) == (
                fault.stage, fault.microbatch, fault.phase, device), mine
            assert other["error"] in ("RankFailed", "CollectiveTimeout"), other
            assert re.search(rf"\branks? \[?{owner}\b", other["message"]), other
            continue
        assert mine["error"] == "StreamError", mine
        assert f"{fault.phase} s{fault.stage} mb{fault.microbatch} on device {device}" \
            in mine["message"], mine
        assert other["error"] == "RankFailed", other
        assert other["message"].startswith(f"rank {owner} failed during train_step"), other


def test_the_rank_line_is_logged_at_debug_only():
    """Each rank's ``rank r/N (pid P on host)`` line: nothing without logging configured (a
    script making many runtimes printed one per runtime and rank), once per runtime and rank
    at DEBUG of the ``overlap`` logger."""
    code = ("import logging, sys; import overlap; from scheduler import Cluster\n"
            "overlap.Runtime(Cluster.preset('p3.8xlarge', 2)).close()\n"
            "sys.stderr.write('--- debug on\\n'); sys.stderr.flush()\n"
            "logging.basicConfig(level=logging.DEBUG, format='%(name)s: %(message)s')\n"
            "overlap.Runtime(Cluster.preset('p3.8xlarge', 2)).close()\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_", "HYDRA_"))}
    done = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", code], env=env,
                          cwd=Path(__file__).parents[1], capture_output=True, text=True,
                          timeout=JOB_BOUND_S)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    marks = [i for i, line in enumerate(lines) if line == "--- debug on"]
    assert len(marks) == 2, done.stderr  # (one per rank)
    line = re.compile(r"^overlap: rank (\d)/2 \(pid \d+ on ")
    before = [x for x in lines[:marks[0]] if line.match(x)]
    assert before == [], done.stderr
    after = sorted(int(m.group(1)) for m in map(line.match, lines) if m)
    assert after == [0, 1], done.stderr
