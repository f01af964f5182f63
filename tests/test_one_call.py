"""One-call transactions (CommitTxn) against real processes: presumed abort when the
coordinator dies between staging and decision (parallel commits, which a lone commit
takes by default, have their own module: tests/test_parallel_commits.py; this module's
cluster turns them off), markers that land after a partition
server's restart, an ack conflict that changes nothing, a transaction that outgrows the
bound mid-way, the partition servers' lookup of transactions their coordinator never
committed, and bad input refused with a reason.

The module runs its own cluster, started with failpoints enabled (services/failpoints.py)
so a test can hold a coordinator exactly between two steps and kill it there, and with a
short partition.txn_check_after_ms so presumed aborts happen within seconds."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest

from atomlog.v1 import (common_pb2, coordinator_pb2, coordinator_pb2_grpc, partition_pb2,
                        partition_pb2_grpc)
from coordinator.records import tc_partition_for
from partition_server.record_batch import Record, encode_batch
from services import failpoints
from services.errors import from_rpc_error
from spark_client import Client, errors
from spark_client.transactions import Coordinators
from tests.conftest import CLUSTER_SETTINGS, Cluster, create_online, metric_sum, wait_until

pytestmark = pytest.mark.cluster

CHECK_AFTER_MS = 1_500


@pytest.fixture(scope="module")
def failpoint_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("failpoints")


def failpoint_cluster(directory: Path, failpoint_dir: Path, *settings: str,
                      combined: bool = False):
    """A module's cluster (the combined server when `combined`) with failpoints on (armed
    by files in `failpoint_dir`) and the shared CLUSTER_SETTINGS plus `settings`
    ("--set", "name=value", ...); a generator for a module fixture to `yield from`."""
    cluster = Cluster(directory, combined=combined)
    previous = os.environ.get(failpoints.ENVIRONMENT_VARIABLE)
    os.environ[failpoints.ENVIRONMENT_VARIABLE] = str(failpoint_dir)
    try:
        cluster.run("up", "--output", "json", *(("--combined",) if combined else ()),
                    *CLUSTER_SETTINGS, *settings)
        yield cluster
    finally:
        cluster.run("down", check=False)
        if previous is None:
            os.environ.pop(failpoints.ENVIRONMENT_VARIABLE, None)
        else:
            os.environ[failpoints.ENVIRONMENT_VARIABLE] = previous


@pytest.fixture(scope="module")
def servers(tmp_path_factory, failpoint_dir):
    yield from failpoint_cluster(tmp_path_factory.mktemp("atomlog-one-call"), failpoint_dir,
                                 "--set", f"partition.txn_check_after_ms={CHECK_AFTER_MS}",
                                 "--set", "partition.txn_check_interval_ms=200",
                                 # Markers ride while commits come at least every 200 ms,
                                 # not 20: on a loaded machine (the suite's other worker)
                                 # back-to-back commits came more than 20 ms apart and
                                 # none rode.
                                 "--set", "coordinator.marker_linger_ms=200",
                                 # Two rounds, presumed abort (the tests hold commits
                                 # between them).
                                 "--set", "coordinator.parallel_commits=off")


def restart(cluster: Cluster) -> list[str]:
    """Start what is not running, with the module's environment (failpoints on)."""
    import json
    return json.loads(cluster.run("up", "--output", "json").stdout)["started"]


@pytest.fixture(scope="module")
def client(servers):
    with Client(servers.info["bootstrap"], request_timeout_s=10) as client:
        yield client


class Armed:
    """A failpoint armed for the duration of a with block."""

    def __init__(self, directory: Path, name: str):
        self.path = directory / name

    def __enter__(self):
        self.path.touch()
        return self

    def disarm(self) -> None:
        self.path.unlink(missing_ok=True)

    def __exit__(self, *exc) -> None:
        self.disarm()


def committed_values(client, topic: str) -> list[bytes]:
    with client.consumer([topic], isolation="read_committed", start="earliest") as consumer:
        found, quiet_since = [], time.monotonic()
        while time.monotonic() - quiet_since < 0.5:
            batch = consumer.poll(timeout_s=0.1, max_records=10_000)
            if batch:
                found.extend(m.value for m in batch)
                quiet_since = time.monotonic()
        return found


def settled(client, topic: str, partitions: int) -> bool:
    """No open transaction, and the max read position at the high watermark, everywhere
    (not yet while a partition cannot be described: its server is coming back)."""
    for partition in range(partitions):
        try:
            d = client.describe_partition(topic, partition)
        except errors.AtomlogClientError as error:
            if error.retriable:
                return False
            raise
        if d.open_transactions or d.max_read_position != d.high_watermark:
            return False
    return True


def process_serving(cluster: Cluster, client: Client, topic: str, partition: int) -> str:
    address = client.metadata.route(topic, partition).address
    return next(p["name"] for p in cluster.services() if p["grpc_address"] == address)


def kill_and_restart(cluster: Cluster, victim: str, held: Armed) -> None:
    """kill -9 the victim where the failpoint holds it, disarm, start it again."""
    os.kill(cluster.process(victim)["pid"], signal.SIGKILL)
    held.disarm()
    assert victim in restart(cluster)


def coordinator_of(cluster: Cluster, tc_partition: int) -> str:
    for process in cluster.status()["processes"]:
        if tc_partition in process.get("tc_partitions", []):
            return process["name"]
    raise AssertionError(f"no coordinator owns TC partition {tc_partition}")


def open_txns(client, topic: str, partitions: int) -> set[tuple[int, int]]:
    return {(t.txn_id.tc_partition, t.txn_id.sequence)
            for p in range(partitions)
            for t in client.describe_partition(topic, p).open_transactions}


def staged_everywhere(client, topic: str, partitions: int) -> tuple[int, int]:
    """Wait until one transaction is open on every partition of `topic` (staged there);
    its (TC partition, sequence)."""
    wait_until(lambda: len(open_txns(client, topic, partitions)) == 1
               and all(client.describe_partition(topic, p).open_transactions
                       for p in range(partitions)), 20,
               "the transaction staged on every partition")
    (staged,) = open_txns(client, topic, partitions)
    return staged


def commit_in_thread(txn, outcome: dict) -> threading.Thread:
    """txn.commit() on a thread of its own (the test kills its coordinator meanwhile):
    `outcome` gets "committed" (the transaction id) or "error"."""
    def commit() -> None:
        try:
            txn.commit()
            outcome["committed"] = txn.id
        except errors.AtomlogClientError as error:
            outcome["error"] = error

    thread = threading.Thread(target=commit)
    thread.start()
    return thread


def test_coordinator_killed_between_staging_and_decision_presumes_abort(servers, client,
                                                                        failpoint_dir):
    killed_between_staging_and_decision_commits_once(
        client, create_online(client, "oc-presumed", 2), failpoint_dir,
        lambda held, staged: kill_and_restart(servers, coordinator_of(servers, staged[0]),
                                              held))


