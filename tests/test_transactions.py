"""Transactions end to end on real processes: the partition servers' transaction buffer
(verification with the coordinator, markers as control batches, max read position,
read_committed filtering) driven through the SDK, and survival of kill -9."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc
from partition_server.record_batch import Record, encode_batch, iter_batches
from partition_server.wal import plan as wal_plan
from partition_server.wal import read_frames as plan_frames
from services.errors import from_rpc_error
from spark_client import Client, errors
from tests.conftest import SHAPES_AND_PATHS, TXN_PATHS, wait_until

_TOPICS = ("tx-a", "tx-b", "tx-c")
_SUFFIX = [""]  # the current transaction path's: each path writes topics of its own


def T(name: str) -> str:  # noqa: N802 — reads as a topic name in the tests
    """The topic `name` of the current transaction path (set by the client fixture)."""
    return name + _SUFFIX[0]


def topics() -> tuple[str, ...]:
    return tuple(T(name) for name in _TOPICS)


PARTITIONS = 4


@pytest.fixture(scope="module", params=SHAPES_AND_PATHS, ids="-".join)
def shape_and_path(request):
    return request.param


@pytest.fixture(scope="module")
def servers(request, shape_and_path):
    """The multi-process cluster, then the combined server (every role in one process)."""
    return request.getfixturevalue(shape_and_path[0])


@pytest.fixture(scope="module")
def client(servers, shape_and_path):
    """With one-call transactions, then with the streaming path."""
    client = Client(servers.info["bootstrap"], one_call_max_bytes=TXN_PATHS[shape_and_path[1]])
    _SUFFIX[0] = "" if shape_and_path[1] == "one-call" else "-s"
    for topic in (*topics(), T("tx-solo"), T("tx-crash")):
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
    before = len(read_all(client, topics(), "read_committed"))
    with client.producer() as producer:
        txn = client.begin_transaction(timeout_s=60)
        sent = []
        for topic in topics():
            for partition in range(PARTITIONS):
                for i in range(5):
                    value = f"{topic}/{partition}/{i}".encode()
                    sent.append(value)
                    producer.send(topic, value, partition=partition, txn=txn)
        producer.flush()
        # Written, durable, but not committed: read_uncommitted sees it, read_committed not.
        assert len(read_all(client, topics(), "read_committed")) == before
        uncommitted = values(read_all(client, topics(), "read_uncommitted"))
        assert set(sent) <= set(uncommitted)
        d = describe(client, T("tx-a"), 0)
        assert [(t.txn_id.tc_partition, t.txn_id.sequence) for t in d.open_transactions] == \
            [txn.key]
        assert d.max_read_position <= d.open_transactions[0].first_offset < d.high_watermark
        txn.commit(wait_for_markers=True)
    committed = values(read_all(client, topics(), "read_committed"))
    assert sorted(v for v in committed if v in set(sent)) == sorted(sent)
    assert len(committed) == before + len(sent)  # exactly once, markers not delivered
    d = describe(client, T("tx-a"), 0)
    assert not d.open_transactions and d.max_read_position == d.high_watermark
    assert d.coordinator_epochs[txn.key[0]] >= 1


def test_aborted_data_is_never_visible_and_is_listed_for_uncommitted_readers(client):
    with client.producer() as producer:
        txn = client.begin_transaction(timeout_s=60)
        for i in range(20):
            producer.send(T("tx-solo"), f"aborted-{i}", partition=1, txn=txn)
        producer.flush()
        txn.abort()
        plain = producer.send(T("tx-solo"), "plain-after-abort", partition=1)
        plain.result(10)
    wait_until(lambda: describe(client, T("tx-solo"), 1).aborted_transaction_count >= 1, 10,
               "the ABORT marker")
    committed = values(read_all(client, [T("tx-solo")], "read_committed"))
    assert b"plain-after-abort" in committed
    assert not [v for v in committed if v.startswith(b"aborted-")]
    # read_uncommitted gets the aborted batches and the list to hide them itself.
    address = client.metadata.route(T("tx-solo"), 1).address
    stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(address))
    reply = stub.Fetch(partition_pb2.FetchRequest(
        items=[partition_pb2.FetchItem(topic_partition=common_pb2.TopicPartition(
            topic=T("tx-solo"), partition=1), fetch_offset=0)],
        isolation_level=common_pb2.ISOLATION_LEVEL_READ_UNCOMMITTED), timeout=10)
    aborted = reply.results[0].aborted_transactions
    assert (aborted[-1].txn_id.tc_partition, aborted[-1].txn_id.sequence) == txn.key


def test_commit_async_lets_the_next_transaction_produce_while_the_last_commits(client):
    """A stream of transactions on one producer: each commit runs in the background while
    the next transaction's sends go on; every transaction ends committed, in full, and a
    send into a transaction whose commit began is refused (nothing of it written)."""
    topic, partition = T("tx-stream"), 2
    client.create_topic(topic, partitions=PARTITIONS)
    before = len(read_all(client, [topic], "read_committed"))
    with client.producer() as producer:
        commits, sent = [], []
        for round_ in range(6):
            txn = client.begin_transaction(timeout_s=60)
            for i in range(50):
                value = f"stream-{round_}-{i}".encode()
                producer.send(topic, value, partition=partition, txn=txn)
                sent.append(value)
            commits.append((txn, txn.commit_async()))
            # (On a loaded machine the commit may have ended by then: "committed".)
            with pytest.raises(errors.TransactionNotOpen, match="committing|committed"):
                producer.send(topic, b"too-late", partition=partition, txn=txn)
        for txn, future in commits:
            assert future.result(timeout=60) is None
            assert txn.state() in ("COMMITTING", "COMMITTED")
        aborted = client.begin_transaction(timeout_s=60)
        producer.send(topic, b"aborted-in-stream", partition=partition, txn=aborted).result(10)
        aborted.abort()  # a commit after that fails in the future, as commit() would
        with pytest.raises(errors.TransactionAborted):
            aborted.commit_async().result(timeout=30)
        # 4 s, not less: on a loaded CI machine the first write alone took over 1 s.
        began = time.monotonic()
        failing = client.begin_transaction(timeout_s=4.0)
        producer.send(topic, b"timed-out-in-stream", partition=partition, txn=failing).result(10)
        time.sleep(max(0.0, began + 4.0 + 2.0 - time.monotonic()))  # past it, with a margin
        with pytest.raises(errors.TransactionTimedOut):
            failing.commit_async().result(timeout=30)
    committed = values(read_all(client, [topic], "read_committed"))
    assert len(committed) == before + len(sent)
    assert [v for v in committed if v.startswith(b"stream-")] == sent  # in send order
    assert b"too-late" not in committed and b"aborted-in-stream" not in committed
    assert b"timed-out-in-stream" not in committed


def test_an_open_transaction_holds_back_later_plain_writes(client):
    with client.producer() as producer:
        txn = client.begin_transaction(timeout_s=60)
        producer.send(T("tx-solo"), "open-txn", partition=2, txn=txn).result(10)
        producer.send(T("tx-solo"), "plain-behind", partition=2).result(10)
        assert b"plain-behind" not in values(read_all(client, [T("tx-solo")], "read_committed"))
        assert b"plain-behind" in values(read_all(client, [T("tx-solo")], "read_uncommitted"))
        txn.commit(wait_for_markers=True)
    committed = values(read_all(client, [T("tx-solo")], "read_committed"))
    assert committed.index(b"open-txn") < committed.index(b"plain-behind")


def test_writes_need_verification_and_late_writes_are_refused(client):
    """Server side, raw batches: a partition not added to the transaction, a write after
    the abort, and a non-idempotent transactional batch are refused, appending nothing."""
    producer_id, epoch = client.allocate_producer_id()
    txn = client.begin_transaction(timeout_s=60)
    txn.register_partitions([(T("tx-solo"), 3)])

    def batch(seq: int) -> bytes:
        return encode_batch([Record(value=b"raw")], producer_id=producer_id,
                            producer_epoch=epoch, base_sequence=seq, txn=txn.key)

    hw = describe(client, T("tx-solo"), 0).high_watermark
    result = produce_raw(client, T("tx-solo"), 0, batch(0))
    assert result.error.reason == "PARTITION_NOT_IN_TRANSACTION"
    assert describe(client, T("tx-solo"), 0).high_watermark == hw
    assert not produce_raw(client, T("tx-solo"), 3, batch(0)).error.reason
    txn.abort()
    wait_until(lambda: not describe(client, T("tx-solo"), 3).open_transactions, 10, "the marker")
    late = produce_raw(client, T("tx-solo"), 3, batch(1))
    assert late.error.reason in ("TRANSACTION_NOT_OPEN", "TRANSACTION_ABORTED")
    assert not describe(client, T("tx-solo"), 3).open_transactions  # nothing hangs
    plain = encode_batch([Record(value=b"raw")], txn=txn.key)
    assert produce_raw(client, T("tx-solo"), 3, plain).error.reason == "INVALID_ARGUMENT"


def test_a_retry_of_a_written_batch_is_a_duplicate_after_its_transaction_aborted(client):
    """A batch written in a transaction whose answer was lost (its server was killed, say)
    is sent again after the coordinator aborted the transaction. The truthful answer is
    "written, at these offsets": a refusal would tell the producer nothing was written,
    and it would give the batch's sequence numbers to its next batch, which the server
    would then take for this retry and drop (found by the Go loop's kill -9 test: a
    committed transaction lost its records of one partition)."""
    producer_id, epoch = client.allocate_producer_id()
    txn = client.begin_transaction(timeout_s=60)
    txn.register_partitions([(T("tx-solo"), 2)])

    def batch(seq: int, values: list[bytes]) -> bytes:
        return encode_batch([Record(value=v) for v in values], producer_id=producer_id,
                            producer_epoch=epoch, base_sequence=seq, txn=txn.key)

    first = batch(0, [b"retried-1", b"retried-2"])
    written = produce_raw(client, T("tx-solo"), 2, first)
    assert not written.error.reason and not written.duplicate
    txn.abort()
    # The abort marker is applied, and durable: the high watermark is past it.
    marker_end = written.last_offset + 2
    wait_until(lambda: not describe(client, T("tx-solo"), 2).open_transactions
               and describe(client, T("tx-solo"), 2).high_watermark >= marker_end, 10,
               "the marker")
    hw = describe(client, T("tx-solo"), 2).high_watermark
    assert hw == marker_end

    again = produce_raw(client, T("tx-solo"), 2, first)
    assert not again.error.reason, again.error
    assert again.duplicate
    assert (again.base_offset, again.last_offset) == (written.base_offset, written.last_offset)
    # A new batch of the aborted transaction is refused, and nothing was appended.
    late = produce_raw(client, T("tx-solo"), 2, batch(2, [b"late"]))
    assert late.error.reason in ("TRANSACTION_NOT_OPEN", "TRANSACTION_ABORTED")
    assert describe(client, T("tx-solo"), 2).high_watermark == hw
    assert not describe(client, T("tx-solo"), 2).open_transactions
    committed = values(read_all(client, [T("tx-solo")], "read_committed"))
    assert not {b"retried-1", b"retried-2", b"late"} & set(committed)


def test_a_zombie_session_cannot_write_or_commit(client):
    first = client.producer(transactional_id="copier-1")
    zombie_txn = first.begin_transaction(timeout_s=60)
    first.send(T("tx-solo"), "zombie-1", partition=0, txn=zombie_txn).result(10)
    second = client.producer(transactional_id="copier-1")  # fences the first session
    assert second.epoch > first.epoch or second.producer_id != first.producer_id
    with pytest.raises(errors.AtomlogClientError) as late_send:
        first.send(T("tx-solo"), "zombie-2", partition=0, txn=zombie_txn).result(10)
    assert late_send.value.reason in ("TRANSACTION_ABORTED", "TRANSACTION_NOT_OPEN",
                                      "PRODUCER_FENCED")
    with pytest.raises(errors.ProducerFenced):
        zombie_txn.commit()
    with pytest.raises(errors.ProducerFenced):
        first.begin_transaction()
    txn = second.begin_transaction()
    second.send(T("tx-solo"), "live-1", partition=0, txn=txn)
    txn.commit(wait_for_markers=True)
    committed = values(read_all(client, [T("tx-solo")], "read_committed"))
    assert b"live-1" in committed and not {b"zombie-1", b"zombie-2"} & set(committed)
    first.close()
    second.close()


def test_a_session_whose_epoch_bump_answer_was_lost_goes_on(client, monkeypatch):
    """A session's producer whose write had an unknown outcome bumps its epoch at the next
    begin_transaction(). That InitProducerId's answer is lost: begin_transaction() raises,
    and the caller calls it again. Before, the second InitProducerId (the same epoch) was
    answered PRODUCER_FENCED, and the producer could never go on. Now it gets the epoch the
    first made, and its transactions commit."""
    from spark_client import transactions

    real_call = transactions.Coordinators.call
    lost: list[int] = []

    def call_losing_a_bumps_answer(self, k, method, request, deadline):
        answer = real_call(self, k, method, request, deadline)
        if method == "InitProducerId" and request.producer_id and not lost:
            lost.append(answer.producer_epoch)
            raise errors.error_for("SERVER_UNAVAILABLE", "the answer was lost (test)")
        return answer

    producer = client.producer(transactional_id="bumper-1")
    try:
        before = producer.epoch
        producer._needs_reinit = True  # as a write with an unknown outcome leaves it
        monkeypatch.setattr(transactions.Coordinators, "call", call_losing_a_bumps_answer)
        with pytest.raises(errors.AtomlogClientError) as unknown:
            producer.begin_transaction()
        assert unknown.value.reason == "SERVER_UNAVAILABLE" and lost == [before + 1]
        txn = producer.begin_transaction()
        assert producer.epoch == before + 1
        producer.send(T("tx-solo"), "after-the-lost-bump", partition=0, txn=txn)
        txn.commit(wait_for_markers=True)
        assert b"after-the-lost-bump" in values(read_all(client, [T("tx-solo")],
                                                         "read_committed"))
    finally:
        producer.close()


def test_a_session_producers_plain_sends_start_a_new_epoch_after_broken_sequences(client):
    """A transactional-id producer's plain sends (outside a transaction) after one of its
    partitions was abandoned (a refusal, or an unknown outcome): the session keeps its
    producer id, and only begin_transaction() bumped the epoch, so every later plain
    send to that partition carried a sequence the server could not take, refused one
    after the other for good. The next plain send now bumps the epoch first."""
    producer = client.producer(transactional_id="plain-1")
    try:
        producer.send(T("tx-solo"), "first", partition=0).result(10)
        before = producer.epoch
        with producer._lock:  # as _abandon_partition leaves a session's partition
            producer._partitions[(T("tx-solo"), 0)].next_sequence += 7
            producer._needs_reinit = True
        producer.send(T("tx-solo"), "second", partition=0).result(10)
        assert producer.epoch == before + 1
    finally:
        producer.close()
    assert {b"first", b"second"} <= set(values(read_all(client, [T("tx-solo")],
                                                        "read_committed")))


def test_transaction_state_survives_kill_9_of_every_partition_server(servers, client):
    """Committed data stays visible, aborted data invisible, and an open transaction
    keeps holding the max read position, after every partition server is killed -9 and
    restarted (recovery from transaction-buffer snapshots plus the log tail)."""
    with client.producer() as producer:
        committed_txn = client.begin_transaction(timeout_s=120)
        aborted_txn = client.begin_transaction(timeout_s=120)
        open_txn = client.begin_transaction(timeout_s=120)
        for partition in range(PARTITIONS):
            producer.send(T("tx-crash"), f"c{partition}", partition=partition, txn=committed_txn)
            producer.send(T("tx-crash"), f"a{partition}", partition=partition, txn=aborted_txn)
        producer.send(T("tx-crash"), "o0", partition=0, txn=open_txn)
        producer.flush()
        committed_txn.commit(wait_for_markers=True)
        aborted_txn.abort()
        producer.send(T("tx-crash"), "plain", partition=0).result(10)
    wait_until(lambda: all(describe(client, T("tx-crash"), p).aborted_transaction_count
                           for p in range(PARTITIONS)), 10, "the ABORT markers")
    expected = {b"c0", b"c1", b"c2", b"c3"}
    assert set(values(read_all(client, [T("tx-crash")], "read_committed"))) == expected
    for server in servers.services():  # the combined server's coordinator goes with it
        if server["role"] in ("partition_server", "combined"):
            os.kill(server["pid"], signal.SIGKILL)
            wal = servers.data_dir / server["name"] / "wal"
            if wal.is_dir():  # partition.durability=wal: and then the power went too
                wait_until(lambda pid=server["pid"]: gone(pid), 10, "the killed server to exit")
                assert lose_what_the_write_ahead_file_holds(
                    wal, servers.data_dir / server["name"] / "partitions") > 0
    servers.up()

    def readable() -> bool:
        try:
            return set(values(read_all(client, [T("tx-crash")], "read_committed"))) == expected
        except errors.AtomlogClientError:
            return False

    wait_until(readable, 60, "the partitions to recover")
    d = describe(client, T("tx-crash"), 0)
    assert [(t.txn_id.tc_partition, t.txn_id.sequence) for t in d.open_transactions] == \
        [open_txn.key]
    open_txn.commit(wait_for_markers=True)
    assert set(values(read_all(client, [T("tx-crash")], "read_committed"))) == \
        expected | {b"o0", b"plain"}


def gone(pid: int) -> bool:
    """The process exited (a zombie counts: it writes nothing any more)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def lose_what_the_write_ahead_file_holds(wal: Path, partitions: Path) -> int:
    """What a power cut may do to a server in partition.durability=wal: every partition
    file loses what its last checkpoint did not fsync. Modelled at its worst that the
    files allow: each partition's last segment cut back to where the partition's frames
    begin or to its recovery point, whichever is higher (below both, a checkpoint
    fsynced it). Returns the bytes cut; the restart must bring them back from the
    frames."""
    cut = 0
    for name, plan in wal_plan(plan_frames(wal)).items():
        segments = sorted((partitions / name).glob("*.log"))
        if not segments:
            continue
        recovery_point = json.loads((partitions / name / "recovery-point.json").read_text())
        floor = max(plan.start, recovery_point["offset"])
        last = segments[-1]
        data = last.read_bytes()
        keep = len(data)
        for position, header in iter_batches(data):
            if header.base_offset >= floor:
                keep = position
                break
        os.truncate(last, keep)
        cut += len(data) - keep
    return cut


