"""The link's wire format (docs/clients.md, "The link"), shared by its server
(partition_server/copy_link.py: every atomlog server that has a link) and its callers:
followers and coordinators (copy_link.py), and the SDK's commits, consumers' calls and
producers' calls (spark_client/link.py).

A link is a plain length-prefixed TCP connection (TLS when the server's gRPC port has it)
beside a server's gRPC port. Big-endian:
- the client opens with the 8 bytes `MAGIC` or `MAGIC_PIPELINED` (a version: another
  value is closed at once);
- then frames, each `u32 length` (of what follows) + `u8 kind` + payload:
  - ReplicateMany request, kind 1: `u16 token length`, the token (UTF-8; empty: none),
    then the serialized ReplicateManyRequest (a follower's copy);
  - call, kind 3: `u8 method` (CALL_METHODS), `u32 timeout ms` (0: none), `u16 token
    length`, the token, then the serialized request;
  - answer, kind 0: the serialized response; kind 2: an error, a serialized `ItemError`
    (reason, message, metadata), as gRPC's ErrorInfo would carry it.
After `MAGIC` one request is outstanding per connection at a time. After
`MAGIC_PIPELINED` (a connection of the SDK's producer, spark_client/link.py) the client
may send up to `MAX_PIPELINED` frames before their answers: the server starts each
call as its frame arrives, in the order they arrive (so a producer's batches reach their
partitions in the order it sent them, as on one gRPC connection), and answers them in
that order. A server from before pipelining closes such a connection at once, and the
client sends over gRPC instead.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

from atomlog.v1 import coordinator_pb2, partition_pb2

MAGIC = b"ATLNK\x00\x00\x01"
MAGIC_PIPELINED = b"ATLNK\x00\x00\x02"
MAX_PIPELINED = 8  # frames a client may have unanswered on a pipelined connection
KIND_ANSWER, KIND_REQUEST, KIND_ERROR, KIND_CALL = 0, 1, 2, 3
HEAD = struct.Struct(">IB")  # frame length (of what follows), kind
TOKEN_LEN = struct.Struct(">H")
CALL_HEAD = struct.Struct(">BIH")  # method number, timeout in ms (0: none), token length
_CALL_FRAME_HEAD = struct.Struct(">IBBIH")  # HEAD then CALL_HEAD, packed at once (call_frame)
MAX_CALL_BYTES = 64 << 20  # a call frame or its answer (as gRPC's max message size)


class CallMethod:
    """A unary method a link carries as call frames: its service (as servers register
    their servicers with the link), name, request and response types, and full name (as
    the ACL rules and the metrics name it)."""

    __slots__ = ("number", "service", "name", "request_type", "response_type", "full_name")

    def __init__(self, number: int, module, service: str, name: str):
        self.number = number
        self.service = service
        self.name = name
        self.request_type = getattr(module, f"{name}Request")
        self.response_type = getattr(module, f"{name}Response")
        self.full_name = f"/atomlog.v1.{service}/{name}"


# Numbers are the wire's: never reuse one.
CALL_METHODS: dict[int, CallMethod] = {method.number: method for method in (
    CallMethod(1, partition_pb2, "PartitionService", "StageTxn"),
    CallMethod(2, partition_pb2, "PartitionService", "Produce"),
    CallMethod(3, partition_pb2, "PartitionService", "EndTxnOnPartition"),
    CallMethod(4, coordinator_pb2, "CoordinatorService", "CommitTxn"),
    CallMethod(5, coordinator_pb2, "CoordinatorService", "CommitTxns"),
    # The streaming path's calls to a coordinator (NewTxn, ..., EndTxn).
    CallMethod(6, coordinator_pb2, "CoordinatorService", "NewTxn"),
    CallMethod(7, coordinator_pb2, "CoordinatorService", "AddPartitionToTxn"),
    CallMethod(8, coordinator_pb2, "CoordinatorService", "AddSubscriptionToTxn"),
    CallMethod(9, coordinator_pb2, "CoordinatorService", "PrepareTxn"),
    CallMethod(10, coordinator_pb2, "CoordinatorService", "EndTxn"),
    CallMethod(11, coordinator_pb2, "CoordinatorService", "GetTxnStatus"),
    # A partition server's questions to a coordinator (partition_server/verifier.py).
    CallMethod(12, coordinator_pb2, "CoordinatorService", "VerifyTxnPartitions"),
    # The SDK's subscription consumers' calls to partition servers (spark_client/subscriber.py).
    CallMethod(13, partition_pb2, "PartitionService", "Receive"),
    CallMethod(14, partition_pb2, "PartitionService", "Ack"),
    CallMethod(15, partition_pb2, "PartitionService", "Nack"),
    # The SDK's consumers' reads (spark_client/consumer.py; the Spark source's too).
    CallMethod(16, partition_pb2, "PartitionService", "Fetch"),
)}
CALL_NUMBERS: dict[tuple[str, str], int] = {
    (method.service, method.name): number for number, method in CALL_METHODS.items()}


def call_frame(number: int, timeout_s: float | None, token: bytes, request) -> bytes:
    """A call frame (kind 3), head and body in one buffer: a connection sends it with one
    write (one send(2), one TCP segment under TCP_NODELAY). `request`: a message, or its
    serialized bytes."""
    body = request if isinstance(request, bytes) else request.SerializeToString()
    # call_head's bytes, inline: one pack, no join (a call frame per SDK call).
    timeout_ms = max(1, min(int(timeout_s * 1000), 0xFFFFFFFF)) if timeout_s else 0
    head = _CALL_FRAME_HEAD.pack(1 + CALL_HEAD.size + len(token) + len(body), KIND_CALL,
                                 number, timeout_ms, len(token))
    return head + token + body if token else head + body


def call_head(number: int, timeout_s: float | None, token: bytes, body_bytes: int) -> bytes:
    """A call frame's bytes before its serialized request of `body_bytes` (a large
    request is sent after it, not copied once more to join them)."""
    timeout_ms = max(1, min(int(timeout_s * 1000), 0xFFFFFFFF)) if timeout_s else 0
    return b"".join((HEAD.pack(1 + CALL_HEAD.size + len(token) + body_bytes, KIND_CALL),
                     CALL_HEAD.pack(number, timeout_ms, len(token)), token))


class LinkProtocolError(ConnectionError):
    """The peer broke the link's wire format: the connection is closed."""


