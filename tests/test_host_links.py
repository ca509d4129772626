"""Host links (``overlap/backends/job/host_links.py``) in one process: ``HostLinks`` joined by
socket pairs play ranks, each read by a progress engine (``overlap/backends/job/engine.py``).
MPI's point-to-point semantics — matching by channel, source and tag, in order; messages that
come before their receive; counts; cancel — and the completions: a request's callback runs
once when it completes, from the thread that completed it (the engine's, or the posting
thread's when it completes at once). (Across processes: tests/test_mpi.py.)

A test that needs a rank to read nothing for a while holds its engine in a call
(:func:`held`); one that needs what was written so far to have been read lets the engine go
round once (:func:`settled`: a call runs after the descriptors that were ready with it)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from overlap.backends.job.engine import Engine
from overlap.backends.job.host_links import HEADER, HostLinks, LinkRequest
from overlap.errors import CollectiveAborted, OverlapRuntimeError
from overlap.scope import CancelScope

BOUND_S = 10.0  # every wait here is bounded: a hang fails the test


def wait(req: LinkRequest) -> None:
    """Block until ``req`` completes (raises what failed it), woken by its completion."""
    assert req.block(CancelScope("a test"), req.what, BOUND_S), "the request never completed"
    assert req.Test()


@contextlib.contextmanager
def held(engine: Engine) -> Iterator[None]:
    """The engine's thread held in a call: it reads and writes nothing until the end."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(BOUND_S)

    engine.call_soon(hold)
    assert entered.wait(BOUND_S), "the engine never ran the call"
    try:
        yield
    finally:
        release.set()


def settled(engine: Engine) -> None:
    """Return once the engine went round once: what its descriptors held before now is read."""
    ran = threading.Event()
    engine.call_soon(ran.set)
    assert ran.wait(BOUND_S), "the engine never ran the call"


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine("overlap-engine-test")
    yield e
    e.close()


def test_tags_past_32_bits_match_exactly(pair):
    """A resharding's tags grow with the calls made (a counter × its transfers + k): a long
    run passes 2**31 — each tag still meets its own receive, and only it."""
    a, b = pair
    big = (1 << 40) + 5
    first, second = np.zeros(4, np.int64), np.zeros(4, np.int64)
    r1, r2 = b.irecv(1, 0, big, first), b.irecv(1, 0, big + (1 << 32), second)
    wait(a.isend(1, 1, big + (1 << 32), np.full(4, 2, np.int64)))
    wait(a.isend(1, 1, big, np.full(4, 1, np.int64)))
    wait(r1)
    wait(r2)
    assert first.tolist() == [1] * 4 and second.tolist() == [2] * 4


def test_a_message_lands_in_its_posted_receive_and_wakes_its_waiter(pair):
    a, b = pair
    got = np.zeros(1000, np.float32)
    recv = b.irecv(3, 0, 7, got)
    assert not recv.Test()
    woken_on: list[bool] = []
    done = threading.Event()

    def wake() -> None:
        woken_on.append(b.engine.on_thread())
        done.set()

    assert recv.add_callback(wake)  # (posted before its message: it waits)
    sent = np.arange(1000, dtype=np.float32)
    a.isend(3, 1, 7, sent)
    assert done.wait(BOUND_S)
    assert woken_on == [True]  # the receiving rank's engine, once
    assert recv.Test() and recv.count == sent.nbytes
    assert got.tobytes() == sent.tobytes()
    assert (a.frames_sent, b.frames_received) == (1, 1)


def test_receives_match_by_channel_and_tag_whatever_the_order(pair):
    a, b = pair
    sends = {(c, t): np.full(16, 10 * c + t, np.int64) for c in (0, 1) for t in (5, 6)}
    for (c, t), x in sends.items():
        a.isend(c, 1, t, x)
    for (c, t) in [(1, 6), (0, 5), (1, 5), (0, 6)]:  # another order than sent
        buf = np.empty(16, np.int64)
        wait(b.irecv(c, 0, t, buf))
        assert (buf == 10 * c + t).all(), (c, t)


