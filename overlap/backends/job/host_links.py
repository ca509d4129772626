"""Byte links between the MPI ranks of one host: a Unix stream socket per pair of ranks, with
MPI's point-to-point semantics (nonblocking send and receive, matched by channel, source and
tag, in order), read by the process's progress engine.

Why not MPI for these bytes: MPI offers no completion a thread can sleep on. Its requests are
polled, and on a host with fewer cores than ranks every poll is a thread wake-up; and MPICH
moves messages of 8 KiB and more by rendezvous, which completes only while the receiving
process polls. A socket needs neither: the kernel buffers what was sent (so a send completes
at once, whether or not its receiver looks), and the engine sleeps in ``select`` until bytes
arrive — one wake-up per message, the way gloo's transport waits.

Messages are frames: a header (channel, tag, payload bytes), then the payload. The engine
reads every socket: a frame whose receive is posted lands in that receive's buffer directly;
one that comes first waits, copied, until its receive is posted (MPI's unexpected messages).
Between frames it reads 16 KiB at once (a small frame and those queued after it in one
system call; a larger payload's start is copied once, its rest lands in place). A send writes
what the socket takes at once from the posting thread and leaves the rest to the engine.
Every request is a :class:`~overlap.backends.job.engine.Completion`.

Failures: a peer whose socket closed delivers what it sent before; receives still waiting for
it then wait on (as MPI's do: the runtime's failure notices and timeouts name the rank), a
send to it fails at once, naming it.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import socket
import stat
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...bootstrap import Bootstrap, reachable_address
from ...errors import CollectiveAborted, OverlapRuntimeError
from ...scope import CancelScope
from .engine import Completion, Engine

log = logging.getLogger("overlap")

HEADER = struct.Struct("<IqQ")  # channel id, tag (64 bits: see wire.py), payload bytes
SOCKET_BUFFER_BYTES = 4 << 20  # asked of the kernel (it caps it: wmem_max)
CONNECT_TIMEOUT_S = 30.0  # link setup: every rank of the host is inside the same call
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)  # a closed peer: an error, not SIGPIPE
_READS_PER_EVENT = 64  # reads from one socket before the others get their turn
# Bytes read at once between frames: a small frame (the runtime's rounds, a width-64
# boundary) comes whole in one system call; a larger payload's first part is copied once.
_STAGE_BYTES = 16 << 10


class LinkRequest(Completion):
    """One nonblocking send or receive on a link (the subset of ``mpi4py.MPI.Request`` the
    wire uses — ``Test``, ``Cancel``, ``Wait`` after a cancel — on a :class:`Completion`)."""

    __slots__ = ("_links", "cancelled", "key", "matched", "nbytes", "view")

    def __init__(self, links: HostLinks, key: tuple[int, int, int], view: memoryview) -> None:
        super().__init__(f"link message (channel {key[1]}, tag {key[2]})", key[0])
        self._links = links
        self.key = key  # (peer, channel, tag)
        self.view = view
        self.nbytes = view.nbytes
        self.cancelled = False
        self.matched = False  # a receive whose message is landing (a cancel comes too late)

    def Test(self, status: Any = None) -> bool:
        """True once complete; raises what failed it."""
        if self.error is not None:
            raise self.error
        return self.done

    def Cancel(self) -> None:
        """Take back a receive not matched yet: it never will be, its message goes to the
        next one. One whose message is already landing completes with it (as MPI's cancel
        can fail): ``Wait`` then waits for its bytes."""
        self._links._cancel(self)

    def Wait(self, timeout: float = 1.0) -> None:
        """(After ``Cancel``.) Return once no bytes will land in the buffer any more: at
        once for a receive taken back; else when its message has landed (or its link
        failed), at most ``timeout`` seconds."""
        if self.matched:
            with contextlib.suppress(Exception):
                self.block(CancelScope("taking a receive back"), self.what, timeout)


class _Conn:
    """One peer's socket and its reader's and writer's state."""

    def __init__(self, peer: int, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.header = bytearray(HEADER.size)
        self.stage = bytearray(_STAGE_BYTES)  # what is read between frames (see _read_ahead)
        self.got = 0  # bytes of a header on the stage, then of the payload, read so far
        self.body: memoryview | None = None  # where the payload lands (None: reading a header)
        self.frame: tuple[int, int, int] = (0, 0, 0)  # (channel, tag, bytes) being read
        self.target: LinkRequest | None = None  # the receive it lands in (None: unexpected)
        self.out: deque[tuple[list[memoryview], LinkRequest]] = deque()  # sends in flight
        self.wlock = threading.Lock()  # frames are written whole, in order
        self.writing = False  # the engine watches it for room to write
        self.closed: str | None = None  # why the peer cannot be written to
        self.gone = False  # nobody reads it any more (the peer closed, or a bad frame)
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
    """Links from this rank to ``peers`` (rank -> connected stream socket), read by
    ``engine``. Build it for an MPI job with :meth:`connect`."""

    def __init__(self, rank: int, peers: Mapping[int, socket.socket], engine: Engine) -> None:
        self.rank = rank
        self.engine = engine
        self._lock = threading.Lock()  # matching: posted receives, unexpected messages
        self._posted: dict[tuple[int, int, int], deque[LinkRequest]] = {}
        self._unexpected: dict[tuple[int, int, int], deque[bytearray]] = {}
        self._conns = {p: _Conn(p, s) for p, s in peers.items()}
        # Channels whose frames go to a handler (peer, tag, payload) instead of a receive.
        self._handlers: dict[int, Callable[[int, int, bytes], None]] = {}
        self._closing = False
        self.frames_received = 0  # messages read whole (for tests and benchmarks)
        for c in self._conns.values():
            c.sock.setblocking(False)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with contextlib.suppress(OSError):
                    c.sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
            engine.watch_reader(c.fd, lambda c=c: self._on_readable(c))

    # ---- setup ---------------------------------------------------------------------------

    @classmethod
    def connect(cls, boot: Bootstrap, engine: Engine, *, network: bool = False,
                timeout: float = CONNECT_TIMEOUT_S,
                failures: list[str] | None = None) -> HostLinks | None:
        """Collective over ``boot`` (every rank, same thread order): link this rank to every
        other rank on its host (same ``boot.host()``: a Unix socket) and, with ``network``,
        to every rank on other hosts too (TCP: a job with no MPI, started by torchrun). None
        where links cannot be made on every rank that needs them; ``failures`` (when given)
        then gets each failed rank's reason, the socket error included.

        No one else can join or disturb the setup: each rank listens on a Unix socket in a
        directory of its own that only its user may enter (``mkdtemp``: mode 0700; nothing
        in the abstract namespace, where every user could list and reach it), accepts only
        peers of its own user (``SO_PEERCRED``), and every peer proves it holds the job's
        secret by an HMAC of both ranks and a fresh nonce — the secret never crosses a link,
        and a dialer waits for no answer (no rank's setup waits on another's). A connection
        that fails any of this (another user, a port scanner, silence past ``HANDSHAKE_S``)
        is closed and logged, and the setup goes on waiting for the real peers."""
        rank, size = boot.rank, boot.size
        hosts = boot.allgather(boot.host())
        secret = _job_secret(boot)
        mates = [r for r in range(size) if r != rank and hosts[r] == hosts[rank]]
        remote = [r for r in range(size) if r != rank and hosts[r] != hosts[rank]] \
            if network else []
        peers: dict[int, socket.socket] = {}
        here, why = _Listening.open(rank, len(mates), len(remote))
        # Everyone listens before anyone connects; a rank that cannot makes every rank fall
        # back (links are all or nothing: both ends of a pair must agree).
        addresses = boot.allgather([here.path, here.where])
        ok = boot.all_true(why is None)
        try:
            if ok:
                for r in (r for r in (*mates, *remote) if r > rank):  # lower ranks connect
                    s = dial(addresses[r][0] if r in mates else tuple(addresses[r][1]),
                              timeout)
                    peers[r] = s
                    check_same_user(s)
                    _prove(s, secret, rank, r)
                for listener, group in ((here.unix, mates), (here.tcp, remote)):
                    want = {r for r in group if r < rank}  # higher ranks accept
                    if want:
                        assert listener is not None
                        accept_peers(listener, want, secret, peers, timeout, rank)
        except OSError as exc:
            why = f"linking: {type(exc).__name__}: {exc}"
        finally:
            here.close()
        whys = boot.allgather(why)
        if any(w is not None for w in whys):
            for s in peers.values():
                s.close()
            if failures is not None:
                failures += [f"rank {r}: {w}" for r, w in enumerate(whys) if w is not None]
                if remote and any(w is not None and w.startswith("linking") for w in whys):
                    failures.append("the ranks are on several hosts: a firewall between them?")
            return None
        for r in remote:
            with contextlib.suppress(OSError):  # (frames are small and latency-bound)
                peers[r].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(rank, peers, engine)

    def has(self, peer: int) -> bool:
        return peer in self._conns

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted(self._conns))

    @property
    def network_peers(self) -> tuple[int, ...]:
        """The peers linked over TCP (on other hosts, in a job without MPI)."""
        return tuple(p for p, c in sorted(self._conns.items())
                     if c.sock.family != socket.AF_UNIX)

    @property
    def frames_sent(self) -> int:
        """Messages sent on every link (for tests and benchmarks)."""
        return sum(c.sent for c in self._conns.values())

    def closed_to(self, peer: int) -> bool:
        """Whether the link to ``peer`` is closed (its process closed it, or it broke)."""
        conn = self._conns.get(peer)
        return conn is None or conn.closed is not None

    def listen(self, channel: int, handler: Callable[[int, int, bytes], None]) -> None:
        """Every frame of ``channel`` (from any peer, any tag) goes to ``handler(peer, tag,
        payload)`` on the engine's thread, in arrival order per peer — MPI's "any source"
        receive, for messages whose size the receiver cannot know (control messages)."""
        self._handlers[channel] = handler

    # ---- requests (any thread) -----------------------------------------------------------

    def irecv(self, channel: int, peer: int, tag: int, buf: Any) -> LinkRequest:
        """Receive the next message from ``peer`` with this channel and tag into ``buf``."""
        view = _bytes(buf)
        if view.readonly:
            raise OverlapRuntimeError("a link cannot receive into a read-only buffer")
        req = LinkRequest(self, (peer, channel, tag), view)
        self._conn(peer)
        with self._lock:
            if self._closing:
                raise self._ended()
            early = self._unexpected.get(req.key)
            if early:
                data = early.popleft()
                if not early:
                    del self._unexpected[req.key]
            else:
                self._posted.setdefault(req.key, deque()).append(req)
                return req
        req.complete(_deliver(req, memoryview(data)))
        return req

    def isend(self, channel: int, peer: int, tag: int, buf: Any) -> LinkRequest:
        """Send ``buf`` (which must stay untouched until the request completes)."""
        view = _bytes(buf)
        req = LinkRequest(self, (peer, channel, tag), view)
        conn = self._conn(peer)
        parts = [memoryview(HEADER.pack(channel, tag, view.nbytes)), view]
        if self._closing:
            raise self._ended()
        with conn.wlock:
            # A peer gone fails the request, not the call (as MPI reports it): whoever waits
            # for it learns why from the runtime's notices first.
            if conn.closed is not None:
                req.fail(_closed(conn))
                return req
            # (Counted before its bytes go: a peer may see them, and complete, before this
            # thread goes on.)
            conn.sent += 1
            if not conn.out:
                try:
                    parts = _write(conn.sock, parts)
                except OSError as exc:
                    conn.sent -= 1
                    conn.closed = f"{type(exc).__name__}: {exc}"
                    req.fail(_closed(conn))
                    return req
            if not parts:
                req.complete()
                return req
            conn.out.append((parts, req))
            start = not conn.writing
            conn.writing = True
        if start:  # the engine writes the rest as the socket takes it
            self.engine.watch_writer(conn.fd, lambda: self._flush(conn))
        return req

    def _ended(self) -> CollectiveAborted:
        return CollectiveAborted(f"rank {self.rank}'s host links are closed")

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

    # ---- the engine's side ---------------------------------------------------------------

    def _on_readable(self, conn: _Conn) -> None:
        try:
            self._read(conn)
        except Exception as exc:  # (a bad frame: that link only)
            log.exception("rank %d: link to rank %d failed", self.rank, conn.peer)
            self._broken(conn, exc)

    def _read(self, conn: _Conn) -> None:
        """Read what arrived on ``conn``: whole frames and the start of the next one. A short
        read means the socket is drained: the engine calls again when more comes."""
        for _ in range(_READS_PER_EVENT):
            if conn.gone:
                return
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
        req = None
        if channel not in self._handlers:
            with self._lock:
                req = self._take_posted((conn.peer, channel, tag))
                if req is not None:
                    req.matched = True  # (under the lock: a cancel now comes too late)
        conn.target = req
        # In place when the sizes agree; else in a copy (its size reported, as MPI's count).
        conn.body = req.view if req is not None and req.nbytes == nbytes else \
            memoryview(bytearray(nbytes))
        conn.got = 0
        if nbytes == 0:  # (no byte left to read: no further readable event would come)
            self._land(conn)

    def _land(self, conn: _Conn) -> None:
        """A payload is in: complete its receive, or keep it for the receive to come."""
        channel, tag, nbytes = conn.frame
        req, body = conn.target, conn.body
        conn.body, conn.target, conn.got = None, None, 0
        self.frames_received += 1  # (only the engine writes it)
        assert body is not None
        handler = self._handlers.get(channel)
        if handler is not None:
            try:
                handler(conn.peer, tag, bytes(body))
            except Exception:  # (the handler's own failure: not the link's)
                log.exception("rank %d: handling a message from rank %d failed", self.rank,
                              conn.peer)
            return
        if req is None:
            key = (conn.peer, channel, tag)
            with self._lock:
                req = self._take_posted(key)  # posted while the payload was landing
                if req is None:
                    self._unexpected.setdefault(key, deque()).append(body.obj)
                    return
        if body is not req.view:
            _deliver(req, body)
        req.complete(nbytes)

    def _take_posted(self, key: tuple[int, int, int]) -> LinkRequest | None:
        """(Under ``_lock``.) The first receive posted for ``key``, taken out (None: none)."""
        queue = self._posted.get(key)
        if not queue:
            return None
        req = queue.popleft()
        if not queue:
            del self._posted[key]
        return req

    def _flush(self, conn: _Conn) -> None:
        """Write what the socket takes of the sends in flight (the engine's writer)."""
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
                self.engine.watch_writer(conn.fd, None)
        for req in finished:
            req.complete()
        for req in lost:
            req.fail(_closed(conn))

    def _lost(self, conn: _Conn, why: str) -> None:
        """The peer's end closed. What it sent before has been read; receives waiting for
        more wait on (the runtime names the rank: failure notice or timeout); sends fail."""
        conn.gone = True
        self.engine.forget(conn.fd)
        with conn.wlock:
            pending = conn.shut(why)
        err = _closed(conn)
        for req in pending:
            req.fail(err)

    def _broken(self, conn: _Conn, exc: Exception) -> None:
        """A frame from ``conn`` could not be taken in: that link ends, and what waits on it
        fails, naming why."""
        conn.gone = True
        self.engine.forget(conn.fd)
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
            req.fail(err)

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Close every socket and fail what still waits (the engine forgets them)."""
        if self._closing:
            return
        self._closing = True
        err = self._ended()
        with self._lock:
            pending = [r for q in self._posted.values() for r in q]
            self._posted.clear()
        for conn in self._conns.values():
            self.engine.forget(conn.fd)
            with conn.wlock:
                pending += conn.shut(conn.closed or str(err))
            if conn.target is not None:
                pending.append(conn.target)
        for req in pending:
            req.fail(err)
        for conn in self._conns.values():
            with contextlib.suppress(OSError):
                conn.sock.close()


class LinksComm:
    """One channel of :class:`HostLinks` with the point-to-point calls of an MPI
    communicator that a bootstrap uses (``Isend``/``Irecv`` returning requests with ``Test``
    and ``Cancel``): how NCCL's unique ids travel in a job without MPI."""

    def __init__(self, links: HostLinks, channel: int) -> None:
        self.links, self.channel = links, channel

    def Isend(self, buf: Any, dest: int, tag: int) -> LinkRequest:
        return self.links.isend(self.channel, dest, tag, buf)

    def Irecv(self, buf: Any, source: int, tag: int) -> LinkRequest:
        return self.links.irecv(self.channel, source, tag, buf)


