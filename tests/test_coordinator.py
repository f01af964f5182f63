"""The transaction coordinator with real processes: leases of the TC partitions, the
RPCs against the durable TC log, timeouts, fencing of a paused owner, and kill -9 of the
owner at each point of a commit (the new owner finishes as decided, never flipping)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from atomlog.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    metadata_pb2,
    metadata_pb2_grpc,
    partition_pb2,
    partition_pb2_grpc,
)

from coordinator.records import tc_partition_for
from services.errors import from_rpc_error
from spark_client import Client
from tests.conftest import SESSION_TIMEOUT_MS, TC_SNAPSHOT_EVERY_RECORDS, metric_sum, wait_until

S = coordinator_pb2
COMMIT, ABORT = partition_pb2.TXN_DECISION_COMMIT, partition_pb2.TXN_DECISION_ABORT
COORDINATORS = ("coord-0", "coord-1")


def metadata(cluster) -> metadata_pb2.GetMetadataResponse:
    # From the id allocator: the tests pause and kill partition servers and coordinators.
    allocator = next(p for p in cluster.services() if p["role"] == "id_allocator")
    with grpc.insecure_channel(allocator["grpc_address"]) as channel:
        return metadata_pb2_grpc.MetadataServiceStub(channel).GetMetadata(
            metadata_pb2.GetMetadataRequest(), timeout=10)


def owners(cluster) -> dict[int, tuple[str, int]]:
    """TC partition -> (coordinator name, epoch), for the owned ones."""
    return {tc.tc_partition: (tc.coordinator_name, tc.coordinator_epoch)
            for tc in metadata(cluster).tc_partitions if tc.coordinator_name}


def owner(cluster, k: int, timeout_s: float = 15) -> tuple[str, int]:
    """(coordinator name, epoch) of TC partition k once it has one: a balancing pass may be
    moving it between the coordinators (released, not yet acquired) when asked."""
    seen: dict[int, tuple[str, int]] = {}

    def owned() -> bool:
        seen.clear()
        seen.update(owners(cluster))
        return k in seen
    wait_until(owned, timeout_s, f"TC partition {k} to have a coordinator")
    return seen[k]


def all_owned(cluster) -> bool:
    return len(owners(cluster)) == metadata(cluster).tc_partition_count


_channels: dict[str, grpc.Channel] = {}


def stub(cluster, name: str) -> coordinator_pb2_grpc.CoordinatorServiceStub:
    address = cluster.process(name)["grpc_address"]
    if address not in _channels:
        _channels[address] = grpc.insecure_channel(address)
    return coordinator_pb2_grpc.CoordinatorServiceStub(_channels[address])


_owner_of: dict[tuple[str, int], str] = {}  # (cluster directory, k) -> the owner last seen


def call(cluster, k: int, method: str, request, timeout: float = 10.0):
    """Call the owner of TC partition k, following NOT_COORDINATOR / COORDINATOR_LOADING.
    The owner is looked up again (GetMetadata) only when a call to the one last seen
    fails retriably: a lookup per call made the snapshot test's 800 calls take 80 s in CI."""
    deadline = time.monotonic() + 30
    key = (str(cluster.data_dir), k)
    while True:
        owner = _owner_of.get(key) or owners(cluster).get(k, ("", 0))[0]
        try:
            if owner:
                _owner_of[key] = owner
                return getattr(stub(cluster, owner), method)(request, timeout=timeout)
        except grpc.RpcError as raised:
            error = from_rpc_error(raised)
            if not error.retriable or time.monotonic() > deadline:
                raise
        _owner_of.pop(key, None)
        if time.monotonic() > deadline:
            raise AssertionError(f"TC partition {k} has no owner")
        time.sleep(0.1)


def reason_of(fn) -> str:
    with pytest.raises(grpc.RpcError) as raised:
        fn()
    return from_rpc_error(raised.value).reason


def tp(topic: str, partition: int) -> common_pb2.TopicPartition:
    return common_pb2.TopicPartition(topic=topic, partition=partition)


def state(cluster, txn_id) -> int:
    return call(cluster, txn_id.tc_partition, "GetTxnStatus",
                S.GetTxnStatusRequest(txn_id=txn_id)).state


@pytest.fixture(scope="module")
def topics(cluster):
    client = Client(cluster.info["bootstrap"])
    for name in ("txa", "txb"):
        try:
            client.create_topic(name, partitions=3)
        except Exception as error:  # noqa: BLE001 — created by an earlier module
            assert "exists" in str(error).lower()
    client.close()
    wait_until(lambda: all_owned(cluster), 30, "every TC partition to be leased")
    return ("txa", "txb")


def counts(cluster) -> list[int]:
    held = owners(cluster)
    return sorted(sum(1 for owner, _ in held.values() if owner == name)
                  for name in COORDINATORS)