def killed_between_staging_and_decision_commits_once(client, topic: str, failpoint_dir,
                                                     kill) -> None:
    """A one-call transaction of six records over `topic`'s two partitions, its decision
    held by the one_call_decide failpoint once staged everywhere; `kill(held, staged)`
    kills its coordinator there and restarts it. The staged attempt never commits: its
    partitions abort it (presumed abort) once its coordinator's successor does not know
    it; the SDK's retry with the same idempotency key ran the transaction anew, so it
    committed exactly once."""
    outcome: dict = {}
    with Armed(failpoint_dir, failpoints.ONE_CALL_DECIDE) as held, client.producer() as producer:
        txn = client.begin_transaction(timeout_s=60)
        for i in range(6):
            producer.send(topic, f"p{i}".encode(), partition=i % 2, txn=txn)
        assert txn.one_call
        thread = commit_in_thread(txn, outcome)
        staged = staged_everywhere(client, topic, 2)
        kill(held, staged)
        thread.join(timeout=120)
    assert not thread.is_alive()
    wait_until(lambda: settled(client, topic, 2), 30, "every partition to settle")
    assert outcome.get("committed"), outcome
    assert outcome["committed"] != f"{staged[0]}:{staged[1]}"
    assert sorted(committed_values(client, topic)) == sorted(f"p{i}".encode() for i in range(6))
    for partition in range(2):
        assert client.describe_partition(topic, partition).aborted_transaction_count == 1


@pytest.fixture(scope="module")
def late_checks(tmp_path_factory, failpoint_dir):
    """A cluster whose partition servers look an open transaction up only after 120 s
    (every 200 ms a round), unless its coordinator changed."""
    yield from failpoint_cluster(tmp_path_factory.mktemp("atomlog-late-checks"), failpoint_dir,
                                 "--set", "partition.txn_check_after_ms=120000",
                                 "--set", "partition.txn_check_interval_ms=200",
                                 "--set", "coordinator.parallel_commits=off")


def test_a_dead_coordinators_staged_transaction_is_aborted_once_a_successor_takes_over(
        late_checks, failpoint_dir):
    """The same kill between staging and deciding, with lookups 120 s after a transaction
    was first seen: its partitions ask the successor as soon as the TC partition's
    coordinator epoch rises, so they settle within seconds of the takeover (before, they
    held the staged transaction, their max read position and read_committed readers for
    `partition.txn_check_after_ms`, 10 s by default)."""
    with Client(late_checks.info["bootstrap"], request_timeout_s=10) as client:
        killed_between_staging_and_decision_commits_once(
            client, create_online(client, "oc-successor", 2), failpoint_dir,
            lambda held, staged: kill_and_restart(
                late_checks, coordinator_of(late_checks, staged[0]), held))


def test_a_failed_commit_of_a_dead_coordinator_leaves_nothing_hanging(servers, client,
                                                                      failpoint_dir):
    """Same kill, but the client gives up before the coordinator is back: nothing of the
    transaction is ever visible and no partition keeps it open."""
    topic = create_online(client, "oc-gave-up", 2)
    short = Client(servers.info["bootstrap"], request_timeout_s=2)
    try:
        with Armed(failpoint_dir, failpoints.ONE_CALL_DECIDE) as held, \
                short.producer() as producer:
            txn = short.begin_transaction(timeout_s=3)
            for i in range(4):
                producer.send(topic, f"g{i}".encode(), partition=i % 2, txn=txn)
            result: dict = {}
            thread = commit_in_thread(txn, result)
            staged = staged_everywhere(client, topic, 2)
            victim = coordinator_of(servers, staged[0])
            os.kill(servers.process(victim)["pid"], signal.SIGKILL)
            thread.join(timeout=60)  # the client runs out of time while it is down
            held.disarm()
        assert not thread.is_alive()
        assert "error" in result, result
        assert victim in restart(servers)
        wait_until(lambda: settled(client, topic, 2), 30, "the presumed abort")
        assert committed_values(client, topic) == []
    finally:
        short.close()


def test_a_commit_whose_caller_goes_away_before_the_decision_is_aborted_at_once(
        servers, client, failpoint_dir):
    """A CommitTxn cancelled between staging and its decision (the caller's deadline
    passed, or it went away) never decided its transaction: staged everywhere, it stayed
    OPEN until its timeout (60 s here) plus the grace, holding its key and its
    partitions' max read position, read_committed readers stalled behind it. Now the
    cancelled call aborts it (presumed abort) and its key takes a new commit."""
    topic = create_online(client, "oc-cancelled", 2)
    count = client.metadata.tc_partition_count
    key = _key_on(0, count)
    items = [partition_pb2.ProduceItem(
        topic_partition=common_pb2.TopicPartition(topic=topic, partition=p),
        record_batch=encode_batch([Record(None, f"c{p}".encode(), (), 0)])) for p in (0, 1)]
    request = coordinator_pb2.CommitTxnRequest(tc_partition=0, idempotency_key=key,
                                               timeout_ms=60_000, batches=items)
    def route() -> str:
        client.metadata.refresh()
        return client.metadata.tc_routes[0]

    wait_until(route, 20, "TC partition 0's coordinator")
    with Armed(failpoint_dir, failpoints.ONE_CALL_DECIDE):
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(client.channels.get(route()))
        with pytest.raises(grpc.RpcError) as gone:
            stub.CommitTxn(request, timeout=3)
        assert gone.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: settled(client, topic, 2), 20, "the cancelled commit's abort")
    for partition in range(2):  # it was staged there, and aborted
        assert client.describe_partition(topic, partition).aborted_transaction_count == 1
    answer = stub.CommitTxn(request, timeout=30)  # the same key: a new commit
    assert answer.state == coordinator_pb2.TXN_STATE_COMMITTING
    wait_until(lambda: settled(client, topic, 2), 20, "the commit's markers")
    assert sorted(committed_values(client, topic)) == [b"c0", b"c1"]


def test_a_partition_server_killed_before_the_marker_gets_it_after_restart(servers, client,
                                                                           failpoint_dir):
    topic = create_online(client, "oc-marker", 2)
    victim = process_serving(servers, client, topic, 0)
    with Armed(failpoint_dir, failpoints.MARKERS_SEND) as held, client.producer() as producer:
        txn = client.begin_transaction(timeout_s=60)
        futures = [producer.send(topic, f"m{i}".encode(), partition=i % 2, txn=txn)
                   for i in range(6)]
        txn.commit()  # durable decision; the markers are held
        assert txn.state() == "COMMITTING"
        assert committed_values(client, topic) == []
        os.kill(servers.process(victim)["pid"], signal.SIGKILL)
        held.disarm()
        assert victim in restart(servers)
    wait_until(lambda: settled(client, topic, 2), 30, "the markers after the restart")
    wait_until(lambda: txn.state() == "COMMITTED", 30, "the transaction to complete")
    assert sorted(committed_values(client, topic)) == sorted(f"m{i}".encode() for i in range(6))
    offsets = [f.result(1).offset for f in futures]
    assert sorted(offsets[0::2]) == [0, 1, 2] and sorted(offsets[1::2]) == [0, 1, 2]


