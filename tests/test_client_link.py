"""The SDK's calls on the servers' links (spark_client/link.py; docs/clients.md, "The
link"): on the cluster and on the combined server, CommitTxn and CommitTxns go on the link
each coordinator advertises in the metadata, and a consumer's Fetch and a subscription
consumer's Receive, Ack and Nack on the link of each partition server, none sent over
gRPC; the answers, refusals included, are gRPC's; a link that cannot be reached sends the
calls over gRPC; Client(links=False) uses gRPC only; a kept connection the server closed
is not used."""

from __future__ import annotations

import os
import socket
import threading
import time

import grpc
import pytest

from atomlog.v1 import common_pb2, coordinator_pb2, metadata_pb2, partition_pb2
from services.errors import from_rpc_error
from spark_client import Client
from tests.conftest import create_online, metric_sum, wait_until
from tests.link_tools import calls_by_way

pytestmark = pytest.mark.cluster

METHODS = ("CommitTxn", "CommitTxns")
# An abort by key answers ABORTING, then ABORTED once its markers are written.
ABORTED = (coordinator_pb2.TXN_STATE_ABORTING, coordinator_pb2.TXN_STATE_ABORTED)


def coordinator_calls(cluster, methods=METHODS) -> dict[str, dict[str, float]]:
    """The coordinators' calls of each method: {"link": ..., "grpc": ...}."""
    roles = ("combined",) if cluster.combined else ("coordinator",)
    return calls_by_way([p["metrics_address"] for p in cluster.services() if p["role"] in roles],
                        "CoordinatorService", methods)


SUBSCRIPTION_METHODS = ("Receive", "Ack", "Nack")


def _partition_metrics(cluster) -> list[str]:
    """The metrics endpoints of the processes that are partition servers."""
    roles = ("combined",) if cluster.combined else ("partition_server",)
    return [p["metrics_address"] for p in cluster.services() if p["role"] in roles]


def partition_server_calls(cluster) -> dict[str, dict[str, float]]:
    """The partition servers' subscription calls: {"link": ..., "grpc": ...}."""
    return calls_by_way(_partition_metrics(cluster), "PartitionService", SUBSCRIPTION_METHODS)


def grew(before: dict, after: dict, methods=METHODS) -> dict[str, dict[str, float]]:
    return {way: {m: after[way][m] - before[way][m] for m in methods} for way in before}


def commit_each(client: Client, producer, topic: str, values: list[bytes],
                partitions: int = 1) -> None:
    """One transaction per value, committed before the next begins (value i to partition
    i % partitions)."""
    for i, value in enumerate(values):
        with client.transaction(timeout_s=30) as txn:
            producer.send(topic, value, partition=i % partitions, txn=txn)


def committed_values(client: Client, topic: str, expected: int) -> list[bytes]:
    """The read_committed values of `topic` once `expected` are there (markers are
    written after the commit answers), and a quiet half second more: a duplicate shows."""
    seen: list[bytes] = []
    with client.consumer([topic], isolation="read_committed", start="earliest") as consumer:
        wait_until(lambda: seen.extend(m.value for m in consumer.poll(timeout_s=0.2))
                   or len(seen) >= expected, 30, f"{expected} committed records of {topic}")
        time.sleep(0.5)
        seen.extend(m.value for m in consumer.poll(timeout_s=0.2))
    return sorted(seen)


def owned_tc_partition(client: Client) -> tuple[int, str]:
    """A TC partition with an owner now, and its owner's gRPC address (in a cluster
    just started, the coordinators are still taking their leases)."""
    def owned():
        client.metadata.refresh()
        return [(k, a) for k, a in sorted(client.metadata.tc_routes.items()) if a]

    wait_until(lambda: owned(), 30, "a TC partition with an owner")
    return owned()[0]


@pytest.fixture(params=["cluster", "combined"])
def shape(request):
    return request.getfixturevalue(request.param)