def test_bad_transactional_input_is_refused_with_a_reason(client):
    producer_id, epoch = client.allocate_producer_id()
    bad = encode_batch([Record(value=b"x")], producer_id=producer_id, producer_epoch=epoch,
                       base_sequence=0, txn=(99, 1))
    result = produce_raw(client, T("tx-solo"), 0, bad)
    assert result.error.reason == "INVALID_ARGUMENT"
    unknown = encode_batch([Record(value=b"x")], producer_id=producer_id, producer_epoch=epoch,
                           base_sequence=0, txn=(0, 987_654_321))
    assert produce_raw(client, T("tx-solo"), 0, unknown).error.reason == "UNKNOWN_TRANSACTION"
    address = client.metadata.route(T("tx-solo"), 0).address
    stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(address))
    with pytest.raises(grpc.RpcError) as raised:
        stub.Fetch(partition_pb2.FetchRequest(items=[partition_pb2.FetchItem(
            topic_partition=common_pb2.TopicPartition(topic=T("tx-solo"), partition=0),
            fetch_offset=-1)]), timeout=10)
    assert from_rpc_error(raised.value).reason == "INVALID_ARGUMENT"


# ------------------------------------------------------------------ subscriptions

def test_a_consumer_receives_only_what_it_polls_for_and_the_rest_goes_to_others(client):
    """poll(max_records=N) asks the servers for at most N messages (max_messages), so the
    rest stays deliverable to the subscription's other consumers at once; it used to be
    delivered to the first consumer whole and wait in its memory for up to the ack
    timeout (and, after a server restart, be handed out by it although another consumer
    had acknowledged it since: found by the chaos harness)."""
    client.create_topic(T("tx-share"), partitions=2)
    with client.producer() as producer:
        for i in range(10):
            producer.send(T("tx-share"), f"m{i}", partition=i % 2)
    with client.consumer(T("tx-share"), subscription="share", ack_timeout_s=60) as first, \
            client.consumer(T("tx-share"), subscription="share", ack_timeout_s=60) as second:
        taken = first.poll(timeout_s=5, max_records=4)  # 2 from each server, or 4 from one
        assert 1 <= len(taken) <= 4
        rest, deadline = [], time.monotonic() + 10
        while len(rest) < 10 - len(taken) and time.monotonic() < deadline:
            rest.extend(second.poll(timeout_s=0.5, max_records=100))
        assert sorted(values(taken + rest)) == sorted(f"m{i}".encode() for i in range(10))
        assert first.poll(timeout_s=0.3, max_records=100) == []  # nothing held back for it


