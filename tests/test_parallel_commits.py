"""Parallel commits (docs/coordinator.md, "Parallel commits"; coordinator.parallel_commits,
auto by default) against real processes: a coordinator killed after a transaction's commit
point (its Staging record and every stage durable) is succeeded by one that commits it,
exactly once, also when the client gave up and also for a transaction with acks
(consume-transform-produce); one killed with the record durable and nothing staged is
succeeded by one that aborts it, and the SDK's retry commits anew.

The module runs its own cluster with parallel commits on (every one-call commit) and
failpoints enabled
(services/failpoints.py), so a test can hold a coordinator exactly between two steps and
kill it there. The helpers are tests/test_one_call.py's (same cluster shape, same checks)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from atomlog.v1 import coordinator_pb2
from services import failpoints
from spark_client import Client
from spark_client.transactions import Coordinators
from tests.conftest import create_online, metric_sum, wait_until
from tests.test_one_call import (
    Armed, commit_in_thread, committed_values, coordinator_of, failpoint_cluster,
    kill_and_restart, restart, settled, staged_everywhere,
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def failpoint_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("failpoints")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, failpoint_dir):
    yield from failpoint_cluster(tmp_path_factory.mktemp("atomlog-parallel-commits"),
                                 failpoint_dir, "--set", "coordinator.parallel_commits=true")


@pytest.fixture(scope="module")
def client(servers):
    with Client(servers.info["bootstrap"], request_timeout_s=10) as client:
        yield client


@pytest.fixture(scope="module")
def warm_topic(client) -> str:
    return create_online(client, "oc-warm", 1)


def lease_owners(servers) -> dict[int, str]:
    """TC partition -> the coordinator holding its lease."""
    return {k: process["name"] for process in servers.status()["processes"]
            for k in process.get("tc_partitions", [])}


def leases_settled(servers) -> None:
    """Wait until every TC partition has an owner, the coordinators hold even shares, and
    nothing moved for 2 s (two rebalance intervals): after a test killed and restarted a
    coordinator, its peers hand partitions back for a few seconds."""
    coordinators = [p["name"] for p in servers.services() if p["role"] == "coordinator"]

    def stable() -> bool:
        owners = lease_owners(servers)
        shares = Counter(owners.values())
        if len(owners) < 16 or max(shares[c] for c in coordinators) - min(
                shares[c] for c in coordinators) > 1:
            return False
        time.sleep(2)
        return lease_owners(servers) == owners
    wait_until(stable, 60, "the TC partitions' leases to settle")


def parallel_transaction(servers, client, warm_topic: str, timeout_s: float = 60):
    """A transaction whose one-call commit will be a parallel commit: its TC partition
    has a durable reservation (the first commit of a block of sequences waits for its
    reservation and takes two rounds), made by committing one transaction there first,
    under the owner that will take the commit (a new owner reserves a new block: the
    leases are let settle first, and the warm-up is made again if the lease moved). The
    transaction returned is begun after the warm-up: its `timeout_s` (a few seconds in
    some tests) must not run out while a loaded machine warms up."""
    leases_settled(servers)
    tc = begin_on(client, None, 30).tc_partition  # lazy: nothing is sent until commit
    while True:
        owner = coordinator_of(servers, tc)
        warm = begin_on(client, tc, 30)
        with client.producer() as producer:
            producer.send(warm_topic, b"warm", partition=0, txn=warm)
            warm.commit()
        if coordinator_of(servers, tc) == owner:
            return begin_on(client, tc, timeout_s)


def begin_on(client, tc: int | None, timeout_s: float):
    """A one-call transaction of TC partition `tc` (any when None): begun until one lands
    there (nothing is sent until commit, so the others cost nothing)."""
    while True:
        txn = client.begin_transaction(timeout_s=timeout_s)
        if tc is None or txn.tc_partition == tc:
            return txn


def test_coordinator_killed_after_staging_is_committed_by_its_successor(servers, client,
                                                                       failpoint_dir,
                                                                       warm_topic):
    """A parallel commit (docs/coordinator.md): held after its Staging record and both
    stages are durable, before the answer, and killed there. That is the commit point:
    the successor resolves the record by asking both partitions and commits it; the SDK's
    retry with the same idempotency key finds that commit. Exactly once, nothing aborted."""
    topic = create_online(client, "oc-resolved", 2)
    outcome: dict = {}
    txn = parallel_transaction(servers, client, warm_topic)
    with Armed(failpoint_dir, failpoints.ONE_CALL_DECIDE) as held, client.producer() as producer:
        for i in range(6):
            producer.send(topic, f"p{i}".encode(), partition=i % 2, txn=txn)
        assert txn.one_call
        thread = commit_in_thread(txn, outcome)
        staged = staged_everywhere(client, topic, 2)
        kill_and_restart(servers, coordinator_of(servers, staged[0]), held)
        thread.join(timeout=120)
    assert not thread.is_alive()
    wait_until(lambda: settled(client, topic, 2), 30, "every partition to settle")
    assert outcome.get("committed") == f"{staged[0]}:{staged[1]}", outcome
    assert sorted(committed_values(client, topic)) == sorted(f"p{i}".encode() for i in range(6))
    for partition in range(2):
        assert client.describe_partition(topic, partition).aborted_transaction_count == 0


@contextlib.contextmanager
def held_commit(servers, client, short, warm_topic: str, topic: str, prefix: str,
                failpoint_dir: Path):
    """A parallel commit of `short`'s (a client that gives up soon) of four records over
    `topic`'s two partitions, committing on a thread of its own and held by the
    one_call_decide failpoint once staged on both: yields (the transaction, the armed
    failpoint, the thread, its outcome, the staged (TC partition, sequence))."""
    txn = parallel_transaction(servers, short, warm_topic, timeout_s=3)
    with Armed(failpoint_dir, failpoints.ONE_CALL_DECIDE) as held, \
            short.producer() as producer:
        for i in range(4):
            producer.send(topic, f"{prefix}{i}".encode(), partition=i % 2, txn=txn)
        result: dict = {}
        thread = commit_in_thread(txn, result)
        yield txn, held, thread, result, staged_everywhere(client, topic, 2)


def test_a_commit_its_client_gave_up_on_is_still_resolved_exactly_once(servers, client,
                                                                       failpoint_dir,
                                                                       warm_topic):
    """Same kill, but the client gives up before the coordinator is back (its outcome
    unknown to it): the successor still commits what reached its commit point, once, and
    no partition keeps it open. (The other coordinator may take the TC partition over
    and resolve it within the client's last attempt: then the client hears it
    committed. Either way it is committed once.)"""
    topic = create_online(client, "oc-gave-up", 2)
    short = Client(servers.info["bootstrap"], request_timeout_s=2)
    victim = None
    try:
        with held_commit(servers, client, short, warm_topic, topic, "g", failpoint_dir) as (
                _, held, thread, result, staged):
            victim = coordinator_of(servers, staged[0])
            os.kill(servers.process(victim)["pid"], signal.SIGKILL)
            thread.join(timeout=60)  # the client runs out of time while it is down
            held.disarm()
        assert not thread.is_alive()
        assert "error" in result or "committed" in result, result
        assert victim in restart(servers)
        wait_until(lambda: settled(client, topic, 2), 30, "the resolution")
        assert sorted(committed_values(client, topic)) == sorted(
            f"g{i}".encode() for i in range(4))
    finally:
        short.close()
        if victim is not None:
            restart(servers)  # (nothing, unless a check above failed: the next tests need it)


def _staging_txns(client, tc: int) -> list:
    """The OPEN transactions of TC partition `tc` (a parallel commit's Staging record
    makes its transaction OPEN there before anything is staged)."""
    listed = Coordinators(client).call(tc, "ListTransactions",
                                       coordinator_pb2.ListTransactionsRequest(
                                           states=[coordinator_pb2.TXN_STATE_OPEN],
                                           tc_partitions=[tc]), time.monotonic() + 30)
    return list(listed.transactions)


def test_coordinator_killed_before_staging_is_aborted_by_its_successor(servers, client,
                                                                      failpoint_dir,
                                                                      warm_topic):
    """A parallel commit held with its Staging record durable and nothing staged, and
    killed there: the successor asks both partitions (fencing the dead owner's epoch
    there), hears that neither holds it, and logs its abort; the key is free again, so
    the SDK's retry commits the transaction anew. Exactly once, nothing left open."""
    topic = create_online(client, "oc-unstaged", 2)
    outcome: dict = {}
    txn = parallel_transaction(servers, client, warm_topic)
    with Armed(failpoint_dir, failpoints.ONE_CALL_STAGE) as held, client.producer() as producer:
        for i in range(4):
            producer.send(topic, f"u{i}".encode(), partition=i % 2, txn=txn)
        tc = txn.tc_partition
        thread = commit_in_thread(txn, outcome)
        wait_until(lambda: _staging_txns(client, tc), 20, "the Staging record")
        (logged,) = _staging_txns(client, tc)
        kill_and_restart(servers, coordinator_of(servers, tc), held)
        thread.join(timeout=120)
    assert not thread.is_alive()
    assert outcome.get("committed"), outcome
    staged_id = f"{logged.txn_id.tc_partition}:{logged.txn_id.sequence}"
    assert outcome["committed"] != staged_id
    described = Coordinators(client).call(tc, "DescribeTransaction",
                                          coordinator_pb2.DescribeTransactionRequest(
                                              txn_id=logged.txn_id), time.monotonic() + 30)
    assert described.summary.state in (coordinator_pb2.TXN_STATE_ABORTING,
                                       coordinator_pb2.TXN_STATE_ABORTED)
    wait_until(lambda: settled(client, topic, 2), 30, "every partition to settle")
    assert sorted(committed_values(client, topic)) == sorted(f"u{i}".encode() for i in range(4))


