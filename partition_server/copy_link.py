"""The replication link (docs/replication.md, "The replication link"): followers' ReplicateMany
calls over a plain length-prefixed TCP connection to their leader, beside its gRPC port.

Why: a follower's round moves about a megabyte per call, and through gRPC (HTTP/2 frames,
its C core's threads, its Cython callbacks and copies on both sides) that costs 1.1-1.2 ms
of CPU per MB over the two processes on this machine, against 0.5-0.6 ms over this link
(`bench/copy_link.py`). With three replicas on one machine, each follower's copy of every
megabyte pays that transport once.

What travels is what travels on gRPC: a `ReplicateManyRequest` and the leader's answer
bytes exactly as its gRPC serializer writes them (`replicate_wire.serialize_many`, the
records spliced in), parsed by the same `parse_many`. The leader answers a link request
with the same servicer method, after the same authentication (the caller's bearer token,
as `authorization` metadata would carry it) and the same ACL check as the gRPC
interceptor applies to `/atomlog.v1.PartitionService/ReplicateMany`, so nothing is
reachable on the link that is not reachable, for the same caller, on gRPC.

Wire format (big-endian):
- the client opens with the 8 bytes `MAGIC` (a version: another value is closed at once);
- then frames, each `u32 length` (of what follows) + `u8 kind` + payload:
  - request, kind 1: `u16 token length`, the token (UTF-8; empty: none), then the
    serialized ReplicateManyRequest;
  - answer, kind 0: the serialized ReplicateManyResponse; kind 2: an error, a serialized
    `ItemError` (reason, message, metadata), as gRPC's ErrorInfo would carry it.
One request is outstanding per connection at a time (a follower's fetcher makes one call
at a time per leader); the leader answers in order.

Limits: a request frame of at most `MAX_REQUEST_BYTES` (else the connection is closed), at
most `MAX_CONNECTIONS` connections per leader (more are closed at once), a connection idle
for `IDLE_TIMEOUT_S`, or as slow to send a frame it announced, is closed (a follower's
long polls keep it busy), and the follower refuses an answer frame larger than its
`max_bytes` allows.

TLS: the link speaks no TLS. A server with tls.enabled opens no link and advertises none,
so its followers and leaders use gRPC (encrypted) as before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import struct
import time

from prometheus_client import Counter, Histogram

from atomlog.v1 import partition_pb2
from partition_server.replicate_wire import ReplicateManyAnswer, parse_many, serialize_many
from services import auth, interceptors
from services.errors import AtomlogError, from_item, unexpected
from services.metrics import LATENCY_BUCKETS_SECONDS
from services.logs import event

log = logging.getLogger("atomlog.partition.link")

MAGIC = b"ATLNK\x00\x00\x01"
KIND_ANSWER, KIND_REQUEST, KIND_ERROR = 0, 1, 2
_HEAD = struct.Struct(">IB")
_TOKEN_LEN = struct.Struct(">H")
METHOD = "/atomlog.v1.PartitionService/ReplicateMany"
MAX_REQUEST_BYTES = 1 << 20
MAX_CONNECTIONS = 256
IDLE_TIMEOUT_S = 120.0
# After a failed connect, a follower uses gRPC for this long before trying the link again.
RETRY_LINK_AFTER_S = 10.0
# Room beside the records in an answer frame (positions, epochs, cursor state headers).
ANSWER_OVERHEAD_BYTES = 1 << 20

LINK_REQUESTS = Counter("atomlog_replication_link_requests_total",
                        "ReplicateMany requests this server answered as a leader on its "
                        "replication link, by outcome (ok or the error reason).", ["outcome"])
LINK_SECONDS = Histogram("atomlog_replication_link_request_duration_seconds",
                         "Time a leader took to answer a ReplicateMany request on its "
                         "replication link (a long poll waits up to replication.fetch_wait_ms).",
                         buckets=LATENCY_BUCKETS_SECONDS)
LINK_FALLBACKS = Counter("atomlog_replication_link_fallbacks_total",
                         "ReplicateMany calls this server sent as a follower over gRPC because "
                         "its leader's replication link could not be reached.")


class LinkProtocolError(ConnectionError):
    """The peer broke the link's wire format: the connection is closed."""


