"""The link server's connections (partition_server/copy_link.py, `_ServedConnection`: an
asyncio.Protocol that parses request frames as their bytes arrive): frames sent byte by
byte or many in one write are answered alike; a pipelined connection's calls start in
frame order and are answered in it; its bounds (MAX_PIPELINED, one call at a time after
MAGIC, MAX_CALL_BYTES, MAX_HELD_BYTES, MAX_CONNECTIONS, a wrong magic or kind) hold; an
end of file still gets the answers of the calls under way; a peer that reads nothing
makes the server stop reading from it; close() cuts a call of a one-call connection. Real
sockets on loopback, a servicer in process."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import pytest

from atomlog.v1 import common_pb2, partition_pb2
from partition_server import copy_link
from partition_server.copy_link import (KIND_ANSWER, KIND_CALL, KIND_ERROR, MAGIC,
                                        MAGIC_PIPELINED, LinkServer)
from services.link_wire import CALL_NUMBERS, MAX_PIPELINED, call_frame
from tests.link_tools import HEAD
from tests.test_call_link import Bare  # (an interceptor that runs a method as it is)

STAGE = CALL_NUMBERS["PartitionService", "StageTxn"]


class Echo:
    """StageTxn: waits the first item's coordinator_epoch in ms, then answers its
    txn_id; records the order calls started in and how many ran at once."""

    def __init__(self):
        self.started: list[int] = []
        self.running = 0
        self.most = 0
        self.cancelled = 0

    async def StageTxn(self, request, context):
        item = request.items[0]
        self.started.append(item.txn_id.sequence)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if item.coordinator_epoch:
                await asyncio.sleep(item.coordinator_epoch / 1000)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        return partition_pb2.StageTxnResponse(
            results=[partition_pb2.StageTxnResult(txn_id=item.txn_id)])


def frame(sequence: int, delay_ms: int = 0, timeout_s: float | None = 5.0) -> bytes:
    item = partition_pb2.StageTxnItem(
        txn_id=common_pb2.TxnId(sequence=sequence), coordinator_epoch=delay_ms)
    return call_frame(STAGE, timeout_s, b"", partition_pb2.StageTxnRequest(items=[item]))


async def answer(reader) -> tuple[int, int | bytes]:
    """(kind, the echoed sequence) of the next answer frame, (kind, payload) of an error."""
    length, kind = HEAD.unpack(await asyncio.wait_for(reader.readexactly(HEAD.size), 5))
    payload = await asyncio.wait_for(reader.readexactly(length - 1), 5)
    if kind != KIND_ANSWER:
        return kind, payload
    return kind, partition_pb2.StageTxnResponse.FromString(payload).results[0].txn_id.sequence


async def closed(reader) -> bool:
    """Whether the server closed the connection (within 2 s) without sending more."""
    try:
        return await asyncio.wait_for(reader.read(1), 2) == b""
    except ConnectionResetError:
        return True


def run(scenario):
    async def main():
        servicer = Echo()
        server = LinkServer(Bare(), "127.0.0.1", 0)
        server.serve("PartitionService", servicer)
        port = await server.start()
        try:
            await scenario(server, servicer, port)
        finally:
            await server.close()
        assert not server._connections and server._held_bytes == 0
        await asyncio.sleep(0.01)
        # (No call task left, nor the runner of a connection of one call at a time.)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


def test_frames_byte_by_byte_and_in_bulk_are_answered_alike():
    async def scenario(server, servicer, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for byte in MAGIC + frame(1):  # one write(2), and one segment, per byte
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0)
        assert await answer(reader) == (KIND_ANSWER, 1)
        writer.write(frame(2))
        assert await answer(reader) == (KIND_ANSWER, 2)
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(MAGIC_PIPELINED + b"".join(frame(n) for n in range(MAX_PIPELINED)))
        assert [await answer(reader) for _ in range(MAX_PIPELINED)] == [
            (KIND_ANSWER, n) for n in range(MAX_PIPELINED)]
        writer.close()

    run(scenario)


def test_a_pipelined_connection_starts_calls_in_frame_order_and_answers_in_it():
    """The first calls take longest: they are still answered first; no more than
    MAX_PIPELINED run at once (the frames past it wait to be read), and a connection of
    one call at a time runs one, even when its peer sends two frames at once."""
    async def scenario(server, servicer, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        count = MAX_PIPELINED + 4
        writer.write(MAGIC_PIPELINED + b"".join(
            frame(n, delay_ms=10 * (count - n)) for n in range(count)))
        assert [await answer(reader) for _ in range(count)] == [
            (KIND_ANSWER, n) for n in range(count)]
        assert servicer.started == list(range(count))
        assert servicer.most == MAX_PIPELINED
        writer.close()

        servicer.most = 0
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(MAGIC + frame(1, delay_ms=50) + frame(2))
        assert [await answer(reader) for _ in range(2)] == [(KIND_ANSWER, 1), (KIND_ANSWER, 2)]
        assert servicer.most == 1
        writer.close()

    run(scenario)


@pytest.mark.parametrize("opening", [
    b"ATLNK\x00\x00\x09",  # another version
    MAGIC + HEAD.pack(10, 7) + b"\0" * 9,  # an unknown kind
    MAGIC + HEAD.pack(1, KIND_CALL),  # an empty call
    MAGIC_PIPELINED + HEAD.pack(copy_link.MAX_CALL_BYTES + 2, KIND_CALL),
    MAGIC + HEAD.pack(copy_link.MAX_REQUEST_BYTES + 2, copy_link.KIND_REQUEST),
], ids=["magic", "kind", "empty", "call-too-long", "request-too-long"])
def test_a_frame_out_of_bounds_closes_its_connection(opening):
    async def scenario(server, servicer, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(opening)
        assert await closed(reader)
        writer.close()
        for _ in range(100):
            if not server._connections:
                break
            await asyncio.sleep(0.01)
        assert not server._connections and server._held_bytes == 0

    run(scenario)


def test_the_held_bytes_bound_waits_for_the_connections_own_answers(monkeypatch):
    """Two frames that the link holds only one at a time: on a pipelined connection the
    second waits until the first is answered; a frame the bound refuses alone closes its
    connection."""
    one = len(frame(1, delay_ms=50)) - 4  # (as the server counts: the length field's)
    monkeypatch.setattr(copy_link, "MAX_HELD_BYTES", one + one // 2)

    async def scenario(server, servicer, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(MAGIC_PIPELINED + frame(1, delay_ms=50) + frame(2, delay_ms=50))
        assert [await answer(reader) for _ in range(2)] == [(KIND_ANSWER, 1), (KIND_ANSWER, 2)]
        assert servicer.most == 1
        writer.close()

        monkeypatch.setattr(copy_link, "MAX_HELD_BYTES", one - 1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(MAGIC + frame(3, delay_ms=50))
        assert await closed(reader)
        writer.close()

    run(scenario)


def test_connections_past_the_bound_are_closed_at_once(monkeypatch):
    monkeypatch.setattr(copy_link, "MAX_CONNECTIONS", 1)

    async def scenario(server, servicer, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(MAGIC + frame(1))
        assert await answer(reader) == (KIND_ANSWER, 1)
        second_reader, second_writer = await asyncio.open_connection("127.0.0.1", port)
        second_writer.write(MAGIC + frame(2))
        assert await closed(second_reader)
        writer.write(frame(3))
        assert await answer(reader) == (KIND_ANSWER, 3)
        for stream in (writer, second_writer):
            stream.close()

    run(scenario)


@pytest.mark.parametrize("magic", [MAGIC, MAGIC_PIPELINED], ids=["one", "pipelined"])
def test_a_peer_that_ends_its_sending_still_gets_its_answers(magic):
    """An end of file after the frames (shutdown of the peer's writing side): the calls
    under way are answered, then the server closes the connection."""
    async def scenario(server, servicer, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        calls = 1 if magic == MAGIC else 3
        writer.write(magic + b"".join(frame(n, delay_ms=30) for n in range(calls)))
        writer.write_eof()
        assert [await answer(reader) for _ in range(calls)] == [
            (KIND_ANSWER, n) for n in range(calls)]
        assert await closed(reader)
        writer.close()

    run(scenario)


def test_a_peer_that_reads_nothing_is_not_read_from_without_bound(monkeypatch):
    """A pipelined peer that sends frames without end and never reads its answers: once
    the transport's buffer passes its bound the server stops writing answers, then
    starting calls, then reading (what it buffered stays bounded), as a drain would
    have it; the peer's sending stalls."""
    monkeypatch.setattr(copy_link, "IDLE_TIMEOUT_S", 30)

    class Big(Echo):
        async def StageTxn(self, request, context):
            answer = await super().StageTxn(request, context)
            answer.results[0].batch_results.add(error=partition_pb2.ItemError(
                message="x" * (256 << 10)))
            return answer

    async def main():
        server = LinkServer(Bare(), "127.0.0.1", 0)
        servicer = Big()
        server.serve("PartitionService", servicer)
        port = await server.start()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            one = frame(1)
            writer.write(MAGIC_PIPELINED)
            sent = 0
            began = time.monotonic()
            while time.monotonic() - began < 1.0:
                writer.write(one * 64)
                sent += 64
                try:
                    await asyncio.wait_for(writer.drain(), 0.2)
                except asyncio.TimeoutError:
                    break  # (the server stopped reading: our sending stalls)
            [connection] = server._connections
            started = len(servicer.started)  # (answers the kernel took, then 8 more)
            await asyncio.sleep(0.3)
            assert len(servicer.started) == started and connection.write_since is not None
            assert len(connection._pending) <= MAX_PIPELINED
            assert len(connection._buffer) <= 2 * copy_link.READ_AHEAD_BYTES
            assert server._held_bytes <= (MAX_PIPELINED + 1) * len(one)
            assert sent * len(one) > 4 * copy_link.READ_AHEAD_BYTES
        finally:
            writer.transport.abort()  # (its answers, done, go nowhere: not waited for)
            began = time.monotonic()
            await server.close()
        assert time.monotonic() - began < 2
        assert not server._connections and server._held_bytes == 0

    asyncio.run(main())


def test_closing_the_link_cuts_a_one_call_connections_call():
    """close(): a connection of one call at a time is closed at once, its call under way
    cancelled and unanswered (a pipelined one's calls are left to end: test_call_link)."""
    async def scenario(server, servicer, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(MAGIC + frame(1, delay_ms=3000, timeout_s=None))
        while not servicer.started:
            await asyncio.sleep(0.01)
        began = time.monotonic()
        await server.close()
        assert time.monotonic() - began < 1
        assert servicer.cancelled == 1
        assert await closed(reader)
        writer.close()

    run(scenario)


def test_a_connection_lost_or_idle_ends_its_runner(monkeypatch):
    """A connection of one call at a time runs its calls in one task, waiting between
    them: a peer that resets the connection, and one closed for being idle, end it."""
    monkeypatch.setattr(copy_link, "IDLE_TIMEOUT_S", 0.2)

    async def scenario(server, servicer, port):
        for idle in (False, True):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(MAGIC + frame(1))
            assert await answer(reader) == (KIND_ANSWER, 1)
            if idle:
                assert await closed(reader)
            else:  # (a reset: the connection lost, no end of file read)
                writer.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            for _ in range(100):
                if not server._connections:
                    break
                await asyncio.sleep(0.01)
            assert not server._connections
            assert asyncio.all_tasks() == {asyncio.current_task()}
            writer.close()

    run(scenario)


def test_an_error_frame_keeps_the_connection():
    """A call the link cannot run (a method nobody serves here, a request that does not
    parse) is an error frame; the connection takes the next call."""
    async def scenario(server, servicer, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(MAGIC + call_frame(STAGE, 5.0, b"", b"\xff\xff"))
        kind, _ = await answer(reader)
        assert kind == KIND_ERROR
        writer.write(frame(4))
        assert await answer(reader) == (KIND_ANSWER, 4)
        writer.close()

    run(scenario)