def test_leases_spread_evenly_with_fresh_epochs(cluster, topics):
    took = wait_until(lambda: counts(cluster) == [8, 8], 30, "an even spread")
    print(f"\nleases even (8/8) after a further {took:.1f} s")
    held = owners(cluster)
    assert len(held) == 16
    assert all(epoch >= 1 for _, epoch in held.values())
    # `atomlog status` shows who holds what.
    rows = {r["name"]: r for r in cluster.status()["processes"]}
    for name in COORDINATORS:
        assert rows[name]["tc_partitions"] == sorted(k for k, (o, _) in held.items() if o == name)


def ticks(cluster) -> float:
    return sum(metric_sum(cluster.process(name)["metrics_address"],
                          "atomlog_coordinator_ticks_total ") for name in COORDINATORS)


def ticks_over(cluster, seconds: float) -> float:
    before = ticks(cluster)
    time.sleep(seconds)
    return ticks(cluster) - before


def test_an_idle_tc_partition_ticks_once_a_second_and_a_transaction_brings_back_the_pace(
        cluster, topics):
    """With nothing unfinished a tick can only expire sessions: the 16 TC partitions
    tick about once a second each (every 100 ms, they would tick 320 times in 2 s).
    A transaction wakes its partition at once; it ticks every 100 ms while the
    transaction is open (its timeout needs that), and its timeout still aborts it."""
    wait_until(lambda: counts(cluster) == [8, 8], 30, "an even spread")
    idle = ticks_over(cluster, 2.0)
    # (Room for a few partitions another test left an unfinished transaction on.)
    assert 16 <= idle <= 100, idle
    k = 4
    txn = call(cluster, k, "NewTxn", S.NewTxnRequest(
        tc_partition=k, timeout_ms=60_000, topic_partitions=[tp("txa", 1)])).txn_id
    busy = ticks_over(cluster, 2.0)
    assert busy >= idle + 10, (idle, busy)
    call(cluster, k, "EndTxn", S.EndTxnRequest(txn_id=txn, decision=ABORT))
    wait_until(lambda: state(cluster, txn) == S.TXN_STATE_ABORTED, 10, "the abort")
    txn = call(cluster, k, "NewTxn", S.NewTxnRequest(
        tc_partition=k, timeout_ms=300, topic_partitions=[tp("txa", 1)])).txn_id
    wait_until(lambda: state(cluster, txn) == S.TXN_STATE_ABORTED, 10, "the timeout abort")
    status = call(cluster, k, "GetTxnStatus", S.GetTxnStatusRequest(txn_id=txn))
    assert status.end_cause == S.TXN_END_CAUSE_TIMEOUT


def test_commit_across_partitions_is_durable_and_idempotent(cluster, topics):
    k = 3
    opened = call(cluster, k, "NewTxn", S.NewTxnRequest(
        tc_partition=k, timeout_ms=30_000,
        topic_partitions=[tp("txa", 0), tp("txb", 2), tp("nope", 0), tp("txa", 7)]))
    assert opened.state == S.TXN_STATE_OPEN and opened.txn_id.tc_partition == k
    reasons = [r.error.reason for r in opened.topic_partition_results]
    assert reasons == ["", "", "UNKNOWN_TOPIC_OR_PARTITION", "UNKNOWN_TOPIC_OR_PARTITION"]
    txn = opened.txn_id
    added = call(cluster, k, "AddPartitionToTxn", S.AddPartitionToTxnRequest(
        txn_id=txn, topic_partitions=[tp("txa", 1), tp("txa", 0)]))
    assert [r.error.reason for r in added.results] == ["", ""]
    described = call(cluster, k, "DescribeTransaction", S.DescribeTransactionRequest(txn_id=txn))
    assert {(t.topic, t.partition) for t in described.topic_partitions} == {
        ("txa", 0), ("txa", 1), ("txb", 2)}
    ended = call(cluster, k, "EndTxn", S.EndTxnRequest(txn_id=txn, decision=COMMIT,
                                                        wait_for_markers=True))
    assert ended.state == S.TXN_STATE_COMMITTED and not ended.already_ended
    again = call(cluster, k, "EndTxn", S.EndTxnRequest(txn_id=txn, decision=COMMIT))
    assert again.already_ended and again.state == S.TXN_STATE_COMMITTED
    assert reason_of(lambda: call(cluster, k, "EndTxn", S.EndTxnRequest(
        txn_id=txn, decision=ABORT))) == "TRANSACTION_ALREADY_COMMITTED"
    described = call(cluster, k, "DescribeTransaction", S.DescribeTransactionRequest(txn_id=txn))
    assert described.summary.topic_partition_count == 3  # finished: counts, not the list
    assert not described.marker_pending_topic_partitions
    assert described.completed_unix_ms >= described.decided_unix_ms > 0


