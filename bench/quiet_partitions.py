"""Benchmark (issue 19, replication): what idle partitions cost the written ones on a
cluster of three copies, with the leaders' quiet-partition skipping on and off
(docs/replication.md, "Quiet partitions").

Each cell is a fresh local cluster of 1 id allocator, 2 coordinators and 3 partition
servers, every topic (`__txn_log` included) of three copies, as `atomlog up` makes it. A
topic of 16 partitions takes the load; in the cells with idle partitions, a second topic
of --idle partitions (three copies too) is created and written once per partition, then
left alone. One client commits small one-call transactions (ten 1 KiB records over four
partitions, as bench/transactions.py's) one after another for --seconds: transactions
per second, commit p50 / p90, the servers' CPU per transaction (every process but
ZooKeeper) and the followers' ReplicateMany calls per transaction
(`atomlog_replica_fetch_calls_total`). Then the cluster idles for 5 s: its servers' CPU.
`replication.skip_quiet_partitions` is the setting the on and off cells differ in.

The cells run in rotating order, --rounds times, and the table gives each cell's median
(and range). Baseline in the same run: the cells without idle partitions (what the
written topic costs alone), and off against on.

    .venv/bin/python bench/quiet_partitions.py [--idle 240] [--seconds 10] [--rounds 2]
        [--no-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))

import common  # noqa: E402

TOPIC, IDLE_TOPIC, PARTITIONS, RECORD = "qp-load", "qp-idle", 16, b"x" * 1024
SETTING = "replication.skip_quiet_partitions"
FETCH_CALLS = "atomlog_replica_fetch_calls_total"
BEGIN = "<!-- bench/quiet_partitions.py: begin -->"
END = "<!-- bench/quiet_partitions.py: end -->"


def run_cell(idle: int, skip: bool, seconds: float) -> dict:
    from spark_client import Client

    settings = {SETTING: "true" if skip else "false"}
    with common.local_cluster("quiet-", None, replication_factor=3,
                              settings=settings) as (_data, report, address):
        services = [p for p in report.cluster.processes if p.role != "zookeeper"]
        partition_servers = [p.metrics_address for p in services
                             if p.role == "partition_server"]
        client = Client(address)
        try:
            client.create_topic(TOPIC, partitions=PARTITIONS)
            if idle:
                client.create_topic(IDLE_TOPIC, partitions=idle)
            with client.producer(linger_ms=0) as producer:
                for partition in range(idle):  # every idle partition has a log end to ask
                    producer.send(IDLE_TOPIC, b"once", partition=partition)
                producer.flush()

                def one() -> None:
                    txn = client.begin_transaction(timeout_s=30)
                    for i in range(10):
                        producer.send(TOPIC, RECORD, partition=i % 4, txn=txn)
                    txn.commit()

                for _ in range(30):  # warm: routes, sessions, every follower's rounds
                    one()
                cpu0 = {p.pid: common.cpu_seconds(p.pid) for p in services}
                calls0 = common.counter_totals(partition_servers, (FETCH_CALLS,))[0]
                latencies = []
                began = time.perf_counter()
                while time.perf_counter() - began < seconds:
                    start = time.perf_counter()
                    one()
                    latencies.append(time.perf_counter() - start)
                elapsed = time.perf_counter() - began
                count = len(latencies)
                cpu = sum(common.cpu_seconds(p.pid) - cpu0[p.pid] for p in services)
                calls = common.counter_totals(partition_servers, (FETCH_CALLS,))[0] - calls0
            idle0 = {p.pid: common.cpu_seconds(p.pid) for p in services}
            time.sleep(5)
            idle_cpu = sum(common.cpu_seconds(p.pid) - idle0[p.pid] for p in services) / 5
        finally:
            client.close()
    return {"txn_per_s": count / elapsed,
            "p50_ms": common.percentile(latencies, 0.5) * 1e3,
            "p90_ms": common.percentile(latencies, 0.9) * 1e3,
            "cpu_ms": cpu / count * 1e3, "calls": calls / count,
            "idle_cores": idle_cpu}


def cell_name(idle: int, skip: bool) -> str:
    return (f"{idle} idle partitions" if idle else "no idle partitions") + \
        (", quiet ones skipped" if skip else ", every partition looked at (off)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=240,
                        help="partitions of the idle topic (three copies each)")
    parser.add_argument("--seconds", type=float, default=10,
                        help="seconds of transactions a cell")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the four cells")
    parser.add_argument("--no-docs", action="store_true", help="print only")
    args = parser.parse_args()
    if args.idle < 1 or args.seconds <= 0 or args.rounds < 1:
        parser.error("--idle, --seconds and --rounds must be positive")
    load = os.getloadavg()[0]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cells = [(0, True), (0, False), (args.idle, True), (args.idle, False)]
    results: dict[tuple[int, bool], list[dict]] = {cell: [] for cell in cells}
    for round_ in range(args.rounds):
        for idle, skip in common.rotated(cells, round_):
            result = run_cell(idle, skip, args.seconds)
            results[(idle, skip)].append(result)
            print(f"round {round_ + 1}: {cell_name(idle, skip)}: "
                  f"{result['txn_per_s']:.0f} txn/s, p50 {result['p50_ms']:.1f} ms, "
                  f"{result['cpu_ms']:.1f} ms CPU a transaction", flush=True)

    def show(cell, key: str, digits: int) -> str:
        return common.median_range([r[key] for r in results[cell]], f",.{digits}f")

    rows = ["| cell | small transactions/s | commit p50 / p90 ms | servers' CPU ms a "
            "transaction | follower calls a transaction | idle servers' CPU, cores |",
            "| --- | --- | --- | --- | --- | --- |"]
    for cell in cells:
        rows.append(f"| {cell_name(*cell)} | {show(cell, 'txn_per_s', 0)} | "
                    f"{show(cell, 'p50_ms', 1)} / {show(cell, 'p90_ms', 1)} | "
                    f"{show(cell, 'cpu_ms', 1)} | {show(cell, 'calls', 1)} | "
                    f"{show(cell, 'idle_cores', 2)} |")

    def ratio(key: str, idle: int) -> str:
        on = statistics.median(r[key] for r in results[(idle, True)])
        off = statistics.median(r[key] for r in results[(idle, False)])
        return f"{on / off:.2f}x"

    text = "\n".join([
        BEGIN,
        "## Idle partitions beside written ones, three copies (replication)",
        "",
        f"`{common.command_line('bench/quiet_partitions.py', sys.argv[1:])}` — {when}, "
        f"{common.machine(load)}.",
        f"Fresh clusters of three partition servers, every topic of three copies; one "
        f"client commits small one-call transactions (ten 1 KiB records over four "
        f"partitions of a 16-partition topic) one after another, {args.seconds:g} s a "
        f"cell, beside a topic of {args.idle} idle partitions or none; `{SETTING}` on or "
        f"off. {args.rounds} rounds of the four cells in rotating order: medians "
        f"(ranges). Follower calls: ReplicateMany calls of every follower.",
        "",
        *rows,
        "",
        f"With {args.idle} idle partitions, skipping quiet ones against looking at every "
        f"one: {ratio('p50_ms', args.idle)} the commit p50, "
        f"{ratio('cpu_ms', args.idle)} the servers' CPU a transaction; without idle "
        f"partitions {ratio('p50_ms', 0)} and {ratio('cpu_ms', 0)}.",
        END, ""])
    print(text)
    if not args.no_docs:
        common.write_docs_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
