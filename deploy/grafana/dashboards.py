"""The atomlog Grafana dashboards, written as data: `python deploy/grafana/dashboards.py`
rewrites deploy/grafana/dashboards/*.json from the definitions below (a test checks the
committed files match). Every query uses metrics the servers export or the recording
rules of deploy/prometheus/rules; tests/test_deploy_live.py runs each one on a real
Prometheus scraping a real cluster.

Template variables: datasource (a Prometheus), namespace (Kubernetes; matches the
missing label of a local cluster too), topic. Rates use Grafana's $__rate_interval.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
NS = 'namespace=~"$namespace"'
TOPIC = 'topic=~"$topic"'
RI = "$__rate_interval"


def rate(metric: str, by: str = "", selector: str = NS) -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{selector}}}[{RI}]))"


def quantile(q: float, metric: str, by: str = "", selector: str = NS) -> str:
    group = ", ".join(x for x in (by, "le") if x)
    return f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RI}])))"


def panel(title: str, *targets: tuple[str, str], unit: str = "short", kind: str = "timeseries",
          description: str = "", width: int = 12, height: int = 8) -> dict:
    return {"type": kind, "title": title, "description": description, "datasource": DATASOURCE,
            "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr,
                         "legendFormat": legend, "range": kind == "timeseries",
                         "instant": kind != "timeseries"}
                        for i, (expr, legend) in enumerate(targets)],
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom",
                                   "calcs": ["lastNotNull", "max"]}} if kind == "timeseries" else {},
            "_size": (width, height)}


def variables(topic: bool) -> list[dict]:
    found = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus",
         "current": {}, "hide": 0},
        {"name": "namespace", "type": "query", "label": "Namespace", "datasource": DATASOURCE,
         "query": {"query": "label_values(atomlog_build_info, namespace)", "refId": "namespace"},
         "definition": "label_values(atomlog_build_info, namespace)", "refresh": 2,
         "includeAll": True, "allValue": ".*", "multi": True,
         "current": {"text": "All", "value": "$__all"}, "hide": 0, "sort": 1},
    ]
    if topic:
        query = f"label_values(atomlog_partition_records_in_total{{{NS}}}, topic)"
        found.append({"name": "topic", "type": "query", "label": "Topic", "datasource": DATASOURCE,
                      "query": {"query": query, "refId": "topic"}, "definition": query,
                      "refresh": 2, "includeAll": True, "allValue": ".*", "multi": True,
                      "current": {"text": "All", "value": "$__all"}, "hide": 0, "sort": 1})
    return found


def dashboard(uid: str, title: str, description: str, rows: list[tuple[str, list[dict]]],
              topic: bool = False) -> dict:
    panels, y, next_id = [], 0, 1
    for row_title, row_panels in rows:
        panels.append({"type": "row", "title": row_title, "id": next_id, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id, y, x, row_height = next_id + 1, y + 1, 0, 0
        for p in row_panels:
            width, height = p.pop("_size")
            if x + width > 24:
                x, y, row_height = 0, y + row_height, 0
            panels.append({"id": next_id, **p, "gridPos": {"h": height, "w": width, "x": x, "y": y}})
            next_id, x, row_height = next_id + 1, x + width, max(row_height, height)
        y += row_height
    return {"uid": uid, "title": title, "description": description, "tags": ["atomlog"],
            "editable": True, "graphTooltip": 1, "refresh": "30s", "schemaVersion": 39,
            "time": {"from": "now-1h", "to": "now"}, "timezone": "",
            "templating": {"list": variables(topic)}, "annotations": {"list": []},
            "links": [{"type": "dashboards", "tags": ["atomlog"], "asDropdown": True,
                       "title": "atomlog", "includeVars": True, "keepTime": True}],
            "panels": panels, "version": 1}


def overview() -> dict:
    return dashboard("atomlog-overview", "atomlog / Cluster overview",
                     "Is every server up and serving, is anything alerting, and how much is flowing.", [
        ("Health", [
            panel("Servers SERVING", (f"sum by (role) (atomlog_serving{{{NS}}})", "{{role}}"),
                  kind="stat", width=6, height=5,
                  description="Processes whose gRPC health is SERVING, by role."),
            panel("Scrape targets down", (f'sum by (role) (1 - up{{job="atomlog", {NS}}})', "{{role}}"),
                  kind="stat", width=6, height=5,
                  description="A partition server down means its partitions are offline (no replicas yet)."),
            panel("TC partitions with a coordinator",
                  (f"sum(namespace:atomlog_coordinator_tc_partitions_owned:sum{{{NS}}})", "owned"),
                  kind="stat", width=6, height=5, description="Should be the cluster's TC partition count, fixed when it was created (16 by default; 1 when a single-node combined server created it)."),
            panel("atomlog alerts firing",
                  ('count(ALERTS{alertname=~"Atomlog.*", alertstate="firing"}) or vector(0)', "firing"),
                  kind="stat", width=6, height=5),
            panel("Partitions by state", (f"sum by (state) (atomlog_partitions{{{NS}}})", "{{state}}"),
                  kind="stat", width=8, height=5,
                  description="DATA_LOSS partitions refuse to serve until `atomlog partition recover`."),
            panel("ZooKeeper connected", (f"sum by (role) (atomlog_zookeeper_connected{{{NS}}})", "{{role}}"),
                  kind="stat", width=8, height=5),
            panel("ZooKeeper sessions per process",
                  (f"max by (role) (atomlog_zookeeper_sessions_total{{{NS}}})", "{{role}}"),
                  kind="stat", width=8, height=5, description="More than 1: a session expired."),
        ]),
        ("Traffic", [
            panel("Calls by role", (rate("atomlog_rpc_handled_total", "role"), "{{role}}"), unit="reqps"),
            panel("Calls failing on the server's side",
                  (f"role:atomlog_rpc_server_errors:ratio_rate5m{{{NS}}}", "{{role}}"), unit="percentunit"),
            panel("Records in / out", (rate("atomlog_partition_records_in_total"), "in"),
                  (rate("atomlog_partition_records_out_total"), "out"), unit="rps"),
            panel("Transactions ended", (rate("atomlog_coordinator_transactions_ended_total", "decision"),
                                         "{{decision}}"), unit="ops"),
        ]),
        ("Versions", [
            panel("Servers and versions", (f"atomlog_build_info{{{NS}}}", "{{name}} {{role}} {{version}}"),
                  kind="table", width=24, height=7),
        ]),
    ])


def transactions() -> dict:
    return dashboard("atomlog-transactions", "atomlog / Transactions",
                     "Open, committed and aborted transactions, commit latency, how long "
                     "read_committed readers are held back, and possibly hanging transactions.", [
        ("Throughput", [
            panel("Open transactions (coordinators)",
                  (f"sum by (instance_name) (atomlog_coordinator_unfinished_transactions{{{NS}}})", "{{instance_name}}")),
            panel("Open transactions on partitions",
                  (f"sum by (topic) (atomlog_partition_open_transactions{{{NS}, {TOPIC}}})", "{{topic}}")),
            panel("Committed / aborted", (rate("atomlog_coordinator_transactions_ended_total", "decision"), "{{decision}}"),
                  (rate("atomlog_coordinator_transactions_started_total"), "started"), unit="ops"),
            panel("Decisions by cause", (rate("atomlog_coordinator_decisions_total", "decision, cause"),
                                         "{{decision}} ({{cause}})"), unit="ops"),
            panel("One-call transactions by result",
                  (rate("atomlog_coordinator_one_call_transactions_total", "result"), "{{result}}"), unit="ops"),
            panel("Timeouts and refusals", (rate("atomlog_coordinator_core_timeouts_total"), "timed out"),
                  (rate("atomlog_coordinator_core_exhausted_total"), "RESOURCE_EXHAUSTED"),
                  (rate("atomlog_coordinator_core_fenced_total"), "PRODUCER_FENCED"),
                  (rate("atomlog_coordinator_core_concurrent_total"), "CONCURRENT_TRANSACTIONS"), unit="ops"),
            panel("One-call commits: parallel, and in flight",
                  (rate("atomlog_coordinator_parallel_commits_total"), "parallel commits / s"),
                  (f"sum by (instance_name) (atomlog_coordinator_one_call_commits_in_flight{{{NS}}})",
                   "in flight on {{instance_name}}"),
                  description="Parallel commits (coordinator.parallel_commits; docs/coordinator.md): "
                              "one-call commits whose Staging record and stages went at once. With "
                              "`auto` a coordinator makes them only once 16 commits in a row began "
                              "there with no other in flight; the commits in flight are what it reads."),
            panel("Finished transactions remembered",
                  (f"sum by (instance_name) (atomlog_coordinator_finished_transactions{{{NS}}})",
                   "{{instance_name}}"),
                  description="Per coordinator, over its TC partitions. Each keeps the last "
                              "transaction.max_finished to finish, and every one whose caller may "
                              "still retry it (its deadline + transaction.finished_grace_ms); at "
                              "transaction.max_finished_held a TC partition refuses new transactions "
                              "(RESOURCE_EXHAUSTED above). docs/coordinator.md, \"Retention of "
                              "finished transactions\"."),
            panel("Finished transactions forgotten, and held for retries",
                  (rate("atomlog_coordinator_core_evicted_total"), "forgotten"),
                  (rate("atomlog_coordinator_core_held_total"), "kept past max_finished (looks)"),
                  unit="ops"),
        ]),
        ("Latency", [
            panel("EndTxn latency", (quantile(0.5, "atomlog_coordinator_end_txn_duration_seconds",
                                              selector=f'{NS}, wait_for_markers="false"'), "p50"),
                  (quantile(0.99, "atomlog_coordinator_end_txn_duration_seconds",
                            selector=f'{NS}, wait_for_markers="false"'), "p99"), unit="s",
                  description="From the call to the durable decision (streaming transactions)."),
            panel("CommitTxn latency (one-call)",
                  (quantile(0.5, "atomlog_coordinator_commit_txn_duration_seconds",
                            selector=f'{NS}, wait_for_markers="false"'), "p50"),
                  (quantile(0.99, "atomlog_coordinator_commit_txn_duration_seconds",
                            selector=f'{NS}, wait_for_markers="false"'), "p99"), unit="s"),
            panel("TC log append latency p99",
                  (quantile(0.99, "atomlog_coordinator_log_append_duration_seconds", "instance_name"),
                   "{{instance_name}}"), unit="s"),
            panel("First-write verification latency p99",
                  (quantile(0.99, "atomlog_partition_txn_verification_duration_seconds", "instance_name"),
                   "{{instance_name}}"), unit="s"),
        ]),
        ("Read-committed visibility and hanging transactions", [
            panel("Max read position lag (time)",
                  (f"max by (topic) (atomlog_partition_max_read_position_lag_seconds{{{NS}, {TOPIC}}})", "{{topic}}"),
                  unit="s", description="Age of the oldest open transaction: how long read_committed "
                                        "readers of the topic have been held back (LSO lag)."),
            panel("Max read position lag (records)",
                  (f"max by (topic) (atomlog_partition_max_read_position_lag_records{{{NS}, {TOPIC}}})", "{{topic}}")),
            panel("Late transactions (possibly hanging)",
                  (f"sum by (topic) (atomlog_partition_late_transactions{{{NS}, {TOPIC}}})", "{{topic}}"),
                  description="Open longer than partition.late_transaction_ms: run `atomlog txn find-hanging`."),
            panel("Markers", (f"sum(atomlog_coordinator_unconfirmed_markers{{{NS}}})", "unconfirmed"),
                  (f"sum(atomlog_coordinator_marker_queue_depth{{{NS}}})", "queued"),
                  (rate("atomlog_coordinator_markers_confirmed_total"), "confirmed/s"),
                  (rate("atomlog_coordinator_core_marker_resends_total"), "transactions re-sent/s")),
        ]),
        ("Coordinators", [
            panel("TC partitions owned", (f"sum by (instance_name) (atomlog_coordinator_tc_partitions_owned{{{NS}}})",
                                          "{{instance_name}}")),
            panel("Leases lost", (rate("atomlog_coordinator_lease_lost_total", "reason"), "{{reason}}"), unit="ops"),
        ]),
    ], topic=True)


def partitions() -> dict:
    return dashboard("atomlog-partitions", "atomlog / Partitions and storage",
                     "Partition states, bytes and records per topic, fsync and append latency, "
                     "producer state and the transaction buffers.", [
        ("Partitions", [
            panel("Partitions by server and state",
                  (f"sum by (instance_name, state) (atomlog_partitions{{{NS}}})", "{{instance_name}} {{state}}")),
            panel("Transaction buffers replaying",
                  (f"sum by (topic) (atomlog_partition_txn_buffers_recovering{{{NS}, {TOPIC}}})", "{{topic}}")),
            panel("Idempotent producers tracked",
                  (f"sum by (topic) (atomlog_partition_producers{{{NS}, {TOPIC}}})", "{{topic}}")),
            panel("Aborted-transaction index entries",
                  (f"sum by (topic) (atomlog_partition_aborted_transactions{{{NS}, {TOPIC}}})", "{{topic}}")),
        ]),
        ("Traffic per topic", [
            panel("Bytes in", (rate("atomlog_partition_bytes_in_total", "topic", f"{NS}, {TOPIC}"), "{{topic}}"), unit="Bps"),
            panel("Bytes out", (rate("atomlog_partition_bytes_out_total", "topic", f"{NS}, {TOPIC}"), "{{topic}}"), unit="Bps"),
            panel("Records in", (rate("atomlog_partition_records_in_total", "topic", f"{NS}, {TOPIC}"), "{{topic}}"), unit="rps"),
            panel("Duplicates answered, not appended",
                  (rate("atomlog_partition_duplicates_rejected_total", "topic", f"{NS}, {TOPIC}"), "{{topic}}"), unit="ops"),
        ]),
        ("Storage", [
            panel("fsync latency", (quantile(0.5, "atomlog_partition_fsync_duration_seconds", "instance_name"),
                                    "{{instance_name}} p50"),
                  (f"instance_name:atomlog_partition_fsync_duration_seconds:p99_5m{{{NS}}}", "{{instance_name}} p99 (5m)"),
                  (f"max by (instance_name) (atomlog_partition_oldest_fsync_seconds{{{NS}}})",
                   "{{instance_name}} oldest in flight"),
                  unit="s"),
            panel("fsyncs and batches per fsync", (rate("atomlog_partition_fsyncs_total", "instance_name"), "{{instance_name}} fsyncs/s"),
                  (f"sum(rate(atomlog_partition_batches_per_fsync_sum{{{NS}}}[{RI}])) / "
                   f"sum(rate(atomlog_partition_batches_per_fsync_count{{{NS}}}[{RI}]))", "batches per fsync")),
            panel("Durability barrier p99: wait for a round, the round's syncs",
                  (quantile(0.99, "atomlog_durability_wait_seconds", "instance_name"),
                   "{{instance_name}} wait"),
                  (quantile(0.99, "atomlog_durability_round_seconds", "instance_name"),
                   "{{instance_name}} round"), unit="s",
                  description="A log's fsync waits for the round in flight, then its own "
                              "round; the rest of the fsync latency is the hand-back to the "
                              "partition's owner on its event loop."),
            panel("Append latency (no fsync) p99",
                  (quantile(0.99, "atomlog_partition_append_duration_seconds", "instance_name"), "{{instance_name}}"), unit="s"),
            panel("Markers written", (rate("atomlog_partition_markers_written_total", "decision",
                                           f"{NS}, {TOPIC}"), "{{decision}}"),
                  (rate("atomlog_partition_stale_markers_total"), "refused: stale epoch"), unit="ops"),
            panel("Scrubber: copies read back, and damage found",
                  (rate("atomlog_scrub_bytes_total", "instance_name"), "{{instance_name}} read back"),
                  (f"sum by (instance_name, copy) (increase(atomlog_scrub_damage_found_total{{{NS}}}[1h]))",
                   "{{instance_name}} damaged batches ({{copy}} copy), last hour"),
                  unit="Bps",
                  description="Each partition server reads every copy it holds back from disk "
                              "at partition.scrub_bytes_per_s and checks each batch; a damaged "
                              "copy is mended from an in-sync replica (docs/operations.md, "
                              "\"Scrubbing\"). Damage found points at the server's disk."),
            panel("Time held by garbage collection",
                  (rate("atomlog_gc_pause_seconds_sum", "instance_name, generation"),
                   "{{instance_name}} generation {{generation}}"), unit="percentunit",
                  description="The share of each server's time its Python garbage collector "
                              "held the process, event loop included. A full (generation 2) "
                              "collection scans every tracked object: a long one shows in "
                              "commit p99 (atomlog_gc_pause_seconds has the histogram)."),
        ]),
    ], topic=True)


def clients() -> dict:
    produce = 'method="/atomlog.v1.PartitionService/Produce"'
    fetch = 'method="/atomlog.v1.PartitionService/Fetch"'
    return dashboard("atomlog-clients", "atomlog / Clients",
                     "What clients do and what fails for them: calls, latency and errors by "
                     "method and code, refused batches, producer ids.", [
        ("Produce and fetch", [
            panel("Produce / Fetch calls", (rate("atomlog_rpc_handled_total", "", f"{NS}, {produce}"), "Produce"),
                  (rate("atomlog_rpc_handled_total", "", f"{NS}, {fetch}"), "Fetch"), unit="reqps"),
            panel("Produce / Fetch latency p99",
                  (quantile(0.99, "atomlog_rpc_duration_seconds", "", f"{NS}, {produce}"), "Produce"),
                  (quantile(0.99, "atomlog_rpc_duration_seconds", "", f"{NS}, {fetch}"), "Fetch"), unit="s",
                  description="Fetch includes long-poll waits."),
            panel("Bytes produced / fetched", (rate("atomlog_partition_bytes_in_total"), "produced"),
                  (rate("atomlog_partition_bytes_out_total"), "fetched"), unit="Bps"),
            panel("Calls in flight", (f"sum by (role) (atomlog_rpc_in_flight{{{NS}}})", "{{role}}")),
        ]),
        ("Errors", [
            panel("Failed calls by method and code",
                  (rate("atomlog_rpc_handled_total", "method, code", f'{NS}, code!="OK"'), "{{method}} {{code}}"),
                  unit="reqps", width=24),
            panel("Produced batches refused by reason",
                  (rate("atomlog_partition_rejected_batches_total", "reason"), "{{reason}}"), unit="ops",
                  description="Per batch, inside Produce calls that themselves succeed."),
            panel("Calls by method", (rate("atomlog_rpc_handled_total", "method"), "{{method}}"), unit="reqps"),
        ]),
        ("Latency", [
            panel("Latency p99 by method", (quantile(0.99, "atomlog_rpc_duration_seconds", "method"), "{{method}}"),
                  unit="s", width=24),
        ]),
        ("Producer ids", [
            panel("Producer ids handed out", (rate("atomlog_id_allocator_producer_ids_allocated_total"), "ids/s"),
                  (rate("atomlog_id_allocator_blocks_allocated_total"), "blocks/s"), unit="ops"),
            panel("Allocation failures by reason", (rate("atomlog_id_allocator_failures_total", "reason"), "{{reason}}"),
                  unit="ops"),
            panel("Allocation latency p99", (quantile(0.99, "atomlog_id_allocator_allocation_latency_seconds"), "p99"),
                  unit="s"),
            panel("Compare-and-set conflicts", (rate("atomlog_id_allocator_cas_conflicts_total"), "conflicts/s"), unit="ops"),
        ]),
    ])


DASHBOARDS = {"atomlog-overview.json": overview, "atomlog-transactions.json": transactions,
              "atomlog-partitions.json": partitions, "atomlog-clients.json": clients}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}", file=sys.stderr)