def test_wrong_coordinator_and_bad_input(cluster, topics):
    held = owners(cluster)
    k = 5
    other = next(name for name in COORDINATORS if name != held[k][0])
    with pytest.raises(grpc.RpcError) as raised:
        stub(cluster, other).NewTxn(S.NewTxnRequest(tc_partition=k), timeout=5)
    error = from_rpc_error(raised.value)
    assert error.reason == "NOT_COORDINATOR" and error.metadata["owner_server_name"] == held[k][0]
    owner = stub(cluster, held[k][0])
    for request, method in (
            (S.NewTxnRequest(tc_partition=99), "NewTxn"),
            (S.EndTxnRequest(txn_id=common_pb2.TxnId(tc_partition=k, sequence=1)), "EndTxn"),
            (S.EndTxnRequest(decision=COMMIT), "EndTxn"),
            (S.GetTxnStatusRequest(txn_id=common_pb2.TxnId(tc_partition=k)), "GetTxnStatus"),
            (S.VerifyTxnPartitionsRequest(), "VerifyTxnPartitions")):
        rpc = getattr(owner, method)
        assert reason_of(lambda: rpc(request, timeout=5)) == "INVALID_ARGUMENT"  # noqa: B023
    assert reason_of(lambda: owner.NewTxn(S.NewTxnRequest(tc_partition=k, timeout_ms=3_600_000),
                                          timeout=5)) == "INVALID_TRANSACTION_TIMEOUT"
    assert reason_of(lambda: owner.GetTxnStatus(S.GetTxnStatusRequest(
        txn_id=common_pb2.TxnId(tc_partition=k, sequence=10**12)), timeout=5)) == \
        "UNKNOWN_TRANSACTION"
    # A subscription name the partition servers refuse is refused here, per item, and the
    # transaction does not hold it: before, it did, every marker to its server (which
    # carries all of the transaction's targets there) was refused, and the transaction
    # never ended. The valid target beside it is held, and the transaction ends.
    bad_names = ["bad name", "a/b", "..", "s" * 250]
    opened = owner.NewTxn(S.NewTxnRequest(
        tc_partition=k, timeout_ms=30_000, topic_partitions=[tp("txa", 0)],
        subscription_partitions=[common_pb2.SubscriptionPartition(
            topic="txa", partition=0, subscription=name) for name in bad_names]), timeout=5)
    assert [r.error.reason for r in opened.subscription_partition_results] == \
        ["INVALID_ARGUMENT"] * len(bad_names)
    assert not opened.topic_partition_results[0].error.reason
    added = owner.AddSubscriptionToTxn(S.AddSubscriptionToTxnRequest(
        txn_id=opened.txn_id, subscription_partitions=[common_pb2.SubscriptionPartition(
            topic="txa", partition=0, subscription="bad name")]), timeout=5)
    assert [r.error.reason for r in added.results] == ["INVALID_ARGUMENT"]
    ended = owner.EndTxn(S.EndTxnRequest(txn_id=opened.txn_id, decision=COMMIT,
                                         wait_for_markers=True), timeout=15)
    assert ended.state == S.TXN_STATE_COMMITTED


def test_parent_commit_keeps_named_children_and_aborts_the_rest(cluster, topics):
    k = 7
    parent = call(cluster, k, "NewTxn", S.NewTxnRequest(tc_partition=k, timeout_ms=30_000)).txn_id
    children = []
    for partition in range(3):
        child = call(cluster, k, "NewTxn", S.NewTxnRequest(
            tc_partition=k, parent_txn_id=parent,
            topic_partitions=[tp("txa", partition)])).txn_id
        children.append(child)
    for child in children[:2]:
        prepared = call(cluster, k, "PrepareTxn", S.PrepareTxnRequest(txn_id=child))
        assert prepared.state == S.TXN_STATE_PREPARED
    assert reason_of(lambda: call(cluster, k, "EndTxn", S.EndTxnRequest(
        txn_id=parent, decision=COMMIT, children_to_keep=[children[2]]))) == "CHILD_NOT_PREPARED"
    ended = call(cluster, k, "EndTxn", S.EndTxnRequest(
        txn_id=parent, decision=COMMIT, children_to_keep=[children[0]], wait_for_markers=True))
    assert ended.state == S.TXN_STATE_COMMITTED
    assert [c.sequence for c in ended.kept_child_txn_ids] == [children[0].sequence]
    assert {c.sequence for c in ended.aborted_child_txn_ids} == {children[1].sequence,
                                                                 children[2].sequence}
    assert state(cluster, children[0]) == S.TXN_STATE_COMMITTED
    assert state(cluster, children[1]) == S.TXN_STATE_ABORTED
    status = call(cluster, k, "GetTxnStatus", S.GetTxnStatusRequest(txn_id=children[2]))
    assert status.end_cause == S.TXN_END_CAUSE_PARENT


