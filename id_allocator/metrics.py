"""Metrics of the producer-id allocator (prefix `atomlog_id_allocator_`).

The ZooKeeper connection state is the shared `atomlog_zookeeper_connected` gauge
(services/metrics.py). Labels take bounded values only (reasons, resolutions).
"""

from __future__ import annotations

from prometheus_client import Gauge

from services.fastmetrics import Counter, Histogram
from services.metrics import LATENCY_BUCKETS_SECONDS

BLOCKS_ALLOCATED = Counter("atomlog_id_allocator_blocks_allocated_total",
                           "Producer-id blocks issued by this process.")
IDS_ALLOCATED = Counter("atomlog_id_allocator_producer_ids_allocated_total",
                        "Producer ids issued by this process (sum of block sizes).")
WRITES = Counter("atomlog_id_allocator_zookeeper_writes_total",
                 "Successful compare-and-set writes of the block znode (one may issue "
                 "several blocks).")
CAS_CONFLICTS = Counter("atomlog_id_allocator_cas_conflicts_total",
                        "Compare-and-set writes refused because the znode version changed.")
UNCERTAIN_WRITES = Counter("atomlog_id_allocator_uncertain_writes_total",
                           "Writes whose reply was lost, by how the re-read resolved them "
                           "(ours: issued; not_ours: never issued; unresolved: ZooKeeper gone).",
                           ["resolution"])
FAILURES = Counter("atomlog_id_allocator_failures_total",
                   "Allocation requests that failed, by error reason.", ["reason"])
ALLOCATION_LATENCY = Histogram("atomlog_id_allocator_allocation_latency_seconds",
                               "Time from queueing an allocation request to its answer.",
                               buckets=LATENCY_BUCKETS_SECONDS)
PENDING_REQUESTS = Gauge("atomlog_id_allocator_pending_requests",
                         "Allocation requests queued for the allocator's owner task.")
REQUESTS_PER_WRITE = Histogram("atomlog_id_allocator_requests_per_write",
                               "Requests served by one compare-and-set round.",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024))

for _resolution in ("ours", "not_ours", "unresolved"):
    UNCERTAIN_WRITES.labels(_resolution)
