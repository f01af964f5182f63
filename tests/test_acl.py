"""Authorization (issue 24, item 3) against a real cluster made by `atomlog up --tls` (mTLS,
auth.authorizer=acl, atomlog-admin a super user, ZooKeeper digest on; one partition
server, one coordinator, one id allocator as separate processes, so every internal call
crosses gRPC as a service principal; conftest.acl_secured, shared with test_acl_go and
test_acl_spark). Principals are client certificates of the cluster's
CA (CN alice, bob, carol). Each negative test asserts the status, the reason and the
missing permission, and that nothing changed; the positive ones: allow by name and by
prefix, `*`, super user, deny beats allow, changes applied live, the SDK under ACLs, the
CLI, the log and the metric."""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest

from atomlog.v1 import (common_pb2, coordinator_pb2, coordinator_pb2_grpc, id_allocator_pb2,
                        id_allocator_pb2_grpc, partition_pb2, partition_pb2_grpc)
from partition_server.record_batch import Record, encode_batch
from services.acl import Acl, AclStore
from services.errors import AtomlogError, from_rpc_error
from services.tls import ChannelTls, LocalCa, TlsConfig
from services.zk import kazoo_client
from spark_client import Client
from spark_client import errors
from spark_client.errors import AtomlogClientError
from tests.conftest import Cluster, create_online, wait_until

pytestmark = pytest.mark.timeout(120)

TOPIC, OTHER = "acl-orders", "acl-payments"


@pytest.fixture(scope="module")
def acl_cluster(acl_secured):
    """The suite's secured cluster (conftest.acl_secured) with this module's topics."""
    with Client(acl_secured.info["bootstrap"], tls=tls_of(acl_secured, "admin")) as admin:
        for topic in (TOPIC, OTHER):
            create_online(admin, topic, 1)
    return acl_secured


@pytest.fixture(scope="module")
def store(acl_cluster):
    info = acl_cluster.info
    client = kazoo_client(info["zookeeper"] + info["chroot"],
                          info["tls"]["zookeeper_digest_file"], timeout=10)
    client.start(timeout=10)
    yield AclStore(client)
    client.stop()


@pytest.fixture
def acls(store):
    """Add entries for one test; every entry is removed after it."""
    added: list[Acl] = []

    def add(*entries: Acl) -> None:
        added.extend(entries)
        store.change(lambda current: current.added(entries))

    yield add
    store.change(lambda current: current.removed(added))


def tls_of(cluster: Cluster, principal: str) -> TlsConfig:
    """The client TLS of `principal` (a certificate of the cluster's CA; admin: the
    cluster's own client certificate, atomlog-admin)."""
    tls = cluster.info["tls"]
    if principal == "admin":
        return TlsConfig(tls["ca_file"], tls["cert_file"], tls["key_file"])
    directory = Path(tls["dir"])
    cert, key = directory / f"user-{principal}.crt", directory / f"user-{principal}.key"
    if not cert.exists():
        LocalCa(directory).issue(cert, key, principal, server=False)
    return TlsConfig(tls["ca_file"], str(cert), str(key))


def rpc(cluster: Cluster, principal: str, stub_class, method: str, request,
        address: str | None = None):
    """One call as `principal`: the reply, or the AtomlogError it failed with (a
    PERMISSION_DENIED must carry the gRPC code PERMISSION_DENIED)."""
    address = address or cluster.info["bootstrap"]
    with ChannelTls(tls_of(cluster, principal)).channel(address) as channel:
        try:
            return getattr(stub_class(channel), method)(request, timeout=10)
        except grpc.RpcError as error:
            decoded = from_rpc_error(error)
            if decoded.reason == "PERMISSION_DENIED":
                assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            return decoded


def denied(reply, operation: str, resource_type: str, name: str) -> None:
    assert isinstance(reply, AtomlogError), reply
    assert reply.reason == "PERMISSION_DENIED", reply
    assert {k: reply.metadata[k] for k in ("operation", "resource_type", "resource_name")} == \
        {"operation": operation, "resource_type": resource_type, "resource_name": name}, reply


def ps(cluster: Cluster, principal: str, method: str, request):
    return rpc(cluster, principal, partition_pb2_grpc.PartitionServiceStub, method, request,
               cluster.process("ps-0")["grpc_address"])


def tc(cluster: Cluster, principal: str, method: str, request):
    return rpc(cluster, principal, coordinator_pb2_grpc.CoordinatorServiceStub, method, request,
               cluster.process("coord-0")["grpc_address"])


def tp(topic: str) -> common_pb2.TopicPartition:
    return common_pb2.TopicPartition(topic=topic, partition=0)


