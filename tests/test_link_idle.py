"""The replication link's server closes a connection whose read has waited longer than
IDLE_TIMEOUT_S: one idle before its magic, one idle between frames, one slow to send a
frame it announced (partition_server/copy_link.py, `_ReadWatch`: one timer per
connection, not a timeout per read). A connection that keeps sending, or that waits on
its own call's answer, is not closed. In process, with the bound made short."""

from __future__ import annotations

import asyncio
import time

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
