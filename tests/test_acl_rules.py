"""The pure core of authorization (services/acl.py), without servers: rule evaluation
(deny wins, default deny, prefix and `*`, describe implied), the per-RPC table (every RPC
of every service, unknown methods refused), service-only RPCs, super users, internal
topics, transaction openers, and the ACL znode's encoding."""

from __future__ import annotations

import pytest

from atomlog.v1 import (common_pb2, coordinator_pb2, id_allocator_pb2, metadata_pb2,
                        partition_pb2)
from services.acl import (TABLE, Acl, AclError, AclSet, Caller, Permission, TxnOwners, decide,
                          requirement)

ALICE, BOB, SERVICE = Caller("alice"), Caller("bob"), Caller("ps-0", service=True)
NOBODY_SUPER = frozenset()


def tp(topic: str, partition: int = 0):
    return common_pb2.TopicPartition(topic=topic, partition=partition)


def sp(topic: str, subscription: str):
    return common_pb2.SubscriptionPartition(topic=topic, partition=0, subscription=subscription)


def produce(*topics: str):
    return partition_pb2.ProduceRequest(items=[partition_pb2.ProduceItem(topic_partition=tp(t))
                                               for t in topics])


def verdict(method, request, caller=ALICE, acls=(), super_users=NOBODY_SUPER, owners=None):
    return decide(f"/atomlog.v1.{method}", request, caller, AclSet(acls), super_users,
                  owners or TxnOwners())


def test_every_rpc_of_every_service_is_in_the_table():
    methods = {f"/{service.full_name}/{method.name}"
               for module in (coordinator_pb2, partition_pb2, metadata_pb2, id_allocator_pb2)
               for service in module.DESCRIPTOR.services_by_name.values()
               for method in service.methods}
    assert methods - set(TABLE) == set()


def test_an_unknown_method_is_refused_even_for_super_users():
    denial = decide("/atomlog.v1.PartitionService/Teleport", partition_pb2.ProduceRequest(),
                    ALICE, AclSet(), frozenset({"alice"}), TxnOwners())
    assert denial is not None and "not in the authorization table" in denial.why
    assert requirement("/atomlog.v1.PartitionService/Teleport", None) is None


def test_default_deny_then_allow_by_name_prefix_and_everyone():
    denial = verdict("PartitionService/Produce", produce("orders"))
    assert denial.metadata() == {"operation": "write", "resource_type": "topic",
                                 "resource_name": "orders"}
    for acl in (Acl("alice", "topic", "orders", "write"),
                Acl("alice", "topic", "ord", "write", pattern="prefix"),
                Acl("*", "topic", "orders", "write"),
                Acl("alice", "topic", "*", "write")):
        assert verdict("PartitionService/Produce", produce("orders"), acls=[acl]) is None, acl
    # A prefix does not match a shorter or different name; a literal is not a prefix.
    assert verdict("PartitionService/Produce", produce("ord"),
                   acls=[Acl("alice", "topic", "orders", "write", pattern="prefix")])
    assert verdict("PartitionService/Produce", produce("orders-eu"),
                   acls=[Acl("alice", "topic", "orders", "write")])
    # Another principal's allow, or another operation, allows nothing.
    assert verdict("PartitionService/Produce", produce("orders"),
                   acls=[Acl("bob", "topic", "orders", "write"),
                         Acl("alice", "topic", "orders", "read")])


def test_deny_beats_allow_whatever_the_order_and_the_match():
    allow = Acl("*", "topic", "*", "write")
    for deny in (Acl("alice", "topic", "orders", "write", "deny"),
                 Acl("*", "topic", "or", "write", "deny", pattern="prefix")):
        for acls in ([allow, deny], [deny, allow]):
            denial = verdict("PartitionService/Produce", produce("orders"), acls=acls)
            assert denial is not None and denial.why == "an ACL denies it"
    # Bob is not denied by alice's deny.
    assert verdict("PartitionService/Produce", produce("orders"), caller=BOB,
                   acls=[allow, Acl("alice", "topic", "orders", "write", "deny")]) is None


def test_every_item_needs_its_permission():
    acls = [Acl("alice", "topic", "orders", "write")]
    denial = verdict("PartitionService/Produce", produce("orders", "payments"), acls=acls)
    assert denial.permission == Permission("write", "topic", "payments")


