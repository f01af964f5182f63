"""ResolveStaged, the partition-server side of parallel commits' recovery
(docs/coordinator.md): a coordinator that took over a TC partition asks whether a
transaction's staged batch is durable on each of its partitions (and its staged ack on
each subscription partition it acked), and fences the old owner so that a StageTxn of it
still in flight never lands afterwards.

Owner-level tests on a real PartitionOwner over a temp dir (the fence is atomic with the
stage's append, a cursor answers for its staged acks, and the answer waits for the
durability of what came before it), then
real processes: a cluster of its own (its tests fence TC partitions at made-up coordinator
epochs, which would refuse the markers of a shared cluster's coordinators), with the
presumed-abort check pushed out of the way so staged transactions stay open."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal

import grpc
import pytest

from atomlog.v1 import common_pb2, partition_pb2
from partition_server.coordinator_epochs import CoordinatorEpochs
from partition_server.log import LogConfig
from partition_server.owner import OwnerSettings, PartitionOwner, State
from partition_server.record_batch import Record, TxnId, encode_batch, parse_header, \
    stamp_transaction
from partition_server.service import PartitionServicer
from services.errors import AtomlogError, from_rpc_error
from spark_client import Client
from tests.conftest import CLUSTER_SETTINGS, Cluster, create_online, metric_sum, wait_until
from tests.test_partition_owner import GatedFsync, batch, fail_loading, start, until


def staged_batch(txn: TxnId, value: bytes = b"staged") -> tuple[bytes, object]:
    """A batch as StageTxn hands it to the owner: stamped with its transaction."""
    raw = encode_batch([Record(None, value, (), 0)])
    return stamp_transaction(raw, parse_header(raw), txn)


def stage(owner: PartitionOwner, txn: TxnId, epoch: int) -> asyncio.Future:
    data, header = staged_batch(txn)
    return asyncio.ensure_future(owner.stage(txn, data, header, coordinator_epoch=epoch))


# ---------------------------------------------------------------------- the owner
def test_a_stage_overtaken_by_a_newer_epoch_in_the_queue_is_refused_in_the_owner_step(
        tmp_path):
    """The stage passed the servicer's fence (its epoch was current) and waits in the
    owner's queue; a ResolveStaged of a newer coordinator raises the epoch and asks. The
    owner's write step refuses the stage (nothing written) and the answer is False: it
    can never land afterwards."""
    gate = GatedFsync()
    # Queued work waits while the only fsync runs (write-ahead never reached).
    settings = OwnerSettings(log=LogConfig(), max_fsyncs_in_flight=1, write_ahead_bytes=1 << 30)
    epochs = CoordinatorEpochs(None, 16)
    epochs.observe(3, 5)
    late, later = TxnId(3, 11), TxnId(3, 12)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings, fsync=gate,
                               coordinator_epoch=epochs.current)
        await owner.start()
        first = start(owner, batch(7, 0))  # a plain write whose fsync is held
        await until(lambda: gate.calls == 1)
        staged = stage(owner, late, 5)  # epoch 5 is current: the servicer let it through
        await asyncio.sleep(0.05)
        assert owner.log.log_end_offset == 2 and not staged.done()  # queued, not written
        epochs.observe(3, 6)  # ResolveStaged's fence, then its question
        resolved = asyncio.ensure_future(owner.resolve_staged(late))
        await asyncio.sleep(0.02)
        assert not resolved.done()
        gate.release_all()
        assert [r.base_offset for r in await first] == [0]
        with pytest.raises(AtomlogError) as refused:
            await staged
        assert refused.value.reason == "STALE_COORDINATOR_EPOCH"
        assert refused.value.metadata["current_coordinator_epoch"] == "6"
        assert await resolved is False
        assert owner.log.log_end_offset == 2 and owner.txns.open_transaction(late) is None
        # The new owner's stages of the same TC partition go ahead.
        appended = await stage(owner, later, 6)
        assert (appended.base_offset, appended.duplicate) == (2, False)
        assert await owner.resolve_staged(later) is True
        await owner.close()

    asyncio.run(scenario())


def test_a_staged_ack_whose_epoch_a_fence_raised_meanwhile_is_refused_where_it_is_staged(
        tmp_path):
    """The ack passed the servicer's fence (its epoch was current) and its task waits to
    run; a newer coordinator's fence comes first. The cursor store's step refuses it
    (STALE_COORDINATOR_EPOCH) and stages nothing, as the owner's write step does for a
    batch; the newer coordinator's own ack is taken."""
    settings = OwnerSettings(log=LogConfig())
    epochs = CoordinatorEpochs(None, 16)
    epochs.observe(3, 5)
    old, new = TxnId(3, 11), TxnId(3, 12)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings,
                               coordinator_epoch=epochs.current)
        await owner.start()
        await start(owner, batch(7, 0))  # two records to ack
        assert await owner.subscriptions.create("s", 0) == (True, 0)
        limit = owner.max_read_position()

        class Routed:  # the servicer's routing, to this owner (the step is the real one)
            async def _subscription_owner(self, sp):
                assert (sp.topic, sp.partition, sp.subscription) == ("t", 0, "s")
                return owner

        async def staged_ack(txn: TxnId, epoch: int):
            """PartitionServicer's step for one staged ack of StageTxn."""
            entry = partition_pb2.AckResult()
            await PartitionServicer._stage_ack(Routed(), txn, epoch, partition_pb2.AckItem(
                subscription_partition=common_pb2.SubscriptionPartition(
                    topic="t", partition=0, subscription="s"),
                cumulative_end_offset=2), entry)
            return entry

        epochs.observe(3, 6)  # the fence, between the servicer's check and the step
        refused = await staged_ack(old, 5)
        assert refused.error.reason == "STALE_COORDINATOR_EPOCH"
        assert refused.error.metadata["current_coordinator_epoch"] == "6"
        assert refused.cumulative_end_offset == -1
        assert owner.subscriptions.pending_transactions("s") == []  # nothing staged
        taken = await staged_ack(new, 6)
        assert not taken.error.reason and taken.cumulative_end_offset == 0  # pending
        assert owner.subscriptions.pending_transactions("s") == [new]
        await owner.close()

    asyncio.run(scenario())


