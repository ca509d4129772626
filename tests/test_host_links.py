"""Host links (``overlap/backends/host_links.py``) in one process: two ``HostLinks`` joined by
a socket pair play two ranks. MPI's point-to-point semantics — matching by channel, source and
tag, in order; messages that come before their receive; counts; cancel — and the waits:
a request's ``wake`` runs when it completes, from the thread that completed it.
(Across processes: tests/test_mpi.py.)"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from overlap.backends.host_links import HostLinks, LinkRequest
from overlap.errors import CollectiveAborted, OverlapRuntimeError

BOUND_S = 10.0  # every wait here is bounded: a hang fails the test


def wait(req: LinkRequest) -> None:
    """Block until ``req`` completes, woken by its ``wake`` (no polling)."""
    done = threading.Event()
    if req.notify(done.set):
        assert done.wait(BOUND_S), "the request never completed"
    assert req.Test()


def test_a_message_lands_in_its_posted_receive_and_wakes_its_waiter(pair):
    a, b = pair
    got = np.zeros(1000, np.float32)
    recv = b.irecv(3, 0, 7, got)
    assert not recv.Test()
    sent = np.arange(1000, dtype=np.float32)
    a.isend(3, 1, 7, sent)
    woken_on: list[str] = []
    done = threading.Event()

    def wake() -> None:
        woken_on.append(threading.current_thread().name)
        done.set()

    if recv.notify(wake):
        assert done.wait(BOUND_S)
        assert woken_on == ["overlap-links-r1"]  # the link thread, once
    assert recv.Test() and recv.count == sent.nbytes
    assert got.tobytes() == sent.tobytes()


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
    # The link thread takes it in while no receive is posted; a probe on another tag, sent
    # after it, lands once it did (in order on the socket).
    a.isend(0, 1, 2, np.zeros(1))
    wait(b.irecv(0, 0, 2, np.empty(1)))
    buf = np.empty(64)
    req = b.irecv(0, 0, 1, buf)
    assert req.Test(), "an early message completes its receive when posted"
    assert req.count == sent.nbytes and (buf == sent).all()


def test_a_message_larger_than_the_socket_buffers_arrives_whole(pair):
    a, b = pair
    sent = np.random.default_rng(0).integers(0, 255, 48 << 20, dtype=np.uint8)
    got = np.zeros_like(sent)
    recv = b.irecv(0, 0, 3, got)
    send = a.isend(0, 1, 3, sent)  # returns at once: the link thread writes what is left
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


def test_empty_messages(pair):
    a, b = pair
    wait(a.isend(0, 1, 0, np.empty(0)))
    req = b.irecv(0, 0, 0, np.empty(0))
    wait(req)
    assert req.count == 0


def test_a_cancelled_receive_gets_nothing_and_its_message_waits_for_the_next(pair):
    a, b = pair
    first = np.zeros(8)
    cancelled = b.irecv(0, 0, 5, first)
    woken = threading.Event()
    assert cancelled.notify(woken.set)
    cancelled.Cancel()
    cancelled.Wait()
    a.isend(0, 1, 5, np.ones(8))
    buf = np.zeros(8)
    wait(b.irecv(0, 0, 5, buf))
    assert (buf == 1).all() and (first == 0).all()
    assert not cancelled.Test() and not woken.is_set()


def test_a_wake_set_after_completion_is_refused_so_the_caller_looks_again(pair):
    a, _ = pair
    req = a.isend(0, 1, 0, np.zeros(4))
    assert req.Test()
    assert not req.notify(lambda: pytest.fail("called for a request already complete"))


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


def test_close_ends_the_link_thread(pair):
    a, b = pair
    b.irecv(0, 0, 1, np.zeros(4))  # pending: close does not wait for it
    a.close()
    b.close()
    for lk in (a, b):
        assert not lk._thread.is_alive()
    a.close()  # twice: nothing


def test_bad_requests_are_refused_naming_what(pair):
    a, _ = pair
    with pytest.raises(OverlapRuntimeError, match=r"no link to rank 5 \(linked: \[1\]\)"):
        a.isend(0, 5, 0, np.zeros(2))
    with pytest.raises(OverlapRuntimeError, match="contiguous"):
        a.isend(0, 1, 0, np.zeros((4, 4))[:, 1])


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


# ---- review fixes: each test failed before its fix -----------------------------------------


class ShortReads(socket.socket):
    """A socket whose reads return at most 10 bytes (as the kernel's do while the writer is
    still writing), so a frame takes many reads."""

    def recv_into(self, buf, nbytes=0, flags=0):
        return super().recv_into(buf, min(nbytes or len(buf), 10), flags)


@pytest.mark.parametrize("size", [590, 600, 610])
def test_an_empty_message_after_many_reads_lands(size):
    """An empty frame whose header is the last read the link thread allows itself per event
    has no byte left to wake it again: it lands at once."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, receiver = HostLinks(0, {1: a}), HostLinks(1, {0: ShortReads(fileno=b.detach())})
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