def test_messages_of_one_key_arrive_in_the_order_sent(pair):
    a, b = pair
    for k in range(5):
        a.isend(0, 1, 9, np.full(4, k, np.int32))
    for k in range(5):
        buf = np.empty(4, np.int32)
        wait(b.irecv(0, 0, 9, buf))
        assert (buf == k).all()


def test_a_message_that_comes_before_its_receive_waits_for_it(pair):
    a, b = pair
    sent = np.arange(64, dtype=np.float64)
    wait(a.isend(0, 1, 1, sent))
    # The engine takes it in while no receive is posted; a probe on another tag, sent after
    # it, lands once it did (in order on the socket).
    a.isend(0, 1, 2, np.zeros(1))
    wait(b.irecv(0, 0, 2, np.empty(1)))
    buf = np.empty(64)
    req = b.irecv(0, 0, 1, buf)
    assert req.Test(), "an early message completes its receive when posted"
    assert req.count == sent.nbytes and (buf == sent).all()
    assert not req.add_callback(lambda: pytest.fail("called for a request already complete"))


def test_a_message_larger_than_the_socket_buffers_arrives_whole(pair):
    a, b = pair
    sent = np.random.default_rng(0).integers(0, 255, 48 << 20, dtype=np.uint8)
    got = np.zeros_like(sent)
    recv = b.irecv(0, 0, 3, got)
    send = a.isend(0, 1, 3, sent)  # returns at once: the engine writes what is left
    wait(send)
    wait(recv)
    assert np.array_equal(got, sent)


def test_a_size_mismatch_is_reported_as_the_count(pair):
    a, b = pair
    a.isend(0, 1, 4, np.arange(10, dtype=np.uint8))
    small = np.zeros(4, np.uint8)
    req = b.irecv(0, 0, 4, small)
    wait(req)
    assert req.count == 10 and list(small) == [0, 1, 2, 3]
    # (Posted first, too: the message does not fit in place and is copied, as far as fits.)
    large = np.full(16, 99, np.uint8)
    req = b.irecv(0, 0, 5, large)
    a.isend(0, 1, 5, np.arange(3, dtype=np.uint8))
    wait(req)
    assert req.count == 3 and list(large[:4]) == [0, 1, 2, 99]


def test_empty_messages(pair):
    a, b = pair
    wait(a.isend(0, 1, 0, np.empty(0)))
    req = b.irecv(0, 0, 0, np.empty(0))
    wait(req)
    assert req.count == 0
    posted = b.irecv(0, 0, 1, np.empty(0))  # (posted first: no byte of payload to read)
    a.isend(0, 1, 1, np.empty(0))
    wait(posted)
    assert posted.count == 0


def test_a_cancelled_receive_gets_nothing_and_its_message_waits_for_the_next(pair):
    a, b = pair
    first = np.zeros(8)
    cancelled = b.irecv(0, 0, 5, first)
    woken = threading.Event()
    assert cancelled.add_callback(woken.set)
    cancelled.Cancel()
    cancelled.Wait()  # (taken back: at once)
    a.isend(0, 1, 5, np.ones(8))
    buf = np.zeros(8)
    wait(b.irecv(0, 0, 5, buf))
    assert (buf == 1).all() and (first == 0).all()
    assert not cancelled.Test() and not woken.is_set()


def test_a_callback_added_after_completion_is_refused_so_the_caller_looks_again(pair):
    a, _ = pair
    req = a.isend(0, 1, 0, np.zeros(4))  # (the socket takes it: done on this thread)
    assert req.Test()
    assert not req.add_callback(lambda: pytest.fail("called for a request already complete"))