def produce_request(topic: str, value: bytes = b"v") -> partition_pb2.ProduceRequest:
    return partition_pb2.ProduceRequest(items=[partition_pb2.ProduceItem(
        topic_partition=tp(topic), record_batch=encode_batch([Record(value=value)]))])


def high_watermark(cluster: Cluster, topic: str) -> int:
    reply = ps(cluster, "admin", "ListOffsets", partition_pb2.ListOffsetsRequest(items=[
        partition_pb2.ListOffsetsItem(topic_partition=tp(topic),
                                      spec=partition_pb2.OFFSET_SPEC_LATEST)]))
    return reply.results[0].high_watermark


def produced(reply) -> bool:
    return (isinstance(reply, partition_pb2.ProduceResponse)
            and not reply.results[0].error.reason)


def tc_partition(cluster: Cluster, key: str) -> int:
    from coordinator.records import tc_partition_for

    return tc_partition_for(key, 16)


def test_produce_needs_write_on_the_topic_and_acl_changes_apply_live(acl_cluster, acls):
    before = high_watermark(acl_cluster, TOPIC)
    denied(ps(acl_cluster, "alice", "Produce", produce_request(TOPIC)), "write", "topic", TOPIC)
    assert high_watermark(acl_cluster, TOPIC) == before
    acls(Acl("alice", "topic", TOPIC, "write"))  # by name
    took = wait_until(lambda: produced(ps(acl_cluster, "alice", "Produce",
                                          produce_request(TOPIC))), 5, "the ACL to apply")
    assert took < 3 and high_watermark(acl_cluster, TOPIC) == before + 1
    # Only that topic; and a deny added later beats the allow, live too.
    denied(ps(acl_cluster, "alice", "Produce", produce_request(OTHER)), "write", "topic", OTHER)
    acls(Acl("alice", "topic", "acl-", "write", "deny", "prefix"))
    wait_until(lambda: isinstance(ps(acl_cluster, "alice", "Produce", produce_request(TOPIC)),
                                  AtomlogError), 5, "the deny to apply")
    before = high_watermark(acl_cluster, TOPIC)  # polls until then may have written
    denied(ps(acl_cluster, "alice", "Produce", produce_request(TOPIC)), "write", "topic", TOPIC)
    assert high_watermark(acl_cluster, TOPIC) == before


def test_allow_by_prefix_and_for_everyone(acl_cluster, acls):
    acls(Acl("bob", "topic", "acl-pay", "write", pattern="prefix"))
    wait_until(lambda: produced(ps(acl_cluster, "bob", "Produce", produce_request(OTHER))), 5,
               "bob's prefix ACL")
    denied(ps(acl_cluster, "bob", "Produce", produce_request(TOPIC)), "write", "topic", TOPIC)
    acls(Acl("*", "topic", TOPIC, "write"))
    wait_until(lambda: produced(ps(acl_cluster, "carol", "Produce", produce_request(TOPIC))), 5,
               "the * ACL")
    # The super user needs no entry at all.
    assert produced(ps(acl_cluster, "admin", "Produce", produce_request(OTHER)))


def test_a_transaction_cannot_take_in_a_topic_without_write(acl_cluster, acls):
    acls(Acl("alice", "topic", TOPIC, "write"))
    wait_until(lambda: produced(ps(acl_cluster, "alice", "Produce", produce_request(TOPIC))), 5,
               "alice's ACL")
    key = f"acl-{uuid.uuid4()}"
    request = coordinator_pb2.NewTxnRequest(tc_partition=tc_partition(acl_cluster, key),
                                            idempotency_key=key, topic_partitions=[tp(TOPIC)])
    # The coordinator learns the ACL from ZooKeeper on its own watch, maybe after the
    # partition server did: a refused NewTxn opens nothing, and the key makes the retry
    # the same transaction.
    answers = []

    def opens() -> bool:
        answers.append(tc(acl_cluster, "alice", "NewTxn", request))
        return isinstance(answers[-1], coordinator_pb2.NewTxnResponse)

    wait_until(opens, 5, "the coordinator to see alice's ACL")
    opened = answers[-1]
    denied(tc(acl_cluster, "alice", "AddPartitionToTxn", coordinator_pb2.AddPartitionToTxnRequest(
        txn_id=opened.txn_id, topic_partitions=[tp(OTHER)])), "write", "topic", OTHER)
    other_key = f"acl-{uuid.uuid4()}"
    denied(tc(acl_cluster, "alice", "NewTxn", coordinator_pb2.NewTxnRequest(
        tc_partition=tc_partition(acl_cluster, other_key), idempotency_key=other_key,
        topic_partitions=[tp(TOPIC), tp(OTHER)])), "write", "topic", OTHER)
    before = high_watermark(acl_cluster, OTHER)
    denied(tc(acl_cluster, "alice", "CommitTxn", coordinator_pb2.CommitTxnRequest(
        tc_partition=tc_partition(acl_cluster, other_key), idempotency_key=other_key,
        batches=[partition_pb2.ProduceItem(topic_partition=tp(OTHER),
                                           record_batch=encode_batch([Record(value=b"x")]))])),
        "write", "topic", OTHER)
    # Nothing changed: the transaction still holds only its own partition, nothing was
    # staged or written, and the refused NewTxn opened nothing.
    described = tc(acl_cluster, "admin", "DescribeTransaction",
                   coordinator_pb2.DescribeTransactionRequest(txn_id=opened.txn_id))
    assert [p.topic for p in described.topic_partitions] == [TOPIC]
    assert high_watermark(acl_cluster, OTHER) == before
    listed = tc(acl_cluster, "admin", "ListTransactions", coordinator_pb2.ListTransactionsRequest())
    assert not [t for t in listed.transactions if t.txn_id != opened.txn_id
                and t.state == coordinator_pb2.TXN_STATE_OPEN]
    ended = tc(acl_cluster, "alice", "EndTxn", coordinator_pb2.EndTxnRequest(
        txn_id=opened.txn_id, decision=partition_pb2.TXN_DECISION_ABORT))
    assert isinstance(ended, coordinator_pb2.EndTxnResponse), ended


