"""Coordinators' calls on the partition servers' links (partition_server/copy_link.py:
`LinkServer._call` and `CallLink`; docs/coordinator.md, "The partition servers' links"),
with real processes: a coordinator's StageTxn, TC-log Produce and EndTxnOnPartition go
over the link and not over gRPC; bad frames change nothing and get the answers gRPC
would give; a link that cannot be reached sends the call over gRPC; a deadline that
passes answers REQUEST_TIMED_OUT and drops the connection; kept connections are
reused, and one the server closed is not used."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc
from partition_server.copy_link import (CALL_NUMBERS, KIND_ANSWER, KIND_CALL, KIND_ERROR,
                                        MAGIC, MAGIC_PIPELINED, MAX_PIPELINED, CallLink)
from partition_server.record_batch import Record, encode_batch
from services.errors import from_rpc_error
from spark_client import Client
from tests.conftest import create_online, metric_sum, wait_until
from tests.link_tools import (HEAD, calls_by_way, closed_by_peer, connect, link_address,
                              read_frame)

pytestmark = pytest.mark.cluster

LINK_METHODS = ("StageTxn", "Produce", "EndTxnOnPartition")


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.info["bootstrap"]) as client:
        yield client


def servers(cluster, role: str) -> list[dict]:
    return [p for p in cluster.services() if p["role"] == role]


def calls(cluster) -> dict[str, dict[str, float]]:
    """The partition servers' calls of each method, {"link": ..., "grpc": ...}."""
    return calls_by_way([s["metrics_address"] for s in servers(cluster, "partition_server")],
                        "PartitionService", LINK_METHODS)


def fallbacks(cluster) -> float:
    return sum(metric_sum(p["metrics_address"], "atomlog_link_call_fallbacks_total")
               for p in servers(cluster, "coordinator"))


def call_frame(number: int, body: bytes, timeout_ms: int = 10_000, token: bytes = b"") -> bytes:
    payload = struct.pack(">BIH", number, timeout_ms, len(token)) + token + body
    return HEAD.pack(len(payload) + 1, KIND_CALL) + payload


def produce_request(topic: str, partition: int, value: bytes) -> partition_pb2.ProduceRequest:
    return partition_pb2.ProduceRequest(items=[partition_pb2.ProduceItem(
        topic_partition=common_pb2.TopicPartition(topic=topic, partition=partition),
        record_batch=encode_batch([Record(key=None, value=value)]))])


def values(client: Client, topic: str, isolation: str = "read_committed") -> list[bytes]:
    with client.consumer([topic], isolation=isolation, start="earliest") as consumer:
        return [m.value for chunk in consumer.read_until() for m in chunk]


def owner_of(client: Client, topic: str, partition: int):
    """(gRPC address, server name) of the partition's owner."""
    route = client.metadata.route(topic, partition)
    return route.address, route.server_name


def test_coordinator_calls_go_over_the_link(cluster, client):
    """One-call transactions (StageTxn, their decisions' TC-log Produce) and streaming
    ones (their markers: EndTxnOnPartition) cross from the coordinators to the partition
    servers on the links, none over gRPC and none falling back; read_committed sees each
    value once."""
    topic = create_online(client, "link-calls", 2)
    before, fallbacks_before = calls(cluster), fallbacks(cluster)
    streaming = Client(cluster.info["bootstrap"], one_call_max_bytes=0)
    try:
        with client.producer(linger_ms=0) as producer, \
                streaming.producer(linger_ms=0) as streamer:
            for i in range(6):
                txn = client.begin_transaction(timeout_s=30)
                producer.send(topic, b"one-call-%d" % i, partition=i % 2, txn=txn)
                txn.commit()
            for i in range(3):
                txn = streaming.begin_transaction(timeout_s=30)
                streamer.send(topic, b"streaming-%d" % i, partition=i % 2, txn=txn)
                txn.commit(wait_for_markers=True)
    finally:
        streaming.close()
    after = calls(cluster)
    link = {m: after["link"][m] - before["link"][m] for m in LINK_METHODS}
    assert link["StageTxn"] >= 6
    assert link["Produce"] >= 1  # the decisions, in the TC log
    assert link["EndTxnOnPartition"] >= 1  # the streaming transactions' markers
    # None over gRPC (the streaming transactions' own Produce calls, from the SDK, go on
    # its pipelined link connections); no coordinator call fell back.
    over_grpc = {m: after["grpc"][m] - before["grpc"][m] for m in LINK_METHODS}
    assert over_grpc == dict.fromkeys(LINK_METHODS, 0), over_grpc
    assert fallbacks(cluster) == fallbacks_before
    expected = sorted([b"one-call-%d" % i for i in range(6)]
                      + [b"streaming-%d" % i for i in range(3)])
    # (The last one-call markers may linger up to coordinator.marker_linger_ms.)
    wait_until(lambda: sorted(values(client, topic)) == expected, 30, "every value committed")


