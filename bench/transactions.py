"""Benchmark (issue 6): transactions on the partition servers, through the Python SDK.

Starts its own local cluster in a temporary directory (1 id allocator, 2 coordinators,
3 partition servers, ZooKeeper), then measures:

1. Small transactions: C concurrent client processes (default 8), each in a loop:
   begin_transaction, 10 records of 1 KiB over 4 partitions, commit() (which waits for
   the sends, then for the durable decision). Transactions/s and commit() p50/p99, plus
   the whole transaction's p50/p99.
2. Produce throughput of one producer writing 1 KiB records as fast as it can for D
   seconds: idempotent without transactions, and with a transaction committed every
   100 ms. The overhead is the relative loss of records/s.
3. Fetch throughput of everything written in (2) from the start: read_committed vs
   read_uncommitted (one consumer, same data, MB/s).

Baselines in the same run: one small os.write + os.fsync (latency), and plain Python
appending the same bytes to a file with an fsync per 256 KiB (MB/s).

Prints a table and writes its section of docs/benchmarks.md.

    .venv/bin/python bench/transactions.py [--clients 8] [--seconds 10] [--no-docs]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))  # after the packages: bench/coordinator.py is a script

import common  # noqa: E402

from services import launcher  # noqa: E402

BEGIN, END = "<!-- bench/transactions.py: begin -->", "<!-- bench/transactions.py: end -->"
SMALL_TOPIC, STREAM_TOPIC = "bench-small-txn", "bench-txn-stream"
PARTITIONS = 16
RECORD = b"x" * 1024


def bootstrap(report) -> str:
    return next(p for p in report.cluster.processes if p.role == "id_allocator").grpc_address


# ------------------------------------------------------------------ small transactions
def small_client(address: str, index: int, seconds: float, start_at: float, out) -> None:
    from spark_client import Client

    client = Client(address)
    partitions = [(index * 4 + i) % PARTITIONS for i in range(4)]
    commits, totals, count = [], [], 0
    with client.producer(linger_ms=0) as producer:
        for _ in range(5):  # warm up: connections, producer registration, verification path
            txn = client.begin_transaction(timeout_s=30)
            for i in range(10):
                producer.send(SMALL_TOPIC, RECORD, partition=partitions[i % 4], txn=txn)
            txn.commit()
        while time.time() < start_at:
            time.sleep(0.001)
        deadline = start_at + seconds
        while time.time() < deadline:
            began = time.perf_counter()
            txn = client.begin_transaction(timeout_s=30)
            for i in range(10):
                producer.send(SMALL_TOPIC, RECORD, partition=partitions[i % 4], txn=txn)
            committing = time.perf_counter()
            txn.commit()
            ended = time.perf_counter()
            commits.append(ended - committing)
            totals.append(ended - began)
            count += 1
    client.close()
    out.put((count, commits, totals))


def small_transactions(address: str, clients: int, seconds: float) -> dict:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    start_at = time.time() + 8 + clients * 0.5
    workers = [context.Process(target=small_client, args=(address, i, seconds, start_at, out))
               for i in range(clients)]
    for worker in workers:
        worker.start()
    results = [out.get(timeout=seconds + 300) for _ in workers]
    for worker in workers:
        worker.join()
    count = sum(r[0] for r in results)
    commits = [c for r in results for c in r[1]]
    totals = [t for r in results for t in r[2]]
    return {"clients": clients, "transactions": count, "per_s": count / seconds,
            "commit_p50_ms": common.percentile(commits, 0.5) * 1e3,
            "commit_p99_ms": common.percentile(commits, 0.99) * 1e3,
            "txn_p50_ms": common.percentile(totals, 0.5) * 1e3,
            "txn_p99_ms": common.percentile(totals, 0.99) * 1e3}


# ------------------------------------------------------------------ throughput
def stream(address: str, seconds: float, transactional: bool, partition: int) -> dict:
    """One producer, 1 KiB records to one partition for `seconds`; with transactional,
    a transaction committed every 100 ms."""
    from spark_client import Client

    client = Client(address)
    sent = 0
    with client.producer(linger_ms=5) as producer:
        began = time.perf_counter()
        deadline = began + seconds
        txn, txn_began = None, began
        while True:
            now = time.perf_counter()
            if transactional and (txn is None or now - txn_began >= 0.1):
                if txn is not None:
                    txn.commit()
                if now >= deadline:
                    break
                txn, txn_began = client.begin_transaction(timeout_s=60), time.perf_counter()
            elif not transactional and now >= deadline:
                break
            for _ in range(256):
                producer.send(STREAM_TOPIC, RECORD, partition=partition, txn=txn)
            sent += 256
        producer.flush()
        elapsed = time.perf_counter() - began
    client.close()
    return {"records": sent, "seconds": elapsed, "per_s": sent / elapsed,
            "mb_s": sent * len(RECORD) / elapsed / 1e6}


def fetch_all(address: str, partition: int, isolation: str) -> dict:
    from spark_client import Client

    client = Client(address)
    with client.consumer(STREAM_TOPIC, isolation=isolation) as consumer:
        ends = consumer.end_offsets()
        for (topic, p), offset in ends.items():
            if p != partition:
                consumer.seek(topic, p, offset)  # read only `partition`
        end = ends[(STREAM_TOPIC, partition)]
        records = size = 0
        began = time.perf_counter()
        while consumer.assignment()[(STREAM_TOPIC, partition)] < end:
            for message in consumer.poll(timeout_s=1.0, max_records=100_000):
                records += 1
                size += len(message.value or b"")
        elapsed = time.perf_counter() - began
    client.close()
    return {"isolation": isolation, "records": records, "mb_s": size / elapsed / 1e6}


# ------------------------------------------------------------------ report
def section(command: str, load: float, baseline: dict, raw_mb_s: float, small: dict,
            plain: dict, txn: dict, reads: list[dict]) -> str:
    overhead = (1 - txn["per_s"] / plain["per_s"]) * 100
    lines = [
        BEGIN,
        "## Transactions on the partition servers (issue 6)",
        "",
        f"`{command}` — {time.strftime('%Y-%m-%d')}, {common.machine(load)}.",
        "A local cluster (1 id allocator, 2 coordinators, 3 partition servers, ZooKeeper)",
        "on this machine with the clients, all through the Python SDK.",
        "",
        f"Baselines in the same run: one small os.write + os.fsync {baseline['p50']:.2f} ms "
        f"(p50), {baseline['p99']:.2f} ms (p99); plain Python appending 1 KiB records with an "
        f"fsync per 256 KiB: {raw_mb_s:.0f} MB/s.",
        "",
        "| workload | figure | target / peers |",
        "| --- | --- | --- |",
        f"| small transactions: {small['clients']} client processes, 10 × 1 KiB over 4 "
        f"partitions, commit | **{small['per_s']:.0f} transactions/s**; commit() p50 "
        f"{small['commit_p50_ms']:.1f} ms, p99 {small['commit_p99_ms']:.1f} ms; whole "
        f"transaction p50 {small['txn_p50_ms']:.1f} ms, p99 {small['txn_p99_ms']:.1f} ms | "
        "target ≥ 2,600/s, p99 < 10 ms; PostgreSQL 2,576/s (p99 6.9 ms), Redis MULTI/EXEC "
        "5,503/s (p99 4.9 ms) |",
        f"| one producer, 1 KiB records, idempotent | {plain['per_s']:,.0f} records/s "
        f"({plain['mb_s']:.0f} MB/s) | |",
        f"| the same, a transaction committed every 100 ms | {txn['per_s']:,.0f} records/s "
        f"({txn['mb_s']:.0f} MB/s): **overhead {overhead:.1f}%** | target ≤ 3% (Kafka ~3%) |",
    ]
    by = {r["isolation"]: r for r in reads}
    ratio = by["read_committed"]["mb_s"] / by["read_uncommitted"]["mb_s"]
    lines += [
        f"| fetch of that data, read_uncommitted | {by['read_uncommitted']['mb_s']:.0f} MB/s | |",
        f"| fetch of that data, read_committed | {by['read_committed']['mb_s']:.0f} MB/s "
        f"(**{ratio * 100:.0f}%** of read_uncommitted) | target: within 10% |",
        "",
        "Reading: the small-transaction target is far out of reach, and CPU is why. One",
        "transaction here is about 17 gRPC calls between Python processes: from the client",
        "NewTxn, AddPartitionToTxn (4 partitions in one), one Produce per partition server",
        "(3) and EndTxn; between servers one VerifyTxnPartitions and one EndTxnOnPartition",
        "per partition server (3 + 3) and 4-5 appends to the TC log, each a Produce to the",
        "partition server holding `__txn_log-<k>`. Measured with one client, that costs",
        "about 23 ms of CPU per transaction over all processes (client 3.4 ms, the",
        "partition server holding the TC logs 6 ms, each coordinator 3.3 ms), so 2 CPUs",
        "top out near 80 transactions/s whatever the concurrency. 2,600/s needs under",
        "0.8 ms of CPU per transaction: many transactions per call (client batching), the",
        "TC log written in-process next to the coordinator (as Pulsar's TC writes its",
        "managed ledger) rather than by RPC, and registration folded into verification",
        "(Kafka's KIP-890) — not done yet.",
        f"The stream overhead ({overhead:.1f}%) is "
        + ("within the 3% target" if overhead <= 3 else "above the 3% target")
        + " in this run; it compares two runs one after the other on two partitions, and",
        "moves by several points between runs here. Every 100 ms a transaction adds",
        "NewTxn, AddPartitionToTxn, a verification and EndTxn, and the producer waits for",
        "its in-flight batches before each commit (the pipeline drains 10 times a second).",
        f"read_committed reads at {ratio * 100:.0f}% of read_uncommitted: "
        + ("within" if ratio >= 0.9 else "outside") + " the 10% target.",
        END,
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--no-docs", action="store_true", help="print only")
    args = parser.parse_args()
    command = "python bench/transactions.py" + "".join(
        f" {a}" for a in sys.argv[1:] if a != "--no-docs")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="atomlog-bench-txn-") as directory:
        data_dir = Path(directory)
        try:
            report = launcher.up(data_dir, {"id_allocator": 1, "coordinator": 2,
                                            "partition_server": 3}, {}, timeout_s=90)
            address = bootstrap(report)
            from spark_client import Client

            with Client(address) as client:
                client.create_topic(SMALL_TOPIC, partitions=PARTITIONS)
                client.create_topic(STREAM_TOPIC, partitions=PARTITIONS)
            time.sleep(3)  # leases settle
            baseline = common.fsync_baseline(data_dir)
            raw_s = common.raw_append_seconds(data_dir, RECORD * 256, 4_000, 1)
            raw_mb_s = 4_000 * 256 * len(RECORD) / raw_s / 1e6
            small = small_transactions(address, args.clients, args.seconds)
            print(f"small transactions: {small}", flush=True)
            plain = stream(address, args.seconds, False, 0)
            print(f"idempotent: {plain}", flush=True)
            txn = stream(address, args.seconds, True, 1)
            print(f"transactional: {txn}", flush=True)
            reads = [fetch_all(address, 1, isolation)
                     for isolation in ("read_uncommitted", "read_committed")]
            print(f"reads: {reads}", flush=True)
        finally:
            if (data_dir / launcher.CLUSTER_FILE).exists():
                launcher.down(data_dir, timeout_s=10)
    text = section(command, load, baseline, raw_mb_s, small, plain, txn, reads)
    print()
    print(text)
    if not args.no_docs:
        common.write_docs_section(text, BEGIN, END)
        print(f"wrote its section of {common.DOCS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
