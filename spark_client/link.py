"""The SDK's calls on the servers' links (docs/clients.md, "The link").

A server with a link advertises it (ServerInfo.link_address in the metadata): the
length-prefixed TCP protocol its partition servers' followers and coordinators already
speak (services/link_wire.py), beside its gRPC port. A coordinator has one when
coordinator.client_link is on; a partition server always has one (its followers copy
over it). The SDK sends there its calls to coordinators (CommitTxn, CommitTxns, and the
streaming path's NewTxn ... EndTxn), its consumers' calls to partition servers (Fetch; a
subscription's Receive, Ack, Nack), and its producers' Produce calls, on one pipelined
connection per partition server (`Pipeline`): link_wire.CALL_METHODS. A gRPC call costs
a Python client about 0.3-0.4 ms of CPU and the server about as much before either does
any work (docs/grpc-links.md), a call frame on a kept socket a fraction of that.

What travels and what comes back is what gRPC would carry: the same request and response
messages, the same bearer token (or, under mTLS, the same client certificate), the same
refusals (an error frame is the ErrorInfo of the gRPC status); the server checks the call
as its gRPC interceptor does. A failure is raised as the failed gRPC call would raise it
(a grpc.RpcError with the same ErrorInfo), so callers treat both alike; a link that
cannot be reached raises `LinkUnavailable`, and the caller sends that call, and those of
the next RETRY_LINK_AFTER_S, over gRPC. A connection lost mid-call is SERVER_UNAVAILABLE
(the outcome unknown), which callers retry as after a gRPC UNAVAILABLE.

Blocking sockets, one call per connection at a time, kept for the next call: at most
MAX_CONNECTIONS per server (a call beyond that goes over gRPC); and a producer's
`Pipeline`, up to MAX_PIPELINED calls at once on one connection. Calls that must go at
once run on the client's link threads (Links.submit); a long poll runs on its caller's
thread (Deferred). A forked child drops its parent's connections (they are the parent's
streams) and its link threads.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import select
import socket
import struct
import threading
import time
import weakref

from atomlog.v1 import partition_pb2
from services import local
from services.errors import AtomlogError, from_item
from services.link_wire import (
    CALL_METHODS,
    CALL_NUMBERS,
    KIND_ERROR,
    MAGIC_PIPELINED,
    MAX_CALL_BYTES,
    MAX_PIPELINED,
    SEND_PIECE_BYTES,
    call_frame,
    call_head,
    connect_blocking,
    read_answer,
    read_answer_into,
    send_frame,
)

# The SDK's calls a link carries, by name: to coordinators, and to partition servers.
METHODS = frozenset(name for service, name in CALL_NUMBERS if service == "CoordinatorService")
PARTITION_METHODS = frozenset({"Fetch", "Receive", "Ack", "Nack"})
PIPELINED_METHODS = frozenset({"Produce"})  # a producer's, on a Pipeline
_NUMBERS = {name: number for (_, name), number in CALL_NUMBERS.items()
            if name in METHODS | PARTITION_METHODS | PIPELINED_METHODS}
MAX_CONNECTIONS = 16  # per server; more calls at once go over gRPC
MAX_THREADS = 32  # Links.submit's: link calls made at once (a thread each, made when needed)
IDLE_S = 60.0  # a kept connection unused this long is closed (the server's idle limit: 120 s)
RETRY_LINK_AFTER_S = 10.0  # after a link could not be reached, gRPC for this long
# A pipelined call's answer not come this long after its deadline (the server answers
# REQUEST_TIMED_OUT at the deadline): the connection is taken for lost.
LATE_ANSWER_S = 2.0
JOIN_BYTES = 64 << 10  # a larger request is sent after its frame's head, not joined to it


class LinkUnavailable(ConnectionError):
    """No connection to the link could be made (or it was refused before any answer):
    the caller sends the call over gRPC."""


class Links:
    """A Client's links to its servers, by gRPC address (a combined server's one link
    takes both its coordinator's and its partition server's calls)."""

    def __init__(self, tls=None, token=None, enabled: bool = True):
        self._tls = tls  # services.tls.ChannelTls, or None
        self._token = token  # services.auth.TokenSource, or None
        self.enabled = enabled
        self._links: dict[str, ServerLink] = {}
        self._pipelines: dict[str, Pipeline] = {}
        self._lock = threading.Lock()
        self.calls = 0  # calls answered on a link (tests, benchmarks)
        self.fallbacks = 0  # calls sent over gRPC because a link could not be reached
        # Threads for link calls made at once (a consumer's calls to several servers).
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        _ALL.add(self)

    def submit(self, call, request, timeout_s: float) -> concurrent.futures.Future:
        """call(request, timeout=timeout_s) on one of the links' threads (at most
        MAX_THREADS): a future, as a gRPC stub's .future() gives."""
        if self._executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        max_workers=MAX_THREADS, thread_name_prefix="atomlog-link")
        return self._executor.submit(call, request, timeout=timeout_s)

    def get(self, grpc_address: str, link_address: str) -> "ServerLink | None":
        """The link to the server at `grpc_address`, which advertises `link_address`
        (empty: none, None returned); a new one when the advertised address changed (a
        restarted server)."""
        return self._kept(self._links, ServerLink, grpc_address, link_address)

    def pipeline(self, grpc_address: str, link_address: str) -> "Pipeline | None":
        """The pipelined connection to the server at `grpc_address`, as `get`."""
        return self._kept(self._pipelines, Pipeline, grpc_address, link_address)

    def _kept(self, kept: dict, make, grpc_address: str, link_address: str):
        if not self.enabled or not link_address:
            return None
        link = kept.get(grpc_address)
        if link is not None and link.address == link_address:
            return link
        with self._lock:
            link = kept.get(grpc_address)
            if link is None or link.address != link_address:
                if link is not None:
                    link.close()
                link = kept[grpc_address] = make(link_address, grpc_address, self._tls,
                                                 self._token, self)
            return link

    def close(self) -> None:
        with self._lock:
            links, self._links = [*self._links.values(), *self._pipelines.values()], {}
            self._pipelines = {}
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)  # calls under way end alone
        for link in links:
            link.close()

    def _forget_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._executor = None  # its threads are the parent's
        for link in [*self._links.values(), *self._pipelines.values()]:
            link.forget()