def test_a_staged_ack_answers_whether_it_is_pending_on_its_cursor(tmp_path):
    """The cursor side of a resolution (PartitionSubscriptions.staged_ack_now): an ack
    staged and durable answers True, also once retention acknowledged its offsets (the
    transaction stays pending until its marker); a transaction that acked elsewhere, an
    aborted one and a subscription that does not exist answer False; after a restart the
    answer comes from the journal. Asking writes nothing."""
    settings = OwnerSettings(log=LogConfig())
    staged, other, aborted = TxnId(3, 1), TxnId(3, 2), TxnId(3, 3)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings,
                               coordinator_epoch=lambda tc: 1)
        await owner.start()
        await start(owner, batch(7, 0))  # offsets 0 and 1
        assert await owner.subscriptions.create("s", 0) == (True, 0)
        subscriptions, limit = owner.subscriptions, owner.max_read_position()
        await subscriptions.ack("s", 1, [], staged, limit)
        await subscriptions.ack("s", 0, [(1, 2)], aborted, limit)
        await subscriptions.end_txn("s", aborted, committed=False)
        store = subscriptions.store
        written = store.appended_end
        assert await subscriptions.staged_ack_now("s", staged) is True
        assert await subscriptions.staged_ack_now("s", other) is False
        assert await subscriptions.staged_ack_now("s", aborted) is False
        assert await subscriptions.staged_ack_now("no-such", staged) is False
        assert store.appended_end == written  # asking staged nothing
        subscriptions.forget_below(2)  # retention acknowledges offsets 0 and 1
        assert await subscriptions.staged_ack_now("s", staged) is True
        await owner.close()
        reopened = PartitionOwner("t", 0, tmp_path / "t-0", settings,
                                  coordinator_epoch=lambda tc: 1)
        await reopened.start()
        assert await reopened.subscriptions.staged_ack_now("s", staged) is True
        assert await reopened.subscriptions.staged_ack_now("s", aborted) is False
        await reopened.close()

    asyncio.run(scenario())


