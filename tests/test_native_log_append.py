"""The native log append (partition_server/rust/src/log_append.rs, `log_append_step` and
`AppendFacts`, used by PartitionLog.append_parsed) against the Python path, the reference
(`PartitionLog._append`: record_batch.plan_log_append in Python, `_write_planned`,
WalTap.wrote and wal.frame_parts), side by side.

Each seed drives two real logs, one on each path, through the same random steps: groups of
1-4 batches of random sizes (data batches of producers, transactional ones, markers),
some with a batch whose header lies about its size or over the size limit, at a clock that
moves on, stands still or goes back; segments small enough that groups roll them on the
way (by size, by age), explicit rolls and flushes; with a write-ahead file attached or not
(its frames fatal or not, its name sometimes one frame_parts refuses); and at the end a
log that refuses (failed, rolling, closed) or a write that fails (ENOSPC). After every
step the answers (offsets, or the error's type, reason, message and metadata), the logs'
state (segments, every index, the recent starts, the offsets and times) and the frames
queued must be the same; at the end so must every file's bytes.
"""

from __future__ import annotations

import dataclasses
import os
import random
import struct
from pathlib import Path

import pytest

from partition_server import log as log_module
from partition_server import native, record_batch
from partition_server.log import LogConfig, PartitionLog
from partition_server.record_batch import (ControlType, Record, TxnId, control_batch_parsed,
                                           encode_batch, parse_header)
from partition_server.segment import SparseIndex
from partition_server.wal import DATA, WriteAheadLog, decode_frames, frame_parts
from services.errors import AtomlogError

STEP = getattr(native.core, "log_append_step", None)
pytestmark = pytest.mark.skipif(STEP is None, reason=f"no native log append: {native.status()}")

SEEDS = int(os.environ.get("ATOMLOG_LOG_APPEND_DIFF_SEEDS", "40"))
STEPS = 60
NAME = "topic-3"


@pytest.fixture(autouse=True)
def python_reference(monkeypatch):
    """The reference log plans in Python, not with the native plan_log_append."""
    monkeypatch.setattr(record_batch, "plan_log_append",
                        record_batch.python_functions["plan_log_append"])


class Clock:
    def __init__(self, now: int):
        self.now = now

    def __call__(self) -> int:
        return self.now


def make_batch(rng: random.Random, now: int) -> tuple[bytes, object]:
    kind = rng.random()
    timestamp = now + rng.randint(-5_000, 5_000)
    if kind < 0.15:
        return control_batch_parsed(rng.choice([ControlType.COMMIT, ControlType.ABORT]),
                                    txn=TxnId(rng.randint(0, 15), rng.randint(1, 1000)),
                                    coordinator_epoch=rng.randint(0, 5), timestamp_ms=timestamp,
                                    producer_id=rng.randint(1, 50), producer_epoch=1)
    records = [Record(b"k%d" % i, rng.randbytes(rng.choice([0, 10, 300, 1200, 2500])),
                      timestamp_ms=timestamp + i)
               for i in range(rng.randint(1, 4))]
    txn = TxnId(rng.randint(0, 15), rng.randint(1, 1000)) if kind < 0.5 else None
    batch = encode_batch(records, producer_id=rng.randint(1, 50), producer_epoch=1,
                         base_sequence=rng.randint(0, 1000), txn=txn)
    return batch, parse_header(batch)


