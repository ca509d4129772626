"""Multi-process runs under ``torchrun`` (the ``torch`` extra; no MPI anywhere).

The same job as the MPI tests (``tests/mpi_jobs/job.py``), started as a PyTorch user starts
a script: ``torchrun --standalone --nproc-per-node N`` on one node, or two ``torchrun``
agents joined by a c10d rendezvous for two nodes (both on this machine: their ranks link
over TCP, as on two hosts). Results equal the one-process run bit for bit; every failure of
"Failure behaviour" ends the job non-zero with the failed rank named, within its bound.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_results import assert_same_as_single, links_of, outputs, verdicts
from launchers import ROOT, clean_env, launch

pytest.importorskip("torch.distributed.run", reason="torch is not installed: pip install "
                                                    "torch==2.13.0 (the 'torch' extra)")

from overlap import Runtime
from scheduler import Cluster

JOB = ROOT / "tests" / "mpi_jobs" / "job.py"
JOB_BOUND_S = 90.0  # startup of 4 interpreters (with torch) on 2 cores; failures end in ~12 s

sys.path.insert(0, str(JOB.parent))
import job as toy_job  # noqa: E402


def torchrun(n: int, *args: str, bound: float = JOB_BOUND_S
             ) -> tuple[subprocess.CompletedProcess[str], float]:
    """``torchrun --standalone --nproc-per-node n job.py args``: (result, seconds)."""
    start = time.perf_counter()
    done = launch("torchrun", n, JOB, *args, timeout=bound)
    return done, time.perf_counter() - start


def torchrun_nodes(nodes: int, per_node: int, *args: str, script: Path = JOB,
                   env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess[str]]:
    """``nodes`` torchrun agents (one per "node", all here) joined by a c10d rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
         "--nproc-per-node", str(per_node), "--node-rank", str(k), "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"overlap-test-{port}",
         str(script), *args], env=env or clean_env(), cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for k in range(nodes)]
    done = []
    for p in agents:
        try:
            out, err = p.communicate(timeout=JOB_BOUND_S)
        except subprocess.TimeoutExpired:
            for q in agents:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def toy_single():
    with Runtime(Cluster.preset("p3.8xlarge", num_hosts=4)) as rt:
        single = {}
        for schedule in ("gpipe", "1f1b", "eager-1f1b"):
            single.update(toy_job.run_toy(rt, schedule))
    return single


# ---- results equal the one-process run -----------------------------------------------------

@pytest.mark.parametrize("n", [4, 2])
def test_toy_pipeline_under_torchrun_equals_one_process_bit_for_bit(tmp_path, n):
    done, _ = torchrun(n, "toy", str(tmp_path))
    assert done.returncode == 0, verdicts(done.stderr)
    assert_same_as_single(outputs(tmp_path, n), toy_single(), replicated=("/losses",))
    for r, info in enumerate(links_of(tmp_path, n)):  # one node: Unix-socket links
        assert info["peers"] == [q for q in range(n) if q != r] and info["rounds"]
        assert info["tcp"] == [] and info["sent"] > 0
    assert not re.search(r"overlap: rank \d/\d \(pid \d+", done.stderr)  # (DEBUG only)


def test_two_torchrun_nodes_link_over_tcp_and_equal_one_process(tmp_path):
    done = torchrun_nodes(2, 2, "toy", str(tmp_path))
    for d in done:
        assert d.returncode == 0, verdicts(d.stderr)
    assert_same_as_single(outputs(tmp_path, 4), toy_single(), replicated=("/losses",))
    # Ranks 0-1 on node 0, 2-3 on node 1: TCP between the nodes, Unix sockets within one.
    links = links_of(tmp_path, 4)
    assert [i["tcp"] for i in links] == [[2, 3], [2, 3], [0, 1], [0, 1]]
    assert all(i["rounds"] and i["sent"] > 0 for i in links)


def test_nodes_that_share_a_secret_file_link_with_it(tmp_path):
    """``OVERLAP_LINK_SECRET_FILE`` on every rank: the TCP links between the nodes prove
    the file's secret (it never travels through the rendezvous store) and the job runs."""
    secret = tmp_path / "secret"
    secret.write_text("a0" * 32)
    secret.chmod(0o600)
    env = clean_env() | {"OVERLAP_LINK_SECRET_FILE": str(secret)}
    (tmp_path / "out").mkdir()
    done = torchrun_nodes(2, 1, "toy", str(tmp_path / "out"), env=env)
    for d in done:
        assert d.returncode == 0, verdicts(d.stderr)
    assert [i["tcp"] for i in links_of(tmp_path / "out", 2)] == [[1], [0]]