def test_a_cancel_that_comes_while_the_message_lands_completes_the_receive(engine):
    """As MPI's cancel may fail: the receive whose message is landing gets it whole (and
    ``Wait`` returns once it has), the next receive gets the next message."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    links = HostLinks(0, {1: ours}, engine)
    try:
        payload = bytes(range(256)) * 4096  # 1 MiB
        half = len(payload) // 2
        got = bytearray(len(payload))
        req = links.irecv(4, 1, 9, got)
        theirs.sendall(HEADER.pack(4, 9, len(payload)) + payload[:half])
        settled(engine)  # (its header and first half are in: it is landing)
        assert req.matched and not req.done
        req.Cancel()
        theirs.sendall(payload[half:])
        req.Wait(timeout=BOUND_S)
        assert req.Test() and bytes(got) == payload
        nxt = np.zeros(4, np.uint8)
        later = links.irecv(4, 1, 9, nxt)
        theirs.sendall(HEADER.pack(4, 9, 4) + bytes([2] * 4))
        wait(later)
        assert nxt.tolist() == [2] * 4
    finally:
        links.close()
        theirs.close()


def test_what_a_peer_sent_before_closing_still_arrives_and_sends_to_it_then_fail(pair):
    a, b = pair
    a.isend(0, 1, 1, np.full(3, 7.0))
    a.close()
    buf = np.zeros(3)
    wait(b.irecv(0, 0, 1, buf))
    assert (buf == 7).all()
    # A receive for more waits on (the runtime's notices and timeouts name the rank); a
    # send fails, naming the peer — its request does (as MPI reports it), not the call.
    pending = b.irecv(0, 0, 2, np.zeros(3))
    assert not pending.Test()
    req = b.isend(0, 0, 1, np.zeros(4))
    assert not req.done
    with pytest.raises(CollectiveAborted, match="link to rank 0 is closed"):
        req.Test()
    assert b.closed_to(0)
    settled(b.engine)
    assert not pending.Test()  # (still waiting)


def test_close_fails_what_still_waits_and_refuses_new_requests(pair):
    a, b = pair
    with held(b.engine):  # (b reads nothing: a's large send stays half written)
        send = a.isend(0, 1, 1, np.ones(64 << 20, np.uint8))
        recv = a.irecv(0, 1, 2, np.empty(4, np.uint8))
        woken = threading.Event()
        assert recv.add_callback(woken.set)
        assert not send.Test()
        a.close()
        assert woken.is_set()
        for req in (send, recv):
            with pytest.raises(CollectiveAborted, match="host links are closed"):
                req.Test()
        with pytest.raises(CollectiveAborted, match="host links are closed"):
            a.irecv(0, 1, 3, np.empty(4, np.uint8))
        with pytest.raises(CollectiveAborted, match="host links are closed"):
            a.isend(0, 1, 3, np.empty(4, np.uint8))
        a.close()  # (twice: nothing)
    assert a.engine.failure is None and b.engine.failure is None


def test_links_closed_on_a_shared_engine_leave_it_serving_the_others(engine):
    """Three ranks' links read by one engine: closing one rank's links makes the engine
    forget its sockets (it never waits on a closed one), and the others go on."""
    ends = _mesh(3)
    links = [HostLinks(r, ends[r], engine) for r in range(3)]
    try:
        for r in range(3):
            assert links[r].peers == tuple(p for p in range(3) if p != r)
            assert links[r].has((r + 1) % 3) and not links[r].has(r)
        links[0].close()
        settled(engine)  # (1 and 2 read their link's end)
        assert links[1].closed_to(0) and links[2].closed_to(0)
        assert not links[1].closed_to(2)
        for src, dst in ((1, 2), (2, 1)):
            got = np.zeros(8, np.int32)
            recv = links[dst].irecv(0, src, 1, got)
            links[src].isend(0, dst, 1, np.full(8, src, np.int32))
            wait(recv)
            assert (got == src).all()
        assert engine.failure is None
    finally:
        for lk in links:
            lk.close()


def test_bad_requests_are_refused_naming_what(pair):
    a, b = pair
    with pytest.raises(OverlapRuntimeError, match=r"no link to rank 5 \(linked: \[1\]\)"):
        a.isend(0, 5, 0, np.zeros(2))
    with pytest.raises(OverlapRuntimeError, match=r"no link to rank 5 \(linked: \[1\]\)"):
        a.irecv(0, 5, 0, np.zeros(2))
    with pytest.raises(OverlapRuntimeError, match="contiguous"):
        a.isend(0, 1, 0, np.zeros((4, 4))[:, 1])
    with pytest.raises(OverlapRuntimeError, match="read-only"):
        b.irecv(0, 0, 1, np.frombuffer(b"abcd", np.uint8))


def test_many_threads_sending_at_once_keep_frames_whole(pair):
    a, b = pair
    n, size = 8, 1 << 18

    def sender(k: int) -> None:
        for j in range(4):
            a.isend(k, 1, j, np.full(size, k * 4 + j, np.int32))

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    for k in range(n):
        for j in range(4):
            buf = np.empty(size, np.int32)
            wait(b.irecv(k, 0, j, buf))
            assert (buf == k * 4 + j).all()


def test_threads_sending_small_frames_and_ones_that_do_not_fit_lose_nothing(pair):
    """Threads send small frames and ones larger than the socket takes at once (the engine
    finishes those, the frames after them queue behind): every message arrives whole and in
    order within its key."""
    a, b = pair
    n, senders = 12, 3  # (every third frame 6 MiB: more than a socket takes at once)
    msgs = {(t, k): np.full((1_500_000 if k % 3 == 2 else 2 + k,), t * 1000 + k, np.int32)
            for t in range(senders) for k in range(n)}
    got = {key: np.zeros_like(m) for key, m in msgs.items()}
    recvs = [b.irecv(7, 0, t, got[t, k]) for t in range(senders) for k in range(n)]
    sends: list[LinkRequest] = []

    def send(t: int) -> None:
        for k in range(n):
            sends.append(a.isend(7, 1, t, msgs[t, k]))

    threads = [threading.Thread(target=send, args=(t,)) for t in range(senders)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(BOUND_S)
    assert len(sends) == n * senders
    for req in (*sends, *recvs):
        wait(req)
    assert all(got[key].tobytes() == m.tobytes() for key, m in msgs.items())


def test_a_send_that_does_not_fit_is_finished_by_the_engine(pair):
    """A send larger than the socket takes at once returns to its thread with the rest
    left to the sending rank's engine, which writes it as the socket takes it."""
    a, b = pair
    big = np.arange(4 << 20, dtype=np.uint32)  # 16 MiB: more than the socket takes
    got = np.zeros_like(big)
    recv = b.irecv(2, 0, 5, got)
    finished_on: list[bool] = []
    with held(b.engine):  # (b reads nothing: the send stays half written)
        send = a.isend(2, 1, 5, big)
        assert not send.Test()
        assert send.add_callback(lambda: finished_on.append(a.engine.on_thread()))
    wait(send)
    wait(recv)
    assert finished_on == [True]
    assert got.tobytes() == big.tobytes()