def test_one_call_commits_go_on_the_coordinators_links(shape):
    """Every coordinator advertises its link (the combined server its one link); the SDK's
    commits, alone (CommitTxn) and pipelined (CommitTxns), go there and none over gRPC;
    each committed exactly once."""
    topic_name = f"client-link-{'combined' if shape.combined else 'cluster'}"
    with Client(shape.info["bootstrap"]) as client:
        servers = client.metadata.call("GetMetadata", metadata_pb2.GetMetadataRequest()).servers
        coordinators = [s for s in servers if s.role == 2]  # SERVER_ROLE_COORDINATOR
        assert coordinators and all(s.link_address for s in coordinators), servers
        partition_servers = [s for s in servers if s.role == 1]
        assert all(s.link_address for s in partition_servers)
        if shape.combined:  # one process, one link
            assert {s.link_address for s in servers if s.role in (1, 2)} == \
                {coordinators[0].link_address}
        topic = create_online(client, topic_name, 2)
        before = coordinator_calls(shape)
        with client.producer(linger_ms=0) as producer:
            commit_each(client, producer, topic, [b"alone-%d" % i for i in range(5)], 2)
            pending = []
            for i in range(12):  # pipelined: those queued behind one in flight ride together
                txn = client.begin_transaction(timeout_s=30)
                producer.send(topic, b"piped-%02d" % i, partition=i % 2, txn=txn)
                pending.append(txn.commit_async())
            for future in pending:
                future.result(timeout=60)
        change = grew(before, coordinator_calls(shape))
        assert change["grpc"] == {"CommitTxn": 0, "CommitTxns": 0}, change
        assert change["link"]["CommitTxn"] >= 5, change
        assert change["link"]["CommitTxn"] + change["link"]["CommitTxns"] == client.links.calls
        assert client.links.fallbacks == 0
        # The sequential commits reused their connections; the pipelined ones took at
        # most the 16 commit threads' worth.
        assert all(1 <= link.connects <= 16 for link in client.links._links.values())
        assert committed_values(client, topic, 17) == sorted(
            [b"alone-%d" % i for i in range(5)] + [b"piped-%02d" % i for i in range(12)])


def test_streaming_transactions_call_their_coordinator_on_its_link(shape):
    """The streaming path's calls to a coordinator (NewTxn, AddPartitionToTxn, EndTxn; an
    ack's subscription, when the client registers it, AddSubscriptionToTxn) go on its
    link too, and so do the partition servers' VerifyTxnPartitions: none over gRPC (on
    the combined server the verifications are function calls)."""
    methods = ("NewTxn", "AddPartitionToTxn", "AddSubscriptionToTxn", "EndTxn",
               "VerifyTxnPartitions")
    name = f"client-link-stream-{'combined' if shape.combined else 'cluster'}"
    with Client(shape.info["bootstrap"], one_call_max_bytes=0) as client:
        topic = create_online(client, name, 2)
        with client.producer(linger_ms=0) as producer:
            producer.send(topic, b"input", partition=0).result(timeout=30)
        before = coordinator_calls(shape, methods)
        with client.consumer([topic], subscription=f"{name}-sub") as consumer, \
                client.producer(linger_ms=0) as producer:
            messages = []
            while not messages:
                messages = consumer.poll(timeout_s=1.0)
            for i in range(3):
                with client.transaction(timeout_s=30) as txn:
                    producer.send(topic, b"streamed-%d" % i, partition=1, txn=txn)
                    if i == 0:
                        consumer.ack(messages, txn=txn)
        change = grew(before, coordinator_calls(shape, methods), methods)
        assert all(n == 0 for n in change["grpc"].values()), change
        assert change["link"]["NewTxn"] == 3 and change["link"]["EndTxn"] == 3, change
        assert change["link"]["AddPartitionToTxn"] >= 1, change
        assert client.links.fallbacks == 0
        if not shape.combined:
            # The partition servers asked the coordinators about the transactions' first
            # writes and acks on the coordinators' links too (partition_server/verifier.py).
            assert change["link"]["VerifyTxnPartitions"] >= 3, change


