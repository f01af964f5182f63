"""Metrics of the transaction coordinator (prefix `atomlog_coordinator_`). Labels take
bounded values only (decisions, causes, reasons) — never a transaction or TC partition id
(16 TC partitions would be bounded, but per-process totals are what alerts need; the
per-partition view is `atomlog txn list` / DescribeTransaction). Lease metrics live in
coordinator/leases.py."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable

from prometheus_client import REGISTRY, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.fastmetrics import Counter, Histogram
from services.metrics import LATENCY_BUCKETS_SECONDS

STARTED = Counter("atomlog_coordinator_transactions_started_total",
                  "Transactions opened (Opened records made durable).")
ENDED = Counter("atomlog_coordinator_transactions_ended_total",
                "Transactions finished (COMMITTED/ABORTED made durable), by decision.",
                ["decision"])
DECIDED = Counter("atomlog_coordinator_decisions_total",
                  "Decisions made durable, by decision and cause (timeout = timed out).",
                  ["decision", "cause"])
COMMIT_LATENCY = Histogram("atomlog_coordinator_end_txn_duration_seconds",
                           "EndTxn from the call to its answer (decision durable, or every "
                           "marker confirmed with wait_for_markers).", ["wait_for_markers"],
                           buckets=LATENCY_BUCKETS_SECONDS)
ONE_CALL_LATENCY = Histogram("atomlog_coordinator_commit_txn_duration_seconds",
                             "CommitTxn (a one-call transaction) from the call to its answer: "
                             "staging, then the decision durable (or every marker confirmed "
                             "with wait_for_markers).", ["wait_for_markers"],
                             buckets=LATENCY_BUCKETS_SECONDS)
CHAINED_COMMITS = Histogram("atomlog_coordinator_commit_txns_commits",
                            "One-call transactions per CommitTxns call (a client's pipelined "
                            "commits, staged in order).", buckets=(1, 2, 3, 4, 6, 8, 16, 32, 64))
ONE_CALL = Counter("atomlog_coordinator_one_call_transactions_total",
                   "One-call transactions (CommitTxn) by outcome: committed, or the reason "
                   "it was not (presumed abort: nothing logged).", ["result"])
PARALLEL_COMMITS = Counter("atomlog_coordinator_parallel_commits_total",
                           "One-call commits begun as parallel commits: a Staging record "
                           "appended while they stage (coordinator.parallel_commits; with "
                           "auto, those that came in a run of commits one at a time).")
RESOLUTIONS = Counter("atomlog_coordinator_parallel_commit_resolutions_total",
                     "Parallel commits left undecided by their CommitTxn (a coordinator that "
                     "died or failed) and decided by asking their partitions "
                     "(ResolveStaged), by decision.", ["decision"])
LOG_APPEND_SECONDS = Histogram("atomlog_coordinator_log_append_duration_seconds",
                               "One append to a TC log (durable on the partition server).",
                               buckets=LATENCY_BUCKETS_SECONDS)
LOG_PRODUCES = Counter("atomlog_coordinator_log_produces_total",
                       "Attempts to write a TC log append: on the owner of its partition in "
                       "this process (path=owner, the combined server) or by a Produce call "
                       "(path=call; in-process calls included).", ["path"])
LOG_RECORDS_PER_APPEND = Histogram("atomlog_coordinator_log_records_per_append",
                                   "Records written by one TC log append (batching).",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096))
LOAD_SECONDS = Histogram("atomlog_coordinator_tc_partition_load_seconds",
                         "Time to load a TC partition (fence, read its log, restore, replay).",
                         buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
TICKS = Counter("atomlog_coordinator_ticks_total",
                "Ticks of the TC partitions (timeouts, completions, marker re-sends, session "
                "expiry): every 100 ms (coordinator.tick_interval_ms) while a partition has "
                "unfinished transactions, about once a second while it has none.")
LOAD_FAILURES = Counter("atomlog_coordinator_tc_partition_load_failures_total",
                        "Loads of a TC partition that failed (retried).")
SNAPSHOTS = Counter("atomlog_coordinator_snapshots_total",
                    "Snapshots of TC partitions written into their logs.")
SNAPSHOT_BYTES = Gauge("atomlog_coordinator_last_snapshot_bytes",
                       "Size of the last snapshot written by this process.")
MARKER_QUEUE = Gauge("atomlog_coordinator_marker_queue_depth",
                     "Markers queued for delivery to partition servers.")
MARKER_CALLS = Counter("atomlog_coordinator_marker_calls_total",
                       "EndTxnOnPartition calls made (each carries many markers).")
MARKERS_CONFIRMED = Counter("atomlog_coordinator_markers_confirmed_total",
                            "Markers confirmed by partition servers.")
MARKER_FAILURES = Counter("atomlog_coordinator_marker_failures_total",
                          "Markers not confirmed, by reason (the tick re-sends them).",
                          ["reason"])


class CoreCollector(Collector):
    """Gauges and counters read from the TC partition cores (and the coordinator's count
    of one-call commits in flight) at scrape time: nothing on the commit path."""

    def __init__(self, cores: Callable[[], Iterable], in_flight: Callable[[], int]):
        self._cores = cores
        self._in_flight = in_flight
        # The counters of cores gone since (their TC partition moved away, or reloaded
        # into a new core): kept in the totals, so that the counters never go down. (A
        # counter that fell read as a reset to Prometheus, whose rate() then counted its
        # whole remaining value as new: false spikes, and alerts on them.)
        self._retired: dict[str, int] = {}
        self._seen: dict[int, tuple[weakref.ref, dict[str, int]]] = {}
        self._lock = threading.Lock()  # (scrapes may come on several threads)

    def _counter_totals(self, cores: list) -> dict[str, int]:
        """Under the lock: each counter summed over the cores now and the cores gone."""
        now: dict[int, tuple[weakref.ref, dict[str, int]]] = {}
        for core in cores:
            now[id(core)] = (weakref.ref(core), {
                name: value for name, value in vars_of(core.metrics).items()
                if name.endswith("_total")})
        for key, (ref, values) in self._seen.items():
            if key not in now or now[key][0]() is not ref():
                for name, value in values.items():
                    self._retired[name] = self._retired.get(name, 0) + value
        self._seen = now
        totals = dict(self._retired)
        for _, values in now.values():
            for name, value in values.items():
                totals[name] = totals.get(name, 0) + value
        return totals

    def collect(self):
        totals: dict[str, int] = {}
        cores = list(self._cores())
        for core in cores:
            for name, value in vars_of(core.metrics).items():
                totals[name] = totals.get(name, 0) + value
        with self._lock:
            totals.update(self._counter_totals(cores))
        gauges = {
            "unfinished_transactions": "Unfinished transactions (OPEN, PREPARED, COMMITTING, "
                                       "ABORTING) in the TC partitions this process owns.",
            "finished_transactions": "Finished transactions remembered.",
            "sessions": "Transactional-id sessions.",
            "streams": "Streams (TxnStream: Spark streaming queries) whose highest committed "
                       "step is kept (transaction.max_streams per TC partition).",
            "pending_appends": "Appends to TC logs proposed and not yet durable.",
            "unconfirmed_markers": "Markers of decided transactions not yet confirmed.",
        }
        for name, text in gauges.items():
            family = GaugeMetricFamily(f"atomlog_coordinator_{name}", text)
            family.add_metric([], totals.get(name, 0))
            yield family
        family = GaugeMetricFamily(
            "atomlog_coordinator_one_call_commits_in_flight",
            "One-call commits (CommitTxn, CommitTxns) this coordinator is handling: begun "
            "and not yet answered, a parallel commit until it is decided even when its "
            "caller went away (coordinator.parallel_commits=auto reads the same count).")
        family.add_metric([], self._in_flight())
        yield family
        counters = {
            "timeouts_total": "Transactions aborted by their OPEN or PREPARED timeout.",
            "marker_resends_total": "Transactions whose markers were re-sent because they "
                                    "were not all confirmed in time (one per transaction and "
                                    "re-send, whatever its number of markers).",
            "exhausted_total": "Calls refused by a bound (RESOURCE_EXHAUSTED).",
            "fenced_total": "Calls refused with PRODUCER_FENCED.",
            "concurrent_total": "Calls refused with CONCURRENT_TRANSACTIONS.",
            "evicted_total": "Finished transactions forgotten (past transaction.max_finished "
                             "and their callers' retries).",
            "held_total": "Times a finished transaction past transaction.max_finished was "
                          "kept because its caller may still retry it (its deadline plus "
                          "transaction.finished_grace_ms not reached).",
        }
        for name, text in counters.items():
            family = CounterMetricFamily(f"atomlog_coordinator_core_{name[:-6]}", text)
            family.add_metric([], totals.get(name, 0))
            yield family


def vars_of(metrics) -> dict[str, int]:
    return {name: getattr(metrics, name) for name in metrics.__dataclass_fields__}


def register_core_collector(cores: Callable[[], Iterable],
                            in_flight: Callable[[], int]) -> CoreCollector:
    collector = CoreCollector(cores, in_flight)
    REGISTRY.register(collector)
    return collector
