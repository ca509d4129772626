"""The process world and device placement: what the launcher says, and the errors for what
cannot run (no MPI needed: these never start a multi-process backend)."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from overlap import Runtime
from overlap.backends.mpi import Backoff
from overlap.pipeline import mesh_groups
from overlap.world import Placement, World, _ranges, detect_world
from scheduler import Cluster, DeviceMesh

CLUSTER = Cluster(2, 2, nic_gbps=100.0)


def test_no_launcher_is_a_one_process_world():
    assert detect_world({}) == World()
    assert not World().distributed


def test_torchrun_variables_name_the_process():
    w = detect_world({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                      "LOCAL_WORLD_SIZE": "2"})
    assert (w.rank, w.size, w.local_rank, w.local_size, w.source) == (3, 4, 1, 2, "env")


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


def test_overlap_world_single_wins_over_a_launcher():
    assert detect_world({"OVERLAP_WORLD": "single", "PMI_RANK": "1", "PMI_SIZE": "2"}) == World()


def test_a_multi_process_torchrun_world_is_refused_with_the_launch_to_use():
    with pytest.raises(RuntimeError, match="mpiexec -n N"):
        Runtime(CLUSTER, world=World(0, 2, source="env"))


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


def test_device_ranges_read_compactly():
    assert _ranges([4, 5, 6, 7, 9, 12, 13]) == "4-7,9,12-13"
    assert _ranges([]) == "none"


def test_cuda_across_processes_runs_one_device_per_process():
    from overlap.backends.cuda_mpi import CudaMpiBackend

    with pytest.raises(ValueError, match=r"placement: backend 'cuda' across processes runs "
                                         r"one device per process .* rank 0 owns 2 devices"):
        CudaMpiBackend(4, world=World(0, 2, source="mpi"), placement=Placement.blocks(4, 2))


def test_a_placement_must_cover_the_cluster_exactly():
    Placement.blocks(4, 2).check_covers(4)
    with pytest.raises(ValueError, match="placement: covers 4 devices, the cluster has 6"):
        Placement.blocks(4, 2).check_covers(6)
    from overlap.backends.cuda_mpi import CudaMpiBackend

    with pytest.raises(ValueError, match="placement: covers 2 devices, the cluster has 4"):
        CudaMpiBackend(4, world=World(0, 2, source="mpi"), placement=Placement((0, 1)))


@pytest.mark.parametrize("grace", [-1.0, "3", True, float("nan")])
def test_a_bad_exit_grace_is_named_before_mpi_starts(grace):
    from overlap.backends.mpi import MpiBackend

    with pytest.raises(ValueError, match=r"grace: expected seconds >= 0"):
        MpiBackend(4, world=World(0, 2, source="mpi"), placement=Placement.blocks(4, 2),
                   grace=grace)


def test_broadcast_pieces_minimise_the_pipeline_model():
    """The piece size the MPI backend picks is the best whole number of pieces under its own
    model (k pieces through s stages: (k + s - 1) x (bytes / (k x bandwidth) + overhead))."""
    from overlap.backends import mpi

    def modeled(nbytes: int, stages: int, k: int) -> float:
        return (k + stages - 1) * (nbytes / k / mpi.HOST_BYTES_PER_S + mpi.PIECE_OVERHEAD_S)

    for nbytes in (1 << 20, 7 << 20, 64 << 20, 1 << 30):
        for stages in (2, 3, 5, 9):
            piece = mpi.piece_bytes(nbytes, stages)
            assert piece >= mpi.MIN_PIECE_BYTES
            k = -(-nbytes // piece)
            best = min(modeled(nbytes, stages, j) for j in range(1, 2000))
            assert modeled(nbytes, stages, k) <= best * 1.02, (nbytes, stages, k)
    # One stage (one hop, nothing copied on): one message; small tensors: one piece.
    assert mpi.piece_bytes(64 << 20, 1) == 64 << 20
    assert mpi.piece_bytes(1000, 4) == 1000
    assert mpi.piece_bytes(0, 1) == 1
    # Longer pipelines cut finer.
    assert mpi.piece_bytes(64 << 20, 9) < mpi.piece_bytes(64 << 20, 2)


def test_a_bad_piece_size_is_named():
    from overlap.backends.mpi import MpiBackend

    with pytest.raises(ValueError, match=r"chunk_bytes: expected an int >= 1 or None"):
        MpiBackend(4, world=World(0, 2, source="mpi"), placement=Placement.blocks(4, 2),
                   chunk_bytes=0)


def test_a_rank_prints_its_traceback_in_one_write(monkeypatch):
    """Python's own hook writes a traceback in pieces; under a launcher with unbuffered output
    several ranks' pieces interleave mid-line. The exit guard writes it whole."""
    import traceback

    from overlap.backends.distributed import print_whole
    from overlap.errors import CallMismatch

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


