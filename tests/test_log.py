"""The partition log on real files: offsets, reads, rolls, retention, look-ups, torn-tail
recovery, DATA_LOSS before the tail, index rebuilds, and recovery == full replay.

A "crash" is a copy of the partition directory taken while the log is open: that is what
kill -9 leaves (every write() is in the page cache, nothing after it). Torn tails are then
made by cutting the copy's last segment above what was flushed."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partition_server.log import DATA_LOSS_FILE, RECOVERY_POINT_FILE, LogConfig, PartitionLog
from partition_server.record_batch import (PREFIX_SIZE, ControlType, Record, encode_batch,
                                           encode_control_batch, iter_batches, parse_header,
                                           with_base_offset)
from services.errors import AtomlogError


class Clock:
    def __init__(self, now: int = 1_700_000_000_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def make_batch(records: int = 3, value_bytes: int = 100, timestamp_ms: int = 1_000,
               key: bytes = b"k") -> bytes:
    return encode_batch([Record(key, bytes([i % 251]) * value_bytes) for i in range(records)],
                        timestamp_ms=timestamp_ms)


def open_log(path: Path, clock: Clock | None = None, *, direct_copies: bool = False,
             **config) -> PartitionLog:
    return PartitionLog(path, LogConfig(**config), clock_ms=clock or Clock(),
                        direct_copies=direct_copies)


def stored_batches(log: PartitionLog, upper: int | None = None) -> list[tuple[int, bytes]]:
    """(base_offset, bytes) of every batch below `upper` (default: the high watermark)."""
    upper = log.high_watermark if upper is None else upper
    if upper == log.log_start_offset:
        return []
    data, next_offset = log.read(log.log_start_offset, 1 << 40, upper)
    assert next_offset == upper
    return [(h.base_offset, data[p:p + h.size]) for p, h in iter_batches(data, verify=True)]


def reason_and_metadata(call) -> tuple[str, dict]:
    with pytest.raises(AtomlogError) as info:
        call()
    return info.value.reason, info.value.metadata


def crash_copy(log: PartitionLog, destination: Path) -> Path:
    """What kill -9 leaves behind: the files as they are right now."""
    shutil.copytree(log.directory, destination)
    return destination


def segment_file(directory: Path, base_offset: int) -> Path:
    return directory / f"{base_offset:020d}.log"


# --- Append, flush, read ------------------------------------------------------------------

def test_append_assigns_offsets_that_count_records_and_stamps_the_header(tmp_path):
    clock = Clock()
    log = open_log(tmp_path / "p", clock)
    batches = [make_batch(3), make_batch(1), make_batch(5)]
    assert log.append(batches) == [0, 3, 4]
    assert (log.log_end_offset, log.high_watermark, log.log_start_offset) == (9, 0, 0)
    assert log.read(0, 1 << 20) == (b"", 0)  # not flushed: not readable by default
    assert log.flush() == 9 and log.high_watermark == 9
    data, next_offset = log.read(0, 1 << 20)
    assert next_offset == 9
    assert data == b"".join(with_base_offset(b, o, clock.now) for b, o in zip(batches, [0, 3, 4]))
    clock.now -= 5_000  # the server clock went backwards: append times never do
    log.append([make_batch(1)])
    log.flush()
    assert list(log.iter_headers(9))[0].log_append_time_ms == clock.now + 5_000
    log.close()


def test_unflushed_data_is_readable_only_below_an_explicit_bound(tmp_path):
    log = open_log(tmp_path / "p")
    log.append([make_batch(2)])
    log.flush()
    log.append([make_batch(2)])
    assert log.read(0, 1 << 20)[1] == 2
    assert log.read(0, 1 << 20, log.log_end_offset)[1] == 4
    with pytest.raises(ValueError):
        log.read(0, 1 << 20, 5)


def test_read_starts_at_the_batch_containing_the_offset(tmp_path):
    log = open_log(tmp_path / "p", index_interval_bytes=500)
    for _ in range(10):
        log.append([make_batch(3)])
    log.flush()
    batches = stored_batches(log)
    for offset in range(30):
        data, next_offset = log.read(offset, 1 << 20)
        first = offset // 3
        assert data == b"".join(b for _, b in batches[first:]) and next_offset == 30
    assert log.read(30, 1 << 20) == (b"", 30)
    for bad in (-1, 31):
        reason, metadata = reason_and_metadata(lambda: log.read(bad, 100))
        assert reason == "OFFSET_OUT_OF_RANGE"
        assert metadata == {"log_start_offset": "0", "high_watermark": "30"}


def test_reads_from_recent_batch_starts_agree_with_a_walk_and_a_cut_forgets_them(tmp_path):
    """Where the latest batches begin is kept (a follower's next fetch starts at one):
    reads from there give what a walk from the sparse index gives, across rolls, and after
    a cut a kept position of a batch that is gone is never used."""
    log = open_log(tmp_path / "p", index_interval_bytes=4096, segment_bytes=2_000)
    for n in range(100):
        log.append([make_batch(1 + n % 3, 50)])
    log.flush()
    assert len(log.segments()) > 3 and len(log._recent_starts) == 64
    starts = [offset for offset, _ in stored_batches(log)]
    kept = {offset: log.read(offset, 300) for offset in range(log.high_watermark)}
    assert all(offset in log._recent_starts for offset in starts[-64:])
    log._recent_starts.clear()  # every read below walks from the index
    assert {offset: log.read(offset, 300) for offset in range(log.high_watermark)} == kept

    cut = open_log(tmp_path / "q")
    cut.append([make_batch(3), make_batch(3), make_batch(3)])  # [0,3) [3,6) [6,9)
    cut.flush()
    assert cut.truncate_to(3) == 3
    cut.append([make_batch(6, 70)])  # [3,9): 6 is inside it now
    cut.flush()
    data, next_offset = cut.read(6, 1 << 20)
    assert next_offset == 9
    assert [(h.base_offset, h.record_count) for _, h in iter_batches(data, verify=True)] == \
        [(3, 6)]


@pytest.mark.parametrize("index_interval_bytes", [1, 700, 4096])
def test_read_limits_are_whole_batches_at_least_one_and_never_past_the_bound(
        tmp_path, index_interval_bytes):
    rng = random.Random(7)
    log = open_log(tmp_path / "p", segment_bytes=3_000, index_interval_bytes=index_interval_bytes)
    for i in range(40):
        log.append([make_batch(rng.randint(1, 4), rng.randint(0, 700), key=b"%d" % i)])
    log.flush()
    model = [(h.base_offset, h.next_offset, len(b))
             for (o, b) in stored_batches(log) for h in [parse_header(b)]]
    assert log.segment_count > 5
    end = log.high_watermark
    for _ in range(400):
        offset = rng.randint(0, end - 1)
        bound = rng.randint(offset, end)
        max_bytes = rng.choice([0, 1, rng.randint(1, 5_000), 1 << 30])
        data, next_offset = log.read(offset, max_bytes, bound)
        first = next(i for i, (b, n, _) in enumerate(model) if n > offset)
        expected, total = [], 0
        for base, nxt, size in model[first:]:
            if nxt > bound or (expected and total + size > max_bytes):
                break
            if not expected and size > max_bytes:
                expected.append((base, nxt, size))
                break
            expected.append((base, nxt, size))
            total += size
        got = [(h.base_offset, h.next_offset, h.size) for _, h in iter_batches(data, verify=True)]
        assert got == expected, (offset, bound, max_bytes)
        assert next_offset == (expected[-1][1] if expected else offset)


def test_reads_are_slices_of_the_segment_files(tmp_path):
    log = open_log(tmp_path / "p", segment_bytes=2_000)
    for _ in range(20):
        log.append([make_batch(2, 300)])
    log.flush()
    assert log.segment_count > 3
    data, _ = log.read(0, 1 << 30)
    assert data == b"".join(Path(s.path).read_bytes() for s in log.segments())


def test_append_validates_everything_before_writing(tmp_path):
    log = open_log(tmp_path / "p", max_batch_bytes=1_000)
    log.append([make_batch()])
    size = log.size_bytes
    good = make_batch()
    for bad, reason in [(good[:-1], "CORRUPT_BATCH"), (good + b"x", "CORRUPT_BATCH"),
                        (b"\x00" * 10, "CORRUPT_BATCH"), (make_batch(1, 2_000), "BATCH_TOO_LARGE")]:
        assert reason_and_metadata(lambda: log.append([good, bad]))[0] == reason
        assert (log.log_end_offset, log.size_bytes) == (3, size)
    assert log.append([]) == []


# --- Roll -----------------------------------------------------------------------------------

def test_roll_by_size(tmp_path):
    log = open_log(tmp_path / "p", segment_bytes=1_000)
    batch = make_batch(2, 200)  # 2 fit in 1000 bytes, 3 do not
    assert 333 < len(batch) <= 500
    log.append([batch] * 5)
    assert [s.base_offset for s in log.segments()] == [0, 4, 8]
    assert [s.size_bytes for s in log.segments()] == [2 * len(batch), 2 * len(batch), len(batch)]
    log.append([make_batch(1, 2_000)])  # bigger than a segment: alone in its own
    log.append([batch])
    assert [s.base_offset for s in log.segments()] == [0, 4, 8, 10, 11]
    sealed = [Path(s.path).with_suffix(".index") for s in log.segments()[:-1]]
    assert all(p.exists() for p in sealed) and not Path(log.segments()[-1].path).with_suffix(
        ".index").exists()


def test_roll_by_age_and_on_demand(tmp_path):
    clock = Clock()
    log = open_log(tmp_path / "p", clock, segment_ms=1_000)
    log.append([make_batch()])
    clock.now += 999
    log.append([make_batch()])
    assert log.segment_count == 1
    clock.now += 1
    log.append([make_batch()])
    assert [s.base_offset for s in log.segments()] == [0, 6]
    log.roll()
    log.roll()  # empty active segment: nothing to roll
    assert [s.base_offset for s in log.segments()] == [0, 6, 9]
    log.flush()
    log.close()
    reopened = open_log(tmp_path / "p", clock, segment_ms=1_000)
    assert [s.base_offset for s in reopened.segments()] == [0, 6, 9]
    assert reopened.log_end_offset == 9



def test_a_roll_in_two_halves_takes_no_appends_between_and_a_crash_anywhere_is_whole(tmp_path):
    """roll_begin / RollJob.run / roll_end (the owner runs `run` on a worker thread):
    between the halves reads and flushes go on but appends and cuts are a caller's bug.
    The roll's disk work makes the sealed segment durable before the next file exists,
    so a crash before it, after it, or before roll_end leaves a log that opens whole.
    A roll that failed breaks the log until it is reopened."""
    log = open_log(tmp_path / "p")
    log.append([make_batch(), make_batch()])
    before = crash_copy(log, tmp_path / "before")  # unflushed tail, no roll begun
    job = log.roll_begin()
    assert not log.roll_due(1 << 30)  # one roll at a time
    with pytest.raises(RuntimeError, match="roll is under way"):
        log.append([make_batch()])
    with pytest.raises(RuntimeError, match="roll is under way"):
        log.truncate_to(3)
    assert log.flush() == 6 and len(stored_batches(log)) == 2
    job.run()
    mid = crash_copy(log, tmp_path / "mid")  # a crash before roll_end
    log.roll_end(job)
    assert [s.base_offset for s in log.segments()] == [0, 6]
    log.append([make_batch()])
    log.flush()
    for directory, segments, end in ((before, [0], 6), (mid, [0, 6], 6)):
        reopened = open_log(directory)
        assert reopened.data_loss is None
        assert [s.base_offset for s in reopened.segments()] == segments
        assert reopened.log_end_offset == end
        reopened.close()
    log.close()
    again = open_log(tmp_path / "p")
    assert again.roll_due(1 << 30) and not again.roll_due(1)
    job = again.roll_begin()
    again.roll_failed(job, OSError(5, "Input/output error"))
    with pytest.raises(AtomlogError, match="I/O error while rolling"):
        again.append([make_batch()])
    again.close()
    assert open_log(tmp_path / "p").log_end_offset == 9


@pytest.mark.parametrize("failed", [False, True])
def test_nothing_records_the_file_durable_before_a_checkpoints_verdict(tmp_path, failed):
    """A write-ahead checkpoint fsyncs the active segment (through a duplicate of the
    log's descriptor) on the event loop's ring, and a roll may fsync the same file
    meanwhile. Linux gives a write-back error to the first fsync that looks: the roll's
    could return success and count the sealed segment durable while the checkpoint's
    failed. So until the checkpoint's verdict no recovery point is written (the frames
    above the last one stay the truth), a failed checkpoint breaks the log at once, and
    a close with one in flight syncs nothing and records no clean shutdown."""
    log = open_log(tmp_path / "p", recovery_point_interval_ms=0)
    log.append([make_batch(), make_batch()])
    target, _fd = log.flush_begin()
    log.flush_end(target, durable=False)  # readable, not durable: a checkpoint's work
    point = tmp_path / "p" / "recovery-point.json"
    before = point.read_bytes() if point.exists() else None
    started = log.checkpoint_begin()
    assert started is not None and log.checkpointing
    assert log.checkpoint_begin() is None  # one at a time
    job = log.roll_begin()
    job.run()  # its fsync "succeeds"
    log.roll_end(job)
    assert log.durable_offset == 6  # counted in memory ...
    log.append([make_batch()])
    target, _fd = log.flush_begin()
    log.flush_end(target, durable=False)
    assert (point.read_bytes() if point.exists() else None) == before  # ... not on disk
    log.checkpoint_ended(OSError(5, "Input/output error") if failed else None)
    assert not log.checkpointing
    if failed:
        with pytest.raises(AtomlogError, match="checkpoint"):
            log.append([make_batch()])
        log.close()
        assert (point.read_bytes() if point.exists() else None) == before
        assert not log.closed_durable
    else:
        assert log.checkpoint_end(started[0], started[2])
        log.close()
        assert log.closed_durable
        assert json.loads(point.read_text())["offset"] == 9

    other = open_log(tmp_path / "q")
    other.append([make_batch()])
    target, _fd = other.flush_begin()
    other.flush_end(target, durable=False)
    assert other.checkpoint_begin() is not None
    other.close()  # the checkpoint's verdict unknown: no fsync, no clean shutdown
    assert not other.closed_durable
    recorded = json.loads((tmp_path / "q" / "recovery-point.json").read_text()) \
        if (tmp_path / "q" / "recovery-point.json").exists() else {}
    assert "clean_shutdown" not in recorded
    closing = open_log(tmp_path / "r")
    closing.append([make_batch()])
    target, _fd = closing.flush_begin()
    closing.flush_end(target, durable=False)
    closing.begin_close()
    assert closing.checkpoint_begin() is None  # the owner closes: no checkpoint begins
    closing.close()


# --- Retention ------------------------------------------------------------------------------

def test_retention_by_size_deletes_whole_old_segments(tmp_path):
    log = open_log(tmp_path / "p", segment_bytes=1_000, retention_bytes=1_500)
    batch = make_batch(2, 200)
    log.append([batch] * 9)  # segments of 2 batches: [0,4) [4,8) [8,12) [12,16) [16,18)
    assert log.apply_retention() == 0  # nothing flushed yet: nothing deleted
    log.flush()
    assert log.apply_retention(keep_from_offset=3) == 0  # offset 3 is in the oldest segment
    assert log.apply_retention(keep_from_offset=4) == 1 and log.log_start_offset == 4
    assert log.apply_retention() == 1
    assert log.log_start_offset == 8
    assert [s.base_offset for s in log.segments()] == [8, 12, 16]
    assert not segment_file(log.directory, 0).exists()
    assert not segment_file(log.directory, 0).with_suffix(".index").exists()
    assert reason_and_metadata(lambda: log.read(7, 100))[0] == "OFFSET_OUT_OF_RANGE"
    assert log.read(8, 1)[1] == 10
    zero = dataclasses.replace(log.config, retention_bytes=0)
    log.config = zero
    assert log.apply_retention() == 2 and log.segment_count == 1  # never the active one
    log.close()
    assert open_log(tmp_path / "p").log_start_offset == 16


def test_retention_by_age_uses_the_last_append_time(tmp_path):
    clock = Clock()
    start = clock.now
    log = open_log(tmp_path / "p", clock, segment_bytes=1_000, retention_ms=10_000)
    batch = make_batch(2, 200)
    log.append([batch, batch])
    clock.now = start + 5_000
    log.append([batch, batch])  # second segment, appended 5 s later
    log.append([batch])
    log.flush()
    clock.now = start + 10_000
    assert log.apply_retention() == 0
    clock.now = start + 10_001
    assert log.apply_retention() == 1 and log.log_start_offset == 4
    clock.now = start + 15_001
    assert log.apply_retention() == 1 and log.log_start_offset == 8
    clock.now = start + 10**9
    assert log.apply_retention() == 0  # the active segment stays


# --- Look-ups -------------------------------------------------------------------------------

def test_offset_for_timestamp_matches_brute_force(tmp_path):
    rng = random.Random(3)
    log = open_log(tmp_path / "p", segment_bytes=2_500, index_interval_bytes=600)
    timestamps = [rng.randint(0, 1_000) for _ in range(60)]
    for ts in timestamps:
        log.append([make_batch(rng.randint(1, 3), rng.randint(50, 400), ts)])
        if rng.random() < 0.3:
            log.flush()
    log.flush()
    log.append([make_batch(1, 10, 5_000)])  # not flushed: never an answer
    headers = list(log.iter_headers(0, log.high_watermark))

    def brute(target):
        return next(((h.base_offset, h.max_timestamp_ms) for h in headers
                     if h.max_timestamp_ms >= target), None)

    for target in range(-1, 1_002):
        assert log.offset_for_timestamp(target) == brute(target), target
    assert log.offset_for_timestamp(5_000) is None
    log.close()
    reopened = open_log(tmp_path / "p", segment_bytes=2_500, index_interval_bytes=600)
    headers = list(reopened.iter_headers(0, reopened.high_watermark))
    for target in range(-1, 1_002, 7):
        assert reopened.offset_for_timestamp(target) == brute(target)
    assert reopened.offset_for_timestamp(5_000) == (headers[-1].base_offset, 5_000)


def test_iter_headers_from_any_offset(tmp_path):
    log = open_log(tmp_path / "p", segment_bytes=1_500, index_interval_bytes=300)
    for i in range(20):
        log.append([make_batch(i % 3 + 1, 200)])
    log.flush()
    everything = list(log.iter_headers())
    assert [h.base_offset for h in everything] == [0] + [h.next_offset for h in everything[:-1]]
    for offset in range(log.log_end_offset):
        assert list(log.iter_headers(offset)) == [h for h in everything if h.next_offset > offset]
    assert list(log.iter_headers(log.log_end_offset)) == []
    assert list(log.iter_headers(0, 10)) == [h for h in everything if h.base_offset < 10]
    assert reason_and_metadata(lambda: log.iter_headers(log.log_end_offset + 1))[0] == \
        "OFFSET_OUT_OF_RANGE"


def test_a_cut_above_the_durable_offset_never_writes_a_recovery_point_above_it(
        tmp_path, monkeypatch):
    """The recovery point a cut writes before it deletes anything (so that a crash
    midway is not taken for lost flushed data) is at most what was fsynced: a cut above
    an unflushed tail that then lost it in a power cut must read as a torn tail, not as
    DATA_LOSS. (It used to be the cut's offset.)"""
    import partition_server.log as log_module
    log = open_log(tmp_path / "p")
    log.append([make_batch(2)])
    log.flush()  # durable below 2
    log.append([make_batch(2), make_batch(2)])  # 2..5, not flushed
    written = []
    real = log_module._atomic_write

    def recording(path, data, **kwargs):
        if path.name == RECOVERY_POINT_FILE:
            written.append(json.loads(data)["offset"])
        return real(path, data, **kwargs)

    monkeypatch.setattr(log_module, "_atomic_write", recording)
    assert log.truncate_to(4) == 4
    assert written and written[0] <= 2, written
    log.close()


def test_truncate_to_removes_whole_batches_across_segments(tmp_path):
    log = open_log(tmp_path / "p", segment_bytes=1_000)
    log.append([make_batch(2, 200)] * 7)  # [0,4) [4,8) [8,12) [12,14)
    log.flush()
    assert log.truncate_to(20) == 14
    assert log.truncate_to(11) == 10  # 11 is inside batch [10,12): the whole batch goes
    assert [s.base_offset for s in log.segments()] == [0, 4, 8]
    assert not segment_file(log.directory, 12).exists()
    # A cut at a segment's start takes the emptied segment too: the one before is active.
    assert log.truncate_to(9) == 8  # 9 is inside batch [8,10), the first of segment 8
    assert [s.base_offset for s in log.segments()] == [0, 4]
    assert not segment_file(log.directory, 8).exists()
    assert log.high_watermark == 8
    assert log.append([make_batch(1)]) == [8]  # segment 4 is full: a roll by size
    log.flush()
    assert [s.base_offset for s in log.segments()] == [0, 4, 8]
    assert log.truncate_to(5) == 4
    assert [s.base_offset for s in log.segments()] == [0]
    assert not segment_file(log.directory, 4).exists()
    assert not segment_file(log.directory, 4).with_suffix(".index").exists()
    log.close()
    reopened = open_log(tmp_path / "p", segment_bytes=1_000)
    assert reopened.log_end_offset == 4 and reopened.data_loss is None


# --- Torn tails -----------------------------------------------------------------------------

def build_log_with_unflushed_tail(directory: Path) -> tuple[PartitionLog, bytes]:
    log = open_log(directory, segment_bytes=1_500)
    for _ in range(6):
        log.append([make_batch(2, 300)])
        log.flush()
    log.append([make_batch(4, 250)])  # written, not flushed: a crash may tear it
    last = stored_batches(log, log.log_end_offset)[-1][1]
    return log, last


def test_torn_tail_is_truncated_at_every_cut_point(tmp_path):
    log, last = build_log_with_unflushed_tail(tmp_path / "p")
    last_base = parse_header(last).base_offset
    segments_before = [s.base_offset for s in log.segments()]
    for cut in range(1, len(last) + 1):
        copy = crash_copy(log, tmp_path / f"crash-{cut}")
        active = segment_file(copy, segments_before[-1])
        os.truncate(active, active.stat().st_size - cut)
        recovered = open_log(copy, segment_bytes=1_500)
        assert recovered.data_loss is None
        assert recovered.log_end_offset == recovered.high_watermark == last_base
        assert recovered.recovery.truncated_bytes == len(last) - cut
        assert active.stat().st_size == recovered.segments()[-1].size_bytes
        assert recovered.append([make_batch(1)]) == [last_base]
        recovered.close()
        shutil.rmtree(copy)


@pytest.mark.parametrize("damage", ["zeros", "garbage", "bit-flip", "header-flip"])
def test_damaged_unflushed_tail_is_truncated(tmp_path, damage):
    log, last = build_log_with_unflushed_tail(tmp_path / "p")
    copy = crash_copy(log, tmp_path / "crash")
    active = segment_file(copy, log.segments()[-1].base_offset)
    data = bytearray(active.read_bytes())
    if damage == "zeros":
        data += bytes(4096)  # blocks allocated, data never written
    elif damage == "garbage":
        data += os.urandom(1000)
    elif damage == "bit-flip":
        data[-10] ^= 0x04
    else:
        data[len(data) - len(last) + 30] ^= 0x01  # record_count of the last batch
    active.write_bytes(bytes(data))
    recovered = open_log(copy, segment_bytes=1_500)
    expected_end = parse_header(last).base_offset + (
        parse_header(last).record_count if damage in ("zeros", "garbage") else 0)
    assert recovered.data_loss is None and recovered.log_end_offset == expected_end


def test_damaged_flushed_data_in_the_last_segment_is_data_loss(tmp_path):
    log, last = build_log_with_unflushed_tail(tmp_path / "p")
    log.flush()
    log.close()  # everything flushed: the recovery point is the log end
    active = segment_file(log.directory, log.segments()[-1].base_offset)
    os.truncate(active, active.stat().st_size - 1)
    reopened = open_log(log.directory, segment_bytes=1_500)
    loss = reopened.data_loss
    assert loss is not None and loss.offset == parse_header(last).base_offset
    assert loss.position == active.stat().st_size - len(last) + 1
    assert "recovery point" in loss.detail
    # A cut exactly at a batch boundary: the scan is clean, but flushed offsets are missing.
    reopened.close()
    os.truncate(active, loss.position)
    (log.directory / DATA_LOSS_FILE).unlink()
    again = open_log(log.directory, segment_bytes=1_500)
    assert again.data_loss is not None and again.data_loss.offset == parse_header(last).base_offset
    result = again.recover_data_loss(again.data_loss.path, again.data_loss.offset)
    assert result.removed_bytes == 0 and again.log_end_offset == parse_header(last).base_offset


# --- Corruption before the tail --------------------------------------------------------------

def build_sealed_log(directory: Path, **config) -> PartitionLog:
    log = open_log(directory, segment_bytes=3_000, index_interval_bytes=400, **config)
    for i in range(16):
        log.append([make_batch(2, 300, timestamp_ms=i)])
    log.flush()
    assert log.segment_count >= 4
    return log


def test_corruption_in_a_sealed_segment_refuses_service_until_recovered(tmp_path):
    log = build_sealed_log(tmp_path / "p")
    victim = log.segments()[1]
    batches = stored_batches(log)
    in_victim = [(o, b) for o, b in batches if victim.base_offset <= o < victim.next_offset]
    bad_offset, bad_batch = in_victim[-1]
    bad_position = victim.size_bytes - len(bad_batch)
    later_bytes = sum(s.size_bytes for s in log.segments()[2:])
    log.close()
    path = Path(victim.path)
    data = bytearray(path.read_bytes())
    data[bad_position + 200] ^= 0x80
    path.write_bytes(bytes(data))

    for _ in range(2):  # refuses on every open, not just the first
        broken = open_log(tmp_path / "p", segment_bytes=1_500)
        loss = broken.data_loss
        assert (loss.path, loss.position, loss.offset) == (str(path), bad_position, bad_offset)
        assert "CRC32C mismatch" in loss.detail
        for call in (lambda: broken.append([make_batch()]), lambda: broken.read(0, 100),
                     broken.flush, lambda: broken.offset_for_timestamp(0),
                     lambda: broken.iter_headers(0), broken.apply_retention,
                     lambda: broken.truncate_to(1)):
            reason, metadata = reason_and_metadata(call)
            assert reason == "DATA_LOSS"
            assert metadata == {"file": str(path), "position": str(bad_position),
                                "offset": str(bad_offset)}
        broken.close()

    path.write_bytes(bytes(data[:bad_position + 200]) + bytes([data[bad_position + 200] ^ 0x80])
                     + bytes(data[bad_position + 201:]))  # repaired by hand...
    broken = open_log(tmp_path / "p", segment_bytes=1_500)
    assert broken.data_loss is not None  # ...still refused: an operator must accept it

    assert reason_and_metadata(lambda: broken.recover_data_loss(path, bad_offset + 1))[0] == \
        "DATA_LOSS_MISMATCH"
    assert reason_and_metadata(lambda: broken.recover_data_loss(
        segment_file(path.parent, 0), bad_offset))[0] == "DATA_LOSS_MISMATCH"
    assert reason_and_metadata(lambda: broken.recover_data_loss(
        "/elsewhere/" + path.name, bad_offset))[0] == "DATA_LOSS_MISMATCH"
    result = broken.recover_data_loss(path.name, bad_offset)
    assert result.truncated_at_offset == bad_offset and result.data_loss is None
    assert result.removed_bytes == len(bad_batch) + later_bytes
    assert broken.data_loss is None and broken.log_end_offset == broken.high_watermark == bad_offset
    assert [s.base_offset for s in broken.segments()] == [0, victim.base_offset]
    assert not (tmp_path / "p" / DATA_LOSS_FILE).exists()
    assert broken.append([make_batch(1)]) == [bad_offset]
    broken.flush()
    assert reason_and_metadata(lambda: broken.recover_data_loss(path, bad_offset))[0] == \
        "PARTITION_NOT_IN_DATA_LOSS"
    broken.close()
    assert open_log(tmp_path / "p", segment_bytes=1_500).log_end_offset == bad_offset + 1


def test_corruption_deep_in_a_sealed_segment_is_found_by_a_full_check_or_a_read(tmp_path):
    log = build_sealed_log(tmp_path / "p")
    first_batch = stored_batches(log)[0][1]
    log.close()
    path = segment_file(tmp_path / "p", 0)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01  # inside the first batch: the cheap open check does not look there
    path.write_bytes(bytes(data))

    full = open_log(tmp_path / "p", segment_bytes=1_500, verify_all_segments_on_open=True)
    assert (full.data_loss.position, full.data_loss.offset) == (0, 0)
    full.close()
    (tmp_path / "p" / DATA_LOSS_FILE).unlink()

    lazy = open_log(tmp_path / "p", segment_bytes=1_500)
    assert lazy.data_loss is None
    assert lazy.read(2, 100)[1] == 4  # a read that does not touch the damage still works
    reason, metadata = reason_and_metadata(lambda: lazy.read(0, 100))
    assert reason == "DATA_LOSS" and metadata["offset"] == "0"
    assert len(first_batch) > 100
    lazy.close()
    assert open_log(tmp_path / "p", segment_bytes=1_500).data_loss.offset == 0


def test_a_missing_segment_is_data_loss_at_the_gap(tmp_path):
    log = build_sealed_log(tmp_path / "p")
    segments = log.segments()
    log.close()
    Path(segments[2].path).unlink()
    broken = open_log(tmp_path / "p", segment_bytes=1_500)
    loss = broken.data_loss
    assert loss.path == segments[1].path and loss.offset == segments[1].next_offset
    assert loss.position == segments[1].size_bytes and "next segment" in loss.detail
    broken.recover_data_loss(loss.path, loss.offset)
    assert broken.log_end_offset == segments[1].next_offset
    assert [s.base_offset for s in broken.segments()] == [0, segments[1].base_offset]


def test_damaged_batch_header_in_a_sealed_segment_is_data_loss(tmp_path):
    log = build_sealed_log(tmp_path / "p")
    victim = log.segments()[0]
    last_base, last_batch = [(o, b) for o, b in stored_batches(log) if o < victim.next_offset][-1]
    log.close()
    path = Path(victim.path)
    data = bytearray(path.read_bytes())
    data[victim.size_bytes - len(last_batch) + 7] ^= 0x01  # base_offset: outside the CRC
    path.write_bytes(bytes(data))
    broken = open_log(tmp_path / "p", segment_bytes=1_500)
    assert broken.data_loss.offset == last_base
    assert "base_offset" in broken.data_loss.detail


# --- Indexes are derived data -------------------------------------------------------------

@pytest.mark.parametrize("damage", ["missing", "garbage", "entry-flip", "truncated", "empty"])
def test_sealed_index_is_rebuilt_when_missing_or_damaged(tmp_path, damage):
    log = build_sealed_log(tmp_path / "p")
    sealed = log.segments()[1]
    index_path = Path(sealed.path).with_suffix(".index")
    original = index_path.read_bytes()
    entries = log.index_entries(sealed.base_offset)
    assert len(entries) > 2
    expected_read = log.read(sealed.base_offset + 1, 1 << 20)
    log.close()
    if damage == "missing":
        index_path.unlink()
    elif damage == "garbage":
        index_path.write_bytes(os.urandom(len(original)))
    elif damage == "entry-flip":
        data = bytearray(original)
        data[16 + 16 + 5] ^= 0x10  # a middle entry's position: only the CRC notices
        index_path.write_bytes(bytes(data))
    elif damage == "truncated":
        index_path.write_bytes(original[:-16])
    else:
        index_path.write_bytes(b"")
    reopened = open_log(tmp_path / "p", segment_bytes=1_500, index_interval_bytes=400)
    assert reopened.data_loss is None
    assert reopened.read(sealed.base_offset + 1, 1 << 20) == expected_read
    assert reopened.index_entries(sealed.base_offset) == entries
    assert index_path.read_bytes() == original
    if damage != "entry-flip":  # found at open; a flipped entry only when first used
        assert index_path.name in reopened.recovery.rebuilt_index_files


def test_offset_for_timestamp_answers_data_batches_not_markers(tmp_path):
    """A marker takes its timestamp from the server's clock, data from the producer's:
    one marker stamped ahead (a server clock a day ahead, or plain skew) answered every
    ListOffsets by timestamp up to its stamp, so a consumer seeking by time started far
    too early and read again what it had processed. Markers are not records a consumer
    reads: the answer is the first data batch at or after the time."""
    hour = 3_600_000
    log = open_log(tmp_path / "p", segment_bytes=1 << 20, index_interval_bytes=100)
    for i in range(10):
        log.append([make_batch(1, 100, timestamp_ms=i * hour)])
    log.append([encode_control_batch(ControlType.COMMIT, txn=(1, 1), coordinator_epoch=1,
                                     timestamp_ms=34 * hour)])
    for i in range(11, 30):
        log.append([make_batch(1, 100, timestamp_ms=i * hour)])
    log.flush()
    assert log.offset_for_timestamp(12 * hour) == (12, 12 * hour)
    assert log.offset_for_timestamp(29 * hour) == (29, 29 * hour)
    assert log.offset_for_timestamp(9 * hour) == (9, 9 * hour)
    assert log.offset_for_timestamp(30 * hour) is None  # only the marker is that late
    log.close()


# --- Clean shutdown ------------------------------------------------------------------------

def build_cleanly_closed_log(directory: Path) -> tuple[dict, list[tuple[int, bytes]]]:
    """A log whose last segment holds data batches then markers, closed cleanly."""
    log = open_log(directory, segment_bytes=20_000, index_interval_bytes=500)
    for i in range(40):
        log.append([make_batch(3, 200, timestamp_ms=1_000 + i)])
    log.append([encode_control_batch(ControlType.COMMIT, txn=(1, 1), coordinator_epoch=1,
                                     timestamp_ms=5)])
    log.flush()
    live, batches = state_of(log), stored_batches(log)
    log.close()
    return live, batches


def test_a_cleanly_closed_log_opens_without_reading_its_last_segment_and_then_forgets_that(
        tmp_path):
    live, batches = build_cleanly_closed_log(tmp_path / "p")
    assert len(live["segments"]) > 1 and len(live["indexes"][-1]) > 1
    log = open_log(tmp_path / "p", segment_bytes=20_000, index_interval_bytes=500)
    assert log.recovery.clean_shutdown
    assert state_of(log) == live and stored_batches(log) == batches
    assert log.last_data_offset == live["positions"][3] < log.log_end_offset - 1  # marker last
    assert not log.segments()[-1].path.endswith(".index")
    assert not Path(log.segments()[-1].path).with_suffix(".index").exists()
    # Appends after a clean open, then kill -9: the record is gone, so the next open reads
    # the last segment batch by batch and finds everything, including the new batch.
    log.append([make_batch(2, 100, timestamp_ms=9_999)])
    log.flush()
    expected = stored_batches(log)
    copy = crash_copy(log, tmp_path / "crash")
    log.close()
    crashed = open_log(copy, segment_bytes=20_000, index_interval_bytes=500)
    assert not crashed.recovery.clean_shutdown
    assert stored_batches(crashed) == expected
    assert crashed.offset_for_timestamp(9_999)[0] == expected[-1][0]
    crashed.close()


@pytest.mark.parametrize("change", ["appended", "truncated", "index damaged", "index missing",
                                    "record torn", "verify all"])
def test_a_clean_shutdown_record_that_does_not_match_the_files_is_not_trusted(tmp_path, change):
    live, batches = build_cleanly_closed_log(tmp_path / "p")
    last = Path(live["segments"][-1].path)
    config = dict(segment_bytes=20_000, index_interval_bytes=500)
    if change == "appended":  # e.g. a torn write by something that did not update the record
        with open(last, "ab") as file:
            file.write(make_batch(2, 100)[:50])
    elif change == "truncated":
        os.truncate(last, last.stat().st_size - 10)
    elif change == "index damaged":
        index = bytearray(last.with_suffix(".index").read_bytes())
        index[-1] ^= 0xFF
        last.with_suffix(".index").write_bytes(bytes(index))
    elif change == "index missing":
        last.with_suffix(".index").unlink()
    elif change == "record torn":
        (tmp_path / "p" / "recovery-point.json").write_text('{"offset": 1, "clean_shutdown": {"se')
    else:
        config["verify_all_segments_on_open"] = True
    log = open_log(tmp_path / "p", **config)
    assert not log.recovery.clean_shutdown
    if change == "truncated":  # flushed data is missing: refused, as after any open
        assert log.data_loss is not None and "recovery point" in log.data_loss.detail
    else:
        assert log.data_loss is None
        assert stored_batches(log) == batches
        assert state_of(log) == live
    log.close()


# --- Recovery equals a full replay ---------------------------------------------------------

def replay(source: PartitionLog, destination: Path) -> PartitionLog:
    """A fresh log fed every batch of `source` one at a time, rolled where `source` has
    segment boundaries, with a clock that repeats each batch's original append time."""
    destination.mkdir()
    segment_file(destination, source.log_start_offset).touch()
    clock = Clock()
    config = dataclasses.replace(source.config, segment_bytes=2**31, segment_ms=2**62)
    fresh = PartitionLog(destination, config, clock_ms=clock)
    boundaries = {s.base_offset for s in source.segments()[1:]}
    for base_offset, batch in stored_batches(source, source.log_end_offset):
        if base_offset in boundaries:
            fresh.roll()
        clock.now = parse_header(batch).log_append_time_ms
        assert fresh.append([batch]) == [base_offset]
    if source.log_end_offset in boundaries:
        fresh.roll()
    fresh.flush()
    return fresh


def state_of(log: PartitionLog) -> dict:
    segments = log.segments()
    return {
        "positions": (log.log_start_offset, log.log_end_offset, log.high_watermark,
                      log.last_data_offset),
        "segments": segments,
        "files": [Path(s.path).read_bytes() for s in segments],
        "sealed_indexes": [Path(s.path).with_suffix(".index").read_bytes() for s in segments[:-1]],
        "indexes": [log.index_entries(s.base_offset) for s in segments],
        "headers": list(log.iter_headers()),
    }


operation = st.one_of(
    st.tuples(st.just("append"), st.lists(st.tuples(st.integers(0, 4), st.integers(0, 700),
                                                    st.integers(0, 10_000)), min_size=1, max_size=4)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("tick"), st.integers(0, 4_000)),
    st.tuples(st.just("roll")),
    st.tuples(st.just("crash"), st.floats(0, 1)),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("restart")),  # a clean close and open: the last segment is not re-read
)


@settings(max_examples=80, deadline=None)
@given(operations=st.lists(operation, max_size=30),
       recovery_point_interval_ms=st.sampled_from([0, 3_000]),
       index_interval_bytes=st.sampled_from([1, 500, 4096]))
def test_recovery_equals_a_full_replay(operations, recovery_point_interval_ms,
                                       index_interval_bytes):
    config = dict(segment_bytes=2_000, segment_ms=5_000, index_interval_bytes=index_interval_bytes,
                  recovery_point_interval_ms=recovery_point_interval_ms)
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        clock = Clock()
        directory = root / "log-0"
        log = PartitionLog(directory, LogConfig(**config), clock_ms=clock)
        model: list[tuple[int, bytes]] = []  # (base offset, bytes after the stamped prefix)
        model_counts: dict[int, int] = {}  # base offset -> record count
        markers: set[int] = set()  # base offsets of control batches
        for step, op in enumerate(operations):
            if op[0] == "append":
                batches = [make_batch(n, size, ts, key=b"%d" % step) if n else
                           encode_control_batch(ControlType.ABORT, txn=(1, step + 1),
                                                coordinator_epoch=size, timestamp_ms=ts)
                           for n, size, ts in op[1]]
                offsets = log.append(batches)
                model += [(o, b[PREFIX_SIZE:]) for o, b in zip(offsets, batches)]
                model_counts.update((o, parse_header(b).record_count) for o, b in zip(offsets, batches))
                markers.difference_update(offsets)  # offsets re-used after a truncation
                markers.update(o for o, b in zip(offsets, batches) if parse_header(b).is_control)
            elif op[0] == "flush":
                log.flush()
            elif op[0] == "tick":
                clock.now += op[1]
            elif op[0] == "roll":
                log.roll()
            elif op[0] == "truncate":
                offset = log.log_start_offset + int(op[1] * (log.log_end_offset - log.log_start_offset))
                end = log.truncate_to(offset)
                model = [(o, b) for o, b in model if o < end]
            elif op[0] == "restart":
                log.flush()
                live = state_of(log)
                log.close()
                log = PartitionLog(directory, LogConfig(**config), clock_ms=clock)
                assert log.recovery.clean_shutdown == (live["segments"][-1].size_bytes > 0)
                assert state_of(log) == live
            else:  # crash, and maybe tear what was not flushed
                active = log.segments()[-1]
                flushed_below = max(log.high_watermark, active.base_offset)
                flushed_position = sum(len(b) + PREFIX_SIZE for o, b in model
                                       if active.base_offset <= o < flushed_below)
                cut = flushed_position + int(op[1] * (active.size_bytes - flushed_position))
                copy = crash_copy(log, root / f"log-{step + 1}")
                log.close()
                os.truncate(segment_file(copy, active.base_offset), cut)
                log = PartitionLog(copy, LogConfig(**config), clock_ms=clock)
                directory = copy
                assert log.data_loss is None
                assert not log.recovery.clean_shutdown
                survivors = [(o, b) for o, b in model if o < active.base_offset]
                position = 0
                for o, b in [(o, b) for o, b in model if o >= active.base_offset]:
                    if position + len(b) + PREFIX_SIZE > cut:
                        break
                    survivors.append((o, b))
                    position += len(b) + PREFIX_SIZE
                model = survivors
                assert log.log_end_offset == log.high_watermark
            assert log.log_end_offset == (model[-1][0] + model_counts[model[-1][0]] if model else 0)
        log.flush()
        live = state_of(log)
        log.close()
        reopened = PartitionLog(log.directory, LogConfig(**config), clock_ms=clock)
        recovered = state_of(reopened)
        assert [(o, b[PREFIX_SIZE:]) for o, b in stored_batches(reopened)] == model
        assert recovered == live
        data_offsets = [o + model_counts[o] - 1 for o, _ in model if o not in markers]
        assert reopened.last_data_offset == (data_offsets[-1] if data_offsets else -1)
        replayed = replay(reopened, root / "replay")
        assert state_of(replayed) | {"segments": None} == recovered | {"segments": None}
        assert [dataclasses.replace(s, path="") for s in replayed.segments()] == \
            [dataclasses.replace(s, path="") for s in reopened.segments()]
        reopened.close()
        replayed.close()


def test_one_owner_per_directory(tmp_path):
    log = open_log(tmp_path / "p")
    with pytest.raises(RuntimeError):
        open_log(tmp_path / "p")
    log.close()
    log.close()  # idempotent
    with pytest.raises(RuntimeError):
        log.append([make_batch()])
    open_log(tmp_path / "p").close()


@pytest.mark.parametrize("bad", [dict(segment_bytes=0), dict(segment_bytes=2**31 + 1),
                                 dict(index_interval_bytes=0), dict(retention_ms=-2),
                                 dict(max_batch_bytes=0), dict(max_open_segment_files=0)])
def test_config_is_checked(bad):
    with pytest.raises(ValueError):
        LogConfig(**bad)


def test_many_sealed_segments_with_few_open_files(tmp_path):
    log = open_log(tmp_path / "p", segment_bytes=1_000, max_open_segment_files=2)
    for _ in range(30):
        log.append([make_batch(2, 200)])
    log.flush()
    assert log.segment_count >= 15
    data, _ = log.read(0, 1 << 30)
    assert data == b"".join(Path(s.path).read_bytes() for s in log.segments())
    open_segments = [target for target in map(_fd_target, os.listdir("/proc/self/fd"))
                     if target.endswith(".log") and target.startswith(str(log.directory))]
    assert 1 <= len(open_segments) <= 3  # the active one plus at most 2 sealed ones
    log.close()


def _fd_target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_last_data_offset_skips_markers_and_unflushed_data(tmp_path):
    log = open_log(tmp_path / "p", segment_bytes=1_000)
    marker = encode_control_batch(ControlType.COMMIT, txn=(1, 1), coordinator_epoch=3,
                                  timestamp_ms=0)
    assert log.last_data_offset == -1
    log.append([marker])
    log.flush()
    assert log.last_data_offset == -1
    log.append([make_batch(3, 300)])
    assert log.last_data_offset == -1  # not flushed yet
    log.flush()
    assert log.last_data_offset == 3
    log.append([marker] * 30)  # fills the rest of this segment and more with markers only
    log.flush()
    assert log.segment_count >= 3 and log.last_data_offset == 3
    log.close()
    reopened = open_log(tmp_path / "p", segment_bytes=1_000)
    assert reopened.last_data_offset == 3
    reopened.close()


def test_split_flush_and_undurable_flush(tmp_path):
    log = open_log(tmp_path / "p", recovery_point_interval_ms=0)
    assert log.flush_begin() == (0, None)
    log.append([make_batch(2)])
    target, fd = log.flush_begin()
    assert target == 2 and fd is not None and log.high_watermark == 0
    os.fsync(fd)
    assert log.flush_end(target) and log.high_watermark == 2
    assert not log.flush_end(target)
    log.append([make_batch(2)])
    target, fd = log.flush_begin()
    assert log.flush_end(target, durable=False) and log.high_watermark == 4
    # Without the fsync the recovery point stays at 2: a torn batch at 2.. is a tail.
    copy = crash_copy(log, tmp_path / "crash")
    os.truncate(segment_file(copy, 0), segment_file(copy, 0).stat().st_size - 5)
    recovered = open_log(copy)
    assert recovered.data_loss is None and recovered.log_end_offset == 2
    recovered.close()
    # Had it been flushed durably, the same damage is data loss.
    log.flush_begin()
    log.append([make_batch(2)])
    log.flush()
    copy = crash_copy(log, tmp_path / "crash-2")
    os.truncate(segment_file(copy, 0), segment_file(copy, 0).stat().st_size - 5)
    assert open_log(copy).data_loss is not None


def test_pipelined_flushes_end_in_order_across_a_roll(tmp_path):
    """The owner begins a flush, goes on appending (here across a roll) and begins the
    next: each flush_end moves the high watermark to its own target only, in order."""
    log = open_log(tmp_path / "p", segment_bytes=1_000, recovery_point_interval_ms=0)
    log.append([make_batch(2)])
    first, first_fd = log.flush_begin()
    duplicate = os.dup(first_fd)  # as the owner fsyncs: the roll may close the original
    for _ in range(4):
        log.append([make_batch(2)])  # rolls: the sealed segment is fsynced then
    assert log.segment_count >= 2
    second, second_fd = log.flush_begin()
    assert (first, second) == (2, 10) and second_fd != first_fd
    os.fsync(second_fd)
    os.fsync(duplicate)
    os.close(duplicate)
    assert log.flush_end(first) and log.high_watermark == 2
    assert log.read(0, 1 << 20)[1] == 2  # reads stop at the high watermark
    assert log.flush_end(second) and log.high_watermark == 10
    assert log.read(0, 1 << 20)[1] == 10
    assert not log.flush_end(second)
    log.close()
    assert open_log(tmp_path / "p").log_end_offset == 10


def failed_fsync(path: Path) -> tuple[PartitionLog, object]:
    """A log flushed at 2, written on to 4, whose flush of that failed (the log broken):
    (the log, the failed flush's target)."""
    log = open_log(path, recovery_point_interval_ms=0)
    log.append([make_batch(2)])
    log.flush()
    log.append([make_batch(2)])
    target, _ = log.flush_begin()
    log.fail("fsync failed: [Errno 5] Input/output error")
    return log, target


def test_a_failed_fsync_elsewhere_breaks_the_log_and_close_does_not_flush(tmp_path):
    log, target = failed_fsync(tmp_path / "p")
    reason, _ = reason_and_metadata(lambda: log.flush_end(target))
    assert reason == "INTERNAL" and log.high_watermark == 2
    reason, _ = reason_and_metadata(lambda: log.append([make_batch(1)]))
    assert reason == "INTERNAL"
    log.close()  # no fsync, and the recovery point stays at 2
    assert json.loads((tmp_path / "p" / RECOVERY_POINT_FILE).read_text()) == {"offset": 2}


def test_a_reopen_after_a_failed_fsync_keeps_the_recovery_point_it_found(tmp_path):
    """After a writeback error the kernel may have dropped a file's dirty pages while
    later fsyncs succeed: the tail above the last good flush proves nothing. The reload
    after it reopened the log and wrote the recovery point as the log end, synced, before
    its owner cut the tail back (or rewrote it from the write-ahead file): a crash in
    between found the lost tail recorded as durable (DATA_LOSS, or in wal mode frames not
    replayed). Opened with trust_tail=False, the recovery point stays as found; a normal
    open still raises it."""
    log, _ = failed_fsync(tmp_path / "p")
    log.close()
    recovery_point = tmp_path / "p" / RECOVERY_POINT_FILE
    assert json.loads(recovery_point.read_text()) == {"offset": 2}
    reopened = PartitionLog(tmp_path / "p", LogConfig(), trust_tail=False)
    assert reopened.log_end_offset == 4  # (the pages are still cached here)
    assert json.loads(recovery_point.read_text()) == {"offset": 2}
    reopened.truncate_to(2)  # what the owner does next
    reopened.close()
    trusting = PartitionLog(tmp_path / "p", LogConfig())
    trusting.append([make_batch(2)])
    trusting.flush()
    trusting.fail("a crash")
    trusting.close()
    PartitionLog(tmp_path / "p", LogConfig()).close()
    assert json.loads(recovery_point.read_text())["offset"] == 4


def test_a_deferred_recovery_point_never_lands_after_a_lower_one(tmp_path, monkeypatch):
    """An owner defers the periodic recovery-point write to a worker thread. The write is
    of the value when it was due; one made meanwhile by the log itself (lowered before a
    cut, a clean shutdown) drops it, so a stale higher value can never make a deliberate
    cut look like lost flushed data; a failed deferred write breaks the log."""
    path = tmp_path / "p"
    point = lambda: json.loads((path / RECOVERY_POINT_FILE).read_text())["offset"]  # noqa: E731
    log = open_log(path, recovery_point_interval_ms=0)
    queued: list = []
    log.defer_recovery_point = queued.append
    log.append([make_batch(2)])
    log.flush()
    assert len(queued) == 1 and point() == 0  # due, not written yet
    log.append([make_batch(2)])
    log.flush()
    assert len(queued) == 1  # one at a time
    queued.pop()()
    assert point() == 2  # the value when it was due
    log.flush_begin()
    log.append([make_batch(2)])
    log.flush()
    assert len(queued) == 1
    stale = queued.pop()
    log.truncate_to(2)  # lowers the recovery point to 2 first
    stale()  # 6 would now claim flushed data the cut removed: dropped
    assert point() == 2
    log.close()
    reopened = open_log(path)
    assert reopened.data_loss is None and reopened.log_end_offset == 2
    reopened.defer_recovery_point = queued.append
    reopened.append([make_batch(1)])
    reopened.flush()
    broken = queued.pop()

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("partition_server.log._atomic_write", full_disk)
    with pytest.raises(OSError):  # raised to the owner, which reloads the partition
        broken()
    monkeypatch.undo()
    reason, _ = reason_and_metadata(lambda: reopened.append([make_batch(1)]))
    assert reason == "INTERNAL"
    reopened.close()
    # No worker to take the write (the loop's executor shut down): written inline.
    last = open_log(path, recovery_point_interval_ms=0)

    def shut_down(_write):
        raise RuntimeError("cannot schedule new futures after shutdown")

    last.defer_recovery_point = shut_down
    last.append([make_batch(1)])
    last.flush()
    assert point() == last.high_watermark
    last.close()