def test_bad_call_frames_change_nothing(cluster, client):
    """A call frame announced past its bound closes the connection unread; a frame the
    link reads but cannot take (no such method, a short head, a token past its frame, a
    body that is not the method's request) and a request the servicer refuses get an
    error frame, the connection kept, and the log is unchanged."""
    topic = create_online(client, "link-bad-calls", 1)
    address, server = owner_of(client, topic, 0)
    link = link_address(cluster, server)
    stage = CALL_NUMBERS["PartitionService", "StageTxn"]
    produce = CALL_NUMBERS["PartitionService", "Produce"]
    with connect(link) as sock:
        sock.sendall(HEAD.pack((64 << 20) + 2, KIND_CALL))
        assert closed_by_peer(sock)
    refused = [
        (HEAD.pack(3, KIND_CALL) + b"\x01\x00", "INVALID_ARGUMENT"),  # head too short
        (call_frame(200, b""), "UNIMPLEMENTED"),  # no such method
        # A coordinator's method on a partition server (the cluster's run apart).
        (call_frame(CALL_NUMBERS["CoordinatorService", "CommitTxn"], b""), "UNIMPLEMENTED"),
        (HEAD.pack(10, KIND_CALL) + struct.pack(">BIH", produce, 0, 40) + b"ab",
         "INVALID_ARGUMENT"),  # token past its frame
        (call_frame(produce, b"\xff\xff\xff"), "INVALID_ARGUMENT"),  # not a ProduceRequest
        (call_frame(stage, b""), "INVALID_ARGUMENT"),  # StageTxn refuses an empty request
    ]
    with connect(link) as sock:
        for frame, reason in refused:
            sock.sendall(frame)
            kind, payload = read_frame(sock)
            assert kind == KIND_ERROR, frame
            assert partition_pb2.ItemError.FromString(payload).reason == reason, frame
        # A well-formed Produce of a bad batch: the item's refusal inside the answer, as
        # over gRPC; then a good one appends at offset 0 (nothing else was written).
        bad = produce_request(topic, 0, b"x")
        bad.items[0].record_batch = b"\x00" * 70
        sock.sendall(call_frame(produce, bad.SerializeToString()))
        kind, payload = read_frame(sock)
        assert kind == KIND_ANSWER
        answer = partition_pb2.ProduceResponse.FromString(payload)
        assert answer.results[0].error.reason == "CORRUPT_BATCH"
        sock.sendall(call_frame(produce, produce_request(topic, 0, b"good").SerializeToString()))
        kind, payload = read_frame(sock)
        assert kind == KIND_ANSWER
        result = partition_pb2.ProduceResponse.FromString(payload).results[0]
        assert not result.error.reason and result.base_offset == 0



def test_a_pipelined_connection_starts_calls_as_they_come_and_answers_in_order(cluster,
                                                                                client):
    """On a pipelined connection (MAGIC_PIPELINED, the SDK producer's) a client sends
    frames without waiting for answers: each call starts as its frame arrives, so a
    Produce sent behind a Fetch waiting on the empty partition wakes that Fetch, and
    answers come in the order of the frames, refusals in their places; more frames than
    MAX_PIPELINED at once wait their turn, none lost."""
    topic = create_online(client, "link-pipelined", 1)
    address, server = owner_of(client, topic, 0)
    produce = CALL_NUMBERS["PartitionService", "Produce"]
    fetch = CALL_NUMBERS["PartitionService", "Fetch"]
    wait = partition_pb2.FetchRequest(items=[partition_pb2.FetchItem(
        topic_partition=common_pb2.TopicPartition(topic=topic, partition=0), fetch_offset=0)],
        isolation_level=common_pb2.ISOLATION_LEVEL_READ_UNCOMMITTED, max_wait_ms=5_000)
    count = 3 * MAX_PIPELINED
    frames = [call_frame(fetch, wait.SerializeToString())]
    for i in range(count):
        frames.append(call_frame(produce, produce_request(topic, 0, b"p-%02d" % i)
                                 .SerializeToString()))
        if i == 1:
            frames.append(call_frame(200, b""))  # no such method: refused in its place
    with connect(link_address(cluster, server), MAGIC_PIPELINED) as sock:
        began = time.monotonic()
        sock.sendall(b"".join(frames))
        kind, payload = read_frame(sock)
        waited = time.monotonic() - began
        assert kind == KIND_ANSWER
        fetched = partition_pb2.FetchResponse.FromString(payload).results[0]
        assert not fetched.error.reason and fetched.next_fetch_offset >= 1, fetched
        assert waited < 4.0, waited  # woken by the Produce behind it, not at its deadline
        offsets = []
        for i in range(count):
            kind, payload = read_frame(sock)
            assert kind == KIND_ANSWER, i
            result = partition_pb2.ProduceResponse.FromString(payload).results[0]
            assert not result.error.reason, result
            offsets.append(result.base_offset)
            if i == 1:
                kind, payload = read_frame(sock)
                assert kind == KIND_ERROR
                assert partition_pb2.ItemError.FromString(payload).reason == "UNIMPLEMENTED"
        assert offsets == list(range(count))  # appended in the order they were sent
    assert values(client, topic, "read_uncommitted") == [b"p-%02d" % i for i in range(count)]