def test_a_transactional_id_needs_write_to_init_fence_and_commit(acl_cluster, acls):
    txn_id = f"etl-{uuid.uuid4().hex[:8]}"
    acls(Acl("bob", "transactional_id", txn_id, "write"), Acl("bob", "topic", TOPIC, "write"),
         Acl("alice", "topic", TOPIC, "write"))
    init = coordinator_pb2.InitProducerIdRequest(transactional_id=txn_id)
    session = wait_until(lambda: isinstance(tc(acl_cluster, "bob", "InitProducerId", init),
                                            coordinator_pb2.InitProducerIdResponse), 5, "bob's ACL")
    bobs = tc(acl_cluster, "bob", "InitProducerId", init)  # epoch 1 (a re-init: also fine)
    # Alice can neither init nor fence bob's session ...
    denied(tc(acl_cluster, "alice", "InitProducerId", init), "write", "transactional_id", txn_id)
    denied(tc(acl_cluster, "alice", "InitProducerId", coordinator_pb2.InitProducerIdRequest(
        transactional_id=txn_id, producer_id=bobs.producer_id,
        producer_epoch=bobs.producer_epoch)), "write", "transactional_id", txn_id)
    # ... nor commit under it, even with its producer id and epoch.
    stolen = coordinator_pb2.TransactionalSession(transactional_id=txn_id,
                                                  producer_id=bobs.producer_id,
                                                  producer_epoch=bobs.producer_epoch)
    before = high_watermark(acl_cluster, TOPIC)
    denied(tc(acl_cluster, "alice", "CommitTxn", coordinator_pb2.CommitTxnRequest(
        tc_partition=bobs.tc_partition, idempotency_key=f"steal-{txn_id}", session=stolen,
        batches=[partition_pb2.ProduceItem(topic_partition=tp(TOPIC),
                                           record_batch=encode_batch([Record(value=b"x")]))])),
        "write", "transactional_id", txn_id)
    denied(tc(acl_cluster, "alice", "NewTxn", coordinator_pb2.NewTxnRequest(
        tc_partition=bobs.tc_partition, session=stolen)), "write", "transactional_id", txn_id)
    assert high_watermark(acl_cluster, TOPIC) == before
    # Nothing changed: bob's session is not fenced — his epoch still commits.
    committed = tc(acl_cluster, "bob", "CommitTxn", coordinator_pb2.CommitTxnRequest(
        tc_partition=bobs.tc_partition, idempotency_key=f"bob-{txn_id}", session=stolen,
        batches=[partition_pb2.ProduceItem(topic_partition=tp(TOPIC),
                                           record_batch=encode_batch([Record(value=b"b")]))]))
    assert isinstance(committed, coordinator_pb2.CommitTxnResponse), committed
    assert session < 5