def test_a_cancel_that_comes_while_the_message_lands_completes_the_receive(pair):
    """As MPI's cancel may fail: the receive whose message is landing gets it whole (and
    Wait returns once it has), the next receive gets the next message."""
    a, b = pair
    n = 1 << 22
    first = np.zeros(n, np.uint8)
    r1 = b.irecv(0, 0, 5, first)
    a.isend(0, 1, 5, np.full(n, 1, np.uint8))
    deadline = time.monotonic() + BOUND_S
    while not r1.matched and not r1.done:  # (it begins landing)
        assert time.monotonic() < deadline
        time.sleep(1e-4)
    r1.Cancel()
    r1.Wait()
    assert r1.Test() and (first == 1).all()
    second = np.zeros(4, np.uint8)
    a.isend(0, 1, 5, np.full(4, 2, np.uint8))
    wait(b.irecv(0, 0, 5, second))
    assert (second == 2).all()


def test_close_fails_what_still_waits_and_refuses_new_requests(pair):
    a, b = pair
    b._sel.unregister(b._conns[0].sock)  # (b stops reading: a's large send stays queued)
    send = a.isend(0, 1, 1, np.ones(64 << 20, np.uint8))
    recv = a.irecv(0, 1, 2, np.empty(4, np.uint8))
    woken = threading.Event()
    assert recv.notify(woken.set)
    a.close()
    assert woken.is_set()
    for req in (send, recv):
        with pytest.raises(CollectiveAborted, match="host links are closed"):
            req.Test()
    with pytest.raises(CollectiveAborted, match="host links are closed"):
        a.irecv(0, 1, 3, np.empty(4, np.uint8))
    with pytest.raises(CollectiveAborted, match="host links are closed"):
        a.isend(0, 1, 3, np.empty(4, np.uint8))


def test_a_waker_that_raises_does_not_stop_the_links(pair):
    a, b = pair
    req = b.irecv(0, 0, 1, np.empty(1))

    def bad() -> None:
        raise RuntimeError("a waiter's bug")

    assert req.notify(bad)
    a.isend(0, 1, 1, np.ones(1))
    buf = np.zeros(1)
    a.isend(0, 1, 2, np.ones(1))
    wait(b.irecv(0, 0, 2, buf))  # (the link thread lives on)
    assert req.Test() and buf[0] == 1


def test_a_frame_that_cannot_be_taken_in_fails_its_link_only(pair, monkeypatch):
    """A receive into a read-only buffer is refused when posted; a frame whose landing
    raises (here: memory) fails what waits on that link, naming it — the thread lives."""
    a, b = pair
    with pytest.raises(OverlapRuntimeError, match="read-only"):
        b.irecv(0, 0, 1, np.frombuffer(b"abcd", np.uint8))
    waiting = b.irecv(0, 0, 9, np.empty(4, np.uint8))

    def no_memory(self, conn):
        raise MemoryError("no room for the frame")

    monkeypatch.setattr(HostLinks, "_begin", no_memory)
    a.isend(0, 1, 1, np.ones(4))
    done = threading.Event()
    if waiting.notify(done.set):
        assert done.wait(BOUND_S)
    with pytest.raises(CollectiveAborted, match="link to rank 0 failed: MemoryError"):
        waiting.Test()
    assert b._thread.is_alive() and b.failure is None


