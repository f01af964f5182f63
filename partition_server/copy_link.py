"""A server's link (docs/replication.md, "The replication link"; docs/coordinator.md,
"The partition servers' links" and "The clients' link"): a plain length-prefixed TCP
connection beside its gRPC port. A partition server's carries followers' ReplicateMany
calls and coordinators' StageTxn, TC-log Produce and EndTxnOnPartition calls; a
coordinator's carries clients' transaction calls (CommitTxn, NewTxn, EndTxn, ...:
spark_client/link.py); a
combined server has one link for both.

Why: through gRPC (HTTP/2 frames, its C core's threads, its Cython callbacks and copies on
both sides) a follower's round costs 1.1-1.2 ms of CPU per MB over the two processes on
this machine, against 0.5-0.6 ms over this link (`bench/copy_link.py`); and a
coordinator's small call costs about 0.65 ms of CPU over the two processes as a unary
gRPC call (docs/grpc-links.md), several times what it costs here. A small one-call
transaction on the cluster makes about three such calls (`bench/transactions.py`).

What travels is what travels on gRPC. ReplicateMany: a `ReplicateManyRequest` and the
leader's answer bytes exactly as its gRPC serializer writes them
(`replicate_wire.serialize_many`, the records spliced in), parsed by the same
`parse_many`. A call: the method's request and response messages. The server answers
with the servicer method of whichever service of its process registered for it
(`LinkServer.serve`: a coordinator's transaction calls from the SDK, spark_client/link.py,
on a coordinator's or a combined server's link), after the same
authentication (the caller's bearer token, as `authorization` metadata would carry it)
and the same ACL check as the gRPC interceptor applies to the method, so nothing is
reachable on the link that is not reachable, for the same caller, on gRPC.

The wire format: services/link_wire.py. One request is outstanding per connection at a
time (a follower's fetcher makes one call at a time per leader; a coordinator keeps a few
connections per server, `CallLink`; the SDK a few per coordinator); the server answers in
order. A pipelined connection (`MAGIC_PIPELINED`: the SDK producers' Produce calls) has
up to MAX_PIPELINED calls under way at once, started in the order their frames arrive
and answered in that order. The server parses frames as their bytes arrive, a protocol
per connection (`_ServedConnection`), and answers on its transport.

Limits: a ReplicateMany frame of at most `MAX_REQUEST_BYTES` and a call frame of at most
`MAX_CALL_BYTES` (else the connection is closed), at most `MAX_HELD_BYTES` of frames read
and being answered at once over all connections, at most `MAX_CONNECTIONS` connections
per server (more are closed at once), a connection idle for `IDLE_TIMEOUT_S`, or as slow
to send a frame it announced or to take its answers, is closed (a follower's long polls
keep it busy), and the follower refuses an answer frame larger than its `max_bytes`
allows.

TLS: a server with tls.enabled serves its link over TLS with the certificate, CA and
client-certificate rule of its gRPC port (`services.tls.ServerTls.ssl_context`, reloaded
as the gRPC port's are), and its followers and coordinators connect with their channels'
TLS (`services.tls.ChannelTls.ssl_context`: the server's certificate checked against the
host of its gRPC address). Under mTLS the client certificate authenticates each frame as
it authenticates a gRPC call: the frames' tokens are empty and the principal comes from
the certificate (`_peer_auth_context`, in the shape grpc's auth_context has). The link
never falls back to plaintext: a handshake that fails is a connection that cannot be made.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import logging
import socket
import ssl
import time

import grpc

from atomlog.v1 import partition_pb2
from partition_server.replicate_wire import ReplicateManyAnswer, parse_many, serialize_many
from services import auth, interceptors, local
from services.fastmetrics import Counter, Histogram
from services.link_wire import (
    CALL_HEAD,
    CALL_METHODS,
    CALL_NUMBERS,
    HANDSHAKE_TIMEOUT_S,
    HEAD,
    KIND_ANSWER,
    KIND_CALL,
    KIND_ERROR,
    KIND_REQUEST,
    MAGIC,
    MAGIC_PIPELINED,
    MAX_CALL_BYTES,
    MAX_PIPELINED,
    TOKEN_LEN,
    LinkProtocolError,
    answer_head,
    call_frame,
    connect_blocking,
    read_answer,
)
from services.errors import AtomlogError, from_item, from_rpc_error, unexpected
from services.metrics import LATENCY_BUCKETS_SECONDS
from services.logs import event

log = logging.getLogger("atomlog.partition.link")

METHOD = "/atomlog.v1.PartitionService/ReplicateMany"
MAX_REQUEST_BYTES = 1 << 20
# The request frames a link reads and answers at once, over all its connections: a frame
# that would pass it closes its connection (the caller's outcome is unknown; it retries).
MAX_HELD_BYTES = 256 << 20
# Per server: a coordinator's link takes every client process's commits (the SDK keeps up
# to 16 connections per coordinator; more are sent over gRPC).
MAX_CONNECTIONS = 1024
IDLE_TIMEOUT_S = 120.0
# An answer at most this large leaves in one write with its head (a larger one, a
# follower's records, in two, not copied once more to join them).
JOIN_BYTES = 256 << 10
# After a failed connect, a follower uses gRPC for this long before trying the link again.
RETRY_LINK_AFTER_S = 10.0
# A call past its deadline ends within this much more, on either side (LinkServer._sweep
# and CallLink._sweep: one timer per link while calls are under way, not one per call).
CALL_SWEEP_S = 0.025
# Room beside the records in an answer frame (positions, epochs, cursor state headers).
ANSWER_OVERHEAD_BYTES = 1 << 20

LINK_REQUESTS = Counter("atomlog_replication_link_requests_total",
                        "ReplicateMany requests this server answered as a leader on its "
                        "replication link, by outcome (ok or the error reason).", ["outcome"])
LINK_SECONDS = Histogram("atomlog_replication_link_request_duration_seconds",
                         "Time a leader took to answer a ReplicateMany request on its "
                         "replication link (a long poll waits up to replication.fetch_wait_ms).",
                         buckets=LATENCY_BUCKETS_SECONDS)
LINK_CALLS = Counter("atomlog_link_calls_total",
                     "Calls this server took on its link instead of gRPC, by method: a "
                     "partition server's from coordinators (StageTxn, TC-log Produce, "
                     "EndTxnOnPartition) and from clients (Produce, Fetch, Receive, Ack, "
                     "Nack), a coordinator's from clients (CommitTxn, NewTxn, EndTxn, "
                     "...); those authenticated are also counted in "
                     "atomlog_rpc_started_total, as gRPC calls are.", ["method"])
LINK_FALLBACKS = Counter("atomlog_replication_link_fallbacks_total",
                         "ReplicateMany calls this server sent as a follower over gRPC because "
                         "its leader's replication link could not be reached.")


# ----------------------------------------------------------------------------- leader side
class LinkServer:
    """A server's link: answers ReplicateMany and call frames with the servicers of its
    process that registered (`serve`): a partition server's, a coordinator's, or both in
    a combined server. Each call is checked as `interceptor` (services/interceptors.py)
    checks gRPC calls: its authenticator and, when set, its authorizer (read at each
    request: the runtime sets them at start). Over TLS when `ssl_context` is given (the
    gRPC port's, module doc). Each connection is a `_ServedConnection` (an
    asyncio.Protocol: frames parsed as their bytes arrive, answers written to its
    transport); one timer for the link closes the idle ones (`_watch`)."""

    def __init__(self, interceptor, host: str, port: int,
                 ssl_context: ssl.SSLContext | None = None):
        self.servicers: dict[str, object] = {}  # by service name (link_wire.CallMethod)
        self.interceptor = interceptor
        self.host, self.port = host, port
        self.ssl_context = ssl_context
        self._server: asyncio.AbstractServer | None = None
        # The connections served: from their start until closed with no call under way.
        self._connections: set[_ServedConnection] = set()
        self._held_bytes = 0  # request frames being read or answered, over every connection
        # Calls under way with a deadline, by the task running each (`_call`), the ones
        # `_sweep` cancelled for passing it, and the sweep's timer while there are any.
        self._deadlines: dict[asyncio.Task, float] = {}
        self._expired: set[asyncio.Task] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._watcher: asyncio.TimerHandle | None = None  # the idle bound's (`_watch`)
        self._all_ended: asyncio.Future | None = None  # close(): the last connection ended

    def serve(self, service: str, servicer) -> None:
        """The link answers `service`'s methods in CALL_METHODS (and, for the
        PartitionService, ReplicateMany) with `servicer`; a call of a service nobody
        registered is answered UNIMPLEMENTED."""
        self.servicers[service] = servicer

    async def start(self) -> int:
        """Listens; returns the bound port."""
        tls = {} if self.ssl_context is None else {
            "ssl": self.ssl_context, "ssl_handshake_timeout": HANDSHAKE_TIMEOUT_S}
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServedConnection(self),
                                                self.host, self.port, **tls)
        self._watcher = loop.call_later(IDLE_TIMEOUT_S / 4, self._watch)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and end every connection: one of a call at a time at once (its
        call under way cancelled, unanswered), a pipelined one once its calls under way
        have ended and been answered (no more frames read); waits up to 5 s for them."""
        # (The deadlines' sweep goes on: a pipelined connection's calls are left to end,
        # and still end at their deadline; it stops once none is under way.)
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.shut()
        if self._connections:
            self._all_ended = asyncio.get_running_loop().create_future()
            await asyncio.wait([self._all_ended], timeout=5)
        if self._server is not None:
            await self._server.wait_closed()

    def _ended(self, connection: _ServedConnection) -> None:
        """`connection` is closed and has no call under way."""
        self._connections.discard(connection)
        if not self._connections and self._all_ended is not None \
                and not self._all_ended.done():
            self._all_ended.set_result(None)

    def _watch(self) -> None:
        """Every quarter of IDLE_TIMEOUT_S: close the connections whose read has waited
        longer than it (idle, or as slow to send a frame it announced) and those whose
        peer has not taken its answers for as long (`_ServedConnection.check`). One timer
        for the link, not one per read; a connection is closed within a quarter of the
        bound more."""
        self._watcher = None
        loop = asyncio.get_running_loop()
        now, bound_s = time.monotonic(), IDLE_TIMEOUT_S
        for connection in list(self._connections):
            connection.check(now, bound_s)
        if self._connections or self._server is not None and self._server.is_serving():
            self._watcher = loop.call_later(bound_s / 4, self._watch)

    async def _answer(self, body: bytes, peer: str, auth_context: dict,
                      reader: _ServedConnection | None = None) -> tuple[int, bytes]:
        """One request frame's answer: (kind, payload). Every failure is an error frame, as
        the gRPC interceptor makes every failure a status."""
        started = time.perf_counter()
        outcome = "ok"
        try:
            if len(body) < TOKEN_LEN.size:
                raise AtomlogError("INVALID_ARGUMENT", "the request frame has no token length")
            (token_length,) = TOKEN_LEN.unpack_from(body)
            token_end = TOKEN_LEN.size + token_length
            if token_end > len(body):
                raise AtomlogError("INVALID_ARGUMENT", "the request's token runs past its frame")
            token = body[TOKEN_LEN.size:token_end].decode("utf-8", "replace")
            try:
                request = partition_pb2.ReplicateManyRequest.FromString(body[token_end:])
            except Exception:  # noqa: BLE001 — any parse failure is the caller's
                raise AtomlogError("INVALID_ARGUMENT",
                                   "the request is not a ReplicateManyRequest") from None
            principal = self._authenticate(token, peer, auth_context)
            token_var = auth.set_current(principal)
            try:
                authorizer = self.interceptor.authorizer
                if authorizer is not None:
                    authorizer.check(METHOD, request, principal)
                servicer = self.servicers.get("PartitionService")
                if servicer is None:
                    raise AtomlogError("UNIMPLEMENTED", "this server's link copies no "
                                       "partitions (it is no partition server)")
                answer = await servicer.ReplicateMany(request, None)
                if authorizer is not None:
                    authorizer.answered(METHOD, request, answer, principal)
            finally:
                auth.reset_current(token_var)
            return KIND_ANSWER, serialize_many(answer)
        except AtomlogError as error:
            outcome = error.reason
            return KIND_ERROR, _error_bytes(error)
        except Exception as unhandled:  # noqa: BLE001 — a bug (logged), or ZooKeeper gone
            error = unexpected(unhandled, f"{METHOD} (replication link)")
            if error.reason == "INTERNAL":
                log.exception("unhandled error on the replication link")
            outcome = error.reason
            return KIND_ERROR, _error_bytes(error)
        finally:
            LINK_REQUESTS.labels(outcome).inc()
            LINK_SECONDS.observe(time.perf_counter() - started)

    async def _call(self, body: bytes, peer: str, auth_context: dict,
                    reader: _ServedConnection | None = None) -> tuple[int, bytes]:
        """A call frame (kind 3): method number, timeout, token, request. It
        runs as a gRPC call of the method runs: through the gRPC interceptor's wrapper
        (authenticated, checked by the ACLs, counted and timed; services/interceptors.py)
        with the caller's deadline; a refusal it gives `context.abort` becomes an error
        frame, as a malformed frame does."""
        try:
            if len(body) < CALL_HEAD.size:
                raise AtomlogError("INVALID_ARGUMENT", "the call frame is shorter than its head")
            number, timeout_ms, token_length = CALL_HEAD.unpack_from(body)
            method = CALL_METHODS.get(number)
            if method is None:
                raise AtomlogError("UNIMPLEMENTED", f"no method {number} on the link")
            servicer = self.servicers.get(method.service)
            if servicer is None:
                raise AtomlogError("UNIMPLEMENTED", f"{method.full_name} is not served on "
                                   f"this server's link (it runs no {method.service})")
            request_type, full_name = method.request_type, method.full_name
            token_end = CALL_HEAD.size + token_length
            if token_end > len(body):
                raise AtomlogError("INVALID_ARGUMENT", "the call's token runs past its frame")
            token = body[CALL_HEAD.size:token_end].decode("utf-8", "replace")
            try:
                request = request_type.FromString(body[token_end:])
            except Exception:  # noqa: BLE001 — any parse failure is the caller's
                raise AtomlogError("INVALID_ARGUMENT",
                                   f"the request is not a {request_type.__name__}") from None
        except AtomlogError as error:
            return KIND_ERROR, _error_bytes(error)
        LINK_CALLS.labels(full_name).inc()
        timeout_s = timeout_ms / 1000 if timeout_ms else None
        task = asyncio.current_task()
        cancelling = task.cancelling()
        if timeout_s is not None:  # (`_sweep` cancels the call at its deadline)
            loop = asyncio.get_running_loop()
            self._deadlines[task] = loop.time() + timeout_s
            if self._sweeper is None:
                self._sweeper = loop.call_later(CALL_SWEEP_S, self._sweep)
        try:
            handler = self.interceptor.wrapped(full_name, getattr(servicer, method.name))
            answer = await handler(request, _CallContext(token, peer, timeout_s,
                                                         auth_context, reader))
            return KIND_ANSWER, answer.SerializeToString()
        except asyncio.CancelledError:
            # Its deadline passed (and nothing else cancelled the task meanwhile, as
            # asyncio.timeout has it): an error frame; else the cancellation goes on.
            if task in self._expired:
                self._expired.discard(task)
                if task.uncancel() <= cancelling:
                    return KIND_ERROR, _error_bytes(AtomlogError(
                        "REQUEST_TIMED_OUT",
                        f"{full_name} (link) took longer than its deadline"))
            raise
        except _Aborted as aborted:
            return KIND_ERROR, _error_bytes(from_rpc_error(aborted))
        except AtomlogError as error:
            return KIND_ERROR, _error_bytes(error)
        except Exception as unhandled:  # noqa: BLE001 — a bug: an error frame, as on gRPC
            # (Escaping, it ended a pipelined connection's answers: every later call on
            # it went unanswered, and frames read meanwhile held their bytes for good.)
            error = unexpected(unhandled, f"{full_name} (link)")
            if error.reason == "INTERNAL":
                log.exception("unhandled error in a call on the link")
            return KIND_ERROR, _error_bytes(error)
        finally:
            if timeout_s is not None:
                self._deadlines.pop(task, None)
                if task in self._expired:  # (the handler made its cancellation something
                    self._expired.discard(task)  # else: the task's count made right, as
                    task.uncancel()  # asyncio.timeout does whenever it expired)

    def _sweep(self) -> None:
        """Cancel the calls past their deadline (`_call` answers them
        REQUEST_TIMED_OUT), every CALL_SWEEP_S while calls with one are under way: one
        timer for the link, not an asyncio.timeout (its timer in the loop's heap, and
        the heap's comparisons to take it out) a call."""
        self._sweeper = None
        if not self._deadlines:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for task, deadline in list(self._deadlines.items()):
            if deadline <= now and task not in self._expired:
                self._expired.add(task)
                task.cancel()
        self._sweeper = loop.call_later(CALL_SWEEP_S, self._sweep)

    def _authenticate(self, token: str, peer: str, auth_context: dict) -> auth.Principal:
        """As the gRPC interceptor authenticates a call: the token as its `authorization`
        metadata would carry it, the client certificate (under mTLS) as its auth_context."""
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        return interceptors.principal_of(self.interceptor.authenticator, METHOD, metadata,
                                         auth_context, peer)