# ----------------------------------------------------------------------------- leader side
class LinkServer:
    """A leader's replication link: answers ReplicateMany frames with `servicer`, checked as
    `interceptor` (services/interceptors.py) checks gRPC calls: its authenticator and, when
    set, its authorizer (read at each request: the runtime sets them at start)."""

    def __init__(self, servicer, interceptor, host: str, port: int):
        self.servicer = servicer
        self.interceptor = interceptor
        self.host, self.port = host, port
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Listens; returns the bound port."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port,
                                                  limit=MAX_REQUEST_BYTES + 64)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=5)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if len(self._connections) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._connections.add(task)
        peer = writer.get_extra_info("peername")
        peer_name = f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            magic = await asyncio.wait_for(reader.readexactly(len(MAGIC)), IDLE_TIMEOUT_S)
            if magic != MAGIC:
                raise LinkProtocolError(f"not a replication link client ({magic[:8]!r})")
            while True:
                length, kind = _HEAD.unpack(
                    await asyncio.wait_for(reader.readexactly(_HEAD.size), IDLE_TIMEOUT_S))
                if kind != KIND_REQUEST or not 0 < length - 1 <= MAX_REQUEST_BYTES:
                    raise LinkProtocolError(f"frame kind {kind}, {length} bytes")
                body = await asyncio.wait_for(reader.readexactly(length - 1), IDLE_TIMEOUT_S)
                answer_kind, payload = await self._answer(body, peer_name)
                writer.write(_HEAD.pack(len(payload) + 1, answer_kind))
                writer.write(payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as error:
            if isinstance(error, LinkProtocolError):
                event(log, "replication link closed", logging.WARNING, peer=peer_name,
                      why=str(error))
        except asyncio.CancelledError:
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _answer(self, body: bytes, peer: str) -> tuple[int, bytes]:
        """One request frame's answer: (kind, payload). Every failure is an error frame, as
        the gRPC interceptor makes every failure a status."""
        started = time.perf_counter()
        outcome = "ok"
        try:
            if len(body) < _TOKEN_LEN.size:
                raise AtomlogError("INVALID_ARGUMENT", "the request frame has no token length")
            (token_length,) = _TOKEN_LEN.unpack_from(body)
            token_end = _TOKEN_LEN.size + token_length
            if token_end > len(body):
                raise AtomlogError("INVALID_ARGUMENT", "the request's token runs past its frame")
            token = body[_TOKEN_LEN.size:token_end].decode("utf-8", "replace")
            try:
                request = partition_pb2.ReplicateManyRequest.FromString(body[token_end:])
            except Exception:  # noqa: BLE001 — any parse failure is the caller's
                raise AtomlogError("INVALID_ARGUMENT",
                                   "the request is not a ReplicateManyRequest") from None
            principal = self._authenticate(token, peer)
            token_var = auth.set_current(principal)
            try:
                authorizer = self.interceptor.authorizer
                if authorizer is not None:
                    authorizer.check(METHOD, request, principal)
                answer = await self.servicer.ReplicateMany(request, None)
                if authorizer is not None:
                    authorizer.answered(METHOD, answer, principal)
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

    def _authenticate(self, token: str, peer: str) -> auth.Principal:
        """As the gRPC interceptor authenticates a call: the token as its `authorization`
        metadata would carry it; no TLS, so no certificate."""
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        return interceptors.principal_of(self.interceptor.authenticator, METHOD, metadata,
                                         {}, peer)


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
    transport failure drops the connection, and the next call opens a new one."""

    def __init__(self, address: str, token_source=None):
        host, _, port = address.rpartition(":")
        self.address = address
        self._target = (host.strip("[]"), int(port))
        self._token_source = token_source
        self._sock: socket.socket | None = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None  # made on first use
        self.down_until = 0.0  # monotonic: no link until then (a connect failed)
        self._closed = False

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
        frame = b"".join((_HEAD.pack(1 + _TOKEN_LEN.size + len(token_bytes) + request.ByteSize(),
                                     KIND_REQUEST), _TOKEN_LEN.pack(len(token_bytes)),
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
            try:
                sock.shutdown(socket.SHUT_RDWR)
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
        if sock is None:
            try:
                sock = socket.create_connection(self._target, timeout=min(timeout_s, 5.0))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(MAGIC)
            except OSError as error:
                self.down_until = time.monotonic() + RETRY_LINK_AFTER_S
                raise LinkUnavailable(f"{self.address}: {error}") from None
            self._sock = sock
        try:
            sock.settimeout(timeout_s)
            sock.sendall(frame)
            head = bytearray(_HEAD.size)
            _receive(sock, memoryview(head))
            length, kind = _HEAD.unpack(head)
            if kind not in (KIND_ANSWER, KIND_ERROR) or not 1 <= length <= limit + 1:
                raise LinkProtocolError(f"answer frame kind {kind}, {length} bytes")
            payload = bytearray(length - 1)
            _receive(sock, memoryview(payload))
            return kind, payload
        except BaseException:
            self._sock = None
            try:
                sock.close()
            except OSError:
                pass
            raise


class LinkUnavailable(ConnectionError):
    """No connection to the leader's replication link could be made."""


def _receive(sock: socket.socket, into: memoryview) -> None:
    got, size = 0, len(into)
    while got < size:
        n = sock.recv_into(into[got:], size - got)
        if n == 0:
            raise ConnectionError("the leader closed the replication link")
        got += n