def test_small_frames_that_came_together_are_taken_in_a_few_reads(monkeypatch):
    """Between frames a link reads a stage of bytes at once: small frames waiting together
    (a round's messages, small boundaries) cost a system call or two, not two or three
    each; they still land in order, each in its own receive."""
    from overlap.backends.host_links import HEADER

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
    links = HostLinks(1, {0: b})
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
def test_frames_across_read_boundaries_arrive_whole_and_in_order(payload):
    """Frames that straddle what one read takes (a header split between two reads — 15
    frames of 1076 bytes end 4 bytes short of a 16 KiB read —, a payload begun in one read
    and finished in place, payloads larger than a read) arrive whole, in order."""
    from overlap.backends.host_links import HEADER

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    frames = 40
    sent = [np.random.default_rng(k).integers(0, 255, payload, np.uint8) for k in range(frames)]
    writer = threading.Thread(  # (larger than the socket's buffer: written meanwhile)
        target=lambda: [a.sendall(HEADER.pack(2, 3, payload) + x.tobytes()) for x in sent])
    writer.start()
    links = HostLinks(1, {0: b})
    try:
        for k in range(frames):
            got = np.empty(payload, np.uint8)
            wait(links.irecv(2, 0, 3, got))
            assert got.tobytes() == sent[k].tobytes(), k
    finally:
        writer.join(BOUND_S)
        links.close()
        a.close()


# ---- an event loop as the links' reader (the runtime's *_sync calls) ----------------------


def test_a_loop_that_serves_the_links_completes_receives_on_its_own_thread(pair):
    """While a loop serves them, a message wakes its waiter on the loop's thread (one thread
    woken, not the link thread and then the loop); given back, the link thread does again."""
    import asyncio

    a, b = pair

    async def receive(n: int) -> str:
        got = np.zeros(64, np.uint8)
        req = b.irecv(1, 0, n, got)
        loop, ready = asyncio.get_running_loop(), asyncio.Event()
        woken_on: list[str] = []

        def wake() -> None:
            woken_on.append(threading.current_thread().name)
            loop.call_soon_threadsafe(ready.set)

        assert req.notify(wake)
        a.isend(1, 1, n, np.full(64, n, np.uint8))
        await asyncio.wait_for(ready.wait(), BOUND_S)
        assert got.tolist() == [n] * 64
        return woken_on[0]

    async def main() -> None:
        b.serve(asyncio.get_running_loop())
        assert await receive(1) == threading.current_thread().name
        assert await receive(2) == threading.current_thread().name
        b.serve(None)
        assert await receive(3) == "overlap-links-r1"

    asyncio.run(main())


def _received_on(links: HostLinks, sender: HostLinks, tag: int) -> str:
    """Post a receive on ``links``, send to it from ``sender``: the name of the thread that
    completed it (awaited on the running loop)."""
    import asyncio

    async def go() -> str:
        got = np.zeros(16, np.uint8)
        req = links.irecv(1, sender.rank, tag, got)
        loop, ready = asyncio.get_running_loop(), asyncio.Event()
        woken_on: list[str] = []
        assert req.notify(lambda: (woken_on.append(threading.current_thread().name),
                                   loop.call_soon_threadsafe(ready.set)))
        sender.isend(1, links.rank, tag, np.full(16, tag, np.uint8))
        await asyncio.wait_for(ready.wait(), BOUND_S)
        assert got.tolist() == [tag] * 16
        return woken_on[0]

    return go()


def test_a_loop_that_stopped_leaves_the_links_to_the_next_without_the_link_thread(
        pair, monkeypatch):
    """``asyncio.run`` per call: each call's loop serves the links, and the next one takes
    them from the closed loop directly — the link thread is neither asked to read again
    nor to stop (two thread round trips a call)."""
    import asyncio

    a, b = pair
    handovers: list[bool] = []
    real = b._hand_over
    monkeypatch.setattr(b, "_hand_over", lambda watch: (handovers.append(watch), real(watch)))

    async def call(tag: int) -> str:
        b.serve(asyncio.get_running_loop())
        return await _received_on(b, a, tag)

    me = threading.current_thread().name
    assert [asyncio.run(call(t)) for t in range(4)] == [me] * 4
    assert handovers == [False]  # (once: the first loop takes them from the thread)
    b.serve(None)
    assert handovers == [False, True]
    assert asyncio.run(_received_on(b, a, 9)) == "overlap-links-r1"


