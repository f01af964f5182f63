"""Micro-benchmark: how long segment rolls and deletions hold the event loop.

A roll seals the active segment: it fsyncs it, writes its index file (synced), creates the
next segment's file and fsyncs the directory. A deletion (retention, DeleteRecords) takes
whole old segments away. A partition owner used to do both on the event loop that every
partition and TC partition of the process shares. It now runs a roll's disk work on a
worker thread, holding only its own partition's writes meanwhile (partition_server/
owner.py, `_begin_roll`), and a deletion renames the files to *.deleted, fsyncs the
directory and leaves the unlinks to a worker thread (partition_server/log.py,
`_delete_segment`). Measured in one run, on this machine's disk and on a slow one (each
fsync through the owner first waits --slow-ms, as the fsync_slow failpoint makes it):

- the floor: one fsync of a freshly written 64 KiB, on the same disk;
- rolls of an idle log, each timed whole (what the event loop was held for when the
  owner rolled inside its append) and in the two halves that stay on the loop now
  (`roll_begin`, `roll_end`);
- a real PartitionOwner taking --mib MiB of 64 KiB batches (built beforehand) from four
  producers, while a heartbeat task on the same loop asks to wake every millisecond: its
  lateness is how long the loop was held by anything (appends, answers, rolls). Three
  runs: segments too large to roll; 1 MiB segments rolled inside the append, on the loop
  (the owner before this change: `roll_due` made to say no, so the log rolls inline);
  1 MiB segments rolled on a thread (as it is). Each roll's disk work is timed;
- deletions of --delete-mib MiB segments (this machine's disk only), one at a time by
  DeleteRecords, timed on the caller: with the unlinks inline (as before) and with them
  handed off (as now); the handed-off unlinks are timed on their own.

Prints three tables; --docs writes them to docs/benchmarks.md.

    .venv/bin/python bench/segments.py [--mib 64] [--slow-ms 5] [--delete-mib 256] [--dir PATH] [--docs]
"""

from __future__ import annotations

import argparse
import asyncio
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
from partition_server.owner import OwnerSettings, PartitionOwner  # noqa: E402
from partition_server.record_batch import Record, encode_batch, parse_header  # noqa: E402

MIB = 1 << 20
SEGMENT_BYTES = MIB
RECORDS, RECORD_BYTES = 64, 1_000  # a batch of about 64 KiB
PRODUCERS = 4
ROLLS_IDLE = 16
BEGIN = "<!-- BEGIN bench/segments.py -->"
END = "<!-- END bench/segments.py -->"
DELETIONS = 3


def slow_fsync(delay_s: float):
    def fsync(fd: int) -> None:
        if delay_s:
            time.sleep(delay_s)
        os.fsync(fd)
    return fsync


def make_batch(producer_id: int | None = None, sequence: int = 0) -> bytes:
    """About 64 KiB; idempotent (a producer id and sequence) when `producer_id` is given."""
    value = os.urandom(RECORD_BYTES)
    records = [Record(b"k%03d" % i, value) for i in range(RECORDS)]
    if producer_id is None:
        return encode_batch(records, timestamp_ms=1_000)
    return encode_batch(records, producer_id=producer_id, base_sequence=sequence,
                        timestamp_ms=1_000)


def fsync_floor_ms(directory: Path, batch: bytes, fsync, count: int = 20) -> float:
    """p50 of write + fsync of one batch to a new file, through `fsync`."""
    path = directory / "floor.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    times = []
    try:
        for _ in range(count):
            os.write(fd, batch)
            started = time.perf_counter()
            fsync(fd)
            times.append(time.perf_counter() - started)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(times) * 1000