def test_open_timeout_aborts_and_commit_then_fails_distinctly(cluster, topics):
    k = 9
    txn = call(cluster, k, "NewTxn", S.NewTxnRequest(
        tc_partition=k, timeout_ms=300, topic_partitions=[tp("txa", 2)])).txn_id
    wait_until(lambda: state(cluster, txn) == S.TXN_STATE_ABORTED, 10, "the timeout abort")
    status = call(cluster, k, "GetTxnStatus", S.GetTxnStatusRequest(txn_id=txn))
    assert status.end_cause == S.TXN_END_CAUSE_TIMEOUT
    assert reason_of(lambda: call(cluster, k, "EndTxn", S.EndTxnRequest(
        txn_id=txn, decision=COMMIT))) == "TRANSACTION_TIMED_OUT"
    # PREPARED has its own, longer timeout: not aborted by the OPEN one.
    txn2 = call(cluster, k, "NewTxn", S.NewTxnRequest(tc_partition=k, timeout_ms=300)).txn_id
    call(cluster, k, "PrepareTxn", S.PrepareTxnRequest(txn_id=txn2, prepared_timeout_ms=60_000))
    time.sleep(1.0)
    assert state(cluster, txn2) == S.TXN_STATE_PREPARED
    call(cluster, k, "EndTxn", S.EndTxnRequest(txn_id=txn2, decision=COMMIT))


def test_transactional_id_session_fences_the_previous_one(cluster, topics):
    tid = "copier-1"
    k = tc_partition_for(tid, 16)
    first = call(cluster, k, "InitProducerId", S.InitProducerIdRequest(transactional_id=tid))
    assert first.tc_partition == k
    session = S.TransactionalSession(transactional_id=tid, producer_id=first.producer_id,
                                     producer_epoch=first.producer_epoch)
    txn = call(cluster, k, "NewTxn", S.NewTxnRequest(tc_partition=k, session=session)).txn_id
    second = call(cluster, k, "InitProducerId", S.InitProducerIdRequest(transactional_id=tid))
    assert (second.producer_id, second.producer_epoch) == (first.producer_id,
                                                          first.producer_epoch + 1)
    assert second.aborted_txn_id.sequence == txn.sequence
    assert reason_of(lambda: call(cluster, k, "NewTxn", S.NewTxnRequest(
        tc_partition=k, session=session))) == "PRODUCER_FENCED"
    wait_until(lambda: state(cluster, txn) == S.TXN_STATE_ABORTED, 10, "the fenced abort")


def test_an_epoch_bump_retried_after_a_lost_answer_gets_its_session_from_the_next_owner_too(
        cluster, topics):
    """A producer bumps its own epoch (InitProducerId carrying it, as the SDK does after an
    unknown outcome), the answer is lost, and it asks again with the same epoch. Before,
    the retry was answered PRODUCER_FENCED and the producer could never go on (KIP-360's
    case). Now it gets the session the first call made: from the same owner, and from
    the next one after kill -9. A new instance's takeover still fences the old holder."""
    tid = "retrier-1"
    k = tc_partition_for(tid, 16)

    def init(producer_id: int = 0, epoch: int = 0):
        return call(cluster, k, "InitProducerId", S.InitProducerIdRequest(
            transactional_id=tid, producer_id=producer_id, producer_epoch=epoch), timeout=30)

    first = init()
    held = (first.producer_id, first.producer_epoch)
    session = S.TransactionalSession(transactional_id=tid, producer_id=held[0],
                                     producer_epoch=held[1])
    txn = call(cluster, k, "NewTxn", S.NewTxnRequest(tc_partition=k, session=session)).txn_id
    bumped = init(*held)  # this answer is the one lost
    assert (bumped.producer_id, bumped.producer_epoch) == (held[0], held[1] + 1)
    assert bumped.aborted_txn_id.sequence == txn.sequence
    again = init(*held)
    assert (again.producer_id, again.producer_epoch) == (bumped.producer_id,
                                                         bumped.producer_epoch)
    old = owner(cluster, k)
    kill(cluster, old[0])
    wait_for_new_owner(cluster, k, old, SESSION_TIMEOUT_MS / 1000 + 15)
    after = init(*held)
    assert (after.producer_id, after.producer_epoch) == (bumped.producer_id,
                                                         bumped.producer_epoch)
    taken = init()  # a new instance takes the transactional id over
    assert taken.producer_epoch == bumped.producer_epoch + 1
    for zombie in (held, (bumped.producer_id, bumped.producer_epoch)):
        assert reason_of(lambda: init(*zombie)) == "PRODUCER_FENCED"
    cluster.up()
    wait_until(lambda: all_owned(cluster), 30, "every TC partition to be leased again")