def test_subscription_acks_are_durable_and_redelivery_follows_nacks(client):
    client.create_topic(T("tx-sub"), partitions=2)
    with client.producer() as producer:
        for i in range(20):
            producer.send(T("tx-sub"), f"m{i}", partition=i % 2)
    with client.consumer(T("tx-sub"), subscription="s1", ack_timeout_s=60) as consumer:
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 20 and time.monotonic() < deadline:
            got.extend(consumer.poll(timeout_s=0.2))
        assert sorted(values(got)) == sorted(f"m{i}".encode() for i in range(20))
        first = [m for m in got if m.partition == 0]
        consumer.ack(first[:5])
        consumer.nack(first[5:])
        again = []
        deadline = time.monotonic() + 10
        while len(again) < 5 and time.monotonic() < deadline:
            again.extend(m for m in consumer.poll(timeout_s=0.2) if m.partition == 0)
        assert sorted(m.offset for m in again) == sorted(m.offset for m in first[5:])
        consumer.ack(again)
        cursors = {c.subscription_partition.partition: c for c in consumer.describe()}
        assert cursors[0].cumulative_end_offset == first[-1].offset + 1
    # A new consumer of the subscription gets only what was never acknowledged.
    with client.consumer(T("tx-sub"), subscription="s1") as consumer:
        rest = []
        deadline = time.monotonic() + 10
        while len(rest) < 10 and time.monotonic() < deadline:
            rest.extend(consumer.poll(timeout_s=0.2))
        assert sorted(m.partition for m in rest) == [1] * 10