def test_altering_a_topics_settings_needs_alter_on_that_topic():
    request = metadata_pb2.AlterTopicConfigRequest(topic="orders", set={"retention.ms": "60000"})
    denial = verdict("MetadataService/AlterTopicConfig", request,
                     acls=[Acl("alice", "topic", "orders", "write"),
                           Acl("alice", "topic", "payments", "alter")])
    assert denial.permission == Permission("alter", "topic", "orders")
    assert verdict("MetadataService/AlterTopicConfig", request,
                   acls=[Acl("alice", "topic", "orders", "alter")]) is None


def test_describe_is_implied_by_other_operations_but_not_the_reverse():
    request = partition_pb2.ListOffsetsRequest(items=[partition_pb2.ListOffsetsItem(
        topic_partition=tp("orders"))])
    assert verdict("PartitionService/ListOffsets", request,
                   acls=[Acl("alice", "topic", "orders", "read")]) is None
    assert verdict("PartitionService/Fetch", partition_pb2.FetchRequest(
        items=[partition_pb2.FetchItem(topic_partition=tp("orders"))]),
        acls=[Acl("alice", "topic", "orders", "describe")])


def test_super_users_bypass_acls_but_not_the_internal_rpcs():
    supers = frozenset({"alice"})
    assert verdict("PartitionService/Produce", produce("orders"), super_users=supers,
                   acls=[Acl("alice", "topic", "orders", "write", "deny")]) is None
    markers = partition_pb2.EndTxnOnPartitionRequest()
    denial = verdict("PartitionService/EndTxnOnPartition", markers, super_users=supers,
                     acls=[Acl("alice", "cluster", "*", "write")])
    assert denial.permission == Permission("write", "cluster", "atomlog")
    assert "only atomlog servers" in denial.why
    assert verdict("PartitionService/EndTxnOnPartition", markers, caller=SERVICE) is None
    # A deny entry can take even a server's cluster permission away.
    assert verdict("PartitionService/EndTxnOnPartition", markers, caller=SERVICE,
                   acls=[Acl("ps-0", "cluster", "atomlog", "write", "deny")])


def test_service_principals_hold_the_cluster_only():
    assert verdict("PartitionService/Produce", produce("orders"), caller=SERVICE)
    # The TC log is an internal topic: the cluster's.
    assert verdict("PartitionService/Produce", produce("__txn_log"), caller=SERVICE) is None
    denial = verdict("PartitionService/Produce", produce("__txn_log"))
    assert denial.permission == Permission("write", "cluster", "atomlog")
    for method, request in (("CoordinatorService/VerifyTxnPartitions",
                             coordinator_pb2.VerifyTxnPartitionsRequest()),
                            ("PartitionService/StageTxn", partition_pb2.StageTxnRequest()),
                            ("PartitionService/ResolveStaged",
                             partition_pb2.ResolveStagedRequest()),
                            ("IdAllocatorService/AllocateProducerIds",
                             id_allocator_pb2.AllocateProducerIdsRequest())):
        assert verdict(method, request, acls=[Acl("*", "cluster", "*", "write")]), method
        assert verdict(method, request, caller=SERVICE) is None, method


def test_transactions_need_write_on_every_topic_and_their_transactional_id():
    session = coordinator_pb2.TransactionalSession(transactional_id="etl-1", producer_id=7)
    commit = coordinator_pb2.CommitTxnRequest(
        idempotency_key="k", session=session,
        batches=[partition_pb2.ProduceItem(topic_partition=tp("orders"))],
        acks=[partition_pb2.AckItem(subscription_partition=sp("in", "etl"))])
    acls = [Acl("alice", "topic", "orders", "write"), Acl("alice", "subscription", "etl", "read")]
    denial = verdict("CoordinatorService/CommitTxn", commit, acls=acls)
    assert denial.permission == Permission("write", "transactional_id", "etl-1")
    acls.append(Acl("alice", "transactional_id", "etl-", "write", pattern="prefix"))
    assert verdict("CoordinatorService/CommitTxn", commit, acls=acls) is None
    assert verdict("CoordinatorService/InitProducerId", coordinator_pb2.InitProducerIdRequest(
        transactional_id="etl-1"), acls=acls) is None
    assert verdict("CoordinatorService/InitProducerId", coordinator_pb2.InitProducerIdRequest(
        transactional_id="other"), acls=acls).permission.name == "other"
    add = coordinator_pb2.AddPartitionToTxnRequest(
        txn_id=common_pb2.TxnId(tc_partition=1, sequence=2), topic_partitions=[tp("payments")])
    assert verdict("CoordinatorService/AddPartitionToTxn", add, acls=acls).permission == \
        Permission("write", "topic", "payments")