def test_the_answer_waits_for_the_durability_of_what_came_before_it(tmp_path):
    """Nothing before it: answered without a write. A stage written and not durable yet:
    answered True only once its fsync ended. A failed fsync: the question fails with the
    stage (the caller asks again), and after the reload the lost stage answers False."""
    gate = GatedFsync()
    settings = OwnerSettings(log=LogConfig(), max_fsyncs_in_flight=1, write_ahead_bytes=0)
    first, second = TxnId(3, 1), TxnId(3, 2)

    async def scenario():
        owner = PartitionOwner("t", 0, tmp_path / "t-0", settings, fsync=gate,
                               coordinator_epoch=lambda tc: 1)
        await owner.start()
        assert await owner.resolve_staged(first) is False  # an empty step
        assert gate.calls == 0 and owner.log.log_end_offset == 0
        staged = stage(owner, first, 1)
        await until(lambda: gate.calls == 1)
        resolved = asyncio.ensure_future(owner.resolve_staged(first))
        await asyncio.sleep(0.05)
        assert not resolved.done() and not staged.done()  # the stage's fsync is held
        gate.release(0)
        assert (await staged).base_offset == 0
        assert await resolved is True
        assert owner.log.high_watermark == 1

        lost = stage(owner, second, 1)
        await until(lambda: gate.calls == 2)
        asked = asyncio.ensure_future(owner.resolve_staged(second))
        await asyncio.sleep(0.02)
        gate.release(1, OSError(errno.EIO, "Input/output error"))
        await fail_loading(lost, asked)  # the question fails with the stage before it
        await until(lambda: owner.state is State.ONLINE)
        gate.release_all()
        assert owner.log.log_end_offset == 1  # cut back to what was durable
        assert await owner.resolve_staged(second) is False
        assert await owner.resolve_staged(first) is True
        await owner.close()

    asyncio.run(scenario())


# ---------------------------------------------------------------------- real servers
EPOCH = 100  # above any epoch this module's coordinators reach: the fences are ours


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("atomlog-resolve-staged"))
    try:
        cluster.run("up", "--output", "json", "--partition-servers", "2", "--coordinators",
                    "1", *CLUSTER_SETTINGS, "--set", "partition.txn_check_after_ms=3600000")
        yield cluster
    finally:
        cluster.run("down", check=False)


@pytest.fixture(scope="module")
def client(servers):
    with Client(servers.info["bootstrap"], request_timeout_s=10) as client:
        yield client


def tp(topic: str, partition: int) -> common_pb2.TopicPartition:
    return common_pb2.TopicPartition(topic=topic, partition=partition)


def txn_id(tc: int, sequence: int) -> common_pb2.TxnId:
    return common_pb2.TxnId(tc_partition=tc, sequence=sequence)


def stub_for(client, topic: str, partition: int):
    return client.channels.partition(client.metadata.route(topic, partition).address)


def stage_txn(client, topic: str, partition: int, tc: int, sequence: int,
              epoch: int) -> partition_pb2.ProduceResult:
    """StageTxn of one batch, straight, as a coordinator sends it."""
    reply = stub_for(client, topic, partition).StageTxn(partition_pb2.StageTxnRequest(
        items=[partition_pb2.StageTxnItem(
            txn_id=txn_id(tc, sequence), coordinator_epoch=epoch,
            batches=[partition_pb2.ProduceItem(
                topic_partition=tp(topic, partition),
                record_batch=encode_batch([Record(None, b"%d" % sequence, (), 0)]))])]),
        timeout=10)
    return reply.results[0].batch_results[0]


def item(tc: int, sequence: int, epoch: int, topic: str, *partitions: int):
    return partition_pb2.ResolveStagedItem(txn_id=txn_id(tc, sequence), coordinator_epoch=epoch,
                                           topic_partitions=[tp(topic, p) for p in partitions])


def resolve(client, topic: str, partition: int, *items) -> list[list[bool | str]]:
    """ResolveStaged at the server leading topic-partition: per item, per partition, its
    answer or its error's reason."""
    reply = stub_for(client, topic, partition).ResolveStaged(
        partition_pb2.ResolveStagedRequest(items=list(items)), timeout=10)
    assert [r.txn_id for r in reply.results] == [i.txn_id for i in items]
    for result, asked in zip(reply.results, items):
        assert [p.topic_partition for p in result.partitions] == list(asked.topic_partitions)
    return [[p.error.reason or p.staged for p in r.partitions] for r in reply.results]