def test_an_abort_that_acked_returns_once_its_markers_released_the_acks(servers, failpoint_dir):
    """abort() of a transaction whose acks reached the partition server (the streaming
    path) waits for its ABORT marker, which releases them: the next transaction may ack
    the same messages at once (before, abort() returned with the decision durable, and
    an ack right after it could meet TRANSACTION_CONFLICT). A one-call transaction's acks
    never left the client: its abort() waits for nothing."""
    for one_call_max_bytes in (0, 1 << 20):
        with Client(servers.info["bootstrap"], one_call_max_bytes=one_call_max_bytes) as client:
            topic = create_online(client, f"oc-abort-acks-{one_call_max_bytes}", 1)
            with client.producer() as producer:
                for i in range(3):
                    producer.send(topic, f"in{i}".encode(), partition=0)
            with client.consumer(topic, subscription="abort-acks", ack_timeout_s=60) as consumer:
                got = []
                deadline = time.monotonic() + 30
                while len(got) < 3 and time.monotonic() < deadline:
                    got.extend(consumer.poll(timeout_s=1))
                assert len(got) == 3
                txn = client.begin_transaction(timeout_s=30)
                consumer.ack(got, txn=txn)
                with Armed(failpoint_dir, failpoints.MARKERS_SEND) as held:
                    released = threading.Timer(2.0, held.disarm)
                    released.start()
                    try:
                        txn.abort()
                        waited = not released.is_alive()
                    finally:
                        released.cancel()
                assert waited == (one_call_max_bytes == 0)
                if waited:  # released with the marker, not after it
                    assert not consumer.describe()[0].pending_acks
                again = client.begin_transaction(timeout_s=30)
                consumer.ack(got, txn=again)  # no TRANSACTION_CONFLICT
                again.commit(wait_for_markers=True)
                cursor = consumer.describe()[0]
                assert cursor.cumulative_end_offset == 3 and not cursor.pending_acks


def test_a_commit_waiting_for_markers_waits_past_the_call_s_deadline(servers, failpoint_dir):
    """commit(wait_for_markers=True) promises the records are readable when it returns.
    The coordinator waits for the markers only until the call's deadline, then answers
    COMMITTING; the SDK returned all the same (a Spark write did, and a read planned
    right after it missed the rows). Now it waits on, polling, until the markers land
    (or, past a bound, logs that they are late). Both paths: one call, and streaming."""
    import threading

    for one_call_max_bytes in (1 << 20, 0):
        with Client(servers.info["bootstrap"], request_timeout_s=2,
                    one_call_max_bytes=one_call_max_bytes) as short:
            topic = create_online(short, f"oc-slow-markers-{one_call_max_bytes}", 1)
            with Armed(failpoint_dir, failpoints.MARKERS_SEND) as held, \
                    short.producer() as producer:
                txn = short.begin_transaction(timeout_s=10)
                producer.send(topic, b"late", partition=0, txn=txn)
                producer.flush()
                released = threading.Timer(4.0, held.disarm)
                released.start()
                try:
                    txn.commit(wait_for_markers=True)
                    assert not released.is_alive()  # it returned after the markers went
                finally:
                    released.cancel()
            assert committed_values(short, topic) == [b"late"]


def test_a_one_call_transaction_with_a_conflicting_ack_changes_nothing(servers, client):
    conflicting_ack_changes_nothing(client, servers.info["bootstrap"],
                                    create_online(client, "oc-in", 1),
                                    create_online(client, "oc-out", 1), "oc")


def conflicting_ack_changes_nothing(client, bootstrap: str, source: str, sink: str,
                                    subscription: str, refused=lambda: None) -> None:
    """A one-call transaction (a send to `sink`, empty, and acks on `source`'s
    subscription) whose ack conflicts with one pending in another transaction is refused
    and changes nothing: ABORTED for good, its send failed, nothing of it visible, the
    cursor as before. `refused()` runs once its commit was refused."""
    with client.producer() as producer:
        for i in range(4):
            producer.send(source, f"in{i}".encode(), partition=0)
        producer.flush()
    streaming = Client(bootstrap, one_call_max_bytes=0)
    try:
        with client.consumer(source, subscription=subscription, ack_timeout_s=60) as \
                consumer, client.producer() as producer:
            got = []
            while len(got) < 4:
                got += consumer.poll(timeout_s=1.0)
            holder = streaming.begin_transaction(timeout_s=60)  # acks pending at the server
            consumer.ack(got[:2], txn=holder)
            before = consumer.describe()[0]
            txn = client.begin_transaction(timeout_s=60)
            out = producer.send(sink, b"never", partition=0, txn=txn)
            consumer.ack(got[1:3], txn=txn)  # got[1] is pending in `holder`
            assert txn.one_call
            with pytest.raises(errors.TransactionConflict):
                txn.commit()
            refused()
            assert txn.state() == "ABORTED"
            with pytest.raises(errors.TransactionAborted):  # and stays so
                txn.commit()
            with pytest.raises(errors.TransactionConflict):
                out.result(1)
            wait_until(lambda: settled(client, sink, 1), 10, "the staged data aborted")
            assert committed_values(client, sink) == []
            after = consumer.describe()[0]
            assert after.cumulative_end_offset == before.cumulative_end_offset
            assert [(p.txn_id.tc_partition, p.txn_id.sequence) for p in after.pending_acks] == \
                [(p.txn_id.tc_partition, p.txn_id.sequence) for p in before.pending_acks]
            holder.commit(wait_for_markers=True)
    finally:
        streaming.close()


def test_a_transaction_that_outgrows_the_bound_switches_paths_mid_way(servers):
    topic = "oc-switch"
    with Client(servers.info["bootstrap"], one_call_max_bytes=4_096) as small:
        create_online(small, topic, 2)
        with small.producer() as producer:
            txn = small.begin_transaction(timeout_s=60)
            futures = []
            for i in range(20):
                futures.append(producer.send(topic, b"%02d" % i + b"." * 500,
                                             partition=i % 2, txn=txn))
                if i == 3:
                    assert txn.one_call  # 4 records of ~530 bytes: still kept
            assert not txn.one_call  # switched at about 4 KiB
            txn.commit(wait_for_markers=True)
        got = committed_values(small, topic)
        assert len(got) == 20 and len(set(got)) == 20
        for partition in (0, 1):  # send order kept per partition
            mine = [v[:2] for v in got if int(v[:2]) % 2 == partition]
            assert mine == sorted(mine)
        offsets = [(f.result(1).partition, f.result(1).offset) for f in futures]
        assert len(set(offsets)) == 20


