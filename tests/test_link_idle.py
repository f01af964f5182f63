"""The replication link's server closes a connection whose read has waited longer than
IDLE_TIMEOUT_S: one idle before its magic, one idle between frames, one slow to send a
frame it announced (partition_server/copy_link.py, `LinkServer._watch`: one timer
for the link, not a timeout per read). A connection that keeps sending, or that waits on
its own call's answer, is not closed. In process, with the bound made short."""

from __future__ import annotations

import asyncio
import time

import pytest

from partition_server import copy_link
from partition_server.copy_link import KIND_CALL, MAGIC, MAGIC_PIPELINED, LinkServer
from services.link_wire import CALL_NUMBERS, call_frame
from tests.link_tools import HEAD

BOUND_S = 0.4


async def closed_after(port: int, sends: list[tuple[float, bytes]]) -> float | None:
    """Seconds from the first send (or the connection, without any) until the server
    closed the connection, the later sends going on meanwhile (None: still open 4 bounds
    after the last one)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    began = time.monotonic()
    try:
        for index, (pause, data) in enumerate(sends):
            await asyncio.sleep(pause)
            writer.write(data)
            await writer.drain()
            if index == 0:
                began = time.monotonic()
        data = await asyncio.wait_for(reader.read(1), 4 * BOUND_S)
    except asyncio.TimeoutError:
        return None
    except (ConnectionResetError, BrokenPipeError):
        data = b""  # (closed with bytes of ours unread, or written after: a reset)
    finally:
        writer.close()
    assert data == b""  # closed, nothing sent
    return time.monotonic() - began


async def calls_answered(port: int, calls: int) -> tuple[int, float | None]:
    """A connection that sends a call every half bound (to a service nobody serves here:
    each is answered UNIMPLEMENTED), waiting for each answer: (answers, seconds from the
    last answer until the server closed it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    frame = call_frame(next(iter(CALL_NUMBERS.values())), 5.0, b"", b"")
    answers = 0
    try:
        writer.write(MAGIC)
        for _ in range(calls):
            await asyncio.sleep(BOUND_S / 2)
            writer.write(frame)
            length, _kind = HEAD.unpack(await asyncio.wait_for(reader.readexactly(HEAD.size),
                                                               2 * BOUND_S))
            await reader.readexactly(length - 1)
            answers += 1
        last = time.monotonic()
        try:
            data = await asyncio.wait_for(reader.read(1), 4 * BOUND_S)
        except asyncio.TimeoutError:
            return answers, None
        assert data == b""
        return answers, time.monotonic() - last
    finally:
        writer.close()


def test_a_read_waiting_past_the_bound_closes_its_connection_and_only_it(monkeypatch):
    monkeypatch.setattr(copy_link, "IDLE_TIMEOUT_S", BOUND_S)

    async def scenario():
        server = LinkServer(None, "127.0.0.1", 0)
        port = await server.start()
        try:
            half_head = HEAD.pack(100, KIND_CALL)[:3]
            busy = [(BOUND_S / 3, b"\0")] * 4  # a frame's bytes keep coming, slowly
            outcomes = await asyncio.gather(
                closed_after(port, []),  # no magic
                closed_after(port, [(0, MAGIC)]),  # idle between frames
                closed_after(port, [(0, MAGIC_PIPELINED)]),
                closed_after(port, [(0, MAGIC + half_head)]),  # a frame head half sent
                closed_after(port, [(0, MAGIC + HEAD.pack(100, KIND_CALL))] + busy),
                calls_answered(port, 6))
            answers, idle = outcomes.pop()
            assert answers == 6  # three bounds of calls: never cut
            assert idle is not None and BOUND_S * 0.9 <= idle <= BOUND_S * 2.5
            for waited in outcomes:
                # Closed once the bound passed, within a quarter of it more (and some
                # room for a busy machine).
                assert waited is not None and BOUND_S * 0.9 <= waited <= BOUND_S * 2.5, \
                    outcomes
            assert not server._connections
        finally:
            await server.close()

    asyncio.run(scenario())


class _Bare:
    """An interceptor that runs a servicer's method as it is (no authentication)."""

    authenticator = None
    authorizer = None

    @staticmethod
    def wrapped(_full_name, method):
        return method


class _Servicer:
    """Produce fails with a bug; Fetch answers `answer_bytes` of records."""

    def __init__(self, answer_bytes: int = 0):
        self.answer_bytes = answer_bytes

    async def Produce(self, request, context):
        raise RuntimeError("a bug in a handler")

    async def Fetch(self, request, context):
        from atomlog.v1 import partition_pb2

        return partition_pb2.FetchResponse(results=[partition_pb2.FetchResult(
            record_batches=b"r" * self.answer_bytes)])


def _number(method: str) -> int:
    return CALL_NUMBERS["PartitionService", method]


def test_a_failing_handler_answers_an_error_and_holds_nothing_after(monkeypatch):
    """An exception out of a call's handler ended a pipelined connection's answer writer:
    the calls after it went unanswered, and a frame read while the writer ended held its
    bytes for good (enough such connections and the link refused every frame, followers'
    and coordinators' included). Now it is an error frame (INTERNAL), as on gRPC."""
    monkeypatch.setattr(copy_link, "IDLE_TIMEOUT_S", BOUND_S)

    async def scenario():
        server = LinkServer(_Bare(), "127.0.0.1", 0)
        server.serve("PartitionService", _Servicer())
        port = await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(MAGIC_PIPELINED + call_frame(_number("Produce"), 5.0, b"", b""))
            second = call_frame(_number("Fetch"), 5.0, b"", b"\0" * 100_000)
            writer.write(second[:1000])
            await writer.drain()
            await asyncio.sleep(0.1)  # the first call has failed meanwhile
            writer.write(second[1000:])
            await writer.drain()
            kinds = []
            for _ in range(2):
                length, kind = HEAD.unpack(await asyncio.wait_for(
                    reader.readexactly(HEAD.size), 2))
                await reader.readexactly(length - 1)
                kinds.append(kind)
            assert kinds == [copy_link.KIND_ERROR, copy_link.KIND_ERROR], kinds  # (Fetch's
            writer.close()  # request is no FetchRequest: INVALID_ARGUMENT)
            for _ in range(50):
                if not server._connections:
                    break
                await asyncio.sleep(0.05)
            assert not server._connections and server._held_bytes == 0
        finally:
            await server.close()

    asyncio.run(scenario())


def test_a_peer_that_stops_reading_its_answers_is_closed_and_holds_nothing(monkeypatch):
    """Answers were written with no time limit: a peer that stopped reading kept its
    connection slot, the frames it had sent (up to the link's whole MAX_HELD_BYTES, which
    then refused every other connection's frames) and the answers, for as long as it
    stayed connected. Now a write waiting past IDLE_TIMEOUT_S closes the connection, on
    connections of one call at a time and pipelined ones."""
    import socket

    monkeypatch.setattr(copy_link, "IDLE_TIMEOUT_S", BOUND_S)

    async def scenario():
        server = LinkServer(_Bare(), "127.0.0.1", 0)
        server.serve("PartitionService", _Servicer(answer_bytes=16 << 20))
        port = await server.start()
        try:
            # (The Fetch requests do not parse: INVALID_ARGUMENT, a small answer. The big
            # answers come from frames that are FetchRequests.)
            from atomlog.v1 import partition_pb2

            fetch = partition_pb2.FetchRequest().SerializeToString()
            connections = []
            for magic, calls in ((MAGIC, 1), (MAGIC_PIPELINED, 6)):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", port))
                sock.setblocking(False)
                reader, writer = await asyncio.open_connection(sock=sock)
                writer.write(magic + call_frame(_number("Fetch"), 5.0, b"", fetch) * calls)
                await writer.drain()
                connections.append((reader, writer))
            began = time.monotonic()
            while server._connections and time.monotonic() - began < 6 * BOUND_S:
                await asyncio.sleep(0.05)
            assert not server._connections, "a peer that reads nothing is still served"
            assert server._held_bytes == 0
            for _, writer in connections:
                writer.close()
        finally:
            await server.close()

    asyncio.run(scenario())


def test_a_link_that_takes_connections_and_closes_them_sends_servers_calls_over_grpc(
        monkeypatch):
    """A link at its MAX_CONNECTIONS (or its held bytes) takes a connection and closes it
    at once. The SDK's and the Go client's links then send the call over gRPC, as the
    docs say; a coordinator's CallLink and a follower's LinkClient failed the call
    SERVER_UNAVAILABLE instead, and tried the link again at every call, for as long as it
    stayed full. Now both go over gRPC for a while. A call too large for the link (its
    head and token counted, as the server counts them) goes over gRPC too, also when a
    kept connection is free."""
    from atomlog.v1 import partition_pb2

    monkeypatch.setattr(copy_link, "MAX_CONNECTIONS", 0)  # every connection closed at once

    class Grpc:
        def __init__(self):
            self.calls = []

        async def StageTxn(self, request, timeout=None):
            self.calls.append(request)
            return partition_pb2.StageTxnResponse()

    async def scenario():
        server = LinkServer(_Bare(), "127.0.0.1", 0)
        port = await server.start()
        grpc_stub, unreachable = Grpc(), []
        stub = copy_link.CallLink(f"127.0.0.1:{port}", grpc_stub,
                                  on_unreachable=lambda: unreachable.append(1))
        try:
            request = partition_pb2.StageTxnRequest()
            assert isinstance(await stub.StageTxn(request, timeout=5),
                              partition_pb2.StageTxnResponse)
            assert len(grpc_stub.calls) == 1 and unreachable == [1]
            assert stub.down_until > time.monotonic() and stub._connections == 0
            await stub.StageTxn(request, timeout=5)  # (not tried on the link again yet)
            assert len(grpc_stub.calls) == 2 and unreachable == [1]

            follower = copy_link.LinkClient(f"127.0.0.1:{port}", None)
            try:
                with pytest.raises(copy_link.LinkUnavailable):
                    await follower.replicate_many(partition_pb2.ReplicateManyRequest(), 5)
                assert follower.down_until > time.monotonic()
            finally:
                follower.close()
        finally:
            stub.close()
            await server.close()

    asyncio.run(scenario())


def test_a_call_larger_than_the_link_takes_goes_over_grpc_on_a_kept_connection(monkeypatch):
    from atomlog.v1 import partition_pb2

    class Grpc:
        calls = 0

        async def StageTxn(self, request, timeout=None):
            Grpc.calls += 1
            return partition_pb2.StageTxnResponse()

    class Staging:
        async def StageTxn(self, request, context):
            return partition_pb2.StageTxnResponse()

    async def scenario():
        server = LinkServer(_Bare(), "127.0.0.1", 0)
        server.serve("PartitionService", Staging())
        port = await server.start()
        stub = copy_link.CallLink(f"127.0.0.1:{port}", Grpc())
        try:
            await stub.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)  # (kept after)
            assert Grpc.calls == 0 and len(stub._idle) == 1
            item = partition_pb2.StageTxnItem(coordinator_epoch=1)
            request = partition_pb2.StageTxnRequest(items=[item])
            # Exactly the link's bound in request bytes: with its head, more than it takes.
            monkeypatch.setattr(copy_link, "MAX_CALL_BYTES", request.ByteSize())
            await stub.StageTxn(request, timeout=5)
            assert Grpc.calls == 1 and len(stub._idle) == 1
        finally:
            stub.close()
            await server.close()

    asyncio.run(scenario())