def end_txn(client, topic: str, partition: int, tc: int, sequence: int, epoch: int,
            decision) -> None:
    reply = stub_for(client, topic, partition).EndTxnOnPartition(
        partition_pb2.EndTxnOnPartitionRequest(markers=[partition_pb2.TxnMarker(
            txn_id=txn_id(tc, sequence), decision=decision, coordinator_epoch=epoch,
            topic_partitions=[tp(topic, partition)])]), timeout=10)
    entry = reply.results[0].topic_partition_results[0]
    assert not entry.error.reason and entry.marker_offset >= 0, entry


def open_sequences(client, topic: str, partition: int) -> list[int]:
    return [t.txn_id.sequence
            for t in client.describe_partition(topic, partition).open_transactions]


def process_of(servers: Cluster, client, topic: str, partition: int) -> dict:
    address = client.metadata.route(topic, partition).address
    return next(p for p in servers.services() if p["grpc_address"] == address)


def resolved_count(process: dict, result: str) -> float:
    return metric_sum(process["metrics_address"],
                      f'atomlog_partition_resolve_staged_total{{result="{result}"}}')


@pytest.mark.cluster
def test_staged_durable_data_answers_true_and_never_staged_or_aborted_false(servers, client):
    """One request, one item per transaction: staged and durable (True), its partition
    where it was never staged (False), aborted by an ABORT marker (False), committed by a
    COMMIT marker (True), a partition this server does not lead (NOT_PARTITION_OWNER)."""
    topic = create_online(client, "rs-answers", 6)
    route = client.metadata.route
    here = [p for p in range(6) if route(topic, p).address == route(topic, 0).address]
    there = [p for p in range(6) if p not in here]
    assert len(here) >= 2 and there, (here, there)
    other = here[1]
    tc = 1
    for sequence in (1, 2, 3):
        assert not stage_txn(client, topic, 0, tc, sequence, EPOCH).error.reason
    end_txn(client, topic, 0, tc, 2, EPOCH, partition_pb2.TXN_DECISION_ABORT)
    end_txn(client, topic, 0, tc, 3, EPOCH, partition_pb2.TXN_DECISION_COMMIT)
    assert open_sequences(client, topic, 0) == [1]
    process = process_of(servers, client, topic, 0)
    before = {r: resolved_count(process, r) for r in ("staged", "not_staged", "error")}
    assert resolve(client, topic, 0,
                   item(tc, 1, EPOCH, topic, 0, other, there[0]),
                   item(tc, 2, EPOCH, topic, 0),
                   item(tc, 3, EPOCH, topic, 0),
                   item(tc, 4, EPOCH, topic, 0)) == [
        [True, False, "NOT_PARTITION_OWNER"], [False], [True], [False]]
    after = {r: resolved_count(process, r) for r in before}
    assert {r: after[r] - before[r] for r in before} == \
        {"staged": 2, "not_staged": 3, "error": 1}
    # Asking changed nothing: the staged transaction is still open, nothing was written.
    assert open_sequences(client, topic, 0) == [1]
    assert open_sequences(client, topic, other) == []
    assert client.describe_partition(topic, other).high_watermark == 0


@pytest.mark.cluster
def test_after_resolve_staged_a_stage_of_the_older_epoch_is_refused_and_writes_nothing(
        servers, client):
    """A new coordinator (epoch E+1) resolves a transaction the old one (E) was staging:
    not staged here. The old owner's StageTxn arriving afterwards is refused and appends
    nothing, so the answer holds; a ResolveStaged of the old epoch is refused too."""
    topic = create_online(client, "rs-fence", 1)
    tc = 2
    assert not stage_txn(client, topic, 0, tc, 1, EPOCH).error.reason  # the old owner's
    before = client.describe_partition(topic, 0)
    assert resolve(client, topic, 0, item(tc, 2, EPOCH + 1, topic, 0)) == [[False]]
    late = stage_txn(client, topic, 0, tc, 2, EPOCH)
    assert late.error.reason == "STALE_COORDINATOR_EPOCH"
    assert late.error.metadata["current_coordinator_epoch"] == str(EPOCH + 1)
    assert (late.base_offset, late.last_offset) == (-1, -1)
    after = client.describe_partition(topic, 0)
    assert after.high_watermark == before.high_watermark
    assert open_sequences(client, topic, 0) == [1]
    with client.consumer([topic], isolation="read_uncommitted", start="earliest") as consumer:
        values = []
        while not values:
            values += [m.value for m in consumer.poll(timeout_s=1.0)]
        assert not consumer.poll(timeout_s=0.5)
    assert values == [b"1"]  # the old owner's first stage, nothing after it
    assert resolve(client, topic, 0, item(tc, 2, EPOCH, topic, 0)) == \
        [["STALE_COORDINATOR_EPOCH"]]
    # The new owner stages and resolves as usual.
    assert not stage_txn(client, topic, 0, tc, 3, EPOCH + 1).error.reason
    assert resolve(client, topic, 0, item(tc, 3, EPOCH + 1, topic, 0),
                   item(tc, 2, EPOCH + 1, topic, 0)) == [[True], [False]]