def test_a_producers_batches_queue_in_order_behind_its_batch_being_verified(
        servers, client, failpoint_dir):
    """The first batch of a transaction on a partition waits for its verification with
    the coordinator. Batches of the same producer sent meanwhile (plain, or of the same
    transaction) wait behind it and are written in sequence order; before, they could
    be queued first and refused as out of order, and the producer resent them one at a
    time (bench/transactions.py's commit_async() stream: 102 refusals in 10 s). A second
    batch of the transaction finds the first one's answer cached instead of asking again."""
    topic = "oc-verify-order"
    create_online(client, topic, 1)
    producer_id, epoch = client.allocate_producer_id()
    txn = client.begin_transaction(timeout_s=60)
    txn.register_partitions([(topic, 0)])
    address = client.metadata.route(topic, 0).address
    stub = partition_pb2_grpc.PartitionServiceStub(client.channels.get(address))

    def produce(seq: int, value: bytes, transactional: bool):
        batch = encode_batch([Record(value=value)], producer_id=producer_id,
                             producer_epoch=epoch, base_sequence=seq,
                             txn=txn.key if transactional else None)
        return stub.Produce.future(partition_pb2.ProduceRequest(items=[
            partition_pb2.ProduceItem(
                topic_partition=common_pb2.TopicPartition(topic=topic, partition=0),
                record_batch=batch)]), timeout=30)

    def write_verifications() -> float:
        """Verifications the partition servers asked for writes: every question asked
        but the presumed-abort checker's lookups of old open transactions (on a loaded
        machine it looked this test's transaction up too)."""
        def total(name: str) -> float:
            return _metric_sum(servers, name, role="partition_server")
        return (total("atomlog_partition_txn_verifications_total")
                - total("atomlog_partition_txn_checks_total"))

    first = produce(0, b"plain-0", False).result()
    assert not first.results[0].error.reason
    verified_before = write_verifications()
    with Armed(failpoint_dir, failpoints.VERIFY_HOLD):
        calls = [produce(1, b"txn-1", True)]
        time.sleep(0.3)  # its verification is held
        # Each sent 50 ms after the last: separate unary calls have no order of their own
        # on the server (on a loaded CI machine seq 3 was once taken before seq 2).
        for seq, value, transactional in ((2, b"plain-2", False), (3, b"txn-3", True),
                                          (4, b"plain-4", False)):
            calls.append(produce(seq, value, transactional))
            time.sleep(0.05)
        time.sleep(0.5)
        assert not any(call.done() for call in calls)  # all behind the first
    results = [call.result().results[0] for call in calls]
    assert [r.error.reason for r in results] == [""] * 4
    offsets = [r.base_offset for r in results]
    assert offsets == sorted(offsets) and offsets[0] > first.results[0].base_offset
    assert write_verifications() - verified_before == 1
    txn.commit(wait_for_markers=True)
    assert committed_values(client, topic) == [b"plain-0", b"txn-1", b"plain-2", b"txn-3",
                                               b"plain-4"]


def committed_one(client, topic: str) -> tuple[int, int, int]:
    """Commit a transaction of one record ("kept") to partition 0 of `topic`: its TC
    partition, its sequence (those above it, inside the reservation, are handed out to
    nobody yet) and the coordinator epoch of that TC partition."""
    with client.producer() as producer:
        txn = client.begin_transaction(timeout_s=30)
        producer.send(topic, b"kept", partition=0, txn=txn)
        txn.commit(wait_for_markers=True)
    tc, sequence = txn.key
    described = Coordinators(client).call(tc, "DescribeTransaction",
                                          coordinator_pb2.DescribeTransactionRequest(
                                              txn_id=txn.txn_id), time.monotonic() + 30)
    return tc, sequence, described.coordinator_epoch


def test_a_staged_transaction_its_coordinator_never_committed_is_aborted_by_the_partition(
        servers, client):
    """Stage straight through StageTxn a transaction the coordinator handed out no
    decision for (a sequence inside its reservation): the partition server asks, hears
    ABORTED (presumed abort), and writes the ABORT marker itself."""
    topic = create_online(client, "oc-orphan", 1)
    tc, sequence, epoch = committed_one(client, topic)
    orphan = common_pb2.TxnId(tc_partition=tc, sequence=sequence + 1_000)
    stub = client.channels.partition(client.metadata.route(topic, 0).address)
    reply = stub.StageTxn(partition_pb2.StageTxnRequest(items=[partition_pb2.StageTxnItem(
        txn_id=orphan, coordinator_epoch=epoch, batches=[partition_pb2.ProduceItem(
            topic_partition=common_pb2.TopicPartition(topic=topic, partition=0),
            record_batch=encode_batch([Record(None, b"orphan", (), 0)]))])]), timeout=10)
    (result,) = reply.results
    assert not result.batch_results[0].error.reason
    d = client.describe_partition(topic, 0)
    assert [(t.txn_id.tc_partition, t.txn_id.sequence) for t in d.open_transactions] == \
        [(tc, sequence + 1_000)]
    assert d.max_read_position < d.high_watermark
    # Staged again (a coordinator's retry): the first stage's offsets, nothing appended.
    again = stub.StageTxn(partition_pb2.StageTxnRequest(items=[partition_pb2.StageTxnItem(
        txn_id=orphan, coordinator_epoch=epoch, batches=[partition_pb2.ProduceItem(
            topic_partition=common_pb2.TopicPartition(topic=topic, partition=0),
            record_batch=encode_batch([Record(None, b"orphan", (), 0)]))])]), timeout=10)
    assert again.results[0].batch_results[0].duplicate
    assert again.results[0].batch_results[0].base_offset == result.batch_results[0].base_offset
    began = time.monotonic()
    wait_until(lambda: settled(client, topic, 1), 20, "the presumed abort")
    assert time.monotonic() - began < 10
    assert client.describe_partition(topic, 0).aborted_transaction_count == 1
    assert committed_values(client, topic) == [b"kept"]
    # A deposed coordinator's stage (an older epoch) is refused.
    stale = stub.StageTxn(partition_pb2.StageTxnRequest(items=[partition_pb2.StageTxnItem(
        txn_id=common_pb2.TxnId(tc_partition=tc, sequence=sequence + 1_001),
        coordinator_epoch=epoch + 1, batches=[partition_pb2.ProduceItem(
            topic_partition=common_pb2.TopicPartition(topic="oc-no-such", partition=0),
            record_batch=b"")])]), timeout=10)  # raises the epoch; the item itself fails
    assert stale.results[0].batch_results[0].error.reason
    refused = stub.StageTxn(partition_pb2.StageTxnRequest(items=[partition_pb2.StageTxnItem(
        txn_id=common_pb2.TxnId(tc_partition=tc, sequence=sequence + 1_002),
        coordinator_epoch=epoch, batches=[partition_pb2.ProduceItem(
            topic_partition=common_pb2.TopicPartition(topic=topic, partition=0),
            record_batch=encode_batch([Record(None, b"stale", (), 0)]))])]), timeout=10)
    assert refused.results[0].batch_results[0].error.reason == "STALE_COORDINATOR_EPOCH"


def _commit_txn(client, **fields):
    """A raw CommitTxn that must be refused: its error. Sent again (to the new owner)
    while the TC partition is moving: the module's kills make leases rebalance."""
    k = fields.setdefault("tc_partition", 0)
    for _ in range(50):
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(
            client.channels.get(client.metadata.tc_routes[k]))
        try:
            stub.CommitTxn(coordinator_pb2.CommitTxnRequest(**fields), timeout=10)
        except grpc.RpcError as rpc_error:
            error = from_rpc_error(rpc_error)
            if error.reason not in ("NOT_COORDINATOR", "COORDINATOR_LOADING"):
                return error
            time.sleep(0.2)
            client.metadata.refresh()
            continue
        raise AssertionError("CommitTxn was accepted")
    raise AssertionError(f"TC partition {k} found no owner")


