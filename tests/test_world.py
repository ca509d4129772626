"""The process world and device placement (what the launcher says, and the errors for what
cannot run), and the control plane of a multi-process job (:mod:`overlap.backends.job.distributed`).

The control plane's ranks are played in this process: each rank's ``Distributed`` on a
progress engine of its own, joined by host links (socket pairs, one per pair of ranks on a
host) and by :class:`FakeMpi`, a stand-in for the MPI calls it makes (point-to-point
messages matched by source and tag, receives that can be taken back, probes,
``Iallgather`` matched in call order). What the tests look at is what a rank raises, what
its rounds return, how its scopes end, the links' message counts and the messages the
stand-in carried. ``tests/mpi_jobs/job.py`` (mode ``abandon``) checks the one thing the
stand-in cannot: MPI's own cancel of a round's receive.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from overlap import Runtime
from overlap.backends import make_backend
from overlap.backends.job.engine import Backoff, Completion, Engine
from overlap.errors import CallMismatch, CollectiveAborted, CollectiveTimeout, RankFailed
from overlap.pipeline import mesh_groups
from overlap.scope import CancelScope
from overlap.world import Placement, World, describe, detect_world
from scheduler import Cluster, DeviceMesh

CLUSTER = Cluster(2, 2, nic_gbps=100.0)
BOUND_S = 20.0  # every wait of these tests ends within it (or the test fails)


def test_no_launcher_is_a_one_process_world():
    assert detect_world({}) == World()
    assert not World().distributed


def test_torchrun_variables_name_the_process():
    w = detect_world({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                      "LOCAL_WORLD_SIZE": "2"})
    assert (w.rank, w.size, w.local_rank, w.local_size, w.source) == (3, 4, 1, 2, "torchrun")


@pytest.mark.parametrize("env, match", [
    ({"RANK": "0"}, "WORLD_SIZE is not set"),
    ({"WORLD_SIZE": "2"}, "RANK is not set"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK: expected an integer, got 'x'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "need 0 <= rank < size"),
    ({"OVERLAP_WORLD": "many"}, "OVERLAP_WORLD: expected 'single' or 'auto'"),
])
def test_bad_launch_variables_are_named(env, match):
    with pytest.raises(ValueError, match=match):
        detect_world(env)


def test_srun_without_an_mpi_plugin_says_how_to_launch():
    with pytest.raises(RuntimeError, match="srun --mpi=pmix"):
        detect_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"})


@pytest.mark.parametrize("env", [{"PMIX_RANK": "0"},
                                 {"PMIX_RANK": "0", "PMIX_NAMESPACE": "job"},
                                 {"PMIX_RANK": "0", "PMIX_SERVER_URI41": "pmix-server.1;x"}])
def test_a_pmix_rank_without_a_pmix_server_is_named_before_mpi_starts(env):
    """(MPI_Init would abort the process with MPICH's own message.)"""
    with pytest.raises(RuntimeError, match="PMIX_RANK is set, but no PMIx launcher"):
        detect_world(env)


def test_overlap_world_single_wins_over_a_launcher():
    assert detect_world({"OVERLAP_WORLD": "single", "PMI_RANK": "1", "PMI_SIZE": "2"}) == World()


def test_a_torchrun_world_without_its_rendezvous_says_what_is_missing(monkeypatch):
    pytest.importorskip("torch.distributed")
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="RANK and WORLD_SIZE are set but not MASTER_ADDR"):
        Runtime(CLUSTER, world=World(0, 2, source="torchrun"))


def test_a_torchrun_world_moves_every_byte_over_links(monkeypatch):
    monkeypatch.setenv("OVERLAP_HOST_LINKS", "0")
    with pytest.raises(ValueError, match=r"host_links: a job started by torchrun moves every "
                                         r"byte over links"):
        Runtime(CLUSTER, world=World(0, 2, source="torchrun"))


def test_link_emulation_is_refused_across_processes():
    with pytest.raises(ValueError, match=r"emulate_links: .* not available in a multi-process"):
        Runtime(CLUSTER, emulate_links=True, world=World(0, 2, source="mpi"))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"world": (0, 2)}, TypeError, "world: expected an overlap.world.World"),
    ({"placement": [0, 0]}, TypeError, "placement: expected an overlap.world.Placement"),
    ({"placement": Placement((0, 1, 0, 1))}, ValueError, "placement: a one-process world"),
])
def test_runtime_world_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        Runtime(CLUSTER, **kwargs)


def test_default_placement_is_contiguous_blocks():
    assert Placement.blocks(4, 4).owners == (0, 1, 2, 3)   # one process per device
    assert Placement.blocks(4, 2).owners == (0, 0, 1, 1)   # one per host (host-major ids)
    p = Placement.blocks(16, 4)
    assert p.devices_of(2) == (8, 9, 10, 11)
    assert p.ranks_of((12, 0, 13, 4)) == (3, 0, 1)         # first appearance order


@pytest.mark.parametrize("num, size, match", [
    (4, 8, r"8 processes for a cluster of 4 devices"),
    (6, 4, "6 devices do not split evenly over 4 processes"),
])
def test_block_placement_errors_name_the_counts(num, size, match):
    with pytest.raises(ValueError, match=match):
        Placement.blocks(num, size)


def test_explicit_placement_and_its_errors():
    assert Placement.explicit({0: 1, 1: 0, 2: 1, 3: 0}, 4, 2).owners == (1, 0, 1, 0)
    assert Placement.explicit([0, 0, 0, 1], 4, 2).devices_of(1) == (3,)
    with pytest.raises(ValueError, match=r"devices \[3\] have no rank"):
        Placement.explicit([0, 0, 1], 4, 2)
    with pytest.raises(ValueError, match=r"devices \[4\] are not in the cluster"):
        Placement.explicit([0, 0, 1, 1, 1], 4, 2)
    with pytest.raises(ValueError, match=r"device 2 -> 5 is not a rank in 0\.\.1"):
        Placement.explicit([0, 1, 5, 1], 4, 2)
    with pytest.raises(ValueError, match=r"ranks \[2\] own no device"):
        Placement.explicit([0, 1, 0, 1], 4, 3)


def test_world_values_are_checked():
    with pytest.raises(TypeError, match="rank: expected an int"):
        World(rank="0")
    with pytest.raises(ValueError, match="local_rank/local_size"):
        World(local_rank=1, local_size=1)
    with pytest.raises(ValueError, match="source: expected"):
        World(source="slurm")


def test_backoff_bad_values_are_named():
    with pytest.raises(ValueError, match=r"poll: need spin >= 0"):
        Backoff(start=1e-3, cap=1e-4)
    with pytest.raises(ValueError, match=r"poll: need spin >= 0"):
        Backoff(spin=-1)


