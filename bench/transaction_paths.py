"""Benchmark (issue 19): the transaction paths, both server shapes and the peers, in ONE run.

Cells, each on a fresh local cluster of its shape (the multi-process cluster: 1 id
allocator, 2 coordinators, 3 partition servers; the combined server: every role in one
process), through the Python SDK exactly as bench/transactions.py runs them:

- small transactions: 8 client processes in a loop of begin, 10 × 1 KiB over 4
  partitions, commit() — with one-call transactions (the SDK's default: one CommitTxn)
  and with the streaming path (Client(one_call_max_bytes=0): NewTxn, Produce, EndTxn).
  Transactions/s, commit() p50/p99, calls per transaction by method, and CPU per
  transaction of the servers and of the clients;
- consume-transform-produce (peers-bench W3: 20,000 preloaded inputs, batches of 100;
  the worker's consumer prefetches 900 more per Receive): sequential (ack(), commit())
  and pipelined (ack_async(), commit_async(), 8 committing), one-call and streaming;
  each cell, and PostgreSQL's W3, run three times (--ctp-runs): the median is reported.

Every topic in those cells has one copy, like the peers. One more cell runs the small
one-call transactions on the cluster as `atomlog up` makes it, its topics at the
product's default of three copies: what a user gets without choosing
(--no-default-copies skips it).

Baselines and peers measured in the same run: the do-nothing gRPC call rate between two
Python processes (the ceiling per call), fsync latency; PostgreSQL from
../shared/peers-bench (W1 with 8 clients, W3), when its servers run (`bash setup.sh`
there); Apache Kafka 4.x (bench/kafka_peer.py: one KRaft broker, fsync per message,
confluent-kafka transactions), when Java and its jars can be had. A peer that cannot run
is skipped and the table says so.

Prints a table and writes its section of docs/benchmarks.md.

    .venv/bin/python bench/transaction_paths.py [--clients 8] [--seconds 10] [--ctp-runs 3]
        [--no-peers] [--no-default-copies] [--no-docs]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))

import common  # noqa: E402
import transactions as tb  # noqa: E402  (bench/transactions.py: the cells themselves)

BEGIN = "<!-- bench/transaction_paths.py: begin -->"
END = "<!-- bench/transaction_paths.py: end -->"
PEERS_BENCH = REPO.parent / "shared" / "peers-bench"
SHAPES = common.SHAPES


@contextlib.contextmanager
def _cluster(prefix: str, roles: dict, replication_factor: int | None):
    """A fresh local cluster with the small transactions' topic, its leases settled:
    yields (launcher report, bootstrap address). `replication_factor` None: the
    product's default copies."""
    from spark_client import Client

    with common.local_cluster(prefix, roles, replication_factor=replication_factor) as (
            _, report, address):
        with Client(address) as client:
            client.create_topic(tb.SMALL_TOPIC, partitions=tb.PARTITIONS)
        time.sleep(3)  # leases settle
        yield report, address


def run_shape(shape: str, clients: int, seconds: float, ctp_inputs: int,
              ctp_runs: int) -> dict:
    """Every atomlog cell on one fresh cluster of `shape`."""
    cells: dict = {}
    with _cluster(f"atomlog-bench-paths-{shape}-", SHAPES[shape],
                  common.BENCH_REPLICATION_FACTOR) as (report, address):
        for one_call in (True, False):
            path = "one-call" if one_call else "streaming"
            cells[f"small {path}"] = tb.small_transactions(report, address, clients, seconds,
                                                           one_call)
            print(f"{shape} small {path}: {cells[f'small {path}']}", flush=True)
            if one_call:  # the latency below the maximum: an open loop at half of it
                cells["small one-call half"] = tb.small_transactions(
                    report, address, clients, seconds, True,
                    rate_per_s=cells["small one-call"]["per_s"] / 2)
                print(f"{shape} small one-call, open loop at half the rate: "
                      f"{cells['small one-call half']}", flush=True)
            for pipelined in (False, True):
                name = f"ctp {'pipelined' if pipelined else 'sequential'} {path}"
                runs = []
                for run in range(ctp_runs):
                    runs.append(tb.consume_transform_produce(report, address, ctp_inputs, 1,
                                                             pipelined, one_call, run=run))
                    print(f"{shape} {name}: {runs[-1]}", flush=True)
                cells[name] = median_run(runs, "per_s")
    return cells


