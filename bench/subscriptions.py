"""Benchmark (issue 19): a subscription consumer's loop, its calls on the partition
servers' links against gRPC.

A topic of `--partitions` partitions is preloaded with `--messages` 1 KiB records
(untimed). Then, in turns (`--rounds`), two consumers of new subscriptions each take all
of them with a loop of `poll(max_records=100)` and `ack()` (no prefetch: one Receive and
one Ack per 100 messages): one with the SDK's default (`Receive`, `Ack` on each partition
server's link, spark_client/link.py), one with `Client(links=False)` (every call over
gRPC), which is the same run's baseline. Per cell: messages/s, and the CPU of the servers
(every server process) and of this client process per 100 messages. The do-nothing gRPC
call rate of the same run (common.grpc_call_floor) is printed beside them. `--shape`:
the combined server (default) or the cluster (its 3 partition servers: with 3 partitions
a poll calls three servers at once).

    .venv/bin/python bench/subscriptions.py [--shape combined|cluster] [--rounds 3]
        [--messages 20000] [--partitions 1] [--no-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))  # after the packages: bench/coordinator.py is a script

import common  # noqa: E402

MARKERS = "<!-- bench/subscriptions.py --shape {}: {} -->"  # a section per shape
TOPIC = "bench-subscriptions"
PER_POLL = 100


def consume(address: str, pids: list[int], links: bool, messages: int) -> dict:
    """One consumer of a new subscription takes `messages` messages, 100 a poll, each
    poll acked: messages/s and CPU per 100 messages (servers, this client)."""
    from spark_client import Client

    with Client(address, links=links) as client:
        name = f"bench-{'link' if links else 'grpc'}-{time.monotonic_ns()}"
        with client.consumer(TOPIC, subscription=name, prefetch=0) as consumer:
            servers_before = sum(common.cpu_seconds(pid) for pid in pids)
            client_before = time.process_time()
            began = time.perf_counter()
            taken = 0
            while taken < messages:
                batch = consumer.poll(timeout_s=5, max_records=PER_POLL)
                if not batch:
                    raise RuntimeError(f"no message after {taken} of {messages}")
                consumer.ack(batch)
                taken += len(batch)
            seconds = time.perf_counter() - began
            servers = sum(common.cpu_seconds(pid) for pid in pids) - servers_before
            client_cpu = time.process_time() - client_before
        calls = client.links.calls
    return {"per_s": taken / seconds, "server_ms": servers / taken * PER_POLL * 1e3,
            "client_ms": client_cpu / taken * PER_POLL * 1e3, "link_calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("combined", "cluster"), default="combined")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    floor = common.grpc_call_floor()
    print(f"do-nothing gRPC calls: {floor['calls_per_s']:,.0f}/s", flush=True)
    roles = {"combined": 1} if args.shape == "combined" else None
    cells: dict[bool, list[dict]] = {True: [], False: []}
    with common.local_cluster("atomlog-bench-subscriptions-", roles) as (_, report, address):
        from spark_client import Client

        with Client(address) as client:
            client.create_topic(TOPIC, partitions=args.partitions)
            time.sleep(1)  # the partitions come online
            payload = os.urandom(1024)
            with client.producer(linger_ms=5) as producer:
                for i in range(args.messages):
                    producer.send(TOPIC, payload, partition=i % args.partitions)
                producer.flush()
        pids = [p.pid for p in report.cluster.processes if p.role != "zookeeper"]
        for turn in range(args.rounds):
            for links in ((True, False) if turn % 2 == 0 else (False, True)):
                cell = consume(address, pids, links, args.messages)
                cells[links].append(cell)
                print(f"round {turn + 1}, {'links' if links else 'gRPC '}: "
                      f"{cell['per_s']:,.0f} messages/s; per 100: server CPU "
                      f"{cell['server_ms']:.2f} ms, client {cell['client_ms']:.2f} ms "
                      f"({cell['link_calls']} calls on links)", flush=True)

    def median(links: bool, key: str) -> float:
        return statistics.median(c[key] for c in cells[links])

    def spread(links: bool, key: str, fmt: str) -> str:
        values = [c[key] for c in cells[links]]
        return f"{fmt.format(median(links, key))} ({fmt.format(min(values))}-" \
               f"{fmt.format(max(values))})"

    shape = ("the combined server" if args.shape == "combined" else
             "the cluster (3 partition servers, 2 coordinators, 1 id allocator)")
    begin, end = (MARKERS.format(args.shape, edge) for edge in ("begin", "end"))
    lines = [
        begin,
        f"`{common.command_line('bench/subscriptions.py', sys.argv[1:])}` — "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{common.machine(load)}. On {shape}, {args.messages:,} preloaded 1 KiB messages "
        f"on {args.partitions} partition(s); each cell a consumer of a new subscription "
        f"taking them all with `poll(max_records=100)` and `ack()`, no prefetch; "
        f"{args.rounds} rounds in turns, medians (ranges). The do-nothing gRPC call ran "
        f"at {floor['calls_per_s']:,.0f} calls/s in the same run.",
        "",
        "| calls | messages/s | servers' CPU per 100 messages, ms | client's CPU per 100 "
        "messages, ms |",
        "| --- | --- | --- | --- |",
    ]
    for links, label in ((True, "on the partition servers' links (the SDK's default)"),
                         (False, "over gRPC (`Client(links=False)`)")):
        lines.append(f"| {label} | {spread(links, 'per_s', '{:,.0f}')} | "
                     f"{spread(links, 'server_ms', '{:.2f}')} | "
                     f"{spread(links, 'client_ms', '{:.2f}')} |")
    lines += ["", f"On the links: {median(True, 'per_s') / median(False, 'per_s'):.2f}× the "
              f"messages/s, {median(True, 'server_ms') / median(False, 'server_ms'):.0%} of "
              f"the servers' CPU and {median(True, 'client_ms') / median(False, 'client_ms'):.0%}"
              " of the client's per message.", end]
    text = "\n".join(lines)
    print(text)
    if not args.no_docs:
        common.write_docs_section(text + "\n", begin, end)
        print("wrote its section of docs/benchmarks.md")


if __name__ == "__main__":
    main()