def sp(topic: str, partition: int, subscription: str) -> common_pb2.SubscriptionPartition:
    return common_pb2.SubscriptionPartition(topic=topic, partition=partition,
                                            subscription=subscription)


def stage_ack(client, topic: str, subscription: str, tc: int, sequence: int, epoch: int,
              start: int, end: int) -> partition_pb2.AckResult:
    """StageTxn of one ack (offsets [start, end) of partition 0), as a coordinator sends
    it."""
    reply = stub_for(client, topic, 0).StageTxn(partition_pb2.StageTxnRequest(
        items=[partition_pb2.StageTxnItem(
            txn_id=txn_id(tc, sequence), coordinator_epoch=epoch,
            acks=[partition_pb2.AckItem(
                subscription_partition=sp(topic, 0, subscription),
                individual_ranges=[partition_pb2.OffsetRange(start_offset=start,
                                                             end_offset=end)])])]),
        timeout=10)
    return reply.results[0].ack_results[0]


def resolve_acks(client, topic: str, tc: int, sequence: int, epoch: int,
                 *subscriptions: str) -> list[bool | str]:
    """ResolveStaged of one transaction's acks on partition 0's subscriptions: per
    subscription partition, its answer or its error's reason."""
    reply = stub_for(client, topic, 0).ResolveStaged(partition_pb2.ResolveStagedRequest(
        items=[partition_pb2.ResolveStagedItem(
            txn_id=txn_id(tc, sequence), coordinator_epoch=epoch,
            subscription_partitions=[sp(topic, 0, s) for s in subscriptions])]), timeout=10)
    (result,) = reply.results
    assert not result.partitions
    assert [e.subscription_partition.subscription for e in result.subscription_partitions] == \
        list(subscriptions)
    return [e.error.reason or e.staged for e in result.subscription_partitions]


@pytest.mark.cluster
def test_a_staged_ack_answers_true_and_the_fence_refuses_a_later_one_of_the_older_epoch(
        servers, client):
    """A transaction's ack staged on a subscription (StageTxn) is durable there: True; a
    transaction that staged none, and a subscription that does not exist: False. After a
    newer epoch's resolution the old owner's late ack is refused and stages nothing, so
    the answer holds; the newer owner's acks go ahead."""
    topic = create_online(client, "rs-acks", 1)
    with client.producer() as producer:
        for i in range(4):
            producer.send(topic, b"%d" % i, partition=0)
    stub = stub_for(client, topic, 0)
    created = stub.CreateSubscription(partition_pb2.CreateSubscriptionRequest(
        subscription_partitions=[sp(topic, 0, "s")],
        initial_position=partition_pb2.SUBSCRIPTION_INITIAL_POSITION_EARLIEST), timeout=10)
    assert not any(r.error.reason for r in created.results), created
    tc = 5
    staged = stage_ack(client, topic, "s", tc, 1, EPOCH, 0, 2)
    assert not staged.error.reason, staged
    assert resolve_acks(client, topic, tc, 1, EPOCH, "s", "none") == [True, False]
    assert resolve_acks(client, topic, tc, 2, EPOCH + 1, "s") == [False]  # fences EPOCH
    late = stage_ack(client, topic, "s", tc, 2, EPOCH, 2, 4)
    assert late.error.reason == "STALE_COORDINATOR_EPOCH", late
    assert resolve_acks(client, topic, tc, 2, EPOCH + 1, "s") == [False]
    (cursor,) = [c for c in client.describe_partition(topic, 0).subscriptions
                 if c.subscription_partition.subscription == "s"]
    assert [(p.txn_id.tc_partition, p.txn_id.sequence) for p in cursor.pending_acks] == \
        [(tc, 1)]
    assert not stage_ack(client, topic, "s", tc, 3, EPOCH + 1, 2, 4).error.reason
    assert resolve_acks(client, topic, tc, 3, EPOCH + 1, "s") == [True]
    assert resolve_acks(client, topic, tc, 1, EPOCH, "s") == ["STALE_COORDINATOR_EPOCH"]


