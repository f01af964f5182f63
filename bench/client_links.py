"""Benchmark (issue 19): the SDK's consumers and producers with their calls on the
partition servers' links against gRPC. (Named bench/consumers.py until 2026-12-01, when
the producer's cell came.)

Each cell runs twice per round, in turns (`--rounds`): with the SDK's default (its
calls on each partition server's link, spark_client/link.py) and with
`Client(links=False)` (every call over gRPC), which is the same run's baseline.
`--kinds` picks the cells (each set of kinds writes a section of its own):
- subscription: a subscription consumer (a new subscription each time) takes the
  topic's `--messages` preloaded 1 KiB records in a loop of `poll(max_records=100)`
  and `ack()`, no prefetch (one Receive and one Ack per 100 messages);
- read: a read_committed consumer from the earliest offset takes them with
  `poll_arrow()` (Fetch calls of up to its max_bytes_per_request, as the Spark source
  reads);
- produce: an idempotent producer sends `--messages` 1 KiB records with `send()` over
  the partitions, its default linger (5 ms) and `batch_max_bytes=16 KiB`, each
  acknowledged (many small Produce calls: on the link, one pipelined connection per
  partition server).
Per cell: messages/s, and the CPU of the servers (every server process) and of this
client process per 100 messages. The do-nothing gRPC call rate of the same run
(common.grpc_call_floor) is printed beside them. `--shape`: the combined server
(default) or the cluster (its 3 partition servers: with 3 partitions a poll calls three
servers at once; every topic at the product default of 3 copies there, 1 on the
combined server, unless `--replication-factor` says otherwise).

    .venv/bin/python bench/client_links.py [--shape combined|cluster]
        [--kinds subscription,read] [--rounds 3] [--messages 100000] [--partitions 1]
        [--replication-factor 0] [--no-docs]
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

# A section per shape and set of kinds.
MARKERS = "<!-- bench/client_links.py --shape {} --kinds {}: {} -->"
TOPIC = "bench-consumers"
PER_POLL = 100
PRODUCE_BATCH_BYTES = 16 << 10


def run_cell(address: str, pids: list[int], links: bool, messages: int, kind: str,
             partitions: int) -> dict:
    """One cell: `messages` messages taken by a consumer (`kind` "subscription", 100 a
    poll, each poll acked; "read": a read_committed consumer's poll_arrow()) or sent by
    a producer ("produce"): messages/s and CPU per 100 messages (servers, this
    client)."""
    from spark_client import Client

    with Client(address, links=links) as client:
        if kind == "produce":
            topic = f"bench-produce-{'link' if links else 'grpc'}-{time.monotonic_ns()}"
            client.create_topic(topic, partitions=partitions)
            time.sleep(1)  # the partitions come online
            work = client.producer(batch_max_bytes=PRODUCE_BATCH_BYTES)
        elif kind == "subscription":
            name = f"bench-{'link' if links else 'grpc'}-{time.monotonic_ns()}"
            work = client.consumer(TOPIC, subscription=name, prefetch=0)
        else:
            work = client.consumer(TOPIC, start="earliest", isolation="read_committed")
        with work:
            servers_before = sum(common.cpu_seconds(pid) for pid in pids)
            client_before = time.process_time()
            began = time.perf_counter()
            futures = produce(work, topic, messages, partitions) if kind == "produce" \
                else ()
            taken = len(futures) or take(work, messages, kind)
            seconds = time.perf_counter() - began
            servers = sum(common.cpu_seconds(pid) for pid in pids) - servers_before
            client_cpu = time.process_time() - client_before
            for future in futures:  # (outside the timed window) every one acknowledged
                future.result(timeout=60)
        calls = client.links.calls
    return {"per_s": taken / seconds, "server_ms": servers / taken * PER_POLL * 1e3,
            "client_ms": client_cpu / taken * PER_POLL * 1e3, "link_calls": calls}


def take(consumer, messages: int, kind: str) -> int:
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
    return taken


def produce(producer, topic: str, messages: int, partitions: int) -> list:
    """`messages` 1 KiB records sent and flushed: their futures."""
    payload = os.urandom(1024)
    futures = [producer.send(topic, payload, partition=i % partitions)
               for i in range(messages)]
    producer.flush()
    return futures


KINDS = {"subscription": "a subscription's poll(100) and ack()",
         "read": "a read_committed consumer's poll_arrow()",
         "produce": "a producer's send() of 1 KiB records (16 KiB batches)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("combined", "cluster"), default="combined")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--replication-factor", type=int, default=0,
                        help="copies of every topic (0: the product default, 3 on the "
                             "cluster's 3 partition servers, 1 on the combined server)")
    parser.add_argument("--kinds", default="subscription,read",
                        help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    kinds = {kind: KINDS[kind] for kind in args.kinds.split(",")}  # (KeyError: no such kind)
    load = os.getloadavg()[0]
    floor = common.grpc_call_floor()
    print(f"do-nothing gRPC calls: {floor['calls_per_s']:,.0f}/s", flush=True)
    roles = {"combined": 1} if args.shape == "combined" else None
    cells: dict[tuple[str, bool], list[dict]] = {(k, links): [] for k in kinds
                                                  for links in (True, False)}
    with common.local_cluster("atomlog-bench-consumers-", roles,
                              replication_factor=args.replication_factor or None) \
            as (_, report, address):
        from spark_client import Client

        if set(kinds) - {"produce"}:  # the consumers' messages
            with Client(address) as client:
                client.create_topic(TOPIC, partitions=args.partitions)
                time.sleep(1)  # the partitions come online
                with client.producer(linger_ms=5) as producer:
                    for future in produce(producer, TOPIC, args.messages, args.partitions):
                        future.result(timeout=60)
        pids = [p.pid for p in report.cluster.processes if p.role != "zookeeper"]
        for turn in range(args.rounds):
            for kind in kinds:
                for links in ((True, False) if turn % 2 == 0 else (False, True)):
                    cell = run_cell(address, pids, links, args.messages, kind,
                                    args.partitions)
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

    copies = args.replication_factor or (1 if args.shape == "combined" else 3)
    shape = ("the combined server" if args.shape == "combined" else
             "the cluster (3 partition servers, 2 coordinators, 1 id allocator)") + (
        f", with its topics at {copies} cop{'y' if copies == 1 else 'ies'}"
        + (" (the product default)" if not args.replication_factor else "")
        + (", a leader's write acknowledged once its followers have it" if copies > 1
           else ""))
    where = args.shape + (f" --replication-factor {args.replication_factor}"
                          if args.replication_factor else "")
    begin, end = (MARKERS.format(where, ",".join(kinds), edge) for edge in ("begin", "end"))
    lines = [
        begin,
        f"`{common.command_line('bench/client_links.py', sys.argv[1:])}` — "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{common.machine(load)}. On {shape}: {args.messages:,} 1 KiB messages "
        f"on {args.partitions} partition(s), taken whole by each cell's consumer or sent "
        "by its producer; "
        f"{args.rounds} rounds in turns, medians (ranges). The do-nothing gRPC call ran "
        f"at {floor['calls_per_s']:,.0f} calls/s in the same run.",
        "",
        "| client | calls | messages/s | servers' CPU per 100 messages, ms | client's CPU "
        "per 100 messages, ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind, label in kinds.items():
        for links, way in ((True, "on the partition servers' links (the SDK's default)"),
                           (False, "over gRPC (`Client(links=False)`)")):
            lines.append(f"| {label} | {way} | {spread(kind, links, 'per_s', '{:,.0f}')} | "
                         f"{spread(kind, links, 'server_ms', '{:.2f}')} | "
                         f"{spread(kind, links, 'client_ms', '{:.2f}')} |")
    lines.append("")
    for kind, label in kinds.items():
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