def test_a_wait_on_the_runtimes_messages_ends_at_once_when_aborted_past_its_timeout():
    """A call aborted by a peer's failure notice after its timeout ran out raises at once:
    it does not first ask the peers how far they got (the failed one never answers; the
    call returned a second late)."""
    from overlap.backends.distributed import Distributed
    from overlap.errors import CollectiveAborted

    class Never:
        def Test(self) -> bool:
            return False

        def Cancel(self) -> None:
            pass

    class Backend:
        abort_reason = "rank 0 failed"
        timeout = 0.0  # run out already

    class Control:
        def lagging(self, calls: int, among=None) -> tuple[str, bool]:
            raise AssertionError("asked the peers")

    dist = object.__new__(Distributed)
    dist.backend, dist.control, dist.calls, dist.rank = Backend(), Control(), 3, 1
    dist.poll, dist.grace = Backoff(), 5.0
    with pytest.raises(CollectiveAborted, match="rank 0 failed"):
        dist.wait_polled(Never(), "train_step: losses")


def test_asking_the_peers_how_far_they_got_stops_waiting_once_aborted():
    """A failure notice that arrives while this rank asks its peers is the explanation: the
    question stops waiting for an answer a failed peer may never send."""
    import time

    from overlap.backends.distributed import _Control

    class Backend:
        abort_reason = "rank 0 failed"

    class Dist:
        backend = Backend()

    control = object.__new__(_Control)
    control.dist, control.rank, control.size, control.replies = Dist(), 1, 2, {}
    control.tell_all = lambda tag, msg, wait: None  # (rank 0 never answers)
    started = time.monotonic()
    said = control.behind(3, wait=60.0)
    assert time.monotonic() - started < 5.0  # not the 60 s it would wait for an answer
    assert "ranks [0] do not answer" in said


def test_asking_how_far_the_peers_got_names_the_calls_members_only():
    """Past a timeout, a rank asks every rank how many calls it made and whether it is inside
    one, and names the call's members behind it (not in a call: they never made this one),
    past it (they went on without this rank: another plan?) or mute — never a rank outside
    the call, whose count says nothing about it. A wait may go on (patient) only while every
    other member is at work: inside this call, or still inside an earlier one."""
    from overlap.backends.distributed import _Control

    class Backend:
        abort_reason = None

    class Dist:
        backend = Backend()

    control = object.__new__(_Control)
    control.dist, control.rank, control.size, control.replies = Dist(), 2, 6, {}

    def answer(tag, msg, wait) -> None:  # (rank 3 does not answer)
        control.replies.update({0: (9, True), 1: (3, False), 4: (4, True), 5: (1, False),
                                6: (2, True)})

    control.tell_all = answer
    control.size = 7
    said, at_work = control.lagging(4, among=(0, 1, 2, 3, 4), wait=0.05)
    assert "ranks [1] never made this call (they are at calls [3], this rank at 4)" in said
    assert "ranks [0] went on without this rank (they are at calls [9]" in said
    assert "ranks [3] do not answer" in said
    assert "[5]" not in said and not at_work
    said, at_work = control.lagging(4, among=(2, 4), wait=0.05)
    assert at_work and "ranks [4] are in this call" in said
    said, at_work = control.lagging(4, among=(2, 4, 6), wait=0.05)
    assert at_work and "ranks [6] are still in calls [2], this rank at 4" in said
    said, at_work = control.lagging(4, among=(1, 2, 6), wait=0.05)
    assert not at_work and "ranks [1] never made this call" in said


