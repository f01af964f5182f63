"""Replicated subscription cursors with real processes (issue 21, docs/replication.md,
"Cursors"): on the suite's cluster (three partition servers, 3 s ZooKeeper sessions), a
subscription of a factor-3 topic keeps its acknowledgements through a kill -9 of the
leader (the new leader redelivers exactly what was not acknowledged), transactional acks
— committed ones and ones still pending when the leader dies — survive the failover, a
follower whose data directory was wiped rebuilds its cursors from the leader and can then
serve them alone, an ack still works with a follower dead past the ISR shrink
(min.insync.replicas 2), and with too few in-sync replicas an ack is refused and changes
nothing."""

from __future__ import annotations

import shutil
import time

import pytest

from spark_client import Client, errors
from tests.conftest import SESSION_TIMEOUT_MS, wait_until
from tests.test_replication import (fully_in_sync, kill, leader_of, metadata, restart_all,
                                    server_metric)

pytestmark = pytest.mark.cluster

SERVERS = ("ps-0", "ps-1", "ps-2")
FAILOVER_S = SESSION_TIMEOUT_MS / 1000 + 10


@pytest.fixture(scope="module")
def client(cluster):
    client = Client(cluster.info["bootstrap"])
    yield client
    client.close()


@pytest.fixture(scope="module")
def streaming(cluster, client):
    """Transactions without one-call buffering: a transactional ack reaches the server
    (pending on the cursor) when made. The bootstrap is one server, which the test before
    may have just restarted: its port opens a little after it rejoins the ISR."""
    streaming = Client(cluster.info["bootstrap"], one_call_max_bytes=0)

    def bootstrapped() -> bool:
        try:
            streaming.list_topics()
            return True
        except errors.AtomlogClientError:
            return False

    wait_until(bootstrapped, 30, "the bootstrap server to answer")
    yield streaming
    streaming.close()


def produce(client: Client, topic: str, count: int, first: int = 0) -> None:
    with client.producer(linger_ms=2) as producer:
        futures = [producer.send(topic, f"m{i}".encode(), partition=0)
                   for i in range(first, first + count)]
        producer.flush()
        assert [f.result(60).offset for f in futures] == list(range(first, first + count))