def test_a_callback_that_raises_does_not_stop_the_links(pair, caplog):
    a, b = pair
    req = b.irecv(0, 0, 1, np.empty(1))
    others = threading.Event()

    def bad() -> None:
        raise RuntimeError("a waiter's bug")

    assert req.add_callback(bad)
    assert req.add_callback(others.set)
    with caplog.at_level(logging.ERROR, logger="overlap"):
        a.isend(0, 1, 1, np.ones(1))
        buf = np.zeros(1)
        a.isend(0, 1, 2, np.ones(1))
        wait(b.irecv(0, 0, 2, buf))  # (the engine reads on)
    assert req.Test() and buf[0] == 1
    assert others.is_set()  # (the callbacks after it ran)
    assert any("a waiter's bug" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    assert b.engine.failure is None


def test_a_frame_that_cannot_be_taken_in_fails_its_link_only(engine, caplog):
    """A frame whose landing raises (here: a header asking for more memory than there is)
    fails what waits on that link, naming it; the engine and the other links go on."""
    bad_end, bad_peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    good = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    links = HostLinks(1, {0: bad_end, 2: good[0]}, engine)
    other = HostLinks(2, {1: good[1]}, engine)
    try:
        waiting = links.irecv(0, 0, 9, np.empty(4, np.uint8))
        with caplog.at_level(logging.ERROR, logger="overlap"):
            bad_peer.sendall(HEADER.pack(1, 1, 1 << 62))
            with pytest.raises(CollectiveAborted, match="link to rank 0 failed: MemoryError"):
                wait(waiting)
        assert links.closed_to(0) and not links.closed_to(2)
        with pytest.raises(CollectiveAborted, match="link to rank 0 failed: MemoryError"):
            links.isend(0, 0, 1, np.zeros(1)).Test()
        got = np.zeros(4, np.uint8)
        recv = links.irecv(0, 2, 1, got)
        other.isend(0, 1, 1, np.full(4, 5, np.uint8))
        wait(recv)
        assert got.tolist() == [5] * 4
        assert engine.failure is None
    finally:
        links.close()
        other.close()
        bad_peer.close()


class ShortReads(socket.socket):
    """A socket whose reads return at most 10 bytes (as the kernel's do while the writer is
    still writing), so a frame takes many reads."""

    def recv_into(self, buf, nbytes=0, flags=0):
        return super().recv_into(buf, min(nbytes or len(buf), 10), flags)


@pytest.mark.parametrize("size", [590, 600, 610])
def test_an_empty_message_after_many_reads_lands(size, engine):
    """An empty frame whose header is the last read the engine allows itself per event
    has no byte left to wake it again: it lands at once."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = HostLinks(0, {1: a}, engine)
    receiver = HostLinks(1, {0: ShortReads(fileno=b.detach())}, engine)
    try:
        big = receiver.irecv(0, 0, 1, np.empty(size, np.uint8))
        empty = receiver.irecv(0, 0, 2, np.empty(0, np.uint8))
        sender.isend(0, 1, 1, np.arange(size, dtype=np.uint8))
        sender.isend(0, 1, 2, np.empty(0, np.uint8))
        wait(empty)
        wait(big)
        assert big.count == size
    finally:
        sender.close()
        receiver.close()


def test_small_frames_that_came_together_are_taken_in_a_few_reads(monkeypatch, engine):
    """Between frames a link reads a stage of bytes at once: small frames waiting together
    (a round's messages, small boundaries) cost a system call or two, not two or three
    each; they still land in order, each in its own receive."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    frames = 50
    for k in range(frames):  # (as a peer writes them: header, payload)
        a.sendall(HEADER.pack(5, 1, 8) + np.full(1, k, np.int64).tobytes())
    reads = []
    real = socket.socket.recv_into

    def counted(sock, *args, **kwargs):
        reads.append(1)
        return real(sock, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "recv_into", counted)
    links = HostLinks(1, {0: b}, engine)
    try:
        for k in range(frames):
            got = np.empty(1, np.int64)
            wait(links.irecv(5, 0, 1, got))
            assert got[0] == k
        assert len(reads) <= 3, len(reads)
    finally:
        links.close()
        a.close()


@pytest.mark.parametrize("payload", [1076, 1000, 24, 40000])
def test_frames_across_read_boundaries_arrive_whole_and_in_order(payload, engine):
    """Frames that straddle what one read takes (a header split between two reads — 15
    frames of 1076 bytes end 4 bytes short of a 16 KiB read —, a payload begun in one read
    and finished in place, payloads larger than a read) arrive whole, in order."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    frames = 40
    sent = [np.random.default_rng(k).integers(0, 255, payload, np.uint8) for k in range(frames)]
    writer = threading.Thread(  # (larger than the socket's buffer: written meanwhile)
        target=lambda: [a.sendall(HEADER.pack(2, 3, payload) + x.tobytes()) for x in sent])
    writer.start()
    links = HostLinks(1, {0: b}, engine)
    try:
        for k in range(frames):
            got = np.empty(payload, np.uint8)
            wait(links.irecv(2, 0, 3, got))
            assert got.tobytes() == sent[k].tobytes(), k
    finally:
        writer.join(BOUND_S)
        links.close()
        a.close()


def _mesh(n: int) -> list[dict[int, socket.socket]]:
    """Sockets joining every pair of ``n`` ranks: ``ends[r][p]`` is rank r's end to p."""
    ends: list[dict[int, socket.socket]] = [{} for _ in range(n)]
    for r in range(n):
        for p in range(r + 1, n):
            ends[r][p], ends[p][r] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return ends


def test_a_listened_channel_hands_every_frame_to_its_handler_in_order(pair):
    """Control messages of a job without MPI: a channel whose frames (any tag, any size)
    go to a handler on the engine's thread, in order; other channels still match receives,
    and a handler that raises loses its message only."""
    a, b = pair
    got: list[tuple[int, int, bytes, bool]] = []
    done = threading.Event()

    def handler(peer: int, tag: int, data: bytes) -> None:
        got.append((peer, tag, data, b.engine.on_thread()))
        if data == b"boom":
            raise ValueError("the handler's own failure")
        if len(got) == 4:
            done.set()

    b.listen(7, handler)
    plain = np.zeros(4, np.uint8)
    recv = b.irecv(0, 0, 3, plain)
    for tag, data in ((1, b"x" * 3), (2, b"boom"), (9, b""), (1, b"y" * 70000)):
        wait(a.isend(7, 1, tag, np.frombuffer(data, np.uint8) if data else np.zeros(0, np.uint8)))
    wait(a.isend(0, 1, 3, np.arange(4, dtype=np.uint8)))
    wait(recv)
    assert done.wait(BOUND_S)
    assert [(p, t, d) for p, t, d, _ in got] == [(0, 1, b"xxx"), (0, 2, b"boom"), (0, 9, b""),
                                                 (0, 1, b"y" * 70000)]
    assert all(on_engine for *_, on_engine in got)
    assert list(plain) == [0, 1, 2, 3]
    assert b.engine.failure is None and not b.closed_to(0)


def test_a_unix_link_peer_of_another_user_is_refused(monkeypatch):
    from overlap.backends.job import host_links

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    host_links.check_same_user(a)  # the same user: fine
    uid = host_links.os.getuid()
    monkeypatch.setattr(host_links.os, "getuid", lambda: uid + 1)
    with pytest.raises(OSError, match=r"a link peer runs as uid \d+, this rank as \d+"):
        host_links.check_same_user(b)
    a.close()


def test_setup_values_travel_as_json_never_pickled():
    from overlap.bootstrap import MAX_VALUE_BYTES, decode_values, encode_value

    row = encode_value(["vm", [1, 2]])
    rows = np.zeros((2, row.size), np.uint8)
    rows[0] = rows[1] = row
    assert decode_values(rows, np.array([row.size, row.size])) == [["vm", [1, 2]]] * 2
    with pytest.raises(ValueError, match=r"rank 1 sent a setup value of -1 bytes"):
        decode_values(rows, np.array([row.size, -1]))
    with pytest.raises(ValueError, match=r"a setup value of \d+ bytes \(at most"):
        encode_value("x" * (MAX_VALUE_BYTES + 1))
    import pickle

    with pytest.raises(ValueError):  # a pickle is not JSON: refused, never loaded
        decode_values(np.frombuffer(pickle.dumps(("vm",)), np.uint8)[None, :],
                np.array([len(pickle.dumps(("vm",)))]))


# ---- setup: nobody else can join or disturb it --------------------------------------------


class _ThreadBoot:
    """A bootstrap for ranks played by threads of this process (every collective a
    barrier), all on one host."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=BOUND_S)
        self._values: list[object] = [None] * size

    def of(self, rank: int) -> object:
        boot = self

        class Rank:
            def __init__(self) -> None:
                self.rank, self.size = rank, boot.size

            def allgather(self, value: object) -> list[object]:
                boot._values[rank] = value
                boot._barrier.wait()
                out = list(boot._values)
                boot._barrier.wait()
                return out

            def bcast(self, value: object, root: int = 0) -> object:
                return self.allgather(value)[root]

            def all_true(self, ok: bool) -> bool:
                return all(self.allgather(ok))

            def host(self) -> str:
                return "this-host"
        return Rank()


def _link_ranks(size: int, engine: Engine, during=None, **kwargs) -> list[object]:
    """``HostLinks.connect`` on ``size`` threads; ``during(rank)`` runs in each before."""
    boot = _ThreadBoot(size)
    out: list[object] = [None] * size
    failures: list[list[str]] = [[] for _ in range(size)]

    def run(r: int) -> None:
        out[r] = HostLinks.connect(boot.of(r), engine, failures=failures[r], **kwargs)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join(BOUND_S)
    return [out, failures]


def test_a_connection_without_the_jobs_secret_is_refused_and_setup_goes_on(engine, caplog,
                                                                          monkeypatch):
    from overlap.backends.job import host_links

    # An intruder of this very user connects to rank 1's socket just before rank 0 does:
    # refused, logged; rank 0 still links.
    real_dial = host_links.dial
    intruders: list[threading.Thread] = []

    def dial(address, timeout):
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bad.settimeout(BOUND_S)
        bad.connect(address)

        def answer() -> None:
            with contextlib.suppress(OSError):  # "rank 0", a nonce, a wrong proof
                bad.sendall(b"\0\0\0\0" + b"n" * 32 + b"x" * 32)
                bad.recv(1)  # (until refused)
            bad.close()

        intruders.append(threading.Thread(target=answer))
        intruders[-1].start()
        return real_dial(address, timeout)

    monkeypatch.setattr(host_links, "dial", dial)
    with caplog.at_level(logging.WARNING, logger="overlap"):
        (links, failures) = _link_ranks(2, engine)
    assert all(isinstance(x, HostLinks) for x in links), failures
    assert links[0].peers == (1,) and links[1].peers == (0,)
    assert "refused a link connection during setup: it does not hold this job's secret" \
        in caplog.text
    for t in intruders:
        t.join(BOUND_S)
    for x in links:
        x.close()


def test_the_setup_sockets_are_out_of_other_users_reach(engine, monkeypatch, tmp_path):
    # Each rank listens in a directory only its user may enter (not the abstract namespace,
    # which every user can list and connect to).
    import os
    import stat
    import tempfile

    from overlap.backends.job import host_links

    made: list[str] = []
    real = tempfile.mkdtemp

    def spy(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(host_links.tempfile, "mkdtemp", spy)
    seen: list[int] = []
    real_accept = host_links.accept_peers

    def look(listener, *a):
        path = listener.getsockname()
        assert isinstance(path, str) and not path.startswith("\0"), path
        seen.append(stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode))
        if os.geteuid() == 0:  # another user (nobody) tries to connect: the kernel refuses
            pid = os.fork()
            if pid == 0:  # (the child: only a setuid and a connect, then out)
                code = 0
                try:
                    os.setuid(65534)
                    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(path)
                except PermissionError:
                    code = 3
                except BaseException:
                    code = 4
                os._exit(code)
            seen.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        return real_accept(listener, *a)

    monkeypatch.setattr(host_links, "accept_peers", look)
    (links, failures) = _link_ranks(2, engine)
    assert all(isinstance(x, HostLinks) for x in links), failures
    assert seen[0] == 0o700
    if os.geteuid() == 0:
        assert seen[1] == 3, "another user reached the socket"
    assert not any(os.path.exists(d) for d in made)  # cleaned up
    for x in links:
        x.close()


def test_a_failed_setup_says_the_socket_error(engine, monkeypatch):
    from overlap.backends.job import host_links

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied", "/tmp")

    monkeypatch.setattr(host_links.tempfile, "mkdtemp", refuse)
    (links, failures) = _link_ranks(2, engine)
    assert links == [None, None]
    assert failures[0] == failures[1]
    assert "rank 0: listening: PermissionError: [Errno 13] Permission denied: '/tmp'" \
        in failures[0]
    assert not any("firewall" in f for f in failures[0])  # (one host)


def test_a_connection_that_never_answers_is_dropped_and_setup_goes_on(engine, caplog,
                                                                      monkeypatch):
    from overlap.backends.job import host_links

    monkeypatch.setattr(host_links, "HANDSHAKE_S", 0.3)
    real_dial = host_links.dial
    silent: list[socket.socket] = []

    def dial(address, timeout):
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bad.connect(address)  # connects first, then says nothing
        silent.append(bad)
        return real_dial(address, timeout)

    monkeypatch.setattr(host_links, "dial", dial)
    with caplog.at_level(logging.WARNING, logger="overlap"):
        (links, failures) = _link_ranks(2, engine)
    assert all(isinstance(x, HostLinks) for x in links), failures
    assert "refused a link connection during setup: timed out" in caplog.text
    for s in silent:
        s.close()
    for x in links:
        x.close()


def test_a_peer_that_drips_its_hello_is_dropped_within_the_handshake_bound(engine, caplog,
                                                                          monkeypatch):
    import time

    from overlap.backends.job import host_links

    monkeypatch.setattr(host_links, "HANDSHAKE_S", 0.4)
    real_dial = host_links.dial
    drips: list[threading.Thread] = []

    def dial(address, timeout):
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bad.connect(address)

        def drip() -> None:  # one byte every 0.1 s: the whole hello would take 6.8 s
            with contextlib.suppress(OSError):
                for _ in range(68):
                    bad.send(b"\0")
                    time.sleep(0.1)
            bad.close()
        drips.append(threading.Thread(target=drip))
        drips[-1].start()
        return real_dial(address, timeout)

    monkeypatch.setattr(host_links, "dial", dial)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="overlap"):
        (links, failures) = _link_ranks(2, engine)
    took = time.monotonic() - start
    assert all(isinstance(x, HostLinks) for x in links), failures
    assert took < 3.0, took  # (not the 6.8 s the drip would take)
    assert "refused a link connection during setup: timed out" in caplog.text
    for t in drips:
        t.join(BOUND_S)
    for x in links:
        x.close()


def test_a_long_temporary_directory_still_links(engine, monkeypatch, tmp_path):
    from overlap.backends.job import host_links

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(host_links.tempfile, "gettempdir", lambda: str(deep))
    (links, failures) = _link_ranks(2, engine)
    assert all(isinstance(x, HostLinks) for x in links), failures
    for x in links:
        x.close()


# ---- a secret that never travels: OVERLAP_LINK_SECRET_FILE ---------------------------------


def _connect_each(size: int, engine: Engine, boot: _ThreadBoot) -> list[object]:
    """``HostLinks.connect`` on ``size`` threads: each rank's links, or the error it raised."""
    out: list[object] = [None] * size

    def run(r: int) -> None:
        try:
            out[r] = HostLinks.connect(boot.of(r), engine)
        except ValueError as exc:
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    return out


class _NoSecretBoot(_ThreadBoot):
    """Ranks whose bootstrap refuses to carry anything by ``bcast`` (the only way a secret
    could travel)."""

    def of(self, rank: int) -> object:
        rank_boot = super().of(rank)

        def bcast(value: object, root: int = 0) -> object:
            raise AssertionError("the secret travelled through the bootstrap")
        rank_boot.bcast = bcast
        return rank_boot


def test_a_secret_file_links_every_rank_without_sending_the_secret(engine, monkeypatch,
                                                                   tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("c2" * 32)
    secret.chmod(0o600)
    monkeypatch.setenv("OVERLAP_LINK_SECRET_FILE", str(secret))
    links = _connect_each(3, engine, _NoSecretBoot(3))
    assert all(isinstance(x, HostLinks) for x in links), links
    assert [x.peers for x in links] == [(1, 2), (0, 2), (0, 1)]
    for x in links:
        x.close()


@pytest.mark.parametrize("mode, text, why", [
    (0o644, "c2" * 32, "readable by no one else (chmod 600; it is -rw-r--r--"),
    (0o600, "short", "5 bytes; a secret is at least 16"),
    (None, "", "cannot open it"),
])
def test_a_bad_secret_file_is_refused_on_every_rank_naming_it(engine, monkeypatch, tmp_path,
                                                              mode, text, why):
    secret = tmp_path / "secret"
    if mode is not None:
        secret.write_text(text)
        secret.chmod(mode)
    monkeypatch.setenv("OVERLAP_LINK_SECRET_FILE", str(secret))
    out = _connect_each(2, engine, _ThreadBoot(2))
    for error in out:
        assert isinstance(error, ValueError), out
        assert f"rank 0: OVERLAP_LINK_SECRET_FILE={secret}: " in str(error)
        assert why in str(error)