async def serve_on_link(runtime, service: str, servicer, listen_key: str,
                        advertised_port_key: str) -> str:
    """`servicer` answers `service`'s calls on this process's link, which the first role
    to serve on it opens (listening at config[listen_key], over TLS when the gRPC port is:
    the same certificate, CA and client-certificate rule) and the runtime closes at stop.
    A combined server has one link for its partition server and its coordinator. Returns
    the link's advertised address, for the role's registration."""
    state = runtime.link_state
    if "server" not in state:
        config = runtime.config
        listen = config[listen_key] or f"{config['server.listen'].rsplit(':', 1)[0]}:0"
        host, port = listen.rsplit(":", 1)
        link = LinkServer(runtime.interceptor, host.strip("[]"), int(port),
                          runtime.server_tls.ssl_context() if runtime.server_tls else None)
        try:
            bound = await link.start()
        except OSError as error:
            raise AtomlogError("INVALID_ARGUMENT",
                               f"cannot listen on {listen} ({listen_key}): {error}") from None
        runtime.stop_hooks.append(link.close)
        advertised = config["server.advertised_host"] or host
        state["server"] = link
        state["address"] = f"{advertised}:{config[advertised_port_key] or bound}"
    state["server"].serve(service, servicer)
    return state["address"]


def _peer_auth_context(transport: asyncio.BaseTransport) -> dict:
    """The TLS peer's certificate as grpc's `ServicerContext.auth_context()` gives it
    (what services.auth reads: its PEM and its common names), or {} without TLS or
    without a client certificate."""
    ssl_object = transport.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        return {}
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    names = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(
        NameOID.COMMON_NAME)
    return {"transport_security_type": [b"ssl"],
            "x509_pem_cert": [ssl.DER_cert_to_PEM_cert(der).encode()],
            "x509_common_name": [str(name.value).encode() for name in names]}