class ServerLink:
    """Kept connections to one server's link; `call` is thread-safe."""

    def __init__(self, address: str, server_address: str, tls, token, links: Links):
        host, _, port = address.rpartition(":")
        self.address = address
        self._target = (host.strip("[]"), int(port))
        self._tls = tls
        self._server_hostname = tls.server_hostname(server_address) if tls is not None else ""
        self._token = token
        self._links = links
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []  # kept, the last used last
        self._open = 0  # connections made and not closed
        self.connects = 0  # connections made (tests: kept ones are reused)
        self.down_until = 0.0
        self._closed = False

    def call(self, method: str, request, timeout_s: float):
        """`method` (one of METHODS or PARTITION_METHODS) on the link: its response, or
        raises the grpc.RpcError a failed gRPC call would raise, or LinkUnavailable (send
        it over gRPC)."""
        if time.monotonic() < self.down_until or self._closed:
            raise LinkUnavailable(f"{self.address}: not tried again yet")
        number = _NUMBERS[method]
        token = self._token.token.encode() if self._token is not None else b""
        frame = call_frame(number, timeout_s, token, request)
        if len(frame) > MAX_CALL_BYTES:
            raise LinkUnavailable(f"a {len(frame)}-byte call is more than the link takes")
        conn, fresh = self._take(timeout_s)
        sock = conn.sock
        kept = False
        try:
            conn.deadline = time.monotonic() + timeout_s
            if conn.buffer is None:  # TLS: Python's own timeout (a poll(2) per read)
                sock.settimeout(max(0.001, timeout_s))
                send_frame(sock, frame, conn.more)
                kind, payload = read_answer(sock, MAX_CALL_BYTES, conn.more)
            else:
                conn.bound(timeout_s)
                if len(frame) <= SEND_PIECE_BYTES:  # send_frame's one sendall, inline
                    sock.sendall(frame)
                else:
                    send_frame(sock, frame, conn.more)
                kind, payload = read_answer_into(sock, conn.buffer, MAX_CALL_BYTES,
                                                 conn.more)
            kept = True
        except (socket.timeout, TimeoutError, BlockingIOError):  # (the kernel's timeout)
            raise local.rpc_error(AtomlogError(
                "REQUEST_TIMED_OUT", f"{method} to {self.address} (link) took longer than "
                f"{timeout_s:.3f} s")) from None
        except OSError as error:
            if fresh:  # refused before any answer (the server's connection limit, say)
                self._down(error)
                raise LinkUnavailable(f"{self.address}: {error}") from None
            raise local.rpc_error(AtomlogError(
                "SERVER_UNAVAILABLE", f"{method} to {self.address} (link): "
                f"{type(error).__name__}: {error}", {"retry_after_ms": "50"})) from None
        finally:
            self._give_back(conn, kept)
        self._links.calls += 1
        if kind == KIND_ERROR:
            raise local.rpc_error(from_item(partition_pb2.ItemError.FromString(payload)))
        return CALL_METHODS[number].response_type.FromString(payload)

    def _take(self, timeout_s: float) -> tuple["_Connection", bool]:
        """A kept connection (False) or a new one (True). A kept one the server closed
        meanwhile (readable while no call is under way: its EOF), or idle too long, is
        closed here instead of failing a call."""
        now = time.monotonic()
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if now - conn.used < IDLE_S and not _readable(conn.sock, poller=conn.poller):
                    return conn, False
                self._open -= 1
                conn.sock.close()
            if self._open >= MAX_CONNECTIONS:
                raise LinkUnavailable(f"{self.address}: {MAX_CONNECTIONS} calls under way")
            self._open += 1
        try:
            return _Connection(self._connect(timeout_s)), True
        except BaseException:
            with self._lock:
                self._open -= 1
            raise

    def _connect(self, timeout_s: float) -> socket.socket:
        self.connects += 1
        try:
            return connect_blocking(self._target, timeout_s, self._tls, self._server_hostname)
        except (OSError, ValueError) as error:  # ssl.SSLError is an OSError
            self._down(error)
            raise LinkUnavailable(f"{self.address}: {error}") from None

    def _give_back(self, conn: "_Connection", kept: bool) -> None:
        with self._lock:
            if kept and not self._closed:
                conn.used = time.monotonic()
                self._idle.append(conn)
                return
            self._open -= 1
        conn.sock.close()

    def _down(self, error: BaseException) -> None:
        self.down_until = time.monotonic() + RETRY_LINK_AFTER_S
        self._links.fallbacks += 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for conn in idle:
            conn.sock.close()

    def forget(self) -> None:
        """In a forked child: the kept connections are the parent's streams. Closing our
        copies of their descriptors (close(2), no shutdown and no TLS close_notify) leaves
        the parent's connections up; the child opens its own."""
        self._lock = threading.Lock()
        idle, self._idle = self._idle, []
        self._open = 0
        for conn in idle:
            conn.sock.close()