CONNECT_TIMEOUT_S = 5.0
HANDSHAKE_TIMEOUT_S = 10.0  # a TLS handshake not done by then: no connection


def connect_blocking(target: tuple[str, int], timeout_s: float, tls=None,
                     server_hostname: str = "", magic: bytes = MAGIC) -> socket.socket:
    """A blocking connection to a link, ready for frames: connected, TCP_NODELAY, over
    TLS when `tls` (a services.tls.ChannelTls) is given, `magic` sent. Raises OSError
    (ssl.SSLError included) or ValueError (TLS files that cannot be loaded) when it
    cannot be made, leaving nothing open."""
    sock = socket.create_connection(target, timeout=min(timeout_s, CONNECT_TIMEOUT_S))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:  # (the TLS socket takes the plain one's descriptor)
            sock.settimeout(min(timeout_s, HANDSHAKE_TIMEOUT_S))
            sock = tls.ssl_context().wrap_socket(sock, server_hostname=server_hostname)
        sock.sendall(magic)
    except BaseException:
        sock.close()
        raise
    return sock


# A request frame larger than this leaves in pieces of it when its sender bounds the
# whole call (send_frame's `more`): one send(2) per piece, each bounded by what is left.
SEND_PIECE_BYTES = 256 << 10


def send_frame(sock: socket.socket, frame: bytes,
               more: Callable[[], None] | None = None) -> None:
    """sendall(frame) on a blocking socket; a frame larger than SEND_PIECE_BYTES with
    `more` (read_answer's) goes in pieces, `more` called before each but the first, so
    that a peer taking it slowly cannot stretch the call past its deadline (the kernel's
    timeout restarts at each send's progress)."""
    if more is None or len(frame) <= SEND_PIECE_BYTES:
        sock.sendall(frame)
        return
    view, sent = memoryview(frame), 0
    while sent < len(frame):
        if sent:
            more()
        sent += sock.send(view[sent:sent + SEND_PIECE_BYTES])