def test_a_backlog_on_one_partition_does_not_starve_the_others(client):
    """A server takes a Receive's messages partition by partition in request order, and
    the SDK sent the same order every time: one message on partition 1, behind 300 on
    partition 0, came only once partition 0 was drained (the 31st poll of 10). The SDK
    now starts each Receive one partition further."""
    client.create_topic(T("tx-starve"), partitions=2)
    with client.producer() as producer:
        for i in range(300):
            producer.send(T("tx-starve"), f"a{i}", partition=0)
        producer.send(T("tx-starve"), "lonely", partition=1).result(10)
    with client.consumer(T("tx-starve"), subscription="s-starve", ack_timeout_s=60,
                         prefetch=0) as consumer:
        polls = 0
        while True:
            polls += 1
            got = consumer.poll(timeout_s=2, max_records=10)
            consumer.ack(got)
            if any(m.partition == 1 for m in got):
                break
            assert polls < 31, "partition 1 starved"
        assert polls <= 3, polls


def poll_all(consumer, count: int, timeout_s: float = 10) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got.extend(consumer.poll(timeout_s=0.2))
    return got


def test_a_prefetching_consumer_holds_what_it_received_and_releases_it_on_close(client):
    """prefetch: one Receive delivers beyond the poll's max_records; the rest stays with
    this consumer (leased, not given to others) for its next polls, in order; acks of it
    commit in a transaction; close() hands what was never acked to the others at once."""
    with pytest.raises(ValueError, match="prefetch"):
        client.consumer(T("tx-a"), subscription="s-pre", prefetch=-1)
    client.create_topic(T("tx-pre"), partitions=1)
    with client.producer() as producer:
        for i in range(100):
            producer.send(T("tx-pre"), f"m{i}", partition=0)
    a = client.consumer(T("tx-pre"), subscription="s-pre", ack_timeout_s=60, prefetch=40)
    first = a.poll(timeout_s=5, max_records=10)
    assert [m.offset for m in first] == list(range(10))
    with client.consumer(T("tx-pre"), subscription="s-pre", ack_timeout_s=60) as b:
        others = poll_all(b, 50)
        # a holds offsets 0-49: b is given only what a did not receive.
        assert sorted(m.offset for m in others) == list(range(50, 100))
        b.ack(others)
        held = []
        for _ in range(4):  # from a's buffer: b took everything the servers had
            held += a.poll(timeout_s=0, max_records=10)
        assert [m.offset for m in held] == list(range(10, 50))
        txn = client.begin_transaction()
        a.ack(first + held[:10], txn=txn)
        txn.commit(wait_for_markers=True)  # its acks are on the cursor when it is read below
        a.close()  # 20-49 were never acked: released to b, long before the ack timeout
        released = poll_all(b, 20, timeout_s=10)
        assert sorted(m.offset for m in released) == list(range(20, 50))
        assert values(released[:1]) == [f"m{released[0].offset}".encode()]
        b.ack(released)
        cursor = b.describe()[0]
        assert cursor.cumulative_end_offset == 100 and not cursor.individual_ranges