class Pipeline:
    """One pipelined connection to a server's link (link_wire.MAGIC_PIPELINED), for a
    producer's Produce calls: `start` sends a call at once, in the order its callers
    start them (so a producer's batches reach their partitions in sequence order, as
    on its one gRPC connection, where calls on several connections could overtake one
    another), and returns a future; a reader thread reads the answers, which come in
    the same order, and settles the futures (their callbacks run on it, as a gRPC
    future's run on gRPC's thread). At most MAX_PIPELINED calls unanswered: `start`
    waits for room.

    The socket is read and written under one lock (`_wire`): a TLS connection may not
    be read and written at once from two threads. Sends do not wait for answers to be
    read: the server reads every frame of a connection with fewer than MAX_PIPELINED
    unanswered, and a Produce answer is small.

    Failures: a connection that cannot be made, or that the server closes before any
    answer (a server from before pipelining closes it at once), raises LinkUnavailable
    (the caller sends over gRPC, and so do the next RETRY_LINK_AFTER_S of calls). A
    connection lost later fails every unanswered call SERVER_UNAVAILABLE (its outcome
    unknown: the producer resends, and its sequence numbers make a resend of a written
    batch harmless). An answer not come LATE_ANSWER_S after its call's deadline fails
    the unanswered calls REQUEST_TIMED_OUT and closes the connection."""

    def __init__(self, address: str, server_address: str, tls, token, links: Links):
        host, _, port = address.rpartition(":")
        self.address = address
        self._target = (host.strip("[]"), int(port))
        self._tls = tls
        self._server_hostname = tls.server_hostname(server_address) if tls is not None else ""
        self._token = token
        self._links = links
        self._sending = threading.Lock()  # one start() at a time: sends in `_pending` order
        self._wire = threading.Lock()  # the socket's reads and writes
        self._state = threading.Condition(threading.Lock())  # what follows
        self._sock: socket.socket | None = None
        self._answered = False  # whether the connection answered anything yet
        self._pending: collections.deque = collections.deque()  # (future, number, deadline)
        self.connects = 0
        self.most_unanswered = 0  # the most calls unanswered at once (tests, benchmarks)
        self.down_until = 0.0
        self._closed = False

    def start(self, method: str, request: bytes, timeout_s: float) -> concurrent.futures.Future:
        """Sends `method` (serialized `request`); its future: the response, or raises the
        grpc.RpcError a failed gRPC call would raise. Raises LinkUnavailable (nothing
        sent: send it over gRPC)."""
        number = _NUMBERS[method]
        token = self._token.token.encode() if self._token is not None else b""
        head = call_head(number, timeout_s, token, len(request))
        if len(head) + len(request) > MAX_CALL_BYTES:
            raise LinkUnavailable(f"a {len(request)}-byte call is more than the link takes")
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        with self._sending:
            while True:
                with self._state:
                    if time.monotonic() < self.down_until or self._closed:
                        raise LinkUnavailable(f"{self.address}: not tried again yet")
                    while len(self._pending) >= MAX_PIPELINED and self._sock is not None:
                        self._state.wait()
                    sock = self._sock
                    if sock is not None:  # (queued with it: the reader keeps it open)
                        self._pending.append((future, number, time.monotonic() + timeout_s))
                        self.most_unanswered = max(self.most_unanswered, len(self._pending))
                        self._state.notify_all()
                        break
                sock = self._connect(timeout_s)  # only a sender connects (LinkUnavailable)
                with self._state:
                    if self._closed:
                        _shut(sock)
                        raise LinkUnavailable(f"{self.address}: closed")
                    self._sock, self._answered = sock, False
                threading.Thread(target=self._read, args=(sock,), daemon=True,
                                 name="atomlog-link-pipeline").start()
            try:
                with self._wire:
                    sock.settimeout(max(0.001, timeout_s))
                    if len(request) <= JOIN_BYTES:
                        sock.sendall(head + request)
                    else:
                        sock.sendall(head)
                        sock.sendall(request)
            except OSError as error:  # (this call's future fails with the others)
                self._lost(sock, error)
        return future

    def _connect(self, timeout_s: float) -> socket.socket:
        self.connects += 1
        try:
            return connect_blocking(self._target, timeout_s, self._tls, self._server_hostname,
                                    magic=MAGIC_PIPELINED)
        except (OSError, ValueError) as error:  # ssl.SSLError is an OSError
            self._down()
            raise LinkUnavailable(f"{self.address}: {error}") from None

    def _read(self, sock: socket.socket) -> None:
        """The reader thread of connection `sock`: its answers, in order, until it is
        lost or replaced, or idle for IDLE_S (then it closes it)."""
        while True:
            with self._state:
                while not self._pending and self._sock is sock:
                    if not self._state.wait(IDLE_S) and not self._pending \
                            and self._sock is sock:
                        self._sock = None
                        _shut(sock)
                        return
                if self._sock is not sock:
                    return
                _, number, deadline = self._pending[0]
            try:
                kind, payload = self._answer(sock, deadline)
            except (OSError, ValueError) as error:  # LinkProtocolError, TimeoutError too
                self._lost(sock, error)
                return
            with self._state:
                if self._sock is not sock:
                    return  # (its calls were failed with it)
                future, number, _ = self._pending.popleft()
                self._answered = True
                self._state.notify_all()
            self._links.calls += 1
            if kind == KIND_ERROR:
                future.set_exception(local.rpc_error(
                    from_item(partition_pb2.ItemError.FromString(payload))))
                continue
            try:
                response = CALL_METHODS[number].response_type.FromString(payload)
            except Exception as error:  # noqa: BLE001 — a garbled answer: lost, as others
                future.set_exception(_unavailable(CALL_METHODS[number].name, self.address,
                                                  error))
                self._lost(sock, error)
                return
            future.set_result(response)

    def _answer(self, sock: socket.socket, deadline: float) -> tuple[int, bytearray]:
        """The next answer frame, read once the socket is readable (a TLS socket's
        decrypted bytes count), by `deadline` + LATE_ANSWER_S (else TimeoutError)."""
        wait_s = deadline + LATE_ANSWER_S - time.monotonic()
        pending = getattr(sock, "pending", None)
        if not (pending is not None and pending()) and not _readable(sock, max(0.0, wait_s)):
            raise TimeoutError(f"no answer {LATE_ANSWER_S} s after the call's deadline")
        with self._wire:
            sock.settimeout(max(1.0, wait_s))
            return read_answer(sock, MAX_CALL_BYTES)

    def _lost(self, sock: socket.socket, error: BaseException) -> None:
        """The connection `sock` is gone: every unanswered call fails (outcome unknown)."""
        with self._state:
            if self._sock is not sock:
                return
            self._sock = None
            failed, self._pending = list(self._pending), collections.deque()
            never_answered = not self._answered
            self._state.notify_all()
        _shut(sock)  # (wakes its reader, if waiting on it)
        if never_answered and not self._closed:
            self._down()  # (a server from before pipelining: gRPC for a while)
        for future, number, _ in failed:
            method = CALL_METHODS[number].name
            if isinstance(error, TimeoutError):
                future.set_exception(local.rpc_error(AtomlogError(
                    "REQUEST_TIMED_OUT", f"{method} to {self.address} (link) took longer "
                    "than its deadline")))
            else:
                future.set_exception(_unavailable(method, self.address, error))

    def _down(self) -> None:
        self.down_until = time.monotonic() + RETRY_LINK_AFTER_S
        self._links.fallbacks += 1

    def close(self) -> None:
        with self._state:
            self._closed = True
            sock = self._sock
        if sock is not None:
            self._lost(sock, ConnectionError("the client closed"))

    def forget(self) -> None:
        """In a forked child: the parent's connection and reader thread are not ours
        (the descriptor is closed, the connection left to the parent), nor its calls."""
        self._sending, self._wire = threading.Lock(), threading.Lock()
        self._state = threading.Condition(threading.Lock())
        sock, self._sock = self._sock, None
        self._pending = collections.deque()
        if sock is not None:
            sock.close()  # (no shutdown: that would end the parent's connection too)


