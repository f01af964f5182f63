"""A server's calls on another server's link (partition_server/copy_link.py, `CallLink`:
a coordinator's StageTxn, TC-log Produce and markers; a partition server's
VerifyTxnPartitions), each connection an asyncio protocol that parses its answer as the
bytes come, and one sweep timer per link failing the calls past their deadline.

Against a scripted peer on a real socket (what it sends, and when, is the test's), so
that the answers a real server never gives (late, in pieces, broken, unasked for, cut
short) are covered; tests/test_partition_link.py runs CallLink against a real partition
server."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from atomlog.v1 import partition_pb2
from partition_server import copy_link
from partition_server.copy_link import MAGIC, CallLink
from services.errors import AtomlogError, from_rpc_error
from services.link_wire import CALL_HEAD, HEAD, KIND_ANSWER, KIND_ERROR


def answer(kind: int = KIND_ANSWER, payload: bytes | None = None) -> bytes:
    if payload is None:
        payload = partition_pb2.StageTxnResponse(results=[
            partition_pb2.StageTxnResult(txn_id={"tc_partition": 3, "sequence": 7})]
        ).SerializeToString()
    return HEAD.pack(len(payload) + 1, kind) + payload


class Peer:
    """A link server whose answers the test scripts: `script(call_index)` is a coroutine
    function given (reader, writer) after each call frame is read whole, which answers
    (or not) as the test wants. Counts connections and calls."""

    def __init__(self, script):
        self.script = script
        self.connections = 0
        self.calls = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            assert await reader.readexactly(len(MAGIC)) == MAGIC
            while True:
                length, _ = HEAD.unpack(await reader.readexactly(HEAD.size))
                body = await reader.readexactly(length - 1)
                assert len(body) >= CALL_HEAD.size
                index, self.calls = self.calls, self.calls + 1
                await self.script(index, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        self.server.close()


class NoGrpc:
    """The link's gRPC stub: every call here must stay on the link."""

    def __getattr__(self, name):
        raise AssertionError(f"{name} went over gRPC")


def run(script, scenario, grpc_stub=None):
    async def main():
        peer = Peer(script)
        port = await peer.start()
        link = CallLink(f"127.0.0.1:{port}", grpc_stub or NoGrpc())
        try:
            await scenario(link, peer)
        finally:
            link.close()
            await peer.close()

    asyncio.run(main())


def reason(error: BaseException) -> str:
    assert isinstance(error, grpc.aio.AioRpcError), error
    return from_rpc_error(error).reason


def test_calls_share_one_kept_connection_and_answers_in_pieces_are_read_whole():
    async def script(index, reader, writer):
        frame = answer()
        if index == 1:  # byte by byte, the head too
            for position in range(len(frame)):
                writer.write(frame[position:position + 1])
                await writer.drain()
                await asyncio.sleep(0.002)
        else:
            writer.write(frame)

    async def scenario(link, peer):
        for _ in range(3):
            reply = await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)
            assert reply.results[0].txn_id.sequence == 7
        assert peer.connections == 1 and link._connections == 1 and len(link._idle) == 1
        assert not link._busy

    run(script, scenario)


def test_a_late_answer_times_out_near_its_deadline_and_its_connection_goes():
    """No per-call timer: the link's sweep fails the call within CALL_SWEEP_S of its
    deadline. Its connection is closed (the answer may still come), the next call takes
    a new one, and the sweep stops once no call is under way."""
    async def script(index, reader, writer):
        if index == 0:
            await asyncio.sleep(3)  # never in time
        writer.write(answer())

    async def scenario(link, peer):
        began = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=0.3)
        took = time.monotonic() - began
        assert reason(late.value) == "REQUEST_TIMED_OUT"
        assert 0.3 <= took < 0.3 + copy_link.CALL_SWEEP_S + 0.2, took
        assert link._connections == 0 and not link._idle and not link._busy
        reply = await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)
        assert reply.results[0].txn_id.tc_partition == 3
        assert peer.connections == 2 and link._connections == 1
        await asyncio.sleep(3 * copy_link.CALL_SWEEP_S)
        assert link._sweeper is None

    run(script, scenario)