def test_a_prefetching_consumer_sends_its_next_receive_while_the_application_works(client):
    """Once a poll leaves at most half of what a Receive asks for (max_records +
    prefetch) kept, the next Receive, for the difference, goes out in the background: the
    server has delivered it before any poll asks. The polls hand everything out once, in
    order; received_at moves to when the background Receive was sent; a reset drops what
    it delivered (replayed from the new position), and a close releases it to the others
    at once."""
    topic = T("tx-topup")
    client.create_topic(topic, partitions=1)
    with client.producer() as producer:
        for i in range(100):
            producer.send(topic, f"m{i}", partition=0)
    a = client.consumer(topic, subscription="s-topup", ack_timeout_s=60, prefetch=40)

    def delivered() -> int:
        return a.describe()[0].delivered_unacknowledged_count

    got = a.poll(timeout_s=5, max_records=10)  # one Receive for 50: 40 kept
    got += a.poll(timeout_s=0, max_records=10)  # 30 kept: more than half of 50
    first_received_at = a.received_at
    time.sleep(0.3)
    assert delivered() == 50  # nothing went out in the background
    sent_after = time.time()
    got += a.poll(timeout_s=0, max_records=10)  # 20 kept: a Receive for 30 goes out
    wait_until(lambda: delivered() == 80, 10, "the background Receive's deliveries")
    while len(got) < 100:
        polled = a.poll(timeout_s=0, max_records=10)
        assert polled, f"a poll came back empty after {len(got)} messages"
        got += polled
    assert [m.offset for m in got] == list(range(100))
    assert values(got[-1:]) == [b"m99"]
    assert first_received_at < sent_after <= a.received_at
    assert a.poll(timeout_s=0.2, max_records=10) == []

    a.ack(got[:60])
    assert a.reset("offset", offset=60) == {(topic, 0): 60}
    replayed = a.poll(timeout_s=5, max_records=10)  # the 40 left are delivered, 30 kept
    wait_until(lambda: delivered() == 40, 10, "the deliveries after the reset")
    assert [m.offset for m in replayed] == list(range(60, 70))
    a.close()  # 60-99 were never acked: released to b, long before the ack timeout
    with client.consumer(topic, subscription="s-topup", ack_timeout_s=60) as b:
        released = poll_all(b, 40, timeout_s=10)
        assert sorted(m.offset for m in released) == list(range(60, 100))
        b.ack(released)
        cursor = b.describe()[0]
        assert cursor.cumulative_end_offset == 100 and not cursor.delivered_unacknowledged_count


