"""The SDK's calls on the servers' links (docs/clients.md, "The link").

A server with a link advertises it (ServerInfo.link_address in the metadata): the
length-prefixed TCP protocol its partition servers' followers and coordinators already
speak (services/link_wire.py), beside its gRPC port. A coordinator has one when
coordinator.client_link is on; a partition server always has one (its followers copy
over it). The SDK sends there its calls to coordinators (CommitTxn, CommitTxns, and the
streaming path's NewTxn ... EndTxn) and its consumers' calls to partition servers
(Fetch; a subscription's Receive, Ack, Nack): link_wire.CALL_METHODS. A gRPC call costs
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
MAX_CONNECTIONS per server (a call beyond that goes over gRPC). Calls that must go at
once run on the client's link threads (Links.submit); a long poll runs on its caller's
thread (Deferred). A forked child drops its parent's connections (they are the parent's
streams) and its link threads.
"""

from __future__ import annotations

import concurrent.futures
import os
import select
import socket
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
    MAX_CALL_BYTES,
    call_frame,
    connect_blocking,
    read_answer,
)

# The SDK's calls a link carries, by name: to coordinators, and to partition servers.
METHODS = frozenset(name for service, name in CALL_NUMBERS if service == "CoordinatorService")
PARTITION_METHODS = frozenset({"Fetch", "Receive", "Ack", "Nack"})
_NUMBERS = {name: number for (_, name), number in CALL_NUMBERS.items()
            if name in METHODS | PARTITION_METHODS}
MAX_CONNECTIONS = 16  # per server; more calls at once go over gRPC
MAX_THREADS = 32  # Links.submit's: link calls made at once (a thread each, made when needed)
IDLE_S = 60.0  # a kept connection unused this long is closed (the server's idle limit: 120 s)
RETRY_LINK_AFTER_S = 10.0  # after a link could not be reached, gRPC for this long


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
        if not self.enabled or not link_address:
            return None
        link = self._links.get(grpc_address)
        if link is not None and link.address == link_address:
            return link
        with self._lock:
            link = self._links.get(grpc_address)
            if link is None or link.address != link_address:
                if link is not None:
                    link.close()
                link = self._links[grpc_address] = ServerLink(
                    link_address, grpc_address, self._tls, self._token, self)
            return link

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)  # calls under way end alone
        for link in links:
            link.close()

    def _forget_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._executor = None  # its threads are the parent's
        for link in self._links.values():
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
        self._idle: list[tuple[socket.socket, float]] = []  # (socket, when last used)
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
        sock, fresh = self._take(timeout_s)
        kept = False
        try:
            sock.settimeout(max(0.001, timeout_s))
            sock.sendall(frame)
            kind, payload = read_answer(sock, MAX_CALL_BYTES)
            kept = True
        except (socket.timeout, TimeoutError):
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
            self._give_back(sock, kept)
        self._links.calls += 1
        if kind == KIND_ERROR:
            raise local.rpc_error(from_item(partition_pb2.ItemError.FromString(payload)))
        return CALL_METHODS[number].response_type.FromString(payload)

    def _take(self, timeout_s: float) -> tuple[socket.socket, bool]:
        """A kept connection (False) or a new one (True). A kept one the server closed
        meanwhile (readable while no call is under way: its EOF), or idle too long, is
        closed here instead of failing a call."""
        now = time.monotonic()
        with self._lock:
            while self._idle:
                sock, used = self._idle.pop()
                if now - used < IDLE_S and not _readable(sock):
                    return sock, False
                self._open -= 1
                sock.close()
            if self._open >= MAX_CONNECTIONS:
                raise LinkUnavailable(f"{self.address}: {MAX_CONNECTIONS} calls under way")
            self._open += 1
        try:
            return self._connect(timeout_s), True
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

    def _give_back(self, sock: socket.socket, kept: bool) -> None:
        with self._lock:
            if kept and not self._closed:
                self._idle.append((sock, time.monotonic()))
                return
            self._open -= 1
        sock.close()

    def _down(self, error: BaseException) -> None:
        self.down_until = time.monotonic() + RETRY_LINK_AFTER_S
        self._links.fallbacks += 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for sock, _ in idle:
            sock.close()

    def forget(self) -> None:
        """In a forked child: the kept connections are the parent's streams. Closing our
        copies of their descriptors (close(2), no shutdown and no TLS close_notify) leaves
        the parent's connections up; the child opens its own."""
        self._lock = threading.Lock()
        idle, self._idle = self._idle, []
        self._open = 0
        for sock, _ in idle:
            sock.close()


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


def _readable(sock: socket.socket) -> bool:
    """Whether an idle connection has something to read: its EOF (or an RST), since no
    call is under way on it. poll(2), not select(2): a process with more than 1,024
    descriptors (an executor) has sockets select cannot watch."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


_ALL: "weakref.WeakSet[Links]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for links in list(_ALL):
        links._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