def test_aborting_another_principals_transaction_needs_transaction_admin(acl_cluster, acls):
    acls(Acl("bob", "topic", TOPIC, "write"))
    key = f"acl-{uuid.uuid4()}"
    request = coordinator_pb2.NewTxnRequest(tc_partition=tc_partition(acl_cluster, key),
                                            idempotency_key=key, topic_partitions=[tp(TOPIC)])
    wait_until(lambda: isinstance(tc(acl_cluster, "bob", "NewTxn", request),
                                  coordinator_pb2.NewTxnResponse), 5, "bob's ACL")
    bobs = tc(acl_cluster, "bob", "NewTxn", request).txn_id  # the same (by key)
    abort = coordinator_pb2.AbortTransactionRequest(txn_id=bobs, reason="test")
    denied(tc(acl_cluster, "alice", "AbortTransaction", abort), "abort", "transaction_admin",
           "atomlog")
    denied(tc(acl_cluster, "alice", "EndTxn", coordinator_pb2.EndTxnRequest(
        txn_id=bobs, decision=partition_pb2.TXN_DECISION_ABORT)), "alter", "transaction_admin",
        "atomlog")
    status = tc(acl_cluster, "admin", "GetTxnStatus", coordinator_pb2.GetTxnStatusRequest(txn_id=bobs))
    assert status.state == coordinator_pb2.TXN_STATE_OPEN  # nothing changed
    # An operator with transaction_admin may.
    acls(Acl("carol", "transaction_admin", "*", "abort"))
    aborted = wait_until(lambda: isinstance(tc(acl_cluster, "carol", "AbortTransaction", abort),
                                            coordinator_pb2.AbortTransactionResponse), 5,
                         "carol's ACL")
    status = tc(acl_cluster, "admin", "GetTxnStatus", coordinator_pb2.GetTxnStatusRequest(txn_id=bobs))
    assert status.end_cause == coordinator_pb2.TXN_END_CAUSE_OPERATOR and aborted < 5


def test_own_transaction_may_be_aborted_without_transaction_admin(acl_cluster, acls):
    acls(Acl("bob", "topic", TOPIC, "write"))
    key = f"acl-{uuid.uuid4()}"
    request = coordinator_pb2.NewTxnRequest(tc_partition=tc_partition(acl_cluster, key),
                                            idempotency_key=key, topic_partitions=[tp(TOPIC)])
    wait_until(lambda: isinstance(tc(acl_cluster, "bob", "NewTxn", request),
                                  coordinator_pb2.NewTxnResponse), 5, "bob's ACL")
    txn = tc(acl_cluster, "bob", "NewTxn", request).txn_id
    reply = tc(acl_cluster, "bob", "AbortTransaction",
               coordinator_pb2.AbortTransactionRequest(txn_id=txn, reason="mine"))
    assert isinstance(reply, coordinator_pb2.AbortTransactionResponse), reply


def test_a_subscription_needs_read_to_receive_ack_and_reset(acl_cluster, acls):
    sub = common_pb2.SubscriptionPartition(topic=TOPIC, partition=0, subscription="acl-etl")
    created = ps(acl_cluster, "admin", "CreateSubscription", partition_pb2.CreateSubscriptionRequest(
        subscription_partitions=[sub],
        initial_position=partition_pb2.SUBSCRIPTION_INITIAL_POSITION_EARLIEST))
    assert not created.results[0].error.reason, created
    assert produced(ps(acl_cluster, "admin", "Produce", produce_request(TOPIC)))
    acls(Acl("alice", "topic", TOPIC, "read"))

    def cursor():
        reply = ps(acl_cluster, "admin", "DescribeSubscription",
                   partition_pb2.DescribeSubscriptionRequest(subscription_partitions=[sub]))
        found = reply.cursors[0]
        return (found.cumulative_end_offset, found.delivered_unacknowledged_count)

    before = cursor()
    receive = partition_pb2.ReceiveRequest(consumer_id="alice", subscription_partitions=[sub],
                                           max_messages=10)
    denied(ps(acl_cluster, "alice", "Receive", receive), "read", "subscription", "acl-etl")
    denied(ps(acl_cluster, "alice", "Ack", partition_pb2.AckRequest(items=[partition_pb2.AckItem(
        subscription_partition=sub, cumulative_end_offset=1)])), "read", "subscription", "acl-etl")
    denied(ps(acl_cluster, "alice", "ResetSubscription", partition_pb2.ResetSubscriptionRequest(
        subscription_partitions=[sub], position=partition_pb2.SUBSCRIPTION_INITIAL_POSITION_LATEST)),
        "read", "subscription", "acl-etl")
    key = f"acl-{uuid.uuid4()}"
    denied(tc(acl_cluster, "alice", "NewTxn", coordinator_pb2.NewTxnRequest(
        tc_partition=tc_partition(acl_cluster, key), idempotency_key=key,
        subscription_partitions=[sub])), "read", "subscription", "acl-etl")
    assert cursor() == before  # nothing delivered, acknowledged or moved
    acls(Acl("alice", "subscription", "acl-", "read", pattern="prefix"))
    got = wait_until(lambda: isinstance(ps(acl_cluster, "alice", "Receive", receive),
                                        partition_pb2.ReceiveResponse), 5, "alice's ACL")
    assert got < 5