def test_a_reset_of_some_partitions_keeps_what_the_consumer_holds_of_the_others(client):
    """A reset of one partition forgets what the consumer kept of it (replayed from the
    new position) and keeps what it holds of the others, in its buffer and in what its
    background Receive delivered: the next polls hand those out, once, instead of
    leaving them out to this consumer until their ack timeout."""
    topic = T("tx-reset-some")
    client.create_topic(topic, partitions=2)
    with client.producer() as producer:
        for partition in (0, 1):
            for i in range(30):
                producer.send(topic, f"p{partition}-{i}", partition=partition)
    p0, p1 = (topic, 0), (topic, 1)
    with client.consumer(topic, subscription="s-some", ack_timeout_s=60,
                         prefetch=40) as consumer:
        before = consumer.poll(timeout_s=5, max_records=10)  # one Receive for 50
        while len(before) < 30:  # the third poll of 10 sends the next Receive
            before += consumer.poll(timeout_s=0, max_records=10)
        wait_until(lambda: sum(c.delivered_unacknowledged_count
                               for c in consumer.describe()) == 60, 10,
                   "every message delivered, the rest kept by the consumer")
        # (Which partition a Receive takes first rotates: the one polled least is the
        # one the consumer holds most of.)
        polled = Counter(m.partition for m in before)
        held = min((0, 1), key=lambda partition: polled[partition])
        reset = (topic, 1 - held)
        assert polled[held] < 30, "the consumer keeps none of a partition: nothing to check"
        assert consumer.reset("offset", offset=0, partitions=[reset]) == {reset: 0}
        after = poll_all(consumer, 30 + 30 - polled[held], timeout_s=10)
        assert consumer.poll(timeout_s=0.3) == []
        assert [m.offset for m in after if m.partition == reset[1]] == list(range(30))
        kept = [m.offset for m in before + after if m.partition == held]
        assert sorted(kept) == list(range(30))  # each once, none left out
        consumer.ack(after)
        consumer.ack([m for m in before if m.partition == held])
        ends = {(c.subscription_partition.topic, c.subscription_partition.partition):
                c.cumulative_end_offset for c in consumer.describe()}
        assert ends == {p0: 30, p1: 30}