def test_a_stream_step_needs_write_on_the_stream_as_a_transactional_id():
    """A stream's committed high-water holds back its later steps: whoever could move it
    could make another's query skip its micro-batches as done."""
    stream = coordinator_pb2.TxnStream(name="spark-stream:q1", ordinal=4)
    opened = coordinator_pb2.NewTxnRequest(tc_partition=3, idempotency_key="k",
                                           stream=stream, topic_partitions=[tp("orders")])
    acls = [Acl("alice", "topic", "orders", "write")]
    assert verdict("CoordinatorService/NewTxn", opened, acls=acls).permission == \
        Permission("write", "transactional_id", "spark-stream:q1")
    end = coordinator_pb2.EndTxnRequest(txn_id=common_pb2.TxnId(tc_partition=3, sequence=9),
                                        decision=partition_pb2.TXN_DECISION_COMMIT,
                                        stream=stream)
    assert verdict("CoordinatorService/EndTxn", end, acls=acls).permission == \
        Permission("write", "transactional_id", "spark-stream:q1")
    acls.append(Acl("alice", "transactional_id", "spark-stream:", "write", pattern="prefix"))
    assert verdict("CoordinatorService/NewTxn", opened, acls=acls) is None
    assert verdict("CoordinatorService/EndTxn", end, acls=acls) is None
    # PrepareTxn has no stream; an EndTxn without one needs nothing more.
    end.ClearField("stream")
    assert verdict("CoordinatorService/EndTxn", end, acls=acls[:1]) is None


def test_another_principals_transaction_needs_transaction_admin():
    owners = TxnOwners()
    txn = common_pb2.TxnId(tc_partition=3, sequence=9)
    owners.record((3, 9), "alice")
    abort = coordinator_pb2.AbortTransactionRequest(txn_id=txn)
    end = coordinator_pb2.EndTxnRequest(txn_id=txn, decision=partition_pb2.TXN_DECISION_ABORT)
    assert verdict("CoordinatorService/AbortTransaction", abort, owners=owners) is None
    assert verdict("CoordinatorService/EndTxn", end, owners=owners) is None
    denial = verdict("CoordinatorService/AbortTransaction", abort, caller=BOB, owners=owners)
    assert denial.permission == Permission("abort", "transaction_admin", "atomlog")
    assert verdict("CoordinatorService/EndTxn", end, caller=BOB, owners=owners).permission == \
        Permission("alter", "transaction_admin", "atomlog")
    admin = [Acl("bob", "transaction_admin", "*", "abort")]
    assert verdict("CoordinatorService/AbortTransaction", abort, caller=BOB, owners=owners,
                   acls=admin) is None
    # An opener not known here: aborting needs the admin permission, continuing does not.
    unknown = coordinator_pb2.AbortTransactionRequest(
        txn_id=common_pb2.TxnId(tc_partition=3, sequence=10))
    assert verdict("CoordinatorService/AbortTransaction", unknown, owners=owners)
    assert verdict("CoordinatorService/EndTxn", coordinator_pb2.EndTxnRequest(
        txn_id=unknown.txn_id), owners=owners) is None
    # The first opener stays; the table is bounded.
    owners.record((3, 9), "bob")
    assert owners.owner((3, 9)) == "alice"
    small = TxnOwners(limit=2)
    for sequence in range(3):
        small.record((0, sequence), "alice")
    assert len(small) == 2 and small.owner((0, 0)) is None


def test_a_completed_transactions_opener_is_forgotten_so_open_ones_are_never_pushed_out():
    """Anyone could flood the opener table with transactions of their own (100,000, each
    ended at once): another principal's open transaction fell out of it, its opener
    became unknown, and then anyone could commit or abort it. Openers are now forgotten
    when their transaction completes, and the bound is above every transaction a process
    can hold open (transaction.max_open times 16 TC partitions)."""
    from services import acl

    class Authorizer:  # (what transaction_completed reaches: an authorizer's table)
        def __init__(self):
            self.owners = TxnOwners()

    authorizer = Authorizer()
    acl._AUTHORIZERS.add(authorizer)
    try:
        authorizer.owners.record((3, 9), "alice")
        for sequence in range(10, 1_010):  # mallory's, each ended at once
            authorizer.owners.record((3, sequence), "mallory")
            acl.transaction_completed(3, sequence)
        assert authorizer.owners.owner((3, 9)) == "alice" and len(authorizer.owners) == 1
        end = coordinator_pb2.EndTxnRequest(txn_id=common_pb2.TxnId(tc_partition=3, sequence=9),
                                            decision=partition_pb2.TXN_DECISION_COMMIT)
        assert verdict("CoordinatorService/EndTxn", end, caller=BOB,
                       owners=authorizer.owners) is not None
    finally:
        acl._AUTHORIZERS.discard(authorizer)
    assert acl.MAX_REMEMBERED_OWNERS >= 16 * 10_000