def test_an_error_frame_is_the_servicers_refusal_and_keeps_the_connection():
    async def script(index, reader, writer):
        if index == 0:
            error = partition_pb2.ItemError(reason="INVALID_ARGUMENT", message="no items")
            writer.write(answer(KIND_ERROR, error.SerializeToString()))
        else:
            writer.write(answer())

    async def scenario(link, peer):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)
        assert reason(refused.value) == "INVALID_ARGUMENT"
        await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)
        assert peer.connections == 1 and link._connections == 1

    run(script, scenario)


@pytest.mark.parametrize("broken", [
    pytest.param(HEAD.pack(5, 9) + b"abcd", id="an-unknown-kind"),
    pytest.param(HEAD.pack(0, KIND_ANSWER), id="an-empty-frame"),
    pytest.param(HEAD.pack(copy_link.MAX_CALL_BYTES + 1, KIND_ANSWER), id="too-long"),
    pytest.param(answer() + b"\0", id="bytes-after-the-answer"),
    pytest.param(answer()[:-3], id="cut-short-then-closed"),
])
def test_a_broken_answer_on_a_kept_connection_is_server_unavailable(broken):
    """On a kept connection (the first call answered well), a broken answer fails the
    call SERVER_UNAVAILABLE (its outcome unknown) and closes the connection; the next
    call opens a new one."""
    async def script(index, reader, writer):
        if index == 1:
            writer.write(broken)
            await writer.drain()
            if broken == answer()[:-3]:
                writer.close()
            else:
                await asyncio.sleep(0.5)
            return
        writer.write(answer())

    async def scenario(link, peer):
        await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)
        assert reason(failed.value) == "SERVER_UNAVAILABLE"
        assert link._connections == 0 and not link._idle
        await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)
        assert link._connections == 1

    run(script, scenario)


def test_a_kept_connection_the_server_closed_is_not_used():
    async def script(index, reader, writer):
        writer.write(answer())
        await writer.drain()
        if index == 0:
            writer.close()  # as a restarted server's would be

    async def scenario(link, peer):
        await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)
        await asyncio.sleep(0.05)
        assert link._idle[0].broken is not None
        await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)
        assert peer.connections == 2 and link._connections == 1

    run(script, scenario)


def test_a_cancelled_call_closes_its_connection():
    """The caller gave up (cancelled): its answer may still come, so the connection is
    not kept for another call to read it as its own."""
    async def script(index, reader, writer):
        if index == 0:
            await asyncio.sleep(0.3)
        writer.write(answer())

    async def scenario(link, peer):
        call = asyncio.ensure_future(link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5))
        await asyncio.sleep(0.1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert link._connections == 0 and not link._idle and not link._busy
        await asyncio.sleep(0.4)  # the late answer reaches a closed connection
        reply = await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)
        assert reply.results[0].txn_id.sequence == 7 and peer.connections == 2

    run(script, scenario)


def test_a_fresh_connection_closed_before_its_answer_sends_the_call_over_grpc():
    """The server's link took the connection and closed it (its connections full): the
    call goes over gRPC, and so do the next ones for RETRY_LINK_AFTER_S."""
    async def script(index, reader, writer):
        writer.close()

    class Grpc:
        calls = 0

        async def StageTxn(self, request, timeout=None):
            Grpc.calls += 1
            return partition_pb2.StageTxnResponse()

    async def scenario(link, peer):
        await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)
        assert Grpc.calls == 1 and link.down_until > time.monotonic()
        assert link._connections == 0

    run(script, scenario, Grpc())


def test_calls_at_once_take_a_connection_each_up_to_the_bound():
    async def script(index, reader, writer):
        await asyncio.sleep(0.05)
        writer.write(answer())

    async def scenario(link, peer):
        replies = await asyncio.gather(*(
            link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5) for _ in range(5)))
        assert all(r.results[0].txn_id.sequence == 7 for r in replies)
        assert peer.connections == 5 and len(link._idle) == 5 and not link._busy

    run(script, scenario)


def test_an_answer_error_is_an_atomlog_error_with_its_metadata():
    async def script(index, reader, writer):
        error = partition_pb2.ItemError(reason="STALE_COORDINATOR_EPOCH", message="old",
                                        metadata={"current_epoch": "4"})
        writer.write(answer(KIND_ERROR, error.SerializeToString()))

    async def scenario(link, peer):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await link.StageTxn(partition_pb2.StageTxnRequest(), timeout=5)
        error = from_rpc_error(refused.value)
        assert isinstance(error, AtomlogError)
        assert error.reason == "STALE_COORDINATOR_EPOCH"
        assert error.metadata.get("current_epoch") == "4"

    run(script, scenario)


