"""Benchmark (issue 7): the Spark data source's exactly-once write and its read, against
the same job through the plain idempotent producer, a no-op sink and Parquet files.

Starts its own local cluster in a temporary directory (1 id allocator, 2 coordinators,
3 partition servers, ZooKeeper; every topic, __txn_log included, at one copy by default,
like the Parquet files it is compared with: `--replication-factor 0` for the product
default of three copies) and one SparkSession (`local[2]`, the machine's 2 CPUs,
shared with the cluster), then measures, on a topic of 8 partitions:

1. **exactly once**: `df.write.format("atomlog")` of N rows (default 1,000,000) with
   100-byte string values, 8 Spark partitions: parent transaction, a prepared child per
   task, parent commit waiting for every marker. Each task hands the Arrow batches Spark
   gives it to `producer.send_batch()`, about 4 MiB at a time (no Python per row).
2. **idempotent foreachPartition**: the same DataFrame, `df.foreachPartition(...)` with a
   `Client(...).producer()` per partition sending each row and flushing (at-least-once:
   what users write today).
3. **no-op sink**: the same DataFrame written to a data source that discards the rows:
   Spark's own cost of producing and shipping them to Python (the floor of 1).
4. **Parquet write**: the same DataFrame appended to a Parquet directory (8 files, Spark's
   defaults) in the cluster's temporary directory, so that it ends up holding the same
   rows as the topic of 1.
5. **read**: `spark.read.format("atomlog")` of everything written by 1 (read_committed),
   counting the rows and summing the value lengths (so every row is decoded and
   shipped); the tasks yield an Arrow record batch per fetched columnar block (its key
   and value buffers as fetched).
6. **read, value only**: the read of 5 with the reader given the schema `value binary`
   (the column the Parquet files hold): the other columns are neither built nor shipped.
7. **Parquet read**: `spark.read.parquet(...)` of the directory written by 4 (the same
   rows), the same count and sum.

The write cells run in turn (1, 2, 3, 4, 4, 3, ...: in order, then in reverse) for R
rounds (default 2) after a warm-up of each (a tenth of N rows), then the read cells (5, 6,
7, 7, 6, ...) for R rounds after a read of each one's warm-up data; the best round of each is reported with every round listed, and
every read must see all N x R rows and their bytes. Client CPU: the CPU time, in that
round, of the Spark JVM and of the Python worker processes under it, from /proc (sampled
every 0.5 s: the pyspark daemon ignores SIGCHLD, so a worker's CPU counts nowhere once it
exits, and one exiting between samples loses at most that much). Targets: 1 at least 50%
of 3's rows/s and at least 2's; 6 (the same column as Parquet's) at least 50% of 7's.
The other baseline of the same
run: plain Python appending the same bytes (100-byte records in 256 KiB batches, an
fsync per batch) to a file on the same disk.

Prints a table and writes its section of docs/benchmarks.md.

    .venv/bin/python bench/spark.py [--rows 1000000] [--rounds 2] [--no-docs]
        [--replication-factor 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.append(str(REPO / "bench"))  # after the packages: bench/coordinator.py is a script

import common  # noqa: E402


BEGIN, END = "<!-- bench/spark.py: begin -->", "<!-- bench/spark.py: end -->"
PARTITIONS = 8
VALUE_BYTES = 100
EXACTLY_ONCE, FOREACH = "exactly once (data source)", "idempotent foreachPartition"
NOOP, PARQUET_WRITE = "no-op sink (Spark's floor)", "Parquet (local files)"
READ, PARQUET_READ = "atomlog, the exactly-once topic", "Parquet, the same rows"
READ_VALUE = "atomlog, the same topic, column value only"
TARGET = 0.5  # of the same run's no-op sink (writes) and Parquet read (reads)
BEFORE = ("2026-11-24 23:46, the same benchmark before the writer gathered Spark's "
          "batches and the reader handed Spark the fetched blocks: exactly once 328,689 "
          "rows/s, 36% of the no-op sink's 920,323; read 1,030,597 rows/s, 45% of the "
          "Parquet read's 2,301,562. With records stored row by row (2026-11-21): exactly "
          "once 69,664 rows/s, 12% of the no-op sink's 595,942; read 83,948 rows/s")


def frame(spark, rows: int):
    return spark.range(0, rows, numPartitions=PARTITIONS).selectExpr(
        f"lpad(cast(id as string), {VALUE_BYTES}, 'x') as value")


def write_atomlog(df, address: str, topic: str) -> None:
    (df.write.format("atomlog").option("bootstrap", address).option("topic", topic)
     .mode("append").save())


def write_foreach(df, address: str, topic: str) -> None:
    def send_partition(rows) -> None:
        from spark_client import Client

        with Client(address) as client, client.producer() as producer:
            for row in rows:
                producer.send(topic, row.value)
            producer.flush()

    df.foreachPartition(send_partition)


def write_noop(df, address: str, topic: str) -> None:
    df.write.format("atomlog-bench-noop").mode("append").save()


def write_parquet(df, address: str, path: str) -> None:
    df.write.mode("append").parquet(path)


def register_noop(spark) -> None:
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

    class Discard(DataSourceArrowWriter):
        def write(self, iterator):
            rows = sum(batch.num_rows for batch in iterator)
            return WriterCommitMessage() if rows >= 0 else None

    class Noop(DataSource):
        @classmethod
        def name(cls) -> str:
            return "atomlog-bench-noop"

        def writer(self, schema, overwrite):
            return Discard()

    spark.dataSource.register(Noop)


def totals(df) -> tuple[int, int]:
    """Rows and the sum of their value lengths: every row decoded and shipped."""
    from pyspark.sql.functions import count, length, lit
    from pyspark.sql.functions import sum as sum_

    row = df.select(count(lit(1)), sum_(length("value"))).first()
    return row[0], row[1] or 0


def read_atomlog(spark, address: str, topic: str) -> tuple[int, int]:
    return totals(spark.read.format("atomlog").option("bootstrap", address)
                  .option("topic", topic).load())


def read_atomlog_value(spark, address: str, topic: str) -> tuple[int, int]:
    """The read with the reader given the one column the Parquet files hold (`value`):
    the others are neither built nor shipped (Spark's Python data source API passes no
    column pruning on; a schema given to the reader names the columns it yields)."""
    return totals(spark.read.format("atomlog").option("bootstrap", address)
                  .option("topic", topic).schema("value binary").load())


def read_parquet(spark, address: str, path: str) -> tuple[int, int]:
    return totals(spark.read.parquet(path))


def read_tasks(spark, address: str, topic: str, path: str) -> tuple[int, int]:
    """Spark partitions (tasks) of the atomlog read and of the Parquet read."""
    return (spark.read.format("atomlog").option("bootstrap", address).option("topic", topic)
            .load().rdd.getNumPartitions(), spark.read.parquet(path).rdd.getNumPartitions())


class ClientCpu:
    """CPU seconds used so far by the Spark JVM and by every process under it (the
    pyspark daemons and the Python workers they fork), from /proc. The daemons ignore
    SIGCHLD, so an exited worker's CPU is added to no process: a thread samples every
    `interval_s` and keeps each worker's last figure."""

    def __init__(self, jvm_pid: int, interval_s: float = 0.5):
        self.jvm_pid = jvm_pid
        self._jvm = 0.0
        self._workers: dict[tuple[int, int], float] = {}  # (pid, start time): CPU seconds
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stopped.wait(interval_s):
            self._sample()

    def _sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        children: dict[int, list[int]] = {}
        cpu: dict[int, tuple[int, float]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            children.setdefault(int(fields[1]), []).append(int(name))
            cpu[int(name)] = (int(fields[19]), (int(fields[11]) + int(fields[12])) / tick)
        below, found = list(children.get(self.jvm_pid, ())), {}
        while below:
            pid = below.pop()
            if pid in cpu:
                start, seconds = cpu[pid]
                found[(pid, start)] = seconds
            below.extend(children.get(pid, ()))
        with self._lock:
            if self.jvm_pid in cpu:
                self._jvm = cpu[self.jvm_pid][1]
            self._workers.update(found)

    def snapshot(self) -> tuple[float, float]:
        """(Python workers, JVM) CPU seconds so far."""
        self._sample()
        with self._lock:
            return sum(self._workers.values()), self._jvm

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


@dataclass
class Measured:
    seconds: float
    python_cpu_s: float  # the Python workers'
    jvm_cpu_s: float


def play(cells: dict, rounds: int, rows: int, cpu: ClientCpu) -> dict[str, list[Measured]]:
    """Each cell, name: (function, arguments, warm-up arguments), called once with its
    warm-up arguments, then `rounds` times in turn (in order, then in reverse, ...: no
    cell is always the first after the warm-ups), every call handling `rows` rows (a
    read returns the rows and value bytes it saw, which must be all of them)."""
    for fn, _, warmup in cells.values():
        fn(*warmup)
    measured: dict[str, list[Measured]] = {name: [] for name in cells}
    order = list(cells)
    for round_ in range(rounds):
        for name in (order if round_ % 2 == 0 else order[::-1]):
            fn, arguments, _ = cells[name]
            before = cpu.snapshot()
            started = time.perf_counter()
            seen = fn(*arguments)
            seconds = time.perf_counter() - started
            python_s, jvm_s = (a - b for a, b in zip(cpu.snapshot(), before))
            if seen is not None and seen != (rows, rows * VALUE_BYTES):
                raise SystemExit(f"{name} saw {seen[0]:,} rows of {seen[1]:,} value bytes, "
                                 f"not {rows:,} of {rows * VALUE_BYTES:,}")
            measured[name].append(Measured(seconds, python_s, jvm_s))
            print(f"{name}: {rows / seconds:,.0f} rows/s ({seconds:.1f} s; client CPU "
                  f"{python_s:.1f} s Python workers, {jvm_s:.1f} s JVM)", flush=True)
    return measured


def best_rate(measured: list[Measured], rows: int) -> float:
    return rows / min(m.seconds for m in measured)


def table(heading: str, measured: dict[str, list[Measured]], rows: int) -> list[str]:
    lines = [f"| {heading} | rows | best s | rows/s | MB/s | Python workers CPU µs/row | "
             "JVM CPU µs/row | every round (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, rounds in measured.items():
        best = min(rounds, key=lambda m: m.seconds)
        lines.append(f"| {name} | {rows:,} | {best.seconds:.1f} | {rows / best.seconds:,.0f} "
                     f"| {rows * VALUE_BYTES / best.seconds / 1e6:.1f} "
                     f"| {best.python_cpu_s / rows * 1e6:.1f} "
                     f"| {best.jvm_cpu_s / rows * 1e6:.1f} "
                     f"| {', '.join(f'{m.seconds:.1f}' for m in rounds)} |")
    return lines


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def count_records(client, topic: str) -> str:
    """The topic's offsets below the max read position: in all, and the fewest and most
    of a partition (a read runs a Spark task per topic partition, or per maxOffsetsPerSplit
    offsets of one)."""
    consumer = client.consumer(topic)
    try:
        ends = consumer.end_offsets().values()
    finally:
        consumer.close()
    return f"{sum(ends):,} ({min(ends):,} to {max(ends):,} a partition)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per write")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of the write cells, then of the read cells")
    parser.add_argument("--no-docs", action="store_true", help="print only")
    parser.add_argument("--replication-factor", type=int,
                        default=common.BENCH_REPLICATION_FACTOR,
                        help="copies of every topic (0: the product default, three copies "
                             "with the three partition servers)")
    args = parser.parse_args()
    command = common.command_line("bench/spark.py", sys.argv[1:])
    load = os.getloadavg()[0]
    from spark_client import Client
    from spark_client.spark import local_session

    with common.local_cluster("atomlog-bench-spark-", down_timeout_s=30,
                              replication_factor=args.replication_factor) as (data_dir, _, address):
        client = Client(address)
        topics = {name: f"bench-spark-{name}" for name in ("exactly-once", "foreach",
                                                           "warmup")}
        for topic in topics.values():
            client.create_topic(topic, partitions=PARTITIONS)
        time.sleep(3)  # leases settle
        batch = (b"x" * VALUE_BYTES) * (256 * 1024 // VALUE_BYTES)
        batches = max(1, args.rows * VALUE_BYTES // len(batch))
        raw_s = common.raw_append_seconds(data_dir, batch, batches, 1)
        raw_mb_s = batches * len(batch) / raw_s / 1e6

        spark = local_session("atomlog-bench", master="local[2]")
        cpu = ClientCpu(spark.sparkContext._gateway.proc.pid)
        try:
            register_noop(spark)
            df = frame(spark, args.rows)
            # Warm-ups of a tenth of the rows (at least 20,000): with 20,000 the first
            # measured write used 4.5-5.8 s of JVM CPU against 1.7-2.2 in later rounds
            # (2026-11-25). With a tenth it still used 2.9-3.2 s and stayed the slowest
            # round of the exactly-once write; not explained yet (docs/benchmarks.md).
            warm = frame(spark, max(20_000, args.rows // 10))
            parquet = {name: str(data_dir / "parquet" / name) for name in ("rows", "warmup")}
            writes = play({
                EXACTLY_ONCE: (write_atomlog, (df, address, topics["exactly-once"]),
                               (warm, address, topics["warmup"])),
                FOREACH: (write_foreach, (df, address, topics["foreach"]),
                          (warm, address, topics["warmup"])),
                NOOP: (write_noop, (df, address, ""), (warm, address, "")),
                PARQUET_WRITE: (write_parquet, (df, address, parquet["rows"]),
                                (warm, address, parquet["warmup"])),
            }, args.rounds, args.rows, cpu)
            read_rows = args.rows * args.rounds
            reads = play({
                READ: (read_atomlog, (spark, address, topics["exactly-once"]),
                       (spark, address, topics["warmup"])),
                READ_VALUE: (read_atomlog_value, (spark, address, topics["exactly-once"]),
                             (spark, address, topics["warmup"])),
                PARQUET_READ: (read_parquet, (spark, address, parquet["rows"]),
                               (spark, address, parquet["warmup"])),
            }, args.rounds, read_rows, cpu)
            tasks = read_tasks(spark, address, topics["exactly-once"], parquet["rows"])
            parquet_bytes = sum(f.stat().st_size for f in Path(parquet["rows"]).rglob("*.parquet"))
            written = {name: count_records(client, topics[key])
                       for name, key in ((EXACTLY_ONCE, "exactly-once"), (FOREACH, "foreach"))}
        finally:
            cpu.stop()
            spark.stop()
            client.close()

    ours, plain, floor = (best_rate(writes[name], args.rows)
                          for name in (EXACTLY_ONCE, FOREACH, NOOP))
    read, read_value, parquet_read = (best_rate(reads[name], read_rows)
                                      for name in (READ, READ_VALUE, PARQUET_READ))
    round_shares = {name: [a.seconds and b.seconds / a.seconds
                           for a, b in zip(reads[name], reads[PARQUET_READ])]
                    for name in (READ, READ_VALUE)}
    write_shares = [a.seconds and b.seconds / a.seconds
                    for a, b in zip(writes[EXACTLY_ONCE], writes[NOOP])]
    met_rounds = sum(x >= TARGET for x in write_shares)
    read_met = sum(x >= TARGET for x in round_shares[READ])
    overhead = (plain / ours - 1) * 100
    lines = [
        BEGIN,
        "## Spark data source (issue 7)",
        "",
        f"`{command}` — {time.strftime('%Y-%m-%d')}, {common.machine(load, with_java=True)}.",
        "",
        __doc__.split("\n\n", 1)[1].split("\n\nPrints")[0].strip(),
        "",
        f"Baseline: raw append of the same bytes, {raw_mb_s:,.0f} MB/s.",
        "",
        *table("write", writes, args.rows),
        "",
        *table("read (count and sum of value lengths)", reads, read_rows),
        "",
        f"Records in the topics afterwards (offsets below the max read position, control "
        f"batches included): {', '.join(f'{k} {v}' for k, v in written.items())}.",
        "",
        f"- Exactly-once write: **{ours:,.0f} rows/s, {ours / floor:.0%} of the no-op sink's "
        f"{floor:,.0f}** (target at least {TARGET:.0%}: {verdict(ours >= TARGET * floor)}); "
        f"{ours / plain:.2f}x the idempotent foreachPartition job's {plain:,.0f} rows/s "
        f"(target at least 1x: {verdict(ours >= plain)}; as time, an overhead of "
        f"{overhead:+.0f}%, issue 7's target at most +10%). Round by round, each beside the "
        f"no-op sink of the same round: {', '.join(f'{x:.0%}' for x in write_shares)} "
        f"(at least {TARGET:.0%} in {met_rounds} of {len(write_shares)}).",
        f"- Read, the column the Parquet files hold (`value`): **{read_value:,.0f} rows/s, "
        f"{read_value / parquet_read:.0%} of the Parquet read's {parquet_read:,.0f}** (target "
        f"at least {TARGET:.0%}: {verdict(read_value >= TARGET * parquet_read)}); round by "
        f"round, each beside the Parquet read of the same round: "
        f"{', '.join(f'{x:.0%}' for x in round_shares[READ_VALUE])}.",
        f"- Read, all seven columns: {read:,.0f} rows/s, {read / parquet_read:.0%} of the "
        f"Parquet read's (target {verdict(read >= TARGET * parquet_read)}); round by round "
        f"{', '.join(f'{x:.0%}' for x in round_shares[READ])} (at least {TARGET:.0%} in "
        f"{read_met} of {len(round_shares[READ])}).",
        f"- Like with like: the same {args.rows * args.rounds:,} rows, written in this run "
        f"(the Parquet directory by cell 4 beside the topic of cell 1), each read after a "
        f"warm-up read in the same JVM and session. Not alike: the atomlog read runs "
        f"{tasks[0]} tasks (one per topic partition), the Parquet read {tasks[1]} (Spark "
        f"packs its {parquet_bytes / 1e6:.1f} MB of files into splits by size), and Parquet "
        f"stores the values compressed (dictionary, Snappy) while the topic holds them "
        f"uncompressed (the data source's default compression, none).",
        f"- Before: {BEFORE}.",
        "- The transactions cost a fixed few calls per task and per job (parent, a child and "
        "a prepare per task, one commit waiting for markers). Per row, the data source moves "
        "columns: Spark's Arrow batches go to send_batch() about 4 MiB at a time, and reads "
        "hand Spark an Arrow batch per fetched columnar block; foreachPartition unpickles a "
        "Row and calls send() per record. Parquet runs in the JVM alone (no Python worker).",
        END,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_docs:
        common.write_docs_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