def _key_on(k: int, count: int) -> str:
    while True:
        key = f"test-{uuid.uuid4()}"
        if tc_partition_for(key, count) == k:
            return key


def test_bad_commit_txn_input_is_refused_with_a_reason_and_changes_nothing(servers, client):
    topic = create_online(client, "oc-bad", 2)
    count = client.metadata.tc_partition_count
    key = _key_on(0, count)
    item = partition_pb2.ProduceItem(
        topic_partition=common_pb2.TopicPartition(topic=topic, partition=0),
        record_batch=encode_batch([Record(None, b"x", (), 0)]))
    cases = {
        "no key": dict(batches=[item]),
        "key of another TC partition": dict(idempotency_key=_key_on(1, count), batches=[item]),
        "nothing to commit": dict(idempotency_key=key),
        "transactional batch": dict(idempotency_key=key, batches=[partition_pb2.ProduceItem(
            topic_partition=item.topic_partition,
            record_batch=encode_batch([Record(None, b"x", (), 0)], txn=(0, 1)))]),
        "producer id": dict(idempotency_key=key, batches=[partition_pb2.ProduceItem(
            topic_partition=item.topic_partition, record_batch=encode_batch(
                [Record(None, b"x", (), 0)], producer_id=7, base_sequence=0))]),
        "truncated batch": dict(idempotency_key=key, batches=[partition_pb2.ProduceItem(
            topic_partition=item.topic_partition, record_batch=item.record_batch[:-1])]),
        "two batches for one partition": dict(idempotency_key=key, batches=[item, item]),
        "too large": dict(idempotency_key=key, batches=[partition_pb2.ProduceItem(
            topic_partition=item.topic_partition,
            record_batch=encode_batch([Record(None, b"x" * (1 << 20), (), 0)]))]),
        "an ack of nothing": dict(idempotency_key=key, acks=[partition_pb2.AckItem(
            subscription_partition=common_pb2.SubscriptionPartition(
                topic=topic, partition=0, subscription="s"))]),
        # A name the partition servers refuse (they would refuse the transaction's
        # markers, and it would never end): refused before anything is staged.
        "an ack of a subscription named badly": dict(
            idempotency_key=key, batches=[item], acks=[partition_pb2.AckItem(
                subscription_partition=common_pb2.SubscriptionPartition(
                    topic=topic, partition=1, subscription="bad name"),
                cumulative_end_offset=1)]),
    }
    for name, fields in cases.items():
        error = _commit_txn(client, **fields)
        expected = "CORRUPT_BATCH" if name == "truncated batch" else "INVALID_ARGUMENT"
        assert error.reason == expected, (name, error)
    unknown = _commit_txn(client, idempotency_key=key, batches=[partition_pb2.ProduceItem(
        topic_partition=common_pb2.TopicPartition(topic="oc-no-such-topic", partition=0),
        record_batch=item.record_batch)])
    assert unknown.reason == "UNKNOWN_TOPIC_OR_PARTITION"
    # A partition past the topic's last, after its partitions were validated (and kept:
    # Coordinator._known_targets) by the calls above.
    beyond = _commit_txn(client, idempotency_key=key, batches=[partition_pb2.ProduceItem(
        topic_partition=common_pb2.TopicPartition(topic=topic, partition=2),
        record_batch=item.record_batch)])
    assert beyond.reason == "UNKNOWN_TOPIC_OR_PARTITION" and "2 partitions" in beyond.message
    corrupt = bytearray(item.record_batch)
    corrupt[-1] ^= 0xFF  # the CRC no longer matches: the partition server refuses it
    crc = _commit_txn(client, idempotency_key=key, batches=[partition_pb2.ProduceItem(
        topic_partition=item.topic_partition, record_batch=bytes(corrupt))])
    assert crc.reason == "CRC_MISMATCH"
    wait_until(lambda: settled(client, topic, 2), 10, "nothing left open")
    assert committed_values(client, topic) == []
    for partition in range(2):  # nothing was appended
        assert client.describe_partition(topic, partition).high_watermark == 0


def test_an_abort_by_key_stops_any_later_commit_and_reports_a_committed_one(servers, client):
    """CommitTxn with abort (what the SDK's abort() sends after a commit with an unknown
    outcome): a committed key answers TRANSACTION_ALREADY_COMMITTED; any other key gets a
    tombstone, and a later CommitTxn with it is refused."""
    topic = create_online(client, "oc-abort-key", 1)
    with client.producer() as producer:
        txn = client.begin_transaction(timeout_s=30)
        producer.send(topic, b"done", partition=0, txn=txn)
        txn.commit()
    k = txn.tc_partition
    committed = _commit_txn(client, tc_partition=k, idempotency_key=txn._new_txn_key,
                            abort=True)
    assert committed.reason == "TRANSACTION_ALREADY_COMMITTED"
    gave_up = _key_on(k, client.metadata.tc_partition_count)
    reply = Coordinators(client).call(k, "CommitTxn", coordinator_pb2.CommitTxnRequest(
        tc_partition=k, idempotency_key=gave_up, abort=True), time.monotonic() + 30)
    assert reply.state in (coordinator_pb2.TXN_STATE_ABORTING, coordinator_pb2.TXN_STATE_ABORTED)
    late = _commit_txn(client, tc_partition=k, idempotency_key=gave_up, batches=[
        partition_pb2.ProduceItem(topic_partition=common_pb2.TopicPartition(
            topic=topic, partition=0), record_batch=encode_batch([Record(None, b"late", (), 0)]))])
    assert late.reason == "TRANSACTION_ABORTED"
    assert committed_values(client, topic) == [b"done"]


def test_acks_staged_for_a_transaction_its_coordinator_never_committed_are_released(
        servers, client):
    """Presumed abort of pending acks: an ack staged straight through StageTxn for a
    transaction the coordinator handed out no decision for is released by the partition
    server (the message can be acknowledged again), and nothing stays pending."""
    topic = create_online(client, "oc-orphan-ack", 1)
    with client.producer() as producer:
        producer.send(topic, b"m0", partition=0).result(10)
    tc, sequence, epoch = committed_one(client, topic)
    with client.consumer(topic, subscription="orphan", ack_timeout_s=60) as consumer:
        got = []
        while not got:
            got = consumer.poll(timeout_s=1.0, max_records=1)
        stub = client.channels.partition(client.metadata.route(topic, 0).address)
        reply = stub.StageTxn(partition_pb2.StageTxnRequest(items=[partition_pb2.StageTxnItem(
            txn_id=common_pb2.TxnId(tc_partition=tc, sequence=sequence + 2_000),
            coordinator_epoch=epoch, acks=[partition_pb2.AckItem(
                subscription_partition=common_pb2.SubscriptionPartition(
                    topic=topic, partition=0, subscription="orphan"),
                cumulative_end_offset=got[0].offset + 1)])]), timeout=10)
        assert not reply.results[0].ack_results[0].error.reason
        assert consumer.describe()[0].pending_acks
        began = time.monotonic()
        wait_until(lambda: not consumer.describe()[0].pending_acks, 20, "the presumed abort")
        assert time.monotonic() - began < 10
        cursor = consumer.describe()[0]
        assert cursor.cumulative_end_offset == 0  # released, not applied
        consumer.ack(got)  # free to acknowledge again
        assert consumer.describe()[0].cumulative_end_offset == got[0].offset + 1