def test_a_subscription_is_made_moved_and_described_only_with_its_topic_s_permission():
    """Subscription calls were checked on the subscription alone: `create` on one made
    a subscription on any topic, the TC log among them, and its answers (and Reset's,
    Describe's) told offsets and backlogs of topics the caller could not describe."""
    create = partition_pb2.CreateSubscriptionRequest(subscription_partitions=[sp("in", "etl")])
    on_log = partition_pb2.CreateSubscriptionRequest(
        subscription_partitions=[sp("__txn_log", "etl")])
    reset = partition_pb2.ResetSubscriptionRequest(subscription_partitions=[sp("in", "etl")])
    describe = partition_pb2.DescribeSubscriptionRequest(
        subscription_partitions=[sp("in", "etl")])
    mine = [Acl("alice", "subscription", "etl", "create"),
            Acl("alice", "subscription", "etl", "read")]
    assert verdict("PartitionService/CreateSubscription", create, acls=mine).permission == \
        Permission("read", "topic", "in")
    assert verdict("PartitionService/CreateSubscription", on_log, acls=mine).permission == \
        Permission("read", "cluster", "atomlog")
    assert verdict("PartitionService/ResetSubscription", reset, acls=mine).permission == \
        Permission("read", "topic", "in")
    assert verdict("PartitionService/DescribeSubscription", describe, acls=mine).permission \
        == Permission("describe", "topic", "in")
    reader = [*mine, Acl("alice", "topic", "in", "read")]
    for method, request in (("CreateSubscription", create), ("ResetSubscription", reset),
                            ("DescribeSubscription", describe)):
        assert verdict(f"PartitionService/{method}", request, acls=reader) is None, method


def test_subscriptions_need_read_to_receive_ack_nack_and_reset():
    acls = [Acl("alice", "topic", "in", "read")]
    receive = partition_pb2.ReceiveRequest(subscription_partitions=[sp("in", "etl")])
    ack = partition_pb2.AckRequest(items=[partition_pb2.AckItem(subscription_partition=sp("in", "etl"))])
    nack = partition_pb2.NackRequest(items=[partition_pb2.NackItem(subscription_partition=sp("in", "etl"))])
    reset = partition_pb2.ResetSubscriptionRequest(subscription_partitions=[sp("in", "etl")])
    for method, request in (("Receive", receive), ("Ack", ack), ("Nack", nack),
                            ("ResetSubscription", reset)):
        denial = verdict(f"PartitionService/{method}", request, acls=acls)
        assert denial.permission == Permission("read", "subscription", "etl"), method
        assert verdict(f"PartitionService/{method}", request,
                       acls=[*acls, Acl("alice", "subscription", "etl", "read")]) is None
    # Receiving also reads the topic.
    assert verdict("PartitionService/Receive", receive,
                   acls=[Acl("alice", "subscription", "etl", "read")]).permission == \
        Permission("read", "topic", "in")


def test_entries_validate_and_the_znode_round_trips():
    for bad in (dict(resource_type="queue"), dict(operation="delete"), dict(permission="maybe"),
                dict(pattern="regex"), dict(principal=""), dict(name="a b"),
                dict(name="*", pattern="prefix")):
        fields = {"principal": "alice", "resource_type": "topic", "name": "orders",
                  "operation": "write", **bad}
        with pytest.raises(AclError):
            Acl(**fields)
    acls = AclSet([Acl("alice", "topic", "orders", "write"),
                   Acl("*", "subscription", "etl-", "read", "deny", "prefix")])
    assert AclSet.decode(acls.encode()).acls == acls.acls
    assert len(AclSet.decode(None)) == 0
    assert len(acls.added([Acl("alice", "topic", "orders", "write")])) == 2  # no duplicates
    assert acls.removed([Acl("alice", "topic", "orders", "write")]).acls == acls.acls[1:]
    for junk in (b"not json", b'{"version": 9, "acls": []}', b'{"version": 1, "acls": [{}]}'):
        with pytest.raises(AclError):
            AclSet.decode(junk)


