"""Micro-benchmark: how long a snapshot holds the event loop, at the tables' default bounds.

A partition owner snapshots its producer state and transaction buffer every ~1,000 batches
or 5 s, and a TC partition its table every 20,000 records or 5 minutes, on the event loop
every partition and TC partition of the process shares: while one encodes, nothing else
runs. Each table here is filled to its default bound through its own API (the
transaction buffer: 10,000 remembered commits and 100,000 aborts; the producer table:
10,000 producers with 5 batches each; the TC partition: 100,000 finished transactions,
each with its idempotency key, replayed from their records), then changed as one
snapshot interval would change it, then snapshotted. The same tables stay in the server's
heap, where a full garbage collection scans whatever in them the collector tracks, the
event loop held as during a snapshot. Beside each, in the same run:
- the table's full encoding (`encode_snapshot` of its state: what every snapshot did
  before its rows were kept; the TC partition keeps no such function);
- the floor for any snapshot of that size: one copy of its bytes and their CRC32C;
- a full collection with the table held, against one of the same process once the table
  is gone.
Prints a table; --docs writes it to docs/benchmarks.md.

    .venv/bin/python bench/snapshots.py [--repeat 5] [--docs]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))  # after the project: bench/coordinator.py

import common  # noqa: E402
import crc32c  # noqa: E402

from coordinator.core import replay  # noqa: E402
from coordinator.records import (  # noqa: E402
    Completed, Decided, Decision, EndCause, Opened, TopicPartition,
)
from partition_server.producer_state import ProducerStateTable  # noqa: E402
from partition_server.producer_state import encode_snapshot as encode_producers  # noqa: E402
from partition_server.record_batch import ControlType, TxnId  # noqa: E402
from partition_server.txn_buffer import TxnBuffer  # noqa: E402
from partition_server.txn_buffer import encode_snapshot as encode_txn_buffer  # noqa: E402

NOW = 1_700_000_000_000
BEGIN = "<!-- BEGIN bench/snapshots.py -->"
END = "<!-- END bench/snapshots.py -->"


def best_ms(call, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times) * 1000


def full_collection_ms(repeat: int) -> float:
    return best_ms(gc.collect, repeat)


def floor_ms(data: bytes, repeat: int) -> float:
    return best_ms(lambda: crc32c.crc32c(bytearray(data)), repeat)  # one copy, its CRC


class TxnBufferCase:
    name = "transaction buffer: 10,000 commits remembered, 100,000 aborts indexed"

    def __init__(self) -> None:
        self.buffer = TxnBuffer()
        self.offset = 0
        self.sequence = 0
        for index in range(110_000):
            self.end_one(ControlType.COMMIT if index % 11 == 0 else ControlType.ABORT)
        self.buffer.on_durable(self.offset)

    def end_one(self, decision: ControlType) -> None:
        self.sequence += 1
        txn = TxnId(1 + self.sequence % 16, self.sequence)
        self.buffer.check_write(txn, 7, 0)
        self.buffer.on_data(txn, 7, 0, self.offset, self.offset + 9, NOW)
        self.buffer.check_marker(txn, decision, 1)
        self.buffer.on_marker(txn, decision, 1, self.offset + 10)
        self.offset += 11

    def interval(self) -> None:
        """A snapshot interval's worth of change: 500 transactions, 1,000 batches."""
        for index in range(500):
            self.end_one(ControlType.ABORT if index % 10 == 0 else ControlType.COMMIT)
        self.buffer.on_durable(self.offset)

    def snapshot(self) -> bytes:
        return self.buffer.snapshot(self.offset)

    def full(self) -> bytes:
        return encode_txn_buffer(self.offset, self.buffer.state())


class ProducersCase:
    name = "producer state: 10,000 producers, 5 batches each"

    def __init__(self) -> None:
        self.table = ProducerStateTable(max_producers=10_000, idle_expiry_ms=10**12)
        self.offset = 0
        self.rounds = 5  # batches each producer has written
        for batch in range(5):
            for producer in range(1, 10_001):
                self.append(producer, batch)

    def append(self, producer: int, batch: int) -> None:
        self.table.apply(producer, 0, batch * 10, batch * 10 + 9, self.offset,
                         self.offset + 9, NOW)
        self.offset += 10

    def interval(self) -> None:
        """1,000 batches from 200 producers (a busy interval touches few of 10,000)."""
        for producer in range(1, 1_001):
            self.append(producer % 200 + 1, self.rounds + producer // 200)
        self.rounds += 5

    def snapshot(self) -> bytes:
        return self.table.snapshot(self.offset)

    def full(self) -> bytes:
        return encode_producers(self.offset, self.table.entries().values())


class TcPartitionCase:
    name = "TC partition: 100,000 finished transactions with idempotency keys"
    tc = 3

    def __init__(self) -> None:
        self.sequence = 0
        self.core = replay(self.records(100_000), self.tc)

    def records(self, count: int):
        for _ in range(count):
            self.sequence += 1
            txn_id = TxnId(self.tc, self.sequence)
            yield Opened(txn_id, NOW, 60_000, NOW + 60_000,
                         idempotency_key=f"query-{self.sequence % 997}/batch-{self.sequence}",
                         topic_partitions=(TopicPartition("orders", self.sequence % 12),))
            yield Decided(txn_id, Decision.COMMIT, EndCause.CLIENT, NOW + 1)
            yield Completed(txn_id, Decision.COMMIT, NOW + 2)

    def interval(self) -> None:
        replay(self.records(1_000), self.tc, base=self.core)

    def snapshot(self) -> bytes:
        return self.core.snapshot()

    full = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="best of N (default 5)")
    parser.add_argument("--docs", action="store_true", help="write docs/benchmarks.md")
    args = parser.parse_args()
    rows = []
    for case_type in (TxnBufferCase, ProducersCase, TcPartitionCase):
        case = case_type()
        gc_with = full_collection_ms(args.repeat)
        case.snapshot()  # the previous snapshot: the interval then changes the table
        times = []
        for _ in range(args.repeat):
            case.interval()
            started = time.perf_counter()
            data = case.snapshot()
            times.append(time.perf_counter() - started)
        snapshot_ms = min(times) * 1000
        full_ms = best_ms(case.full, args.repeat) if case.full else None
        if case.full:
            assert case.full() == data, case.name  # the same bytes either way
        name, size, floor = case.name, len(data), floor_ms(data, args.repeat)
        del case, data
        rows.append((name, size, snapshot_ms, full_ms, floor, gc_with,
                     full_collection_ms(args.repeat)))
    lines = [
        "| table | snapshot bytes | snapshot (rows kept packed), ms | every row packed afresh "
        "(`encode_snapshot`), ms | floor: copy + CRC32C of the bytes, ms | a full garbage "
        "collection with the table held / once it is gone, ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, size, snapshot_ms, full_ms, floor, gc_with, gc_without in rows:
        full = "—" if full_ms is None else f"{full_ms:.1f}"
        lines.append(f"| {name} | {size:,} | {snapshot_ms:.1f} | {full} | {floor:.2f} | "
                     f"{gc_with:.1f} / {gc_without:.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.docs:
        common.write_docs_section(
            f"{BEGIN}\n`bench/snapshots.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
            f", best of {args.repeat}):\n\n{table}\n{END}", BEGIN, END)


if __name__ == "__main__":
    main()