def test_mesh_groups_are_the_mesh_and_every_axis_line():
    mesh = DeviceMesh([[8, 9], [10, 11]], ("a", "b"))
    assert mesh_groups(mesh) == [(8, 9), (8, 9, 10, 11), (8, 10), (9, 11), (10, 11)]
    assert mesh_groups(DeviceMesh([[0]], ("h", "g"))) == [(0,)]


def test_a_rank_describes_its_devices_compactly():
    said = describe(World(1, 4, source="mpi"), [4, 5, 6, 7, 9, 12, 13])
    assert said.startswith("rank 1/4 (pid ") and said.endswith("): devices 4-7,9,12-13")
    assert describe(World(), []).endswith("devices none")


@pytest.fixture
def fake_gpu(monkeypatch):
    """The numpy stand-in for CuPy (the CUDA kind's checks before MPI starts need a GPU)."""
    import fake_cupy

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake_cupy.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", fake_cupy.nccl)


def test_cuda_across_processes_runs_one_device_per_process(fake_gpu):
    with pytest.raises(ValueError, match=r"placement: backend 'cuda' across processes runs "
                                         r"one device per process .* rank 0 owns 2 devices"):
        make_backend("cuda", 4, world=World(0, 2, source="mpi"),
                     placement=Placement.blocks(4, 2))


def test_a_placement_must_cover_the_cluster_exactly(fake_gpu):
    Placement.blocks(4, 2).check_covers(4)
    with pytest.raises(ValueError, match="placement: covers 4 devices, the cluster has 6"):
        Placement.blocks(4, 2).check_covers(6)
    for kind in ("cpu", "cuda"):
        with pytest.raises(ValueError, match="placement: covers 2 devices, the cluster has 4"):
            make_backend(kind, 4, world=World(0, 2, source="mpi"), placement=Placement((0, 1)))


@pytest.mark.parametrize("grace", [-1.0, "3", True, float("nan")])
def test_a_bad_exit_grace_is_named_before_mpi_starts(grace):
    with pytest.raises(ValueError, match=r"grace: expected seconds >= 0"):
        make_backend("cpu", 4, world=World(0, 2, source="mpi"),
                     placement=Placement.blocks(4, 2), grace=grace)


@pytest.mark.parametrize("chunk", [0, -3, True, 2.5, "4096"])
def test_a_bad_piece_size_is_named(chunk):
    from overlap.backends.job.wire import WireTransport

    with pytest.raises(ValueError, match=r"chunk_bytes: expected an int >= 1 or None"):
        WireTransport(None, None, None, None, chunk_bytes=chunk)  # (checked before use)


def test_host_links_are_on_unless_turned_off(monkeypatch):
    from overlap.backends.job.distributed import HOST_LINKS_ENV, host_links_wanted

    monkeypatch.delenv(HOST_LINKS_ENV, raising=False)
    assert host_links_wanted(None) and not host_links_wanted(False)
    monkeypatch.setenv(HOST_LINKS_ENV, "0")
    assert not host_links_wanted(None) and host_links_wanted(True)  # (the argument wins)
    monkeypatch.setenv(HOST_LINKS_ENV, "yes")
    with pytest.raises(ValueError, match=r"OVERLAP_HOST_LINKS: expected 0 or 1, got 'yes'"):
        host_links_wanted(None)
    with pytest.raises(ValueError, match=r"host_links: expected True, False or None, got 1"):
        host_links_wanted(1)


def test_a_rank_prints_its_traceback_in_one_write(monkeypatch):
    """Python's own hook writes a traceback in pieces; under a launcher with unbuffered output
    several ranks' pieces interleave mid-line. The exit guard writes it whole."""
    import traceback

    from overlap.backends.job.exit_guard import print_whole

    class Recorder:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    try:
        raise CallMismatch("reshard: ranks [3] made a different call than rank 0", ranks=(3,))
    except CallMismatch as exc:
        err = exc
    rec = Recorder()
    monkeypatch.setattr(sys, "stderr", rec)
    print_whole(type(err), err, err.__traceback__)
    assert rec.writes == ["".join(traceback.format_exception(type(err), err, err.__traceback__))]
    assert rec.writes[0].endswith("overlap.errors.CallMismatch: reshard: ranks [3] made a "
                                  "different call than rank 0\n")


# ---- the control plane's ranks, played in this process -----------------------------------


@dataclass
class Message:
    """A point-to-point message the stand-in carried (``taken``: a receive got it)."""

    comm: tuple[Any, ...]
    src: int
    dest: int
    tag: int
    data: bytes
    taken: bool = False


def _bytes_of(buf: Any) -> memoryview:
    if isinstance(buf, (list, tuple)):  # ([buffer, MPI.BYTE])
        buf = buf[0]
    return memoryview(buf).cast("B")


class FakeMpi:
    """MPI for the ranks of a job played in one process: the calls ``Distributed`` makes on
    the communicators it duplicates from the one it is given. A send completes at once (its
    message waits, copied, for its receive); messages are matched by source and tag in the
    order they were sent; a receive not matched yet can be taken back (``Cancel``: its next
    test completes it as cancelled); ``Iallgather`` calls match in the order each rank makes
    them. Every point-to-point message is kept in ``messages``."""

    TAG_UB = 536870911  # (MPICH's)

    def __init__(self, size: int) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.size = size
        self.lock = threading.Condition()
        self.messages: list[Message] = []
        self.gathers: list[tuple[tuple[Any, ...], int]] = []  # (communicator, rank) per call
        self.posted: dict[tuple[Any, int], list[FakeRecv]] = defaultdict(list)
        self.queued: dict[tuple[Any, int], list[Message]] = defaultdict(list)
        self.parts: dict[tuple[Any, int], dict[int, tuple[bytes, Any, FakeRequest]]] = \
            defaultdict(dict)

    def comm(self, rank: int) -> FakeComm:
        return FakeComm(self, rank, ("world",))

    def sent(self, comm: tuple[Any, ...] | None = None, src: int | None = None,
             dest: int | None = None) -> list[Message]:
        with self.lock:
            return [m for m in self.messages if (comm is None or m.comm == comm)
                    and (src is None or m.src == src) and (dest is None or m.dest == dest)]

    def wait_for(self, done: Callable[[], bool], what: str) -> None:
        """Until ``done()`` (checked whenever a message is sent), at most ``BOUND_S``."""
        deadline = time.monotonic() + BOUND_S
        with self.lock:
            while not done():
                left = deadline - time.monotonic()
                assert left > 0, f"never: {what}"
                self.lock.wait(min(left, 0.05))

    def inject(self, comm: tuple[Any, ...], src: int, dest: int, tag: int, data: bytes) -> None:
        """A message from ``src`` that no ``Distributed`` sent (a malformed one, say)."""
        FakeComm(self, src, comm).Isend([data, None], dest, tag)

    def match(self, msg: Message) -> None:
        posted = self.posted[(msg.comm, msg.dest)]
        recv = next((r for r in posted if r.matches(msg)), None)
        if recv is None:
            self.queued[(msg.comm, msg.dest)].append(msg)
        else:
            posted.remove(recv)
            recv.land(msg)
        self.lock.notify_all()