def refused_alike(link, method: str, over_grpc, request) -> str:
    """`request` refused on the link as over gRPC (`over_grpc`, the stub's method): the
    same reason, message and gRPC code. Returns the reason."""
    with pytest.raises(grpc.RpcError) as on_link:
        link.call(method, request, 10)
    with pytest.raises(grpc.RpcError) as on_grpc:
        over_grpc(request, timeout=10)
    ours, theirs = from_rpc_error(on_link.value), from_rpc_error(on_grpc.value)
    assert (ours.reason, ours.message) == (theirs.reason, theirs.message)
    assert on_link.value.code() == on_grpc.value.code()
    return ours.reason


def preload(client: Client, topic: str, values: list[bytes], partitions: int) -> None:
    """Write `values` round-robin over the topic's `partitions`, each acknowledged."""
    with client.producer(linger_ms=0) as producer:
        for i, value in enumerate(values):
            producer.send(topic, value, partition=i % partitions)
        producer.flush()


def consume_all(consumer, expected: int, nack_first: bool = False) -> list[bytes]:
    """Poll and ack until `expected` values were acked (with nack_first, each first poll's
    messages are nacked once instead, and come back)."""
    acked: list[bytes] = []
    nacked: set[tuple[int, int]] = set()

    def step():
        messages = consumer.poll(timeout_s=0.5, max_records=50)
        again = [m for m in messages if nack_first and (m.partition, m.offset) not in nacked]
        if again:
            consumer.nack(again)
            nacked.update((m.partition, m.offset) for m in again)
        done = [m for m in messages if m not in again]
        consumer.ack(done)
        acked.extend(m.value for m in done)
        return len(acked) >= expected

    wait_until(step, 60, f"{expected} acked")
    return sorted(acked)


def test_a_subscription_consumer_calls_the_partition_servers_on_their_links(shape):
    """Receive, Ack and Nack go on each partition server's link: several servers at
    once on the cluster (the links' threads), the combined server's one link; none over
    gRPC. Every value is acked once; the nacked ones came back first."""
    name = f"client-link-sub-{'combined' if shape.combined else 'cluster'}"
    values = [b"v-%03d" % i for i in range(60)]
    with Client(shape.info["bootstrap"]) as client:
        topic = create_online(client, name, 3)
        preload(client, topic, values, 3)
        client.metadata.refresh()
        servers = {client.metadata.route(topic, p).address for p in range(3)}
        assert all(client.metadata.partition_links.get(a) for a in servers), \
            client.metadata.partition_links
        before = partition_server_calls(shape)
        with client.consumer(topic, subscription=f"{name}-sub") as consumer:
            assert consume_all(consumer, len(values), nack_first=True) == values
        change = grew(before, partition_server_calls(shape), SUBSCRIPTION_METHODS)
        assert change["grpc"] == dict.fromkeys(SUBSCRIPTION_METHODS, 0), change
        assert all(change["link"][m] >= 1 for m in SUBSCRIPTION_METHODS), change
        assert client.links.fallbacks == 0 and client.links.calls >= sum(
            change["link"].values())
        if not shape.combined:
            assert len(servers) > 1  # calls to several servers went at once


def test_a_consumer_fetches_on_the_partition_servers_links(shape):
    """A plain consumer's Fetch calls (the Spark source reads the same way) go on the
    partition servers' links: several at once on the cluster, none over gRPC; it reads
    every committed value once, and nothing of an aborted transaction."""
    name = f"client-link-fetch-{'combined' if shape.combined else 'cluster'}"
    with Client(shape.info["bootstrap"]) as client:
        topic = create_online(client, name, 3)
        with client.producer(linger_ms=0) as producer:
            commit_each(client, producer, topic, [b"f-%02d" % i for i in range(12)], 3)
            txn = client.begin_transaction(timeout_s=30)
            producer.send(topic, b"aborted", partition=0, txn=txn)
            txn.abort()
        before = calls_by_way(_partition_metrics(shape), "PartitionService", ("Fetch",))
        # A long poll runs on the polling thread, not on the links' threads (which it
        # would hold for its whole wait): only Fetches that do not wait go there.
        waits: list[int] = []
        submit = client.links.submit
        client.links.submit = lambda call, request, timeout_s: (
            waits.append(request.max_wait_ms), submit(call, request, timeout_s))[1]
        assert committed_values(client, topic, 12) == [b"f-%02d" % i for i in range(12)]
        with client.consumer([topic], isolation="read_committed", start="latest") as idle:
            began = time.monotonic()
            assert idle.poll(timeout_s=0.5) == []
            assert time.monotonic() - began >= 0.4  # it waited (long polls, or short ones)
        change = grew(before, calls_by_way(_partition_metrics(shape), "PartitionService",
                                           ("Fetch",)), ("Fetch",))
        assert change["grpc"]["Fetch"] == 0 and change["link"]["Fetch"] >= 1, change
        assert client.links.fallbacks == 0 and not any(waits), waits



