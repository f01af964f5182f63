"""Benchmark (issue 19, replication): what idle partitions cost the written ones on a
cluster of three copies, with fetch sessions, with the leaders' quiet-partition skipping
alone, and with neither (docs/replication.md, "Quiet partitions" and "Fetch sessions"),
for small transactions and for transactions that ack what they consume.

Each cell is a fresh local cluster of 1 id allocator, 2 coordinators and 3 partition
servers, every topic (`__txn_log` included) of three copies, as `atomlog up` makes it. A
topic of 16 partitions takes the load; in the cells with idle partitions, a second topic
of --idle partitions (three copies too) is created and written once per partition, then
left alone. One client commits transactions one after another for --seconds. With
`--workload small`, small one-call transactions (ten 1 KiB records over four partitions,
as bench/transactions.py's); with `--workload acks`, each transaction polls ten 1 KiB
inputs of a subscription of a 4-partition topic (preloaded), sends ten outputs to the
written topic and acks the inputs in the transaction (consume-transform-produce, ten at a
time): every commit then also moves a replicated cursor. Measured: transactions per
second, latency p50 / p90 (the commit; with acks, the whole transaction), the servers'
CPU per transaction (every process but ZooKeeper), the followers' ReplicateMany calls per
transaction (`atomlog_replica_fetch_calls_total`), the partitions they named
(`atomlog_replica_fetch_partitions_named_total`) and the fetchers' rounds the event loop
acted on (`atomlog_replica_fetch_loop_rounds_total`; the rest ran on the replication
link's thread). Then the cluster idles for 5 s: its servers' CPU. The modes: `sessions` (the defaults: `replication.fetch_sessions` and
`replication.skip_quiet_partitions`), `skip` (fetch sessions off: every call names every
partition, the leader skips the quiet ones) and `off` (both off).

The cells run in rotating order, --rounds times, and the table gives each cell's median
(and range). Baseline in the same run: the cells without idle partitions (what the
written topic costs alone), and each mode against the others.

    .venv/bin/python bench/quiet_partitions.py [--idle 240] [--seconds 10] [--rounds 2]
        [--modes sessions,skip,off] [--workload small|acks] [--no-docs]
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
INPUT_TOPIC, INPUT_PARTITIONS, SUBSCRIPTION = "qp-in", 4, "qp"
WARM_TRANSACTIONS, INPUTS_A_TRANSACTION, MOST_PER_S = 30, 10, 250
MODES = {"sessions": {},
         "skip": {"replication.fetch_sessions": "false"},
         "off": {"replication.fetch_sessions": "false",
                 "replication.skip_quiet_partitions": "false"}}
FETCH_CALLS = "atomlog_replica_fetch_calls_total"
NAMED = "atomlog_replica_fetch_partitions_named_total"
LOOP_ROUNDS = "atomlog_replica_fetch_loop_rounds_total"
WORKLOADS = ("small", "acks")
# Each workload's table in docs/benchmarks.md: (begin, end) markers and heading.
SECTIONS = {
    "small": ("<!-- bench/quiet_partitions.py: begin -->",
              "<!-- bench/quiet_partitions.py: end -->",
              "## Idle partitions beside written ones, three copies (replication)"),
    "acks": ("<!-- bench/quiet_partitions.py acks: begin -->",
             "<!-- bench/quiet_partitions.py acks: end -->",
             "## Idle partitions beside written ones, three copies, transactions that ack "
             "(replication)")}


def run_cell(idle: int, mode: str, seconds: float, workload: str = "small") -> dict:
    from spark_client import Client

    with common.local_cluster("quiet-", None, replication_factor=3,
                              settings=MODES[mode]) as (_data, report, address):
        services = [p for p in report.cluster.processes if p.role != "zookeeper"]
        partition_servers = [p.metrics_address for p in services
                             if p.role == "partition_server"]
        client = Client(address)
        try:
            client.create_topic(TOPIC, partitions=PARTITIONS)
            if idle:
                client.create_topic(IDLE_TOPIC, partitions=idle)
            consumer = None
            with client.producer(linger_ms=0) as producer:
                for partition in range(idle):  # every idle partition has a log end to ask
                    producer.send(IDLE_TOPIC, b"once", partition=partition)
                producer.flush()
                if workload == "acks":
                    client.create_topic(INPUT_TOPIC, partitions=INPUT_PARTITIONS)
                    inputs = INPUTS_A_TRANSACTION * int(WARM_TRANSACTIONS + MOST_PER_S * seconds)
                    with client.producer(linger_ms=5) as loader:
                        for i in range(inputs):
                            loader.send(INPUT_TOPIC, RECORD, partition=i % INPUT_PARTITIONS)
                    consumer = client.consumer(INPUT_TOPIC, subscription=SUBSCRIPTION,
                                               ack_timeout_s=120, prefetch=200)

                def one() -> None:
                    txn = client.begin_transaction(timeout_s=30)
                    if consumer is None:
                        for i in range(10):
                            producer.send(TOPIC, RECORD, partition=i % 4, txn=txn)
                    else:
                        messages = consumer.poll(timeout_s=10,
                                                 max_records=INPUTS_A_TRANSACTION)
                        if not messages:
                            raise SystemExit("the preloaded inputs ran out: raise MOST_PER_S")
                        for message in messages:
                            producer.send(TOPIC, message.value, partition=message.partition,
                                          txn=txn)
                        consumer.ack(messages, txn=txn)
                    txn.commit()

                for _ in range(WARM_TRANSACTIONS):  # warm: routes, sessions, every round
                    one()
                cpu0 = {p.pid: common.cpu_seconds(p.pid) for p in services}
                calls0, named0, loop0 = common.counter_totals(
                    partition_servers, (FETCH_CALLS, NAMED, LOOP_ROUNDS))
                latencies = []
                began = time.perf_counter()
                while time.perf_counter() - began < seconds:
                    start = time.perf_counter()
                    one()
                    latencies.append(time.perf_counter() - start)
                elapsed = time.perf_counter() - began
                count = len(latencies)
                cpu = sum(common.cpu_seconds(p.pid) - cpu0[p.pid] for p in services)
                calls, named, loop_rounds = common.counter_totals(
                    partition_servers, (FETCH_CALLS, NAMED, LOOP_ROUNDS))
                calls, named = calls - calls0, named - named0
                loop_rounds -= loop0
            if consumer is not None:
                consumer.close()
            idle0 = {p.pid: common.cpu_seconds(p.pid) for p in services}
            time.sleep(5)
            idle_cpu = sum(common.cpu_seconds(p.pid) - idle0[p.pid] for p in services) / 5
        finally:
            client.close()
    return {"txn_per_s": count / elapsed,
            "p50_ms": common.percentile(latencies, 0.5) * 1e3,
            "p90_ms": common.percentile(latencies, 0.9) * 1e3,
            "cpu_ms": cpu / count * 1e3, "calls": calls / count,
            "named": named / max(calls, 1), "loop_rounds": loop_rounds / count,
            "idle_cores": idle_cpu}


MODE_NAMES = {"sessions": "fetch sessions (the default)",
              "skip": "quiet ones skipped, every one named",
              "off": "every partition named and looked at"}


def cell_name(idle: int, mode: str) -> str:
    return (f"{idle} idle partitions" if idle else "no idle partitions") + \
        f", {MODE_NAMES[mode]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=240,
                        help="partitions of the idle topic (three copies each)")
    parser.add_argument("--seconds", type=float, default=10,
                        help="seconds of transactions a cell")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the cells")
    parser.add_argument("--modes", default="sessions,skip,off",
                        help="comma-separated modes (sessions, skip, off)")
    parser.add_argument("--workload", choices=WORKLOADS, default="small",
                        help="small: small one-call transactions; acks: transactions that "
                             "consume ten inputs, send ten outputs and ack the inputs "
                             "(each workload writes its own table)")
    parser.add_argument("--no-docs", action="store_true", help="print only")
    args = parser.parse_args()
    if args.idle < 1 or args.seconds <= 0 or args.rounds < 1:
        parser.error("--idle, --seconds and --rounds must be positive")
    modes = [mode for mode in args.modes.split(",") if mode]
    if not modes or any(mode not in MODES for mode in modes) or len(set(modes)) < len(modes):
        parser.error(f"--modes: distinct names among {', '.join(MODES)}")
    load = os.getloadavg()[0]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    cells = [(idle, mode) for idle in (0, args.idle) for mode in modes]
    results: dict[tuple[int, str], list[dict]] = {cell: [] for cell in cells}
    for round_ in range(args.rounds):
        for idle, mode in common.rotated(cells, round_):
            result = run_cell(idle, mode, args.seconds, args.workload)
            results[(idle, mode)].append(result)
            print(f"round {round_ + 1}: {cell_name(idle, mode)}: "
                  f"{result['txn_per_s']:.0f} txn/s, p50 {result['p50_ms']:.1f} ms, "
                  f"{result['cpu_ms']:.1f} ms CPU a transaction", flush=True)

    def show(cell, key: str, digits: int) -> str:
        return common.median_range([r[key] for r in results[cell]], f",.{digits}f")

    acks = args.workload == "acks"
    rows = [f"| cell | {'transactions that ack' if acks else 'small transactions'}/s | "
            f"{'transaction' if acks else 'commit'} p50 / p90 ms | servers' CPU ms a "
            "transaction | follower calls a transaction | partitions named a call | "
            "event-loop rounds a transaction | idle servers' CPU, cores |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cell in cells:
        rows.append(f"| {cell_name(*cell)} | {show(cell, 'txn_per_s', 0)} | "
                    f"{show(cell, 'p50_ms', 1)} / {show(cell, 'p90_ms', 1)} | "
                    f"{show(cell, 'cpu_ms', 1)} | {show(cell, 'calls', 1)} | "
                    f"{show(cell, 'named', 1)} | {show(cell, 'loop_rounds', 2)} | "
                    f"{show(cell, 'idle_cores', 2)} |")

    def ratio(key: str, idle: int, mode: str, against: str) -> str:
        on = statistics.median(r[key] for r in results[(idle, mode)])
        off = statistics.median(r[key] for r in results[(idle, against)])
        return f"{on / off:.2f}x"

    comparisons = []
    for mode, against in (("sessions", "skip"), ("sessions", "off"), ("skip", "off")):
        if mode in modes and against in modes:
            comparisons.append(
                f"`{mode}` against `{against}`: with {args.idle} idle partitions "
                f"{ratio('p50_ms', args.idle, mode, against)} the commit p50 and "
                f"{ratio('cpu_ms', args.idle, mode, against)} the servers' CPU a "
                f"transaction; without idle partitions "
                f"{ratio('p50_ms', 0, mode, against)} and "
                f"{ratio('cpu_ms', 0, mode, against)}.")

    begin, end, heading = SECTIONS[args.workload]
    workload = ("transactions that each poll ten 1 KiB inputs of a subscription (a "
                f"{INPUT_PARTITIONS}-partition topic), send them as outputs to a 16-partition "
                "topic and ack them in the transaction" if acks else
                "small one-call transactions (ten 1 KiB records over four partitions of a "
                "16-partition topic)")
    text = "\n".join([
        begin,
        heading,
        "",
        f"`{common.command_line('bench/quiet_partitions.py', sys.argv[1:])}` — {when}, "
        f"{common.machine(load)}.",
        f"Fresh clusters of three partition servers, every topic of three copies; one "
        f"client commits {workload} one after another, {args.seconds:g} s a "
        f"cell, beside a topic of {args.idle} idle partitions or none, in each mode: "
        f"{'; '.join(f'`{mode}`, {MODE_NAMES[mode]}' for mode in modes)}. "
        f"{args.rounds} rounds of the cells in rotating order: medians (ranges). Follower "
        f"calls: ReplicateMany calls of every follower; partitions named: what those "
        f"calls named, a call; event-loop rounds: the fetchers' rounds whose answers the "
        f"event loop acted on instead of the replication link's thread.",
        "",
        *rows,
        "",
        *comparisons,
        end, ""])
    print(text)
    if not args.no_docs:
        common.write_docs_section(text, begin, end)


if __name__ == "__main__":
    main()
