"""How the SDK reads a link's answers (services/link_wire.py `read_answer_into`) and
bounds a call on a plain connection (spark_client/link.py `_Connection`: a blocking
socket, the kernel's SO_RCVTIMEO/SO_SNDTIMEO, one recv(2) for an answer that fits the
connection's buffer). Real sockets: socket pairs for the reader, and for ServerLink a
link server on loopback in a thread whose answers the test scripts (late, cut short,
larger than the buffer, garbled)."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from atomlog.v1 import coordinator_pb2
from services.errors import from_rpc_error
from services.link_wire import (
    HEAD,
    KIND_ANSWER,
    KIND_CALL,
    KIND_ERROR,
    MAGIC,
    LinkProtocolError,
    read_answer_into,
)
from spark_client import link as link_module
from spark_client.link import ANSWER_BUFFER_BYTES, Links, ServerLink


def frame(payload: bytes, kind: int = KIND_ANSWER) -> bytes:
    return HEAD.pack(1 + len(payload), kind) + payload


def test_a_call_frame_is_its_head_and_body_as_call_head_writes_them():
    """call_frame packs its head at once (the SDK's calls); call_head (a large request's
    head, sent before its body) must say the same."""
    from services.link_wire import call_frame, call_head

    request = coordinator_pb2.CommitTxnRequest(tc_partition=3, idempotency_key="k" * 40)
    for timeout_s, token in [(30.0, b""), (0.0004, b"a.b.c"), (None, b""), (5e6, b"t" * 300)]:
        body = request.SerializeToString()
        for given in (request, body):
            assert call_frame(7, timeout_s, token, given) == \
                call_head(7, timeout_s, token, len(body)) + body


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("size", [0, 1, 100, ANSWER_BUFFER_BYTES - HEAD.size,
                                  ANSWER_BUFFER_BYTES - HEAD.size + 1, 3 * ANSWER_BUFFER_BYTES])
def test_an_answer_is_read_whole_in_the_buffer_or_beyond_it(pair, size):
    a, b = pair
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    sender = threading.Thread(target=a.sendall, args=(frame(payload, KIND_ERROR),))
    sender.start()
    buffer = bytearray(ANSWER_BUFFER_BYTES)
    kind, got = read_answer_into(b, buffer, 64 << 20)
    sender.join()
    assert kind == KIND_ERROR and bytes(got) == payload
    # What it returns is its own: the buffer's next use changes nothing in it.
    buffer[:] = bytes(len(buffer))
    assert bytes(got) == payload


@pytest.mark.parametrize("cut", [1, HEAD.size - 1, HEAD.size, HEAD.size + 3])
def test_an_answer_sent_in_pieces_is_put_together(pair, cut):
    a, b = pair
    whole = frame(b"0123456789")

    def send() -> None:
        a.sendall(whole[:cut])
        time.sleep(0.05)
        a.sendall(whole[cut:])

    sender = threading.Thread(target=send)
    sender.start()
    assert read_answer_into(b, bytearray(64), 1 << 20) == (KIND_ANSWER, b"0123456789")
    sender.join()


@pytest.mark.parametrize("sent", [b"", b"\x00\x00", frame(b"0123456789")[:8]])
def test_a_connection_closed_before_the_answer_is_whole_is_a_connection_error(pair, sent):
    a, b = pair
    a.sendall(sent)
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError):
        read_answer_into(b, bytearray(64), 1 << 20)


@pytest.mark.parametrize("sent, why", [
    (frame(b"x", KIND_CALL), "kind 3"),
    (HEAD.pack(0, KIND_ANSWER), "0 bytes"),
    (frame(b"x" * 100), "101 bytes"),  # beyond the limit (50)
    (frame(b"x") + b"more", "4 bytes after"),
])
def test_a_broken_answer_frame_is_a_protocol_error(pair, sent, why):
    a, b = pair
    a.sendall(sent)
    with pytest.raises(LinkProtocolError, match=why):
        read_answer_into(b, bytearray(64), 50)


class ScriptedLink:
    """A link server on loopback: each call it reads is answered by the next step of
    `script` (a function of the connection, called with it)."""

    def __init__(self, script):
        self.script = list(script)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.script:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                assert conn.recv(len(MAGIC), socket.MSG_WAITALL) == MAGIC
                while self.script:
                    head = conn.recv(HEAD.size, socket.MSG_WAITALL)
                    if len(head) < HEAD.size:
                        break
                    length, kind = HEAD.unpack(head)
                    assert kind == KIND_CALL
                    conn.recv(length - 1, socket.MSG_WAITALL)
                    if self.script.pop(0)(conn) == "close":
                        break

    def close(self) -> None:
        self.script.clear()
        self.listener.close()


def answer(state: int, padding: int = 0):
    data = coordinator_pb2.CommitTxnResponse(state=state).SerializeToString()
    if padding:
        data += _padding_field(padding)
    return lambda conn: conn.sendall(frame(data))


def _padding_field(size: int) -> bytes:
    """An unknown length-delimited field (number 1000) of `size` bytes: parsed and kept
    as unknown, so an answer of any size stays a valid CommitTxnResponse."""
    tag = (1000 << 3) | 2
    return _varint(tag) + _varint(size) + b"p" * size


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def request() -> coordinator_pb2.CommitTxnRequest:
    return coordinator_pb2.CommitTxnRequest(tc_partition=0, idempotency_key="k", abort=True)


@pytest.fixture
def scripted():
    made = []

    def make(*script) -> tuple[ScriptedLink, ServerLink]:
        server = ScriptedLink(script)
        made.append(server)
        return server, ServerLink(server.address, server.address, None, None, Links())

    yield make
    for server in made:
        server.close()


def test_answers_on_a_kept_plain_connection_small_and_large(scripted):
    server, link = scripted(answer(3), answer(4, padding=5 * ANSWER_BUFFER_BYTES), answer(5))
    assert link.call("CommitTxn", request(), 5).state == 3
    assert len(link.call("CommitTxn", request(), 5).SerializeToString()) > \
        5 * ANSWER_BUFFER_BYTES
    assert link.call("CommitTxn", request(), 5).state == 5
    assert server.connections == 1 and link.connects == 1 and len(link._idle) == 1
    assert link._idle[0].sock.gettimeout() is None  # blocking: the kernel's timeout


def test_a_late_answer_times_the_call_out_at_about_its_timeout_and_drops_the_connection(
        scripted):
    """The kernel's timeout (SO_RCVTIMEO) ends the wait: REQUEST_TIMED_OUT, as Python's
    own timeout did; the connection, its answer maybe still coming, is not kept. The
    next call, with a timeout four times longer, waits for its slow answer."""
    late = threading.Event()

    def never(conn) -> None:
        late.wait(5)

    def slow(conn) -> None:
        time.sleep(0.5)
        answer(7)(conn)

    server, link = scripted(answer(3), never, slow)
    assert link.call("CommitTxn", request(), 5).state == 3
    began = time.monotonic()
    with pytest.raises(grpc.RpcError) as raised:
        link.call("CommitTxn", request(), 0.3)
    waited = time.monotonic() - began
    late.set()
    assert from_rpc_error(raised.value).reason == "REQUEST_TIMED_OUT"
    assert 0.25 <= waited < 2.0
    assert link._idle == [] and link._open == 0
    assert link.call("CommitTxn", request(), 1.2).state == 7  # (a new connection)
    assert link.connects == 2


def test_a_call_asking_for_longer_than_the_last_waits_its_own_timeout(scripted):
    """A long poll after a short call on the same kept connection (a Fetch after an Ack):
    the kernel's timeout is set again for it, not left at the shorter one (which gave up
    on a slow answer the call had asked to wait for; found by a review)."""
    def slow(conn) -> None:
        time.sleep(0.8)
        answer(7)(conn)

    server, link = scripted(answer(3), slow)
    assert link.call("CommitTxn", request(), 0.6).state == 3
    assert link.call("CommitTxn", request(), 1.0).state == 7
    assert link.connects == 1


def test_an_answer_cut_short_is_server_unavailable_and_the_connection_is_dropped(scripted):
    def cut(conn) -> None:
        conn.sendall(frame(b"\x08\x03" * 10)[:9])
        return "close"

    server, link = scripted(answer(3), cut, answer(4))
    assert link.call("CommitTxn", request(), 5).state == 3
    with pytest.raises(grpc.RpcError) as raised:
        link.call("CommitTxn", request(), 5)
    assert from_rpc_error(raised.value).reason == "SERVER_UNAVAILABLE"
    assert link._idle == [] and link._open == 0
    assert link.call("CommitTxn", request(), 5).state == 4


def test_a_kept_connection_the_server_closed_is_seen_before_the_call(scripted):
    def answer_and_close(conn) -> str:
        answer(3)(conn)
        return "close"

    server, link = scripted(answer_and_close, answer(4))
    assert link.call("CommitTxn", request(), 5).state == 3
    kept = link._idle[0]
    deadline = time.monotonic() + 5
    while not kept.readable() and time.monotonic() < deadline:  # (the server's close)
        time.sleep(0.01)
    assert link.call("CommitTxn", request(), 5).state == 4  # not a failed call
    assert link.connects == 2 and link._idle[0] is not kept


def test_a_changed_timeout_bounds_the_connection_again():
    """`bound` never leaves the kernel's timeouts shorter than the call asks for (a long
    poll after a short call: set again), nor more than a quarter longer (a transaction's
    calls, each asking for a little less: not set each time)."""
    a, b = socket.socketpair()
    try:
        conn = link_module._Connection(a)
        bounds = []
        for timeout_s in (10, 10, 9.9, 6, 5, 4.9, 30, 31, 35, 68, 61, 0.0001):
            conn.bound(timeout_s)
            assert max(0.001, timeout_s) <= conn._bound_s <= 1.25 * max(0.001, timeout_s)
            bounds.append(conn._bound_s)
        assert bounds == [10, 10, 10, 6, 6, 6, 30, 31, 35, 68, 68, 0.001]
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            seconds, micros = link_module._TIMEVAL.unpack(
                a.getsockopt(socket.SOL_SOCKET, option, link_module._TIMEVAL.size))
            assert seconds == 0 and 0 < micros <= 10_000  # (the kernel rounds to its tick)
    finally:
        a.close()
        b.close()


def test_an_answer_that_trickles_in_ends_the_call_near_its_deadline(scripted):
    """The kernel's timeout bounds each recv(2), and restarts with any progress: an
    answer sent a few bytes at a time, each in time, kept a call going for as long as
    the server kept sending (found by a review). Each recv after the first is now bounded
    by what is left of the call (`_Connection.more`): REQUEST_TIMED_OUT near the deadline,
    the connection dropped."""
    stop = threading.Event()

    def trickle(conn) -> None:
        data = frame(b"\x08\x03" + _padding_field(400))
        for position in range(len(data)):
            if stop.wait(0.05):
                return
            try:
                conn.sendall(data[position:position + 1])
            except OSError:
                return

    server, link = scripted(answer(3), trickle, answer(4))
    assert link.call("CommitTxn", request(), 5).state == 3
    began = time.monotonic()
    with pytest.raises(grpc.RpcError) as raised:
        link.call("CommitTxn", request(), 0.5)
    waited = time.monotonic() - began
    stop.set()
    assert from_rpc_error(raised.value).reason == "REQUEST_TIMED_OUT"
    assert 0.5 <= waited < 0.5 * 1.25 + 1.0, waited  # (without the bound: 20 s)
    assert link._idle == [] and link._open == 0
    assert link.call("CommitTxn", request(), 5).state == 4


def test_a_large_request_a_server_takes_slowly_ends_the_call_near_its_deadline(scripted):
    """A request larger than a send's piece (link_wire.SEND_PIECE_BYTES) leaves in
    pieces, each bounded by what is left of the call: a server reading it slowly cannot
    stretch the call past its deadline."""
    # (The scripted server reads the whole frame before its script: it never gets here.)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []
    stop = threading.Event()

    def slow_reader() -> None:
        conn, _ = listener.accept()
        accepted.append(conn)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        while not stop.is_set():
            try:
                if not conn.recv(4096):
                    return
            except OSError:
                return
            time.sleep(0.02)

    thread = threading.Thread(target=slow_reader, daemon=True)
    thread.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    link = ServerLink(address, address, None, None, Links())
    big = coordinator_pb2.CommitTxnRequest(tc_partition=0, idempotency_key="k" * 100)
    big_bytes = big.SerializeToString() + _padding_field(8 << 20)
    began = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as raised:
            link.call("CommitTxn", coordinator_pb2.CommitTxnRequest.FromString(big_bytes), 0.6)
        waited = time.monotonic() - began
        assert from_rpc_error(raised.value).reason == "REQUEST_TIMED_OUT"
        assert 0.6 <= waited < 0.6 * 1.25 + 1.0, waited  # (without the bound: minutes)
        assert link._idle == [] and link._open == 0
    finally:
        stop.set()
        listener.close()
        for conn in accepted:
            conn.close()
        thread.join(5)