def test_only_servers_send_markers_stage_verify_and_allocate(acl_cluster, acls):
    acls(Acl("alice", "cluster", "*", "write"))  # even with an ACL: not a service principal
    marker = partition_pb2.EndTxnOnPartitionRequest(markers=[partition_pb2.TxnMarker(
        txn_id=common_pb2.TxnId(tc_partition=0, sequence=1),
        decision=partition_pb2.TXN_DECISION_COMMIT, coordinator_epoch=1 << 40,
        topic_partitions=[tp(TOPIC)])])
    before = high_watermark(acl_cluster, TOPIC)
    for principal in ("alice", "admin"):  # the super user neither
        denied(ps(acl_cluster, principal, "EndTxnOnPartition", marker), "write", "cluster",
               "atomlog")
        denied(ps(acl_cluster, principal, "StageTxn", partition_pb2.StageTxnRequest(
            items=[partition_pb2.StageTxnItem(txn_id=common_pb2.TxnId(tc_partition=0, sequence=1),
                                              coordinator_epoch=1 << 40)])),
               "write", "cluster", "atomlog")
        denied(ps(acl_cluster, principal, "ResolveStaged", partition_pb2.ResolveStagedRequest(
            items=[partition_pb2.ResolveStagedItem(
                txn_id=common_pb2.TxnId(tc_partition=0, sequence=1), coordinator_epoch=1 << 40,
                topic_partitions=[tp(TOPIC)])])), "write", "cluster", "atomlog")
        denied(tc(acl_cluster, principal, "VerifyTxnPartitions",
                  coordinator_pb2.VerifyTxnPartitionsRequest()), "write", "cluster", "atomlog")
        # The TC log's records: its coordinators trim it below their snapshots; cut
        # below one, a TC partition could not load again.
        denied(ps(acl_cluster, principal, "DeleteRecords", partition_pb2.DeleteRecordsRequest(
            items=[partition_pb2.DeleteRecordsItem(topic=TOPIC, partition=0, before_offset=0),
                   partition_pb2.DeleteRecordsItem(topic="__txn_log", partition=0,
                                                   before_offset=1)])),
               "alter", "cluster", "atomlog")
        denied(rpc(acl_cluster, principal, id_allocator_pb2_grpc.IdAllocatorServiceStub,
                   "AllocateProducerIds", id_allocator_pb2.AllocateProducerIdsRequest(count=5),
                   acl_cluster.process("ida-0")["grpc_address"]), "write", "cluster", "atomlog")
    assert high_watermark(acl_cluster, TOPIC) == before  # no marker was written
    described = rpc(acl_cluster, "admin", id_allocator_pb2_grpc.IdAllocatorServiceStub,
                    "DescribeAllocator", id_allocator_pb2.DescribeAllocatorRequest(),
                    acl_cluster.process("ida-0")["grpc_address"])
    assert described.blocks_issued <= 2  # the coordinator's own block(s), nothing for us


def test_the_sdk_works_under_acls(acl_cluster, acls):
    acls(Acl("carol", "topic", "acl-", "write", pattern="prefix"),
         Acl("carol", "topic", "acl-", "read", pattern="prefix"))
    bootstrap = acl_cluster.info["bootstrap"]
    for one_call in (1 << 20, 0):  # one-call (CommitTxn) and streaming (NewTxn, Produce, EndTxn)
        with Client(bootstrap, tls=tls_of(acl_cluster, "carol"), one_call_max_bytes=one_call,
                    request_timeout_s=10) as client:
            with client.producer() as producer, client.transaction(timeout_s=30) as txn:
                producer.send(OTHER, f"carol-{one_call}".encode(), partition=0, txn=txn)
    with Client(bootstrap, tls=tls_of(acl_cluster, "carol"), request_timeout_s=10) as client:
        seen: list[bytes] = []
        with client.consumer(OTHER) as consumer:
            wait_until(lambda: seen.extend(m.value for m in consumer.poll(timeout_s=0.2))
                       or {b"carol-0", b"carol-1048576"} <= set(seen), 20, "carol's records")
        with pytest.raises(AtomlogClientError) as refused:
            client.create_topic("acl-new", partitions=1)
        assert isinstance(refused.value, errors.PermissionDenied)
        assert not refused.value.retriable
        assert refused.value.metadata["resource_type"] == "topic"