class FakeRequest:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def Test(self, status: Any = None) -> bool:
        return self.done


class FakeRecv:
    def __init__(self, comm: FakeComm, buf: Any, source: int, tag: int) -> None:
        self.job, self.key, self.rank = comm.job, comm.key, comm.rank
        self.buf, self.source, self.tag = buf, source, tag
        self.msg: Message | None = None
        self.cancelled = False

    def matches(self, msg: Message) -> bool:
        MPI = self.job.MPI
        return self.source in (MPI.ANY_SOURCE, msg.src) and self.tag in (MPI.ANY_TAG, msg.tag)

    def land(self, msg: Message) -> None:
        out = _bytes_of(self.buf)
        assert len(msg.data) <= len(out), "a message longer than its receive (MPI truncates)"
        out[:len(msg.data)] = msg.data
        msg.taken = True
        self.msg = msg

    def Test(self, status: Any = None) -> bool:
        with self.job.lock:
            if self.cancelled or self.msg is not None:
                if status is not None:
                    status.Set_cancelled(self.cancelled)
                    if self.msg is not None:
                        status.Set_source(self.msg.src)
                        status.Set_tag(self.msg.tag)
                        status.Set_elements(self.job.MPI.BYTE, len(self.msg.data))
                return True
            return False

    def Cancel(self) -> None:
        with self.job.lock:
            posted = self.job.posted[(self.key, self.rank)]
            if self in posted:
                posted.remove(self)
                self.cancelled = True


class FakeComm:
    """One rank's communicator of a :class:`FakeMpi` job (``key``: which one)."""

    def __init__(self, job: FakeMpi, rank: int, key: tuple[Any, ...]) -> None:
        self.job, self.rank, self.key = job, rank, key
        self.dups = 0  # (duplicates match by their order on each rank, as MPI's do)
        self.gathered = 0

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.job.size

    def Get_attr(self, attr: Any) -> int:
        return FakeMpi.TAG_UB

    def Dup(self) -> FakeComm:
        self.dups += 1
        return FakeComm(self.job, self.rank, (*self.key, self.dups))

    def Idup(self) -> tuple[FakeComm, FakeRequest]:
        return self.Dup(), FakeRequest(done=True)

    def Free(self) -> None:
        pass

    def Isend(self, buf: Any, dest: int, tag: int) -> FakeRequest:
        msg = Message(self.key, self.rank, dest, tag, bytes(_bytes_of(buf)))
        with self.job.lock:
            self.job.messages.append(msg)
            self.job.match(msg)
        return FakeRequest(done=True)

    def Irecv(self, buf: Any, source: int, tag: int) -> FakeRecv:
        job = self.job
        recv = FakeRecv(self, buf, source, tag)
        with job.lock:
            queued = job.queued[(self.key, self.rank)]
            msg = next((m for m in queued if recv.matches(m)), None)
            if msg is None:
                job.posted[(self.key, self.rank)].append(recv)
            else:
                queued.remove(msg)
                recv.land(msg)
        return recv

    def Iprobe(self, source: int, tag: int, status: Any) -> bool:
        job = self.job
        probe = FakeRecv(self, None, source, tag)
        with job.lock:
            msg = next((m for m in job.queued[(self.key, self.rank)] if probe.matches(m)),
                       None)
            if msg is None:
                return False
            status.Set_source(msg.src)
            status.Set_tag(msg.tag)
            status.Set_elements(job.MPI.BYTE, len(msg.data))
            return True

    def Recv(self, buf: Any, source: int, tag: int) -> None:
        job = self.job
        recv = FakeRecv(self, buf, source, tag)
        with job.lock:
            queued = job.queued[(self.key, self.rank)]
            msg = next(m for m in queued if recv.matches(m))  # (probed: it is there)
            queued.remove(msg)
            recv.land(msg)

    def Iallgather(self, row: Any, table: Any) -> FakeRequest:
        job = self.job
        request = FakeRequest()
        data = bytes(_bytes_of(row))
        with job.lock:
            part = job.parts[(self.key, self.gathered)]
            self.gathered += 1
            job.gathers.append((self.key, self.rank))
            part[self.rank] = (data, table, request)
            if len(part) == job.size:
                for _, out, req in part.values():
                    view = _bytes_of(out)
                    for r, (row_bytes, _, _) in part.items():
                        view[r * len(row_bytes):(r + 1) * len(row_bytes)] = row_bytes
                    req.done = True
        return request


@dataclass
class Job:
    """The ranks of a job played in this process: ``dist[r]`` for every rank present (an
    absent rank is mute: nothing reads what is sent to it), ``links[r]`` its host links
    (None: none), ``mpi`` the stand-in."""

    mpi: FakeMpi
    dist: dict[int, Any]
    links: dict[int, Any]

    def scope(self, rank: int, what: str = "reshard") -> CancelScope:
        """A call's scope on ``rank`` (a child of its runtime's)."""
        return CancelScope(what, self.dist[rank].scope)

    def control(self, rank: int) -> tuple[Any, ...]:
        """The communicator ``rank``'s failure notices and queries go on."""
        return self.dist[rank].control_comm.key

    def rounds_comm(self, rank: int) -> tuple[Any, ...]:
        return self.dist[rank].runtime_comm.key


@contextlib.contextmanager
def ranks(n: int, *, present: Sequence[int] | None = None, hosts: str | None = None,
          timeout: float = 30.0, grace: float = 5.0) -> Iterator[Job]:
    """A job of ``n`` ranks (2 devices each), ``present`` ones played here; ``hosts``: the
    host of each rank ("aabb": ranks 0, 1 on one host, 2, 3 on another; default: one host
    for all) — host links join the present ranks of a host."""
    pytest.importorskip("mpi4py", reason="the mpi extra is not installed")
    from overlap.backends.job.distributed import Distributed
    from overlap.backends.job.host_links import HostLinks

    present = list(range(n) if present is None else present)
    hosts = hosts or "a" * n
    mpi = FakeMpi(n)
    ends: dict[int, dict[int, socket.socket]] = {r: {} for r in present}
    for a, b in itertools.combinations(present, 2):
        if hosts[a] == hosts[b]:
            ends[a][b], ends[b][a] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    job = Job(mpi, {}, {})
    placement = Placement.blocks(2 * n, n)
    try:
        for r in present:
            engine = Engine(f"test-engine-r{r}", poll=Backoff(start=1e-4, cap=2e-3))
            links = HostLinks(r, ends[r], engine) if ends[r] else None
            job.links[r] = links
            dist = Distributed(World(r, n, source="mpi"), placement, engine, mpi.comm(r), links,
                               timeout=timeout, grace=grace)
            dist.scope = CancelScope(f"rank {r}'s runtime")
            job.dist[r] = dist
        yield job
    finally:
        for dist in job.dist.values():  # (a handled failure: nothing left for the exit)
            dist.leave(handled=True)
            dist.close()
        for r in present:
            if r not in job.dist:  # (setup failed half-way)
                for s in ends[r].values():
                    s.close()