_CHALLENGE_BYTES = 32
# How long one connection may take to answer the challenge (a rank answers at once: it
# connected to do so); one that does not is dropped and the wait for the real peers goes on.
HANDSHAKE_S = 5.0


SECRET_FILE_ENV = "OVERLAP_LINK_SECRET_FILE"
_MIN_SECRET_BYTES = 16


def _job_secret(boot: Bootstrap) -> bytes:
    """The job's link secret: the contents of the file ``OVERLAP_LINK_SECRET_FILE`` names
    when it is set (every rank reads its own copy: the secret never travels), else a fresh
    one from rank 0 sent once through the launcher's bootstrap — MPI, or torch's rendezvous
    store, which torchrun's ranks trust for everything else too, but which a TCP store
    between nodes carries in the clear. Every rank must agree on which: a mix is refused."""
    path = os.environ.get(SECRET_FILE_ENV)
    given, why = None, None
    if path:
        try:
            given = _read_secret(path)
        except ValueError as exc:
            why = str(exc)
    # (Every rank learns every rank's verdict, so all raise together: none waits on another.)
    verdicts = boot.allgather((bool(path), why))
    bad = [f"rank {r}: {w}" for r, (_, w) in enumerate(verdicts) if w is not None]
    if bad:
        raise ValueError("; ".join(bad))
    if len({has for has, _ in verdicts}) > 1:
        unset = [r for r, (has, _) in enumerate(verdicts) if not has]
        raise ValueError(f"{SECRET_FILE_ENV} is set on some ranks and not on ranks {unset}: "
                         "set it on every rank of the job (or on none)")
    if given is not None:
        return given
    return bytes.fromhex(boot.bcast(secrets.token_hex(32) if boot.rank == 0 else None, root=0))