def test_a_subscription_is_reset_to_replay_or_skip_and_never_under_pending_acks(servers,
                                                                                client):
    topic = T("tx-reset")
    client.create_topic(topic, partitions=2)
    with client.producer() as producer:
        for i in range(10):
            producer.send(topic, f"early{i}", partition=0, timestamp_ms=1_000 + i)
        producer.flush()
        for i in range(10):
            producer.send(topic, f"late{i}", partition=0, timestamp_ms=5_000 + i)
        producer.flush()
    p0 = (topic, 0)
    with client.consumer(topic, subscription="r", ack_timeout_s=60) as consumer:
        got = poll_all(consumer, 20)
        assert [m.offset for m in got] == list(range(20))
        consumer.ack_cumulative(got[-1])
        assert consumer.reset("earliest", partitions=[p0]) == {p0: 0}
        assert values(poll_all(consumer, 20)) == values(got)  # replayed in order
        moved = consumer.reset("timestamp", timestamp_ms=3_000)  # the first batch at/after
        assert moved == {p0: 10, (topic, 1): 0}
        assert values(poll_all(consumer, 10)) == [f"late{i}".encode() for i in range(10)]
        assert consumer.reset("offset", offset=15, partitions=[p0]) == {p0: 15}
        assert [m.offset for m in poll_all(consumer, 5)] == list(range(15, 20))
        assert consumer.reset("offset", offset=10**9, partitions=[p0]) == {p0: 20}  # clamped
        assert consumer.poll(timeout_s=0.3) == []
        with pytest.raises(ValueError):
            consumer.reset("offset")  # no offset: refused before any call

        # Acks pending in an open transaction: the cursor cannot move under them.
        with client.producer() as producer:
            producer.send(topic, b"pending", partition=0).result(10)
        (pending,) = poll_all(consumer, 1)
        txn = client.begin_transaction(timeout_s=60)
        consumer.ack(pending, txn=txn)
        with pytest.raises(errors.TransactionConflict):
            consumer.reset("earliest", partitions=[p0])
        cursor = next(c for c in consumer.describe() if c.subscription_partition.partition == 0)
        assert cursor.cumulative_end_offset == 20 and cursor.pending_acks  # unchanged
        txn.commit(wait_for_markers=True)
        assert consumer.reset("earliest", partitions=[p0]) == {p0: 0}

    # The operator's command: every partition by default, JSON on request, and a missing
    # subscription is an error that moves nothing.
    rows = json.loads(servers.run("subscription", "reset", topic, "r", "--to", "latest",
                                  "-o", "json").stdout)
    end = describe(client, topic, 0).high_watermark
    assert rows == [{"partition": 0, "error": None, "position": end},
                    {"partition": 1, "error": None, "position": 0}]
    missing = servers.run("subscription", "reset", topic, "nobody", "--to", "earliest",
                          check=False)
    assert missing.returncode == 1 and "UNKNOWN_SUBSCRIPTION" in missing.stdout
    for flags in (["--to", "offset"], ["--to", "offset", "--offset", "-3"]):
        bad = servers.run("subscription", "reset", topic, "r", *flags, check=False)
        assert bad.returncode == 2 and "--offset" in bad.stdout + bad.stderr, flags
    address = client.metadata.route(topic, 0).address
    stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(address))
    sp = common_pb2.SubscriptionPartition(topic=topic, partition=0, subscription="r")
    for bad in (dict(), dict(position=9), dict(position=3, offset=-1),
                dict(position=4, timestamp_unix_ms=-5)):
        with pytest.raises(grpc.RpcError) as raised:
            stub.ResetSubscription(partition_pb2.ResetSubscriptionRequest(
                subscription_partitions=[sp], **bad), timeout=10)
        assert from_rpc_error(raised.value).reason == "INVALID_ARGUMENT", bad
    with client.consumer(topic, subscription="r") as consumer:
        cursor = next(c for c in consumer.describe() if c.subscription_partition.partition == 0)
        assert cursor.cumulative_end_offset == end  # the refusals moved nothing
    created = stub.CreateSubscription(partition_pb2.CreateSubscriptionRequest(
        subscription_partitions=[common_pb2.SubscriptionPartition(
            topic=topic, partition=0, subscription="from-5s")],
        initial_position=partition_pb2.SUBSCRIPTION_INITIAL_POSITION_TIMESTAMP,
        timestamp_unix_ms=3_000), timeout=10)
    assert created.results[0].created and created.results[0].cumulative_end_offset == 10

    # The SDK places new cursors the same ways; an existing cursor stays where it is.
    def positions(consumer) -> dict[int, int]:
        return {c.subscription_partition.partition: c.cumulative_end_offset
                for c in consumer.describe()}

    with client.consumer(topic, subscription="sdk-offset", start="offset",
                         start_offset=12) as consumer:
        got = poll_all(consumer, 9)
        assert [(m.partition, m.offset) for m in got] == [(0, o) for o in range(12, 21)]
    with client.consumer(topic, subscription="sdk-offset", start="earliest") as consumer:
        assert positions(consumer) == {0: 12, 1: 0}  # nothing acked: still where it began
    with client.consumer(topic, subscription="sdk-time", start="timestamp",
                         start_timestamp_ms=3_000) as consumer:
        assert positions(consumer) == {0: 10, 1: 0}
    for bad in (dict(start="offset"), dict(start="latest", start_offset=3),
                dict(start="offset", start_offset=-1), dict(start="timestamp"),
                dict(start="middle")):
        with pytest.raises(ValueError):
            client.consumer(topic, subscription="never", **bad)
    stub_cursors = stub.DescribePartition(partition_pb2.DescribePartitionRequest(
        topic_partition=common_pb2.TopicPartition(topic=topic, partition=0)), timeout=10)
    assert "never" not in {c.subscription_partition.subscription
                           for c in stub_cursors.subscriptions}  # refused before any call