def rolls_on_the_loop(directory: Path, batch: bytes, rolls: int, fsync) -> dict:
    """Rolls of an idle PartitionLog, each timed whole (what the owner's event loop was
    held for when it rolled inside the append) and in the two halves that stay on the
    loop now (roll_begin and roll_end, without the disk work between)."""
    log = PartitionLog(directory, LogConfig(segment_bytes=SEGMENT_BYTES))
    whole, halves = [], []
    try:
        for _ in range(rolls):
            while not log.roll_due(len(batch)):
                log.append([batch])
            log.flush()
            started = time.perf_counter()
            job = log.roll_begin()
            began = time.perf_counter()
            job.run(fsync)
            ran = time.perf_counter()
            log.roll_end(job)
            ended = time.perf_counter()
            whole.append(ended - started)
            halves.append((began - started) + (ended - ran))
    finally:
        log.close()
    return {"whole": whole, "halves": halves}


async def owner_run(directory: Path, batches: list[list[bytes]], segment_bytes: int,
                    fsync) -> dict:
    """A real owner taking the producers' `batches` (each producer's in order, all at
    once) while a heartbeat task on the same loop asks to wake every millisecond."""
    settings = OwnerSettings(log=LogConfig(segment_bytes=segment_bytes))
    owner = PartitionOwner("bench", 0, directory, settings, fsync=fsync)
    await owner.start()
    late: list[float] = []
    stop = asyncio.Event()

    async def heartbeat() -> None:
        while not stop.is_set():
            asked = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append(time.perf_counter() - asked - 0.001)

    async def producer(own: list[bytes]) -> None:
        for data in own:
            await owner.produce([(data, parse_header(data))])

    beat = asyncio.ensure_future(heartbeat())
    started = time.perf_counter()
    await asyncio.gather(*(producer(own) for own in batches))
    elapsed = time.perf_counter() - started
    stop.set()
    await beat
    segments, size = owner.log.segment_count, owner.log.size_bytes
    await owner.close()
    return {"late": late, "segments": segments, "mib_per_s": size / MIB / elapsed}


def run_owner(directory: Path, batches: list[list[bytes]], fsync, how: str) -> dict:
    """owner_run with `how` = "none" (segments too large to roll), "inline" (each roll
    whole inside the append, on the event loop: the owner before its rolls moved to a
    thread) or "thread" (as it is); each roll's disk work timed."""
    from partition_server import log as log_module
    times: list[float] = []
    run, roll_due = log_module.RollJob.run, log_module.PartitionLog.roll_due

    def timed(self, fsync_=None):
        started = time.perf_counter()
        try:
            return run(self, fsync)  # the slow disk's fsync also for an inline roll
        finally:
            times.append(time.perf_counter() - started)

    log_module.RollJob.run = timed
    if how == "inline":
        log_module.PartitionLog.roll_due = lambda self, extra_bytes: False
    try:
        result = asyncio.run(owner_run(directory, batches,
                                       1 << 30 if how == "none" else SEGMENT_BYTES, fsync))
    finally:
        log_module.RollJob.run, log_module.PartitionLog.roll_due = run, roll_due
    result["rolls"] = times
    return result


def deletions(directory: Path, segment_mib: int, handed_off: bool) -> dict:
    """DELETIONS segments of `segment_mib` MiB deleted one at a time (DeleteRecords up to
    the next segment's base), each timed on the caller; handed off: the unlinks go to a
    list and are timed afterwards, as a worker thread would run them."""
    batch = make_batch()
    per_segment = segment_mib * MIB // len(batch)
    log = PartitionLog(directory, LogConfig(segment_bytes=per_segment * len(batch)))
    held, unlinks, handed = [], [], []
    if handed_off:
        log.defer_unlink = handed.append
    try:
        for _ in range(DELETIONS + 1):
            log.append([batch] * per_segment)
        log.flush()
        for turn in range(1, DELETIONS + 1):
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