def cursor_of(client, topic: str, subscription: str):
    """Partition 0's cursor of `topic`'s `subscription`."""
    (cursor,) = [c for c in client.describe_partition(topic, 0).subscriptions
                 if c.subscription_partition.subscription == subscription]
    return cursor


def pending_on(client, topic: str, subscription: str) -> list[tuple[int, int]]:
    """The transactions with acks pending on partition 0 of `topic`'s `subscription`."""
    return [(p.txn_id.tc_partition, p.txn_id.sequence)
            for p in cursor_of(client, topic, subscription).pending_acks]


def ctp_parallel_commit(servers, client, warm_topic: str, name: str, failpoint: str,
                        failpoint_dir: Path, while_held, ack_timeout_s: float = 60):
    """A consume-transform-produce transaction (three inputs of topic NAME-in consumed,
    reversed into NAME-out, acked in the transaction) committed as a parallel commit on a
    thread while `failpoint` holds its coordinator; `while_held(txn)` runs then and
    returns what the test checks later. The coordinator is then killed and restarted.
    Checked after: the commit answered, the outputs visible once, the inputs acknowledged
    once, nothing pending. Returns (the committed transaction's id, what while_held
    returned, the consumer, still open for more checks, the output topic)."""
    source = create_online(client, f"{name}-in", 1)
    sink = create_online(client, f"{name}-out", 1)
    with client.producer() as producer:
        for i in range(3):
            producer.send(source, f"in{i}".encode(), partition=0)
    outcome: dict = {}
    consumer = client.consumer(source, subscription="ctp", ack_timeout_s=ack_timeout_s)
    try:
        got: list = []
        while len(got) < 3:
            got += consumer.poll(timeout_s=1.0)
        txn = parallel_transaction(servers, client, warm_topic)
        with Armed(failpoint_dir, failpoint) as held, client.producer() as producer:
            for message in got:
                producer.send(sink, message.value[::-1], partition=0, txn=txn)
            consumer.ack(got, txn=txn)
            assert txn.one_call
            thread = commit_in_thread(txn, outcome)
            seen = while_held(txn, source, sink)
            kill_and_restart(servers, coordinator_of(servers, txn.tc_partition), held)
            thread.join(timeout=120)
        assert not thread.is_alive()
        assert outcome.get("committed"), outcome
        wait_until(lambda: settled(client, sink, 1) and not pending_on(client, source, "ctp"),
                   30, "the markers")
        assert committed_values(client, sink) == [f"in{i}".encode()[::-1] for i in range(3)]
        assert cursor_of(client, source, "ctp").cumulative_end_offset == 3
    except BaseException:
        consumer.close()
        raise
    return outcome["committed"], seen, consumer, sink