def make_group(rng: random.Random, now: int, max_batch_bytes: int) -> list:
    group = [make_batch(rng, now) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.05:  # a header that lies about its batch's size
        at = rng.randrange(len(group))
        group[at] = (group[at][0] + b"\0", group[at][1])
    if rng.random() < 0.05:  # a batch over the limit
        big = encode_batch([Record(b"k", bytes(max_batch_bytes))])
        group.insert(rng.randint(0, len(group)), (big, parse_header(big)))
    if rng.random() < 0.3:  # as the owner gives them: views, or bytearrays
        group = [(rng.choice([memoryview, bytearray, bytes])(batch), header)
                 for batch, header in group]
    return group


def same_place(text: str) -> str:
    """A message naming a log's directory, with the side's part of it taken out."""
    return text.replace("/python/", "/SIDE/").replace("/native/", "/SIDE/")


def outcome(call):
    try:
        return ("ok", call())
    except AtomlogError as error:
        return ("error", type(error), error.reason, same_place(error.message), error.metadata)
    except (ValueError, RuntimeError, OSError) as error:
        return ("error", type(error), same_place(str(error)))


def state(partition_log: PartitionLog) -> tuple:
    segments = partition_log._segments
    active = segments[-1]
    starts = {base: (segment.base_offset, position,
                     any(segment is s for s in segments))
              for base, (segment, position) in partition_log._recent_starts.items()}
    return ([dataclasses.replace(info, path=Path(info.path).name)
             for info in partition_log.segments()],
            list(partition_log._recent_starts), starts,
            [partition_log.index_entries(s.base_offset) for s in segments],
            active.index.running_max_timestamp_ms, active.first_append_time_ms,
            active.last_data_offset, partition_log.log_end_offset,
            partition_log.high_watermark, partition_log.last_append_time_ms,
            partition_log._last_data_offset_written,
            same_place(str(partition_log._broken)))


def files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())
            if path.is_file()}


def frames_of(wal: WriteAheadLog | None) -> tuple:
    if wal is None:
        return ()
    queued = (b"".join(wal._pending), list(wal._pending_ends), wal._fatal_queued)
    wal._pending.clear()
    wal._pending_ends.clear()
    return queued


@pytest.mark.parametrize("seed", range(SEEDS))
def test_native_log_append_matches_the_python_path(tmp_path, seed):
    rng = random.Random(seed)
    print("seed", seed)
    max_batch_bytes = rng.choice([4_000, 8_000, 1 << 20])
    config = LogConfig(segment_bytes=rng.choice([6_000, 12_000, 40_000, 1 << 20]),
                       segment_ms=rng.choice([50, 1_000, 10**9]),
                       index_interval_bytes=rng.choice([1, 500, 3_000, 4096, 100_000]),
                       max_batch_bytes=max_batch_bytes)
    with_wal = rng.random() < 0.7
    name = NAME if rng.random() < 0.9 else "x" * 256  # frame_parts refuses the long one
    start = 1_700_000_000_000
    clocks = {side: Clock(start) for side in ("python", "native")}
    logs, wals, calls = {}, {}, []
    for side in ("python", "native"):
        logs[side] = PartitionLog(tmp_path / side / NAME, config, clock_ms=clocks[side])
        wals[side] = WriteAheadLog(tmp_path / side / "wal") if with_wal else None
        if with_wal:
            logs[side].wal = wals[side].tap(name)
    logs["python"]._append_step = None

    def counted(*arguments):
        calls.append(1)
        return STEP(*arguments)

    logs["native"]._append_step = counted
    try:
        for _ in range(STEPS):
            move = rng.choice([0, 1, 7, 60, 400, -300])
            for clock in clocks.values():
                clock.now += move
            action = rng.random()
            if action < 0.8:
                group = make_group(rng, clocks["python"].now, max_batch_bytes)
                fatal = rng.random() < 0.2
                for tap in (partition_log.wal for partition_log in logs.values()):
                    if tap is not None:
                        tap.fatal = fatal
                size = sum(len(batch) for batch, _ in group)  # as the owner asks first
                assert logs["python"].roll_due(size) == logs["native"].roll_due(size)
                answers = [outcome(lambda: logs[side].append_parsed(group))
                           for side in ("python", "native")]
            elif action < 0.88:
                answers = [outcome(logs[side].roll) for side in ("python", "native")]
            elif action < 0.96:
                answers = [outcome(logs[side].flush) for side in ("python", "native")]
            else:
                answers = [outcome(lambda: logs[side].append_parsed([]))
                           for side in ("python", "native")]
            assert answers[0] == answers[1]
            assert state(logs["python"]) == state(logs["native"])
            queued = [frames_of(wals[side]) for side in ("python", "native")]
            assert queued[0] == queued[1]
            if queued[0] and queued[0][0]:
                frames, end = decode_frames(queued[0][0])
                assert end == len(queued[0][0]) and all(f.name == name for f in frames)
        ending = rng.choice(["none", "broken", "rolling", "closed", "enospc"])
        group = make_group(rng, clocks["python"].now, 1 << 20)
        if ending == "enospc":  # the write fails: the log breaks, as the reference's
            full = os.open("/dev/full", os.O_WRONLY)
            try:
                for partition_log in logs.values():
                    os.dup2(full, partition_log._segments[-1].fd)
            finally:
                os.close(full)
        for partition_log in logs.values():
            if ending == "broken":
                partition_log.fail("an fsync failed")
            elif ending == "rolling":
                partition_log._rolling = object()
            elif ending == "closed":
                partition_log.close()
        answers = [outcome(lambda: logs[side].append_parsed(group))
                   for side in ("python", "native")]
        assert answers[0] == answers[1]
        if ending == "enospc":
            assert answers[0][:2] == ("error", OSError)
            assert logs["python"]._broken == logs["native"]._broken is not None
        if ending == "rolling":
            for partition_log in logs.values():
                partition_log._rolling = None
        assert frames_of(wals["python"]) == frames_of(wals["native"])
    finally:
        for partition_log in logs.values():
            if not partition_log._closed:
                partition_log.close()
    assert files(tmp_path / "python" / NAME) == files(tmp_path / "native" / NAME)
    assert calls  # the native path was taken