def test_a_loop_running_on_another_thread_keeps_the_links(pair):
    """A loop that serves the links while it runs on its own thread is not touched from
    another: a call on this thread's loop leaves the links to it, and its thread completes
    this thread's receives."""
    import asyncio

    a, b = pair
    other = asyncio.new_event_loop()
    runner = threading.Thread(target=other.run_forever, name="other-loop", daemon=True)
    runner.start()
    try:
        taken = asyncio.run_coroutine_threadsafe(_serve_here(b), other)
        taken.result(BOUND_S)

        async def call() -> str:
            b.serve(asyncio.get_running_loop())  # (another thread's loop runs: kept)
            assert b._loop is other
            return await _received_on(b, a, 3)

        assert asyncio.run(call()) == "other-loop"
    finally:
        other.call_soon_threadsafe(other.stop)
        runner.join(BOUND_S)
        b.serve(None)  # (that loop stopped: the link thread again)
        other.close()
    assert asyncio.run(_received_on(b, a, 4)) == "overlap-links-r1"


@pytest.mark.parametrize("held", [False, True], ids=["running", "held-up"])
def test_closing_links_another_threads_loop_serves_lets_that_loop_go_on_its_thread(held):
    """``close()`` from another thread than that of the loop serving the links: the loop
    lets go of them on its own thread (no loop is touched from a thread not its own). A
    loop held up by its own code makes ``close()`` wait a bounded time, not for the loop;
    it lets go once it runs again."""
    import asyncio

    from overlap.backends import host_links

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    links = HostLinks(0, {1: ours})
    fd = ours.fileno()
    other = asyncio.new_event_loop()
    touched: list[str] = []
    real_off = host_links._off_loop

    def off(loop, conn) -> None:  # (records the thread that takes each link off a loop)
        touched.append(threading.current_thread().name)
        real_off(loop, conn)

    runner = threading.Thread(target=other.run_forever, name="other-loop", daemon=True)
    runner.start()
    release = threading.Event()
    try:
        asyncio.run_coroutine_threadsafe(_serve_here(links), other).result(BOUND_S)
        host_links._off_loop = off
        if held:
            other.call_soon_threadsafe(release.wait, BOUND_S)  # (its own code holds it)
        started = time.monotonic()
        links.close()
        took = time.monotonic() - started
        assert touched == ([] if held else ["other-loop"])
        assert took < host_links.LEAVE_WAIT_S + 2.0
        release.set()
        watched = asyncio.run_coroutine_threadsafe(_still_watched(fd), other).result(BOUND_S)
        assert touched == ["other-loop"] and not watched, (touched, watched)
    finally:
        host_links._off_loop = real_off
        release.set()
        other.call_soon_threadsafe(other.stop)
        runner.join(BOUND_S)
        other.close()
        theirs.close()


async def _still_watched(fd: int) -> bool:
    import asyncio

    return asyncio.get_running_loop().remove_reader(fd)


async def _serve_here(links: HostLinks) -> None:
    import asyncio

    links.serve(asyncio.get_running_loop())


def test_waiting_out_a_cancelled_landing_on_the_serving_loop_reads_the_rest_itself():
    """A receive cancelled while its message lands waits for its bytes (``Wait``). On the
    thread of the loop that serves the links nothing else would read them: the wait reads
    the rest itself instead of waiting out its timeout."""
    import asyncio

    from overlap.backends.host_links import HEADER

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    links = HostLinks(0, {1: ours})
    payload = bytes(range(256)) * 4096  # 1 MiB
    half = len(payload) // 2

    def peer() -> None:  # the frame's first half, then (a while later) the rest
        theirs.sendall(HEADER.pack(4, 9, len(payload)) + payload[:half])
        time.sleep(0.5)
        theirs.sendall(payload[half:])

    async def main() -> float:
        links.serve(asyncio.get_running_loop())
        got = bytearray(len(payload))
        req = links.irecv(4, 1, 9, got)
        writer = threading.Thread(target=peer)
        writer.start()
        deadline = time.monotonic() + BOUND_S
        while not req.matched and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        assert req.matched and not req.done
        started = time.monotonic()
        req.Cancel()
        req.Wait(timeout=5.0)  # (on the loop's thread: nothing else reads meanwhile)
        took = time.monotonic() - started
        writer.join(BOUND_S)
        assert req.done and bytes(got) == payload
        return took

    try:
        assert asyncio.run(main()) < 3.0  # not its 5 s timeout
    finally:
        links.close()
        theirs.close()


