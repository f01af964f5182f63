"""Prometheus metrics of the partition server. Labels are bounded: `topic` (operators
bound the number of topics) — never a partition, producer or transaction id."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
PRODUCERS = Gauge("atomlog_partition_producers", "Idempotent producers tracked.", ["topic"])
PRODUCERS_EXPIRED = Counter("atomlog_partition_producers_expired_total",
                            "Producers forgotten after their idle expiry.", ["topic"])
DUPLICATES = Counter("atomlog_partition_duplicates_rejected_total",
                     "Retried batches answered with their original offsets, not appended.",
                     ["topic"])
PARTITIONS_OFFLINE = Gauge("atomlog_partitions_offline",
                           "Partitions refusing to serve (DATA_LOSS) until an operator acts.")
PARTITIONS_ONLINE = Gauge("atomlog_partitions_online", "Partitions serving on this server.")
BAD_BATCHES = Counter("atomlog_partition_rejected_batches_total",
                      "Produced batches refused, by reason.", ["reason"])