def test_a_sessions_key_lives_on_its_tc_partition_whatever_it_hashes_to(cluster, topics):
    """NewTxn of a session goes where its transactional id hashes; its idempotency key
    need not hash there too (a retry with it finds the same transaction). A key without a
    session or parent still decides the TC partition."""
    tid = "copier-keys"
    k = tc_partition_for(tid, 16)
    key = next(f"key-{i}" for i in range(1000) if tc_partition_for(f"key-{i}", 16) != k)
    init = call(cluster, k, "InitProducerId", S.InitProducerIdRequest(transactional_id=tid))
    session = S.TransactionalSession(transactional_id=tid, producer_id=init.producer_id,
                                     producer_epoch=init.producer_epoch)
    first = call(cluster, k, "NewTxn", S.NewTxnRequest(tc_partition=k, session=session,
                                                        idempotency_key=key))
    again = call(cluster, k, "NewTxn", S.NewTxnRequest(tc_partition=k, session=session,
                                                        idempotency_key=key))
    assert not first.existing and again.existing and again.txn_id == first.txn_id
    assert reason_of(lambda: call(cluster, k, "NewTxn", S.NewTxnRequest(
        tc_partition=k, idempotency_key=key))) == "INVALID_ARGUMENT"
    call(cluster, k, "EndTxn", S.EndTxnRequest(txn_id=first.txn_id, decision=ABORT,
                                               session=session))


def test_a_streams_committed_step_outlives_its_key_and_its_owner(cluster, topics):
    """TxnStream (a Spark streaming query's micro-batches): a step committed is refused
    again by any other key — as when its own key is forgotten — also by the next owner
    after kill -9 (the StreamCommitted record is in the TC log). Its key still finds it."""
    name = "spark-stream:test-coordinator-query"
    k = tc_partition_for(name, 16)
    other = (k + 1) % 16
    step = S.TxnStream(name=name, ordinal=7)
    for where, request in (
            (other, S.NewTxnRequest(tc_partition=other, idempotency_key="s", stream=step)),
            (k, S.NewTxnRequest(tc_partition=k, stream=S.TxnStream(name="", ordinal=7))),
            (k, S.NewTxnRequest(tc_partition=k, stream=S.TxnStream(name="x" * 257))),
            (k, S.NewTxnRequest(tc_partition=k, stream=step,
                                session=S.TransactionalSession(transactional_id=name,
                                                               producer_id=1)))):
        assert reason_of(lambda: call(cluster, where, "NewTxn", request)) == "INVALID_ARGUMENT"
    first = call(cluster, k, "NewTxn", S.NewTxnRequest(
        tc_partition=k, idempotency_key=f"{name}:7", stream=step,
        topic_partitions=[tp("txa", 0)]))
    # A parent's commit elsewhere than the stream's TC partition is refused.
    stray = call(cluster, other, "NewTxn", S.NewTxnRequest(tc_partition=other))
    assert reason_of(lambda: call(cluster, other, "EndTxn", S.EndTxnRequest(
        txn_id=stray.txn_id, decision=COMMIT, stream=step))) == "INVALID_ARGUMENT"
    call(cluster, other, "EndTxn", S.EndTxnRequest(txn_id=stray.txn_id, decision=ABORT))
    call(cluster, k, "EndTxn", S.EndTxnRequest(txn_id=first.txn_id, decision=COMMIT,
                                               stream=step))
    old = owner(cluster, k)
    kill(cluster, old[0])
    try:
        wait_for_new_owner(cluster, k, old, SESSION_TIMEOUT_MS / 1000 + 15)
        again = call(cluster, k, "NewTxn", S.NewTxnRequest(
            tc_partition=k, idempotency_key=f"{name}:7", stream=step))
        assert again.existing and again.txn_id == first.txn_id
        for ordinal in (7, 3):
            with pytest.raises(grpc.RpcError) as raised:
                call(cluster, k, "NewTxn", S.NewTxnRequest(
                    tc_partition=k, idempotency_key=f"{name}:{ordinal}/replayed",
                    stream=S.TxnStream(name=name, ordinal=ordinal)))
            error = from_rpc_error(raised.value)
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert error.reason == "STREAM_ORDINAL_COMMITTED"
            assert error.metadata["committed_ordinal"] == "7"
            assert error.metadata["committed_txn_id"] == f"{k}:{first.txn_id.sequence}"
        following = call(cluster, k, "NewTxn", S.NewTxnRequest(
            tc_partition=k, idempotency_key=f"{name}:8",
            stream=S.TxnStream(name=name, ordinal=8)))
        assert not following.existing
        call(cluster, k, "EndTxn", S.EndTxnRequest(txn_id=following.txn_id, decision=ABORT))
    finally:
        cluster.up()
    wait_until(lambda: all_owned(cluster), 30, "every TC partition to be leased again")