def test_denials_are_logged_and_counted_and_the_cli_manages_acls(acl_cluster, store):
    ps0 = acl_cluster.process("ps-0")
    line = 'atomlog_authorization_denied_total{operation="write",resource_type="topic"}'

    def count() -> float:
        text = urllib.request.urlopen(f"http://{ps0['metrics_address']}/metrics",
                                      timeout=5).read().decode()
        return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(line))

    before = count()
    denied(ps(acl_cluster, "dave", "Produce", produce_request(TOPIC)), "write", "topic", TOPIC)
    assert count() == before + 1
    log = [json.loads(l) for l in Path(ps0["log_file"]).read_text().splitlines()
           if '"permission denied"' in l]
    assert any(e["principal"] == "dave" and e["resource_name"] == TOPIC
               and e["operation"] == "write" for e in log)
    # The CLI: add, list, remove (with the local cluster's credential by default).
    args = ("-p", "dave", "-t", "topic", "-n", TOPIC, "--operation", "write")
    acl_cluster.run("acl", "add", *args)
    listed = json.loads(acl_cluster.run("acl", "list", "-p", "dave", "-o", "json").stdout)
    assert listed == [{"principal": "dave", "resource_type": "topic", "name": TOPIC,
                       "pattern": "literal", "operation": "write", "permission": "allow"}]
    wait_until(lambda: produced(ps(acl_cluster, "dave", "Produce", produce_request(TOPIC))), 5,
               "dave's ACL")
    acl_cluster.run("acl", "remove", *args)
    assert json.loads(acl_cluster.run("acl", "list", "-p", "dave", "-o", "json").stdout) == []
    again = acl_cluster.run("acl", "remove", *args, check=False)
    assert again.returncode == 1 and "no such ACL entry" in again.stderr
    wait_until(lambda: isinstance(ps(acl_cluster, "dave", "Produce", produce_request(TOPIC)),
                                  AtomlogError), 5, "the removal to apply")


def _bobs_open_transaction(cluster: Cluster, acls) -> tuple[str, coordinator_pb2.NewTxnResponse]:
    """Bob's open transaction on TOPIC, opened by an idempotency key (alice may write
    TOPIC and OTHER too, bob only TOPIC): the key and NewTxn's answer."""
    acls(Acl("bob", "topic", TOPIC, "write"), Acl("alice", "topic", TOPIC, "write"),
         Acl("alice", "topic", OTHER, "write"))
    key = f"acl-{uuid.uuid4()}"
    request = coordinator_pb2.NewTxnRequest(tc_partition=tc_partition(cluster, key),
                                            idempotency_key=key, topic_partitions=[tp(TOPIC)])
    answers = []

    def opens() -> bool:
        answers.append(tc(cluster, "bob", "NewTxn", request))
        return isinstance(answers[-1], coordinator_pb2.NewTxnResponse)

    wait_until(opens, 5, "the coordinator to see bob's ACL")
    wait_until(lambda: produced(ps(cluster, "alice", "Produce", produce_request(OTHER))), 5,
               "the partition server to see alice's ACL")
    wait_until(lambda: not isinstance(tc(cluster, "alice", "GetTxnStatus",
                                         coordinator_pb2.GetTxnStatusRequest(
                                             txn_id=answers[-1].txn_id)), AtomlogError), 5,
               "alice to reach the coordinator")
    return key, answers[-1]


def test_another_principals_idempotency_key_does_not_reach_its_transaction(acl_cluster, acls):
    """A NewTxn (or a one-call CommitTxn, or its give-up by key) with the key of a
    transaction another principal opened is refused, and changes nothing: the opener's
    partitions and timeout stay, and it stays open."""
    key, bobs = _bobs_open_transaction(acl_cluster, acls)
    k = tc_partition(acl_cluster, key)

    def described():
        return tc(acl_cluster, "admin", "DescribeTransaction",
                  coordinator_pb2.DescribeTransactionRequest(txn_id=bobs.txn_id))

    before = described()
    denied(tc(acl_cluster, "alice", "NewTxn", coordinator_pb2.NewTxnRequest(
        tc_partition=k, idempotency_key=key, topic_partitions=[tp(TOPIC), tp(OTHER)],
        timeout_ms=1_000)), "alter", "transaction_admin", "atomlog")
    denied(tc(acl_cluster, "alice", "CommitTxn", coordinator_pb2.CommitTxnRequest(
        tc_partition=k, idempotency_key=key, abort=True)), "alter", "transaction_admin",
        "atomlog")
    denied(tc(acl_cluster, "alice", "CommitTxn", coordinator_pb2.CommitTxnRequest(
        tc_partition=k, idempotency_key=key, batches=[partition_pb2.ProduceItem(
            topic_partition=tp(OTHER), record_batch=encode_batch([Record(value=b"x")]))])),
        "alter", "transaction_admin", "atomlog")
    after = described()
    assert after.summary.state == coordinator_pb2.TXN_STATE_OPEN
    assert [p.topic for p in after.topic_partitions] == [TOPIC]
    assert after.summary.timeout_ms == before.summary.timeout_ms
    # The opener's own retry is the same transaction, and carol with transaction_admin
    # may reach it too (as she may end it).
    again = tc(acl_cluster, "bob", "NewTxn", coordinator_pb2.NewTxnRequest(
        tc_partition=k, idempotency_key=key, topic_partitions=[tp(TOPIC)]))
    assert again.txn_id == bobs.txn_id and again.existing, again
    acls(Acl("carol", "transaction_admin", "*", "alter"), Acl("carol", "topic", TOPIC, "write"))
    wait_until(lambda: isinstance(tc(acl_cluster, "carol", "NewTxn", coordinator_pb2.NewTxnRequest(
        tc_partition=k, idempotency_key=key, topic_partitions=[tp(TOPIC)])),
        coordinator_pb2.NewTxnResponse), 5, "carol's ACL")