def test_transactional_acks_apply_on_commit_and_come_back_on_abort(client):
    client.create_topic(T("tx-in"), partitions=1)
    with client.producer() as producer:
        for i in range(10):
            producer.send(T("tx-in"), f"in{i}", partition=0)
    with client.consumer(T("tx-in"), subscription="copy", ack_timeout_s=60) as consumer, \
            client.producer() as producer:
        got = poll_all(consumer, 10)
        aborted = client.begin_transaction(timeout_s=60)
        consumer.ack(got[:4], txn=aborted)
        other = client.begin_transaction(timeout_s=60)
        with pytest.raises(errors.TransactionConflict):
            consumer.ack(got[:1], txn=other)  # pending in the first transaction
        other.abort()
        aborted.abort()
        # abort() of a transaction that acked returns once its ABORT marker released the
        # pending acks, so they can be acked again at once (before, it returned with the
        # decision durable, and CI once saw the next ack a few ms ahead of the marker).
        assert not consumer.describe()[0].pending_acks
        committed = client.begin_transaction(timeout_s=60)
        for m in got:
            producer.send(T("tx-solo"), b"out-" + m.value, partition=3, txn=committed)
        consumer.ack_cumulative(got[-1], txn=committed)
        pending = consumer.describe()[0]
        assert pending.pending_acks and pending.cumulative_end_offset == 0
        committed.commit(wait_for_markers=True)
        cursor = consumer.describe()[0]
        assert cursor.cumulative_end_offset == got[-1].offset + 1 and not cursor.pending_acks


def test_async_acks_join_their_transaction_and_a_failed_one_aborts_the_commit(client):
    client.create_topic(T("tx-async-in"), partitions=1)
    with client.producer() as producer:
        for i in range(8):
            producer.send(T("tx-async-in"), f"in{i}", partition=0)
    with client.consumer(T("tx-async-in"), subscription="async", ack_timeout_s=60) as consumer, \
            client.producer() as producer:
        got = poll_all(consumer, 8)
        assert [m.offset for m in got] == list(range(8))

        # Without a transaction: durable once the future is done.
        assert consumer.ack_async(got[0]).result(10) is None
        assert consumer.describe()[0].cumulative_end_offset == 1

        # With one: commit() waits for the ack, which opens the transaction on the ack
        # thread; the ack applies with the outputs.
        txn = client.begin_transaction(timeout_s=60)
        acked = consumer.ack_async(got[1:3], txn=txn)
        producer.send(T("tx-solo"), b"async-out", partition=2, txn=txn)
        txn.commit(wait_for_markers=True)
        assert acked.done() and acked.exception() is None
        cursor = consumer.describe()[0]
        assert cursor.cumulative_end_offset == 3 and not cursor.pending_acks

        # A conflicting async ack fails its future; commit() then aborts and raises it, and
        # the transaction's output is never visible.
        holder = client.begin_transaction(timeout_s=60)
        consumer.ack(got[3:4], txn=holder)
        loser = client.begin_transaction(timeout_s=60)
        producer.send(T("tx-solo"), b"never-visible", partition=2, txn=loser)
        conflicting = consumer.ack_async(got[3:5], txn=loser)
        with pytest.raises(errors.TransactionConflict):
            loser.commit()
        assert isinstance(conflicting.exception(10), errors.TransactionConflict)
        assert loser.state() in ("ABORTING", "ABORTED")
        holder.abort()
        wait_until(lambda: not consumer.describe()[0].pending_acks, 10, "the aborts' markers")
        cursor = consumer.describe()[0]
        assert cursor.cumulative_end_offset == 3 and not cursor.individual_ranges
        assert not cursor.pending_acks
        assert b"never-visible" not in values(read_all(client, [T("tx-solo")], "read_committed"))

        # Once a commit began, the transaction takes no more: refused at once, nothing sent.
        late = client.begin_transaction(timeout_s=60)
        consumer.ack_async(got[5], txn=late).result(10)
        committing = late.commit_async()
        with pytest.raises(errors.TransactionNotOpen):
            consumer.ack_async(got[6], txn=late)
        committing.result(30)
        wait_until(lambda: not consumer.describe()[0].pending_acks, 10, "the commit's marker")
        cursor = consumer.describe()[0]
        assert cursor.cumulative_end_offset == 3
        assert [(r.start_offset, r.end_offset) for r in cursor.individual_ranges] == [(5, 6)]
        with pytest.raises(ValueError):
            client.consumer(T("tx-async-in"), subscription="async", max_async_acks=0)
