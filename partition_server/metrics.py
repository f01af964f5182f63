"""Prometheus metrics of the partition server. Labels are bounded: `topic` (operators
bound the number of topics) — never a partition, producer or transaction id."""

from __future__ import annotations

import time
from typing import Callable, Iterable

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.fastmetrics import Counter, Histogram
from services.metrics import LATENCY_BUCKETS_SECONDS

BYTES_IN = Counter("atomlog_partition_bytes_in_total", "Bytes of record batches appended.",
                   ["topic"])
RECORDS_IN = Counter("atomlog_partition_records_in_total", "Records appended.", ["topic"])
BYTES_OUT = Counter("atomlog_partition_bytes_out_total", "Bytes of record batches fetched.",
                    ["topic"])
RECORDS_OUT = Counter("atomlog_partition_records_out_total",
                      "Records fetched (counted from batch headers) and delivered to "
                      "subscriptions' consumers (Receive; redeliveries too).", ["topic"])
APPEND_SECONDS = Histogram("atomlog_partition_append_duration_seconds",
                           "Time to write one group of batches (no fsync).",
                           buckets=LATENCY_BUCKETS_SECONDS)
FSYNC_SECONDS = Histogram("atomlog_partition_fsync_duration_seconds",
                          "Time of one group-commit fsync.", buckets=LATENCY_BUCKETS_SECONDS)
FSYNCS = Counter("atomlog_partition_fsyncs_total", "Group-commit fsyncs (rate() = fsyncs/s).")
ROLL_SECONDS = Histogram("atomlog_partition_roll_duration_seconds",
                         "Time of one segment roll's disk work (the sealed segment's fsync, "
                         "its index file, the next segment's file, the directory's fsync), "
                         "on a worker thread while the partition holds its writes.",
                         buckets=LATENCY_BUCKETS_SECONDS)