def test_a_transaction_with_acks_killed_after_its_commit_point_is_committed_once(
        servers, client, failpoint_dir, warm_topic):
    """Consume-transform-produce as a parallel commit: its outputs and its acks staged
    with its Staging record, held before the answer, and the coordinator killed there.
    The successor asks the output partition and the input's subscription partition, both
    hold it durably: it commits. The outputs are visible once and the inputs stay
    acknowledged (never delivered again); the SDK's retry finds the commit."""
    def staged(txn, source: str, sink: str) -> tuple[int, int]:
        staged = staged_everywhere(client, sink, 1)
        wait_until(lambda: pending_on(client, source, "ctp") == [staged], 20,
                   "the ack staged")
        return staged

    committed, staged, consumer, sink = ctp_parallel_commit(
        servers, client, warm_topic, "oc-ctp", failpoints.ONE_CALL_DECIDE, failpoint_dir,
        staged, ack_timeout_s=5)
    with consumer:
        assert committed == f"{staged[0]}:{staged[1]}"
        assert client.describe_partition(sink, 0).aborted_transaction_count == 0
        assert not consumer.poll(timeout_s=7.0)  # past the ack timeout: nothing comes back


def test_a_transaction_with_acks_killed_before_staging_is_aborted_and_retried_once(
        servers, client, failpoint_dir, warm_topic):
    """The same transaction held with its Staging record durable and nothing staged, and
    killed there: the successor asks the output partition and the subscription partition
    (fencing the dead owner there), neither holds it, so it logs the abort; the SDK's
    retry commits anew. The outputs are visible once, the inputs acknowledged once."""
    def logged(txn, source: str, sink: str):
        wait_until(lambda: _staging_txns(client, txn.tc_partition), 20, "the Staging record")
        (record,) = _staging_txns(client, txn.tc_partition)
        assert (record.topic_partition_count, record.subscription_partition_count) == \
            (1, 1)  # the Staging record names the acked subscription partition
        return record

    committed, record, consumer, _ = ctp_parallel_commit(
        servers, client, warm_topic, "oc-ctp-unstaged", failpoints.ONE_CALL_STAGE,
        failpoint_dir, logged)
    with consumer:
        assert committed != f"{record.txn_id.tc_partition}:{record.txn_id.sequence}"