def produce_calls(cluster) -> dict[str, dict[str, float]]:
    """The partition servers' Produce calls: {"link": ..., "grpc": ...}."""
    return calls_by_way(_partition_metrics(cluster), "PartitionService", ("Produce",))


def out_of_order_refusals(cluster) -> float:
    return sum(metric_sum(address, 'atomlog_partition_rejected_batches_total{reason='
                          '"OUT_OF_ORDER_SEQUENCE"}') for address in _partition_metrics(cluster))


def produce_in_order(client: Client, topic: str, partitions: int, count: int,
                     **options) -> None:
    """`count` values to each partition through one producer, every one acknowledged;
    then each partition holds exactly its values, in send order."""
    sent = {p: [b"%d-%04d" % (p, i) for i in range(count)] for p in range(partitions)}
    with client.producer(**options) as producer:
        futures = [producer.send(topic, sent[p][i], partition=p)
                   for i in range(count) for p in range(partitions)]
        for future in futures:
            future.result(timeout=60)
    read: dict[int, list[bytes]] = {p: [] for p in range(partitions)}
    with client.consumer([topic], isolation="read_uncommitted", start="earliest") as consumer:
        for chunk in consumer.read_until():
            for message in chunk:
                read[message.partition].append(message.value)
    assert read == sent


def test_a_producer_s_batches_go_on_the_partition_servers_links_in_order(shape):
    """An idempotent producer's Produce calls go on one pipelined connection to each
    partition server's link (Pipeline): several unanswered at once, none over gRPC, and
    none overtaking another (no batch refused as out of order); every record is written
    once, in send order."""
    name = f"client-link-produce-{'combined' if shape.combined else 'cluster'}"
    with Client(shape.info["bootstrap"]) as client:
        topic = create_online(client, name, 3)
        before, refused = produce_calls(shape), out_of_order_refusals(shape)
        produce_in_order(client, topic, 3, 400, linger_ms=0, batch_max_bytes=1024)
        change = grew(before, produce_calls(shape), ("Produce",))
        assert change["grpc"]["Produce"] == 0 and change["link"]["Produce"] >= 10, change
        assert out_of_order_refusals(shape) == refused
        pipelines = list(client.links._pipelines.values())
        assert pipelines and max(p.most_unanswered for p in pipelines) > 1
        assert all(p.connects == 1 for p in pipelines) and client.links.fallbacks == 0
        assert len(pipelines) == (1 if shape.combined else len(
            {client.metadata.route(topic, p).address for p in range(3)}))


def test_a_producer_sends_over_grpc_to_a_link_it_cannot_use(cluster):
    """A link that cannot be reached, or that closes a pipelined connection at once (a
    server from before pipelining): the producer's calls go over gRPC (after one resend
    of what the closed connection took), and every record is written once, in order;
    with Client(links=False), gRPC only."""
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    old = socket.socket()  # takes connections and closes each once its magic came
    old.bind(("127.0.0.1", 0))
    old.listen()
    closer = threading.Thread(target=_close_each, args=(old,), daemon=True)
    closer.start()
    ways = {"unreachable": dead, "old": "127.0.0.1:%d" % old.getsockname()[1], "off": None}
    try:
        for way, address in ways.items():
            with Client(cluster.info["bootstrap"], links=way != "off") as client:
                topic = create_online(client, f"client-link-produce-{way}", 2)
                if address:
                    _links_at(client, address)
                before = produce_calls(cluster)
                produce_in_order(client, topic, 2, 30, linger_ms=0)
                change = grew(before, produce_calls(cluster), ("Produce",))
                assert change["grpc"]["Produce"] >= 2, (way, change)
                assert client.links.calls == 0, way
                assert (client.links.fallbacks >= 1) == (way != "off"), way
    finally:
        old.close()