def quantile_ms(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB the owner takes per run")
    parser.add_argument("--slow-ms", type=float, default=5.0,
                        help="the slow disk: each fsync through the owner waits this first")
    parser.add_argument("--delete-mib", type=int, default=256,
                        help="size of the segments deleted (storage.segment_bytes: 256 MiB)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the logs go (default: a temporary directory in .)")
    parser.add_argument("--docs", action="store_true", help="write docs/benchmarks.md")
    args = parser.parse_args()
    each = max(1, args.mib * MIB // len(make_batch()) // PRODUCERS)
    batches = [[make_batch(1_000 + p, s * RECORDS) for s in range(each)]
               for p in range(PRODUCERS)]
    rows = []
    for label, delay_ms in (("this machine's disk", 0.0),
                            (f"slow: each fsync {args.slow_ms:g} ms later", args.slow_ms)):
        fsync = slow_fsync(delay_ms / 1000)
        with tempfile.TemporaryDirectory(prefix="atomlog-bench-",
                                         dir=args.dir or ".") as scratch:
            scratch = Path(scratch)
            floor = fsync_floor_ms(scratch, batches[0][0], fsync)
            idle = rolls_on_the_loop(scratch / "idle", batches[0][0], ROLLS_IDLE, fsync)
            runs = {how: run_owner(scratch / how, batches, fsync, how)
                    for how in ("none", "inline", "thread")}
        rows.append((label, floor, idle, runs))
    ms = lambda values: (f"{quantile_ms(values, 0.5):.2f} / "  # noqa: E731
                         f"{max(values, default=0) * 1000:.2f}")
    held = [
        "| disk | floor: fsync of 64 KiB, p50 ms | a roll of an idle log whole on the loop "
        "(as before), p50 / max ms | what stays on the loop now (roll_begin + roll_end), "
        "p50 / max ms |",
        "| --- | --- | --- | --- |",
    ]
    loaded = [
        "| disk | the loop held (heartbeat lateness p99 / max ms), MiB/s: no rolls | rolls "
        "inside the append, on the loop (before) | rolls on a thread (now) | rolls; their "
        "disk work under this load, p50 / max ms: inside the append / on a thread |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, floor, idle, runs in rows:
        held.append(f"| {label} | {floor:.2f} | {ms(idle['whole'])} | "
                    f"{quantile_ms(idle['halves'], 0.5):.3f} / "
                    f"{max(idle['halves']) * 1000:.3f} |")
        cells = [f"{quantile_ms(r['late'], 0.99):.2f} / {max(r['late']) * 1000:.2f}, "
                 f"{r['mib_per_s']:.0f} MiB/s" for r in runs.values()]
        loaded.append(f"| {label} | " + " | ".join(cells) +
                      f" | {len(runs['thread']['rolls'])}: {ms(runs['inline']['rolls'])} / "
                      f"{ms(runs['thread']['rolls'])} |")
    with tempfile.TemporaryDirectory(prefix="atomlog-bench-", dir=args.dir or ".") as scratch:
        inline = deletions(Path(scratch) / "inline", args.delete_mib, False)
        handed = deletions(Path(scratch) / "handed", args.delete_mib, True)
    deleted = [
        "| a segment deleted (DeleteRecords), the caller held, p50 / max ms: unlinked "
        "inline (as before) | renamed, the directory synced, the unlink handed off (now) "
        "| the handed-off unlink on its own, p50 / max ms |",
        "| --- | --- | --- |",
        f"| {ms(inline['held'])} | {ms(handed['held'])} | {ms(handed['unlinks'])} |",
    ]
    text = (f"Per roll ({ROLLS_IDLE} rolls of an idle log):\n\n" + "\n".join(held)
            + f"\n\nAn owner taking {args.mib} MiB from {PRODUCERS} producers:\n\n"
            + "\n".join(loaded)
            + f"\n\n{DELETIONS} deletions of a {args.delete_mib} MiB segment each way, this "
            "machine's disk:\n\n" + "\n".join(deleted))
    print(text)
    if args.docs:
        common.write_docs_section(
            f"{BEGIN}\n`bench/segments.py --mib {args.mib} --slow-ms {args.slow_ms:g} "
            f"--delete-mib {args.delete_mib}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())};"
            f" 64 KiB batches, 1 MiB segments for the rolls). {text}\n{END}", BEGIN, END)

if __name__ == "__main__":
    main()
