"""Micro-benchmark: how long segment deletions and rolls hold the event loop.

Every partition and TC partition of a server shares one event loop. A deletion
(retention, DeleteRecords) takes whole old segments away: it now renames their files to
*.deleted, fsyncs the directory and leaves the unlinks to a worker thread
(partition_server/log.py, `_delete_segment`); freeing a large file's blocks is what held
the loop before. A roll seals the active segment: it fsyncs it, writes its index file
(synced), creates the next segment's file and fsyncs the directory. A partition owner
did all of that inside its append, on the loop; it now rolls before a group that would
cross the segment's bounds, in halves: `roll_begin` and `roll_end` on the loop, the disk
work (`RollJob.run`) on a worker thread (partition_server/owner.py, `_begin_roll`).
Measured in one run, on this machine's disk:

- the floor: a small write and its fsync, p50 (`common.fsync_baseline`);
- deletions of --delete-mib MiB segments, one at a time by DeleteRecords, timed on the
  caller: with the unlinks inline (as before) and with them handed off (as now); the
  handed-off unlinks timed on their own;
- rolls of an idle log with --roll-mib MiB segments: whole (`PartitionLog.roll`, what
  the loop waited before), and in halves (the two that stay on the loop now, and the
  disk work on its own), here and on a slow disk (each of the roll's fsyncs --slow-ms
  later, as the fsync_slow failpoint makes them).

Prints two tables; --docs writes them to docs/benchmarks.md.

    .venv/bin/python bench/segments.py [--delete-mib 256] [--roll-mib 1] [--slow-ms 5] [--dir PATH] [--docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.append(str(Path(__file__).resolve().parent))  # after the project: bench/coordinator.py

import common  # noqa: E402

from partition_server.log import LogConfig, PartitionLog, unlink_files  # noqa: E402
from partition_server.record_batch import Record, encode_batch  # noqa: E402

MIB = 1 << 20
RECORDS, RECORD_BYTES = 64, 1_000  # a batch of about 64 KiB
DELETIONS = 3
ROLLS = 16
BEGIN = "<!-- BEGIN bench/segments.py -->"
END = "<!-- END bench/segments.py -->"


def make_batch() -> bytes:
    value = os.urandom(RECORD_BYTES)
    return encode_batch([Record(b"k%03d" % i, value) for i in range(RECORDS)],
                        timestamp_ms=1_000)


def deletions(directory: Path, batch: bytes, segment_mib: int, handed_off: bool) -> dict:
    """DELETIONS segments of `segment_mib` MiB deleted one at a time (DeleteRecords up to
    the next segment's base), each timed on the caller; handed off: the unlinks go to a
    list and are timed afterwards, as the owner's worker thread runs them."""
    per_segment = segment_mib * MIB // len(batch)
    log = PartitionLog(directory, LogConfig(segment_bytes=per_segment * len(batch)))
    held, unlinks, handed = [], [], []
    if handed_off:
        log.defer_unlink = handed.append
    try:
        for _ in range(DELETIONS + 1):
            log.append([batch] * per_segment)
        log.flush()
        for _ in range(DELETIONS):
            before = log.segments()[1].base_offset
            started = time.perf_counter()
            log.delete_records(before)
            held.append(time.perf_counter() - started)
            while handed:
                started = time.perf_counter()
                unlink_files(handed.pop())
                unlinks.append(time.perf_counter() - started)
    finally:
        log.close()
    return {"held": held, "unlinks": unlinks}


def rolls(directory: Path, batch: bytes, segment_mib: int, delay_s: float,
          halves: bool) -> dict:
    """ROLLS rolls of an idle log, its fsyncs `delay_s` later each (the slow disk) when
    given: each timed whole (`PartitionLog.roll`) or, with `halves`, its two halves on
    the caller (`roll_begin`, `roll_end`) apart from its disk work (`RollJob.run`)."""
    per_segment = max(1, segment_mib * MIB // len(batch))
    log = PartitionLog(directory, LogConfig(segment_bytes=per_segment * len(batch)))
    real_fsync = os.fsync
    held: list[float] = []
    disk: list[float] = []

    def slow_fsync(fd: int) -> None:
        time.sleep(delay_s)
        real_fsync(fd)

    fsync = slow_fsync if delay_s else real_fsync
    try:
        for _ in range(ROLLS):
            log.append([batch] * per_segment)
            log.flush()
            if not halves:
                os.fsync = fsync
                try:
                    started = time.perf_counter()
                    log.roll()
                    held.append(time.perf_counter() - started)
                finally:
                    os.fsync = real_fsync
                continue
            started = time.perf_counter()
            job = log.roll_begin()
            os.fsync = fsync  # the index file's fsyncs too
            try:
                begun = time.perf_counter()
                job.run(fsync)
                ran = time.perf_counter()
            finally:
                os.fsync = real_fsync
            log.roll_end(job)
            held.append(begun - started + time.perf_counter() - ran)
            disk.append(ran - begun)
    finally:
        log.close()
    return {"held": held, "disk": disk}


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.2f} / {max(values) * 1000:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delete-mib", type=int, default=256,
                        help="size of the segments deleted (storage.segment_bytes: 256 MiB)")
    parser.add_argument("--roll-mib", type=int, default=1, help="size of the segments rolled")
    parser.add_argument("--slow-ms", type=float, default=5.0,
                        help="the slow disk: each of a roll's fsyncs waits this first")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the logs go (default: a temporary directory in .)")
    parser.add_argument("--docs", action="store_true", help="write docs/benchmarks.md")
    args = parser.parse_args()
    batch = make_batch()
    with tempfile.TemporaryDirectory(prefix="atomlog-bench-", dir=args.dir or ".") as scratch:
        scratch = Path(scratch)
        floor = common.fsync_baseline(scratch)["p50"]
        inline = deletions(scratch / "inline", batch, args.delete_mib, False)
        handed = deletions(scratch / "handed", batch, args.delete_mib, True)
        slow = args.slow_ms / 1000
        roll_runs = {(disk, halves): rolls(scratch / f"rolls-{disk}-{halves}", batch,
                                           args.roll_mib, slow if disk == "slow" else 0.0,
                                           halves)
                     for disk in ("here", "slow") for halves in (False, True)}
    deleted = [
        "| floor: a small write and its fsync, p50 ms | a segment deleted (DeleteRecords), the caller "
        "held, p50 / max ms: unlinked inline (as before) | renamed, the directory synced, "
        "the unlink handed off (now) | the handed-off unlink on its own, p50 / max ms |",
        "| --- | --- | --- | --- |",
        f"| {floor:.2f} | {ms(inline['held'])} | {ms(handed['held'])} | "
        f"{ms(handed['unlinks'])} |",
    ]
    rolled = [
        "| disk | a roll whole, on the loop (as before), p50 / max ms | its two halves on "
        "the loop (now), p50 / max ms | its disk work on a worker thread, p50 / max ms |",
        "| --- | --- | --- | --- |",
    ] + [f"| {label} | {ms(roll_runs[disk, False]['held'])} | "
         f"{ms(roll_runs[disk, True]['held'])} | {ms(roll_runs[disk, True]['disk'])} |"
         for disk, label in (("here", "this disk"),
                             ("slow", f"each fsync {args.slow_ms:g} ms later"))]
    text = (f"{DELETIONS} deletions of a {args.delete_mib} MiB segment each way:\n\n"
            + "\n".join(deleted) + f"\n\n{ROLLS} rolls of {args.roll_mib} MiB segments "
            "each way:\n\n" + "\n".join(rolled))
    print(text)
    if args.docs:
        common.write_docs_section(
            f"{BEGIN}\n`bench/segments.py --delete-mib {args.delete_mib} --roll-mib "
            f"{args.roll_mib} --slow-ms {args.slow_ms:g}` "
            f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; 64 KiB batches). "
            f"{text}\n{END}", BEGIN, END)


if __name__ == "__main__":
    main()