def test_list_describe_and_operator_abort(cluster, topics):
    k = 11
    txn = call(cluster, k, "NewTxn", S.NewTxnRequest(
        tc_partition=k, timeout_ms=60_000, topic_partitions=[tp("txb", 0)])).txn_id
    name = owner(cluster, k)[0]
    listed = stub(cluster, name).ListTransactions(S.ListTransactionsRequest(
        states=[S.TXN_STATE_OPEN], tc_partitions=[k]), timeout=5)
    assert txn.sequence in [t.txn_id.sequence for t in listed.transactions]
    assert list(listed.tc_partitions) == [k]
    prepared = call(cluster, k, "PrepareTxn", S.PrepareTxnRequest(txn_id=txn))
    assert prepared.state == S.TXN_STATE_PREPARED
    assert reason_of(lambda: call(cluster, k, "AbortTransaction", S.AbortTransactionRequest(
        txn_id=txn, reason="test"))) == "TRANSACTION_PREPARED"
    aborted = call(cluster, k, "AbortTransaction", S.AbortTransactionRequest(
        txn_id=txn, reason="test", allow_prepared=True))
    assert aborted.state == S.TXN_STATE_ABORTING
    wait_until(lambda: state(cluster, txn) == S.TXN_STATE_ABORTED, 10, "the operator abort")
    assert call(cluster, k, "GetTxnStatus", S.GetTxnStatusRequest(
        txn_id=txn)).end_cause == S.TXN_END_CAUSE_OPERATOR


def test_verify_answers_state_and_inclusion(cluster, topics):
    k = 13
    txn = call(cluster, k, "NewTxn", S.NewTxnRequest(
        tc_partition=k, topic_partitions=[tp("txa", 1)])).txn_id
    epoch_before = owner(cluster, k)[1]
    answer = call(cluster, k, "VerifyTxnPartitions", S.VerifyTxnPartitionsRequest(items=[
        S.VerifyTxnPartitionsItem(txn_id=txn, topic_partition=tp("txa", 1)),
        S.VerifyTxnPartitionsItem(txn_id=txn, topic_partition=tp("txa", 2)),
        S.VerifyTxnPartitionsItem(txn_id=common_pb2.TxnId(tc_partition=k, sequence=10**12),
                                  topic_partition=tp("txa", 1))]))
    first, second, third = answer.results
    assert (first.state, first.included) == (S.TXN_STATE_OPEN, True)
    # A balancing pass may move TC partition k between the two reads of its owner; the
    # answer carries the epoch of whichever coordinator owned it when it answered.
    assert first.coordinator_epoch in (epoch_before, owner(cluster, k)[1])
    assert (second.state, second.included) == (S.TXN_STATE_OPEN, False)
    assert third.error.reason == "UNKNOWN_TRANSACTION"
    call(cluster, k, "EndTxn", S.EndTxnRequest(txn_id=txn, decision=ABORT))


# ------------------------------------------------------------------ failover

def kill(cluster, name: str) -> None:
    os.kill(cluster.process(name)["pid"], signal.SIGKILL)


def server_of(cluster, topic: str, partition: int) -> str:
    for t in metadata(cluster).topics:
        if t.name == topic:
            return t.partitions[partition].server_name
    raise AssertionError(topic)


def targets_away_from_log(cluster, k: int) -> tuple[str, list[tuple[str, int]]]:
    """The partition server holding __txn_log-k, and partitions of txa on the others."""
    log_server = server_of(cluster, "__txn_log", k)
    return log_server, [("txa", p) for p in range(3) if server_of(cluster, "txa", p) != log_server]


def wait_for_new_owner(cluster, k: int, old: tuple[str, int], timeout_s: float) -> float:
    return wait_until(lambda: owners(cluster).get(k, old)[1] > old[1], timeout_s,
                      f"TC partition {k} to move")