def test_a_long_poll_on_the_link_sees_its_caller_hang_up(monkeypatch):
    """A call's context on the link never said it was cancelled: a Receive long poll
    whose consumer had gone away went on to its end and leased what came meanwhile to
    nobody, until the messages' ack timeout. Now the context reads as cancelled once the
    caller's connection has ended, as a cancelled gRPC call's does."""
    from atomlog.v1 import partition_pb2


    class Polling:
        def __init__(self):
            self.noticed = None

        async def Fetch(self, request, context):
            loop = asyncio.get_running_loop()
            began = loop.time()
            while loop.time() - began < 5:
                if context.cancelled():
                    self.noticed = loop.time() - began
                    break
                await asyncio.sleep(0.01)
            return partition_pb2.FetchResponse()

    async def scenario():
        servicer = Polling()
        server = LinkServer(_Bare(), "127.0.0.1", 0)
        server.serve("PartitionService", servicer)
        port = await server.start()
        try:
            for magic in (MAGIC, MAGIC_PIPELINED):
                servicer.noticed = None
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(magic + call_frame(_number("Fetch"), 10.0, b"",
                                                partition_pb2.FetchRequest()))
                await writer.drain()
                await asyncio.sleep(0.2)
                writer.close()  # the consumer went away
                for _ in range(300):
                    if servicer.noticed is not None:
                        break
                    await asyncio.sleep(0.01)
                assert servicer.noticed is not None and servicer.noticed < 2, magic
        finally:
            await server.close()

    asyncio.run(scenario())