def test_ranks_that_disagree_on_the_secret_file_all_refuse_at_setup(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("b1" * 32)
    secret.chmod(0o600)
    done = launch("torchrun", 2, ROOT / "tests" / "mpi_jobs" / "link_secret.py", str(secret),
                  str(tmp_path), timeout=JOB_BOUND_S)
    assert done.returncode != 0, done.stdout + done.stderr[-2000:]
    for r in range(2):
        text = (tmp_path / f"rank{r}.txt").read_text()
        assert text.startswith("REFUSED "), text
        assert "OVERLAP_LINK_SECRET_FILE is set on some ranks and not on ranks [1]" in text


# ---- failures end the whole job, naming the failed rank --------------------------------------

@pytest.mark.parametrize("n, failing", [(4, 2), (2, 1)])
def test_a_rank_that_raises_mid_step_ends_the_torchrun_job_naming_it(tmp_path, n, failing):
    done, _ = torchrun(n, "raise", str(tmp_path), str(failing))
    text = done.stdout + done.stderr
    assert done.returncode != 0, verdicts(text)
    assert re.search(r"injected failure on device \d+\b", text)
    for r in (r for r in range(n) if r != failing):
        assert re.search(rf"RankFailed: rank {failing} failed during train_step: StreamError: "
                         rf"device \d+ stream 'compute': B s\d mb1 .*\(rank {r} stopped its "
                         r"work\)", text), verdicts(text)
    assert not list(tmp_path.glob("rank*.npz"))


def test_a_killed_rank_ends_the_torchrun_job(tmp_path):
    """torchrun's agent sees the SIGKILL, ends the other workers and exits non-zero, naming
    the killed worker's pid, which the runtime's log lines tie to a rank."""
    done, _ = torchrun(4, "kill", str(tmp_path), "1")
    text = done.stdout + done.stderr
    assert done.returncode != 0, verdicts(text)
    pid = re.search(r"overlap: rank 1/4 \(pid (\d+)", text).group(1)
    assert re.search(rf"exitcode\s*: -9 \(pid: {pid}\)", text), text[-3000:]
    assert not list(tmp_path.glob("rank*.npz"))


def test_an_exception_outside_the_runtime_ends_the_torchrun_job(tmp_path):
    done, _ = torchrun(4, "outside", str(tmp_path), "1")
    text = done.stdout + done.stderr
    assert done.returncode != 0, verdicts(text)
    for r in (0, 2, 3):
        assert (f"RankFailed: rank 1 failed during the script (an uncaught exception): "
                f"RuntimeError: rank 1: the script failed between steps (rank {r} stopped"
                ) in text, verdicts(text)


def test_a_rank_stuck_elsewhere_times_the_torchrun_call_out_naming_it(tmp_path):
    done, _ = torchrun(4, "stuck", str(tmp_path), "1")
    text = done.stdout + done.stderr
    assert done.returncode != 0, verdicts(text)
    assert re.search(r"CollectiveTimeout: reshard: the plan \(call 2\): rank \d waited 2 s; "
                     r"ranks \[1\] never made this call", text), verdicts(text)


def test_a_torchrun_transfer_whose_sender_never_sends_times_out_naming_it(tmp_path):
    done, _ = torchrun(4, "silent", str(tmp_path))
    text = done.stdout + done.stderr
    assert done.returncode != 0, verdicts(text)
    assert ("CollectiveTimeout: broadcast[silent] root 0: rank 1 waited 2 s; rank 0 never "
            "sent it") in text, verdicts(text)


@pytest.mark.parametrize("how, said", [("exit", "exited"), ("close", "closed its runtime")])
def test_a_rank_that_leaves_a_torchrun_job_is_named_at_once(tmp_path, how, said):
    done, elapsed = torchrun(4, "leave", str(tmp_path), "1", how)
    text = done.stdout + done.stderr
    assert done.returncode != 0, verdicts(text)
    for r in (0, 2, 3):
        assert (f"RankFailed: rank 1 {said} after 1 runtime calls; this rank's call 2 needs it "
                f"(rank {r} stopped its work)") in text, verdicts(text)
    assert "CollectiveTimeout" not in text, verdicts(text)
    assert elapsed < 28.0, elapsed  # far below the 30 s timeout (startup included)


def test_torchrun_ranks_that_make_different_calls_are_named(tmp_path):
    done, _ = torchrun(4, "differ", str(tmp_path), "3")
    text = done.stdout + done.stderr
    assert done.returncode != 0, verdicts(text)
    for r in (0, 1, 2):
        assert (f"CallMismatch: train_step: the step graph (call 1): ranks [3] made a "
                f"different call than rank {r}") in text, verdicts(text)


def test_fault_matrix_on_two_torchrun_ranks(tmp_path):
    import json

    from fault_pipeline import every_fault

    done, _ = torchrun(2, "faults", str(tmp_path), bound=240.0)
    assert done.returncode == 0, verdicts(done.stdout + done.stderr)
    rows = [json.loads((tmp_path / f"faults{r}.json").read_text()) for r in (0, 1)]
    for i, fault in enumerate(every_fault()):
        for row in rows:
            assert row[i]["fault"] == str(fault)
            assert row[i]["next_step_ok"] and row[i]["threads_left"] == [], row[i]
            if fault.harmless:
                assert row[i]["error"] is None, row[i]
        if not fault.harmless:
            assert {row[i]["error"] for row in rows} <= {"StreamError", "StageTimeout",
                                                         "RankFailed", "CollectiveTimeout"}
            assert all(row[i]["error"] is not None for row in rows), (rows[0][i], rows[1][i])


def test_nccl_ids_travel_over_torchrun_links_to_every_member_only(tmp_path):
    """The NCCL bootstrap of a CUDA job under torchrun, with a stand-in NCCL (no GPU here):
    every member of a communicator gets the root's id over the links, and its NCCL rank."""
    import numpy as np

    done, _ = torchrun(4, "nccl", str(tmp_path))
    assert done.returncode == 0, verdicts(done.stderr)
    ranks = outputs(tmp_path, 4)
    for name, members in (("all", [0, 1, 2, 3]), ("pair", [2, 1]), ("tail", [1, 3]),
                          ("v14", [3, 0, 2])):
        ids = [ranks[r][f"{name}/id"] for r in members]
        assert len(ids[0]) == 128 and all(np.array_equal(i, ids[0]) for i in ids)
        assert [int(ranks[r][f"{name}/rank"]) for r in members] == list(range(len(members)))
        assert all(f"{name}/id" not in ranks[r] for r in range(4) if r not in members)
    assert not np.array_equal(ranks[1]["pair/id"], ranks[1]["tail/id"])


def test_a_torchrun_job_without_rendezvous_variables_is_named():
    code = "import overlap; from scheduler import Cluster; overlap.Runtime(Cluster.local(2))"
    env = clean_env()
    env.update(RANK="0", WORLD_SIZE="2")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "environment: RANK and WORLD_SIZE are set but not MASTER_ADDR" in done.stderr


def test_a_killed_rank_is_named_under_the_guard_with_torchrun(tmp_path):
    """``torchrun ... -m overlap.guard job.py``: the killed rank is named with its signal and
    the call it was in (the others then die by torchrun's SIGTERM, which the guard says)."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "4", "-m", "overlap.guard", str(JOB), "kill",
                           str(tmp_path), "1"], env=clean_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=JOB_BOUND_S)
    text = done.stdout + done.stderr
    assert done.returncode != 0, verdicts(text)
    pid = re.search(r"overlap: rank 1/4 \(pid (\d+)", text).group(1)
    assert re.search(rf"overlap: rank 1 \(pid {pid} on [^)]+\) was killed by SIGKILL during "
                     r"train_step: the step graph \(call 2\)", text), verdicts(text)


@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
@pytest.mark.parametrize("n", [2, 4])
def test_a_failed_job_ends_within_the_grace_once_every_rank_reported(tmp_path, launcher, n):
    """Once every rank printed its error, the job ends within the exit's grace (5 s): the
    failed ranks hear each other's exit reports (over the links without MPI) instead of
    each waiting the whole grace."""
    from launchers import command

    start = time.perf_counter()
    proc = subprocess.Popen(command(launcher, n, JOB, "raise", str(tmp_path), "1"),
                            env=clean_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    reported: list[float] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if re.search(r"RankFailed: rank 1 failed|ValueError: injected failure", line):
                reported.append(time.perf_counter() - start)
        proc.wait(timeout=JOB_BOUND_S)
    finally:
        proc.kill()
    ended = time.perf_counter() - start
    assert proc.returncode != 0
    assert len(reported) >= n, reported  # (every rank said what happened)
    assert ended - max(reported) <= 5.0, (ended, reported)
