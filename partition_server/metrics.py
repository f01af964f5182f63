"""Prometheus metrics of the partition server. Labels are bounded: `topic` (operators
bound the number of topics) — never a partition, producer or transaction id."""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.metrics import LATENCY_BUCKETS_SECONDS

BYTES_IN = Counter("atomlog_partition_bytes_in_total", "Bytes of record batches appended.",
                   ["topic"])
RECORDS_IN = Counter("atomlog_partition_records_in_total", "Records appended.", ["topic"])
BYTES_OUT = Counter("atomlog_partition_bytes_out_total", "Bytes of record batches fetched.",
                    ["topic"])
RECORDS_OUT = Counter("atomlog_partition_records_out_total",
                      "Records fetched (counted from batch headers).", ["topic"])
APPEND_SECONDS = Histogram("atomlog_partition_append_duration_seconds",
                           "Time to write one group of batches (no fsync).",
                           buckets=LATENCY_BUCKETS_SECONDS)
FSYNC_SECONDS = Histogram("atomlog_partition_fsync_duration_seconds",
                          "Time of one group-commit fsync.", buckets=LATENCY_BUCKETS_SECONDS)
FSYNCS = Counter("atomlog_partition_fsyncs_total", "Group-commit fsyncs (rate() = fsyncs/s).")
PRODUCE_BATCHES_PER_FSYNC = Histogram(
    "atomlog_partition_batches_per_fsync", "Batches made durable by one fsync.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
PRODUCERS_EXPIRED = Counter("atomlog_partition_producers_expired_total",
                            "Producers forgotten after their idle expiry.", ["topic"])
DUPLICATES = Counter("atomlog_partition_duplicates_rejected_total",
                     "Retried batches answered with their original offsets, not appended.",
                     ["topic"])
BAD_BATCHES = Counter("atomlog_partition_rejected_batches_total",
                      "Produced batches refused, by reason.", ["reason"])


class PartitionStateCollector(Collector):
    """Gauges read from the owners at scrape time (never kept by hand, so they cannot
    drift): partitions by state, and idempotent producers tracked per topic."""

    def __init__(self, owners: Callable[[], Iterable]):
        self._owners = owners

    def collect(self):
        states = GaugeMetricFamily("atomlog_partitions", "Partitions hosted here, by state "
                                   "(DATA_LOSS: refusing to serve until an operator acts).",
                                   labels=["state"])
        producers = GaugeMetricFamily("atomlog_partition_producers",
                                      "Idempotent producers tracked.", labels=["topic"])
        by_state: dict[str, int] = {"LOADING": 0, "ONLINE": 0, "DATA_LOSS": 0}
        by_topic: dict[str, int] = {}
        for owner in list(self._owners()):
            by_state[owner.state.value] = by_state.get(owner.state.value, 0) + 1
            by_topic[owner.topic] = by_topic.get(owner.topic, 0) + owner.producers.producer_count
        for state, count in sorted(by_state.items()):
            states.add_metric([state], count)
        for topic, count in sorted(by_topic.items()):
            producers.add_metric([topic], count)
        yield states
        yield producers

    def describe(self):
        return []


def register_state_collector(owners: Callable[[], Iterable]) -> PartitionStateCollector:
    collector = PartitionStateCollector(owners)
    REGISTRY.register(collector)
    return collector