def read_answer(sock: socket.socket, limit: int,
                more: Callable[[], None] | None = None) -> tuple[int, bytearray]:
    """The next answer frame on a blocking socket, (kind, payload): KIND_ANSWER or
    KIND_ERROR, at most `limit` bytes of payload (LinkProtocolError otherwise). `more`,
    when given, is called before every recv(2) but the first (a caller's deadline for the
    whole answer: it raises TimeoutError past it, or sets the socket's timeout to what is
    left of it)."""
    head = bytearray(HEAD.size)
    receive_exactly(sock, memoryview(head), more, first=True)
    length, kind = answer_head(head, limit)
    payload = bytearray(length - 1)
    receive_exactly(sock, memoryview(payload), more)
    return kind, payload


def read_answer_into(sock: socket.socket, buffer: bytearray, limit: int,
                     more: Callable[[], None] | None = None) -> tuple[int, bytes]:
    """read_answer with one recv(2) for an answer that fits `buffer` (a call's answer
    is the only thing a connection receives until the next call, so nothing beyond it
    can arrive): (kind, payload copied out of `buffer`, which the next call reuses). A
    larger answer is read on into a buffer of its own; `more` as read_answer's, before
    each recv after the first. Receiving nothing raises ConnectionError, a broken frame
    LinkProtocolError."""
    view = memoryview(buffer)
    got = sock.recv_into(view)
    while 0 < got < HEAD.size:
        if more is not None:
            more()
        got += sock.recv_into(view[got:]) or -got  # (-got: closed mid-head, below)
    if got <= 0:
        raise ConnectionError("the server closed the link")
    length, kind = answer_head(buffer, limit)
    end = HEAD.size + length - 1
    if got > end:
        raise LinkProtocolError(f"{got - end} bytes after an answer frame")
    if end <= len(buffer):
        if got < end:
            receive_exactly(sock, view[got:end], more)
        return kind, bytes(view[HEAD.size:end])
    payload = bytearray(length - 1)
    payload[:got - HEAD.size] = view[HEAD.size:got]
    receive_exactly(sock, memoryview(payload)[got - HEAD.size:], more)
    return kind, payload


def answer_head(head: bytes | bytearray, limit: int) -> tuple[int, int]:
    """(length, kind) of an answer frame's head (the SDK's readers' and CallLink's); LinkProtocolError when it is neither an
    answer nor an error frame, or not 1..limit + 1 bytes long."""
    length, kind = HEAD.unpack_from(head)
    if kind not in (KIND_ANSWER, KIND_ERROR) or not 1 <= length <= limit + 1:
        raise LinkProtocolError(f"answer frame kind {kind}, {length} bytes")
    return length, kind


def receive_exactly(sock: socket.socket, into: memoryview,
                    more: Callable[[], None] | None = None, first: bool = False) -> None:
    """Fills `into` from a blocking socket; ConnectionError when the peer closes first.
    `more` (read_answer's) before each recv(2), but the very first of an answer when
    `first`."""
    got, size = 0, len(into)
    while got < size:
        if more is not None and not (first and got == 0):
            more()
        n = sock.recv_into(into[got:], size - got)
        if n == 0:
            raise ConnectionError("the server closed the link")
        got += n
