"""Benchmark (replication): what the scrubber costs the writes beside it, and how fast
it reads (docs/operations.md, "Scrubbing").

Each cell is a fresh local cluster (1 id allocator, 2 coordinators, 3 partition servers,
ZooKeeper), every topic of three copies as `atomlog up` makes it. A topic of 3
partitions is preloaded with --preload-mib MiB of 1 KiB records (so every partition
server holds that much in copies to read back), then one producer sends 1 KiB records
to it for --seconds, at most --in-flight unacknowledged: records/s acknowledged, and the
partition servers' CPU per MiB written. The cells differ only in the scrubber:

- `off` (`partition.scrub_bytes_per_s=0`): the baseline;
- `default rate, always scrubbing`: the default rate (4 MiB/s) with a 1 s interval, so a
  pass follows the last one at once (the default interval is a day: this is the worst
  minute of that day, not a typical one);
- `64 MiB/s, always scrubbing` and `unbounded` (1 GiB/s): the same, faster.

Measured in the scrubbing cells as well: the bytes the scrubbers read back a second (all
three servers; `atomlog_scrub_bytes_total`). Baseline in the same run, without servers:
this process reads one server's preloaded segment files around the page cache
(O_DIRECT, 4 MiB reads) with and without the scrubber's batch check
(`scrubber.scrub_span`, unpaced): the disk's read rate and what the check costs on top.

The cells run in rotating order, --rounds times; the table gives each cell's median (and
range). Prints the table and writes its section of docs/benchmarks.md.

    .venv/bin/python bench/scrub.py [--preload-mib 96] [--seconds 10] [--rounds 2]
        [--in-flight 64] [--cells off,default,64,unbounded] [--no-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))

import common  # noqa: E402

BEGIN, END = "<!-- bench/scrub.py: begin -->", "<!-- bench/scrub.py: end -->"
TOPIC, PARTITIONS, RECORD = "scrub-load", 3, b"s" * 1024
MIB = 1 << 20
CELLS = {  # --cells name: (the table's name, settings)
    "off": ("off", {"partition.scrub_bytes_per_s": "0"}),
    "default": ("default rate (4 MiB/s), always scrubbing", {
        "partition.scrub_bytes_per_s": str(4 * MIB), "partition.scrub_interval_ms": "1000"}),
    "64": ("64 MiB/s, always scrubbing", {
        "partition.scrub_bytes_per_s": str(64 * MIB), "partition.scrub_interval_ms": "1000"}),
    "unbounded": ("unbounded (1 GiB/s), always scrubbing", {
        "partition.scrub_bytes_per_s": str(1024 * MIB), "partition.scrub_interval_ms": "1000"}),
}
SCRUB_BYTES = "atomlog_scrub_bytes_total"


def send(producer, seconds: float, in_flight: int) -> int:
    """Send RECORD for `seconds`, at most `in_flight` unacknowledged; returns how many
    were acknowledged."""
    slots = threading.Semaphore(in_flight)
    acked = [0]
    failed: list = []

    def done(future) -> None:
        slots.release()
        if future.exception() is not None:
            failed.append(future.exception())
        else:
            acked[0] += 1

    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        slots.acquire()
        producer.send(TOPIC, RECORD, partition=i % PARTITIONS).add_done_callback(done)
        i += 1
    producer.flush()
    if failed:
        raise RuntimeError(f"{len(failed)} sends failed: {failed[0]}")
    return acked[0]


def partition_servers(report) -> list:
    return [p for p in report.cluster.processes if p.role == "partition_server"]


def run_cell(name: str, settings: dict, preload_mib: int, seconds: float,
             in_flight: int) -> dict:
    from spark_client import Client

    with common.local_cluster("atomlog-bench-scrub-", replication_factor=3,
                              settings=settings) as (_data_dir, report, address):
        client = Client(address)
        try:
            client.create_topic(TOPIC, partitions=PARTITIONS, replication_factor=3)
            with client.producer() as producer:
                send(producer, 0.5, in_flight)  # warm
                left = preload_mib * MIB // len(RECORD)
                futures = []
                for i in range(left):
                    futures.append(producer.send(TOPIC, RECORD, partition=i % PARTITIONS))
                    if len(futures) >= 4_096:
                        for future in futures:
                            future.result(60)
                        futures.clear()
                producer.flush()
                servers = partition_servers(report)
                metrics = [p.metrics_address for p in servers]
                time.sleep(2.0)  # the scrubbers' first pass begins (interval 1 s)
                cpu0 = sum(common.cpu_seconds(p.pid) for p in servers)
                (scrubbed0,) = common.counter_totals(metrics, (SCRUB_BYTES,))
                began = time.monotonic()
                acked = send(producer, seconds, in_flight)
                elapsed = time.monotonic() - began
                cpu = sum(common.cpu_seconds(p.pid) for p in servers) - cpu0
                (scrubbed,) = common.counter_totals(metrics, (SCRUB_BYTES,))
            held = sum(f.stat().st_size for f in
                       (Path(servers[0].data_dir) / "partitions").glob(f"{TOPIC}-*/*.log"))
        finally:
            client.close()
        if not held:
            raise RuntimeError("no segment files found for the preloaded topic")
    written_mib = acked * len(RECORD) / MIB
    return {"cell": name, "records_s": acked / elapsed,
            "cpu_ms_mib": cpu * 1000 / max(written_mib, 1e-9),
            "scrub_mib_s": (scrubbed - scrubbed0) / MIB / elapsed,
            "held_mib": held / MIB}


def read_baseline(directory: Path, preload_mib: int) -> dict:
    """The disk's O_DIRECT read rate, and with the scrubber's check, in this process,
    over segment files written here as a partition server writes them."""
    from partition_server import scrubber
    from partition_server.log import LogConfig, PartitionLog
    from partition_server.record_batch import Record, encode_batch

    partition_log = PartitionLog(directory, LogConfig(segment_bytes=64 * MIB))
    batch = encode_batch([Record(value=RECORD) for _ in range(16)])
    for _ in range(preload_mib * MIB // len(batch)):
        partition_log.append([batch])
    partition_log.flush()
    spans = partition_log.segment_spans(0, partition_log.log_end_offset)
    total = sum(span.end_position - span.position for span in spans)
    reader = scrubber._Reader()
    common.drop_page_cache()
    began = time.monotonic()
    for span in spans:
        fd = scrubber._open(span.path)
        try:
            position = span.position
            while position < span.end_position:
                position += len(reader.read(fd, position,
                                            min(scrubber.CHUNK, span.end_position - position)))
        finally:
            os.close(fd)
    raw = time.monotonic() - began
    pacer = scrubber.Pacer(1 << 40, threading.Event())
    cpu0, began = time.process_time(), time.monotonic()
    for span in spans:
        if scrubber.scrub_span(span, reader, pacer) is not None:
            raise RuntimeError("the baseline's own files look damaged")
    checked, cpu = time.monotonic() - began, time.process_time() - cpu0
    partition_log.close()
    return {"raw_mib_s": total / MIB / raw, "checked_mib_s": total / MIB / checked,
            "check_cpu_ms_mib": cpu * 1000 / (total / MIB)}


def section(results: list[dict], baseline: list[dict], args, when: str, load: float) -> str:
    by_cell: dict[str, list[dict]] = {}
    for result in results:
        by_cell.setdefault(result["cell"], []).append(result)
    off = statistics.median(r["records_s"] for r in by_cell[CELLS["off"][0]])
    lines = [
        BEGIN,
        f"`{common.command_line('bench/scrub.py', sys.argv[1:])}` ({when}; "
        f"{common.machine(load)}). Each cell a fresh cluster of three copies, "
        f"{args.preload_mib} MiB preloaded (each partition server holding "
        f"{statistics.median(r['held_mib'] for r in results):.0f} MiB of it in copies), "
        f"then one producer's 1 KiB records for {args.seconds:g} s with at most "
        f"{args.in_flight} unacknowledged; {args.rounds} rounds, medians (ranges):",
        "",
        "| cell | records/s acknowledged | of the same run's `off` | partition servers' CPU "
        "ms per MiB written | read back by the scrubbers, MiB/s (three servers) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in (CELLS[c][0] for c in args.cells.split(",")):
        cell = by_cell[name]
        rate = statistics.median(r["records_s"] for r in cell)
        lines.append(
            f"| {name} | {common.median_range([r['records_s'] for r in cell], ',.0f')} | "
            f"{rate / off:.0%} | "
            f"{common.median_range([r['cpu_ms_mib'] for r in cell], '.0f')} | "
            f"{common.median_range([r['scrub_mib_s'] for r in cell], '.1f')} |")
    lines += [
        "",
        "Baseline in the same run, no servers: this process reading "
        f"{args.preload_mib} MiB of segment files around the page cache (O_DIRECT, "
        f"{4} MiB reads) "
        f"{common.median_range([b['raw_mib_s'] for b in baseline], ',.0f')} MiB/s; with "
        "the scrubber's check of every batch (`scrubber.scrub_span`, unpaced) "
        f"{common.median_range([b['checked_mib_s'] for b in baseline], ',.0f')} MiB/s at "
        f"{common.median_range([b['check_cpu_ms_mib'] for b in baseline], '.2f')} ms of "
        "CPU per MiB.",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preload-mib", type=int, default=96,
                        help="MiB written before each cell (default 96)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="seconds of writes a cell (default 10)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    parser.add_argument("--in-flight", type=int, default=64,
                        help="unacknowledged records at most (default 64)")
    parser.add_argument("--cells", default=",".join(CELLS),
                        help=f"cells to run, off among them (default {','.join(CELLS)})")
    parser.add_argument("--no-docs", action="store_true", help="print only")
    args = parser.parse_args()
    if "off" not in args.cells.split(",") or not set(args.cells.split(",")) <= set(CELLS):
        parser.error(f"--cells: names among {', '.join(CELLS)}, off among them")
    import tempfile

    load = os.getloadavg()[0]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results, baseline = [], []
    names = args.cells.split(",")
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="atomlog-bench-scrub-read-") as directory:
            baseline.append(read_baseline(Path(directory) / "p", args.preload_mib))
            print(f"round {round_ + 1}: baseline {baseline[-1]}", flush=True)
        for name in common.rotated(names, round_):
            result = run_cell(*CELLS[name], args.preload_mib, args.seconds, args.in_flight)
            print(f"round {round_ + 1}: {result}", flush=True)
            results.append(result)
    text = section(results, baseline, args, when, load)
    print(text)
    if not args.no_docs:
        common.write_docs_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