class Running:
    """A coroutine run to its end on a thread of its own (its own event loop)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(make,), daemon=True)
        self.thread.start()

    def _run(self, make: Callable[[], Any]) -> None:
        try:
            self.value = asyncio.run(make())
        except BaseException as exc:
            self.error = exc

    def result(self) -> Any:
        self.thread.join(BOUND_S)
        assert not self.thread.is_alive(), f"still waiting after {BOUND_S} s"
        if self.error is not None:
            raise self.error
        return self.value


def until(done: Callable[[], bool], what: str) -> None:
    """Until ``done()`` (something another thread does), at most ``BOUND_S``."""
    deadline = time.monotonic() + BOUND_S
    while not done():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.002)


def cancelled(scope: CancelScope) -> BaseException:
    """Until ``scope`` is cancelled (at most ``BOUND_S``): why it was."""
    woken = threading.Event()
    if scope.on_cancel(woken.set) is not None:
        assert woken.wait(BOUND_S), f"{scope} never cancelled"
    assert scope.error is not None
    return scope.error


def solo_calls(dist: Any, k: int, busy: bool = False) -> None:
    """``k`` calls ``dist``'s rank makes on its own devices only (counted, no round); the
    last one still in flight if ``busy``."""
    for i in range(k):
        assert dist.begin_call("solo", b"", (dist.rank,), CancelScope("solo")) is None
        if i < k - 1 or not busy:
            dist.end_call()


def whole_call(job: Job, members: Sequence[int], digest: bytes = b"plan",
               payload: Callable[[int], bytes] = lambda r: bytes([10 + r]) * 3
               ) -> dict[int, Any]:
    """One call made by every present rank: each member agrees and finishes (concurrently);
    returns each member's end-of-call table."""
    rounds = {r: d.begin_call("reshard: the plan", digest, tuple(members), job.scope(r))
              for r, d in job.dist.items() if not d.closed}
    assert all((rounds[r] is None) == (r not in members) for r in rounds)

    def part(r: int) -> Callable[[], Any]:
        async def go() -> dict[int, bytes]:
            await rounds[r].agreed()
            return await rounds[r].finish(payload(r))
        return go

    running = {r: Running(part(r)) for r in members if r in rounds}
    tables = {r: run.result() for r, run in running.items()}
    for r in rounds:
        job.dist[r].end_call()
    return tables


# How a round goes (see Distributed.gather), by the hosts and the call's members:
GATHER_CASES = {
    "links, every rank": (4, "aaaa", (0, 1, 2, 3), "links"),
    "links, three of four": (4, "aaaa", (0, 2, 3), "links"),
    "links, two of six": (6, "aaaaaa", (1, 4), "links"),
    "links within a host": (4, "aabb", (2, 3), "links"),
    "allgather, no links": (3, "abc", (0, 1, 2), "allgather"),
    "allgather, two hosts": (4, "aabb", (0, 1, 2, 3), "allgather"),
    "mpi, three of four": (4, "abcd", (0, 2, 3), "mpi"),
    "mpi, across hosts": (4, "aabb", (1, 2), "mpi"),
}


@pytest.mark.parametrize("before", [0, 2], ids=["call-1", "call-3"])
@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_a_calls_rounds_gather_among_its_members_only(case, before):
    """Both rounds of a call (the agreement, the end of the call) go among its members: all
    to all over host links where they join every member; one ``Iallgather`` where every
    rank is a member and some are not linked; else point to point over MPI among the
    members. Every member gets every member's payload; a rank outside the call (which still
    makes it, and counts it) sends and receives nothing."""
    n, hosts, members, path = GATHER_CASES[case]
    with ranks(n, hosts=hosts) as job:
        for d in job.dist.values():
            solo_calls(d, before)
        tables = whole_call(job, members)
        assert tables == {r: {q: bytes([10 + q]) * 3 for q in members} for r in members}
        assert all(d.calls == before + 1 for d in job.dist.values())
        outside = [r for r in range(n) if r not in members]
        m = len(members)
        frames = {r: (lk.frames_sent, lk.frames_received) if lk is not None else (0, 0)
                  for r, lk in job.links.items()}
        rounds_msgs = job.mpi.sent(job.rounds_comm(0))  # (the same communicator everywhere)
        if path == "links":  # (two rounds: m - 1 rows out and in, each)
            assert all(frames[r] == (2 * (m - 1), 2 * (m - 1)) for r in members), frames
            assert rounds_msgs == [] and job.mpi.gathers == []
        elif path == "allgather":  # (one collective a round on every rank: none is outside)
            assert sorted(r for _, r in job.mpi.gathers) == sorted(2 * list(range(n)))
            assert rounds_msgs == [] and all(f == (0, 0) for f in frames.values())
        else:
            assert job.mpi.gathers == [] and all(f == (0, 0) for f in frames.values())
            pairs = sorted((msg.src, msg.dest) for msg in rounds_msgs)
            assert pairs == sorted(2 * [(a, b) for a in members for b in members if a != b])
        for r in outside:
            assert frames[r] == (0, 0)
            assert not any(r in (msg.src, msg.dest) for msg in rounds_msgs)


ROUND_PATHS = {"links": (3, "aaa", (0, 1, 2)), "allgather": (3, "abc", (0, 1, 2)),
               "mpi": (4, "abcd", (0, 1, 2))}


@pytest.mark.parametrize("path", list(ROUND_PATHS))
def test_a_mismatch_is_settled_by_the_thread_landing_the_last_row(path):
    """Nobody awaits the agreement: the thread that lands its last row compares the rows and
    a mismatch fails the call's scope at once — each rank names the members whose call
    differs from its own — and the verdict then is that same error, without a wait."""
    n, hosts, members = ROUND_PATHS[path]
    with ranks(n, hosts=hosts) as job:
        scopes = {r: job.scope(r) for r in job.dist}
        rounds = {r: d.begin_call("reshard: the plan", b"other" if r == 2 else b"plan",
                                  members, scopes[r]) for r, d in job.dist.items()}
        named = {r: cancelled(scopes[r]) for r in members}
        assert all(isinstance(e, CallMismatch) for e in named.values()), named
        assert {r: e.ranks for r, e in named.items()} == {0: (2,), 1: (2,), 2: (0, 1)}
        assert str(named[0]).startswith("reshard: the plan (call 1): ranks [2] made a "
                                        "different call than rank 0 (every process must")
        assert "ranks [0, 1] made a different call than rank 2" in str(named[2])
        for r in members:
            until(lambda r=r: rounds[r].agreement.over, "the round's sends complete too")
            with pytest.raises(CallMismatch) as got:
                Running(rounds[r].agreed).result()
            assert got.value is named[r]
        assert all(not s.cancelled for r, s in scopes.items() if r not in members)


