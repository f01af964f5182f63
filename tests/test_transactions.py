"""Transactions end to end on real processes: the partition servers' transaction buffer
(verification with the coordinator, markers as control batches, max read position,
read_committed filtering) driven through the SDK, and survival of kill -9."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc
from partition_server.record_batch import Record, encode_batch
from services.errors import from_rpc_error
from spark_client import Client, errors
from tests.conftest import wait_until

TOPICS = ("tx-a", "tx-b", "tx-c")
PARTITIONS = 4


@pytest.fixture(scope="module")
def client(cluster):
    client = Client(cluster.info["bootstrap"])
    for topic in (*TOPICS, "tx-solo", "tx-crash"):
        try:
            client.create_topic(topic, partitions=PARTITIONS)
        except errors.TopicAlreadyExists:
            pass
    yield client
    client.close()


def read_all(client, topics, isolation: str, settle_s: float = 0.3) -> list:
    """Every message of `topics` from the start, under `isolation`."""
    with client.consumer(list(topics), isolation=isolation, start="earliest") as consumer:
        messages, quiet_since = [], time.monotonic()
        while time.monotonic() - quiet_since < settle_s:
            batch = consumer.poll(timeout_s=0.1, max_records=10_000)
            if batch:
                messages.extend(batch)
                quiet_since = time.monotonic()
        return messages


def values(messages) -> list[bytes]:
    return [m.value for m in messages]


def describe(client, topic: str, partition: int):
    address = client.metadata.route(topic, partition).address
    stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(address))
    return stub.DescribePartition(partition_pb2.DescribePartitionRequest(
        topic_partition=common_pb2.TopicPartition(topic=topic, partition=partition)), timeout=10)


def produce_raw(client, topic: str, partition: int, batch: bytes):
    address = client.metadata.route(topic, partition).address
    stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(address))
    reply = stub.Produce(partition_pb2.ProduceRequest(items=[partition_pb2.ProduceItem(
        topic_partition=common_pb2.TopicPartition(topic=topic, partition=partition),
        record_batch=batch)]), timeout=20)
    return reply.results[0]


def test_a_transaction_over_three_topics_is_invisible_until_commit(client):
    before = len(read_all(client, TOPICS, "read_committed"))
    with client.producer() as producer:
        txn = client.begin_transaction(timeout_s=60)
        sent = []
        for topic in TOPICS:
            for partition in range(PARTITIONS):
                for i in range(5):
                    value = f"{topic}/{partition}/{i}".encode()
                    sent.append(value)
                    producer.send(topic, value, partition=partition, txn=txn)
        producer.flush()
        # Written, durable, but not committed: read_uncommitted sees it, read_committed not.
        assert len(read_all(client, TOPICS, "read_committed")) == before
        uncommitted = values(read_all(client, TOPICS, "read_uncommitted"))
        assert set(sent) <= set(uncommitted)
        d = describe(client, "tx-a", 0)
        assert [(t.txn_id.tc_partition, t.txn_id.sequence) for t in d.open_transactions] == \
            [txn.key]
        assert d.max_read_position <= d.open_transactions[0].first_offset < d.high_watermark
        txn.commit(wait_for_markers=True)
    committed = values(read_all(client, TOPICS, "read_committed"))
    assert sorted(v for v in committed if v in set(sent)) == sorted(sent)
    assert len(committed) == before + len(sent)  # exactly once, markers not delivered
    d = describe(client, "tx-a", 0)
    assert not d.open_transactions and d.max_read_position == d.high_watermark
    assert d.coordinator_epochs[txn.key[0]] >= 1


def test_aborted_data_is_never_visible_and_is_listed_for_uncommitted_readers(client):
    with client.producer() as producer:
        txn = client.begin_transaction(timeout_s=60)
        for i in range(20):
            producer.send("tx-solo", f"aborted-{i}", partition=1, txn=txn)
        producer.flush()
        txn.abort()
        plain = producer.send("tx-solo", "plain-after-abort", partition=1)
        plain.result(10)
    wait_until(lambda: describe(client, "tx-solo", 1).aborted_transaction_count >= 1, 10,
               "the ABORT marker")
    committed = values(read_all(client, ["tx-solo"], "read_committed"))
    assert b"plain-after-abort" in committed
    assert not [v for v in committed if v.startswith(b"aborted-")]
    # read_uncommitted gets the aborted batches and the list to hide them itself.
    address = client.metadata.route("tx-solo", 1).address
    stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(address))
    reply = stub.Fetch(partition_pb2.FetchRequest(
        items=[partition_pb2.FetchItem(topic_partition=common_pb2.TopicPartition(
            topic="tx-solo", partition=1), fetch_offset=0)],
        isolation_level=common_pb2.ISOLATION_LEVEL_READ_UNCOMMITTED), timeout=10)
    aborted = reply.results[0].aborted_transactions
    assert (aborted[-1].txn_id.tc_partition, aborted[-1].txn_id.sequence) == txn.key


def test_an_open_transaction_holds_back_later_plain_writes(client):
    with client.producer() as producer:
        txn = client.begin_transaction(timeout_s=60)
        producer.send("tx-solo", "open-txn", partition=2, txn=txn).result(10)
        producer.send("tx-solo", "plain-behind", partition=2).result(10)
        assert b"plain-behind" not in values(read_all(client, ["tx-solo"], "read_committed"))
        assert b"plain-behind" in values(read_all(client, ["tx-solo"], "read_uncommitted"))
        txn.commit(wait_for_markers=True)
    committed = values(read_all(client, ["tx-solo"], "read_committed"))
    assert committed.index(b"open-txn") < committed.index(b"plain-behind")


def test_writes_need_verification_and_late_writes_are_refused(client):
    """Server side, raw batches: a partition not added to the transaction, a write after
    the abort, and a non-idempotent transactional batch are refused, appending nothing."""
    producer_id, epoch = client.allocate_producer_id()
    txn = client.begin_transaction(timeout_s=60)
    txn.register_partitions([("tx-solo", 3)])

    def batch(seq: int) -> bytes:
        return encode_batch([Record(value=b"raw")], producer_id=producer_id,
                            producer_epoch=epoch, base_sequence=seq, txn=txn.key)

    hw = describe(client, "tx-solo", 0).high_watermark
    result = produce_raw(client, "tx-solo", 0, batch(0))
    assert result.error.reason == "PARTITION_NOT_IN_TRANSACTION"
    assert describe(client, "tx-solo", 0).high_watermark == hw
    assert not produce_raw(client, "tx-solo", 3, batch(0)).error.reason
    txn.abort()
    wait_until(lambda: not describe(client, "tx-solo", 3).open_transactions, 10, "the marker")
    late = produce_raw(client, "tx-solo", 3, batch(1))
    assert late.error.reason in ("TRANSACTION_NOT_OPEN", "TRANSACTION_ABORTED")
    assert not describe(client, "tx-solo", 3).open_transactions  # nothing hangs
    plain = encode_batch([Record(value=b"raw")], txn=txn.key)
    assert produce_raw(client, "tx-solo", 3, plain).error.reason == "INVALID_ARGUMENT"


def test_a_zombie_session_cannot_write_or_commit(client):
    first = client.producer(transactional_id="copier-1")
    zombie_txn = first.begin_transaction(timeout_s=60)
    first.send("tx-solo", "zombie-1", partition=0, txn=zombie_txn).result(10)
    second = client.producer(transactional_id="copier-1")  # fences the first session
    assert second.epoch > first.epoch or second.producer_id != first.producer_id
    with pytest.raises(errors.AtomlogClientError) as late_send:
        first.send("tx-solo", "zombie-2", partition=0, txn=zombie_txn).result(10)
    assert late_send.value.reason in ("TRANSACTION_ABORTED", "TRANSACTION_NOT_OPEN",
                                      "PRODUCER_FENCED")
    with pytest.raises(errors.ProducerFenced):
        zombie_txn.commit()
    with pytest.raises(errors.ProducerFenced):
        first.begin_transaction()
    txn = second.begin_transaction()
    second.send("tx-solo", "live-1", partition=0, txn=txn)
    txn.commit(wait_for_markers=True)
    committed = values(read_all(client, ["tx-solo"], "read_committed"))
    assert b"live-1" in committed and not {b"zombie-1", b"zombie-2"} & set(committed)
    first.close()
    second.close()


def test_transaction_state_survives_kill_9_of_every_partition_server(cluster, client):
    """Committed data stays visible, aborted data invisible, and an open transaction
    keeps holding the max read position, after every partition server is killed -9 and
    restarted (recovery from transaction-buffer snapshots plus the log tail)."""
    with client.producer() as producer:
        committed_txn = client.begin_transaction(timeout_s=120)
        aborted_txn = client.begin_transaction(timeout_s=120)
        open_txn = client.begin_transaction(timeout_s=120)
        for partition in range(PARTITIONS):
            producer.send("tx-crash", f"c{partition}", partition=partition, txn=committed_txn)
            producer.send("tx-crash", f"a{partition}", partition=partition, txn=aborted_txn)
        producer.send("tx-crash", "o0", partition=0, txn=open_txn)
        producer.flush()
        committed_txn.commit(wait_for_markers=True)
        aborted_txn.abort()
        producer.send("tx-crash", "plain", partition=0).result(10)
    wait_until(lambda: all(describe(client, "tx-crash", p).aborted_transaction_count
                           for p in range(PARTITIONS)), 10, "the ABORT markers")
    expected = {b"c0", b"c1", b"c2", b"c3"}
    assert set(values(read_all(client, ["tx-crash"], "read_committed"))) == expected
    servers = [p for p in cluster.services() if p["role"] == "partition_server"]
    for server in servers:
        os.kill(server["pid"], signal.SIGKILL)
    cluster.up()

    def readable() -> bool:
        try:
            return set(values(read_all(client, ["tx-crash"], "read_committed"))) == expected
        except errors.AtomlogClientError:
            return False

    wait_until(readable, 60, "the partitions to recover")
    d = describe(client, "tx-crash", 0)
    assert [(t.txn_id.tc_partition, t.txn_id.sequence) for t in d.open_transactions] == \
        [open_txn.key]
    open_txn.commit(wait_for_markers=True)
    assert set(values(read_all(client, ["tx-crash"], "read_committed"))) == \
        expected | {b"o0", b"plain"}


def test_bad_transactional_input_is_refused_with_a_reason(client):
    producer_id, epoch = client.allocate_producer_id()
    bad = encode_batch([Record(value=b"x")], producer_id=producer_id, producer_epoch=epoch,
                       base_sequence=0, txn=(99, 1))
    result = produce_raw(client, "tx-solo", 0, bad)
    assert result.error.reason == "INVALID_ARGUMENT"
    unknown = encode_batch([Record(value=b"x")], producer_id=producer_id, producer_epoch=epoch,
                           base_sequence=0, txn=(0, 987_654_321))
    assert produce_raw(client, "tx-solo", 0, unknown).error.reason == "UNKNOWN_TRANSACTION"
    try:
        stub_error = None
        address = client.metadata.route("tx-solo", 0).address
        stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(address))
        stub.Fetch(partition_pb2.FetchRequest(items=[partition_pb2.FetchItem(
            topic_partition=common_pb2.TopicPartition(topic="tx-solo", partition=0),
            fetch_offset=-1)]), timeout=10)
    except grpc.RpcError as error:
        stub_error = from_rpc_error(error)
    assert stub_error is not None and stub_error.reason == "INVALID_ARGUMENT"
