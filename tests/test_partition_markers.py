"""Transaction markers (EndTxnOnPartition) and DeleteRecords on a real cluster.

Markers: validation per marker, routing per target, fencing by coordinator epoch (from
ZooKeeper /tc/<k> and from accepted markers). No transaction can have data on a
partition yet, so accepted markers write nothing (marker_offset -1).
DeleteRecords: whole segments below before_offset go; reads, offsets and appends agree.

The cluster's coordinators may hold leases on every TC partition, so these tests send
markers only with the current ZooKeeper epoch, except on TC partition 15 for the stale
test, which hands TC 15's lease on afterwards so its holder gets a newer epoch."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import grpc
import pytest
from kazoo.exceptions import BadVersionError, NoNodeError, NotEmptyError

from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc
from partition_server.coordinator_epochs import CoordinatorEpochs
from partition_server.record_batch import Record, encode_batch, iter_batches
from services.errors import from_rpc_error
from spark_client import Client
from tests.conftest import atomlog, create_online, wait_until

pytestmark = pytest.mark.cluster

COMMIT, ABORT = partition_pb2.TXN_DECISION_COMMIT, partition_pb2.TXN_DECISION_ABORT
STALE_TC = 15  # no other test bumps this TC partition's epoch


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.info["bootstrap"]) as client:
        yield client


@pytest.fixture(scope="module")
def zk(cluster):
    client = cluster.zookeeper()
    try:
        yield client
    finally:
        client.stop()
        client.close()


def tp(topic: str, partition: int) -> common_pb2.TopicPartition:
    return common_pb2.TopicPartition(topic=topic, partition=partition)


def sp(topic: str, partition: int, subscription: str) -> common_pb2.SubscriptionPartition:
    return common_pb2.SubscriptionPartition(topic=topic, partition=partition,
                                            subscription=subscription)


def stub_at(client: Client, address: str):
    return partition_pb2_grpc.PartitionServiceStub(client.channels.get(address))


def zk_epoch(zk, k: int) -> int:
    try:
        data, _ = zk.get(f"/tc/{k}")
    except NoNodeError:
        return 0
    return int(json.loads(data or b"{}").get("epoch", 0))


def marker(tc: int, sequence: int, epoch: int, decision=COMMIT, topic_partitions=(),
           subscription_partitions=()) -> partition_pb2.TxnMarker:
    return partition_pb2.TxnMarker(
        txn_id=common_pb2.TxnId(tc_partition=tc, sequence=sequence), decision=decision,
        coordinator_epoch=epoch, topic_partitions=list(topic_partitions),
        subscription_partitions=list(subscription_partitions))


def end_txn(stub, *markers):
    return stub.EndTxnOnPartition(partition_pb2.EndTxnOnPartitionRequest(markers=markers),
                                  timeout=30)


def reasons(result) -> list[str]:
    return ([r.error.reason for r in result.topic_partition_results]
            + [r.error.reason for r in result.subscription_partition_results])


def whole_request_error(call) -> str:
    with pytest.raises(grpc.RpcError) as failed:
        call()
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return from_rpc_error(failed.value).reason


@pytest.fixture(scope="module")
def layout(client, cluster):
    """A 4-partition topic; the server owning partition 0, what it owns and what not."""
    create_online(client, "markers", 4)
    routes = [client.metadata.route("markers", p) for p in range(4)]
    home = routes[0]
    owned = [p for p, r in enumerate(routes) if r.server_name == home.server_name]
    foreign = [(p, r) for p, r in enumerate(routes) if r.server_name != home.server_name]
    if not foreign:  # all four landed on one server: ask another server instead
        other = next(p for p in cluster.services()
                     if p["role"] == "partition_server" and p["name"] != home.server_name)
        return {"stub": stub_at(client, other["grpc_address"]), "owned": [], "foreign": [
            (p, r) for p, r in enumerate(routes)], "home": other["name"]}
    return {"stub": stub_at(client, home.address), "owned": owned, "foreign": foreign,
            "home": home.server_name}


# --------------------------------------------------------------------------- markers

def test_markers_for_owned_partitions_succeed_with_no_marker_offset(zk, layout):
    if not layout["owned"]:
        pytest.skip("every partition of the topic is on one server")
    epoch = max(zk_epoch(zk, 3), 1)
    owned = layout["owned"]
    reply = end_txn(layout["stub"],
                    marker(3, 101, epoch, COMMIT, [tp("markers", p) for p in owned],
                           [sp("markers", owned[0], "sub-a")]),
                    marker(3, 102, epoch, ABORT, [tp("markers", owned[0])]),
                    marker(3, 101, epoch, COMMIT, [tp("markers", owned[0])]))  # a repeat
    assert [r.txn_id.sequence for r in reply.results] == [101, 102, 101]
    first = reply.results[0]
    assert [r.topic_partition.partition for r in first.topic_partition_results] == owned
    assert first.subscription_partition_results[0].subscription_partition.subscription == "sub-a"
    for result in reply.results:
        assert set(reasons(result)) == {""}
        for item in result.topic_partition_results:
            assert item.marker_offset == -1 and not item.already_ended
        assert not any(s.already_ended for s in result.subscription_partition_results)


def test_markers_for_partitions_elsewhere_or_unknown_get_their_reasons(zk, layout):
    epoch = max(zk_epoch(zk, 4), 1)
    partition, route = layout["foreign"][0]
    reply = end_txn(layout["stub"], marker(
        4, 7, epoch, ABORT,
        [tp("markers", partition), tp("no-such-topic", 0), tp("markers", 99)],
        [sp("markers", partition, "sub-b"), sp("no-such-topic", 1, "sub-b")]))
    result = reply.results[0]
    assert reasons(result) == ["NOT_PARTITION_OWNER", "UNKNOWN_TOPIC_OR_PARTITION",
                               "UNKNOWN_TOPIC_OR_PARTITION", "NOT_PARTITION_OWNER",
                               "UNKNOWN_TOPIC_OR_PARTITION"]
    not_owner = result.topic_partition_results[0]
    assert not_owner.error.metadata["owner_server_name"] == route.server_name
    assert not_owner.error.metadata["owner_address"] == route.address
    assert not_owner.marker_offset == -1 and not_owner.error.message
    assert result.subscription_partition_results[0].error.metadata["owner_address"] == \
        route.address


def test_invalid_markers_fail_only_their_own_items(zk, layout):
    epoch = max(zk_epoch(zk, 5), 1)
    target = tp("markers", layout["owned"][0] if layout["owned"] else 0)
    good = marker(5, 1, epoch, COMMIT, [target])
    no_txn = partition_pb2.TxnMarker(decision=COMMIT, coordinator_epoch=epoch,
                                     topic_partitions=[target])
    bad = [
        marker(5, 0, epoch, COMMIT, [target, target]),  # sequence 0
        marker(5, 2, epoch, partition_pb2.TXN_DECISION_UNSPECIFIED, [target]),
        marker(5, 3, 0, COMMIT, [target], [sp("markers", 0, "s")]),  # epoch 0
        marker(99, 4, epoch, COMMIT, [target]),  # no TC partition 99
        no_txn,
        marker(5, 5, epoch, ABORT, [tp("", 0)]),
        marker(5, 6, epoch, ABORT, [target], [sp("markers", 0, "")]),
        marker(5, 7, epoch, ABORT, [tp("bad name!", 0)]),
    ]
    reply = end_txn(layout["stub"], good, *bad, good)
    expected_first = "" if layout["owned"] else "NOT_PARTITION_OWNER"
    assert set(reasons(reply.results[0])) == {expected_first}
    assert set(reasons(reply.results[-1])) == {expected_first}
    for index, result in enumerate(reply.results[1:-1], start=1):
        assert reasons(result) and set(reasons(result)) == {"INVALID_ARGUMENT"}, index
        item = (list(result.topic_partition_results) + list(result.subscription_partition_results))[0]
        assert item.error.metadata["marker_index"] == str(index) and item.error.message
    assert len(reply.results[3].subscription_partition_results) == 1
    assert len(reply.results[1].topic_partition_results) == 2


def test_requests_past_their_bounds_or_with_empty_markers_fail_whole(zk, layout):
    stub, epoch = layout["stub"], max(zk_epoch(zk, 6), 1)
    target = tp("markers", 0)
    assert whole_request_error(lambda: end_txn(stub)) == "INVALID_ARGUMENT"
    assert whole_request_error(lambda: end_txn(
        stub, marker(6, 1, epoch, COMMIT, [target]), marker(6, 2, epoch))) == "INVALID_ARGUMENT"
    too_many = [marker(6, i + 1, epoch, COMMIT, [target]) for i in range(10_001)]
    assert whole_request_error(lambda: end_txn(stub, *too_many)) == "INVALID_ARGUMENT"
    wide = [marker(6, i + 1, epoch, COMMIT, [target] * 25_001) for i in range(4)]
    assert whole_request_error(lambda: end_txn(stub, *wide)) == "INVALID_ARGUMENT"


def test_coordinator_epochs_only_go_up_and_survive_bad_records():
    epochs = CoordinatorEpochs(None, tc_partitions=16)
    assert epochs.current(3) == 0
    epochs._on_data(3, json.dumps({"epoch": 4, "log_producer_id": 9}).encode())
    assert epochs.current(3) == 4
    assert epochs.observe(3, 6) == 6 and epochs.current(3) == 6  # a marker ahead of ZooKeeper
    epochs._on_data(3, json.dumps({"epoch": 5, "log_producer_id": 9}).encode())
    assert epochs.observe(3, 2) == 6 and epochs.current(3) == 6  # never lowered
    for bad in (b"not json", b"{}", b'{"epoch": "7"}', b'{"epoch": -1}', b'{"epoch": true}', None):
        epochs._on_data(3, bad)
    assert epochs.current(3) == 6 and epochs.snapshot() == {3: 6}


def scrape(cluster, server_name: str) -> str:
    address = next(p for p in cluster.services() if p["name"] == server_name)["metrics_address"]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return reply.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "") + r" (\S+)"
    found = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_stale_coordinator_epochs_are_refused(cluster, zk, layout):
    stub = layout["stub"]
    target = tp("markers", layout["owned"][0]) if layout["owned"] else None
    ok = "" if target is not None else "NOT_PARTITION_OWNER"
    target = target or tp("markers", 0)
    path = f"/tc/{STALE_TC}"
    try:
        data, stat = zk.get(path)
        original = json.loads(data)
    except NoNodeError:
        original, stat = None, None
    base = int(original["epoch"]) if original else 0
    epoch = base + 5  # 5 on a cluster without coordinators
    record = {**(original or {}), "epoch": epoch,
              "log_producer_id": (original or {}).get("log_producer_id")}
    had_owner = zk.exists(f"{path}/owner") is not None

    def send(e: int, sequence: int = 1):
        reply = end_txn(stub, marker(STALE_TC, sequence, e, COMMIT, [target],
                                     [sp(target.topic, target.partition, "sub-s")]))
        return reply.results[0]

    before = scrape(cluster, layout["home"])
    try:
        if stat is None:
            zk.create(path, json.dumps(record).encode())
        else:
            zk.set(path, json.dumps(record).encode(), version=stat.version)
        # The watch delivers epoch E to the server: a marker of E - 1 becomes stale.
        wait_until(lambda: set(reasons(send(epoch - 1))) == {"STALE_COORDINATOR_EPOCH"}, 10,
                   f"the server to see epoch {epoch} of TC partition {STALE_TC}")
        stale = send(epoch - 1)
        item = stale.topic_partition_results[0]
        assert item.marker_offset == -1 and item.error.metadata["tc_partition"] == str(STALE_TC)
        assert item.error.metadata["current_coordinator_epoch"] == str(epoch)
        assert set(reasons(send(epoch))) == {ok}
        assert set(reasons(send(epoch + 1))) == {ok}  # ahead of ZooKeeper: accepted
        assert set(reasons(send(epoch + 2))) == {ok}
        assert set(reasons(send(epoch + 1))) == {"STALE_COORDINATOR_EPOCH"}  # raised by E+2
        # In one request, a later marker of a lower epoch is stale too.
        reply = end_txn(stub, marker(STALE_TC, 2, epoch + 3, COMMIT, [target]),
                        marker(STALE_TC, 3, epoch + 2, COMMIT, [target]))
        assert [set(reasons(r)) for r in reply.results] == [{ok}, {"STALE_COORDINATOR_EPOCH"}]
        after = scrape(cluster, layout["home"])
        assert metric(after, "atomlog_partition_stale_markers_total") - \
            metric(before, "atomlog_partition_stale_markers_total") >= 3
        assert metric(after, "atomlog_partition_markers_total", decision="commit",
                      result="stale") - metric(before, "atomlog_partition_markers_total",
                                               decision="commit", result="stale") >= 5
        if ok == "":
            assert metric(after, "atomlog_partition_markers_total", decision="commit",
                          result="applied") > metric(before, "atomlog_partition_markers_total",
                                                     decision="commit", result="applied")
    finally:
        restore_tc_partition(zk, path, original, epoch + 3, had_owner)


def restore_tc_partition(zk, path: str, original: dict | None, highest: int,
                         had_owner: bool) -> None:
    """Undo the test's znode without moving the epoch back (a partition server has accepted
    markers up to `highest`, so a lower epoch would fence TC partition 15's coordinator).
    A lease holder still has its old epoch: delete its owner node, as its session's end
    would, so the lease is taken again at once with an epoch above `highest`."""
    for _ in range(10):
        try:
            data, stat = zk.get(path)
        except NoNodeError:
            return
        if original is None and not zk.get_children(path):
            try:
                zk.delete(path, version=stat.version)
                return
            except (BadVersionError, NotEmptyError):
                continue
        record = json.loads(data)
        try:
            zk.set(path, json.dumps({**(original or {}), **record,
                                     "epoch": max(int(record["epoch"]), highest)}).encode(),
                   version=stat.version)
            break
        except BadVersionError:
            continue
    if not had_owner:
        return
    try:
        zk.delete(f"{path}/owner")
    except NoNodeError:
        pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # best effort: coordinators re-acquire by themselves
        try:
            owner, _ = zk.get(f"{path}/owner")
            if json.loads(owner).get("epoch", 0) > highest:
                return
        except (NoNodeError, ValueError):
            pass
        time.sleep(0.1)


# --------------------------------------------------------------------------- DeleteRecords

def produce(stub, topic: str, partition: int, batches: int, records: int = 10) -> None:
    items = [partition_pb2.ProduceItem(
        topic_partition=tp(topic, partition),
        record_batch=encode_batch([Record(key=b"k", value=bytes([i % 251]) * 1_000)
                                   for i in range(records)])) for _ in range(batches)]
    reply = stub.Produce(partition_pb2.ProduceRequest(items=items), timeout=30)
    assert all(not r.error.reason for r in reply.results)


def delete(stub, topic: str, partition: int, before: int):
    return stub.DeleteRecords(partition_pb2.DeleteRecordsRequest(items=[
        partition_pb2.DeleteRecordsItem(topic=topic, partition=partition, before_offset=before)]),
        timeout=30).results[0]


def fetch(stub, topic: str, partition: int, offset: int):
    return stub.Fetch(partition_pb2.FetchRequest(items=[partition_pb2.FetchItem(
        topic_partition=tp(topic, partition), fetch_offset=offset)]), timeout=30).results[0]


def describe(stub, topic: str, partition: int):
    return stub.DescribePartition(partition_pb2.DescribePartitionRequest(
        topic_partition=tp(topic, partition)), timeout=30)


def test_delete_records_moves_the_log_start_to_a_segment_boundary(client, cluster):
    create_online(client, "trimmed", 1, config={"segment.bytes": str(1 << 16)})
    route = client.metadata.route("trimmed", 0)
    stub = stub_at(client, route.address)
    produce(stub, "trimmed", 0, batches=40)  # ~10 KiB batches of 10 records: 7 segments
    before = describe(stub, "trimmed", 0)
    assert before.high_watermark == 400 and before.segment_count >= 5

    result = delete(stub, "trimmed", 0, 205)
    start = result.log_start_offset
    assert not result.error.reason and (result.topic, result.partition) == ("trimmed", 0)
    assert 0 < start <= 205 and start % 10 == 0  # the base of the segment holding 205
    after = describe(stub, "trimmed", 0)
    assert after.log_start_offset == start and after.segment_count < before.segment_count
    assert after.high_watermark == 400

    below = fetch(stub, "trimmed", 0, start - 1)
    assert below.error.reason == "OFFSET_OUT_OF_RANGE"
    assert below.error.metadata["log_start_offset"] == str(start)
    earliest = stub.ListOffsets(partition_pb2.ListOffsetsRequest(items=[
        partition_pb2.ListOffsetsItem(topic_partition=tp("trimmed", 0),
                                      spec=partition_pb2.OFFSET_SPEC_EARLIEST)]), timeout=30)
    assert earliest.results[0].offset == start == earliest.results[0].log_start_offset
    first = fetch(stub, "trimmed", 0, start)
    assert not first.error.reason and first.log_start_offset == start
    assert [h.base_offset for _, h in iter_batches(first.record_batches)][0] == start
    assert not fetch(stub, "trimmed", 0, 205).error.reason

    assert delete(stub, "trimmed", 0, 205).log_start_offset == start  # idempotent
    assert delete(stub, "trimmed", 0, start - 1).log_start_offset == start
    assert delete(stub, "trimmed", 0, 0).log_start_offset == start
    produce(stub, "trimmed", 0, batches=2)
    assert describe(stub, "trimmed", 0).log_start_offset == start

    everything = delete(stub, "trimmed", 0, 420)  # == the high watermark
    assert not everything.error.reason and start < everything.log_start_offset <= 420
    assert describe(stub, "trimmed", 0).segment_count == 1  # only the active segment is left


def test_the_sdk_and_the_cli_delete_records(client, cluster):
    """Client.delete_records and `atomlog partition delete-records`: each partition named
    trimmed on its owner, the new log starts returned (and printed); past the high
    watermark OFFSET_OUT_OF_RANGE (exit 1), nothing deleted."""
    from spark_client import errors

    create_online(client, "trim-sdk", 2, config={"segment.bytes": str(1 << 16)})
    for partition in (0, 1):
        produce(stub_at(client, client.metadata.route("trim-sdk", partition).address),
                "trim-sdk", partition, batches=40)
    starts = client.delete_records("trim-sdk", {0: 205, 1: 105})
    assert set(starts) == {0, 1} and 0 < starts[0] <= 205 and 0 < starts[1] <= 105
    for partition, start in starts.items():
        assert client.describe_partition("trim-sdk", partition).log_start_offset == start
    assert client.delete_records("trim-sdk", {}) == {}
    with pytest.raises(errors.AtomlogClientError) as refused:
        client.delete_records("trim-sdk", {0: 401})
    assert refused.value.reason == "OFFSET_OUT_OF_RANGE"
    assert client.describe_partition("trim-sdk", 0).log_start_offset == starts[0]

    bootstrap = client.metadata.route("trim-sdk", 0).address
    done = atomlog("partition", "delete-records", "trim-sdk", "1", "--before", "305",
                   "--bootstrap", bootstrap, "-o", "json")
    moved = json.loads(done.stdout)
    assert moved["partition"] == 1 and starts[1] < moved["log_start_offset"] <= 305
    assert client.describe_partition("trim-sdk", 1).log_start_offset == \
        moved["log_start_offset"]
    past = atomlog("partition", "delete-records", "trim-sdk", "1", "--before", "9999",
                   "--bootstrap", bootstrap, check=False)
    assert past.returncode == 1 and "OFFSET_OUT_OF_RANGE" in past.stderr, past
    assert client.describe_partition("trim-sdk", 1).log_start_offset == \
        moved["log_start_offset"]


def test_a_consumer_starts_at_the_log_start_and_a_partition_it_cannot_read_is_not_hidden(
        client, cluster):
    """A consumer started at "earliest" began every partition at offset 0. After
    DeleteRecords (or retention) moved a partition's log start, that partition answered
    OFFSET_OUT_OF_RANGE, and while another partition brought data, poll() dropped the
    error: the partition was never read again, and nothing said so. Now "earliest" is
    the log start, and a partition's error that retrying cannot mend is raised even when
    others bring data (theirs is kept for the next poll)."""
    from spark_client import errors

    create_online(client, "trimmed-2", 2, config={"segment.bytes": str(1 << 16)})
    stub = stub_at(client, client.metadata.route("trimmed-2", 0).address)
    produce(stub, "trimmed-2", 0, batches=40)
    start = delete(stub, "trimmed-2", 0, 205).log_start_offset
    assert start > 0
    other = stub_at(client, client.metadata.route("trimmed-2", 1).address)
    produce(other, "trimmed-2", 1, batches=3)
    with client.consumer(["trimmed-2"]) as consumer:
        assert consumer.assignment() == {("trimmed-2", 0): start, ("trimmed-2", 1): 0}
        got: dict[int, list[int]] = {0: [], 1: []}
        deadline = time.monotonic() + 30
        while (len(got[0]) < 400 - start or len(got[1]) < 30) and time.monotonic() < deadline:
            for message in consumer.poll(1.0):
                got[message.partition].append(message.offset)
        assert got == {0: list(range(start, 400)), 1: list(range(30))}

    produce(other, "trimmed-2", 1, batches=40)  # a backlog on the other partition
    with client.consumer(["trimmed-2"], max_bytes_per_partition=16 << 10) as consumer:
        consumer.seek("trimmed-2", 0, start - 1)  # below the log start now
        read_meanwhile = 0
        with pytest.raises(errors.AtomlogClientError) as refused:
            for _ in range(200):
                read_meanwhile += len(consumer.poll(1.0))
        assert read_meanwhile < 100  # (before: raised only once the backlog of 430 was read)
        assert refused.value.reason == "OFFSET_OUT_OF_RANGE"
        assert "trimmed-2-0" in str(refused.value)


def test_delete_records_bad_inputs(client, cluster):
    create_online(client, "trim-errors", 2)
    route = client.metadata.route("trim-errors", 0)
    stub = stub_at(client, route.address)
    produce(stub, "trim-errors", 0, batches=2)
    reply = stub.DeleteRecords(partition_pb2.DeleteRecordsRequest(items=[
        partition_pb2.DeleteRecordsItem(topic="trim-errors", partition=0, before_offset=21),
        partition_pb2.DeleteRecordsItem(topic="trim-errors", partition=0, before_offset=-1),
        partition_pb2.DeleteRecordsItem(topic="no-such-topic", partition=0, before_offset=0),
        partition_pb2.DeleteRecordsItem(topic="trim-errors", partition=9, before_offset=0),
        partition_pb2.DeleteRecordsItem(topic="", partition=0, before_offset=0),
        partition_pb2.DeleteRecordsItem(topic="trim-errors", partition=0, before_offset=20),
    ]), timeout=30)
    got = [(r.topic, r.partition, r.error.reason, r.log_start_offset) for r in reply.results]
    assert got == [("trim-errors", 0, "OFFSET_OUT_OF_RANGE", -1),
                   ("trim-errors", 0, "INVALID_ARGUMENT", -1),
                   ("no-such-topic", 0, "UNKNOWN_TOPIC_OR_PARTITION", -1),
                   ("trim-errors", 9, "UNKNOWN_TOPIC_OR_PARTITION", -1),
                   ("", 0, "INVALID_ARGUMENT", -1),
                   ("trim-errors", 0, "", 0)]  # one segment only: nothing to delete
    assert reply.results[0].error.metadata["high_watermark"] == "20"
    other = next(p for p in cluster.services()
                 if p["role"] == "partition_server" and p["name"] != route.server_name)
    elsewhere = delete(stub_at(client, other["grpc_address"]), "trim-errors", 0, 0)
    assert elsewhere.error.reason == "NOT_PARTITION_OWNER"
    assert elsewhere.error.metadata["owner_address"] == route.address
    assert whole_request_error(lambda: stub.DeleteRecords(
        partition_pb2.DeleteRecordsRequest(), timeout=30)) == "INVALID_ARGUMENT"
    # A wait for followers beyond 300 s: refused whole, nothing deleted.
    assert whole_request_error(lambda: stub.DeleteRecords(partition_pb2.DeleteRecordsRequest(
        items=[partition_pb2.DeleteRecordsItem(topic="trim-errors", partition=0,
                                               before_offset=20)],
        timeout_ms=300_001), timeout=30)) == "INVALID_ARGUMENT"
    assert describe(stub, "trim-errors", 0).high_watermark == 20


def test_a_server_whose_storage_fails_at_start_says_so_and_exits_2(cluster, tmp_path):
    """A partition server that cannot write its storage at start (a full disk, in the
    chaos harness; here a data directory under a file) crashed with a traceback (exit 1),
    which the harness and an operator read as a bug. It now logs a "cannot start" event
    with reason STORAGE_ERROR and where, and exits 2."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    info = cluster.info
    result = subprocess.run(
        [sys.executable, "-m", "services", "serve", "partition-server",
         "--set", f"zookeeper.hosts={info['zookeeper']}",
         "--set", "zookeeper.chroot=/storage-fails-at-start",  # (not the suite's cluster)
         "--set", f"server.data_dir={blocker / 'data'}", "--set", "server.name=ps-broken"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in (result.stdout + result.stderr).splitlines()
             if line.startswith("{")]
    said = [line for line in lines if line.get("msg") == "cannot start"]
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert said and said[-1]["reason"] == "STORAGE_ERROR"
    assert "Traceback" not in result.stderr