class HeldMembers(tuple):
    """A call's members whose iteration, once ``armed``, holds the first comparison that
    iterates them half-way (until ``go_on``): another thread settling the agreement."""

    armed = False

    def __new__(cls, members: Sequence[int]) -> HeldMembers:
        obj = super().__new__(cls, members)
        obj.comparing, obj.go_on = threading.Event(), threading.Event()
        return obj

    def __iter__(self) -> Iterator[int]:
        if self.armed and not self.comparing.is_set():
            self.comparing.set()
            self.go_on.wait(BOUND_S)
        return super().__iter__()


@pytest.mark.parametrize("verdict", ["agreed", "verdict_after_failure"])
def test_a_verdict_asked_while_another_thread_settles_it_waits_for_that_verdict(verdict):
    """The thread landing the last row compares the rows while the event loop asks for the
    verdict (the call went on, or its work failed here): the loop waits for the comparison
    under way — it does not take "being settled" for "agreed"."""
    with ranks(2) as job:
        members = HeldMembers((0, 1))
        scope = job.scope(0)
        mine = job.dist[0].begin_call("reshard: the plan", b"plan", members, scope)
        if verdict == "verdict_after_failure":
            scope.fail(RuntimeError("op failed"))  # (this rank's part failed)
        members.armed = True
        job.dist[1].begin_call("reshard: the plan", b"other", (0, 1), job.scope(1))
        assert members.comparing.wait(BOUND_S)  # (rank 1's row landed: being compared)
        asker = Running(getattr(mine, verdict))
        asker.thread.join(0.2)
        assert asker.thread.is_alive()  # (it cannot have a verdict before the comparison)
        members.go_on.set()
        if verdict == "agreed":
            with pytest.raises(CallMismatch, match=r"ranks \[1\] made a different call"):
                asker.result()
        else:
            found = asker.result()
            assert isinstance(found, CallMismatch) and found.ranks == (1,)


@pytest.mark.parametrize("peer", ["comes later", "idle, comes later", "failed after its row",
                                  "failed before", "mute", "never comes", "idle, never comes"])
def test_the_verdict_after_a_failure_waits_only_while_the_round_can_complete(peer):
    """A call whose work failed here still asks for the agreement's verdict — a mismatch
    explains the failures it caused — and waits for the rows that can still come: from a
    member that made the call (its row went, even if it failed since), is still inside an
    earlier one, or is idle behind it (slower, as under load: it may yet make it), at most
    half the grace. A member that failed before making the call, or is mute, will never
    post its row: no wait."""
    grace = 0.4 if peer.endswith("never comes") else 600.0  # (else: never waited for in full)
    with ranks(2, present=[0] if peer == "mute" else None, grace=grace) as job:
        solo_calls(job.dist[0], 1)  # (this rank's call 2 is rank 1's next)
        if peer != "mute":  # (still inside its call 1, or idle after it)
            solo_calls(job.dist[1], 1, busy=peer in ("comes later", "never comes"))
        scope = job.scope(0)
        mine = job.dist[0].begin_call("reshard: the plan", b"plan", (0, 1), scope)
        scope.fail(RuntimeError("op failed"))
        if peer == "failed before":
            job.dist[1].announce_failure("train_step", RuntimeError("boom"))
            assert cancelled(job.dist[0].scope).calls == 1
        if peer == "failed after its row":
            job.dist[1].begin_call("reshard: the plan", b"other", (0, 1), job.scope(1))
            job.dist[1].announce_failure("reshard", RuntimeError("boom"))
            failed = cancelled(job.dist[0].scope)
            assert isinstance(failed, RankFailed) and failed.calls == 2
        asker = Running(mine.verdict_after_failure)
        if peer.endswith("comes later"):  # (once rank 1 answered where it is)
            job.mpi.wait_for(lambda: job.mpi.sent(job.control(1), 1, 0), "the answer")
            if peer == "comes later":
                job.dist[1].end_call()
            job.dist[1].begin_call("reshard: the plan", b"other", (0, 1), job.scope(1))
        found = asker.result()
        if peer in ("comes later", "idle, comes later", "failed after its row"):
            assert isinstance(found, CallMismatch) and found.ranks == (1,)
        else:
            assert found is None


@pytest.mark.parametrize("peer", ["at work", "never made it", "done with it", "went on",
                                  "mute"])
def test_the_end_of_call_round_waits_past_the_timeout_while_every_peer_is_at_work(peer):
    """A call returns once every member's part ended: past the timeout, a member waits on
    while every peer it waits for answers that it is inside the call; a peer idle and behind,
    done with the call, ahead of it or mute fails the wait with CollectiveTimeout naming it
    (and its devices)."""
    timeout = 0.1
    with ranks(2, present=[0] if peer == "mute" else None, timeout=timeout) as job:
        if peer == "went on":
            solo_calls(job.dist[1], 2)
        mine = job.dist[0].begin_call("reshard: the plan", b"plan", (0, 1), job.scope(0))
        theirs = None
        if peer in ("at work", "done with it"):
            theirs = job.dist[1].begin_call("reshard: the plan", b"plan", (0, 1), job.scope(1))
            Running(theirs.agreed).result()
            if peer == "done with it":
                job.dist[1].end_call()

        async def part() -> dict[int, bytes]:
            await mine.agreed()
            return await mine.finish(b"x")

        waiting = Running(part)
        if peer == "at work":  # (rank 1's part ends after rank 0 asked twice)
            job.mpi.wait_for(lambda: len(job.mpi.sent(job.control(0), 0, 1)) >= 2,
                             "rank 0 asks rank 1 twice")
            assert Running(lambda: theirs.finish(b"y")).result() == {0: b"x", 1: b"y"}
            assert waiting.result() == {0: b"x", 1: b"y"}
            return
        said = {"never made it": r"ranks \[1\] never made this call \(they are at calls "
                                 r"\[0\], this rank at 1\)",
                "done with it": r"ranks \[1\] are done with this call \(call 1\) without "
                                r"what this rank waits for",
                "went on": r"ranks \[1\] went on without this rank \(they are at calls "
                           r"\[2\], this rank at 1",
                "mute": r"ranks \[1\] do not answer"}[peer]
        where = re.escape("reshard: the plan (call 1)"
                          + (": every rank's work" if peer == "done with it" else ""))
        with pytest.raises(CollectiveTimeout, match=rf"^{where}: rank 0 waited 0.1 s; {said}"
                           ) as got:
            waiting.result()
        assert got.value.missing == (2, 3)  # (rank 1's devices)