@pytest.mark.parametrize("confirmed_before_kill", [0, 1])
def test_kill_9_after_the_decision_finishes_it_as_decided(cluster, topics,
                                                         confirmed_before_kill):
    """Decision logged, markers to none (or one) of two partitions confirmed, COMMITTED not
    logged: kill -9 the owner; the new owner completes the COMMIT."""
    k = 1 + confirmed_before_kill * 2
    _, targets = targets_away_from_log(cluster, k)
    assert len(targets) == 2
    txn = call(cluster, k, "NewTxn", S.NewTxnRequest(
        tc_partition=k, timeout_ms=60_000,
        topic_partitions=[tp(t, p) for t, p in targets])).txn_id
    stopped = [server_of(cluster, t, p) for t, p in targets][confirmed_before_kill:]
    for name in stopped:
        os.kill(cluster.process(name)["pid"], signal.SIGSTOP)
    try:
        ended = call(cluster, k, "EndTxn", S.EndTxnRequest(txn_id=txn, decision=COMMIT))
        assert ended.state == S.TXN_STATE_COMMITTING
        if confirmed_before_kill:
            wait_until(lambda: len(call(cluster, k, "DescribeTransaction",
                                        S.DescribeTransactionRequest(txn_id=txn))
                                   .marker_pending_topic_partitions) == 1, 10,
                       "the reachable partition to confirm")
        old = owner(cluster, k)
        kill(cluster, old[0])
        wait_for_new_owner(cluster, k, old, SESSION_TIMEOUT_MS / 1000 + 15)
        assert state(cluster, txn) == S.TXN_STATE_COMMITTING  # decided, never flipped
    finally:
        for name in stopped:
            os.kill(cluster.process(name)["pid"], signal.SIGCONT)
    wait_until(lambda: state(cluster, txn) == S.TXN_STATE_COMMITTED, 20, "the commit to finish")
    cluster.up()
    wait_until(lambda: all_owned(cluster), 30, "every TC partition to be leased again")


def test_kill_9_before_the_decision_is_durable_never_flips(cluster, topics):
    """EndTxn's append is in flight (the TC log's server is stopped) when the owner dies:
    the commit is either in the log or not; a retried EndTxn(COMMIT) at the new owner
    succeeds either way and the transaction ends COMMITTED."""
    k = 4
    log_server, targets = targets_away_from_log(cluster, k)
    txn = call(cluster, k, "NewTxn", S.NewTxnRequest(
        tc_partition=k, timeout_ms=60_000,
        topic_partitions=[tp(t, p) for t, p in targets])).txn_id
    old = owner(cluster, k)
    os.kill(cluster.process(log_server)["pid"], signal.SIGSTOP)
    outcome: list[object] = []

    def end() -> None:
        try:
            outcome.append(stub(cluster, old[0]).EndTxn(
                S.EndTxnRequest(txn_id=txn, decision=COMMIT), timeout=30))
        except grpc.RpcError as error:
            outcome.append(from_rpc_error(error))

    thread = threading.Thread(target=end)
    thread.start()
    time.sleep(0.5)
    kill(cluster, old[0])
    thread.join(timeout=30)
    assert outcome and not hasattr(outcome[0], "state")  # the caller never heard "done"
    os.kill(cluster.process(log_server)["pid"], signal.SIGCONT)
    wait_for_new_owner(cluster, k, old, SESSION_TIMEOUT_MS / 1000 + 20)
    ended = call(cluster, k, "EndTxn", S.EndTxnRequest(txn_id=txn, decision=COMMIT,
                                                        wait_for_markers=True), timeout=20)
    assert ended.state == S.TXN_STATE_COMMITTED
    cluster.up()
    wait_until(lambda: all_owned(cluster), 30, "every TC partition to be leased again")


def test_paused_owner_cannot_log_or_send_markers_after_losing_its_lease(cluster, topics):
    """SIGSTOP the owner past its ZooKeeper session: the other coordinator takes the TC
    partition (new epoch, log fenced). Resumed, the old owner's buffered calls and its
    re-sent markers take no effect; the new owner's view stands."""
    k = 6
    _, targets = targets_away_from_log(cluster, k)
    victim_target = server_of(cluster, *targets[0])
    # A COMMITTING transaction whose marker the old owner keeps re-sending.
    committing = call(cluster, k, "NewTxn", S.NewTxnRequest(
        tc_partition=k, timeout_ms=60_000, topic_partitions=[tp(*targets[0])])).txn_id
    os.kill(cluster.process(victim_target)["pid"], signal.SIGSTOP)
    try:
        assert call(cluster, k, "EndTxn", S.EndTxnRequest(
            txn_id=committing, decision=COMMIT)).state == S.TXN_STATE_COMMITTING
        open_txn = call(cluster, k, "NewTxn", S.NewTxnRequest(
            tc_partition=k, timeout_ms=60_000)).txn_id
        old = owner(cluster, k)
        os.kill(cluster.process(old[0])["pid"], signal.SIGSTOP)
        outcome: list[object] = []

        def late_abort() -> None:  # reaches the paused owner, handled when it resumes
            try:
                outcome.append(stub(cluster, old[0]).EndTxn(
                    S.EndTxnRequest(txn_id=open_txn, decision=ABORT), timeout=60))
            except grpc.RpcError as error:
                outcome.append(from_rpc_error(error))

        thread = threading.Thread(target=late_abort)
        thread.start()
        took = wait_for_new_owner(cluster, k, old, SESSION_TIMEOUT_MS / 1000 + 20)
        print(f"\nTC partition {k} moved {took:.1f} s after its owner was paused "
              f"(session timeout {SESSION_TIMEOUT_MS / 1000:.0f} s)")
        # The new owner holds the transaction OPEN and commits it.
        assert state(cluster, open_txn) == S.TXN_STATE_OPEN
    finally:
        os.kill(cluster.process(victim_target)["pid"], signal.SIGCONT)
    os.kill(cluster.process(old[0])["pid"], signal.SIGCONT)
    thread.join(timeout=60)
    assert outcome and isinstance(outcome[0], Exception), outcome
    assert outcome[0].reason in ("NOT_COORDINATOR", "COORDINATOR_LOADING"), outcome[0]
    ended = call(cluster, k, "EndTxn", S.EndTxnRequest(txn_id=open_txn, decision=COMMIT,
                                                        wait_for_markers=True))
    assert ended.state == S.TXN_STATE_COMMITTED and not ended.already_ended
    wait_until(lambda: state(cluster, committing) == S.TXN_STATE_COMMITTED, 20,
               "the new owner to finish the old owner's decision")
    wait_until(lambda: all_owned(cluster), 30, "every TC partition to be leased again")