def _read_secret(path: str) -> bytes:
    """The secret in ``path``: a regular file of this user that no one else may read or
    write, at least 16 bytes (ValueError naming the variable and the file otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ValueError(f"{SECRET_FILE_ENV}={path}: cannot open it ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{SECRET_FILE_ENV}={path}: not a regular file")
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ValueError(f"{SECRET_FILE_ENV}={path}: the file must belong to this user "
                             f"and be readable by no one else (chmod 600; it is "
                             f"{stat.filemode(info.st_mode)}, uid {info.st_uid})")
        secret = f.read(1 << 16).strip()
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(f"{SECRET_FILE_ENV}={path}: {len(secret)} bytes; a secret is at least "
                         f"{_MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32 > {path}`)")
    return secret


def _proof(secret: bytes, dialer: int, listener: int, nonce: bytes) -> bytes:
    """The HMAC a dialing rank sends: of both ranks and its fresh nonce, under the job's
    secret (bound to this pair: it proves nothing to another listener)."""
    return hmac.digest(secret, b"overlap-link" + struct.pack("<ii", dialer, listener) + nonce,
                       "sha256")


def _prove(s: socket.socket, secret: bytes, rank: int, listener: int) -> None:
    """(The connecting side.) Say this rank, a fresh nonce and their proof, and go on: no
    answer to wait for, so no rank's setup waits on another's."""
    nonce = secrets.token_bytes(_CHALLENGE_BYTES)
    s.sendall(struct.pack("<i", rank) + nonce + _proof(secret, rank, listener, nonce))


def accept_peers(listener: socket.socket, want: set[int], secret: bytes,
                 peers: dict[int, socket.socket], timeout: float, rank: int) -> None:
    """(The listening side.) Accept until every rank of ``want`` joined, within ``timeout``:
    a connection that is not one of them (another user, a wrong proof — one made for
    another listener too —, a rank already linked, nothing said within ``HANDSHAKE_S``) is
    closed and logged, and the wait goes on."""
    deadline = time.monotonic() + timeout
    while want:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"ranks {sorted(want)} never linked within {timeout:g} s")
        listener.settimeout(left)
        s, _addr = listener.accept()
        try:
            check_same_user(s)
            hello = _read_exactly(s, 4 + _CHALLENGE_BYTES + 32,
                                  min(time.monotonic() + HANDSHAKE_S, deadline))
            who = struct.unpack("<i", hello[:4])[0]
            nonce, mac = hello[4:4 + _CHALLENGE_BYTES], hello[4 + _CHALLENGE_BYTES:]
            if not hmac.compare_digest(mac, _proof(secret, who, rank, nonce)):
                raise OSError("it does not hold this job's secret")
            if who not in want:
                raise OSError(f"it says it is rank {who}, which this rank does not wait for")
        except OSError as exc:
            s.close()
            log.warning("overlap: refused a link connection during setup: %s", exc)
            continue
        s.settimeout(timeout)
        want.discard(who)
        peers[who] = s


@dataclass
class _Listening:
    """Where one rank listens during setup: a Unix socket (``path``) in its private
    directory (``home``), and a TCP one (``where``)."""

    unix: socket.socket | None = None
    tcp: socket.socket | None = None
    home: str | None = None
    path: str | None = None
    where: Any = None

    @classmethod
    def open(cls, rank: int, mates: int, remote: int) -> tuple[_Listening, str | None]:
        """Listen for ``mates`` ranks of this host and ``remote`` ones of others; the error
        where that fails (what is open then is closed by :meth:`close`)."""
        me = cls()
        try:
            if mates:
                me.home = _private_dir()
                me.path = os.path.join(me.home, f"r{rank}")
                me.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                me.unix.bind(me.path)
                me.unix.listen(mates + 8)
            if remote:
                me.tcp = socket.create_server((reachable_address(), 0), backlog=remote + 8)
                me.where = me.tcp.getsockname()[:2]
        except OSError as exc:
            return me, f"listening: {type(exc).__name__}: {exc}"
        return me, None

    def close(self) -> None:
        """Stop listening; the socket's file and its directory go (once linked, nothing is
        left for anyone to reach)."""
        for listener in (self.unix, self.tcp):
            if listener is not None:
                listener.close()
        if self.home is not None:
            if self.path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            with contextlib.suppress(OSError):
                os.rmdir(self.home)


def _private_dir() -> str:
    """A directory only this user may enter (``mkdtemp``: 0700) whose socket paths fit a Unix
    address (108 bytes): the temporary directory, else ``/tmp`` where that is too long."""
    base = tempfile.gettempdir()
    if len(base) > 64 and os.path.isdir("/tmp"):
        base = "/tmp"
    return tempfile.mkdtemp(prefix="overlap-links-", dir=base)


def check_same_user(s: socket.socket) -> None:
    """A Unix-socket peer must run as this process's user (``SO_PEERCRED``): another user's
    process on the host cannot pose as a rank. (Every peer also proves the job's secret.)"""
    if s.family != socket.AF_UNIX or not hasattr(socket, "SO_PEERCRED"):
        return
    creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        s.close()
        raise OSError(f"a link peer runs as uid {uid}, this rank as {os.getuid()}")


def dial(address: Any, timeout: float) -> socket.socket:
    """A stream socket connected to a peer's listening ``address`` (a Unix socket path, or
    a (host, port) pair), within ``timeout``."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(address)
    except OSError:
        s.close()
        raise
    return s


def _read_exactly(s: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes from ``s``; with ``deadline`` (``time.monotonic``) all of them by then (a
    peer that sends a byte at a time cannot stretch it)."""
    data = b""
    while len(data) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            s.settimeout(left)
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


def _deliver(req: LinkRequest, data: memoryview) -> int:
    """Copy a message that did not land in place: as much as fits; returns its size (the
    receive's count)."""
    n = min(req.nbytes, data.nbytes)
    req.view[:n] = data[:n]
    return data.nbytes


def _closed(conn: _Conn) -> CollectiveAborted:
    return CollectiveAborted(f"the link to rank {conn.peer} is closed ({conn.closed})")


__all__ = ["HostLinks", "LinkRequest", "LinksComm"]