PRODUCE_BATCHES_PER_FSYNC = Histogram(
    "atomlog_partition_batches_per_fsync", "Batches made durable by one fsync.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
PRODUCERS_EXPIRED = Counter("atomlog_partition_producers_expired_total",
                            "Producers forgotten after their idle expiry.", ["topic"])
PRODUCERS_EVICTED = Counter("atomlog_partition_producers_evicted_total",
                            "Producers forgotten before their idle expiry to make room for a "
                            "new one in a full table (idle for more than an hour).",
                            ["topic"])
DUPLICATES = Counter("atomlog_partition_duplicates_rejected_total",
                     "Retried batches answered with their original offsets, not appended.",
                     ["topic"])
MARKERS_WRITTEN = Counter("atomlog_partition_markers_written_total",
                          "COMMIT/ABORT control batches written (markers for transactions "
                          "with data on the partition).", ["topic", "decision"])
BAD_BATCHES = Counter("atomlog_partition_rejected_batches_total",
                      "Produced batches refused, by reason.", ["reason"])
RESOLVE_STAGED = Counter(
    "atomlog_partition_resolve_staged_total",
    "ResolveStaged answers (a coordinator recovering a parallel commit), one per "
    "transaction and partition: staged (its staged data is durable here), not_staged "
    "(never here, or aborted: fenced, it never will be), error (a stale coordinator epoch, "
    "not the leader, not serving, a failed fsync: the coordinator asks again).", ["result"])

# Replication (docs/replication.md).
LEADER_ELECTIONS = Counter("atomlog_leader_elections_total", "Partition leader elections this "
                           "server wrote (unclean=true: a replica outside the ISR took over and "
                           "acknowledged writes it lacked are lost).", ["unclean"])
ISR_SHRINKS = Counter("atomlog_isr_shrinks_total", "Followers removed from an in-sync replica "
                      "set by this server as leader (lagging, or their server gone).")
ISR_EXPANDS = Counter("atomlog_isr_expands_total", "Followers added back to an in-sync replica "
                      "set by this server as leader once caught up.")
REPLICA_FETCHED_BYTES = Counter("atomlog_replica_fetched_bytes_total",
                                "Bytes of batches this server copied from leaders as a follower.")
REPLICATE_CALLS = Counter("atomlog_replica_fetch_calls_total",
                          "ReplicateMany calls this server made as a follower (one at a time "
                          "per leader, each asking for every partition it copies from it).")
REPLICATE_LOOP_ROUNDS = Counter(
    "atomlog_replica_fetch_loop_rounds_total",
    "Rounds of this server's replica fetchers whose answers the event loop acted on "
    "instead of the replication link's thread: a divergence, an error or a failed copy, "
    "a partition closing or reopening its log, rounds while a partition backs off, and "
    "every round without a usable link (replication.link=false) (docs/replication.md, "
    "\"Rounds on the link's thread\").")
REPLICATE_NAMED = Counter("atomlog_replica_fetch_partitions_named_total",
                          "Partitions this server named in its ReplicateMany calls as a "
                          "follower: in a fetch session only those new to it or changed "
                          "since its last call, else every partition of the call.")
REPLICATE_SESSIONS_OPENED = Counter(
    "atomlog_replica_fetch_sessions_opened_total",
    "Fetch sessions this server's leaders opened for it as a follower: one per leader, and "
    "one more after each failed or cut call or a session the leader refused.")
REPLICA_ACKNOWLEDGED_LOST = Counter(
    "atomlog_replica_acknowledged_offsets_lost_total",
    "Offsets below the high watermark (acknowledged) that this server cut from its copy to "
    "follow a new leader without them: only after an unclean election.")


class ReplicationCollector(Collector):
    """Gauges read from the manager at scrape time: per topic, the partitions this server
    leads with fewer in-sync replicas than replicas, the offline partitions it holds a
    replica of (no leader: take max() over servers), the largest follower lag (in
    offsets) of the partitions it leads, and the partitions it is catching up on
    (PartitionManager.catching_up; only topics with some)."""

    def __init__(self, manager):
        self._manager = manager

    def collect(self):
        under = GaugeMetricFamily("atomlog_partitions_under_replicated", "Partitions led here "
                                  "whose in-sync replicas are fewer than their replicas.",
                                  labels=["topic"])
        offline = GaugeMetricFamily("atomlog_partitions_offline", "Partitions with a replica "
                                    "here and no leader (no in-sync replica alive).",
                                    labels=["topic"])
        lag = GaugeMetricFamily("atomlog_replica_max_lag_offsets", "Largest number of offsets a "
                                "follower is behind, over the partitions led here.",
                                labels=["topic"])
        catching_up = GaugeMetricFamily(
            "atomlog_partitions_catching_up", "Partitions this server holds and cannot serve "
            "as it should yet: its replica not in the ISR while a live leader serves it, or "
            "its own partition still opening (the health service atomlog.caught_up answers "
            "SERVING when none is left).", labels=["topic"])
        rows = self._manager.replication_summary()
        for topic, (under_count, offline_count, max_lag) in sorted(rows.items()):
            under.add_metric([topic], under_count)
            offline.add_metric([topic], offline_count)
            lag.add_metric([topic], max_lag)
        behind: dict[str, int] = {}
        for topic, _partition in self._manager.catching_up() or ():
            behind[topic] = behind.get(topic, 0) + 1
        for topic, count in sorted(behind.items()):
            catching_up.add_metric([topic], count)
        yield from (under, offline, lag, catching_up)

    def describe(self):
        return []


class PartitionStateCollector(Collector):
    """Gauges read from the owners at scrape time (never kept by hand, so they cannot
    drift): partitions by state; per topic, idempotent producers tracked, open, late and
    aborted transactions, and how far the max read position lags."""

    def __init__(self, owners: Callable[[], Iterable]):
        self._owners = owners

    def collect(self):
        states = GaugeMetricFamily("atomlog_partitions", "Partitions hosted here, by state "
                                   "(DATA_LOSS: refusing to serve until an operator acts).",
                                   labels=["state"])
        producers = GaugeMetricFamily("atomlog_partition_producers",
                                      "Idempotent producers tracked.", labels=["topic"])
        open_txns = GaugeMetricFamily(
            "atomlog_partition_open_transactions", "Transactions with data and no marker yet, "
            "summed over the topic's partitions hosted here.", labels=["topic"])
        lag_records = GaugeMetricFamily(
            "atomlog_partition_max_read_position_lag_records", "Largest high watermark minus "
            "max read position over the topic's partitions: offsets read_committed readers "
            "cannot see yet.", labels=["topic"])
        lag_seconds = GaugeMetricFamily(
            "atomlog_partition_max_read_position_lag_seconds", "Age of the oldest open "
            "transaction over the topic's partitions (how long the max read position has "
            "been held).", labels=["topic"])
        late = GaugeMetricFamily(
            "atomlog_partition_late_transactions", "Open transactions older than "
            "partition.late_transaction_ms (possibly hanging: see `atomlog txn "
            "find-hanging`).", labels=["topic"])
        aborted = GaugeMetricFamily(
            "atomlog_partition_aborted_transactions", "Entries in the aborted-transaction "
            "indexes of the topic's partitions.", labels=["topic"])
        evicted = GaugeMetricFamily(
            "atomlog_partition_aborted_index_evicted_offsets", "Largest number of offsets, over "
            "the topic's partitions, between the log start and where the aborted-transaction "
            "index begins (partition.max_aborted_transactions reached): read_committed reads "
            "there are refused (OFFSET_OUT_OF_RANGE).", labels=["topic"])
        stuck = GaugeMetricFamily(
            "atomlog_partition_oldest_fsync_seconds", "Age of the oldest group-commit fsync "
            "in flight over the partitions led here (0: none). Completed fsyncs are timed by "
            "atomlog_partition_fsync_duration_seconds; one that never completes shows only "
            "here, while its partition acknowledges nothing.")
        buffers = GaugeMetricFamily(
            "atomlog_partition_txn_buffers_recovering", "Partitions of the topic serving plain "
            "writes while their transaction buffer replays the log (transactional writes, "
            "markers and read_committed reads get PARTITION_LOADING meanwhile).",
            labels=["topic"])
        recovering: dict[str, int] = {}
        by_state: dict[str, int] = {"LOADING": 0, "ONLINE": 0, "DATA_LOSS": 0}
        by_topic: dict[str, list[float]] = {}
        now_ms = time.time() * 1000
        now, oldest_fsync = time.perf_counter(), 0.0
        for owner in list(self._owners()):
            by_state[owner.state.value] = by_state.get(owner.state.value, 0) + 1
            began = owner.oldest_flush_began()
            if began is not None:
                oldest_fsync = max(oldest_fsync, now - began)
            row = by_topic.setdefault(owner.topic, [0, 0, 0, 0.0, 0, 0, 0])
            row[0] += owner.producers.producer_count
            if owner.log is None or owner.state.value != "ONLINE":
                continue
            if owner.txns_recovering:
                recovering[owner.topic] = recovering.get(owner.topic, 0) + 1
                continue
            txns = owner.txns
            row[1] += txns.open_count
            row[2] = max(row[2], owner.log.high_watermark - owner.max_read_position())
            oldest = txns.oldest_open()
            if oldest is not None:
                row[3] = max(row[3], (now_ms - oldest.first_timestamp_ms) / 1000)
                row[4] += txns.count_older_than(int(now_ms), owner.settings.late_transaction_ms)
            row[5] += txns.aborted_count
            row[6] = max(row[6], txns.aborted_index_start - owner.log.log_start_offset)
        for state, count in sorted(by_state.items()):
            states.add_metric([state], count)
        for topic, row in sorted(by_topic.items()):
            for family, value in zip((producers, open_txns, lag_records, lag_seconds, late,
                                      aborted, evicted), row):
                family.add_metric([topic], value)
        for topic in sorted(by_topic):
            buffers.add_metric([topic], recovering.get(topic, 0))
        stuck.add_metric([], oldest_fsync)
        yield from (states, producers, open_txns, lag_records, lag_seconds, late, aborted,
                    evicted, buffers, stuck)

    def describe(self):
        return []


def register_state_collector(owners: Callable[[], Iterable]) -> PartitionStateCollector:
    collector = PartitionStateCollector(owners)
    REGISTRY.register(collector)
    return collector


def register_replication_collector(manager) -> ReplicationCollector:
    collector = ReplicationCollector(manager)
    REGISTRY.register(collector)
    return collector


def unregister_collectors(collectors: list) -> None:
    """Unregisters each of `collectors` and empties the list (so a second call does nothing)."""
    while collectors:
        REGISTRY.unregister(collectors.pop())