def test_waiting_for_a_send_while_its_one_call_commit_runs_waits_for_the_commit(servers,
                                                                               client):
    """commit_async() then send.result(): the wait does not switch the transaction (its
    commit has taken what it kept); it ends when the commit does, with the offset."""
    topic = create_online(client, "oc-wait", 1)
    with client.producer() as producer:
        for _ in range(20):
            txn = client.begin_transaction(timeout_s=30)
            future = producer.send(topic, b"v", partition=0, txn=txn)
            committing = txn.commit_async()
            assert future.result(30).offset >= 0
            assert committing.result(30) is None
            assert txn.state() in ("COMMITTING", "COMMITTED")
    assert committed_values(client, topic) == [b"v"] * 20


def _metric_sum(cluster: Cluster, name: str, role: str = "coordinator") -> float:
    """The counter `name`, every label set, summed over the cluster's processes of `role`
    (its coordinators by default)."""
    return sum(metric_sum(process["metrics_address"], (name + " ", name + "{"))
               for process in cluster.services() if process["role"] == role)


def test_markers_ride_with_the_next_staging_call_and_land_exactly_once(servers, client):
    """One-call transactions back to back on the same partitions: a transaction's markers
    wait for the next StageTxn call to their partition server and go inside it
    (coordinator/markers.py), instead of an EndTxnOnPartition call of their own. Every
    transaction still completes, once, with its data visible exactly once."""
    topic = create_online(client, "oc-riders", 2)
    riding_before = _metric_sum(servers, "atomlog_coordinator_riding_markers_total")
    txns = []
    with client.producer() as producer:
        for i in range(40):
            txn = client.begin_transaction(timeout_s=30)
            for partition in range(2):
                producer.send(topic, b"r%d-%d" % (i, partition), partition=partition, txn=txn)
            txn.commit()
            txns.append(txn)
    riding = _metric_sum(servers, "atomlog_coordinator_riding_markers_total") \
        - riding_before
    # 80 markers; those of a transaction whose successor went to the other coordinator
    # (TC partitions are picked round-robin), and the last ones, go alone.
    assert riding >= 10, riding
    wait_until(lambda: all(t.state() == "COMMITTED" for t in txns), 30,
               "every transaction to complete")
    wait_until(lambda: settled(client, topic, 2), 30, "the markers")
    assert sorted(committed_values(client, topic)) == sorted(
        b"r%d-%d" % (i, p) for i in range(40) for p in range(2))


def test_markers_riding_in_a_staging_call_are_applied_and_bad_ones_change_nothing(servers,
                                                                                  client):
    """StageTxnRequest.markers, straight: a request-wide problem with the markers refuses
    the whole call (nothing staged); a valid marker is applied with the items and
    answered in StageTxnResponse.markers; a marker with a bad field fails only itself."""
    topic = create_online(client, "oc-riders-raw", 1)
    tc, sequence, epoch = committed_one(client, topic)
    stub = client.channels.partition(client.metadata.route(topic, 0).address)
    tp = common_pb2.TopicPartition(topic=topic, partition=0)

    def stage(offset: int, value: bytes, markers=()):
        return partition_pb2.StageTxnRequest(
            items=[partition_pb2.StageTxnItem(
                txn_id=common_pb2.TxnId(tc_partition=tc, sequence=sequence + offset),
                coordinator_epoch=epoch, batches=[partition_pb2.ProduceItem(
                    topic_partition=tp, record_batch=encode_batch([Record(None, value, (), 0)]))])],
            markers=partition_pb2.EndTxnOnPartitionRequest(markers=list(markers)))

    def open_sequences() -> list[int]:
        return [t.txn_id.sequence for t in client.describe_partition(topic, 0).open_transactions]

    first = stub.StageTxn(stage(3_000, b"first"), timeout=10)
    assert not first.results[0].batch_results[0].error.reason
    assert not first.HasField("markers")
    # A marker without targets is a request-wide problem: nothing of the call is applied.
    with pytest.raises(grpc.RpcError) as refused:
        stub.StageTxn(stage(3_001, b"never", [partition_pb2.TxnMarker(
            txn_id=common_pb2.TxnId(tc_partition=tc, sequence=sequence + 3_000),
            decision=partition_pb2.TXN_DECISION_ABORT, coordinator_epoch=epoch)]), timeout=10)
    error = from_rpc_error(refused.value)
    assert error.reason == "INVALID_ARGUMENT" and "StageTxnRequest.markers" in error.message
    assert open_sequences() == [sequence + 3_000]
    # The ABORT of the first rides with the staging of the next; a bad marker beside it
    # (sequence 0) fails alone.
    reply = stub.StageTxn(stage(3_002, b"second", [
        partition_pb2.TxnMarker(txn_id=common_pb2.TxnId(tc_partition=tc, sequence=sequence + 3_000),
                                decision=partition_pb2.TXN_DECISION_ABORT,
                                coordinator_epoch=epoch, topic_partitions=[tp]),
        partition_pb2.TxnMarker(txn_id=common_pb2.TxnId(tc_partition=tc, sequence=0),
                                decision=partition_pb2.TXN_DECISION_ABORT,
                                coordinator_epoch=epoch, topic_partitions=[tp])]), timeout=10)
    assert not reply.results[0].batch_results[0].error.reason
    applied, bad = reply.markers.results
    assert not applied.topic_partition_results[0].error.reason
    assert applied.topic_partition_results[0].marker_offset >= 0 or \
        applied.topic_partition_results[0].already_ended  # the checker was quicker
    assert bad.topic_partition_results[0].error.reason == "INVALID_ARGUMENT"
    assert open_sequences() == [sequence + 3_002]
    wait_until(lambda: settled(client, topic, 1), 20, "the presumed abort of the second")
    assert client.describe_partition(topic, 0).aborted_transaction_count == 2
    assert committed_values(client, topic) == [b"kept"]