def refusal(client, topic: str, request) -> AtomlogError:
    with pytest.raises(grpc.RpcError) as refused:
        stub_for(client, topic, 0).ResolveStaged(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return from_rpc_error(refused.value)


@pytest.mark.cluster
def test_a_bad_request_is_refused_whole_with_the_field_and_fences_nothing(servers, client):
    topic = create_online(client, "rs-invalid", 2)
    tc, high = 3, EPOCH + 50
    good = item(tc, 1, high, topic, 0)  # would fence TC 3 at `high` if it were applied
    cases = [
        ("items", []),
        ("items[1].txn_id", [good, partition_pb2.ResolveStagedItem(
            coordinator_epoch=high, topic_partitions=[tp(topic, 0)])]),  # no txn_id
        ("items[0].txn_id", [item(tc, 0, high, topic, 0)]),  # sequence 0
        ("items[0].txn_id", [item(99, 1, high, topic, 0)]),  # no such TC partition
        ("items[0].coordinator_epoch", [item(tc, 1, 0, topic, 0)]),
        ("items[1].topic_partitions", [good, item(tc, 2, high, topic)]),  # none
        ("items[1].topic_partitions[2]", [good, item(tc, 2, high, topic, 0, 1, 0)]),
        ("items[0].topic_partitions[0].topic", [item(tc, 1, high, "no spaces", 0)]),
        ("items[0].subscription_partitions[0].subscription", [
            partition_pb2.ResolveStagedItem(txn_id=txn_id(tc, 1), coordinator_epoch=high,
                                            subscription_partitions=[sp(topic, 0, "")])]),
        ("items[0].subscription_partitions[1]", [partition_pb2.ResolveStagedItem(
            txn_id=txn_id(tc, 1), coordinator_epoch=high,
            subscription_partitions=[sp(topic, 0, "s"), sp(topic, 0, "s")])]),
    ]
    for field, items in cases:
        error = refusal(client, topic, partition_pb2.ResolveStagedRequest(items=items))
        assert (error.reason, error.metadata.get("field")) == ("INVALID_ARGUMENT", field), \
            (items, error)
    # Nothing was fenced: the TC partition's epoch is still below `high`.
    staged = stage_txn(client, topic, 0, tc, 7, EPOCH)
    assert not staged.error.reason, staged
    assert open_sequences(client, topic, 0) == [7]


@pytest.mark.cluster
def test_a_partition_server_killed_after_a_stage_answers_from_its_durable_log(servers,
                                                                              client):
    """kill -9 after the stage was acknowledged (and an aborted one beside it): the
    restarted server rebuilds its transaction buffer from its log and answers from it."""
    topic = create_online(client, "rs-restart", 1)
    tc = 4
    for sequence in (1, 2):
        assert not stage_txn(client, topic, 0, tc, sequence, EPOCH).error.reason
    end_txn(client, topic, 0, tc, 2, EPOCH, partition_pb2.TXN_DECISION_ABORT)
    victim = process_of(servers, client, topic, 0)
    os.kill(victim["pid"], signal.SIGKILL)
    assert victim["name"] in json.loads(servers.run("up", "--output", "json").stdout)["started"]
    asked = [item(tc, sequence, EPOCH + 1, topic, 0) for sequence in (1, 2, 3)]
    answered: list = []

    def answers_given() -> bool:  # not before the partition serves again
        try:
            answered[:] = resolve(client, topic, 0, *asked)
        except grpc.RpcError:
            return False
        return not any(isinstance(a, str) for answer in answered for a in answer)

    wait_until(answers_given, 60, "the restarted server to answer")
    assert answered == [[True], [False], [False]]
    assert open_sequences(client, topic, 0) == [1]