def test_by_default_commits_one_at_a_time_are_parallel_and_overlapping_ones_are_not(cluster):
    """coordinator.parallel_commits=auto (the default, as on the shared cluster): once 16
    one-call commits in a row began on a coordinator with no other in flight, its
    commits are parallel commits; commits of many clients at once keep two rounds (the
    extra append would cost the CPU they share), and only a quiet run of 16 brings
    parallel commits back."""
    coordinators = [p for p in cluster.services() if p["role"] == "coordinator"]

    def parallel() -> float:
        return sum(metric_sum(p["metrics_address"], "atomlog_coordinator_parallel_commits_total")
                   for p in coordinators)

    with Client(cluster.info["bootstrap"], request_timeout_s=10) as client:
        topic = create_online(client, "pc-auto", 2)
        tc = begin_on(client, None, 30).tc_partition
        with client.producer() as producer:
            def commit(value: bytes) -> None:
                txn = begin_on(client, tc, 30)  # one TC partition: one reservation, warmed
                producer.send(topic, value, partition=len(value) % 2, txn=txn)
                txn.commit()

            for i in range(16):  # a quiet run; the first reserves a block of sequences
                commit(b"warm-%d" % i)
            before = parallel()
            for i in range(10):
                commit(b"lone-%d" % i)
            assert parallel() - before >= 8  # (a lease moved meanwhile reserves again)
            before = parallel()
            threads = [threading.Thread(target=lambda i=i: [commit(b"crowd-%d-%d" % (i, j))
                                                            for j in range(5)])
                       for i in range(12)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            crowded = parallel() - before
            assert crowded <= 12, crowded  # at most each thread's first, before overlaps
            before = parallel()
            for i in range(10):  # one at a time again: not parallel until 16 in a row
                commit(b"after-%d" % i)
            assert parallel() - before == 0
        assert len(committed_values(client, topic)) == 96


def test_a_parallel_commit_whose_grpc_caller_went_away_stays_in_flight_until_decided(
        servers, client, failpoint_dir, warm_topic):
    """A parallel commit runs shielded from its caller: over gRPC a caller whose deadline
    passes has its handler cancelled, and the commit goes on. It counts as in flight
    (what coordinator.parallel_commits=auto reads, and
    atomlog_coordinator_one_call_commits_in_flight shows) until it is decided, not until
    its caller went away; then it is decided once, and no partition keeps it open."""
    topic = create_online(client, "oc-in-flight", 2)
    short = Client(servers.info["bootstrap"], request_timeout_s=1, links=False)

    def in_flight(name: str) -> float:
        (process,) = [p for p in servers.services() if p["name"] == name]
        return metric_sum(process["metrics_address"],
                          "atomlog_coordinator_one_call_commits_in_flight")

    try:
        with held_commit(servers, client, short, warm_topic, topic, "f", failpoint_dir) as (
                txn, held, thread, result, staged):
            owner = coordinator_of(servers, txn.tc_partition)
            thread.join(timeout=60)  # every attempt's deadline passes while it is held
            assert not thread.is_alive()
            assert "error" in result, result
            # Only the held commit is left; its caller's handler was cancelled long ago.
            wait_until(lambda: in_flight(owner) == 1, 10, "only the held commit in flight")
            time.sleep(0.5)
            assert in_flight(owner) == 1
            held.disarm()
        wait_until(lambda: in_flight(owner) == 0, 30, "the held commit to be decided")
        wait_until(lambda: settled(client, topic, 2), 30, "every partition to settle")
        assert staged[0] == txn.tc_partition
        # Decided once, all or nothing: by the time it goes on, the transaction's
        # timeout (3 s) has passed, and the coordinator aborts it (no caller was told
        # it committed); had the decision come first, all four would be there.
        assert sorted(committed_values(client, topic)) in (
            [], sorted(f"f{i}".encode() for i in range(4)))
    finally:
        short.close()
