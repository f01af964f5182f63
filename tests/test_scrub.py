"""The scrubber (partition_server/scrubber.py): copies nobody reads are read back from
disk and their damage is mended before the day they are needed.

Its pure parts (the pass's progress, a span's check over real segment files) run here
directly; the rest on a cluster of its own (a real ZooKeeper, three partition servers
scrubbing every second): a damaged byte in a follower's copy that no read touches is
found and that copy cut at the damage and fetched again; one in a leader's copy hands the
partition over, as a read finding it does; one in a partition's only copy takes it to
DATA_LOSS, which `atomlog partition recover` then mends."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import grpc
import pytest

from atomlog.v1.partition_pb2 import PARTITION_STATE_DATA_LOSS
from partition_server import scrubber
from partition_server.log import LogConfig, PartitionLog
from partition_server.record_batch import Record, encode_batch, iter_batches
from partition_server.scrubber import Pacer, ScrubProgress, _Reader, scrub_span
from spark_client import Client
from tests.conftest import CLUSTER_SETTINGS, Cluster, metric_sum, wait_until
from tests.test_replication import (flip_byte_in_batch, fully_in_sync, leader_of, metadata,
                                    read_all, segment_digests)

SCRUB_SETTINGS = ("--set", "partition.scrub_interval_ms=1000",
                  "--set", "partition.scrub_bytes_per_s=67108864")


# --- The pass's progress (pure) -------------------------------------------------------------

def test_a_pass_begins_after_its_interval_and_carries_on_where_it_stopped():
    progress = ScrubProgress(interval_ms=10_000)
    # No pass on record: the first waits a little after the start (the interval if less).
    assert progress.wait_ms(now_ms=1_000, up_ms=1_000) == 10_000
    assert progress.wait_ms(now_ms=11_000, up_ms=1_000) == 0
    progress.begin(11_000)
    assert progress.in_pass and progress.wait_ms(11_000, 1_000) == 0
    keys = {("b", 0), ("a", 1), ("a", 0)}
    assert progress.left(keys) == [("a", 0), ("a", 1), ("b", 0)]
    progress.copy_done(("a", 1))
    # A restart reads the record back and carries on after the last copy read.
    again = ScrubProgress.from_json(progress.to_json(), 10_000)
    assert again.in_pass and again.left(keys | {("a", 2)}) == [("a", 2), ("b", 0)]
    again.end(15_000)
    assert not again.in_pass and again.completed_ms == 15_000
    # The next pass begins an interval after this one began, at once if it took longer.
    assert again.wait_ms(now_ms=16_000, up_ms=0) == 5_000
    assert again.wait_ms(now_ms=30_000, up_ms=0) == 0
    again.begin(30_000)
    assert again.left(keys) == sorted(keys)


def test_a_progress_record_that_does_not_parse_is_no_record():
    for data in (b"", b"{", b"[]", b'{"started_unix_ms": "x"}', b'{"done_through": 3}'):
        progress = ScrubProgress.from_json(data, 5_000)
        assert progress.started_ms == 0 and not progress.in_pass


# --- A span's check over real files ---------------------------------------------------------

def written_log(directory: Path, batches: int, value_bytes: int = 300) -> PartitionLog:
    partition_log = PartitionLog(directory, LogConfig(segment_bytes=8_192))
    for i in range(batches):
        partition_log.append([encode_batch([Record(value=bytes([i % 251]) * value_bytes)])])
    partition_log.flush()
    return partition_log


def check(partition_log: PartitionLog):
    stop = threading.Event()
    reader, pacer = _Reader(), Pacer(1 << 30, stop)
    found = []
    for span in partition_log.segment_spans(partition_log.log_start_offset,
                                            partition_log.log_end_offset):
        failure = scrub_span(span, reader, pacer)
        if failure is not None:
            found.append((span.path.name, failure))
    return found


def test_a_span_check_finds_a_flipped_byte_and_only_that(tmp_path):
    partition_log = written_log(tmp_path / "p", 60)
    assert partition_log.segment_count >= 3
    assert check(partition_log) == []
    segment = sorted((tmp_path / "p").glob("*.log"))[1]
    position = flip_byte_in_batch(segment, 2)
    [(name, failure)] = check(partition_log)
    assert name == segment.name and failure.position == position
    assert "CRC32C mismatch" in failure.detail
    partition_log.close()


def test_a_span_check_reads_batches_larger_than_its_chunk_and_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(scrubber, "CHUNK", 1_000)  # every batch (1.3 KB) spans two reads
    partition_log = written_log(tmp_path / "p", 20, value_bytes=1_300)
    assert check(partition_log) == []
    monkeypatch.setattr(scrubber, "CHUNK", 5_000)  # chunks ending inside batches
    assert check(partition_log) == []
    segment = sorted((tmp_path / "p").glob("*.log"))[0]
    position = flip_byte_in_batch(segment, 4)
    [(_, failure)] = check(partition_log)
    assert failure.position == position
    partition_log.close()


def test_a_damaged_batch_length_is_found(tmp_path):
    """A length field damaged upwards makes the batch reach past the copy: found, not
    read on as a batch larger than a chunk."""
    partition_log = written_log(tmp_path / "p", 10)
    segment = sorted((tmp_path / "p").glob("*.log"))[0]
    position, header = list(iter_batches(segment.read_bytes()))[3]
    fd = os.open(segment, os.O_RDWR)
    try:
        os.pwrite(fd, (header.size + 50_000).to_bytes(4, "big"), position + 8)
    finally:
        os.close(fd)
    [(_, failure)] = check(partition_log)
    assert failure.position == position and "truncated batch" in failure.detail
    partition_log.close()


def test_a_span_check_calls_a_file_cut_short_truncated(tmp_path):
    partition_log = written_log(tmp_path / "p", 10)
    [span] = partition_log.segment_spans(0, partition_log.log_end_offset)
    os.truncate(span.path, span.end_position - 50)
    [(_, failure)] = check(partition_log)
    assert "truncated" in failure.detail
    partition_log.close()


# --- On a cluster ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scrubbing(tmp_path_factory):
    """A cluster of its own whose servers scrub every second."""
    cluster = Cluster(tmp_path_factory.mktemp("atomlog-scrub"))
    try:
        cluster.run("up", "--output", "json", *CLUSTER_SETTINGS, *SCRUB_SETTINGS)
        yield cluster
    finally:
        if (cluster.data_dir / "cluster.json").exists():
            cluster.run("down", check=False)


@pytest.fixture(scope="module")
def client(scrubbing):
    client = Client(scrubbing.info["bootstrap"])
    yield client
    client.close()


def scrub_metric(cluster, server: str, line_start: str) -> float:
    return metric_sum(cluster.process(server)["metrics_address"], line_start)


def damage(cluster, server: str, topic: str, partition: int, batch: int) -> Path:
    """Flip a byte in the `batch`th batch of `server`'s copy (of one segment); returns
    the segment file."""
    [segment] = sorted((cluster.data_dir / server / "partitions" / f"{topic}-{partition}")
                       .glob("*.log"))
    flip_byte_in_batch(segment, batch)
    return segment


def wait_copies_match(cluster, topic: str, partition: int, timeout_s: float, what: str) -> None:
    wait_until(lambda: len(set(segment_digests(cluster, topic, partition).values())) == 1,
               timeout_s, what)


def written(client, cluster, topic: str, factor: int, count: int = 40) -> None:
    client.create_topic(topic, partitions=1, replication_factor=factor,
                        config={"min.insync.replicas": "1"})
    wait_until(lambda: fully_in_sync(client, topic), 30, f"{topic} in sync")
    with client.producer(linger_ms=0) as producer:
        for i in range(count):
            producer.send(topic, f"s{i}".encode() * 50, partition=0).result(30)
    if factor > 1:
        wait_copies_match(cluster, topic, 0, 15, f"copies of {topic}-0 to match")


def test_every_copy_is_read_back_and_the_progress_kept(scrubbing, client):
    written(client, scrubbing, "scrub-progress", 3)
    for server in ("ps-0", "ps-1", "ps-2"):
        passes = scrub_metric(scrubbing, server, "atomlog_scrub_passes_total")
        wait_until(lambda: scrub_metric(scrubbing, server, "atomlog_scrub_passes_total") > passes,
                   30, f"a scrub pass of {server} after the writes")
        assert scrub_metric(scrubbing, server, "atomlog_scrub_bytes_total") > 40 * 100
        assert scrub_metric(scrubbing, server,
                            "atomlog_scrub_last_pass_completed_timestamp_seconds") > 0
        record = json.loads((scrubbing.data_dir / server / "scrub.json").read_text())
        assert record["completed_unix_ms"] > 0


def test_damage_in_a_followers_copy_nobody_reads_is_cut_and_fetched_again(scrubbing, client):
    """No read touches a follower's copy; the scrubber finds the flipped byte, the
    follower cuts its copy there and fetches the rest, and the copies end identical."""
    topic = "scrub-follower"
    written(client, scrubbing, topic, 3)
    part = metadata(client, topic).partitions[0]
    damaged = next(r for r in part.replicas if r != part.server_name)
    before = scrub_metric(scrubbing, damaged, 'atomlog_scrub_damage_found_total{copy="follower"}')
    damage(scrubbing, damaged, topic, 0, 10)
    assert len(set(segment_digests(scrubbing, topic, 0).values())) == 2
    wait_until(lambda: scrub_metric(scrubbing, damaged,
                                    'atomlog_scrub_damage_found_total{copy="follower"}') > before,
               30, f"the scrubber of {damaged} to find the damage")
    wait_copies_match(scrubbing, topic, 0, 30, f"the copies of {topic}-0 identical again")
    assert leader_of(client, topic, 0) == part.server_name  # the leader never noticed
    wait_until(lambda: fully_in_sync(client, topic), 30, f"{damaged} in the ISR")
    assert "follower log corrupt; cut at the damage" in \
        Path(scrubbing.process(damaged)["log_file"]).read_text()
    values = read_all(client, topic, 40)
    assert sorted(values.values()) == sorted(f"s{i}".encode() * 50 for i in range(40))


def test_damage_in_a_leaders_copy_nobody_reads_hands_the_partition_over(scrubbing, client):
    topic = "scrub-leader"
    written(client, scrubbing, topic, 3)
    part = metadata(client, topic).partitions[0]
    damaged, epoch = part.server_name, part.leader_epoch
    damage(scrubbing, damaged, topic, 0, 10)
    wait_until(lambda: leader_of(client, topic, 0) not in ("", damaged), 30,
               f"a leader of {topic}-0 other than {damaged}")
    assert metadata(client, topic).partitions[0].leader_epoch > epoch
    assert scrub_metric(scrubbing, damaged, 'atomlog_scrub_damage_found_total{copy="leader"}') >= 1
    wait_until(lambda: fully_in_sync(client, topic), 30, f"{damaged} back in the ISR")
    wait_copies_match(scrubbing, topic, 0, 30, f"the copies of {topic}-0 identical again")
    values = read_all(client, topic, 40)
    assert sorted(values.values()) == sorted(f"s{i}".encode() * 50 for i in range(40))


def test_damage_in_a_partitions_only_copy_takes_it_to_data_loss(scrubbing, client):
    topic = "scrub-alone"
    written(client, scrubbing, topic, 1)
    server = metadata(client, topic).partitions[0].server_name
    segment = damage(scrubbing, server, topic, 0, 10)
    wait_until(lambda: client.describe_partition(topic, 0).state == PARTITION_STATE_DATA_LOSS,
               30, f"{topic}-0 in DATA_LOSS")
    loss = json.loads((segment.parent / "data-loss.json").read_text())
    assert "found by the scrubber" in loss["detail"] and loss["offset"] == 10


# --- An operator's scrub now (PartitionService.ScrubPartition, `atomlog partition scrub`),
# on the suite's shared cluster, which has no background passes ---------------------------

@pytest.fixture(scope="module")
def shared_client(cluster):
    client = Client(cluster.info["bootstrap"])
    yield client
    client.close()


def test_scrubbing_a_partition_now_finds_and_mends_a_damaged_copy(cluster, shared_client):
    topic = "scrub-now"
    written(shared_client, cluster, topic, 3)
    part = metadata(shared_client, topic).partitions[0]
    whole = json.loads(cluster.run("partition", "scrub", topic, "0", "--output", "json").stdout)
    assert sorted(r["server"] for r in whole) == sorted(part.replicas)
    assert sorted(r["role"] for r in whole) == ["follower", "follower", "leader"]
    assert all("damage" not in r and int(r["bytes_checked"]) > 40 * 100 for r in whole)
    damaged = next(r for r in part.replicas if r != part.server_name)
    damage(cluster, damaged, topic, 0, 10)
    found = cluster.run("partition", "scrub", topic, "0", check=False)
    assert found.returncode == 1
    [line] = [line for line in found.stdout.splitlines()
              if line.startswith(f"{topic}-0 on {damaged}")]
    assert "follower copy" in line and "DAMAGED at offset 10" in line and "acted on" in line
    assert found.stdout.count(", whole") == 2
    wait_copies_match(cluster, topic, 0, 30, f"the copies of {topic}-0 identical again")
    wait_until(lambda: fully_in_sync(shared_client, topic), 30, f"{damaged} back in the ISR")
    assert cluster.run("partition", "scrub", topic, "0").stdout.count(", whole") == 3
    values = read_all(shared_client, topic, 40)
    assert sorted(values.values()) == sorted(f"s{i}".encode() * 50 for i in range(40))


def test_scrub_partition_refuses_what_it_cannot_read_and_changes_nothing(cluster, shared_client):
    from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc
    from services.errors import from_rpc_error

    topic = "scrub-now-alone"
    written(shared_client, cluster, topic, 1)
    holder = metadata(shared_client, topic).partitions[0].server_name
    other = next(p for p in cluster.info["processes"]
                 if p["role"] == "partition_server" and p["name"] != holder)

    def refused(request) -> str:
        stub = partition_pb2_grpc.PartitionServiceStub(grpc.insecure_channel(other["grpc_address"]))
        with pytest.raises(grpc.RpcError) as raised:
            stub.ScrubPartition(request, timeout=10)
        return from_rpc_error(raised.value).reason

    assert refused(partition_pb2.ScrubPartitionRequest()) == "INVALID_ARGUMENT"
    assert refused(partition_pb2.ScrubPartitionRequest(topic_partition=common_pb2.TopicPartition(
        topic=topic, partition=0))) == "UNKNOWN_TOPIC_OR_PARTITION"
    for args in ((topic, "7"), ("scrub-no-such-topic",), ("--server", "ps-9"), ()):
        missing = cluster.run("partition", "scrub", *args, check=False)
        assert missing.returncode == 1 and missing.stderr, args
    # Nothing changed: the one copy reads back whole, and serves.
    [result] = json.loads(cluster.run("partition", "scrub", topic, "0", "--output", "json").stdout)
    assert result["server"] == holder and result["role"] == "leader" and "damage" not in result
    assert len(read_all(shared_client, topic, 40)) == 40


def test_scrubbing_every_copy_a_server_holds(cluster, shared_client):
    """After a disk incident on one server: `--server` reads every copy it holds (of
    every topic), and only those; the damaged one is found and mended."""
    topic = "scrub-server"
    shared_client.create_topic(topic, partitions=3, replication_factor=3,
                               config={"min.insync.replicas": "1"})
    wait_until(lambda: fully_in_sync(shared_client, topic), 30, f"{topic} in sync")
    with shared_client.producer(linger_ms=0) as producer:
        for i in range(30):
            producer.send(topic, f"v{i}".encode() * 40, partition=i % 3).result(30)
    server = "ps-1"
    wait_copies_match(cluster, topic, 2, 15, f"copies of {topic}-2 to match")
    damage(cluster, server, topic, 2, 4)
    found = cluster.run("partition", "scrub", "--server", server, "--output", "json",
                        check=False)
    assert found.returncode == 1
    results = json.loads(found.stdout)
    assert {r["server"] for r in results} == {server}
    mine = {(r["topic"], r["partition"]): r for r in results if r["topic"] == topic}
    assert sorted(mine) == [(topic, 0), (topic, 1), (topic, 2)]
    assert "damage" not in mine[(topic, 0)] and "damage" not in mine[(topic, 1)]
    assert mine[(topic, 2)]["damage"]["acted_on"] and mine[(topic, 2)]["damage"]["offset"] == "4"
    # (Other tests' topics on this shared cluster are read too; their state is theirs.)
    wait_copies_match(cluster, topic, 2, 30, f"the copies of {topic}-2 identical again")
    wait_until(lambda: fully_in_sync(shared_client, topic), 30, f"{topic} in sync again")
    assert cluster.run("partition", "scrub", topic).stdout.count(", whole") == 9
