"""Processes a caller started another way — as Ray's actors, a scheduler's workers — with a
``torch.distributed`` default process group the caller made (``init_process_group(gloo,
tcp://host:port, rank, world_size)``, none of torchrun's variables): the runtime finds that
world, links the ranks and gives the one-process run's results bit for bit."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
from job_results import assert_same_as_single, links_of, outputs, verdicts
from launchers import ROOT, clean_env

pytest.importorskip("torch.distributed", reason="torch is not installed: pip install "
                                                "torch==2.13.0 (the 'torch' extra)")

from test_torchrun import toy_single

JOB = ROOT / "tests" / "mpi_jobs" / "process_group.py"
JOB_BOUND_S = 120.0  # startup of 4 interpreters (with torch) on 2 cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_group(n: int, out, env: dict[str, str] | None = None
                ) -> list[subprocess.CompletedProcess[str]]:
    """``n`` plain ``python`` processes, each making the group as rank r of n (no launcher)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(JOB), str(r), str(n), str(port), str(out)],
                              env=env or clean_env(), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(n)]
    deadline = time.monotonic() + JOB_BOUND_S
    done = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            done.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


@pytest.mark.parametrize("n", [2, 4])
def test_a_callers_process_group_runs_the_toy_pipeline_as_one_process(tmp_path, n):
    done = start_group(n, tmp_path)
    for r, d in enumerate(done):
        assert d.returncode == 0, f"rank {r}: {verdicts(d.stderr) or d.stderr[-2000:]}"
    worlds = [json.loads((tmp_path / f"world{r}.json").read_text()) for r in range(n)]
    assert worlds == [{"rank": r, "size": n, "local_rank": r, "local_size": n,
                       "source": "process_group"} for r in range(n)]
    assert_same_as_single(outputs(tmp_path, n), toy_single(), replicated=("/losses",))
    for r, info in enumerate(links_of(tmp_path, n)):  # one host: Unix-socket links
        assert info["peers"] == [q for q in range(n) if q != r] and info["tcp"] == []


def test_ranks_on_several_hosts_get_local_ranks_from_host_names_and_link_over_tcp(tmp_path):
    env = {**clean_env(), "JOB_HOSTS": "a,b,a,b"}
    done = start_group(4, tmp_path, env)
    for r, d in enumerate(done):
        assert d.returncode == 0, f"rank {r}: {verdicts(d.stderr) or d.stderr[-2000:]}"
    worlds = [json.loads((tmp_path / f"world{r}.json").read_text()) for r in range(4)]
    assert [(w["local_rank"], w["local_size"]) for w in worlds] == [(0, 2), (0, 2), (1, 2),
                                                                    (1, 2)]
    assert [i["tcp"] for i in links_of(tmp_path, 4)] == [[1, 3], [0, 2], [1, 3], [0, 2]]
    assert_same_as_single(outputs(tmp_path, 4), toy_single(), replicated=("/losses",))


def test_a_group_whose_size_does_not_divide_the_cluster_is_named_on_every_rank(tmp_path):
    done = start_group(3, tmp_path)
    for d in done:
        assert d.returncode != 0
        assert "16 devices do not split evenly over 3 processes" in d.stderr, d.stderr[-2000:]
        assert "default process group the caller initialized: world_size=3" in d.stderr


def test_detecting_a_world_never_imports_torch():
    code = ("import sys; from overlap.world import detect_world; "
            "w = detect_world({}); print(w.source, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], env=clean_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["single", "False"], done.stderr