def test_tc_log_appends_ride_with_staging_calls_and_go_by_produce_to_an_older_server(
        servers, client, failpoint_dir):
    """A coordinator's TC-log appends (its decisions) to a partition server that its
    staging calls are busy with leave in the next of those calls (StageTxnRequest
    .appends, coordinator/staging.py) instead of Produce calls of their own: commits of
    eight clients at once keep the staging calls busy. A server that does not know the
    field (one from before it: the stage_appends_unknown failpoint) ignores them, or
    refuses a call with nothing else; the coordinator then sends them by Produce, and
    every transaction still commits exactly once."""
    topic = create_online(client, "oc-riding-appends", 3)
    clients, each = 8, 10

    def run(prefix: bytes) -> list:
        txns: list = []

        def commits(worker: int) -> None:
            with client.producer() as producer:
                for i in range(each):
                    txn = client.begin_transaction(timeout_s=30)
                    for partition in range(3):
                        producer.send(topic, prefix + b"%d-%d-%d" % (worker, i, partition),
                                      partition=partition, txn=txn)
                    txn.commit()
                    txns.append(txn)
        threads = [threading.Thread(target=commits, args=(w,)) for w in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert len(txns) == clients * each
        return txns

    riding = "atomlog_coordinator_riding_appends_total"
    not_taken = "atomlog_coordinator_riding_appends_not_taken_total"
    before = _metric_sum(servers, riding), _metric_sum(servers, not_taken)
    txns = run(b"a")
    rode = _metric_sum(servers, riding) - before[0]
    assert rode >= 5, rode
    assert _metric_sum(servers, not_taken) == before[1]
    with Armed(failpoint_dir, failpoints.STAGE_APPENDS_UNKNOWN):
        txns += run(b"o")
    assert _metric_sum(servers, not_taken) > before[1]
    wait_until(lambda: all(t.state() == "COMMITTED" for t in txns), 30,
               "every transaction to complete")
    wait_until(lambda: settled(client, topic, 3), 30, "the markers")
    assert sorted(committed_values(client, topic)) == sorted(
        prefix + b"%d-%d-%d" % (w, i, p) for prefix in (b"a", b"o") for w in range(clients)
        for i in range(each) for p in range(3))


def test_appends_riding_in_a_staging_call_name_only_tc_logs(servers, client):
    """StageTxnRequest.appends, straight: an append naming any topic but `__txn_log`
    refuses the whole call (INVALID_ARGUMENT naming the field; nothing of it staged), as
    does a call with no items, markers or appends."""
    topic = create_online(client, "oc-appends-raw", 1)
    tc, sequence, epoch = committed_one(client, topic)
    stub = client.channels.partition(client.metadata.route(topic, 0).address)
    tp = common_pb2.TopicPartition(topic=topic, partition=0)
    batch = encode_batch([Record(None, b"never", (), 0)])
    with pytest.raises(grpc.RpcError) as refused:
        stub.StageTxn(partition_pb2.StageTxnRequest(
            items=[partition_pb2.StageTxnItem(
                txn_id=common_pb2.TxnId(tc_partition=tc, sequence=sequence + 5_000),
                coordinator_epoch=epoch,
                batches=[partition_pb2.ProduceItem(topic_partition=tp, record_batch=batch)])],
            appends=partition_pb2.ProduceRequest(items=[partition_pb2.ProduceItem(
                topic_partition=tp, record_batch=batch)])), timeout=10)
    error = from_rpc_error(refused.value)
    assert error.reason == "INVALID_ARGUMENT", error
    assert error.metadata.get("field") == "appends[0].topic_partition.topic", error
    assert not client.describe_partition(topic, 0).open_transactions
    with pytest.raises(grpc.RpcError) as empty:
        stub.StageTxn(partition_pb2.StageTxnRequest(), timeout=10)
    assert from_rpc_error(empty.value).reason == "INVALID_ARGUMENT"
    assert committed_values(client, topic) == [b"kept"]


def test_a_staging_call_routes_each_part_and_each_riding_marker_on_its_own(servers, client):
    """One StageTxn call whose parts and riding markers route differently: a partition
    hosted here is staged (and a marker of a transaction it never saw needs nothing), a
    partition hosted by another server is refused NOT_PARTITION_OWNER naming that server
    (found by awaiting the metadata store, after the parts queued in the handler's first
    step), an unknown topic UNKNOWN_TOPIC_OR_PARTITION; each fails alone."""
    topic = create_online(client, "oc-routes", 6)
    tc, sequence, epoch = committed_one(client, topic)
    here = client.metadata.route(topic, 0).address
    elsewhere = next((p for p in range(6) if client.metadata.route(topic, p).address != here),
                     None)
    assert elsewhere is not None, "every partition on one server: nothing to route away"
    stub = client.channels.partition(here)

    def tp(name: str, partition: int):
        return common_pb2.TopicPartition(topic=name, partition=partition)

    reply = stub.StageTxn(partition_pb2.StageTxnRequest(
        items=[partition_pb2.StageTxnItem(
            txn_id=common_pb2.TxnId(tc_partition=tc, sequence=sequence + 4_000),
            coordinator_epoch=epoch, batches=[
                partition_pb2.ProduceItem(topic_partition=target, record_batch=encode_batch(
                    [Record(None, b"routed", (), 0)]))
                for target in (tp(topic, 0), tp(topic, elsewhere), tp("oc-no-such", 0))])],
        markers=partition_pb2.EndTxnOnPartitionRequest(markers=[partition_pb2.TxnMarker(
            txn_id=common_pb2.TxnId(tc_partition=tc, sequence=sequence + 4_001),
            decision=partition_pb2.TXN_DECISION_ABORT, coordinator_epoch=epoch,
            topic_partitions=[tp(topic, elsewhere), tp(topic, 0)])])), timeout=10)
    staged, away, unknown = reply.results[0].batch_results
    assert not staged.error.reason and staged.base_offset >= 0
    assert away.error.reason == "NOT_PARTITION_OWNER" and away.base_offset == -1
    assert away.error.metadata["owner_address"] == client.metadata.route(topic, elsewhere).address
    assert unknown.error.reason == "UNKNOWN_TOPIC_OR_PARTITION"
    (marker,) = reply.markers.results
    assert [r.error.reason for r in marker.topic_partition_results] == ["NOT_PARTITION_OWNER", ""]
    assert [t.txn_id.sequence for t in client.describe_partition(topic, 0).open_transactions] \
        == [sequence + 4_000]
    assert client.describe_partition(topic, elsewhere).high_watermark == 0  # nothing there
    wait_until(lambda: settled(client, topic, 6), 20, "the presumed abort of the staged part")
    assert committed_values(client, topic) == [b"kept"]


# ---------------------------------------------------------------- CommitTxns (chained)
def _commit(k: int, key: str, topic: str, value: bytes, partition: int = 0, **fields):
    return coordinator_pb2.CommitTxnRequest(
        tc_partition=k, idempotency_key=key, timeout_ms=30_000, batches=[
            partition_pb2.ProduceItem(topic_partition=common_pb2.TopicPartition(
                topic=topic, partition=partition),
                record_batch=fields.pop("record_batch", None)
                or encode_batch([Record(None, value, (), 0)]))], **fields)


def _commit_txns(client, k: int, commits) -> list:
    """CommitTxns on TC partition k's coordinator (retried while leases move): per commit,
    its CommitTxnResponse or its ItemError."""
    reply = Coordinators(client).call(k, "CommitTxns", coordinator_pb2.CommitTxnsRequest(
        commits=commits), time.monotonic() + 30)
    assert len(reply.results) == len(commits)
    return [r.error if r.error.reason else r.response for r in reply.results]


def test_commit_txns_stages_in_order_and_a_refused_commit_stops_those_after_it(servers,
                                                                              client):
    """CommitTxns: every commit is decided on its own, in request order on the partition;
    a commit refused at staging (a CRC the partition server rejects) answers its reason,
    the one after it EARLIER_COMMIT_FAILED with nothing of it visible, and that one sent
    again with the same key commits."""
    topic = create_online(client, "oc-chain", 1)
    count = client.metadata.tc_partition_count
    k = 0
    keys = [_key_on(k, count) for _ in range(5)]
    first = _commit_txns(client, k, [_commit(k, keys[0], topic, b"a"),
                                     _commit(k, keys[1], topic, b"b")])
    assert [r.state for r in first] == [coordinator_pb2.TXN_STATE_COMMITTING] * 2
    assert first[0].batch_results[0].base_offset < first[1].batch_results[0].base_offset
    corrupt = bytearray(encode_batch([Record(None, b"bad", (), 0)]))
    corrupt[-1] ^= 0xFF
    second = _commit_txns(client, k, [_commit(k, keys[2], topic, b"c"),
                                      _commit(k, keys[3], topic, b"", record_batch=bytes(corrupt)),
                                      _commit(k, keys[4], topic, b"e")])
    assert second[0].state == coordinator_pb2.TXN_STATE_COMMITTING
    assert second[1].reason == "CRC_MISMATCH"
    assert second[2].reason == "EARLIER_COMMIT_FAILED"
    wait_until(lambda: settled(client, topic, 1), 10, "the staged data aborted")
    assert committed_values(client, topic) == [b"a", b"b", b"c"]
    again = Coordinators(client).call(k, "CommitTxn", _commit(k, keys[4], topic, b"e"),
                                      time.monotonic() + 30)
    assert again.state == coordinator_pb2.TXN_STATE_COMMITTING and not again.already_ended
    retried = _commit_txns(client, k, [_commit(k, keys[0], topic, b"a")])  # a retry
    assert retried[0].already_ended
    wait_until(lambda: settled(client, topic, 1), 10, "the markers")
    assert committed_values(client, topic) == [b"a", b"b", b"c", b"e"]


def test_bad_commit_txns_input_is_refused_and_changes_nothing(servers, client):
    topic = create_online(client, "oc-chain-bad", 1)
    count = client.metadata.tc_partition_count
    k = 0

    def refused(commits) -> str:
        try:
            _commit_txns(client, k, commits)
        except errors.AtomlogClientError as error:
            return error.reason
        raise AssertionError("CommitTxns was accepted")

    assert refused([]) == "INVALID_ARGUMENT"
    assert refused([_commit(k, _key_on(k, count), topic, b"x") for _ in range(65)]) == \
        "INVALID_ARGUMENT"
    assert refused([_commit(k, _key_on(k, count), topic, b"x"),
                    coordinator_pb2.CommitTxnRequest(tc_partition=k, abort=True,
                                                     idempotency_key=_key_on(k, count))]) == \
        "INVALID_ARGUMENT"
    assert refused([_commit(k, _key_on(k, count), topic, b"x"),  # two TC partitions
                    _commit(1, _key_on(1, count), topic, b"y")]) == "INVALID_ARGUMENT"
    # One key twice: before, the first committed and the second, refused as concurrent,
    # was answered already_ended with the first's id when retried (its batch never was).
    twice = _key_on(k, count)
    assert refused([_commit(k, twice, topic, b"x"), _commit(k, twice, topic, b"y")]) == \
        "INVALID_ARGUMENT"
    # A commit refused before staging (no key; a key of another TC partition) breaks the
    # chain as well: nothing after it commits.
    results = _commit_txns(client, k, [
        _commit(k, "", topic, b"x"), _commit(k, _key_on(k, count), topic, b"y")])
    assert [r.reason for r in results] == ["INVALID_ARGUMENT", "EARLIER_COMMIT_FAILED"]
    other = _key_on(1, count)
    results = _commit_txns(client, k, [
        _commit(k, other, topic, b"x"), _commit(k, _key_on(k, count), topic, b"y")])
    assert [r.reason for r in results] == ["INVALID_ARGUMENT", "EARLIER_COMMIT_FAILED"]
    wait_until(lambda: settled(client, topic, 1), 10, "nothing left open")
    assert committed_values(client, topic) == []
    assert client.describe_partition(topic, 0).high_watermark == 0


@pytest.mark.parametrize("threads", [4, 16])
def test_pipelined_commits_of_one_producer_ride_together_and_keep_send_order(servers, threads):
    """commit_async() of many one-call transactions of one producer: the commits that
    queue while one is in flight leave together in one CommitTxns call (on the TC
    partition of the first: the others move there), and the records reach the
    partition in send order, each exactly once. A commit waits for its call on one of
    the client's commit threads, so a call carries at most `commit_threads` of them."""
    with Client(servers.info["bootstrap"], request_timeout_s=10,
                commit_threads=threads) as client:
        topic = create_online(client, f"oc-chain-sdk-{threads}", 1)
        futures, txns = [], []
        with client.producer() as producer:
            for i in range(60):
                txn = client.begin_transaction(timeout_s=30)
                producer.send(topic, b"p%02d" % i, partition=0, txn=txn)
                futures.append(txn.commit_async())
                txns.append(txn)
            for future in futures:
                future.result(60)
        carpool = client._one_call_carpool
        assert carpool.calls >= 1, "no commits rode together"
        assert carpool.most_carried <= threads
        if threads > 4:  # 60 commits queued at once: more than the old 4 threads allowed
            assert carpool.most_carried > 4, carpool.most_carried
        assert len({t.tc_partition for t in txns}) < 60
        wait_until(lambda: settled(client, topic, 1), 30, "the markers")
        assert committed_values(client, topic) == [b"p%02d" % i for i in range(60)]


def test_a_pipelined_commit_that_conflicts_fails_alone_and_the_rest_keep_order(servers):
    """One commit among pipelined ones conflicts on an ack: it fails (and changes
    nothing); the commits after it, even when carried in the same call, commit after it
    was refused, in send order."""
    with Client(servers.info["bootstrap"], request_timeout_s=10) as client:
        source = create_online(client, "oc-chain-in", 1)
        sink = create_online(client, "oc-chain-out", 1)
        with client.producer() as producer:
            producer.send(source, b"in", partition=0)
            producer.flush()
        streaming = Client(servers.info["bootstrap"], one_call_max_bytes=0)
        try:
            with client.consumer(source, subscription="chain", ack_timeout_s=60) as consumer, \
                    client.producer() as producer:
                got = []
                while not got:
                    got = consumer.poll(timeout_s=1.0)
                holder = streaming.begin_transaction(timeout_s=60)
                consumer.ack(got, txn=holder)  # pending at the server: a conflict for others
                futures = []
                for i in range(30):
                    txn = client.begin_transaction(timeout_s=30)
                    producer.send(sink, b"o%02d" % i, partition=0, txn=txn)
                    if i == 10:
                        consumer.ack(got, txn=txn)
                    futures.append(txn.commit_async())
                outcomes = []
                for future in futures:
                    try:
                        future.result(60)
                        outcomes.append("ok")
                    except errors.TransactionConflict:
                        outcomes.append("conflict")
                assert outcomes == ["ok"] * 10 + ["conflict"] + ["ok"] * 19
                wait_until(lambda: settled(client, sink, 1), 30, "the markers")
                assert committed_values(client, sink) == [b"o%02d" % i for i in range(30)
                                                          if i != 10]
                holder.commit(wait_for_markers=True)
        finally:
            streaming.close()