def loaded_event(cluster, name: str, k: int, epoch: int) -> dict | None:
    with open(cluster.process(name)["log_file"]) as handle:
        for line in handle:
            if '"TC partition loaded"' in line:
                entry = json.loads(line)
                if entry.get("tc_partition") == k and entry.get("epoch") == epoch:
                    return entry
    return None


def txn_log_start(cluster, k: int) -> int:
    server = server_of(cluster, "__txn_log", k)
    with grpc.insecure_channel(cluster.process(server)["grpc_address"]) as channel:
        answer = partition_pb2_grpc.PartitionServiceStub(channel).ListOffsets(
            partition_pb2.ListOffsetsRequest(items=[partition_pb2.ListOffsetsItem(
                topic_partition=tp("__txn_log", k), spec=partition_pb2.OFFSET_SPEC_EARLIEST)]),
            timeout=10)
    return answer.results[0].offset


def test_snapshots_bound_the_log_and_the_next_owner_loads_from_one(cluster, topics):
    """Snapshots go into the TC log every TC_SNAPSHOT_EVERY_RECORDS records and the
    segments below them are deleted; a new owner restores the newest snapshot plus the
    tail, and every transaction is still there, as decided."""
    k = 12
    keys = iter(key for key in (f"snap-{j}" for j in range(10**6))
                if tc_partition_for(key, 16) == k)
    keyed = {i: next(keys) for i in range(0, 400, 50)}

    def one(i: int):
        txn = call(cluster, k, "NewTxn", S.NewTxnRequest(
            tc_partition=k, idempotency_key=keyed.get(i, ""))).txn_id
        decision = ABORT if i % 7 == 0 else COMMIT
        call(cluster, k, "EndTxn", S.EndTxnRequest(txn_id=txn, decision=decision))
        return txn, decision

    with ThreadPoolExecutor(8) as pool:  # eight callers: the same records, sooner
        ended = list(pool.map(one, range(400)))
    committed = [txn for txn, decision in ended if decision == COMMIT]
    aborted = [txn for txn, decision in ended if decision == ABORT]
    # Every transaction finished (its Completed record durable; the last one lingers up
    # to completion_linger_ms for company) before the kill: the load counts them.
    left = [txn for txn, _ in ended]

    def all_finished() -> bool:
        left[:] = [txn for txn in left if state(cluster, txn) not in
                   (S.TXN_STATE_COMMITTED, S.TXN_STATE_ABORTED)]
        return not left
    wait_until(all_finished, 20, "every transaction to finish")
    wait_until(lambda: txn_log_start(cluster, k) > 0, 20, "the TC log to be trimmed")
    old = owner(cluster, k)
    kill(cluster, old[0])
    wait_for_new_owner(cluster, k, old, SESSION_TIMEOUT_MS / 1000 + 15)
    new = owner(cluster, k)
    loaded = None

    def found() -> bool:
        nonlocal loaded
        loaded = loaded_event(cluster, new[0], k, new[1])
        return loaded is not None
    wait_until(found, 10, "the new owner's load")
    assert loaded["snapshot"] is True
    assert loaded["replayed"] < TC_SNAPSHOT_EVERY_RECORDS * 2, loaded
    assert loaded["finished"] >= 400
    for txn in committed[:5] + committed[-5:]:
        assert state(cluster, txn) == S.TXN_STATE_COMMITTED
    for txn in aborted[:3] + aborted[-3:]:
        assert state(cluster, txn) == S.TXN_STATE_ABORTED
    # An idempotency key still maps to its transaction (it survived the snapshot).
    again = call(cluster, k, "NewTxn", S.NewTxnRequest(tc_partition=k,
                                                       idempotency_key=keyed[50]))
    assert again.existing and again.state == S.TXN_STATE_COMMITTED
    cluster.up()
    wait_until(lambda: all_owned(cluster), 30, "every TC partition to be leased again")