def test_asking_how_far_the_peers_got_names_the_calls_members_only():
    """Past a timeout a rank asks the ranks it waits for — and no other — how many calls they
    made and whether they are inside one, and names those behind it (not in a call: they
    never made this one), past it (they went on without this rank: another plan?) or mute;
    never a rank it did not ask. A wait may go on only while every one asked is at work:
    inside this call, or still inside an earlier one (its own work is bounded)."""
    with ranks(7, present=[0, 1, 2, 4, 5, 6]) as job:  # (rank 3 is mute)
        for r, (calls, busy) in {0: (9, True), 1: (3, False), 2: (4, True), 4: (4, True),
                                 5: (1, False), 6: (2, True)}.items():
            solo_calls(job.dist[r], calls, busy)
        asker = job.dist[2]
        said = asker.ask((0, 1, 2, 3, 4))
        assert "ranks [1] never made this call (they are at calls [3], this rank at 4)" \
            in said.text
        assert "ranks [0] went on without this rank (they are at calls [9]" in said.text
        assert "ranks [3] do not answer" in said.text
        assert "[5]" not in said.text and not said.at_work and not said.idle
        asked = sorted({m.dest for m in job.mpi.sent(job.control(2), src=2)})
        assert asked == [0, 1, 3, 4]  # (not rank 5 nor 6)
        said = asker.ask((2, 4))
        assert said.at_work and "ranks [4] are at work (calls [4], this rank at 4)" in said.text
        said = asker.ask((2, 4, 6))
        assert said.at_work and "ranks [4, 6] are at work (calls [4, 2]" in said.text
        said = asker.ask((1, 2, 6))
        assert not said.at_work and said.idle and "ranks [1] never made this call" in said.text
        said = asker.ask((2,))
        assert said.text == "no other rank to wait for" and not said.at_work


def test_an_overdue_wait_goes_on_only_while_every_peer_is_at_work():
    """``overdue``: returns (the wait goes on) while every peer asked is at work; else
    raises CollectiveTimeout naming the wait, the timeout and — where every peer not at work
    is idle — what it never did, the answers' account otherwise."""
    with ranks(4, present=[0, 1, 2], timeout=2.0) as job:  # (rank 3 is mute)
        solo_calls(job.dist[0], 1, busy=True)
        solo_calls(job.dist[1], 1, busy=True)
        scope = job.scope(0)
        job.dist[0].overdue("broadcast[x] root 1", (1,), "rank 1 never sent it", scope)
        with pytest.raises(CollectiveTimeout, match=r"^broadcast\[x\] root 2: rank 0 waited "
                           r"2 s; rank 2 never sent it$") as got:
            job.dist[0].overdue("broadcast[x] root 2", (2,), "rank 2 never sent it", scope)
        assert got.value.missing == (4, 5) and got.value.op == "broadcast[x] root 2"
        with pytest.raises(CollectiveTimeout, match=r"rank 0 waited 2 s; ranks \[3\] do not "
                                                    r"answer"):
            job.dist[0].overdue("broadcast[x] root 3", (1, 3), "rank 3 never sent it", scope)


def test_asking_the_peers_stops_waiting_for_answers_once_the_scope_is_cancelled():
    """A failure notice that comes while this rank asks its peers is the explanation: the
    question stops waiting for an answer a failed peer may never send."""
    with ranks(2, present=[0]) as job:  # (rank 1 never answers)
        scope = job.scope(0)
        said: list[Any] = []
        asking = threading.Thread(
            target=lambda: said.append(job.dist[0].ask((1,), scope, wait=600.0)), daemon=True)
        asking.start()
        job.mpi.wait_for(lambda: job.mpi.sent(job.control(0), 0, 1), "the question")
        scope.fail(RankFailed("rank 1 failed", rank=1, error="boom"))
        asking.join(BOUND_S)  # (not the 600 s it would wait for an answer)
        assert not asking.is_alive() and "ranks [1] do not answer" in said[0].text


@pytest.mark.parametrize("when", ["before its wait", "during its wait"])
def test_a_peers_failure_notice_ends_a_wait_at_once_without_asking(when):
    """A peer's failure notice fails the runtime's scope (RankFailed naming the rank, what
    it was doing, its error and how many calls it had made), which cancels the call in
    flight: a round's wait ends at once — even one whose timeout ran out already, which does
    not first ask the peers how far they got (the failed one may never answer)."""
    timeout = 0.0 if when == "before its wait" else 600.0
    with ranks(2, timeout=timeout) as job:
        mine = job.dist[0].begin_call("train_step: the step graph", b"g", (0, 1),
                                      job.scope(0, "train_step"))
        if when == "during its wait":  # (rank 1 agrees, then never ends its part)
            theirs = job.dist[1].begin_call("train_step: the step graph", b"g", (0, 1),
                                            job.scope(1, "train_step"))
            Running(theirs.agreed).result()
            waiting = Running(lambda: mine.finish(b""))
        job.dist[1].announce_failure("train_step", RuntimeError("boom"))
        failed = cancelled(job.dist[0].scope)
        calls = 1 if when == "during its wait" else 0
        assert isinstance(failed, RankFailed)
        assert (failed.rank, failed.error, failed.calls) == (1, "RuntimeError: boom", calls)
        assert str(failed) == ("rank 1 failed during train_step: RuntimeError: boom (rank 0 "
                               "stopped its work)")
        if when == "before its wait":
            waiting = Running(mine.agreed)
        with pytest.raises(CollectiveAborted, match=r"aborted \(RankFailed: rank 1 failed "
                                                    r"during train_step"):
            waiting.result()
        assert job.mpi.sent(job.control(0), 0, 1) == []  # (no question)


@pytest.mark.parametrize("how, said", [("close", "closed its runtime"), ("exit", "exited")])
def test_a_rank_that_left_fails_only_the_calls_it_is_a_member_of(how, said):
    """A rank that left after one call: a later call among other ranks goes on, and one this
    rank has no part in waits for nobody; one that needs it fails at once, naming it (and
    how it left) — a RankFailed recorded in the call's scope."""
    with ranks(3) as job:
        for d in job.dist.values():
            solo_calls(d, 1)
        job.dist[1].leave(SystemExit(0) if how == "exit" else None)
        until(lambda: 1 in job.dist[0].departed and 1 in job.dist[2].departed,
              "rank 1's notice")
        assert job.dist[0].departed[1] == (1, said)
        assert whole_call(job, (0, 2)) == {r: {0: b"\n" * 3, 2: b"\x0c" * 3} for r in (0, 2)}
        scope = job.scope(0)
        assert job.dist[0].begin_call("reshard: the plan", b"p", (2, 1), scope) is None
        job.dist[0].end_call()
        assert not scope.cancelled
        scope = job.scope(0)
        with pytest.raises(RankFailed, match=rf"^rank 1 {said} after 1 runtime calls; this "
                           r"rank's call 4 needs it \(rank 0 stopped its work\)$") as got:
            job.dist[0].begin_call("reshard: the plan", b"p", (0, 1), scope)
        assert scope.failures == [got.value] and got.value.rank == 1 and got.value.calls == 1