def test_closing_links_a_loop_serves_takes_them_off_the_loop(pair):
    import asyncio

    a, _ = pair

    async def main() -> None:
        loop = asyncio.get_running_loop()
        a.serve(loop)
        fd = a._conns[1].sock.fileno()
        a.close()
        assert not loop.remove_reader(fd)  # (no longer watched)
        a.serve(loop)  # (closed: nobody reads any more, nor starts to)
        assert a._loop is None and not loop.remove_reader(fd)

    asyncio.run(main())


def test_handing_the_links_back_and_forth_while_threads_send_loses_nothing(pair):
    """Threads send (small frames and ones that do not fit at once) while the receiving and
    the sending side's links pass again and again between the link thread and a loop: every
    message arrives whole, in order."""
    import asyncio

    a, b = pair
    n, senders = 12, 3  # (every third frame 6 MiB: more than a socket takes at once)
    msgs = {(t, k): np.full((1_500_000 if k % 3 == 2 else 2 + k,), t * 1000 + k, np.int32)
            for t in range(senders) for k in range(n)}
    got = {key: np.zeros_like(m) for key, m in msgs.items()}
    recvs = [b.irecv(7, 0, t, got[t, k]) for t in range(senders) for k in range(n)]

    def send(t: int) -> None:
        for k in range(n):
            a.isend(7, 1, t, msgs[t, k])
            time.sleep(0.001)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        threads = [threading.Thread(target=send, args=(t,)) for t in range(senders)]
        for th in threads:
            th.start()
        deadline = time.monotonic() + BOUND_S
        flip = 0
        while not all(r.Test() for r in recvs) and time.monotonic() < deadline:
            flip += 1
            a.serve(loop if flip % 2 else None)
            b.serve(None if flip % 3 else loop)
            await asyncio.sleep(0.002)
        for th in threads:
            th.join(BOUND_S)
        a.serve(None)
        b.serve(None)

    asyncio.run(main())
    assert all(r.Test() for r in recvs)
    assert all(got[key].tobytes() == m.tobytes() for key, m in msgs.items())


@pytest.mark.parametrize("before, after", [("loop", "loop"), ("thread", "loop"),
                                           ("loop", "thread")])
def test_a_send_that_does_not_fit_is_finished_by_whoever_reads_the_links(pair, before, after):
    """A send larger than the socket takes at once: the rest is written by the side that
    serves the links — the loop, or the link thread — also when they change hands while it
    is half written."""
    import asyncio

    a, b = pair
    big = np.arange(3 << 20, dtype=np.uint32)  # 12 MiB: more than the socket takes
    got = np.zeros_like(big)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        reader = {"loop": loop, "thread": None}
        idle = asyncio.new_event_loop()  # (b's reader meanwhile: nobody reads)
        b.serve(idle)
        a.serve(reader[before])
        recv = b.irecv(2, 0, 5, got)
        send = a.isend(2, 1, 5, big)
        await asyncio.sleep(0.01)
        assert not send.Test()  # (half written: the peer reads nothing)
        a.serve(reader[after])  # (a hand-over, the rest still to write, or none)
        b.serve(None)  # (b's link thread reads again)
        idle.close()
        deadline = time.monotonic() + BOUND_S
        while not (send.Test() and recv.Test()) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        assert send.Test() and recv.Test()
        a.serve(None)

    asyncio.run(main())
    assert got.tobytes() == big.tobytes()