# ------------------------------------------------------------------ the server's side

class SlowServicer:
    """StageTxn answers after the request's first item's coordinator_epoch in ms."""

    def __init__(self):
        self.cancelled = 0

    async def StageTxn(self, request, context):
        try:
            await asyncio.sleep(request.items[0].coordinator_epoch / 1000 if request.items
                                else 0)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return partition_pb2.StageTxnResponse(results=[partition_pb2.StageTxnResult()])


class Bare:
    authenticator = None
    authorizer = None

    @staticmethod
    def wrapped(_full_name, method):
        return method


def stage_frame(delay_ms: int, timeout_s: float | None) -> bytes:
    from services.link_wire import CALL_NUMBERS, call_frame
    request = partition_pb2.StageTxnRequest(
        items=[partition_pb2.StageTxnItem(coordinator_epoch=delay_ms)])
    return call_frame(CALL_NUMBERS["PartitionService", "StageTxn"], timeout_s, b"", request)


async def read_answer(reader) -> tuple[int, bytes]:
    length, kind = HEAD.unpack(await asyncio.wait_for(reader.readexactly(HEAD.size), 5))
    return kind, await reader.readexactly(length - 1)


async def slow_link():
    """A LinkServer whose StageTxn is SlowServicer's, and a connection to it."""
    servicer = SlowServicer()
    server = copy_link.LinkServer(Bare(), "127.0.0.1", 0)
    server.serve("PartitionService", servicer)
    port = await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return servicer, server, reader, writer


@pytest.mark.parametrize("magic", [MAGIC, copy_link.MAGIC_PIPELINED],
                         ids=["one-at-a-time", "pipelined"])
def test_the_server_answers_a_call_past_its_deadline_request_timed_out(magic):
    """The link server's sweep cancels a call at its deadline (the frame's timeout) and
    answers REQUEST_TIMED_OUT, within CALL_SWEEP_S more; the connection goes on: the
    next call (on a pipelined connection, one sent behind it) is answered, a call with
    no timeout is never cut, and the sweep stops once no call with a deadline is under
    way."""
    async def main():
        servicer, server, reader, writer = await slow_link()
        try:
            writer.write(magic)
            began = time.monotonic()
            writer.write(stage_frame(3000, 0.3))
            if magic == copy_link.MAGIC_PIPELINED:
                writer.write(stage_frame(0, 5))
            kind, payload = await read_answer(reader)
            took = time.monotonic() - began
            assert kind == KIND_ERROR
            error = partition_pb2.ItemError.FromString(payload)
            assert error.reason == "REQUEST_TIMED_OUT", error
            assert 0.3 <= took < 0.3 + copy_link.CALL_SWEEP_S + 0.3, took
            assert servicer.cancelled == 1
            if magic == copy_link.MAGIC:
                writer.write(stage_frame(0, 5))
            kind, payload = await read_answer(reader)
            assert kind == KIND_ANSWER
            writer.write(stage_frame(400, None))  # no deadline: answered whenever
            kind, _ = await read_answer(reader)
            assert kind == KIND_ANSWER and servicer.cancelled == 1
            await asyncio.sleep(3 * copy_link.CALL_SWEEP_S)
            assert server._sweeper is None and not server._deadlines and not server._expired
        finally:
            writer.close()
            await server.close()

    asyncio.run(main())


def test_closing_the_link_still_ends_a_pipelined_call_at_its_deadline():
    """close() leaves a pipelined connection's calls to end (found by a review: it also
    stopped the deadlines' sweep, so such a call ran on past its deadline and the stop
    waited for it): the call is still cut at its deadline, and the close ends then."""
    async def main():
        servicer, server, reader, writer = await slow_link()
        try:
            writer.write(copy_link.MAGIC_PIPELINED + stage_frame(3000, 0.3))
            await asyncio.sleep(0.1)
            began = time.monotonic()
            await server.close()
            took = time.monotonic() - began
            assert servicer.cancelled == 1
            assert took < 0.2 + copy_link.CALL_SWEEP_S + 0.5, took  # (not the 3 s call)
            await asyncio.sleep(3 * copy_link.CALL_SWEEP_S)
            assert not server._deadlines and server._sweeper is None
        finally:
            writer.close()

    asyncio.run(main())