def test_a_rank_that_leaves_during_a_call_that_needs_it_fails_that_call_at_once():
    """The call in flight waits for a member that leaves without having made it: its notice
    fails the call at once, naming it — not after the timeout."""
    with ranks(2, timeout=600.0) as job:
        scope = job.scope(0)
        mine = job.dist[0].begin_call("reshard: the plan", b"p", (0, 1), scope)
        waiting = Running(mine.agreed)
        job.dist[1].leave()
        failed = cancelled(scope)
        assert isinstance(failed, RankFailed) and str(failed).startswith(
            "rank 1 closed its runtime after 0 runtime calls; this rank's call 1 needs it")
        with pytest.raises(CollectiveAborted, match=r"aborted \(RankFailed: rank 1 closed"):
            waiting.result()
        assert not job.dist[0].scope.cancelled  # (the runtime goes on: a later call may not)


def rows_reached(job: Job, src: int, dest: int, count: int) -> Callable[[], bool]:
    """Whether ``count`` round rows from ``src`` reached ``dest``'s side (link or MPI)."""
    links = job.links.get(dest)
    if links is not None:
        return lambda: links.frames_received >= count
    return lambda: len(job.mpi.sent(job.rounds_comm(src), src, dest)) >= count


@pytest.mark.parametrize("stage", ["agreement", "end of call"])
@pytest.mark.parametrize("path", ["links", "mpi"])
def test_a_failed_call_takes_back_its_rounds_and_a_late_row_completes_no_later_round(path,
                                                                                     stage):
    """Rank 0's call 1 fails (in its agreement, or after its end-of-call row went) and is
    abandoned: its rounds' receives are taken back, so rank 1's row of call 1, which comes
    later, is taken by none of them — it waits unmatched. Rows are matched by the call number
    (their tag): that stray row never completes a round of call 2, which agrees and ends
    with rank 1's call-2 rows."""
    from overlap.backends.job.distributed import AGREE_CHANNEL, DONE_CHANNEL

    n, hosts = (2, "aa") if path == "links" else (3, "abc")
    with ranks(n, hosts=hosts, present=[0, 1]) as job:
        scope = job.scope(0)
        mine = job.dist[0].begin_call("reshard: the plan", b"plan", (0, 1), scope)
        theirs = None
        if stage == "end of call":
            theirs = job.dist[1].begin_call("reshard: the plan", b"plan", (0, 1), job.scope(1))
            Running(mine.agreed).result()
            Running(theirs.agreed).result()
            waiting = Running(lambda: mine.finish(b"x"))
            until(rows_reached(job, 0, 1, 2), "rank 0's end-of-call row")
        scope.fail(RuntimeError("op failed"))
        if stage == "end of call":
            with pytest.raises(CollectiveAborted, match=r"aborted \(RuntimeError: op failed"):
                waiting.result()
        mine.abandon()
        job.dist[0].end_call()
        if stage == "agreement":  # (rank 1's row of call 1 comes after the abandon)
            theirs = job.dist[1].begin_call("reshard: the plan", b"plan", (0, 1),
                                            job.scope(1))
            until(rows_reached(job, 1, 0, 1), "rank 1's row of call 1")
            Running(theirs.agreed).result()  # (rank 0's row of call 1 went before)
        else:
            assert Running(lambda: theirs.finish(b"y")).result() == {0: b"x", 1: b"y"}
            until(rows_reached(job, 1, 0, 2), "rank 1's end-of-call row")
        job.dist[1].end_call()
        assert not mine.agreement.over or stage == "end of call"
        if path == "links":  # (the row waits for a receive of its own: call 1's tag)
            probe = job.links[0].irecv(AGREE_CHANNEL if stage == "agreement" else DONE_CHANNEL,
                                       1, 1, bytearray(64))
            assert probe.done
        else:
            stray = job.mpi.sent(job.rounds_comm(1), 1, 0)[-1]
            assert not stray.taken
        tables = whole_call(job, (0, 1), b"plan 2", lambda r: bytes([20 + r]))
        assert tables == {r: {0: b"\x14", 1: b"\x15"} for r in (0, 1)}


@pytest.mark.parametrize("last", [True, False], ids=["its-last-receive", "one-of-two"])
def test_a_cancel_that_comes_as_a_round_completes_is_not_lost(last):
    """Ctrl-C (a task's cancel) in the very loop pass where a receive's completion wakes the
    round's wait: the wait raises CancelledError — it does not return as if the call went on
    (asyncio.wait_for on 3.11 dropped such a cancel) — and takes back the receives still
    pending."""
    from overlap.backends.job.distributed import Round

    class Receive(Completion):
        """A receive that can be taken back (as a link's or MPI's)."""

        __slots__ = ("cancelled",)

        def Cancel(self) -> None:
            self.cancelled = True

    with ranks(2, timeout=600.0) as job:
        first, other = Receive("row from rank 1", 1), Receive("row from rank 2", 2)
        first.cancelled = other.cancelled = False
        rnd = Round(job.dist[0], [first] if last else [first, other], [], (0, 1, 2))

        async def main() -> None:
            task = asyncio.create_task(rnd.wait(job.scope(0), "train_step: the step graph"))
            await asyncio.sleep(0)  # (the task runs up to its wait)
            loop = asyncio.get_running_loop()

            def complete() -> None:  # (as the engine would, then the cancel in that pass)
                first.complete()
                loop.call_soon(task.cancel)

            loop.call_soon(complete)
            with pytest.raises(asyncio.CancelledError):
                await task

        Running(main).result()
        assert not first.cancelled  # (it completed)
        assert other.cancelled is (not last)  # (pending in the round: taken back)


def test_a_round_whose_wait_is_not_until_cancelled_ends_at_its_deadline():
    """With ``until_cancelled=False`` (the verdict after a failure) a wait outlives the
    scope's cancellation and ends at its deadline: False, the round still posted."""
    with ranks(2, timeout=600.0) as job:
        scope = job.scope(0)
        mine = job.dist[0].begin_call("reshard: the plan", b"p", (0, 1), scope)
        scope.fail(RuntimeError("op failed"))

        async def wait() -> bool:
            return await mine.agreement.wait(scope, "reshard", until_cancelled=False,
                                             deadline=time.perf_counter() + 0.05)

        assert Running(wait).result() is False
        with pytest.raises(CollectiveAborted, match=r"reshard: aborted \(RuntimeError: op"):
            Running(lambda: mine.agreement.wait(scope, "reshard")).result()