class _Aborted(Exception):
    """A call's refusal as the interceptor hands it to `context.abort`: the status code,
    details and trailing metadata `services.errors.from_rpc_error` reads back."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata):
        super().__init__(details)
        self._code, self._details, self._trailing = code, details, trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return self._trailing


class _CallContext(local.LocalContext):
    """The part of grpc.aio.ServicerContext the interceptor and our servicers use, for a
    call frame: its token as `authorization` metadata would carry it, its connection's
    client certificate (`_peer_auth_context`), its peer and deadline; `abort` raises
    `_Aborted`."""

    def __init__(self, token: str, peer: str, timeout_s: float | None, auth_context: dict,
                 reader: _ServedConnection | None = None):
        super().__init__(timeout_s)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._peer = peer
        self._auth_context = auth_context
        self._code: grpc.StatusCode | None = None
        self._reader = reader

    def cancelled(self) -> bool:
        """The caller hung up (its connection's end read): a long poll (Fetch, Receive)
        stops instead of leasing messages to a consumer that is gone until their ack
        timeout, as a cancelled gRPC call does."""
        return self._reader is not None and self._reader.at_eof()

    def invocation_metadata(self):
        return self._metadata

    def auth_context(self) -> dict:
        return self._auth_context

    def peer(self) -> str:
        return self._peer

    def code(self) -> grpc.StatusCode | None:
        return self._code

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        self._code = code
        raise _Aborted(code, details, trailing_metadata)


_CANCELLED, _BROKEN = object(), object()  # a call's outcome with no answer (`_run`)
# Bytes a connection reads past the frames it may start now (calls at its limit, its
# peer not taking answers): then it stops reading until it may. (A stream reader's
# default limit, 64 KiB, times four: a recv(2) takes up to 256 KiB.)
READ_AHEAD_BYTES = 256 << 10


class _ServedConnection(asyncio.Protocol):
    """One connection to a LinkServer, as a protocol: the magic, then request frames,
    parsed as their bytes arrive (`data_received`, `_parse`), each frame's call started
    the moment its last byte is in (`_run`: a task a call on a pipelined connection,
    made in frame order, so their first steps run in it and a producer's batches are
    queued on their partitions in the order it sent them; one task for all the calls of
    a connection of one call at a time) and its answer written to the transport when it
    and those before it are done (`_flush`). No stream reader, drain or per-read timer
    between (they cost about 40 Python-level calls a call, measured 2026-12-07).

    Bounds, as the stream-reading server had them: a connection after `MAGIC` has one
    call under way at a time, after `MAGIC_PIPELINED` up to MAX_PIPELINED; a frame
    beyond that, or arriving while the transport's write buffer is over its high-water
    mark (the peer is not taking its answers: `pause_writing`), waits in the buffer (at
    most READ_AHEAD_BYTES more read: then reading pauses). A frame's bytes are held
    (MAX_HELD_BYTES, over the link) from its head until its answer is written; one that
    would pass the bound waits for this connection's calls to be answered, and closes
    the connection when it would pass it alone. A frame out of its kind's bounds, or a
    wrong magic, ends the connection (LinkProtocolError, logged). An end of file, a
    protocol error or the link closing ends the reading (`_end`): the calls under way
    are answered, then the connection closes. `read_since` and `write_since` say since
    when the connection waits on its peer, for LinkServer._watch."""

    __slots__ = ("server", "transport", "peer", "auth_context", "_loop", "_context",
                 "_buffer", "_limit", "_head", "_pending", "_blocked", "_reading",
                 "_ending", "_closed", "_eof", "_lost", "read_since", "write_since",
                 "expired", "_runner", "_next")

    def __init__(self, server: LinkServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.auth_context: dict = {}
        self._loop = asyncio.get_running_loop()
        # What each call task starts from (a copy): not the context of the call whose
        # last step started it (a principal it set, services/interceptors.py).
        self._context = contextvars.copy_context()
        self._buffer = bytearray()  # received, not parsed yet
        self._limit = 0  # calls under way at once: 0 before the magic, then 1 or MAX_PIPELINED
        self._head: tuple[int, int] | None = None  # (length, kind) of the frame being read
        # [frame length, answer (None until the call ends), call task], in the order the
        # frames came, until answered.
        self._pending: collections.deque = collections.deque()
        self._blocked = False  # a frame waits for room (`_parse`)
        self._reading = True  # the transport reads (not paused)
        self._ending = False  # no more frames: answers of the calls under way, then closed
        self._closed = False  # the transport closed or lost: answers go nowhere
        self._eof = False
        self._lost = False
        # Since when (time.monotonic()) a read has waited for the peer's bytes, or the
        # peer has left answers untaken (the transport's buffer over its high-water
        # mark); None: it does not.
        self.read_since: float | None = None
        self.write_since: float | None = None
        self.expired = False  # closed by the idle bound: aborted, its answers dropped
        # A connection of one call at a time: the task that runs its calls (`_run`), and
        # the future through which `_parse` hands it the next one while it waits.
        self._runner: asyncio.Task | None = None
        self._next: asyncio.Future | None = None

    # ------------------------------------------------------------ the transport's calls
    def connection_made(self, transport) -> None:
        self.transport = transport
        server = self.server
        if len(server._connections) >= MAX_CONNECTIONS:
            self._ending = self._closed = True
            transport.close()
            return
        server._connections.add(self)
        try:
            peer = transport.get_extra_info("peername")
            self.peer = f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.auth_context = _peer_auth_context(transport)
        except Exception:  # noqa: BLE001 — a connection we cannot serve: closed, logged
            log.exception("a link connection could not be set up")
            self._end()
            return
        self.read_since = time.monotonic()

    def data_received(self, data: bytes) -> None:
        if self._ending:
            return
        buffer = self._buffer
        buffer += data
        if not self._blocked:
            self._parse()
        elif self._reading and len(buffer) > READ_AHEAD_BYTES:
            self._reading = False
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        if not self._ending and not self._blocked:
            self._parse()  # (it ends the reading: no whole frame is left)
        # Calls under way are still answered (over TLS the transport closes anyway).
        return self.server.ssl_context is None

    def connection_lost(self, error: BaseException | None) -> None:
        self._lost = True
        self._closed = True
        self._release_runner()
        self._end()

    def pause_writing(self) -> None:
        self.write_since = time.monotonic()

    def resume_writing(self) -> None:
        self.write_since = None
        if not self._closed:
            self._flush()

    # ---------------------------------------------------------------- frames and calls
    def _parse(self) -> None:
        """Start the calls of the whole frames in the buffer while the connection may
        (then `_blocked` until `_flush` answers one); the rest waits for more bytes."""
        buffer = self._buffer
        server = self.server
        self._blocked = False
        try:
            while True:
                head = self._head
                if head is None:
                    if not self._limit:
                        if len(buffer) < len(MAGIC):
                            break
                        self._magic(bytes(buffer[:len(MAGIC)]))
                        del buffer[:len(MAGIC)]
                        self.read_since = None
                        continue
                    pending = self._pending
                    if len(pending) >= self._limit or self.write_since is not None:
                        self._block()
                        return
                    if len(buffer) < HEAD.size:
                        break
                    length, kind = head = HEAD.unpack_from(buffer)
                    if kind not in (KIND_REQUEST, KIND_CALL) or not 0 < length - 1 <= (
                            MAX_CALL_BYTES if kind == KIND_CALL else MAX_REQUEST_BYTES):
                        raise LinkProtocolError(f"frame kind {kind}, {length} bytes")
                    if server._held_bytes + length > MAX_HELD_BYTES:
                        if pending:  # (it waits for this connection's calls' answers)
                            self._block()
                            return
                        raise LinkProtocolError(
                            f"a frame of {length} bytes while the link holds "
                            f"{server._held_bytes} (at most {MAX_HELD_BYTES})")
                    server._held_bytes += length  # (until its answer is written)
                    self._head = head
                    del buffer[:HEAD.size]
                    self.read_since = None
                length, kind = head
                if len(buffer) < length - 1:
                    break
                body = bytes(memoryview(buffer)[:length - 1])
                del buffer[:length - 1]
                self._head = None
                self.read_since = None
                entry = [length, None, None]
                self._pending.append(entry)
                answer = server._call if kind == KIND_CALL else server._answer
                call = answer(body, self.peer, self.auth_context, self)
                if self._runner is not None:  # (waiting on `_next`: pending was empty)
                    entry[2] = self._runner
                    self._next.set_result((entry, call))
                else:
                    entry[2] = self._loop.create_task(self._run(entry, call),
                                                      context=self._context.copy())
                    if self._limit == 1:
                        self._runner = entry[2]
        except LinkProtocolError as error:
            event(log, "replication link closed", logging.WARNING, peer=self.peer,
                  why=str(error))
            self._end()
            return
        if self._eof:  # (a frame cut short by the end: dropped, as any partial one)
            self._end()
            return
        if self.read_since is None:
            self.read_since = time.monotonic()
        if not self._reading:
            self._reading = True
            self.transport.resume_reading()

    def _magic(self, magic: bytes) -> None:
        if magic == MAGIC_PIPELINED:
            self._limit = MAX_PIPELINED
        elif magic == MAGIC:
            self._limit = 1
        else:
            raise LinkProtocolError(f"not a replication link client ({magic[:8]!r})")

    def _block(self) -> None:
        """The next frame waits (`_parse`): not idle meanwhile; reading goes on up to
        READ_AHEAD_BYTES (an end of file is seen: a long poll's `cancelled`)."""
        self._blocked = True
        self.read_since = None
        if self._reading and len(self._buffer) > READ_AHEAD_BYTES:
            self._reading = False
            self.transport.pause_reading()

    async def _run(self, entry: list, call) -> None:
        """A frame's call in a task (`_call` and `_answer` read it as theirs: a deadline
        cancels it): its answer into `entry`, then written in turn (`_flush`, in the
        task's step that ended the call: no done callback, no loop step more). On a
        pipelined connection a task a call; on a connection of one call at a time one
        task runs them all, each next one handed over through `_next` (a future a call,
        not a task a call: ~1-2 µs less, measured 2026-12-07), until the connection
        ends (`_release_runner` hands it None)."""
        while True:
            try:
                entry[1] = await call
            except asyncio.CancelledError:  # (the link closing; `shut`)
                entry[1] = _CANCELLED
            except Exception:  # noqa: BLE001 — a bug below `_call`'s own handling
                log.exception("unhandled error answering on the link")
                entry[1] = _BROKEN
            if self._runner is None or self._ending:
                self._flush()
                return
            handed = self._next = self._loop.create_future()  # (before `_flush` reads on)
            self._flush()
            handed = await handed
            if handed is None:
                return
            entry, call = handed

    def _flush(self) -> None:
        """Write the answers of the calls done, in the order of their frames, while the
        transport takes them (not over its high-water mark: as a drain would wait);
        release their frames' bytes; then read on (`_parse`), or close once ended."""
        pending = self._pending
        server = self.server
        while pending:
            length, answer, _task = pending[0]
            if answer is None or self.write_since is not None and not self._closed:
                break
            pending.popleft()
            server._held_bytes -= length
            if self._closed:
                continue  # (the connection is gone: the answer goes nowhere)
            if answer is _CANCELLED:
                if self._limit == 1:  # (its connection ends with it, unanswered)
                    self._close()
                    continue
                answer = KIND_ERROR, _error_bytes(AtomlogError(
                    "SHUTTING_DOWN", "the server is closing this connection"))
            elif answer is _BROKEN:  # (logged: the connection ends)
                self._close()
                continue
            _write_answer(self.transport, *answer)
        if self._closed:
            if not pending:
                self.server._ended(self)
        elif self._ending:
            if not pending:
                self._close()
        elif self._blocked:
            self._parse()

    # ------------------------------------------------------------------- its ending
    def at_eof(self) -> bool:
        """Whether the peer has hung up (an end of file with every frame before it
        read, or the connection lost): `_CallContext.cancelled`."""
        return self._eof and not self._buffer or self._lost

    def check(self, now: float, bound_s: float) -> None:
        """LinkServer._watch: a read waiting past `bound_s` ends the connection (its
        calls under way answered, then aborted); a peer not taking its answers for as
        long has it aborted at once (its answers dropped, its calls left to end)."""
        if self._closed:
            return
        if self.read_since is not None and now - self.read_since >= bound_s:
            self.expired = True
            self._end()
        elif self.write_since is not None and now - self.write_since >= bound_s:
            self.expired = True
            self._close()

    def shut(self) -> None:
        """The link closing: a connection of one call at a time closes now (its call
        under way cancelled, unanswered); a pipelined one reads no more frames and closes
        once its calls under way are answered (`_flush`)."""
        if self._limit > 1:
            self._end()
            return
        for _length, _answer, task in self._pending:
            task.cancel()
        self._end()
        self._close()

    def _release_runner(self) -> None:
        """The runner of a connection of one call at a time, waiting for a next call
        (`_run`), ends: there is none (its call under way, if any, ends first)."""
        if self._next is not None and not self._next.done():
            self._next.set_result(None)

    def _end(self) -> None:
        """No more frames: the partial one is dropped (its bytes released); the
        connection closes once its calls under way are answered."""
        self._ending = True
        self._blocked = False
        self.read_since = None
        self._buffer.clear()
        if self._head is not None:
            self.server._held_bytes -= self._head[0]
            self._head = None
        self._flush()  # (closed now when no call is under way)

    def _close(self) -> None:
        """Close the transport (abort it when the idle bound closed it: answers it never
        read are dropped, not kept to be sent); ended once no call is under way
        (`_flush`)."""
        if not self._closed:
            self._closed = True
            self._ending = True
            self.write_since = None
            self._release_runner()
            if self.expired:
                self.transport.abort()
            else:
                self.transport.close()
        self._flush()  # (the calls done meanwhile release their bytes; ended if none is left)


def _write_answer(transport: asyncio.WriteTransport, kind: int, payload: bytes) -> None:
    head = HEAD.pack(len(payload) + 1, kind)
    if len(payload) <= JOIN_BYTES:  # one send(2), one TCP segment
        transport.write(head + payload)
    else:  # a follower's large answer: not copied once more to join it
        transport.write(head)
        transport.write(payload)


def _error_bytes(error: AtomlogError) -> bytes:
    # (Here, not at the top: partition_server.service imports this module's users.)
    from partition_server.service import item_error
    return item_error(error).SerializeToString()


# --------------------------------------------------------------------------- follower side
class LinkClient:
    """A follower's link to one leader: one connection, one call at a time, its blocking
    socket driven by one thread of its own, on which the fetcher also runs its plain
    rounds (`submit`; replica.LeaderFetcher, "Rounds on the link's thread"). A call that
    fails to connect raises `LinkUnavailable` (the caller sends it over gRPC); any other
    transport failure drops the connection, and the next call opens a new one. Over TLS
    when `tls` (a services.tls.ChannelTls) is given: the leader's certificate must carry
    `tls.server_hostname(server_address)`, the host of its gRPC address (module doc)."""

    def __init__(self, address: str, token_source=None, tls=None, server_address: str = ""):
        host, _, port = address.rpartition(":")
        self.address = address
        self._target = (host.strip("[]"), int(port))
        self._token_source = token_source
        self._tls = tls
        self._server_hostname = tls.server_hostname(server_address or address) if tls else ""
        self._sock: socket.socket | None = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None  # made on first use
        self.down_until = 0.0  # monotonic: no link until then (a connect failed)
        self._closed = False
        self._cancels = 0  # calls ended by `cancel` (their connection dropped here)

    @property
    def usable(self) -> bool:
        return not self._closed and time.monotonic() >= self.down_until

    async def replicate_many(self, request: partition_pb2.ReplicateManyRequest,
                             timeout_s: float) -> ReplicateManyAnswer:
        """`exchange` on the link's thread (the event loop waits for the answer)."""
        return await asyncio.wrap_future(self.submit(self.exchange, request, timeout_s))

    def submit(self, function, *args) -> concurrent.futures.Future:
        """Runs `function(*args)` on the link's thread (made on first use), after whatever
        runs there now: a follower's rounds use the socket only from there."""
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"link {self.address}")
        return self._thread.submit(function, *args)

    def exchange(self, request: partition_pb2.ReplicateManyRequest,
                 timeout_s: float) -> ReplicateManyAnswer:
        """On the link's thread: one call, blocking. The leader's answer; raises
        AtomlogError (its error frame, or SERVER_UNAVAILABLE when the call failed on the
        way) or LinkUnavailable (no connection could be made: the caller sends the call
        over gRPC)."""
        token = self._token_source.token if self._token_source is not None else ""
        token_bytes = token.encode()
        frame = b"".join((HEAD.pack(1 + TOKEN_LEN.size + len(token_bytes) + request.ByteSize(),
                                     KIND_REQUEST), TOKEN_LEN.pack(len(token_bytes)),
                          token_bytes, request.SerializeToString()))
        limit = (request.max_bytes or (64 << 20)) + ANSWER_OVERHEAD_BYTES
        try:
            kind, payload = self._exchange(frame, timeout_s, limit)
        except LinkUnavailable:
            raise
        except OSError as error:  # on the way: the leader's unavailability, not the caller's
            raise AtomlogError("SERVER_UNAVAILABLE", f"replication link to {self.address}: "
                               f"{type(error).__name__}: {error}") from None
        if kind == KIND_ERROR:
            raise from_item(partition_pb2.ItemError.FromString(payload))
        return parse_many(payload)

    def cancel(self) -> None:
        """Ends the call under way, if any (its connection is dropped)."""
        sock = self._sock
        if sock is not None:
            self._cancels += 1  # (its call's end is ours, not the server's closing it)
            try:
                # The socket's own shutdown, not SSLSocket's, which would also let go of its
                # TLS state under the thread reading from it.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def disconnect(self) -> None:
        """Drops the connection and the thread (a later call opens both again)."""
        self.cancel()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.submit(self._drop)  # after any call still under way on it
            thread.shutdown(wait=False)

    def close(self) -> None:
        self._closed = True
        self.disconnect()

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    # On the link's thread.
    def _exchange(self, frame: bytes, timeout_s: float, limit: int) -> tuple[int, bytearray]:
        if self._closed:
            raise ConnectionError("the replication link is closed")
        sock = self._sock
        fresh, cancels = sock is None, self._cancels
        if sock is None:
            try:
                sock = connect_blocking(self._target, timeout_s, self._tls,
                                        self._server_hostname)
            except (OSError, ValueError) as error:
                self.down_until = time.monotonic() + RETRY_LINK_AFTER_S
                raise LinkUnavailable(f"{self.address}: {error}") from None
            self._sock = sock
        try:
            sock.settimeout(timeout_s)
            sock.sendall(frame)
            return read_answer(sock, limit)
        except BaseException as error:
            self._sock = None
            try:
                sock.close()
            except OSError:
                pass
            if fresh and self._cancels == cancels and _closed_by_server(error):
                # Taken and closed before any answer (the leader's link full: its
                # MAX_CONNECTIONS, or its held bytes): as if it could not be reached, so
                # the follower asks over gRPC instead of retrying here for ever.
                self.down_until = time.monotonic() + RETRY_LINK_AFTER_S
                raise LinkUnavailable(f"{self.address}: a new connection was closed before "
                                      f"its first answer ({error})") from None
            raise


class LinkUnavailable(ConnectionError):
    """No connection to the leader's replication link could be made."""


def _closed_by_server(error: BaseException) -> bool:
    """Whether a new connection's first call failed on the way (the server closed or
    reset it), not by its deadline or a broken frame: the rule the SDK's and the Go
    client's links keep (docs/clients.md, "The link")."""
    return isinstance(error, (OSError, EOFError)) and not isinstance(
        error, (TimeoutError, LinkProtocolError))


# -------------------------------------------------------------------------- coordinator side
MAX_CALL_CONNECTIONS = 8  # per partition server: more calls at once go over gRPC
CALL_IDLE_S = IDLE_TIMEOUT_S / 2  # a kept connection unused this long is closed, not used
LENGTH_SIZE = HEAD.size - 1  # an answer frame's length field (the length counts the kind)
CALL_FALLBACKS = Counter("atomlog_link_call_fallbacks_total",
                         "Calls this server sent over gRPC because the other server's link "
                         "could not be reached (or had no free connection), by method: a "
                         "coordinator's to partition servers, a partition server's "
                         "VerifyTxnPartitions to coordinators.",
                         ["method"])


class _CallConnection(asyncio.Protocol):
    """One kept connection of a CallLink, as a protocol: an answer frame is parsed as its
    bytes arrive (`data_received`) and handed to the call waiting for it, with no stream
    reader, drain or per-call timer between (a StreamReader's two reads, a drain and an
    asyncio.timeout_at cost the coordinator about 70 Python-level calls a call, measured
    2026-12-07). One call at a time; anything the server sends unasked, a frame out of
    bounds, an end of file or a lost connection breaks it for good (`broken`), failing
    the call waiting on it, if any."""

    __slots__ = ("transport", "_buffer", "_waiter", "deadline", "broken", "used")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future | None = None
        self.deadline: float | None = None  # the call's, in the loop's time (CallLink._sweep)
        self.broken: BaseException | None = None
        self.used = 0.0  # time.monotonic() when its last call ended (kept connections)

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def begin(self, frame: bytes, waiter: asyncio.Future, deadline: float | None) -> None:
        """Send a call frame; `waiter` gets (kind, payload) of its answer, or the error
        that broke the connection."""
        if self.broken is not None:  # (broken meanwhile: failed, not left waiting)
            waiter.set_exception(self.broken)
            return
        self._waiter, self.deadline = waiter, deadline
        self.transport.write(frame)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        if self._waiter is None:
            self.fail(LinkProtocolError("an answer frame no call waits for"))
            return
        if len(buffer) < HEAD.size:
            return
        try:
            length, kind = answer_head(buffer, MAX_CALL_BYTES - 1)  # (payload + kind byte)
        except LinkProtocolError as error:
            self.fail(error)
            return
        end = LENGTH_SIZE + length
        if len(buffer) < end:
            return
        if len(buffer) > end:  # one call at a time: nothing may follow its answer
            self.fail(LinkProtocolError("bytes after an answer frame"))
            return
        payload = bytes(memoryview(buffer)[HEAD.size:])
        buffer.clear()
        waiter, self._waiter = self._waiter, None
        if not waiter.done():
            waiter.set_result((kind, payload))

    def eof_received(self) -> bool:
        self.fail(EOFError("the link server closed the connection"))
        return False

    def connection_lost(self, error: BaseException | None) -> None:
        self.fail(error if error is not None else EOFError("the link connection closed"))

    def fail(self, error: BaseException) -> None:
        """Break the connection: the waiting call (if any) fails with `error`."""
        if self.broken is None:
            self.broken = error
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        if self.transport is not None:
            self.transport.close()

    def usable(self, now: float) -> bool:
        """Whether a kept connection may take the next call: not broken or closing (the
        server closed it meanwhile: a restart), and not idle for CALL_IDLE_S (the server
        closes one idle for IDLE_TIMEOUT_S)."""
        return self.broken is None and not self.transport.is_closing() and \
            now - self.used < CALL_IDLE_S


class CallLink:
    """A server's stub for another server with a link: the methods of `service` the link
    carries (link_wire.CALL_METHODS) go over the link (call frames, kind 3), any other
    method over gRPC (`grpc_stub`). A coordinator's for a partition server (StageTxn,
    Produce, EndTxnOnPartition), a partition server's for a coordinator
    (VerifyTxnPartitions). Asyncio, on the caller's event loop: one call per connection at a
    time, connections kept for the next call, at most MAX_CALL_CONNECTIONS (a call beyond
    that, or larger than MAX_CALL_BYTES, goes over gRPC). A failure raises what a
    failed gRPC call raises (grpc.aio.AioRpcError with the same ErrorInfo), so callers
    handle both alike: an error frame is the servicer's refusal; a broken connection is
    SERVER_UNAVAILABLE (the outcome unknown, as a gRPC UNAVAILABLE); a deadline passed
    is REQUEST_TIMED_OUT. A connection that cannot be made sends that call and those of
    the next RETRY_LINK_AFTER_S over gRPC, and calls `on_unreachable` (the coordinator's
    routes re-read the servers' link addresses: a restarted server may have a new one).
    Over TLS when `tls` (a services.tls.ChannelTls) is given, as LinkClient."""

    def __init__(self, address: str, grpc_stub, on_unreachable=None, tls=None,
                 server_address: str = "", service: str = "PartitionService"):
        self.service = service
        host, _, port = address.rpartition(":")
        self.address = address
        self._target = (host.strip("[]"), int(port))
        self._tls = tls
        self._server_hostname = tls.server_hostname(server_address or address) if tls else ""
        self._grpc = grpc_stub
        self._on_unreachable = on_unreachable  # called when a connection cannot be made
        self._idle: list[_CallConnection] = []  # kept connections, the last used last
        self._busy: set[_CallConnection] = set()  # those with a call under way
        self._sweeper: asyncio.TimerHandle | None = None
        self._connections = 0
        self.down_until = 0.0
        self._closed = False

    def __getattr__(self, method: str):
        """The call function of `method`: on the link when it carries it, else gRPC's
        (made once, then found as an attribute)."""
        if method.startswith("_"):
            raise AttributeError(method)
        if (self.service, method) not in CALL_NUMBERS:
            return getattr(self._grpc, method)  # everything else: gRPC

        async def call(request, timeout: float | None = None, **options):
            return await self._call(method, request, timeout, options)

        setattr(self, method, call)
        return call

    def _take_idle(self) -> _CallConnection | None:
        """A kept connection to use now, or None. One idle longer than CALL_IDLE_S (the
        server closes a connection idle for IDLE_TIMEOUT_S), or that the server closed
        meanwhile (a restart), is closed here instead of failing a call."""
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.usable(now):
                return connection
            self._connections -= 1
            connection.transport.close()
        return None

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            self._connections -= 1
            connection.transport.close()

    async def _call(self, name: str, request, timeout: float | None, options: dict):
        source = local.channel_token()
        token = source.token.encode() if source is not None else b""
        # The frame's size as the server bounds it (the call's head, token and request).
        size = request.ByteSize() + CALL_HEAD.size + len(token)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        if size > MAX_CALL_BYTES:
            return await self._over_grpc(name, request, timeout, options)
        connection = self._take_idle()
        fresh = connection is None
        if connection is None:
            if (self._closed or time.monotonic() < self.down_until
                    or self._connections >= MAX_CALL_CONNECTIONS):
                return await self._over_grpc(name, request, timeout, options)
            connection = await self._connect(timeout)
            if connection is None:
                return await self._over_grpc(name, request, self._remaining(deadline),
                                             options)
        kept = False
        waiter = loop.create_future()
        busy = self._busy
        busy.add(connection)
        if self._sweeper is None and deadline is not None:
            self._sweeper = loop.call_later(CALL_SWEEP_S, self._sweep)
        try:
            connection.begin(call_frame(CALL_NUMBERS[self.service, name], timeout, token,
                                        request), waiter, deadline)
            kind, payload = await waiter
            kept = True
        except TimeoutError:
            raise local.rpc_error(AtomlogError(
                "REQUEST_TIMED_OUT", f"{name} to {self.address} (link) took longer than "
                f"{timeout} s")) from None
        except (OSError, EOFError, LinkProtocolError) as error:
            self._drop_idle()  # kept ones to a server that went away are broken too
            if not (fresh and _closed_by_server(error)):
                raise local.rpc_error(AtomlogError(
                    "SERVER_UNAVAILABLE", f"{name} to {self.address} (link): "
                    f"{type(error).__name__}: {error}", {"retry_after_ms": "100"})) from None
            # A new connection closed before any answer (the server's link full: its
            # MAX_CONNECTIONS, or its held bytes): unreachable, as a refused connect is.
            # The call is sent over gRPC (the link's methods are safe to send twice:
            # staging and markers are idempotent, TC-log appends carry sequence numbers,
            # a verification only reads), and so are those of the next seconds.
            self._unreachable(error)
            kind = None
        finally:
            busy.discard(connection)
            if kept and not self._closed:
                connection.used = time.monotonic()
                self._idle.append(connection)
            else:  # (a cancelled call's answer may still come: the connection goes)
                self._connections -= 1
                connection.fail(ConnectionAbortedError("the call ended without its answer"))
        if kind is None:
            return await self._over_grpc(name, request, self._remaining(deadline), options)
        if kind == KIND_ERROR:
            raise local.rpc_error(from_item(partition_pb2.ItemError.FromString(payload)))
        return CALL_METHODS[CALL_NUMBERS[self.service, name]].response_type.FromString(payload)

    def _sweep(self) -> None:
        """Fail the calls past their deadline (REQUEST_TIMED_OUT; their connections are
        closed), every CALL_SWEEP_S while calls are under way."""
        self._sweeper = None
        if not self._busy:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for connection in [c for c in self._busy
                           if c.deadline is not None and c.deadline <= now]:
            connection.fail(TimeoutError())
        if self._busy:
            self._sweeper = loop.call_later(CALL_SWEEP_S, self._sweep)

    async def _connect(self, timeout: float | None) -> _CallConnection | None:
        self._connections += 1
        try:
            tls = {} if self._tls is None else {
                "ssl": self._tls.ssl_context(), "server_hostname": self._server_hostname,
                "ssl_handshake_timeout": HANDSHAKE_TIMEOUT_S}
            async with asyncio.timeout(min(timeout or 5.0, 5.0)):
                _, connection = await asyncio.get_running_loop().create_connection(
                    _CallConnection, *self._target, **tls)
        except BaseException as error:
            self._connections -= 1
            if not isinstance(error, (OSError, TimeoutError, ValueError)):
                raise  # cancelled (ValueError: TLS files that cannot be loaded)
            self._unreachable(error)
            return None
        connection.transport.write(MAGIC)
        return connection

    def _unreachable(self, error: BaseException) -> None:
        self.down_until = time.monotonic() + RETRY_LINK_AFTER_S
        event(log, "link unreachable: calls to it go over gRPC for a while",
              logging.WARNING, link=self.address, error=f"{type(error).__name__}: {error}",
              retry_after_s=RETRY_LINK_AFTER_S)
        if self._on_unreachable is not None:
            self._on_unreachable()

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else \
            max(0.001, deadline - asyncio.get_running_loop().time())

    async def _over_grpc(self, name: str, request, timeout, options):
        CALL_FALLBACKS.labels(name).inc()
        return await getattr(self._grpc, name)(request, timeout=timeout, **options)

    def close(self) -> None:
        self._closed = True
        self._drop_idle()


class CallLinks:
    """One caller's CallLinks to the servers of one service, by the servers' gRPC
    addresses: `stub` answers the link's stub where the server advertises a link, and
    `grpc_stub` (gRPC, or an in-process LocalStub) where it does not or is this process."""

    def __init__(self, service: str, on_unreachable=None):
        self.service = service
        self._on_unreachable = on_unreachable
        self._links: dict[str, CallLink] = {}

    def stub(self, address: str, link_address: str, grpc_stub):
        if isinstance(grpc_stub, local.LocalStub):
            return grpc_stub
        link = self._links.get(address)
        if link is not None and link.address != link_address:
            self._links.pop(address).close()  # the server moved its link (a restart)
            link = None
        if not link_address:
            return grpc_stub
        if link is None:
            link = self._links[address] = CallLink(
                link_address, grpc_stub, on_unreachable=self._on_unreachable,
                tls=local.channel_tls(), server_address=address, service=self.service)
        return link

    def retain(self, addresses) -> None:
        """Close the links of servers not in `addresses` (those that exist now): a
        departed server's kept connections were otherwise never looked at again, and
        stayed open (CLOSE_WAIT) for good."""
        for address in [a for a in self._links if a not in addresses]:
            self._links.pop(address).close()

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