def _transactional_batch(cluster: Cluster, principal: str, txn_id, value: bytes) -> bytes:
    ids = tc(cluster, principal, "InitProducerId", coordinator_pb2.InitProducerIdRequest())
    assert isinstance(ids, coordinator_pb2.InitProducerIdResponse), ids
    return encode_batch([Record(value=value)], producer_id=ids.producer_id,
                        producer_epoch=ids.producer_epoch, base_sequence=0,
                        txn=(txn_id.tc_partition, txn_id.sequence))


def test_a_transactional_batch_goes_only_into_its_writers_own_transaction(acl_cluster, acls):
    """Alice may write TOPIC, and learns the id of bob's open transaction on it: her
    transactional batch into it is refused, whether she is the first to write it there
    or bob's batch came first (open on the partition), and the transaction holds only
    bob's. Bob's own batch goes in; with transaction_admin (alter), so may carol's."""
    _, bobs = _bobs_open_transaction(acl_cluster, acls)
    txn = bobs.txn_id

    def produce(principal: str, value: bytes):
        return ps(acl_cluster, principal, "Produce", partition_pb2.ProduceRequest(items=[
            partition_pb2.ProduceItem(topic_partition=tp(TOPIC), record_batch=_transactional_batch(
                acl_cluster, principal, txn, value))]))

    def refused(reply) -> None:
        assert isinstance(reply, partition_pb2.ProduceResponse), reply
        error = reply.results[0].error
        assert error.reason == "PERMISSION_DENIED", reply
        assert dict(error.metadata)["resource_type"] == "transaction_admin", reply

    before = high_watermark(acl_cluster, TOPIC)
    refused(produce("alice", b"alice-first"))  # the first write of the transaction here
    assert high_watermark(acl_cluster, TOPIC) == before
    assert produced(produce("bob", b"bob"))
    refused(produce("alice", b"alice-later"))  # the transaction is open on the partition
    acls(Acl("carol", "transaction_admin", "*", "alter"), Acl("carol", "topic", TOPIC, "write"))
    wait_until(lambda: produced(produce("carol", b"carol")), 5, "carol's ACL")
    ended = tc(acl_cluster, "bob", "EndTxn", coordinator_pb2.EndTxnRequest(
        txn_id=txn, decision=partition_pb2.TXN_DECISION_COMMIT))
    assert isinstance(ended, coordinator_pb2.EndTxnResponse), ended
    values: list[bytes] = []
    with Client(acl_cluster.info["bootstrap"], tls=tls_of(acl_cluster, "admin")) as admin:
        consumer = admin.consumer(TOPIC)
        wait_until(lambda: values.extend(m.value for m in consumer.poll(0.5)) or b"carol" in values,
                   10, "the committed transaction to be read")
        consumer.close()
    assert b"bob" in values and b"carol" in values
    assert b"alice-first" not in values and b"alice-later" not in values


