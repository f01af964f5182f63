"""Benchmark (issue 19): the SDK's consumers with their calls on the partition servers'
links against gRPC.

A topic of `--partitions` partitions is preloaded with `--messages` 1 KiB records
(untimed). Then, in turns (`--rounds`), each consumer takes all of them twice: with the
SDK's default (its calls on each partition server's link, spark_client/link.py) and with
`Client(links=False)` (every call over gRPC), which is the same run's baseline:
- a subscription consumer (a new subscription each time): a loop of
  `poll(max_records=100)` and `ack()`, no prefetch (one Receive and one Ack per 100
  messages);
- a read_committed consumer from the earliest offset: `poll_arrow()` until it has them
  all (Fetch calls of up to its max_bytes_per_request, as the Spark source reads).
Per cell: messages/s, and the CPU of the servers (every server process) and of this
client process per 100 messages. The do-nothing gRPC call rate of the same run
(common.grpc_call_floor) is printed beside them. `--shape`: the combined server
(default) or the cluster (its 3 partition servers: with 3 partitions a poll calls three
servers at once).

    .venv/bin/python bench/consumers.py [--shape combined|cluster] [--rounds 3]
        [--messages 100000] [--partitions 1] [--no-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# After the packages: bench/coordinator.py is a script, not the package.
sys.path.append(str(Path(__file__).resolve().parent))

import common  # noqa: E402

MARKERS = "<!-- bench/consumers.py --shape {}: {} -->"  # a section per shape
TOPIC = "bench-consumers"
PER_POLL = 100


def consume(address: str, pids: list[int], links: bool, messages: int, kind: str) -> dict:
    """One consumer takes `messages` messages (`kind`: "subscription", 100 a poll, each
    poll acked; "read": a read_committed consumer's poll_arrow()): messages/s and CPU per
    100 messages (servers, this client)."""
    from spark_client import Client

    with Client(address, links=links) as client:
        if kind == "subscription":
            name = f"bench-{'link' if links else 'grpc'}-{time.monotonic_ns()}"
            consumer = client.consumer(TOPIC, subscription=name, prefetch=0)
        else:
            consumer = client.consumer(TOPIC, start="earliest", isolation="read_committed")
        with consumer:
            servers_before = sum(common.cpu_seconds(pid) for pid in pids)
            client_before = time.process_time()
            began = time.perf_counter()
            taken = 0
            while taken < messages:
                if kind == "subscription":
                    batch = consumer.poll(timeout_s=5, max_records=PER_POLL)
                    consumer.ack(batch)
                    got = len(batch)
                else:
                    got = consumer.poll_arrow(timeout_s=5).num_rows
                if not got:
                    raise RuntimeError(f"no message after {taken} of {messages}")
                taken += got
            seconds = time.perf_counter() - began
            servers = sum(common.cpu_seconds(pid) for pid in pids) - servers_before
            client_cpu = time.process_time() - client_before
        calls = client.links.calls
    return {"per_s": taken / seconds, "server_ms": servers / taken * PER_POLL * 1e3,
            "client_ms": client_cpu / taken * PER_POLL * 1e3, "link_calls": calls}


KINDS = {"subscription": "a subscription's poll(100) and ack()",
         "read": "a read_committed consumer's poll_arrow()"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("combined", "cluster"), default="combined")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    floor = common.grpc_call_floor()
    print(f"do-nothing gRPC calls: {floor['calls_per_s']:,.0f}/s", flush=True)
    roles = {"combined": 1} if args.shape == "combined" else None
    cells: dict[tuple[str, bool], list[dict]] = {(k, links): [] for k in KINDS
                                                  for links in (True, False)}
    with common.local_cluster("atomlog-bench-consumers-", roles) as (_, report, address):
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
            for kind in KINDS:
                for links in ((True, False) if turn % 2 == 0 else (False, True)):
                    cell = consume(address, pids, links, args.messages, kind)
                    cells[kind, links].append(cell)
                    print(f"round {turn + 1}, {kind}, {'links' if links else 'gRPC '}: "
                          f"{cell['per_s']:,.0f} messages/s; per 100: server CPU "
                          f"{cell['server_ms']:.2f} ms, client {cell['client_ms']:.2f} ms "
                          f"({cell['link_calls']} calls on links)", flush=True)

    def median(kind: str, links: bool, key: str) -> float:
        return statistics.median(c[key] for c in cells[kind, links])

    def spread(kind: str, links: bool, key: str, fmt: str) -> str:
        values = [c[key] for c in cells[kind, links]]
        return f"{fmt.format(median(kind, links, key))} ({fmt.format(min(values))}-" \
               f"{fmt.format(max(values))})"

    shape = ("the combined server" if args.shape == "combined" else
             "the cluster (3 partition servers, 2 coordinators, 1 id allocator)")
    begin, end = (MARKERS.format(args.shape, edge) for edge in ("begin", "end"))
    lines = [
        begin,
        f"`{common.command_line('bench/consumers.py', sys.argv[1:])}` — "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{common.machine(load)}. On {shape}, {args.messages:,} preloaded 1 KiB messages "
        f"on {args.partitions} partition(s), taken whole by each cell's consumer; "
        f"{args.rounds} rounds in turns, medians (ranges). The do-nothing gRPC call ran "
        f"at {floor['calls_per_s']:,.0f} calls/s in the same run.",
        "",
        "| consumer | calls | messages/s | servers' CPU per 100 messages, ms | client's CPU "
        "per 100 messages, ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind, label in KINDS.items():
        for links, way in ((True, "on the partition servers' links (the SDK's default)"),
                           (False, "over gRPC (`Client(links=False)`)")):
            lines.append(f"| {label} | {way} | {spread(kind, links, 'per_s', '{:,.0f}')} | "
                         f"{spread(kind, links, 'server_ms', '{:.2f}')} | "
                         f"{spread(kind, links, 'client_ms', '{:.2f}')} |")
    lines.append("")
    for kind, label in KINDS.items():
        lines.append(
            f"- {label[0].upper() + label[1:]}, on the links: "
            f"{median(kind, True, 'per_s') / median(kind, False, 'per_s'):.2f}× the "
            f"messages/s, {median(kind, True, 'server_ms') / median(kind, False, 'server_ms'):.0%}"
            f" of the servers' CPU and "
            f"{median(kind, True, 'client_ms') / median(kind, False, 'client_ms'):.0%} of the "
            "client's per message.")
    lines.append(end)
    text = "\n".join(lines)
    print(text)
    if not args.no_docs:
        common.write_docs_section(text + "\n", begin, end)
        print("wrote its section of docs/benchmarks.md")


if __name__ == "__main__":
    main()