def receive(consumer, expected: int, timeout_s: float = 30, settle_s: float = 1.5) -> list:
    """Poll until `expected` messages came, then a little longer (anything more is a
    redelivery the test must see); the messages by offset."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while len(seen) < expected and time.monotonic() < deadline:
        seen += consumer.poll(timeout_s=1.0, max_records=1_000)
    settle = time.monotonic() + settle_s
    while time.monotonic() < settle:
        seen += consumer.poll(timeout_s=0.5, max_records=1_000)
    return sorted(seen, key=lambda message: message.offset)


def offsets(messages) -> list[int]:
    return [message.offset for message in messages]


def new_leader_after_killing(cluster, client: Client, topic: str) -> tuple[str, str]:
    victim = leader_of(client, topic, 0)
    kill(cluster, victim)
    wait_until(lambda: leader_of(client, topic, 0) not in ("", victim), FAILOVER_S,
               f"a leader of {topic}-0 other than {victim}")
    return victim, leader_of(client, topic, 0)


def cursor(consumer):
    [described] = consumer.describe()
    assert not described.error.reason, described.error
    return described


def test_followers_copy_acks_on_their_links_thread(cluster, client):
    """A follower's answer that carries cursor frames (acks) is copied on the replication
    link's thread, as records are (docs/replication.md, "Rounds on the link's thread"),
    not handed back to the event loop, whose rounds prepare and compare every partition
    the follower copies from that leader. With min.insync.replicas 3 each ack is answered
    only once both followers hold it durably, so every one of these acks was copied
    there; before, each was one event-loop round on each follower."""
    topic = "cur-link-thread"
    client.create_topic(topic, partitions=1, replication_factor=3,
                        config={"min.insync.replicas": "3"})
    wait_until(lambda: fully_in_sync(client, topic), 15, f"{topic} in sync")
    produce(client, topic, 40)
    consumer = client.consumer(topic, subscription="s", ack_timeout_s=60)
    messages = receive(consumer, 40, settle_s=0.5)
    assert offsets(messages) == list(range(40))
    leader = leader_of(client, topic, 0)
    followers = [s for s in SERVERS if s != leader]
    loop_rounds = "atomlog_replica_fetch_loop_rounds_total"
    calls = "atomlog_replica_fetch_calls_total"
    before = {s: (server_metric(cluster, s, loop_rounds), server_metric(cluster, s, calls))
              for s in followers}
    for message in messages:
        consumer.ack([message])  # one at a time: each its own cursor frame and round
    assert cursor(consumer).cumulative_end_offset == 40
    consumer.close()
    grew = {s: (server_metric(cluster, s, loop_rounds) - before[s][0],
                server_metric(cluster, s, calls) - before[s][1]) for s in followers}
    assert all(called >= 40 for _rounds, called in grew.values()), grew
    assert sum(rounds for rounds, _called in grew.values()) < 10, grew


def test_acknowledged_messages_are_not_redelivered_after_kill_9_of_the_leader(cluster, client):
    topic = "cur-kill"
    client.create_topic(topic, partitions=1, replication_factor=3)
    wait_until(lambda: fully_in_sync(client, topic), 15, f"{topic} in sync")
    produce(client, topic, 100)
    consumer = client.consumer(topic, subscription="s", ack_timeout_s=60)
    messages = receive(consumer, 100)
    assert offsets(messages) == list(range(100))
    consumer.ack(messages[:60])  # answered: durable on every in-sync replica
    consumer.ack([messages[70], messages[75]])
    acked = set(range(60)) | {70, 75}
    consumer.close()
    try:
        victim, leader = new_leader_after_killing(cluster, client, topic)
        consumer = client.consumer(topic, subscription="s", ack_timeout_s=60)
        described = cursor(consumer)
        assert described.cumulative_end_offset == 60
        assert [(r.start_offset, r.end_offset) for r in described.individual_ranges] == \
            [(70, 71), (75, 76)]
        again = receive(consumer, 100 - len(acked))
        assert offsets(again) == [o for o in range(100) if o not in acked], (victim, leader)
        consumer.ack(again)  # the new leader acknowledges with the old one still dead
        assert cursor(consumer).cumulative_end_offset == 100
        consumer.close()
    finally:
        restart_all(cluster)
    wait_until(lambda: fully_in_sync(client, topic), 30, f"{victim} to rejoin the ISR")
    consumer = client.consumer(topic, subscription="s")
    assert receive(consumer, 0, settle_s=2) == []  # nothing left, on any leader
    consumer.close()


def test_transactional_acks_survive_a_failover(cluster, streaming):
    topic, output = "cur-txn", "cur-txn-out"
    streaming.create_topic(topic, partitions=1, replication_factor=3)
    streaming.create_topic(output, partitions=1, replication_factor=3)
    wait_until(lambda: fully_in_sync(streaming, topic) and fully_in_sync(streaming, output),
               15, "topics in sync")
    produce(streaming, topic, 50)
    consumer = streaming.consumer(topic, subscription="t", ack_timeout_s=120)
    messages = receive(consumer, 50)
    with streaming.producer(linger_ms=1) as producer:
        with streaming.transaction(timeout_s=120) as committed:  # acks 0..29
            for message in messages[:30]:
                producer.send(output, message.value, partition=0, txn=committed)
            consumer.ack(messages[:30], txn=committed)
        wait_until(lambda: cursor(consumer).cumulative_end_offset == 30, 15,
                   "the commit marker on the subscription")
        # Open while the leader dies: its acks are pending on the cursor only.
        pending = streaming.begin_transaction(120)
        for message in messages[30:40]:
            producer.send(output, message.value, partition=0, txn=pending)
        consumer.ack(messages[30:40], txn=pending)
        assert len(cursor(consumer).pending_acks) == 1
        consumer.close()
        try:
            victim, leader = new_leader_after_killing(cluster, streaming, topic)
            # The victim comes back as a follower (the suite's __txn_log has one copy:
            # the coordinator may need it to commit); the new leader keeps leading.
            restart_all(cluster)
            assert leader_of(streaming, topic, 0) == leader
            pending.commit()  # its marker reaches the new leader
            consumer = streaming.consumer(topic, subscription="t", ack_timeout_s=120)
            wait_until(lambda: cursor(consumer).cumulative_end_offset == 40, 30,
                       "the pending acks to be committed on the new leader")
            assert not cursor(consumer).pending_acks
            again = receive(consumer, 10)
            assert offsets(again) == list(range(40, 50))
            consumer.close()
        finally:
            restart_all(cluster)
    wait_until(lambda: fully_in_sync(streaming, topic), 30, f"{victim} to rejoin")


def test_a_wiped_follower_rebuilds_its_cursors_and_then_serves_them_alone(cluster, client):
    topic = "cur-wipe"
    client.create_topic(topic, partitions=1, replication_factor=3)
    wait_until(lambda: fully_in_sync(client, topic), 15, f"{topic} in sync")
    produce(client, topic, 40)
    consumer = client.consumer(topic, subscription="w", ack_timeout_s=120)
    messages = receive(consumer, 40)
    consumer.ack(messages[:20])
    part = metadata(client, topic).partitions[0]
    wiped = next(r for r in part.replicas if r != part.server_name)
    kill(cluster, wiped)
    shutil.rmtree(cluster.data_dir / wiped / "partitions" / f"{topic}-0")
    began = time.monotonic()
    consumer.ack(messages[20:30])  # answered once the dead follower left the ISR
    print(f"ack with a dead in-sync follower answered after {time.monotonic() - began:.2f} s")
    assert wiped not in metadata(client, topic).partitions[0].isr
    consumer.close()
    restart_all(cluster)
    # Rejoining the ISR needs the cursors too: the rebuilt follower holds every ack.
    wait_until(lambda: fully_in_sync(client, topic), 30, f"{wiped} to catch up")
    assert (cluster.data_dir / wiped / "partitions" / f"{topic}-0" / "cursors").is_dir()
    others = [r for r in SERVERS if r != wiped]
    try:
        for other in others:
            kill(cluster, other)
            wait_until(lambda: leader_of(client, topic, 0) not in ("", other), FAILOVER_S,
                       f"a leader other than {other}")
        assert leader_of(client, topic, 0) == wiped
        consumer = client.consumer(topic, subscription="w", ack_timeout_s=120)
        assert cursor(consumer).cumulative_end_offset == 30
        assert offsets(receive(consumer, 10)) == list(range(30, 40))
        # Alone, below min.insync.replicas: an ack is refused and changes nothing. (While
        # the ISR still names a dead follower the check passes; the ack is then applied
        # and refused once the ISR shrinks, with applied_on_leader — not this case.)
        wait_until(lambda: list(metadata(client, topic).partitions[0].isr) == [wiped],
                   FAILOVER_S, f"the ISR of {topic} to shrink to {wiped}")
        with pytest.raises(errors.AtomlogClientError) as refused:
            consumer.ack(messages[30:31])
        assert refused.value.reason == "NOT_ENOUGH_REPLICAS"
        assert cursor(consumer).cumulative_end_offset == 30
        assert not cursor(consumer).individual_ranges
        consumer.close()
    finally:
        restart_all(cluster)
    wait_until(lambda: fully_in_sync(client, topic), 30, f"{topic} back in sync")


def test_an_ack_made_with_a_follower_out_of_the_isr_survives_the_next_failover(cluster, client):
    """min.insync.replicas 2 of 3: a dead follower leaves the ISR and acks go on; once it
    is back in the ISR it holds them, whoever leads next."""
    topic = "cur-shrink"
    client.create_topic(topic, partitions=1, replication_factor=3)
    wait_until(lambda: fully_in_sync(client, topic), 15, f"{topic} in sync")
    produce(client, topic, 30)
    consumer = client.consumer(topic, subscription="k", ack_timeout_s=120)
    messages = receive(consumer, 30)
    part = metadata(client, topic).partitions[0]
    dead = next(r for r in part.replicas if r != part.server_name)
    kill(cluster, dead)
    try:
        wait_until(lambda: dead not in metadata(client, topic).partitions[0].isr, FAILOVER_S,
                   f"{dead} to leave the ISR")
        consumer.ack(messages[:10])
        assert cursor(consumer).cumulative_end_offset == 10
    finally:
        restart_all(cluster)
    wait_until(lambda: fully_in_sync(client, topic), 30, f"{dead} back in the ISR")
    consumer.close()
    try:
        # The follower that was dead may be the one elected now: it must have the acks.
        _victim, _leader = new_leader_after_killing(cluster, client, topic)
        consumer = client.consumer(topic, subscription="k", ack_timeout_s=120)
        assert cursor(consumer).cumulative_end_offset == 10
        assert offsets(receive(consumer, 20)) == list(range(10, 30))
        consumer.close()
    finally:
        restart_all(cluster)
    wait_until(lambda: fully_in_sync(client, topic), 30, f"{topic} back in sync")