def _links_at(client: Client, address: str) -> None:
    """Every partition server's link at `address`, in this metadata and after each
    refresh (a producer refreshes it after SERVER_UNAVAILABLE)."""
    metadata, refresh = client.metadata, client.metadata.refresh

    def refresh_there(*args, **options):
        refresh(*args, **options)
        metadata.partition_links = dict.fromkeys(metadata.partition_links, address)

    metadata.refresh = refresh_there
    metadata.refresh()


def _close_each(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.recv(8)

def test_subscription_refusals_on_a_link_are_grpc_s(cluster):
    """An Ack the server refuses, on the link and over gRPC: the same reason and message,
    the same gRPC code."""
    with Client(cluster.info["bootstrap"]) as client:
        topic = create_online(client, "client-link-sub-refused", 1)
        client.metadata.refresh()
        address = client.metadata.route(topic, 0).address
        link = client.links.get(address, client.metadata.partition_links[address])
        stub = client.channels.partition(address)
        no_items = partition_pb2.AckRequest()
        assert refused_alike(link, "Ack", stub.Ack, no_items) == "INVALID_ARGUMENT"
        # An item refused on its own (no such subscription): in the answer, alike.
        sp = common_pb2.SubscriptionPartition(topic=topic, partition=0, subscription="nobody")
        item = partition_pb2.AckRequest(items=[partition_pb2.AckItem(
            subscription_partition=sp, cumulative_end_offset=1)])
        assert link.call("Ack", item, 10) == stub.Ack(item, timeout=10)


def test_unreachable_partition_links_and_links_off_send_the_subscription_calls_over_grpc(
        cluster):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    values = [b"g-%02d" % i for i in range(20)]
    with Client(cluster.info["bootstrap"]) as client:
        topic = create_online(client, "client-link-sub-grpc", 2)
        preload(client, topic, values, 2)
    for links in ("unreachable", "off"):
        with Client(cluster.info["bootstrap"], links=links != "off") as client:
            client.metadata.refresh()
            client.metadata.partition_links = dict.fromkeys(client.metadata.partition_links,
                                                            dead)
            before = partition_server_calls(cluster)
            with client.consumer(topic, subscription=f"grpc-{links}") as consumer:
                assert consume_all(consumer, len(values)) == values
            change = grew(before, partition_server_calls(cluster), SUBSCRIPTION_METHODS)
            assert change["link"] == dict.fromkeys(SUBSCRIPTION_METHODS, 0), change
            assert change["grpc"]["Receive"] >= 1 and change["grpc"]["Ack"] >= 1, change
            assert client.links.calls == 0
            assert client.links.fallbacks == (0 if links == "off" else len(
                client.links._links)) and (links == "off") == (not client.links._links)


def test_without_links_the_commits_go_over_grpc(cluster):
    with Client(cluster.info["bootstrap"], links=False) as client:
        topic = create_online(client, "client-link-off", 1)
        before = coordinator_calls(cluster)
        with client.producer(linger_ms=0) as producer:
            commit_each(client, producer, topic, [b"grpc-%d" % i for i in range(3)])
        change = grew(before, coordinator_calls(cluster))
        assert change["link"]["CommitTxn"] == 0 and change["grpc"]["CommitTxn"] == 3, change
        assert client.links.calls == 0


def test_a_link_that_cannot_be_reached_sends_the_commits_over_grpc(cluster):
    """A coordinator link that refuses connections: the commit goes over gRPC at once,
    and so do the next ones without trying the link again for a while."""
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    with Client(cluster.info["bootstrap"]) as client:
        topic = create_online(client, "client-link-unreachable", 1)
        client.metadata.refresh()
        client.metadata.coordinator_links = dict.fromkeys(client.metadata.coordinator_links,
                                                          dead)
        before = coordinator_calls(cluster)
        with client.producer(linger_ms=0) as producer:
            commit_each(client, producer, topic, [b"fallback-%d" % i for i in range(6)])
        change = grew(before, coordinator_calls(cluster))
        assert change["grpc"]["CommitTxn"] == 6 and change["link"]["CommitTxn"] == 0, change
        # Each coordinator's link tried once (its transactions' TC partitions are
        # random), then left alone.
        tried = client.links._links.values()
        assert client.links.calls == 0 and 1 <= client.links.fallbacks == len(tried) <= 3
        assert all(link.down_until > time.monotonic() for link in tried)
        assert committed_values(client, topic, 6) == [b"fallback-%d" % i for i in range(6)]


def test_link_answers_and_refusals_are_grpc_s(cluster):
    """The same call on the link and over gRPC: the same refusal (reason and message);
    an abort by key answers alike. A kept connection the server closed is not used: the
    next call opens another."""
    with Client(cluster.info["bootstrap"]) as client:
        k, address = owned_tc_partition(client)
        link = client.links.get(address, client.metadata.coordinator_links[address])
        stub = client.channels.coordinator(address)
        no_key = coordinator_pb2.CommitTxnRequest(tc_partition=k)
        assert refused_alike(link, "CommitTxn", stub.CommitTxn, no_key) == "INVALID_ARGUMENT"
        empty = coordinator_pb2.CommitTxnsRequest()
        with pytest.raises(grpc.RpcError) as chained:
            link.call("CommitTxns", empty, 10)
        assert from_rpc_error(chained.value).reason == "INVALID_ARGUMENT"
        # An abort of a key nobody used, on both.
        from coordinator.records import tc_partition_for
        key = next(f"link-abort-{i}" for i in range(10_000)
                   if tc_partition_for(f"link-abort-{i}", len(client.metadata.tc_routes)) == k)
        abort = coordinator_pb2.CommitTxnRequest(tc_partition=k, idempotency_key=key,
                                                 abort=True)
        assert link.call("CommitTxn", abort, 10).state in ABORTED
        assert stub.CommitTxn(abort, timeout=10).state in ABORTED
        # The kept connection, closed under the client (as a restarted server's would
        # be): seen readable (its EOF) and dropped, not used.
        assert len(link._idle) == 1
        kept = link._idle[0].sock
        kept.shutdown(socket.SHUT_RDWR)
        assert link.call("CommitTxn", abort, 10).state in ABORTED
        assert stub.CommitTxn(abort, timeout=10).state in ABORTED
        assert len(link._idle) == 1 and link._idle[0].sock is not kept and link._open == 1
        assert link.connects == 2  # the first, kept for every call until it was closed


def test_a_forked_child_drops_the_parent_s_connections(cluster):
    """After fork the child drops the parent's kept connections (they are the parent's
    streams: closing its copies of them leaves the parent's up) and calls on its own; the
    parent's kept connection still answers. (The child makes no gRPC call: gRPC's core
    is not fork-safe here.)"""
    from coordinator.records import tc_partition_for

    with Client(cluster.info["bootstrap"]) as client:
        k, address = owned_tc_partition(client)
        link = client.links.get(address, client.metadata.coordinator_links[address])
        key = next(f"link-fork-{i}" for i in range(10_000)
                   if tc_partition_for(f"link-fork-{i}", len(client.metadata.tc_routes)) == k)
        abort = coordinator_pb2.CommitTxnRequest(tc_partition=k, idempotency_key=key,
                                                 abort=True)
        assert link.call("CommitTxn", abort, 10).state in ABORTED
        parent_socket = link._idle[0].sock
        pid = os.fork()
        if pid == 0:  # the child: reports by its exit status only
            status = 1
            try:
                if not link._idle and link._open == 0:
                    status = 2
                    if link.call("CommitTxn", abort, 10).state in ABORTED and \
                            link._idle[0].sock is not parent_socket:
                        status = 0
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert link.call("CommitTxn", abort, 10).state in ABORTED
        assert link._idle[0].sock is parent_socket and link._open == 1
