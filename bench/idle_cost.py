"""Benchmark (replication, issue 19): what an idle cluster costs, by how many partitions it
holds (docs/replication.md, "Idle cost").

Each cell is a fresh local cluster of 1 id allocator, 2 coordinators and 3 partition
servers, every topic (`__txn_log` included) of three copies, as `atomlog up` makes it. A
topic of P partitions (three copies each) is created and written once per partition,
the cluster settles for --settle seconds, and then nothing happens for --seconds: the CPU
its processes use meanwhile, from /proc, in cores (1.0 = one core busy), by role, and
the partition servers' event loops apart from their other threads. Cells run in rotating
order, --rounds times; the table gives each cell's median (and range).

Baseline in the same run: the cell with no extra topic (16 `__txn_log` partitions only),
and each cell's cost per 1,000 partitions above it.

    .venv/bin/python bench/idle_cost.py [--partitions 0,240,1000] [--seconds 15]
        [--settle 8] [--rounds 2] [--no-docs]
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

TOPIC = "idle"
BEGIN = "<!-- bench/idle_cost.py: begin -->"
END = "<!-- bench/idle_cost.py: end -->"


def run_cell(partitions: int, seconds: float, settle: float) -> dict:
    from spark_client import Client

    with common.local_cluster("idle-", None, replication_factor=3) as (_d, report, address):
        services = [p for p in report.cluster.processes if p.role != "zookeeper"]
        client = Client(address)
        try:
            if partitions:
                client.create_topic(TOPIC, partitions=partitions)
                with client.producer(linger_ms=0) as producer:
                    for partition in range(partitions):
                        producer.send(TOPIC, b"once", partition=partition)
                    producer.flush()
        finally:
            client.close()
        time.sleep(settle)
        before = {p.pid: (common.cpu_seconds(p.pid), common.thread_cpu_seconds(p.pid))
                  for p in services}
        time.sleep(seconds)
        cores: dict[str, float] = {}
        for p in services:
            total0, threads0 = before[p.pid]
            total = common.cpu_seconds(p.pid) - total0
            cores[p.role] = cores.get(p.role, 0.0) + total / seconds
            if p.role == "partition_server":
                loop = (common.thread_cpu_seconds(p.pid).get("event loop", 0.0)
                        - threads0.get("event loop", 0.0))
                cores["loops"] = cores.get("loops", 0.0) + loop / seconds
        cores["all"] = sum(v for k, v in cores.items() if k != "loops")
    return cores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", default="0,240,1000",
                        help="partition counts of the idle topic, one cell each (0: none)")
    parser.add_argument("--seconds", type=float, default=15, help="seconds measured a cell")
    parser.add_argument("--settle", type=float, default=8,
                        help="seconds after the topic is written before measuring")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the cells")
    parser.add_argument("--no-docs", action="store_true", help="print only")
    args = parser.parse_args()
    try:
        counts = sorted({int(v) for v in args.partitions.split(",")})
    except ValueError:
        parser.error("--partitions: comma-separated whole numbers")
    if not counts or counts[0] < 0 or counts[-1] > 4000 or args.seconds <= 0 \
            or args.settle < 0 or args.rounds < 1:
        parser.error("--partitions 0..4000, --seconds > 0, --settle >= 0, --rounds >= 1")
    load = os.getloadavg()[0]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: dict[int, list[dict]] = {count: [] for count in counts}
    for round_ in range(args.rounds):
        for count in common.rotated(counts, round_):
            cores = run_cell(count, args.seconds, args.settle)
            results[count].append(cores)
            print(f"round {round_ + 1}: {count} idle partitions: {cores['all']:.3f} cores "
                  f"(partition servers {cores.get('partition_server', 0):.3f}, their event "
                  f"loops {cores.get('loops', 0):.3f})", flush=True)

    def show(count: int, key: str) -> str:
        return common.median_range([r.get(key, 0.0) for r in results[count]], ".3f")

    base = counts[0]
    rows = ["| idle partitions (three copies) | whole cluster, cores | partition servers | "
            "their event loops | coordinators | id allocator | above the baseline, cores "
            "per 1,000 partitions |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for count in counts:
        extra = ""
        if count != base:
            above = (statistics.median(r["all"] for r in results[count])
                     - statistics.median(r["all"] for r in results[base]))
            extra = f"{above / (count - base) * 1000:.3f}"
        rows.append(f"| {count:,} | {show(count, 'all')} | {show(count, 'partition_server')} | "
                    f"{show(count, 'loops')} | {show(count, 'coordinator')} | "
                    f"{show(count, 'id_allocator')} | {extra or 'baseline'} |")
    text = "\n".join([
        BEGIN,
        "## An idle cluster's CPU, by its partitions (replication)",
        "",
        f"`{common.command_line('bench/idle_cost.py', sys.argv[1:])}` — {when}, "
        f"{common.machine(load)}.",
        f"Fresh clusters of three partition servers, two coordinators and an id allocator, "
        f"every topic of three copies (the 16 `__txn_log` partitions beside the idle "
        f"topic); each idle partition written once, then {args.settle:g} s to settle and "
        f"{args.seconds:g} s of nothing measured. CPU from /proc in cores (1.0: one core "
        f"busy); {args.rounds} rounds of the cells in rotating order: medians (ranges).",
        "",
        *rows,
        END, ""])
    print(text)
    if not args.no_docs:
        common.write_docs_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