def run_default_copies(clients: int, seconds: float) -> dict:
    """The small one-call cell on the cluster as `atomlog up` makes it, every topic at the
    product's default copies (three, on three partition servers): what a user gets
    without choosing, beside the one-copy cells the targets are measured on."""
    with _cluster("atomlog-bench-paths-default-copies-", SHAPES["cluster"], None) as (
            report, address):
        cell = tb.small_transactions(report, address, clients, seconds, True)
    print(f"cluster small one-call, default copies: {cell}", flush=True)
    return cell


def median_run(runs: list[dict], key: str) -> dict:
    """The run whose `key` is the median of `runs` (the lower middle one of an even
    count), with every run's `key` in "runs" (shown as the range): a cell of 20,000
    inputs lasts about a second, and single such cells moved by ±15% between runs of
    the same code."""
    ranked = sorted(runs, key=lambda run: run[key])
    return {**ranked[(len(ranked) - 1) // 2], "runs": [run[key] for run in runs]}


def run_postgres(clients: int, seconds: float, w3_runs: int) -> dict:
    """peers-bench W1 (8 clients) and W3 (the median of `w3_runs`) on PostgreSQL, or
    {"skipped": why}."""
    python = PEERS_BENCH / ".venv" / "bin" / "python"
    if not python.exists():
        return {"skipped": f"no {python} (run `bash setup.sh` in {PEERS_BENCH})"}
    figures = {}
    w3 = []
    for workload, extra in (("w1", ["--clients", str(clients), "--duration", str(seconds)]),
                            *[("w3", [])] * w3_runs):
        try:
            done = subprocess.run([str(python), "bench.py", "--peer", "pg", "--workload",
                                   workload, *extra], cwd=PEERS_BENCH, capture_output=True,
                                  text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return {"skipped": f"peers-bench {workload} did not finish in 300 s"}
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"skipped": f"peers-bench {workload} failed: {tail[0][:200]}"}
        figures[workload] = json.loads(lines[-1])
        print(f"postgres {workload}: {figures[workload]}", flush=True)
        if workload == "w3":
            w3.append(figures[workload])
    figures["w3"] = median_run(w3, "inputs_per_s")
    return figures


def run_kafka(clients: int, seconds: float, ctp_inputs: int) -> dict:
    """The same workloads on one Kafka 4.x broker, or {"skipped": why}."""
    try:
        import kafka_peer
    except ImportError as error:
        return {"skipped": f"bench/kafka_peer.py cannot be imported: {error}"}
    try:
        with kafka_peer.KafkaBroker() as broker:
            small = kafka_peer.small_transactions(broker.bootstrap, clients=clients,
                                                  seconds=seconds, server_pid=broker.pid)
            print(f"kafka small: {small}", flush=True)
            ctp = kafka_peer.consume_transform_produce(broker.bootstrap, inputs=ctp_inputs,
                                                       server_pid=broker.pid)
            print(f"kafka ctp: {ctp}", flush=True)
            return {"small": small, "ctp": ctp, "version": getattr(broker, "version", "")}
    except kafka_peer.PeerUnavailable as unavailable:
        return {"skipped": str(unavailable)}


# ------------------------------------------------------------------ report
def _ratio(value: float | None, base: float | None) -> str:
    if not value or not base:
        return "–"
    return f"{value / base:.0%}"


def _calls(cell: dict) -> str:
    methods = {m: n for m, n in cell["calls_by_method"].items()
               if not m.startswith(("TC log", "in-process", tb.ON_LINK)) and n >= 0.05}
    text = ", ".join(f"{m} {n:.2f}" for m, n in sorted(methods.items(), key=lambda i: -i[1]))
    linked = cell.get("link_calls_per_txn", 0)
    local = cell.get("local_calls_per_txn", 0)
    return (text + (f"; {linked:.2f} of them on the servers' links" if linked >= 0.05
                    else "") + (f"; in-process {local:.1f}" if local >= 0.05 else ""))


def _pair_row(label: str, pair, cell) -> str:
    """A table row of the cluster's and the combined server's `cell(...)`, no ratio."""
    return f"| {label} | " + " | ".join(cell(c) for c in pair) + " | |"


def _bound_row(path: str, cluster: dict, combined: dict) -> str:
    """The rates the cells' CPU per transaction allows (common.cpu_bounds), and the
    share of them reached."""
    a, b = common.cpu_bounds(cluster), common.cpu_bounds(combined)
    return (f"| CPU bound, {path}: {a['cores']} cores ÷ CPU per transaction (combined: "
            f"also 1 s ÷ its event loop's) | {a['machine']:,.0f}/s (reached "
            f"{_ratio(cluster['per_s'], a['machine'])}) | {b['machine']:,.0f}/s, event loop "
            f"{b['event_loop']:,.0f}/s (reached {_ratio(combined['per_s'], b['event_loop'])}) "
            "| |")


def _budget_row(rate: float, cores: int) -> str:
    """The CPU per transaction the small-transaction targets allow at this run's call
    rate, if every core (or, on the combined server, its event loop) were busy."""
    cluster_ms, combined_ms = cores * 1e3 / (0.25 * rate), cores * 1e3 / (0.50 * rate)
    return (f"| CPU per transaction the targets allow (25% / 50% of the call rate, every core "
            f"busy), servers + clients | ≤ {cluster_ms:.2f} ms | ≤ {combined_ms:.2f} ms, "
            f"and ≤ {1e3 / (0.5 * rate):.2f} ms on the event loop | |")


def _spread(cell: dict) -> str:
    """The range of a median cell's runs ("" for a single run)."""
    runs = cell.get("runs", [])
    if len(runs) < 2:
        return ""
    return f"runs {min(runs):,.0f}-{max(runs):,.0f}; "


def section(command: str, load: float, baseline: dict, floor: dict, shapes: dict,
            postgres: dict, kafka: dict, default_copies: dict | None = None) -> str:
    rate = floor["calls_per_s"]
    pg_w1 = postgres.get("w1", {}).get("txn_per_s")
    pg_w3 = postgres.get("w3", {}).get("inputs_per_s")
    kafka_small = kafka.get("small", {}).get("per_s")
    kafka_ctp = kafka.get("ctp", {}).get("per_s")

    def peers_small(value: float) -> str:
        return (f"{_ratio(value, rate)} of the call rate; {_ratio(value, pg_w1)} of PostgreSQL; "
                f"{_ratio(value, kafka_small)} of Kafka")

    def peers_ctp(value: float) -> str:
        return f"{_ratio(value, pg_w3)} of PostgreSQL; {_ratio(value, kafka_ctp)} of Kafka"

    lines = [
        BEGIN,
        "## The transaction paths: one-call and streaming, cluster and combined server, "
        "beside PostgreSQL and Kafka (issue 19)",
        "",
        f"`{command}`, {time.strftime('%Y-%m-%d %H:%M')}, {common.machine(load, with_java=True)}",
        "",
        "Everything below comes from one run, minutes apart. Baselines: a do-nothing gRPC call "
        f"between two Python processes ran at **{rate:,.0f} calls/s** "
        f"({floor['server_cpu_ms_per_call']:.2f} ms of server CPU and "
        f"{floor.get('client_cpu_ms_per_call', float('nan')):.2f} ms of client CPU per call); "
        "fsync of a small "
        f"write p50 {baseline['p50']:.2f} ms. Small transactions: 8 client processes, each "
        "a loop of begin, 10 × 1 KiB over 4 partitions, commit(). Consume-transform-produce: "
        "peers-bench W3 (batches of 100 inputs), its consumer prefetching "
        f"{tb.CTP_PREFETCH} more per Receive, each transaction's 100 outputs handed over in "
        "one `producer.send_batch()` (as PostgreSQL's W3 inserts them with one "
        "`executemany()`; before 2026-11-30 22:41, one `send()` each). *One-call* is the SDK's "
        "default (the transaction is kept by the client and committed by one CommitTxn); "
        "*streaming* is `Client(one_call_max_bytes=0)` (NewTxn, Produce, EndTxn). Calls are "
        "calls per transaction counted by every server (client and server-to-server, "
        "TC-log appends included): gRPC calls, or calls on the servers' links (the "
        "SDK's commits on the coordinators' links, docs/clients.md; the coordinators' "
        "calls on the partition servers' links, docs/coordinator.md); *in-process* are the combined server's "
        "function calls instead. CPU is per transaction, servers and clients separately. Every topic, "
        f"__txn_log included, has {common.BENCH_REPLICATION_FACTOR} cop"
        f"{'y' if common.BENCH_REPLICATION_FACTOR == 1 else 'ies'} (like the peers; "
        "bench/replication.py measures three against one), except in the row of the "
        "product's default of three copies.",
        "",
        "| cell | cluster | combined server | ratios (cluster / combined) |",
        "| --- | --- | --- | --- |",
    ]
    cluster, combined = shapes.get("cluster", {}), shapes.get("combined", {})
    for path in ("one-call", "streaming"):
        a, b = cluster.get(f"small {path}"), combined.get(f"small {path}")
        if not a or not b:
            continue
        lines += [
            f"| small transactions/s, {path} | **{a['per_s']:,.0f}** | **{b['per_s']:,.0f}** "
            f"| {peers_small(a['per_s'])} / {peers_small(b['per_s'])} |",
            f"| commit() p50 / p99 ms, {path} | {a['commit_p50_ms']:.1f} / "
            f"{a['commit_p99_ms']:.1f} | {b['commit_p50_ms']:.1f} / {b['commit_p99_ms']:.1f} "
            "| |",
            f"| calls per transaction, {path} | {a['calls_per_txn']:.2f} "
            f"({_calls(a)}) | {b['calls_per_txn']:.2f} ({_calls(b)}) | |",
            f"| CPU ms per transaction (servers + clients), {path} | "
            f"{a['server_cpu_ms_per_txn']:.1f} + {a['client_cpu_ms_per_txn']:.1f} | "
            f"{b['server_cpu_ms_per_txn']:.1f} + {b['client_cpu_ms_per_txn']:.1f} | |",
            _bound_row(path, a, b),
        ]
        half = cluster.get(f"small {path} half"), combined.get(f"small {path} half")
        if all(half):
            lines.append(_pair_row(
                f"commit() p50 / p99 ms at half that rate, {path}: an open loop (in brackets, "
                "whole transactions from their scheduled start)", half,
                lambda h: f"{h['commit_p50_ms']:.1f} / {h['commit_p99_ms']:.1f} at "
                          f"{h['per_s']:,.0f}/s ({h['txn_p50_ms']:.1f} / {h['txn_p99_ms']:.1f})"))
        if "machine_jitter" in a and "machine_jitter" in b:
            lines.append(_pair_row(
                f"the machine's own jitter during the {path} cell (common.CpuProbe): a chunk "
                "of plain Python, p50 / p99 ms", (a, b),
                lambda c: f"{c['machine_jitter']['p50_ms']:.2f} / "
                          f"{c['machine_jitter']['p99_ms']:.2f}"))
        if "full_gcs" in a and "full_gcs" in b:
            lines.append(_pair_row(
                f"the servers' full garbage collections during the {path} cell: how many (ms "
                "in all; how many over 10 ms)", (a, b),
                lambda c: f"{c['full_gcs']:.0f} ({c['full_gc_ms']:.0f}; "
                          f"{c['full_gcs_over_10ms']:.0f})"))
    if default_copies:
        d = default_copies
        lines.append(
            f"| small transactions/s, one-call, every topic at the product's default of three "
            f"copies (`atomlog up`; a combined server keeps one) | **{d['per_s']:,.0f}** "
            f"(commit p50 / p99 {d['commit_p50_ms']:.1f} / {d['commit_p99_ms']:.1f} ms; CPU "
            f"{d['server_cpu_ms_per_txn']:.1f} + {d['client_cpu_ms_per_txn']:.1f} ms) | | "
            f"{peers_small(d['per_s'])} |")
    lines.append(_budget_row(rate, common.cores()))
    for path in ("one-call", "streaming"):
        for mode in ("sequential", "pipelined"):
            a = cluster.get(f"ctp {mode} {path}")
            b = combined.get(f"ctp {mode} {path}")
            if not a or not b:
                continue
            lines.append(
                f"| consume-transform-produce inputs/s, {mode}, {path} | **{a['per_s']:,.0f}** "
                f"({_spread(a)}commit p99 {a['commit_p99_ms']:.0f} ms) | **{b['per_s']:,.0f}** "
                f"({_spread(b)}commit p99 {b['commit_p99_ms']:.0f} ms) | "
                f"{peers_ctp(a['per_s'])} / {peers_ctp(b['per_s'])} |")
    lines += ["", "Peers in the same run:", ""]
    if "skipped" in postgres:
        lines.append(f"- PostgreSQL: skipped ({postgres['skipped']}).")
    else:
        w1, w3 = postgres["w1"], postgres["w3"]
        lines.append(f"- PostgreSQL (peers-bench, fsync on, synchronous_commit on): W1 with "
                     f"{w1['clients']} clients **{w1['txn_per_s']:,.0f} txn/s** (latency p50 "
                     f"{w1['p50_ms']:.1f} ms, p99 {w1['p99_ms']:.1f} ms); W3 "
                     f"**{w3['inputs_per_s']:,.0f} inputs/s**"
                     + (f" (the median of {len(w3['runs'])} runs, "
                        f"{min(w3['runs']):,.0f}-{max(w3['runs']):,.0f})"
                        if len(w3.get("runs", [])) > 1 else "") + ".")
    if "skipped" in kafka:
        lines.append(f"- Kafka: skipped ({kafka['skipped']}).")
    else:
        small, ctp = kafka["small"], kafka["ctp"]
        lines.append(f"- Apache Kafka {kafka.get('version') or '4.x'} (one KRaft broker, "
                     "`log.flush.interval.messages=1`, confluent-kafka): small transactions "
                     f"**{small['per_s']:,.0f} txn/s** (commit p50 "
                     f"{small['commit_p50_ms']:.1f} ms, p99 {small['commit_p99_ms']:.1f} ms); "
                     "consume-transform-produce with send_offsets_to_transaction "
                     f"**{ctp['per_s']:,.0f} inputs/s** (commit p99 "
                     f"{ctp['commit_p99_ms']:.1f} ms).")
    lines += ["",
              "Targets of issue 19 (ratios in this run): small transactions ≥ 25% of the call "
              "rate on the cluster and ≥ 50% on the combined server, commit p99 < 25 ms on "
              "the combined server; consume-transform-produce ≥ 60% of PostgreSQL on the "
              "cluster and ≥ 100% on the combined server.", END]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--ctp-inputs", type=int, default=20_000)
    parser.add_argument("--ctp-runs", type=int, default=3,
                        help="runs of each consume-transform-produce cell and of "
                             "PostgreSQL's W3; the median run is reported (a cell lasts "
                             "about a second: single runs move by ±15%%)")
    parser.add_argument("--shapes", default="cluster,combined")
    parser.add_argument("--no-peers", action="store_true", help="skip PostgreSQL and Kafka")
    parser.add_argument("--no-default-copies", action="store_true",
                        help="skip the small one-call cell on a cluster whose topics have "
                             "the product's default copies (three)")
    parser.add_argument("--no-docs", action="store_true", help="print only")
    args = parser.parse_args()
    if not 1 <= args.ctp_runs <= 9:
        parser.error("--ctp-runs takes 1..9")
    command = common.command_line("bench/transaction_paths.py", sys.argv[1:])
    load = os.getloadavg()[0]
    floor = common.grpc_call_floor()
    print(f"gRPC call floor: {floor}", flush=True)
    import tempfile
    with tempfile.TemporaryDirectory(prefix="atomlog-bench-fsync-") as directory:
        baseline = common.fsync_baseline(Path(directory))
    shapes = {shape: run_shape(shape, args.clients, args.seconds, args.ctp_inputs,
                               args.ctp_runs)
              for shape in args.shapes.split(",")}
    default_copies = (None if args.no_default_copies or "cluster" not in args.shapes.split(",")
                      else run_default_copies(args.clients, args.seconds))
    skipped = {"skipped": "--no-peers"}
    postgres = (skipped if args.no_peers
                else run_postgres(args.clients, args.seconds, args.ctp_runs))
    kafka = skipped if args.no_peers else run_kafka(args.clients, args.seconds, args.ctp_inputs)
    text = section(command, load, baseline, floor, shapes, postgres, kafka, default_copies)
    print()
    print(text)
    if not args.no_docs:
        common.write_docs_section(text, BEGIN, END)
        print(f"wrote its section of {common.DOCS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
