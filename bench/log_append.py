"""Micro-benchmark: PartitionLog append + group-commit flush vs raw os.write + fsync.

Appends batches of 1 KiB records (64 KiB batches by default), one append call per batch as
a partition owner would for separate Produce requests, and one flush (fsync) per 8 batches;
the raw baseline writes the same bytes with os.write and fsyncs at the same points, in the
same run and directory. Then reads the log back in 1 MiB fetches. Prints only.

    .venv/bin/python bench/log_append.py [--total-mib 512] [--batch-kib 64] [--dir PATH]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from partition_server.log import LogConfig, PartitionLog  # noqa: E402
from partition_server.record_batch import Record, encode_batch  # noqa: E402

MIB = 1 << 20


def make_batch(batch_kib: int, record_bytes: int) -> bytes:
    count = max(1, batch_kib * 1024 // record_bytes)
    value = os.urandom(record_bytes)
    return encode_batch([Record(b"key-%06d" % i, value) for i in range(count)], timestamp_ms=0)


def raw_baseline(directory: Path, batch: bytes, batches: int, per_flush: int) -> float:
    return common.raw_append_seconds(directory, batch, batches, per_flush)


def log_append(directory: Path, batch: bytes, batches: int, per_flush: int,
               one_call: bool) -> tuple[float, PartitionLog]:
    log_dir = directory / "log"
    shutil.rmtree(log_dir, ignore_errors=True)
    log = PartitionLog(log_dir, LogConfig(segment_bytes=1 << 30))
    started = time.perf_counter()
    if one_call:
        group = [batch] * per_flush
        for _ in range(batches // per_flush):
            log.append(group)
            log.flush()
    else:
        for i in range(batches):
            log.append([batch])
            if (i + 1) % per_flush == 0:
                log.flush()
    log.flush()
    return time.perf_counter() - started, log


def read_all(log: PartitionLog, fetch_bytes: int) -> tuple[float, int]:
    offset, total = 0, 0
    started = time.perf_counter()
    while offset < log.high_watermark:
        data, offset = log.read(offset, fetch_bytes)
        total += len(data)
    return time.perf_counter() - started, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--batch-kib", type=int, default=64)
    parser.add_argument("--record-bytes", type=int, default=1024)
    parser.add_argument("--batches-per-flush", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir in .)")
    args = parser.parse_args()

    batch = make_batch(args.batch_kib, args.record_bytes)
    batches = max(args.batches_per_flush, args.total_mib * MIB // len(batch))
    batches -= batches % args.batches_per_flush
    megabytes = batches * len(batch) / 1e6
    directory = Path(tempfile.mkdtemp(prefix="atomlog-bench-", dir=args.dir or "."))
    print(f"{batches} batches of {len(batch)} bytes ({len(batch) // args.record_bytes} records of "
          f"{args.record_bytes} B), fsync every {args.batches_per_flush} batches, "
          f"{megabytes:.0f} MB per run, {args.rounds} rounds, in {directory}")
    results: dict[str, list[float]] = {"raw os.write+fsync": [], "log append x1 + flush": [],
                                       "log append x8 + flush": [], "log read 1 MiB fetches": []}
    try:
        for _ in range(args.rounds):
            results["raw os.write+fsync"].append(
                megabytes / raw_baseline(directory, batch, batches, args.batches_per_flush))
            elapsed, log = log_append(directory, batch, batches, args.batches_per_flush, False)
            results["log append x1 + flush"].append(megabytes / elapsed)
            log.close()
            elapsed, log = log_append(directory, batch, batches, args.batches_per_flush, True)
            results["log append x8 + flush"].append(megabytes / elapsed)
            elapsed, total = read_all(log, MIB)
            results["log read 1 MiB fetches"].append(total / 1e6 / elapsed)
            log.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    raw = statistics.median(results["raw os.write+fsync"])
    for name, values in results.items():
        median = statistics.median(values)
        ratio = f"{median / raw:6.1%} of raw" if "append" in name else ""
        print(f"{name:26s} median {median:8.1f} MB/s  "
              f"(runs: {', '.join(f'{v:.0f}' for v in values)})  {ratio}")


if __name__ == "__main__":
    main()
