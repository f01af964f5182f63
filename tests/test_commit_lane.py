"""The commit lane (coordinator/lane.py) on a real combined server: one-call commits whose
partitions the process hosts are begun, staged on the owners and decided in event-loop
callbacks, with no StageTxn, their markers riding on the next group's stages; whatever
the lane cannot do goes on, unchanged, on the ordinary path (the staging channel). The
module's combined server runs with failpoints on, so a commit can be held between
staging and its decision and the process killed there."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from atomlog.v1 import common_pb2, partition_pb2

from partition_server.record_batch import Record, encode_batch
from spark_client import Client
from tests.conftest import Cluster, create_online, metric_sum, wait_until
from services import failpoints, launcher
from tests.test_one_call import (
    Armed,
    _commit_txn,
    _key_on,
    committed_values,
    conflicting_ack_changes_nothing,
    failpoint_cluster,
    kill_and_restart,
    killed_between_staging_and_decision_commits_once,
    restart,
    settled,
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def failpoint_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lane-failpoints")


@pytest.fixture(scope="module", params=[True, False], ids=["one-round", "two-rounds"])
def one_round(request) -> bool:
    """coordinator.lane_one_round: a group's decisions in its stages' write-ahead round
    (the default), or in a round after them."""
    return request.param


@pytest.fixture(scope="module")
def node(tmp_path_factory, failpoint_dir, one_round):
    """A combined server with failpoints on (armed by files in `failpoint_dir`)."""
    yield from failpoint_cluster(tmp_path_factory.mktemp("atomlog-lane"), failpoint_dir,
                                 "--set", f"coordinator.lane_one_round={one_round}",
                                 combined=True)


@pytest.fixture(scope="module")
def client(node):
    with Client(node.info["bootstrap"], request_timeout_s=10) as client:
        warm(client, create_online(client, "lane-warm", 1))
        yield client


def metrics_address(node: Cluster) -> str:
    return next(p for p in node.info["processes"] if p["role"] == "combined")[
        "metrics_address"]


def lane(node: Cluster, result: str) -> float:
    return metric_sum(metrics_address(node),
                      f'atomlog_coordinator_lane_commits_total{{result="{result}"}}')


def stage_calls(node: Cluster) -> float:
    return metric_sum(metrics_address(node), 'atomlog_local_calls_total{method="/atomlog.v1.'
                      'PartitionService/StageTxn"}')


def warm(client, topic: str, count: int = 200) -> None:
    """One-call commits until every TC partition has (all but surely: 16 of them, keys
    drawn at random) logged its sequence reservation; a TC partition's first one-call
    commit waits for it, on the ordinary path. Once, for the module (`client`): the kill
    test, which reloads every TC partition, comes last."""
    with client.producer() as producer:
        for i in range(count):
            with client.transaction(timeout_s=30) as txn:
                producer.send(topic, b"warm-%d" % i, partition=0, txn=txn)


def one_round_commits(node: Cluster) -> float:
    return metric_sum(metrics_address(node), "atomlog_coordinator_lane_one_round_commits_total")


def test_one_call_commits_go_through_the_lane_exactly_once_in_order(node, client, one_round):
    topic = create_online(client, "lane-order", 4)
    decided, reserved = lane(node, "decided"), lane(node, "reservation")
    in_round = one_round_commits(node)
    staged_calls = stage_calls(node)
    riding = metric_sum(metrics_address(node), "atomlog_coordinator_riding_markers_total")
    riders_in_step = metric_sum(metrics_address(node),
                                "atomlog_coordinator_lane_riders_confirmed_in_step_total")
    errors: list = []

    def commits(worker: int) -> None:
        try:
            with client.producer() as producer:
                for i in range(40):
                    with client.transaction(timeout_s=30) as txn:
                        for partition in range(4):
                            producer.send(topic, b"w%d-%03d" % (worker, i),
                                          partition=partition, txn=txn)
        except Exception as error:  # noqa: BLE001 — reported below
            errors.append(error)

    threads = [threading.Thread(target=commits, args=(worker,)) for worker in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    # Every commit went through the lane (the warm-up leaves, all but surely, no TC
    # partition whose first commit waits for its reservation on the ordinary path).
    handed_back = lane(node, "reservation") - reserved
    assert lane(node, "decided") - decided + handed_back == 120
    assert handed_back <= 1
    assert stage_calls(node) - staged_calls == handed_back  # no staging call otherwise
    # One round: most commits the lane decided were decided in their group's step;
    # else none. (A group meets an owner whose snapshot is due, or whose own write's
    # flush is still on its way, now and then: 0-5 of 120 on a quiet machine, and 29 of
    # 120 once beside test_spark on a machine loaded eight times over; what this checks
    # is that the step decides at all, which a broken one-round path would make 0.)
    # And the markers riding in a group's step were confirmed there (written before the
    # Completed records they lead to), all but a few.
    confirmed_in_step = metric_sum(
        metrics_address(node), "atomlog_coordinator_lane_riders_confirmed_in_step_total")
    if one_round:
        assert one_round_commits(node) - in_round >= (lane(node, "decided") - decided) / 2
        assert confirmed_in_step - riders_in_step > 0
    else:
        assert one_round_commits(node) == in_round == 0
        assert confirmed_in_step == riders_in_step == 0
    # The markers of a worker's commit rode with its next commit's stages.
    assert metric_sum(metrics_address(node), "atomlog_coordinator_riding_markers_total") \
        > riding
    wait_until(lambda: settled(client, topic, 4), 20, "every marker to land")
    with client.consumer([topic], isolation="read_committed", start="earliest") as consumer:
        found: dict[int, list[bytes]] = {}
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 0.5:
            for message in consumer.poll(timeout_s=0.1, max_records=10_000):
                found.setdefault(message.partition, []).append(message.value)
                quiet_since = time.monotonic()
    for partition in range(4):
        values = found[partition]
        assert sorted(values) == sorted(b"w%d-%03d" % (w, i) for w in range(3)
                                        for i in range(40))
        for worker in range(3):  # each producer's commits in its order
            mine = [v for v in values if v.startswith(b"w%d-" % worker)]
            assert mine == sorted(mine)


def test_a_batch_the_lane_cannot_stage_is_refused_on_the_ordinary_path(node, client):
    topic = create_online(client, "lane-refused", 2)
    restaged = lane(node, "restage")
    key = _key_on(0, client.metadata.tc_partition_count)
    good = encode_batch([Record(None, b"x", (), 0)])
    corrupt = bytearray(good)
    corrupt[-1] ^= 0xFF  # the CRC no longer matches: the owner's checks refuse it
    error = _commit_txn(client, tc_partition=0, idempotency_key=key, batches=[
        partition_pb2.ProduceItem(topic_partition=common_pb2.TopicPartition(
            topic=topic, partition=1), record_batch=good),
        partition_pb2.ProduceItem(topic_partition=common_pb2.TopicPartition(
            topic=topic, partition=0), record_batch=bytes(corrupt))])
    assert error.reason == "CRC_MISMATCH", error
    assert lane(node, "restage") == restaged + 1
    wait_until(lambda: settled(client, topic, 2), 10, "nothing left open")
    assert committed_values(client, topic) == []


def test_acks_go_through_the_lane_and_apply_with_the_commit(node, client):
    source = create_online(client, "lane-in", 1)
    sink = create_online(client, "lane-out", 2)
    with client.producer() as producer:
        for i in range(20):
            producer.send(source, f"in{i}".encode(), partition=0)
        producer.flush()
    decided, staged_calls = lane(node, "decided"), stage_calls(node)
    handed_back = lane(node, "reservation")
    with client.consumer(source, subscription="lane", ack_timeout_s=60) as consumer, \
            client.producer() as producer:
        done = 0
        while done < 20:
            for message in consumer.poll(timeout_s=1.0):
                with client.transaction(timeout_s=30) as txn:
                    producer.send(sink, message.value.replace(b"in", b"out"),
                                  partition=done % 2, txn=txn)
                    consumer.ack([message], txn=txn)
                done += 1
        wait_until(lambda: consumer.describe()[0].cumulative_end_offset == 20, 10,
                   "every ack applied by its commit's marker")
        assert not consumer.describe()[0].pending_acks
    handed_back = lane(node, "reservation") - handed_back
    assert lane(node, "decided") - decided + handed_back == 20
    assert stage_calls(node) - staged_calls == handed_back
    wait_until(lambda: settled(client, sink, 2), 20, "every marker to land")
    assert sorted(committed_values(client, sink)) == sorted(f"out{i}".encode()
                                                            for i in range(20))


def test_a_conflicting_ack_in_the_lane_aborts_and_changes_nothing(node, client):
    decided = lane(node, "decided")

    def refused() -> None:  # decided (to abort) in the lane
        assert lane(node, "decided") == decided + 1

    conflicting_ack_changes_nothing(client, node.info["bootstrap"],
                                    create_online(client, "lane-conflict-in", 1),
                                    create_online(client, "lane-conflict-out", 1), "lane-c",
                                    refused)


def test_killed_between_staging_and_decision_the_lane_commit_is_presumed_aborted(
        node, client, failpoint_dir):
    held_before = lane(node, "failpoint")

    def kill(held, staged) -> None:
        # Staged by the lane, which hands the decision to the ordinary path, held there.
        # The stages show on the partitions before they are durable, and the lane hands
        # the commit back only once they are: waited for, not read at once.
        wait_until(lambda: lane(node, "failpoint") == held_before + 1, 10,
                   "the lane to hand the held decision back")
        kill_and_restart(node, "node-0", held)

    killed_between_staging_and_decision_commits_once(
        client, create_online(client, "lane-presumed", 2), failpoint_dir, kill)


class _Committers:
    """Three client threads in a loop of one-call commits of one value on each of a
    topic's four partitions, each commit's outcome noted (acknowledged, or failed)."""

    def __init__(self, node: Cluster, topic: str):
        self.node, self.topic = node, topic
        self.acked: list[bytes] = []
        self.failed: list[bytes] = []
        self.errors: list = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._commits, args=(worker,))
                        for worker in range(3)]
        for thread in self.threads:
            thread.start()

    def _commits(self, worker: int) -> None:
        try:
            with Client(self.node.info["bootstrap"], request_timeout_s=5) as own, \
                    own.producer() as producer:
                i = 0
                while not self.stop.is_set():
                    value = b"f%d-%05d" % (worker, i)
                    i += 1
                    try:
                        with own.transaction(timeout_s=30) as txn:
                            for partition in range(4):
                                producer.send(self.topic, value, partition=partition,
                                              txn=txn)
                    except Exception:  # noqa: BLE001 — its outcome is checked below
                        self.failed.append(value)
                        time.sleep(0.2)
                        continue
                    self.acked.append(value)
        except Exception as error:  # noqa: BLE001 — reported below
            self.errors.append(error)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def check(self, client: Client) -> None:
        """Every acknowledged commit read exactly once on each of the four partitions, a
        failed one on all four or on none, and no transaction left open."""
        assert not self.errors, self.errors
        topic, acked, failed = self.topic, self.acked, self.failed
        wait_until(lambda: settled(client, topic, 4), 60, "every partition to settle")
        read: dict[int, list[bytes]] = {partition: [] for partition in range(4)}
        with client.consumer([topic], isolation="read_committed",
                             start="earliest") as consumer:
            quiet_since = time.monotonic()
            while time.monotonic() - quiet_since < 1.0:
                for message in consumer.poll(timeout_s=0.1, max_records=10_000):
                    read[message.partition].append(message.value)
                    quiet_since = time.monotonic()
        for partition in range(4):
            values = read[partition]
            assert len(values) == len(set(values)), f"a value twice on partition {partition}"
            assert set(acked) <= set(values), sorted(set(acked) - set(values))[:5]
            assert set(values) == set(read[0]), "a commit read on some partitions only"
            assert set(values) <= set(acked) | set(failed)


def test_a_full_disk_reloads_partitions_under_one_call_commits_and_splits_none(
        node, client, failpoint_dir, one_round):
    """One-call commits from three clients while every recovery-point write fails with
    ENOSPC for a moment (a full disk; the write-ahead file's segments are preallocated,
    so its rounds go on). The partitions concerned fail closed and reload, retrying
    until the disk has room; one with a write of the commit lane's step above its high
    watermark reloads keeping it, where before this stopped the server. The server
    never stops, and every acknowledged commit is read exactly once on each of its four
    partitions, none in part."""
    topic = create_online(client, "lane-full", 4)
    process = node.process("node-0")
    log_file = Path(process["log_file"])
    log_before = len(log_file.read_text(errors="replace"))
    committers = _Committers(node, topic)

    def logged() -> str:
        return log_file.read_text(errors="replace")[log_before:]

    kept = "keeping a write of the commit lane's step"
    try:
        wait_until(lambda: len(committers.acked) >= 30, 30, "commits before the failure")
        # In bursts: each partition fails closed at its first recovery-point write, and
        # (one round) the lane's write is above its high watermark then or not, as the
        # timing has it; a burst more, until one is (at most ten). The disk is slow
        # meanwhile (30 ms a sync, 20 ms before a recovery-point write fails), so most
        # failures come while the next write-ahead round is under way: without that, a
        # loaded machine (CI) saw none in ten bursts.
        for burst in range(10):
            reloads = logged().count("reloading")
            (failpoint_dir / failpoints.FSYNC_SLOW).write_text("30")
            (failpoint_dir / failpoints.RECOVERY_POINT_WRITE).write_text("20")
            with Armed(failpoint_dir, failpoints.FSYNC_SLOW), \
                    Armed(failpoint_dir, failpoints.RECOVERY_POINT_WRITE):
                wait_until(lambda: logged().count("reloading") > reloads, 30,
                           "a partition to fail closed")
                time.sleep(0.3)
            going_on = len(committers.acked)
            wait_until(lambda: len(committers.acked) >= going_on + 20, 90,
                       "commits after the failure")
            if kept in logged() or (burst and not one_round):
                break
    finally:
        committers.finish()
    assert launcher.process_alive(process["pid"], "--name node-0 ")
    assert "stopping: the write-ahead file failed" not in logged()
    if one_round:  # (a partition's lane write above its high watermark, kept)
        assert kept in logged()
    committers.check(client)


def test_a_failed_write_ahead_round_loses_no_commit_and_splits_none(
        node, client, failpoint_dir, one_round):
    """One-call commits from three clients while every fsync fails for a moment (the
    fsync failpoint). One round a commit: a failed round that carried the lane's stages
    and decisions stops the server (exit status 74, its reason logged), which is started
    again and repairs itself from its write-ahead file. Two rounds: the partitions
    concerned reload and the server goes on. Either way every acknowledged commit is
    read exactly once on each of its four partitions, a commit that failed is read on
    all four or on none, and no transaction is left open. (Last in the module: the
    restart reloads every TC partition.)"""
    topic = create_online(client, "lane-fsync", 4)
    process = node.process("node-0")
    committers = _Committers(node, topic)
    acked, failed = committers.acked, committers.failed
    try:
        wait_until(lambda: len(acked) >= 30, 30, "commits before the failure")
        def stopped() -> bool:
            return not launcher.process_alive(process["pid"], "--name node-0 ")

        before = len(failed)
        with Armed(failpoint_dir, failpoints.FSYNC):
            # (One round: all but surely a stop, as a round under the lane's frames fails
            # first; a failed checkpoint found none in flight if its partitions reloaded
            # first, and then nothing of theirs is written in the lane's step.)
            wait_until(lambda: stopped() or len(failed) > before, 30,
                       "the server to stop or a commit to fail")
            time.sleep(0.5)
        if stopped():
            assert one_round
            log_text = Path(process["log_file"]).read_text(errors="replace")
            assert "stopping: the write-ahead file failed" in log_text
            assert "node-0" in restart(node)
        going_on = len(acked)
        wait_until(lambda: len(acked) >= going_on + 30, 90, "commits after the failure")
    finally:
        committers.finish()
    committers.check(client)