def test_call_link_reuses_connections_and_maps_errors(cluster, client):
    """CallLink against a real partition server: sequential calls share one kept
    connection; the servicer's refusal raises what gRPC raises (the same reason); a
    kept connection the peer closed is not used for the next call."""
    topic = create_online(client, "link-client", 1)
    address, server = owner_of(client, topic, 0)
    link = link_address(cluster, server)

    async def run():
        channel = grpc.aio.insecure_channel(address)
        stub = CallLink(link, partition_pb2_grpc.PartitionServiceStub(channel))
        try:
            for i in range(3):
                reply = await stub.Produce(produce_request(topic, 0, b"v%d" % i), timeout=10)
                assert reply.results[0].base_offset == i
            assert stub._connections == 1 and len(stub._idle) == 1
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.StageTxn(partition_pb2.StageTxnRequest(), timeout=10)
            assert from_rpc_error(refused.value).reason == "INVALID_ARGUMENT"
            assert stub._connections == 1  # an error frame keeps the connection
            # The peer closes the kept connection (as a restarted server would): the next
            # call opens another instead of failing.
            stub._idle[0].transport.abort()
            await asyncio.sleep(0.05)
            reply = await stub.Produce(produce_request(topic, 0, b"again"), timeout=10)
            assert reply.results[0].base_offset == 3
            assert stub._connections == 1
        finally:
            stub.close()
            await channel.close()

    asyncio.run(run())


def test_unreachable_or_silent_links(cluster, client):
    """A link nobody listens on: the call goes over gRPC (counted), and so do the calls of
    the next RETRY_LINK_AFTER_S; the routes are asked to refresh. A peer that takes the call and never answers: the
    deadline raises REQUEST_TIMED_OUT, and the connection is dropped."""
    topic = create_online(client, "link-down", 1)
    address, _ = owner_of(client, topic, 0)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{unused.getsockname()[1]}"

    def fallback_count() -> float:
        return REGISTRY.get_sample_value("atomlog_link_call_fallbacks_total",
                                         {"method": "Produce"}) or 0.0

    async def run():
        channel = grpc.aio.insecure_channel(address)
        grpc_stub = partition_pb2_grpc.PartitionServiceStub(channel)
        unreachable: list[str] = []  # the coordinator's routes refresh on this call
        stub = CallLink(dead, grpc_stub, on_unreachable=lambda: unreachable.append(dead))
        silent_frames: list[bytes] = []

        async def silent(reader, writer):  # reads a call, never answers
            silent_frames.append(await reader.read(1 << 16))
            await asyncio.sleep(30)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        try:
            counted = fallback_count()
            for i in range(2):
                reply = await stub.Produce(produce_request(topic, 0, b"g%d" % i), timeout=10)
                assert reply.results[0].base_offset == i
            assert fallback_count() == counted + 2
            assert unreachable == [dead]  # the second call did not try to connect
            assert stub.down_until > 0 and stub._connections == 0
            port = server.sockets[0].getsockname()[1]
            hung = CallLink(f"127.0.0.1:{port}", grpc_stub)
            with pytest.raises(grpc.aio.AioRpcError) as timed_out:
                await hung.Produce(produce_request(topic, 0, b"never"), timeout=0.3)
            assert from_rpc_error(timed_out.value).reason == "REQUEST_TIMED_OUT"
            assert hung._connections == 0 and not hung._idle
            wait_for = asyncio.get_running_loop().time() + 5
            while not silent_frames and asyncio.get_running_loop().time() < wait_for:
                await asyncio.sleep(0.01)
            assert silent_frames and silent_frames[0].startswith(MAGIC)
        finally:
            server.close()
            stub.close()
            await channel.close()

    asyncio.run(run())
    # Nothing reached the log through the silent peer: only the two gRPC appends.
    assert values(client, topic, "read_uncommitted") == [b"g0", b"g1"]