def test_the_native_path_runs(tmp_path):
    """The seeds above take the native path (not only the reference's fallbacks)."""
    taken = []
    partition_log = PartitionLog(tmp_path / NAME, LogConfig())
    partition_log._append_step = lambda *arguments: taken.append(1) or STEP(*arguments)
    batch = encode_batch([Record(b"k", b"v")])
    assert partition_log.append_parsed([(batch, parse_header(batch))] * 2) == [0, 1]
    assert taken == [1]
    partition_log.close()
    assert log_module.PartitionLog._append_step is STEP


def python_step(group, next_offset, now, max_batch_bytes, size, first_time, segment_base,
                segment_bytes, segment_ms, interval_bytes, last_indexed, running_max_ts,
                frame_name):
    """log_append_step's answer made of the reference's parts (facts as lists)."""
    plan = record_batch.python_functions["plan_log_append"](
        group, next_offset, now, max_batch_bytes, size, first_time, segment_base,
        segment_bytes, segment_ms, interval_bytes, last_indexed, running_max_ts)
    if plan is None:
        return None
    buffers, stamped, after, starts, entries, end, running, max_ts, last_data = plan
    data = b"".join(buffers)
    head = None
    if frame_name is not None:
        try:
            head = frame_parts(DATA, frame_name, next_offset, data)[0]
        except (ValueError, struct.error):
            pass
    return (data, head, after, [h.base_offset for h in stamped], end, max_ts, last_data,
            (starts, entries, running))


@pytest.mark.parametrize("seed", range(5))
def test_the_step_is_the_references_parts(seed):
    """log_append_step's answer, item by item, against plan_log_append's and
    frame_parts' (in Python); the facts by what they do to a segment's objects."""
    rng = random.Random(seed)
    for _ in range(100):
        now = 1_700_000_000_000 + rng.randint(0, 10**6)
        group = make_group(rng, now, 8_000)
        size = rng.choice([0, 0, 100, 5_000])
        arguments = (group, rng.randint(0, 10**9), now, 8_000, size,
                     None if not size else now - rng.choice([0, 10, 10**6]), 0,
                     rng.choice([20_000, 1 << 20]), rng.choice([1_000, 10**9]),
                     rng.choice([1, 3_000]), None if not size else rng.choice([None, 0, 90]),
                     rng.choice([-1, now]), rng.choice([None, b"topic-3", b"", b"x" * 256]))
        expected, got = outcome(lambda: python_step(*arguments)), outcome(lambda: STEP(*arguments))
        if expected[0] == "error" or expected[1] is None:
            assert got == expected
            continue
        *same, (starts, entries, running) = expected[1]
        assert list(got[1][:-1]) == same
        index, recent, segment = SparseIndex(), {}, object()
        got[1][-1].apply(segment, index, recent, log_module.RECENT_STARTS)
        assert recent == {base: (segment, position) for base, position in starts}
        assert index.entries() == entries and index.running_max_timestamp_ms == running