def test_docs_security_lists_every_rpc_of_the_table():
    from tests.conftest import REPO_ROOT

    text = (REPO_ROOT / "docs" / "security.md").read_text()
    rows = {line.split("`")[1] for line in text.splitlines()
            if line.startswith("| `") and "Service/" in line}
    assert rows == {method.removeprefix("/atomlog.v1.") for method in TABLE}


def test_commit_txns_needs_what_each_of_its_commits_needs():
    def commit(topic):
        return coordinator_pb2.CommitTxnRequest(
            idempotency_key="k", batches=[partition_pb2.ProduceItem(topic_partition=tp(topic))])

    both = coordinator_pb2.CommitTxnsRequest(commits=[commit("orders"), commit("refunds")])
    acls = [Acl("alice", "topic", "orders", "write")]
    denial = verdict("CoordinatorService/CommitTxns", both, acls=acls)
    assert denial.permission == Permission("write", "topic", "refunds")
    acls.append(Acl("alice", "topic", "refunds", "write"))
    assert verdict("CoordinatorService/CommitTxns", both, acls=acls) is None


def test_another_principals_idempotency_key_needs_transaction_admin():
    """A NewTxn, CommitTxn or CommitTxns naming the key of a transaction another
    principal opened needs alter on transaction_admin; the key is forgotten with its
    transaction (completed, or pushed out of the bounded table)."""
    owners = TxnOwners(limit=2)
    owners.record((3, 9), "alice", (3, "k1"))
    new = coordinator_pb2.NewTxnRequest(tc_partition=3, idempotency_key="k1")
    commit = coordinator_pb2.CommitTxnRequest(tc_partition=3, idempotency_key="k1", abort=True)
    many = coordinator_pb2.CommitTxnsRequest(commits=[
        coordinator_pb2.CommitTxnRequest(tc_partition=5, idempotency_key="other"), commit])
    for method, request in (("NewTxn", new), ("CommitTxn", commit), ("CommitTxns", many)):
        assert verdict(f"CoordinatorService/{method}", request, owners=owners) is None
        denial = verdict(f"CoordinatorService/{method}", request, caller=BOB, owners=owners)
        assert denial.permission == Permission("alter", "transaction_admin", "atomlog"), method
        assert verdict(f"CoordinatorService/{method}", request, caller=BOB, owners=owners,
                       acls=[Acl("bob", "transaction_admin", "*", "alter")]) is None
    # The same key on another TC partition names another transaction.
    assert verdict("CoordinatorService/NewTxn", coordinator_pb2.NewTxnRequest(
        tc_partition=4, idempotency_key="k1"), caller=BOB, owners=owners) is None
    owners.forget((3, 9))
    assert owners.key_owner((3, "k1")) is None
    assert verdict("CoordinatorService/NewTxn", new, caller=BOB, owners=owners) is None
    for sequence in range(3):
        owners.record((0, sequence), "alice", (0, f"key-{sequence}"))
    assert owners.key_owner((0, "key-0")) is None and owners.key_owner((0, "key-2")) == "alice"


def test_an_internal_topic_s_records_are_deleted_by_servers_only():
    delete = partition_pb2.DeleteRecordsRequest(items=[
        partition_pb2.DeleteRecordsItem(topic="orders", partition=0, before_offset=5),
        partition_pb2.DeleteRecordsItem(topic="__txn_log", partition=3, before_offset=5)])
    everything = [Acl("alice", "cluster", "*", "alter"), Acl("alice", "topic", "*", "alter")]
    denial = verdict("PartitionService/DeleteRecords", delete, acls=everything,
                     super_users=frozenset({"alice"}))
    assert denial.permission == Permission("alter", "cluster", "atomlog")
    assert "only atomlog servers" in denial.why
    assert verdict("PartitionService/DeleteRecords", partition_pb2.DeleteRecordsRequest(
        items=[delete.items[1]]), caller=Caller("ps-0", service=True)) is None
    assert verdict("PartitionService/DeleteRecords", partition_pb2.DeleteRecordsRequest(
        items=[delete.items[0]]), acls=everything) is None