def test_a_rank_that_left_fails_only_the_calls_it_is_a_member_of():
    """A rank that left after one call: a later call among other ranks goes on; one that
    needs it fails at once, naming it (and how it left)."""
    from overlap.backends.distributed import Distributed
    from overlap.errors import RankFailed

    class Backend:
        def __init__(self) -> None:
            self.failures: list[BaseException] = []
            self.aborted: list[str] = []

        def note_failure(self, exc: BaseException) -> None:
            self.failures.append(exc)

        def abort(self, reason: str) -> None:
            self.aborted.append(reason)

    dist = object.__new__(Distributed)
    dist.backend, dist.rank, dist.broken = Backend(), 0, None
    dist.departed = {1: (1, "exited")}
    dist._check_departed(2, (0, 2, 3))
    dist._check_departed(2, (2, 1))  # (not this rank's call: it waits for nobody)
    assert dist.backend.aborted == [] and dist.broken is None
    with pytest.raises(RankFailed, match="rank 1 exited after 1 runtime calls; this rank's "
                       "call 2 needs it"):
        dist._check_departed(2, (0, 1))
    assert dist.backend.aborted == ["rank 1 left"]


class _Pending:
    """A request that completes at its ``n``-th test."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.cancelled = False

    def Test(self) -> bool:
        self.left -= 1
        return self.left <= 0

    def Cancel(self) -> None:
        self.cancelled = True

    def Wait(self) -> None:
        pass


def _dist(inside: bool, timeout: float = 0.005):
    """A Distributed with fakes: a timeout of 5 ms (each poll sleeps 2 ms); every peer answers
    that it is inside this call (``inside``) or one is behind."""
    from overlap.backends.distributed import Backoff, Distributed

    class Backend:
        abort_reason = None

    Backend.timeout = timeout

    class Control:
        asked = 0

        def lagging(self, calls: int, among=None) -> tuple[str, bool]:
            Control.asked += 1
            return ("every rank made this call" if inside
                    else "ranks [1] never made this call"), inside

    dist = object.__new__(Distributed)
    dist.backend, dist.control, dist.calls, dist.rank = Backend(), Control(), 3, 0
    dist.poll, dist.grace = Backoff(start=0.002, cap=0.002), 5.0
    return dist


@pytest.mark.parametrize("how", ["polled", "linked"])
def test_the_end_of_call_barrier_waits_past_the_timeout_while_every_peer_is_in_the_call(how):
    """The barrier waits for the others' whole remaining work: past the timeout it waits on
    while every peer says it is inside this call; a wait that is not patient, or a peer
    behind, fails naming them."""
    import asyncio

    from overlap.errors import CollectiveTimeout

    def wait(dist, req, patient: bool) -> None:
        if how == "polled":
            dist.wait_polled(req, "reshard: every rank's work", patient=patient)
        else:
            req.arm = lambda wake: None
            asyncio.run(dist.wait_linked(req, "reshard: every rank's work", patient=patient))

    dist = _dist(inside=True)
    req = _Pending(10)  # (9 looks: 16 ms or more, past the 5 ms timeout)
    wait(dist, req, patient=True)
    assert req.left == 0 and dist.control.asked >= 1
    with pytest.raises(CollectiveTimeout, match="every rank made this call"):
        wait(_dist(inside=True), _Pending(10**9), patient=False)
    with pytest.raises(CollectiveTimeout, match=r"ranks \[1\] never made this call"):
        wait(_dist(inside=False), _Pending(10**9), patient=True)


def test_a_cancel_that_comes_as_a_linked_round_completes_is_not_lost():
    """Ctrl-C (a task's cancel) in the very loop pass where the round's completion wakes the
    wait: the wait raises CancelledError and takes its receives back — it does not return
    as if the call went on (asyncio.wait_for on 3.11 dropped such a cancel)."""
    import asyncio

    dist = _dist(inside=True, timeout=60.0)

    class Round(_Pending):
        def __init__(self) -> None:
            super().__init__(10**9)
            self.wake = None

        def arm(self, wake) -> None:
            self.wake = wake

    async def main() -> None:
        r = Round()
        task = asyncio.create_task(dist.wait_linked(r, "train_step: the step graph"))
        while r.wake is None:
            await asyncio.sleep(0)
        await asyncio.sleep(0.005)  # (asleep in its wait)
        loop = asyncio.get_running_loop()

        def complete() -> None:  # as the link thread would, then the cancel in that pass
            r.left = 0
            r.wake()
            loop.call_soon(task.cancel)

        loop.call_soon(complete)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert r.cancelled

    asyncio.run(main())


@pytest.mark.parametrize("n, members", [(4, (0, 1, 2, 3)), (4, (0, 2, 3)), (4, (1, 3)),
                                        (6, (0, 1, 2, 3, 4, 5)), (6, (0, 2, 3, 4, 5))],
                         ids=["every-rank", "three-of-four", "two-of-four", "six-of-six",
                              "five-of-six"])
@pytest.mark.parametrize("call", [0, 1, 5])
def test_a_linked_round_gathers_among_the_calls_members_only(call, n, members):
    """The runtime's rounds over host links (the agreement, the end-of-call barrier): every
    member gets every member's row — up to DIRECT_MEMBERS (4) members each from each, one
    hop; more through one member (the hub: the call number modulo the members, so the load
    moves round), in 2 (m - 1) messages, not m (m - 1). A rank outside the call's members
    sends and receives nothing. Whoever waits is woken once, when its round is over."""
    import itertools
    import socket
    import threading

    import numpy as np

    from overlap.backends.distributed import DIRECT_MEMBERS, Distributed
    from overlap.backends.host_links import HostLinks

    m = len(members)
    ends: dict[int, dict[int, socket.socket]] = {r: {} for r in range(n)}
    for a, b in itertools.combinations(range(n), 2):
        ends[a][b], ends[b][a] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    links = [HostLinks(r, ends[r]) for r in range(n)]
    hub = members[call % m]
    try:
        tables, rounds = {}, {}
        woken: dict[int, list[int]] = {}
        done = {r: threading.Event() for r in members}
        for r in [hub, *(r for r in members if r != hub)]:  # (the hub waits first)
            dist = object.__new__(Distributed)
            dist.rank, dist.links = r, links[r]
            dist.world = type("World", (), {"size": n})()
            mine = np.full(8, 10 + r, np.uint8)
            every = np.zeros((n, 8), np.uint8)
            every[r] = mine
            tables[r] = every
            rounds[r] = dist.gather_round(7, call, members, mine, every)
            woken[r] = []
            rounds[r].arm(lambda r=r: (woken[r].append(1), done[r].set()))
        for r, rnd in rounds.items():
            assert rnd.Test() or done[r].wait(10.0), "a round never completed"
            assert rnd.Test()
        # (The hub's round was armed before any row could land: its wake comes, just after
        # its last row and the table it forwards.)
        assert done[hub].wait(10.0)
        for every in tables.values():
            assert [every[r, 0] for r in members] == [10 + r for r in members]
        sent = [lk.frames_sent for lk in links]
        outside = [r for r in range(n) if r not in members]
        assert all(sent[r] == 0 and links[r].frames_received == 0 for r in outside), sent
        if m <= DIRECT_MEMBERS:
            assert all(sent[r] == m - 1 for r in members), sent
        else:
            assert sent[hub] == m - 1 and sum(sent) == 2 * (m - 1), sent
        assert (m <= DIRECT_MEMBERS) == (n == 4)  # (both ways are run)
        # Its waiter is woken once a round (the hub's m - 1 rows land one by one).
        assert len(woken[hub]) == 1 and all(len(w) <= 1 for w in woken.values()), woken
    finally:
        for lk in links:
            lk.close()


def _linked_pair(aborted: bool = False, linked: bool = True):
    """Two ranks' Distributed (fakes but their host links: a socket pair)."""
    import socket

    from overlap.backends.distributed import Distributed
    from overlap.backends.host_links import HostLinks

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    links = [HostLinks(0, {1: a}), HostLinks(1, {0: b})]
    dists = []
    for r in range(2):
        dist = object.__new__(Distributed)
        dist.rank, dist.links = r, links[r] if linked else None
        dist.world = type("World", (), {"size": 2})()
        dist.backend = type("Backend", (), {"abort_reason": "stop" if aborted else None,
                                             "failures": []})()
        dist.backend.note_failure = dist.backend.failures.append
        dist.agreed_at = None
        dists.append(dist)
    return dists, links


@pytest.mark.parametrize("case", ["ended", "launched only", "failed", "aborted", "collective"])
def test_the_end_of_call_row_goes_from_the_thread_that_ends_the_work(case):
    """Where an event's completion is its work's end (the host backends), the end-of-call
    round is posted by whoever completes the call's last event — a peer waiting for this
    rank's row is not kept waiting until this rank's event loop runs. Not where completion
    is a launch (CUDA), nor when an event failed or the work was aborted (the round would
    only be taken back), nor for an MPI collective (posted in one order, from the loop)."""
    import threading

    from overlap.backends.cpu import CpuEvent
    from overlap.backends.distributed import AGREE_CHANNEL, Agreement

    dists, links = _linked_pair(aborted=case == "aborted", linked=case != "collective")
    try:
        posted = []
        if case == "collective":  # (no MPI here: the rounds it would post, recorded)
            dists[0].gather_round = lambda channel, *a: posted.append(channel) or _Pending(1)
        check = Agreement(dists[0], b"x" * 32, "reshard", 3, (0, 1))
        check.post()
        sent = links[0].frames_sent
        ev, other = CpuEvent("lane end"), CpuEvent("other lane end")
        check.hurry_after([ev, other], ended=case != "launched only")
        ev._complete()
        assert check._done is None and links[0].frames_sent == sent  # (one lane still busy)
        other._complete(RuntimeError("op failed") if case == "failed" else None)
        # A round polled over MPI is hurried as the work ends; over links nothing polls.
        assert check._hurry.is_set() if case == "collective" else check._hurry is None
        if case != "ended":
            assert check._done is None and links[0].frames_sent == sent
            assert posted == ([AGREE_CHANNEL] if case == "collective" else [])
            return
        assert check._done is not None and links[0].frames_sent == sent + 1
        peer = Agreement(dists[1], b"x" * 32, "reshard", 3, (0, 1))
        peer.post_done()
        for c in (check, peer):  # (each round over once the other's row lands)
            landed = threading.Event()
            c._done.arm(landed.set)
            assert c._done.Test() or landed.wait(10.0)
        check.post_done()  # (finish: posted already, not twice)
        assert links[0].frames_sent == sent + 1
    finally:
        for lk in links:
            lk.close()


def _round_waits(dists) -> None:
    """Give the fake ranks' Distributed the one wait ``Agreement.finish`` uses: until the
    round is over (10 s at most)."""
    async def wait_round(round_, what, **_):
        landed = threading.Event()
        round_.arm(landed.set)
        assert round_.Test() or landed.wait(10.0), f"{what}: never over"

    for d in dists:
        d.wait_round = wait_round


def _landed(check) -> None:
    """Until every row of ``check``'s agreement has landed (and been compared)."""
    landed = threading.Event()
    check._req.when_landed(landed.set)
    assert landed.wait(10.0)


@pytest.mark.parametrize("rank0", ["ends first", "row went first"])
def test_a_row_posted_once_the_work_ended_stands_for_the_end_of_call_round(rank0):
    """Over host links a rank's row waits for its work's end (``hurry_after``) and says
    so: where every member's row does, the call needs no end-of-call round — each member
    sees the same table, so all skip it alike. A member whose row went before its work
    ended (at ``post_within``'s time, say) makes every member use the round."""
    import asyncio

    from overlap.backends.cpu import CpuEvent
    from overlap.backends.distributed import Agreement

    dists, links = _linked_pair()
    _round_waits(dists)
    try:
        checks = [Agreement(d, b"x" * 32, "reshard", 3, (0, 1)) for d in dists]
        if rank0 == "row went first":
            assert checks[0].post()  # (before its work ended: it says not)
        for c in checks:
            assert c.checked_early
            ev = CpuEvent("lane end")
            c.hurry_after([ev], ended=True)
            assert c._req is None or rank0 == "row went first"
            ev._complete()
        sent = [lk.frames_sent for lk in links]
        if rank0 == "ends first":
            assert sent == [1, 1] and all(c._done is None for c in checks)
        else:  # (rank 0's end-of-call row went as its work ended; rank 1's row said "ended")
            assert sent == [2, 1] and checks[0]._done is not None and checks[1]._done is None
        for c in checks:
            _landed(c)
            asyncio.run(c.wait())
        for c in reversed(checks):  # (rank 1's end-of-call row goes in its finish)
            asyncio.run(c.finish())
        if rank0 == "ends first":
            assert [lk.frames_sent for lk in links] == [1, 1]
            assert all(c._done is None for c in checks)
        else:
            assert [lk.frames_sent for lk in links] == [2, 2]
            assert all(c._done.Test() for c in checks)
    finally:
        for lk in links:
            lk.close()


def _held_row(dist):
    """An agreement over host links whose row waits for its one lane's end (the event)."""
    from overlap.backends.cpu import CpuEvent
    from overlap.backends.distributed import Agreement

    check = Agreement(dist, b"x" * 32, "reshard", 3, (0, 1))
    ev = CpuEvent("lane end")
    check.hurry_after([ev], ended=True)
    return check, ev


async def _past_held_time() -> None:
    """Until a timer armed for now (``post_within(loop, 0)``) has run: timers run in time
    order, and this one is due later."""
    loop = asyncio.get_running_loop()
    later = loop.create_future()
    loop.call_later(0.001, later.set_result, None)
    await later


def test_a_row_held_for_the_works_end_goes_at_post_withins_time_at_the_latest():
    """A peer's transfer timeouts and a mismatch's discovery wait for this rank's row: if
    the work has not ended ``post_within`` seconds after the launch, the row goes then
    (saying the work has not ended), and the work's end posts the end-of-call row."""
    import asyncio

    from overlap.backends.distributed import _ENDED

    dists, links = _linked_pair()
    try:
        check, ev = _held_row(dists[0])

        async def held() -> None:
            check.post_within(asyncio.get_running_loop(), 0.0)
            await _past_held_time()

        asyncio.run(held())
        assert check._req is not None and check._mine[_ENDED] == 0
        assert links[0].frames_sent == 1
        ev._complete()
        assert check._done is not None and links[0].frames_sent == 2
    finally:
        for lk in links:
            lk.close()


@pytest.mark.parametrize("how", ["failed", "abandoned"])
def test_no_row_goes_from_the_completing_thread_when_the_work_failed_or_the_call_ended(how):
    """A failed part posts no row as it ends: the event loop's verdict (``wait``) posts it
    (saying the work has not ended). After ``abandon`` (the call failed here) nothing goes
    at all: neither the held row, at its time or at the work's end, nor the end-of-call
    row."""
    import asyncio

    from overlap.backends.distributed import _ENDED

    dists, links = _linked_pair()
    try:
        check, ev = _held_row(dists[0])

        async def call() -> None:
            check.post_within(asyncio.get_running_loop(), 0.0)
            if how == "abandoned":
                check.abandon()
            else:
                ev._complete(RuntimeError("op failed"))
                assert check._req is None and links[0].frames_sent == 0
                assert check.post()  # (what wait() does first)
            await _past_held_time()

        asyncio.run(call())
        if how == "failed":
            assert check._mine[_ENDED] == 0 and links[0].frames_sent == 1
            return
        ev._complete()
        check.post_done()
        assert check._req is None and check._done is None and links[0].frames_sent == 0
    finally:
        for lk in links:
            lk.close()


def test_a_row_that_cannot_go_from_the_completing_thread_is_the_event_loops_failure(caplog):
    """The links closed before the work's end: the completing thread's post fails there,
    quietly (not a callback's bug: nothing logged; the event's other callbacks run), and
    the event loop's verdict meets the failure itself, raising it in the call."""
    import asyncio

    from overlap.backends.cpu import CpuEvent
    from overlap.backends.distributed import Agreement
    from overlap.errors import CollectiveAborted

    dists, links = _linked_pair()
    try:
        check = Agreement(dists[0], b"x" * 32, "reshard", 3, (0, 1))
        ev = CpuEvent("lane end")
        check.hurry_after([ev], ended=True)
        after: list[bool] = []
        ev.add_done_callback(lambda _: after.append(True))
        links[0].close()
        with caplog.at_level("ERROR", logger="overlap"):
            ev._complete()  # (raises nothing: the post failed quietly)
        assert after == [True] and check._req is None and caplog.text == ""
        with pytest.raises(CollectiveAborted, match="host links are closed"):
            asyncio.run(check.wait())
    finally:
        for lk in links:
            lk.close()


def test_a_failed_call_takes_back_its_end_of_call_round():
    """A call that fails after its end-of-call row went (its work ended here, a peer's
    failed): the round's receive is taken back, not left posted on the link."""
    dists, links = _linked_pair()
    from overlap.backends.distributed import Agreement

    try:
        check = Agreement(dists[0], b"x" * 32, "reshard", 3, (0, 1))
        check.post_done(early=True)
        recv = check._done._recvs[0]
        assert not recv.cancelled
        check.abandon()
        assert recv.cancelled
    finally:
        for lk in links:
            lk.close()


@pytest.mark.parametrize("same", [True, False], ids=["same-call", "different-calls"])
def test_over_host_links_the_agreement_is_settled_by_the_thread_landing_its_rows(same):
    """No task waits for the agreement's rows over host links: the thread that lands the
    last one compares them — a mismatch is recorded as the backend's failure (which stops
    the work at once) before anyone awaits the verdict; the verdict then costs no wait."""
    import asyncio

    from overlap.backends.distributed import Agreement
    from overlap.errors import CallMismatch

    dists, links = _linked_pair()
    try:
        mine = Agreement(dists[0], b"a" * 32, "reshard: the plan (call 3)", 3, (0, 1))
        mine.post()
        assert mine.checked_early and dists[0].agreed_at is None
        peer = Agreement(dists[1], (b"a" if same else b"b") * 32, "reshard", 3, (0, 1))
        peer.post()
        for a in (mine, peer):  # (each settled by the link thread as the other's row lands)
            landed = threading.Event()
            a._req.when_landed(landed.set)
            assert landed.wait(10.0)
        failures = dists[0].backend.failures
        assert dists[0].agreed_at is not None
        if same:
            assert failures == []
            asyncio.run(mine.wait())
            return
        assert [type(f) for f in failures] == [CallMismatch]
        assert "ranks [1] made a different call than rank 0" in str(failures[0])
        with pytest.raises(CallMismatch) as got:
            asyncio.run(mine.wait())  # (no wait_round: Distributed has none of its state)
        assert got.value is failures[0]
    finally:
        for lk in links:
            lk.close()


def test_a_verdict_asked_while_another_thread_settles_it_waits_for_that_verdict():
    """The landing thread settles the agreement while the event loop asks for the verdict:
    the loop waits for the comparison under way, it does not take "settled" for "agreed"."""
    import asyncio

    import numpy as np

    from overlap.backends.distributed import Agreement, _LinkRound
    from overlap.errors import CallMismatch

    dists, links = _linked_pair()
    try:
        check = Agreement(dists[0], b"a" * 32, "reshard", 3, (0, 1))
        check._every[1, :32] = np.frombuffer(b"b" * 32, np.uint8)  # (rank 1's row: another call)
        check._req = _LinkRound([], [])  # (its rows are in)
        comparing, go_on = threading.Event(), threading.Event()

        class Members(tuple):
            def __iter__(self):  # (the comparison, held half-way)
                comparing.set()
                go_on.wait(10.0)
                return super().__iter__()

        check.members = Members((0, 1))
        lander = threading.Thread(target=check._settle)
        lander.start()
        assert comparing.wait(10.0)
        verdict: list[BaseException | None] = []

        def ask() -> None:
            try:
                asyncio.run(check.wait())
                verdict.append(None)
            except BaseException as exc:
                verdict.append(exc)

        asker = threading.Thread(target=ask)
        asker.start()
        asker.join(0.2)  # (it must wait for the comparison, not return meanwhile)
        assert verdict == []
        go_on.set()
        asker.join(10.0)
        lander.join(10.0)
        assert len(verdict) == 1 and isinstance(verdict[0], CallMismatch)
    finally:
        for lk in links:
            lk.close()