def _shut(sock: socket.socket) -> None:
    """Closes a connection another thread may be waiting on (shutdown wakes it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _unavailable(method: str, address: str, error: BaseException):
    return local.rpc_error(AtomlogError(
        "SERVER_UNAVAILABLE", f"{method} to {address} (link): {type(error).__name__}: "
        f"{error}", {"retry_after_ms": "50"}))


def partition_call(client, address: str, method: str):
    """(call(request, timeout=...), whether it is a gRPC stub's): `method` on the
    partition server at `address`, on its link when it advertises one and the link
    carries the method (a link that cannot be reached sends it over gRPC), else over
    gRPC. Not a gRPC stub's: a future of it comes from client.links.submit."""
    over_grpc = getattr(client.channels.partition(address), method)
    on_link = (client.links.get(address, client.metadata.partition_links.get(address, ""))
               if method in PARTITION_METHODS else None)
    if on_link is None:
        return over_grpc, True

    def call(request, timeout: float):
        try:
            return on_link.call(method, request, timeout)
        except LinkUnavailable:
            return over_grpc(request, timeout=timeout)
    return call, False


class Deferred:
    """A call made when its result is asked for, on the asking thread, as a blocking
    call (its result() raises what the future's would): a gRPC future on an idle channel
    starts a thread to drive it, and a link's would hold one of the links' threads
    (a long poll, for its whole wait)."""

    __slots__ = ("_call", "_request", "_timeout_s")

    def __init__(self, call, request, timeout_s: float):
        self._call, self._request, self._timeout_s = call, request, timeout_s

    def result(self):
        return self._call(self._request, timeout=self._timeout_s)

    def cancel(self) -> bool:
        return True  # never started: nothing to stop


ANSWER_BUFFER_BYTES = 16 << 10  # a kept plain connection's answers up to this: one recv(2)
_TIMEVAL = struct.Struct("@ll")  # SO_RCVTIMEO's and SO_SNDTIMEO's struct timeval


class _Connection:
    """A ServerLink's connection and what a call on it reuses: a poll(2) object for the
    check before a call, and for a plain (not TLS) socket the buffer answers are read
    into and the kernel's timeout. A plain socket is blocking, its timeout
    SO_RCVTIMEO/SO_SNDTIMEO (`bound`): Python's own timeout polled before every send
    and recv, and set the socket's mode with an ioctl on every call, three to four
    system calls more a call (14 µs of a client's CPU a call against a do-nothing link
    server here, 2026-12-07)."""

    __slots__ = ("sock", "used", "buffer", "poller", "_bound_s", "deadline")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.used = 0.0
        self.poller = _poller(sock)  # (ServerLink._take polls it with _readable)
        plain = type(sock) is socket.socket
        self.buffer = bytearray(ANSWER_BUFFER_BYTES) if plain else None
        self._bound_s = 0.0
        self.deadline = 0.0  # the call's under way (time.monotonic()): `more`
        if plain:
            sock.settimeout(None)

    def bound(self, timeout_s: float) -> None:
        """Each send and recv of the next call gives up after at least `timeout_s` and
        at most a quarter more (the kernel's timeout, per system call; `more` bounds the
        later ones of a call by what is left of it, so an answer that trickles in ends
        the call by then too; a signal restarts a system call with the whole timeout).
        Set again only when the call asks for longer than the last one set, or for less
        than four fifths of it (a transaction's calls ask for what is left of its time, a
        little less each call; a long poll asks for more)."""
        timeout_s = max(0.001, timeout_s)
        if self._bound_s < timeout_s or self._bound_s > 1.25 * timeout_s:
            value = _TIMEVAL.pack(int(timeout_s), int(timeout_s % 1 * 1_000_000))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
            self._bound_s = timeout_s

    def more(self) -> None:
        """Before each send or recv of a call but its first (link_wire.send_frame,
        read_answer_into): the call's time left bounds it, so an answer that trickles in
        (or a request the server takes slowly) ends the call near its deadline, not a
        timeout later per piece. TimeoutError once it is past."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's time ran out while its answer came in pieces")
        if self.buffer is None:
            self.sock.settimeout(left)
        else:
            self.bound(left)

    def readable(self) -> bool:
        """_readable(sock) with the poll object kept: one poll(2)."""
        return _readable(self.sock, poller=self.poller)


def _poller(sock: socket.socket) -> select.poll:
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return poller


def _readable(sock: socket.socket, wait_s: float = 0.0,
              poller: select.poll | None = None) -> bool:
    """Whether a connection has something to read (an idle one: its EOF or an RST,
    since no call is under way on it), waiting up to `wait_s`; `poller`: one made for
    it already (`_poller`). poll(2), not select(2): a process with more than 1,024
    descriptors (an executor) has sockets select cannot watch."""
    try:
        return bool((poller or _poller(sock)).poll(int(wait_s * 1000)))
    except (OSError, ValueError):
        return True


_ALL: "weakref.WeakSet[Links]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for links in list(_ALL):
        links._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