@pytest.mark.parametrize("how, said", [("close", "closed its runtime"), ("exit", "exited")])
def test_a_rank_that_leaves_says_so_once_and_after_how_many_calls(how, said):
    """Leaving (the runtime closed, or the script ended with ``sys.exit(0)``) tells every
    other rank, once: how it left and after how many calls."""
    with ranks(3) as job:
        solo_calls(job.dist[0], 2)
        error = SystemExit(0) if how == "exit" else None
        job.dist[0].leave(error)
        job.dist[0].leave(error)  # (once)
        for r in (1, 2):
            until(lambda r=r: 0 in job.dist[r].departed, f"rank {r} hears it")
            assert job.dist[r].departed[0] == (2, said) and 0 in job.dist[r].exiting
        notices = job.mpi.sent(job.control(0), src=0)
        assert sorted(m.dest for m in notices) == [1, 2]
        assert all(json.loads(m.data) == {"rank": 0, "calls": 2, "how": said}
                   for m in notices)


def test_a_failure_that_was_handled_is_not_announced_again_at_close():
    """A rank whose call failed told its peers then; closing its runtime afterwards (the
    failure handled) says nothing more — not that it left."""
    with ranks(2) as job:
        job.dist[0].failed("reshard", RuntimeError("op failed"))
        failed = cancelled(job.dist[1].scope)
        assert isinstance(failed, RankFailed) and failed.error == "RuntimeError: op failed"
        before = len(job.mpi.sent(job.control(0), src=0))
        job.dist[0].leave(handled=True)
        assert len(job.mpi.sent(job.control(0), src=0)) == before
        assert 0 not in job.dist[1].departed


def test_a_notice_sent_as_the_engine_closes_is_dropped_not_raised(caplog):
    """A control message posted while the progress engine closes (a reply to a peer's query
    as this rank leaves, a failure notice) cannot be watched to its end: it is dropped — the
    rank's exit notice says more — and nothing raises on the engine's thread or the caller's."""
    with ranks(2) as job:
        job.dist[0].engine.close()
        with caplog.at_level("ERROR", logger="overlap"):
            job.dist[0].failed("reshard", RuntimeError("late"))  # (posts a notice to rank 1)
        assert isinstance(job.dist[0].broken, RuntimeError)
        assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_a_peers_failure_is_not_announced_back():
    """A call that failed because a peer did (RankFailed) tells nobody: they know."""
    with ranks(2) as job:
        job.dist[0].failed("reshard", RankFailed("rank 1 failed", rank=1, error="boom"))
        assert job.mpi.sent(job.control(0), src=0) == []
        assert isinstance(job.dist[0].broken, RankFailed)


def test_a_malformed_control_message_is_logged_and_dropped(caplog):
    """Control messages are JSON objects of fixed, typed fields per kind: one that is not is
    logged and dropped (nothing a peer sends is unpickled), and the next is taken in."""
    import pickle

    with ranks(3, present=[0, 1]) as job:
        job.dist[1].announce_failure("reshard", RuntimeError("boom"))  # (to ranks 0 and 2)
        notice = job.mpi.sent(job.control(1), 1, 2)[0]  # (rank 2 is not here to read it)
        failed = cancelled(job.dist[0].scope)
        job.dist[0].scope = CancelScope("rank 0's next runtime")
        bad = [b"{not json", pickle.dumps({"rank": 2}), b'{"rank": "2", "during": "x", '
               b'"error": "y", "calls": 1}', b'[2, "x", "y", 1]']
        with caplog.at_level("WARNING", logger="overlap"):
            for data in bad:
                job.mpi.inject(job.control(1), 2, 0, notice.tag, data)
            job.mpi.inject(job.control(1), 2, 0, notice.tag, notice.data.replace(
                b'"rank": 1', b'"rank": 2'))
            again = cancelled(job.dist[0].scope)
        assert isinstance(failed, RankFailed) and isinstance(again, RankFailed)
        assert again.rank == 2 and again.error == "RuntimeError: boom"
        dropped = [r for r in caplog.records if "ignored a malformed control message" in
                   r.getMessage()]
        assert len(dropped) == len(bad)
        assert all(f"(tag {notice.tag}) from rank 2" in r.getMessage() for r in dropped)


def test_control_messages_are_parsed_field_by_field():
    """(The parser's rules, message by message: exactly the fields of the kind, each of its
    type — a bool is not an int; nothing larger than a control message can be.)"""
    from overlap.backends.job.control_messages import ControlTag, parse_control

    _parse = parse_control
    _FAILED, _EXITING, _QUERY, _REPLY, _LEFT = (ControlTag.FAILED, ControlTag.EXITING,
                                                ControlTag.QUERY, ControlTag.REPLY,
                                                ControlTag.LEFT)

    def enc(msg: Any) -> bytes:
        return json.dumps(msg).encode()

    failed = {"rank": 1, "during": "train_step", "error": "E: x", "calls": 3}
    assert _parse(_FAILED, enc(failed)) == failed
    assert _parse(_EXITING, enc({"rank": 2})) == {"rank": 2}
    assert _parse(_QUERY, enc({})) == {}
    assert _parse(_REPLY, enc({"calls": 4, "busy": False})) == {"calls": 4, "busy": False}
    assert _parse(_LEFT, enc({"rank": 1, "calls": 2, "how": "exited"}))["how"] == "exited"
    for tag, data in [
        (_FAILED, enc({**failed, "extra": 1})),
        (_FAILED, enc({k: v for k, v in failed.items() if k != "calls"})),
        (_FAILED, enc({**failed, "calls": True})),  # (a bool is not an int)
        (_FAILED, enc({**failed, "calls": 3.0})),
        (_REPLY, enc({"calls": 4, "busy": 1})),
        (_EXITING, enc([2])),
        (_QUERY, b"\x80\x04K\x01."),  # (a pickle)
        (_QUERY, b"\xff\xfe"),
        (_EXITING, b"[" * 60_000),  # (nested past the parser's recursion limit)
        (_EXITING, b"[" * 100_000),  # (longer than any control message)
        (_EXITING, enc({"rank": 2, "pad": " " * (1 << 16)})),
        (99, enc({})),  # (no such kind)
    ]:
        assert _parse(tag, data) is None, (tag, data[:40])


def test_an_abandoned_mpi_round_receive_is_taken_back_by_mpi(tmp_path):
    """(MPI's own cancel, which the stand-in above only imitates.) Over MPI point to point,
    rank 0 abandons call 1 before rank 1's row of it comes: that row stays unmatched (an
    ``Iprobe`` finds it after call 2), and call 2 agrees and ends with call 2's rows."""
    pytest.importorskip("mpi4py", reason="the mpi extra is not installed")
    from test_mpi import MPIEXEC, mpiexec, outputs, verdicts

    if MPIEXEC is None:
        pytest.skip("no mpiexec (pip install mpich)")
    done, _ = mpiexec(4, "abandon", str(tmp_path), data="mpi")
    assert done.returncode == 0, verdicts(done.stdout + done.stderr)
    got = outputs(tmp_path, 4)
    assert not bool(got[0]["abandoned_over"])  # (its receive was taken back: never landed)
    assert bool(got[0]["stray_waits"]) and int(got[0]["stray_source"]) == 1
    for r in (0, 1):
        assert got[r]["table"].tolist() == [[20], [21]]