def test_a_transactional_ack_goes_only_into_its_readers_own_transaction(acl_cluster, acls):
    """Alice may read the subscription, and learns bob's open transaction that lists it:
    her ack in bob's transaction is refused, and the cursor does not move."""
    sub = common_pb2.SubscriptionPartition(topic=TOPIC, partition=0, subscription="acl-joined")
    created = ps(acl_cluster, "admin", "CreateSubscription", partition_pb2.CreateSubscriptionRequest(
        subscription_partitions=[sub],
        initial_position=partition_pb2.SUBSCRIPTION_INITIAL_POSITION_EARLIEST))
    assert not created.results[0].error.reason, created
    assert produced(ps(acl_cluster, "admin", "Produce", produce_request(TOPIC)))
    acls(*(Acl(who, kind, name, "read") for who in ("alice", "bob")
           for kind, name in (("subscription", "acl-joined"), ("topic", TOPIC))))
    key = f"acl-{uuid.uuid4()}"
    opened = []
    wait_until(lambda: opened.append(tc(acl_cluster, "bob", "NewTxn", coordinator_pb2.NewTxnRequest(
        tc_partition=tc_partition(acl_cluster, key), idempotency_key=key,
        subscription_partitions=[sub]))) or isinstance(opened[-1], coordinator_pb2.NewTxnResponse),
        5, "bob's ACL")

    def ack(principal: str):
        return ps(acl_cluster, principal, "Ack", partition_pb2.AckRequest(items=[
            partition_pb2.AckItem(subscription_partition=sub, cumulative_end_offset=1,
                                  txn_id=opened[-1].txn_id)]))

    def cursor():
        reply = ps(acl_cluster, "admin", "DescribeSubscription",
                   partition_pb2.DescribeSubscriptionRequest(subscription_partitions=[sub]))
        return reply.cursors[0].cumulative_end_offset

    before = cursor()
    replies = []
    wait_until(lambda: replies.append(ack("alice")) or not isinstance(replies[-1], AtomlogError),
               5, "alice's ACL on the partition server")
    error = replies[-1].results[0].error
    assert error.reason == "PERMISSION_DENIED", replies[-1]
    assert dict(error.metadata)["resource_type"] == "transaction_admin"
    assert cursor() == before
    assert not ack("bob").results[0].error.reason


def test_describe_partition_shows_only_what_the_caller_may_see(acl_cluster, acls):
    """`describe` on the topic shows the partition; its open transactions, aborted ones
    and producers need `describe` on transaction_admin, and each subscription's cursor
    `describe` on that subscription. What is left out is named in `withheld`."""
    for name in ("acl-seen", "acl-hidden"):
        created = ps(acl_cluster, "admin", "CreateSubscription",
                     partition_pb2.CreateSubscriptionRequest(
                         subscription_partitions=[common_pb2.SubscriptionPartition(
                             topic=TOPIC, partition=0, subscription=name)]))
        assert not created.results[0].error.reason or \
            created.results[0].error.reason == "SUBSCRIPTION_EXISTS", created
    _, bobs = _bobs_open_transaction(acl_cluster, acls)
    with Client(acl_cluster.info["bootstrap"], tls=tls_of(acl_cluster, "admin")) as admin:
        with admin.producer() as producer:
            producer.send(TOPIC, b"idempotent", partition=0).result(timeout=10)
    batch = _transactional_batch(acl_cluster, "bob", bobs.txn_id, b"open")
    assert produced(ps(acl_cluster, "bob", "Produce", partition_pb2.ProduceRequest(items=[
        partition_pb2.ProduceItem(topic_partition=tp(TOPIC), record_batch=batch)])))
    request = partition_pb2.DescribePartitionRequest(topic_partition=tp(TOPIC))
    full = ps(acl_cluster, "admin", "DescribePartition", request)
    assert full.open_transactions and full.producers and not full.withheld
    assert {"acl-seen", "acl-hidden"} <= {c.subscription_partition.subscription
                                          for c in full.subscriptions}
    acls(Acl("dave", "topic", TOPIC, "describe"), Acl("dave", "subscription", "acl-seen", "describe"))
    seen = []
    wait_until(lambda: seen.append(ps(acl_cluster, "dave", "DescribePartition", request)) or
               isinstance(seen[-1], partition_pb2.DescribePartitionResponse), 5, "dave's ACL")
    shown = seen[-1]
    assert shown.high_watermark == full.high_watermark and shown.producer_count
    assert not shown.open_transactions and not shown.producers
    assert [c.subscription_partition.subscription for c in shown.subscriptions] == ["acl-seen"]
    assert any(w.startswith("open_transactions") for w in shown.withheld), shown.withheld
    assert any(w.startswith("subscriptions") for w in shown.withheld), shown.withheld
    acls(Acl("dave", "transaction_admin", "*", "describe"))
    wait_until(lambda: ps(acl_cluster, "dave", "DescribePartition", request).open_transactions,
               5, "dave's transaction_admin ACL")
    ended = tc(acl_cluster, "bob", "EndTxn", coordinator_pb2.EndTxnRequest(
        txn_id=bobs.txn_id, decision=partition_pb2.TXN_DECISION_ABORT))
    assert isinstance(ended, coordinator_pb2.EndTxnResponse), ended
