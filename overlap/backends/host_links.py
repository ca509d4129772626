"""Byte links between the MPI ranks of one host: a Unix stream socket per pair of ranks, with
MPI's point-to-point semantics (nonblocking send and receive, matched by channel, source and
tag, in order), whose waits block in the kernel.

Why not MPI for these bytes: MPI offers no completion a thread can sleep on. Its requests are
polled, and on a host with fewer cores than ranks every poll is a thread wake-up (25-35 µs of
CPU each on the 2-core machine of docs/benchmarks.md, ~1,100 per training step of 4 ranks);
and MPICH moves messages of 8 KiB and more by rendezvous, which completes only while the
receiving process polls. A socket needs neither: the kernel buffers what was sent (so a send
completes at once, whether or not its receiver looks), and one thread per process sleeps in
``epoll`` until bytes arrive — one wake-up per message, the way gloo's transport waits. Or,
while the runtime's ``*_sync`` calls run, their event loop itself watches the sockets
(``serve``): the message then wakes the thread that waits for it, not the link thread first.

Messages are frames: a header (channel, tag, payload bytes), then the payload. The reader
(the link thread, or the serving loop) reads every socket: a frame whose receive is posted
lands in that receive's buffer directly; one that comes first waits, copied, until its
receive is posted (MPI's unexpected messages). A send writes what the socket takes at once
from the caller's thread and leaves the rest to the reader. A request's ``wake`` (set by
whoever waits for it) is called on completion from the thread that completed it.

Failures: a peer whose socket closed delivers what it sent before; receives still waiting for
it then wait on (as MPI's do: the runtime's failure notices and timeouts name the rank), a
send to it fails at once, naming it. ``close`` ends the thread within a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import select
import selectors
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import CollectiveAborted, OverlapRuntimeError
from ..loop_calls import call_soon_any_thread

log = logging.getLogger("overlap")

HEADER = struct.Struct("<IiQ")  # channel id, tag, payload bytes
SOCKET_BUFFER_BYTES = 4 << 20  # asked of the kernel (it caps it: wmem_max)
CONNECT_TIMEOUT_S = 30.0  # link setup: every rank of the host is inside the same call
LEAVE_WAIT_S = 1.0  # a loop running on another thread letting go of the links (close())
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)  # a closed peer: an error, not SIGPIPE
_READS_PER_EVENT = 64  # reads from one socket before the others get their turn
# Bytes read at once between frames: a small frame (the runtime's rounds, a width-64
# boundary) comes whole in one system call; a larger payload's first part is copied once.
_STAGE_BYTES = 16 << 10

Wake = Callable[[], None]


class LinkRequest:
    """One nonblocking send or receive on a link (the subset of ``mpi4py.MPI.Request`` the
    data plane uses: ``Test``, ``Cancel``, ``Wait`` after a cancel)."""

    __slots__ = ("_links", "cancelled", "count", "done", "error", "key", "matched", "nbytes",
                 "view", "wake")

    def __init__(self, links: HostLinks, key: tuple[int, int, int], view: memoryview) -> None:
        self._links = links
        self.key = key  # (peer, channel, tag)
        self.view = view
        self.nbytes = view.nbytes
        self.done = False
        self.cancelled = False
        self.matched = False  # a receive whose message is landing (a cancel comes too late)
        self.count = -1  # bytes the matching message carried (receives)
        self.error: BaseException | None = None
        self.wake: Wake | None = None

    def Test(self, status: Any = None) -> bool:
        """True once complete; raises what failed it."""
        if self.error is not None:
            raise self.error
        return self.done

    def notify(self, wake: Wake) -> bool:
        """Have ``wake()`` called when this completes; False (and no call) if it already
        did — the caller looks again instead of waiting."""
        with self._links._lock:
            if self.done or self.error is not None:
                return False
            self.wake = wake
            return True

    def Cancel(self) -> None:
        """Take back a receive not matched yet: it never will be, its message goes to the
        next one. One whose message is already landing completes with it (as MPI's cancel
        can fail): ``Wait`` then waits for its bytes."""
        self._links._cancel(self)

    def Wait(self, timeout: float = 1.0) -> None:
        """(After ``Cancel``.) Return once no bytes will land in the buffer any more: at
        once for a receive taken back; else when its message has landed (or its link
        failed), at most ``timeout`` seconds."""
        if not self.matched:
            return
        landed = threading.Event()
        if self.notify(landed.set):
            self._links.wait_landing(landed, timeout)


class _Conn:
    """One peer's socket and its reader's and writer's state."""

    def __init__(self, peer: int, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        # (Kept: a closed socket's fileno() is -1, and a loop that still watches it must be
        # told which descriptor to forget.)
        self.fd = sock.fileno()
        self.header = bytearray(HEADER.size)
        self.stage = bytearray(_STAGE_BYTES)  # what is read between frames (see _read_ahead)
        self.got = 0  # bytes of a header on the stage, then of the payload, read so far
        self.body: memoryview | None = None  # where the payload lands (None: reading a header)
        self.frame: tuple[int, int, int] = (0, 0, 0)  # (channel, tag, bytes) being read
        self.target: LinkRequest | None = None  # the receive it lands in (None: unexpected)
        self.out: deque[tuple[list[memoryview], LinkRequest]] = deque()  # sends in flight
        self.wlock = threading.Lock()  # frames are written whole, in order
        self.writing = False  # its reader watches it for room to write
        self.closed: str | None = None  # why the peer cannot be written to
        self.gone = False  # its reader stopped watching it (the peer closed, or a bad frame)
        self.sent = 0  # messages sent (under wlock)

    def shut(self, why: str) -> list[LinkRequest]:
        """(Under ``wlock``.) Nothing more is written (``why``): the sends in flight, taken
        out for the caller to fail."""
        self.closed = why
        self.writing = False
        taken = [req for _, req in self.out]
        self.out.clear()
        return taken


class HostLinks:
    """Links from this rank to ``peers`` (rank -> connected stream socket) and the thread that
    reads them. Build it for an MPI job with :meth:`connect`."""

    def __init__(self, rank: int, peers: Mapping[int, socket.socket]) -> None:
        self.rank = rank
        self._lock = threading.Lock()  # matching: posted receives, unexpected messages
        # Who reads changes under this (two threads' calls starting at once must not both
        # take the links: two readers of one socket would split its frames).
        self._serve_lock = threading.Lock()
        self._posted: dict[tuple[int, int, int], deque[LinkRequest]] = {}
        self._unexpected: dict[tuple[int, int, int], deque[bytearray]] = {}
        self._conns = {p: _Conn(p, s) for p, s in peers.items()}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        for c in self._conns.values():
            c.sock.setblocking(False)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with contextlib.suppress(OSError):
                    c.sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
            self._sel.register(c.sock, selectors.EVENT_READ, c)
        self._want_write: list[_Conn] = []
        # The event loop that reads and flushes the links instead of the link thread (None:
        # the thread does; see ``serve``), the thread it runs on, and the thread's pending
        # hand-overs: (watch the sockets again?, set once done).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._handovers: list[tuple[bool, threading.Event]] = []
        self._closing = False
        self.failure: BaseException | None = None  # what stopped the link thread, if anything
        self.frames_received = 0  # messages read whole (for tests and benchmarks)
        self._thread = threading.Thread(target=self._run, name=f"overlap-links-r{rank}",
                                        daemon=True)
        self._thread.start()

    # ---- setup ---------------------------------------------------------------------------

    @classmethod
    def connect(cls, comm: Any, *, timeout: float = CONNECT_TIMEOUT_S) -> HostLinks | None:
        """Collective over ``comm`` (every rank, main thread): link this rank to every other
        rank on its host (same ``MPI.Get_processor_name()``). None where links cannot be
        made on every rank that needs them: the data then goes over MPI everywhere."""
        from mpi4py import MPI

        rank, size = comm.Get_rank(), comm.Get_size()
        hosts = comm.allgather(MPI.Get_processor_name())
        token = comm.bcast(secrets.token_hex(8) if rank == 0 else None, root=0)
        mates = [r for r in range(size) if r != rank and hosts[r] == hosts[rank]]
        peers: dict[int, socket.socket] = {}
        ok = True
        listener = None
        try:
            if mates:
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(_address(token, rank))
                listener.listen(len(mates))
        except OSError:
            ok = False
        # Everyone listens before anyone connects; a rank that cannot makes every rank fall
        # back (links are all or nothing: both ends of a pair must agree).
        ok = bool(comm.allreduce(int(ok), op=MPI.MIN))
        try:
            if ok:
                for r in (r for r in mates if r > rank):  # lower ranks connect, higher accept
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    peers[r] = s
                    s.settimeout(timeout)
                    s.connect(_address(token, r))
                    s.sendall(struct.pack("<i", rank))
                assert listener is not None or not mates
                for _ in (r for r in mates if r < rank):
                    assert listener is not None
                    listener.settimeout(timeout)
                    s, _addr = listener.accept()
                    s.settimeout(timeout)
                    who = struct.unpack("<i", _read_exactly(s, 4))[0]
                    if who not in mates or who > rank or who in peers:
                        raise OSError(f"link from unexpected rank {who}")
                    peers[who] = s
        except OSError:
            ok = False
        finally:
            if listener is not None:
                listener.close()
                if not sys.platform.startswith("linux"):
                    with contextlib.suppress(OSError):
                        os.unlink(_address(token, rank))
        ok = bool(comm.allreduce(int(ok), op=MPI.MIN))
        if not ok:
            for s in peers.values():
                s.close()
            return None
        return cls(rank, peers)

    def has(self, peer: int) -> bool:
        return peer in self._conns

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted(self._conns))

    @property
    def frames_sent(self) -> int:
        """Messages sent on every link (for tests and benchmarks)."""
        return sum(c.sent for c in self._conns.values())

    # ---- requests (any thread) -----------------------------------------------------------

    def irecv(self, channel: int, peer: int, tag: int, buf: memoryview) -> LinkRequest:
        """Receive the next message from ``peer`` with this channel and tag into ``buf``."""
        view = _bytes(buf)
        if view.readonly:
            raise OverlapRuntimeError("a link cannot receive into a read-only buffer")
        req = LinkRequest(self, (peer, channel, tag), view)
        self._conn(peer)
        with self._lock:
            if self.failure is not None or self._closing:
                raise self._ended()
            early = self._unexpected.get(req.key)
            if early:
                data = early.popleft()
                if not early:
                    del self._unexpected[req.key]
            else:
                self._posted.setdefault(req.key, deque()).append(req)
                return req
        _deliver(req, memoryview(data))
        req.done = True
        return req

    def isend(self, channel: int, peer: int, tag: int, buf: memoryview) -> LinkRequest:
        """Send ``buf`` (which must stay untouched until the request completes)."""
        view = _bytes(buf)
        req = LinkRequest(self, (peer, channel, tag), view)
        conn = self._conn(peer)
        parts = [memoryview(HEADER.pack(channel, tag, view.nbytes)), view]
        if self.failure is not None or self._closing:
            raise self._ended()
        with conn.wlock:
            # A peer gone fails the request, not the call (as MPI reports it): whoever waits
            # for it learns why from the runtime's notices first.
            if conn.closed is not None:
                req.error = _closed(conn)
                return req
            # (Counted before its bytes go: a peer may see them, and its reader complete,
            # before this thread goes on.)
            conn.sent += 1
            if not conn.out:
                try:
                    parts = _write(conn.sock, parts)
                except OSError as exc:
                    conn.sent -= 1
                    conn.closed = f"{type(exc).__name__}: {exc}"
                    req.error = _closed(conn)
                    return req
            if not parts:
                req.done = True
                return req
            conn.out.append((parts, req))
            start = not conn.writing
            conn.writing = True
        if start:
            self._want_flush(conn)
        return req

    def _want_flush(self, conn: _Conn) -> None:
        """Have ``conn``'s reader write the rest of its sends as the socket takes them."""
        with self._lock:
            loop = self._loop
            if loop is None:
                self._want_write.append(conn)
        if loop is None:
            self._poke_thread()
            return
        with contextlib.suppress(RuntimeError):  # (the loop closed: close() follows)
            call_soon_any_thread(loop, self._loop_watch_write, loop, conn)

    def _ended(self) -> CollectiveAborted:
        why = ("closed" if self.failure is None
               else f"stopped: {type(self.failure).__name__}: {self.failure}")
        return CollectiveAborted(f"rank {self.rank}'s host links are {why}")

    def _conn(self, peer: int) -> _Conn:
        try:
            return self._conns[peer]
        except KeyError:
            raise OverlapRuntimeError(f"rank {self.rank} has no link to rank {peer} "
                                      f"(linked: {list(self.peers)})") from None

    def _cancel(self, req: LinkRequest) -> None:
        with self._lock:
            req.cancelled = True
            queue = self._posted.get(req.key)
            if queue is not None and req in queue:
                queue.remove(req)
                if not queue:
                    del self._posted[req.key]

    # ---- the link thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing:
                for key, mask in self._sel.select():
                    conn = key.data
                    if conn is None:
                        self._drain_pokes()
                        continue
                    self._on_ready(conn, bool(mask & selectors.EVENT_READ),
                                   bool(mask & selectors.EVENT_WRITE))
        except BaseException as exc:  # a bug here must not pass for a silent link
            self.failure = exc
            self._fail_all(exc)

    def _on_ready(self, conn: _Conn, readable: bool, writable: bool) -> None:
        """``conn``'s socket has bytes to read or room to write (its reader's callback: the
        link thread's, or the serving loop's)."""
        try:
            if readable:
                self._read(conn)
            if writable:
                self._flush(conn)
        except Exception as exc:  # (a bad frame: that link only)
            log.exception("rank %d: link to rank %d failed", self.rank, conn.peer)
            self._broken(conn, exc)

    def _drain_pokes(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass
        with self._lock:
            wanted, self._want_write = self._want_write, []
            handovers, self._handovers = self._handovers, []
        for conn in wanted:
            with contextlib.suppress(KeyError, ValueError):  # (lost meanwhile: unregistered)
                self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        for watch, done in handovers:
            for conn in self._conns.values():
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(conn.sock)
                if watch and not conn.gone:
                    self._sel.register(conn.sock, selectors.EVENT_READ | (
                        selectors.EVENT_WRITE if conn.writing else 0), conn)
            done.set()

    def _poke_thread(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _read(self, conn: _Conn) -> None:
        """Read what arrived on ``conn``: whole frames and the start of the next one. Between
        frames a stage of bytes is read at once (``_read_ahead``: a small frame, header and
        payload, in one system call); the rest of a larger payload lands in place. A short
        read means the socket is drained: the selector calls again when more comes."""
        for _ in range(_READS_PER_EVENT):
            if conn.body is None:
                if not self._read_ahead(conn):
                    return
                continue
            want = conn.body.nbytes - conn.got
            n = self._recv(conn, conn.body[conn.got:], want)
            if n is None:
                return
            conn.got += n
            if n < want:
                return
            self._land(conn)

    def _recv(self, conn: _Conn, view: memoryview, want: int) -> int | None:
        """Bytes read into ``view`` (None: none now, or the link is lost)."""
        try:
            n = conn.sock.recv_into(view, want)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            self._lost(conn, f"{type(exc).__name__}: {exc}")
            return None
        if n == 0:
            self._lost(conn, "its process closed the link")
            return None
        return n

    def _read_ahead(self, conn: _Conn) -> bool:
        """Between frames: read up to a stage of bytes (after the part of a header kept from
        the last read), and take in every frame they hold — whole, or the start of one whose
        payload lands in place next. True: the stage filled, more may wait now."""
        stage = conn.stage
        n = self._recv(conn, memoryview(stage)[conn.got:], len(stage) - conn.got)
        if n is None:
            return False
        end, pos = conn.got + n, 0
        while end - pos >= HEADER.size:
            conn.header[:] = stage[pos:pos + HEADER.size]
            pos += HEADER.size
            self._begin(conn)
            body = conn.body
            if body is None:
                continue  # (an empty payload: landed already)
            take = min(body.nbytes, end - pos)
            body[:take] = stage[pos:pos + take]
            pos += take
            if take < body.nbytes:
                conn.got = take
                return end == len(stage)
            self._land(conn)
        rest = end - pos  # the start of the next header: kept at the stage's start
        stage[:rest] = stage[pos:end]
        conn.got = rest
        return end == len(stage)

    def _begin(self, conn: _Conn) -> None:
        """A header is in: choose where the payload lands."""
        channel, tag, nbytes = HEADER.unpack(conn.header)
        conn.frame = (channel, tag, nbytes)
        key = (conn.peer, channel, tag)
        with self._lock:
            req = self._take_posted(key)
        conn.target = req
        # In place when the sizes agree; else in a copy (its size reported, as MPI's count).
        if req is not None:
            req.matched = True
        conn.body = req.view if req is not None and req.nbytes == nbytes else \
            memoryview(bytearray(nbytes))
        conn.got = 0
        if nbytes == 0:  # (no byte left to read: the selector would not call again)
            self._land(conn)

    def _land(self, conn: _Conn) -> None:
        """A payload is in: complete its receive, or keep it for the receive to come."""
        channel, tag, nbytes = conn.frame
        req, body = conn.target, conn.body
        conn.body, conn.target, conn.got = None, None, 0
        self.frames_received += 1  # (only the link thread writes it)
        assert body is not None
        if req is None:
            key = (conn.peer, channel, tag)
            with self._lock:
                req = self._take_posted(key)  # posted while the payload was landing
                if req is None:
                    self._unexpected.setdefault(key, deque()).append(body.obj)
                    return
        if body is not req.view:
            _deliver(req, body)
        req.count = nbytes
        self._complete(req)

    def _take_posted(self, key: tuple[int, int, int]) -> LinkRequest | None:
        """(Under ``_lock``.) The first receive posted for ``key``, taken out (None: none)."""
        queue = self._posted.get(key)
        if not queue:
            return None
        req = queue.popleft()
        if not queue:
            del self._posted[key]
        return req

    def _complete(self, req: LinkRequest, error: BaseException | None = None) -> None:
        with self._lock:
            if req.done or req.error is not None:
                return
            if error is None:
                req.done = True
            else:
                req.error = error
            wake = req.wake
        if wake is not None:
            try:
                wake()
            except Exception:  # (a waiter's bug must not stop every link of the process)
                log.exception("rank %d: a link request's waker failed", self.rank)

    def _flush(self, conn: _Conn) -> None:
        """Write what the socket takes of the sends in flight."""
        finished: list[LinkRequest] = []
        lost: list[LinkRequest] = []
        with conn.wlock:
            try:
                while conn.out:
                    parts, req = conn.out[0]
                    rest = _write(conn.sock, parts)
                    if rest:
                        conn.out[0] = (rest, req)
                        break
                    conn.out.popleft()
                    finished.append(req)
            except OSError as exc:
                lost = conn.shut(f"{type(exc).__name__}: {exc}")
            if not conn.out:
                conn.writing = False
                loop = self._loop
                if loop is not None:
                    loop.remove_writer(conn.fd)
                else:
                    with contextlib.suppress(KeyError, ValueError):
                        self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        for req in finished:
            self._complete(req)
        for req in lost:
            self._complete(req, _closed(conn))

    def _lost(self, conn: _Conn, why: str) -> None:
        """The peer's end closed. What it sent before has been read; receives waiting for
        more wait on (the runtime names the rank: failure notice or timeout); sends fail."""
        self._unwatch(conn)
        with conn.wlock:
            pending = conn.shut(why)
        err = _closed(conn)
        for req in pending:
            self._complete(req, err)

    def _fail_all(self, exc: BaseException | None) -> None:
        """Fail every request still pending (the link thread stopped, or links closed)."""
        err = self._ended() if exc is None else CollectiveAborted(
            f"rank {self.rank}'s link thread failed: {type(exc).__name__}: {exc}")
        with self._lock:
            pending = [r for q in self._posted.values() for r in q]
            self._posted.clear()
        for conn in self._conns.values():
            with conn.wlock:
                pending += conn.shut(conn.closed or str(err))
            if conn.target is not None:
                pending.append(conn.target)
        for req in pending:
            self._complete(req, err)

    def _broken(self, conn: _Conn, exc: Exception) -> None:
        """A frame from ``conn`` could not be taken in: that link ends, and what waits on it
        fails, naming why."""
        self._unwatch(conn)
        err = CollectiveAborted(f"rank {self.rank}'s link to rank {conn.peer} failed: "
                                f"{type(exc).__name__}: {exc}")
        with self._lock:
            mine = [k for k in self._posted if k[0] == conn.peer]
            pending = [r for k in mine for r in self._posted.pop(k)]
        with conn.wlock:
            pending += conn.shut(str(err))
        if conn.target is not None:
            pending.append(conn.target)
        for req in pending:
            self._complete(req, err)

    def _unwatch(self, conn: _Conn) -> None:
        conn.gone = True
        loop = self._loop
        if loop is not None:
            _off_loop(loop, conn)
            return
        with contextlib.suppress(KeyError, ValueError):  # (unregistered already)
            self._sel.unregister(conn.sock)

    # ---- an event loop as the reader -------------------------------------------------------

    def serve(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """From now on ``loop`` — running on the calling thread — reads and flushes the links
        instead of the link thread or the loop before it (None: the link thread again): a
        message then wakes one thread, not the link thread and then the loop that waits for
        it. Only while the loop runs does anyone read; the kernel keeps what comes meanwhile,
        and a sender whose bytes do not fit waits (as for any slow reader). The runtime
        serves the loop of each call: its ``*_sync`` calls' loop, or the caller's own.

        A loop running on another thread keeps the links (no loop is touched from a thread
        not its own — uvloop's is not thread-safe): it reads them for this thread's calls
        too, whose completions reach any thread. A loop not running (between its calls, or
        closed: ``asyncio.run`` per call) is left for this one without the link thread."""
        me = threading.get_ident()
        with self._serve_lock:
            if self._closing:
                return  # (closed: nobody reads any more)
            if loop is self._loop:
                self._loop_thread = me  # (*_sync calls may come from any thread)
                return
            old = self._loop
            if old is not None and loop is not None and self._loop_thread != me \
                    and old.is_running():
                return
            if old is not None:
                self._leave_loop()
                if loop is None:
                    self._hand_over(watch=True)
                    return
            elif loop is not None:
                self._hand_over(watch=False)  # (the thread reads nothing from now on)
            if loop is not None:
                self._attach(loop)

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """(The link thread not watching.) ``loop`` reads and flushes from now on."""
        with self._lock:
            self._loop, self._loop_thread = loop, threading.get_ident()
        for conn in self._conns.values():
            if not conn.gone:
                loop.add_reader(conn.fd, self._on_ready, conn, True, False)
                if conn.writing:  # (asked of the thread, or of the loop before, meanwhile)
                    loop.add_writer(conn.fd, self._on_ready, conn, False, True)

    def _leave_loop(self) -> None:
        """The loop no longer reads nor flushes the links (it may be closed already). One
        running on another thread lets go on its own thread (no loop is touched from a
        thread not its own): waited for, at most ``LEAVE_WAIT_S`` — a loop held up by its
        own code reads nothing meanwhile, and lets go before it reads again."""
        with self._lock:
            loop, self._loop = self._loop, None
            elsewhere = self._loop_thread != threading.get_ident()
        if loop is None:
            return
        conns = list(self._conns.values())
        if not (elsewhere and loop.is_running()):
            for conn in conns:
                _off_loop(loop, conn)
            return
        left = threading.Event()

        def let_go() -> None:
            for conn in conns:
                _off_loop(loop, conn)
            left.set()

        with contextlib.suppress(RuntimeError):  # (closed meanwhile: nothing watches now)
            loop.call_soon_threadsafe(let_go)
            left.wait(LEAVE_WAIT_S)

    def _hand_over(self, watch: bool) -> None:
        """Have the link thread stop (``watch`` False) or start again watching the sockets,
        and wait until it has (bounded: a thread that stopped is the links' failure)."""
        done = threading.Event()
        with self._lock:
            self._handovers.append((watch, done))
        self._poke_thread()
        if not done.wait(CONNECT_TIMEOUT_S) and self._thread.is_alive():
            raise OverlapRuntimeError(f"rank {self.rank}'s link thread did not answer")

    def _loop_watch_write(self, loop: asyncio.AbstractEventLoop, conn: _Conn) -> None:
        if self._loop is loop and conn.writing and not conn.gone:  # (else: handed back)
            loop.add_writer(conn.fd, self._on_ready, conn, False, True)

    def wait_landing(self, landed: threading.Event, timeout: float) -> None:
        """Wait (at most ``timeout``) for ``landed``, set when a message has landed. On the
        thread of the loop that reads the links, nothing else would read it: read here."""
        if self._loop is None or threading.get_ident() != self._loop_thread:
            landed.wait(timeout)
            return
        deadline = time.perf_counter() + timeout
        while not landed.is_set() and (left := deadline - time.perf_counter()) > 0:
            socks = {c.sock: c for c in self._conns.values() if not c.gone}
            if not socks:
                return
            ready, _, _ = select.select(list(socks), [], [], min(left, 0.05))
            for sock in ready:
                self._on_ready(socks[sock], True, False)

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self, timeout: float = 1.0) -> None:
        """Stop the link thread (within ``timeout``) and close every socket."""
        if self._closing:
            return
        self._closing = True
        with self._serve_lock:  # (a change of reader under way ends first)
            self._leave_loop()
        self._poke_thread()
        self._thread.join(timeout)
        self._fail_all(None)  # (no request is left waiting for a thread that is gone)
        for conn in self._conns.values():
            with contextlib.suppress(OSError):
                conn.sock.close()
        if not self._thread.is_alive():
            self._sel.close()
        self._wake_r.close()
        self._wake_w.close()


def _off_loop(loop: asyncio.AbstractEventLoop, conn: _Conn) -> None:
    """``loop`` no longer watches ``conn`` (it may be closed already)."""
    with contextlib.suppress(RuntimeError, ValueError, OSError):
        loop.remove_reader(conn.fd)
        loop.remove_writer(conn.fd)


def _address(token: str, rank: int) -> str:
    """Where ``rank`` listens: Linux's abstract namespace (nothing on disk to clean up),
    elsewhere a path in the temporary directory."""
    name = f"overlap-{token}-{rank}"
    if sys.platform.startswith("linux"):
        return "\0" + name
    import tempfile

    return os.path.join(tempfile.gettempdir(), name)


def _read_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise OSError("link closed during setup")
        data += chunk
    return data


def _bytes(buf: Any) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise OverlapRuntimeError("a link moves contiguous buffers only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _write(sock: socket.socket, parts: list[memoryview]) -> list[memoryview]:
    """Write what the socket takes of ``parts``; the rest (empty: all written). Raises
    OSError (other than "would block") when the peer is gone."""
    parts = [p for p in parts if p.nbytes]  # (an empty payload: its header only)
    while parts:
        try:
            n = sock.sendmsg(parts, (), _SEND_FLAGS)
        except (BlockingIOError, InterruptedError):
            return parts
        while n:
            if n >= parts[0].nbytes:
                n -= parts[0].nbytes
                parts = parts[1:]
            else:
                parts = [parts[0][n:], *parts[1:]]
                n = 0
    return parts


def _deliver(req: LinkRequest, data: memoryview) -> None:
    """Copy a message that did not land in place: as much as fits, its size as the count."""
    n = min(req.nbytes, data.nbytes)
    req.view[:n] = data[:n]
    req.count = data.nbytes


def _closed(conn: _Conn) -> CollectiveAborted:
    return CollectiveAborted(f"the link to rank {conn.peer} is closed ({conn.closed})")


__all__ = ["HostLinks", "LinkRequest"]
