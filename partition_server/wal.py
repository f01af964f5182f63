"""A write-ahead file per partition server: `partition.durability=wal`.

In the other durability modes a group commit fsyncs the file of every partition it
wrote: a small transaction over four partitions and its TC partition costs five or more
fsyncs, each a request to the kernel's io_uring workers and a completion for the event
loop. In `wal` mode every partition owner of the process still writes its own segment
files (one writer per file, as before), and each write is also queued as a *frame* for
one file of the process, this write-ahead file (as PostgreSQL's WAL). A group commit
then waits for the file's next *round*: every frame queued since the last round in one
write and one fsync of one file, for every owner that asked. One fsync of the file runs
at a time (a round's, or a CUT or BASE frame's): a round asked for meanwhile runs when
it ends, taking everything asked until then (as PostgreSQL's WAL writer does), so no
fsync's success is read while another one's failure on the same file is not yet
recorded. The partition files are
written, readable and acknowledged at once, and fsynced later, many groups at a time, by
a *checkpointer* (every `partition.wal_checkpoint_ms`, or once
`partition.wal_checkpoint_bytes` were framed since the last); only then do their recovery
points move, and the write-ahead segments wholly below every partition's checkpoint are
deleted. docs/coordinator.md ("A write-ahead file per server") has the measurements that
led here.

Frames (big-endian), back to back in segment files `wal/<sequence:020d>.wal`:

    crc u32 (CRC-32C of everything after this field) | length u32 (bytes after this
    field) | kind u8 | name length u8 | offset i64 | name (UTF-8) | payload

- DATA: `offset` is the base offset of the first batch; the payload is the batches
  exactly as the log wrote them (offsets and append times stamped).
- CUT: the log was cut back to `offset` (a reload after a failed write or fsync, an
  operator's recovery from DATA_LOSS): frames before it at or above `offset` are void.
  It is durable before the cut is made, so replay applies appends and cuts in order.
- BASE: an owner loaded the log (replayed and fsynced) and it ends at `offset`: every
  earlier frame of the partition is void (a deleted and re-created topic's partition
  starts again at 0 under the same name). Durable before the owner writes.
- PAD: zeros that end a write on a page boundary (name `-`, offset 0; skipped by the
  replay). A round's fsync writes its last page back, and the kernel holds that page's
  lock meanwhile; the next round's write into the same page waited for it, in the
  event loop's own thread: 40-470 ms at a time on this machine's disk, the whole server
  stopped (measured 2026-12-02, docs/benchmarks.md, "The twentieth session"). So every
  write ends on a page boundary and the next one starts on a fresh page.

Segments are *preallocated*, as PostgreSQL's WAL files: each is made ahead of need on a
thread of the file's own (`partition.wal_segment_bytes` of zeros written around the page
cache, fsynced, as `prepared.wal.next`, renamed when a full segment rolls to it), and
frames overwrite it from the start. A roll away from a failed segment takes an empty
file instead (failures come in bursts, and the disk may be what fails). A round's fsync then writes its pages and no block allocation, extent or
file size: measured on this machine, an fsync of a page-aligned write took 0.13-0.16 ms
at the median in a zeroed file against 0.22-0.28 ms appending (0.19-0.21 ms appending
without the padding). Zeros end a segment's valid prefix like a torn tail. If a segment
cannot be preallocated (a full disk), the next one is an empty file written by appends.

Replay (`plan`, `replay_into`) reads each segment's longest valid prefix (a torn or
failed tail ends it; a roll fsyncs the segment it seals before the next one takes a
frame, so after a power cut only the last segment can be torn) and computes, per
partition, the batches the frames still stand for and the lowest offset they start from
(or a cut leaves). A partition is then *rewritten*
from its recovery point as found at open (everything below it was fsynced by a
successful flush, checkpoint or close; lower if a cut went lower): its log cut back
there (no frame: the bytes come back the same) and the frames' batches above it
appended again as a follower's copies are, then fsynced. So a power cut that lost a
file's unsynced tail, or a checkpoint whose fsync failed (whose pages the kernel may
have dropped), is repaired from the frames, never trusted. A partition whose log ends
below that offset lost data a checkpoint had made durable: DATA_LOSS, never silent.
At start the server replays every partition named in the file (`recover_all`) before it
serves anything, fsyncs them, and starts the file afresh; an owner that reloads after a
failure replays its own frames (`replay_one`).

A partition the file no longer names (its frames all checkpointed and trimmed) may still
hold, above its checkpoint, a write whose round a power cut lost while the kernel had
written the partition's page back. So before a trim deletes any segment, the file writes
a *listing of checkpoints* (`checkpoints.json`: every partition attached to it and how
far its own file was fsynced, below its high watermark), durably; at start, a listed
partition with no frame is cut back to its checkpoint (`cut_unframed_tails`). A
partition not listed was not under the file (another durability mode, or replicated)
and keeps its tail, whose own fsyncs made it durable. The start deletes the listing once every partition is durable to its
end, so a start in another mode never finds a stale one.

What stays on its own fsyncs: replicated partitions (followers copy before the leader's
fsync, and their truncations follow the leader's history), the subscriptions' cursor
journals, snapshots, and segment rolls (a roll fsyncs the sealed segment, as always).

The pure parts (`encode_frame`, `decode_frames`, `plan`, `SegmentLedger`) do no I/O; the
`WriteAheadLog` shell writes, fsyncs (through the durability barrier: the event loop's
io_uring), checkpoints and trims.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import functools
import json
import logging
import mmap
import os
import shutil
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
from prometheus_client import Gauge

from partition_server import durability
from partition_server.log import (CLEAN_SHUTDOWN_KEY, DATA_LOSS_FILE, RECOVERY_POINT_FILE,
                                  LogConfig, PartitionLog, _writev_all)
from partition_server.record_batch import iter_batches, parse_header
from partition_server.snapshot_files import fsync_directory, make_directory, write_atomically
from services import failpoints
from services.errors import AtomlogError
from services.fastmetrics import Counter, Histogram
from services.logs import event
from services.metrics import LATENCY_BUCKETS_SECONDS

log = logging.getLogger(__name__)

DATA, CUT, BASE, PAD = 1, 2, 3, 4
PAGE_BYTES = 4096  # writes end on a page boundary (see PAD)
HEADER = struct.Struct(">IIBBq")  # crc, length, kind, name length, offset
HEADER_SIZE = HEADER.size  # 18
CRC_FROM = 4  # the CRC covers everything after its own field
LENGTH_END = 8  # `length` counts the bytes after it
MAX_FRAME_BYTES = 256 << 20  # a frame claiming more is garbage (a torn tail)
SUFFIX = ".wal"
NEXT_SUFFIX = ".wal.next"  # a preallocated segment not yet in use
PREPARED_NAME = "prepared" + NEXT_SUFFIX
MIB = 1 << 20
NEVER_WAITED_FOR = 1 << 62  # a checkpoint above any offset: nothing is waited for

ROUNDS = Counter("atomlog_wal_rounds_total",
                 "Rounds of the write-ahead file: one write and one fsync for every group "
                 "commit that asked since the previous round.")
FRAMES = Counter("atomlog_wal_frames_total", "Frames written to the write-ahead file.",
                 ["kind"])
BYTES = Counter("atomlog_wal_bytes_total", "Bytes written to the write-ahead file.")
CHECKPOINTS = Counter("atomlog_wal_checkpoints_total",
                      "Partition files fsynced by the write-ahead file's checkpointer.",
                      ["result"])
RETAINED_BYTES = Gauge("atomlog_wal_retained_bytes",
                       "Bytes of write-ahead segments kept (not yet below every "
                       "partition's checkpoint).")
REPLAYED = Counter("atomlog_wal_replayed_batches_total",
                   "Batches appended again from the write-ahead file (start, reloads).")
TAILS_CUT = Counter("atomlog_wal_unframed_tails_cut_total",
                   "Partitions a start cut back to their checkpoint: their files held, above "
                   "it, writes of a round the crash lost that no durable frame covers "
                   "(partition_server/wal.py, cut_unframed_tails).")
ROUND_SECONDS = Histogram("atomlog_wal_round_seconds",
                          "From a round's write to its fsync's completion.",
                          buckets=LATENCY_BUCKETS_SECONDS)
_DATA_FRAMES, _CUT_FRAMES = FRAMES.labels("data"), FRAMES.labels("cut")
_PAD_FRAMES = FRAMES.labels("pad")
_BASE_FRAMES = FRAMES.labels("base")
_CHECKPOINTS_OK, _CHECKPOINTS_FAILED = CHECKPOINTS.labels("ok"), CHECKPOINTS.labels("failed")


# ---------------------------------------------------------------------------- pure core
def encode_frame(kind: int, name: str, offset: int, payload: bytes = b"") -> bytes:
    """One frame, whole (header, name, payload)."""
    return b"".join(frame_parts(kind, name.encode(), offset, payload))


_LENGTH_AND_BODY = struct.Struct(">IBBq")  # length, kind, name length, offset
_CRC = struct.Struct(">I")


def frame_parts(kind: int, raw_name: bytes, offset: int, payload: bytes) -> tuple[bytes, bytes]:
    """A frame as (header and name, payload): written with one writev, no copy of the
    payload."""
    if not 0 < len(raw_name) <= 255:
        raise ValueError(f"a write-ahead frame names its log in 1-255 bytes, not {raw_name!r}")
    head = _LENGTH_AND_BODY.pack(HEADER_SIZE - LENGTH_END + len(raw_name) + len(payload),
                                 kind, len(raw_name), offset) + raw_name
    return _CRC.pack(crc32c.crc32c(payload, crc32c.crc32c(head))) + head, payload


_PAD_NAME = b"-"
_PAD_MIN = HEADER_SIZE + len(_PAD_NAME)


def padding(size: int) -> list[bytes]:
    """The PAD frame (as writev buffers) that ends a write at segment position `size`
    on a page boundary; none if it ends on one already. A gap too short for a frame
    header is padded to the next boundary but one."""
    gap = -size % PAGE_BYTES
    if not gap:
        return []
    return list(_pad_frame(gap + PAGE_BYTES if gap < _PAD_MIN else gap))


@functools.lru_cache(maxsize=PAGE_BYTES + _PAD_MIN)
def _pad_frame(gap: int) -> tuple[bytes, bytes]:
    """One per round: made once per size, not encoded and checksummed each time."""
    return frame_parts(PAD, _PAD_NAME, 0, bytes(gap - _PAD_MIN))


@dataclass(frozen=True)
class Frame:
    kind: int
    name: str
    offset: int
    payload: memoryview
    end_position: int  # where the next frame starts in its segment
    segment: int = -1  # the segment's sequence, -1 for bytes decoded from memory


def decode_frames(data: bytes | memoryview, only: bytes | None = None, segment: int = -1
                  ) -> tuple[list[Frame], int]:
    """The longest valid prefix of a segment's bytes: its frames and where it ends. A
    short, oversized, unknown or CRC-failing frame ends it (a torn or failed tail).
    `only`: the frames of that partition (encoded name) alone; the others' CRCs are not
    checked (an owner's reload reading what its own process wrote). `segment`: the
    sequence of the segment the bytes are, kept in each frame (where `plan` finds their
    batches again)."""
    view = memoryview(data)
    frames: list[Frame] = []
    position, end = 0, len(view)
    while end - position >= HEADER_SIZE:
        crc, length, kind, name_len, offset = HEADER.unpack_from(view, position)
        frame_end = position + LENGTH_END + length
        if length < HEADER_SIZE - LENGTH_END + name_len or length > MAX_FRAME_BYTES or \
                frame_end > end or kind not in (DATA, CUT, BASE, PAD) or not name_len:
            break
        name_at = position + HEADER_SIZE
        if kind == PAD:
            if only is None and crc32c.crc32c(view[position + CRC_FROM:frame_end]) != crc:
                break
            position = frame_end
            continue
        if only is not None and view[name_at:name_at + name_len] != only:
            position = frame_end
            continue
        if crc32c.crc32c(view[position + CRC_FROM:frame_end]) != crc:
            break
        try:
            name = bytes(view[name_at:name_at + name_len]).decode()
        except UnicodeDecodeError:
            break
        frames.append(Frame(kind, name, offset, view[name_at + name_len:frame_end], frame_end,
                            segment))
        position = frame_end
    return frames, position


# Where a planned batch is: (segment sequence, position in it, size) for frames read from
# segment files, which `BatchReader` reads back when the batch is replayed (a plan of a
# 2 GiB write-ahead file holds its batches' places, not their bytes); the bytes
# themselves for frames decoded from memory.
BatchAt = tuple[int, int, int] | memoryview


@dataclass
class Plan:
    """What a partition's frames stand for: rewrite the log from `start` with `batches`
    ((base offset, last offset, where: BatchAt) in order, contiguous from `start`).
    `error`: the frames contradict each other (a writer's bug, or damage a CRC missed):
    the partition fails closed (DATA_LOSS) instead."""

    start: int
    batches: list[tuple[int, int, BatchAt]] = field(default_factory=list)
    error: str | None = None
    lowest_cut: int | None = None  # the lowest CUT since the last BASE

    @property
    def end(self) -> int:
        return self.batches[-1][1] + 1 if self.batches else self.start


def plan(frames: Iterator[Frame] | list[Frame]) -> dict[str, Plan]:
    """Per partition, from frames in the order they were written: the batches still
    standing after every cut since its last BASE, and the lowest offset they (or a cut)
    start from. A DATA frame whose batches do not parse, or do not continue where the
    partition's last ones ended, sets the plan's `error` (frames are appends)."""
    plans: dict[str, Plan] = {}
    for frame in frames:
        current = plans.get(frame.name)
        if current is not None and current.error is not None:
            if frame.kind == BASE:
                plans[frame.name] = Plan(frame.offset)
            continue
        if frame.kind == BASE:
            plans[frame.name] = Plan(frame.offset)
            continue
        if frame.kind == CUT:
            if current is None:
                plans[frame.name] = Plan(frame.offset, lowest_cut=frame.offset)
                continue
            current.batches = [b for b in current.batches if b[1] < frame.offset]
            current.start = min(current.start, frame.offset)
            current.lowest_cut = frame.offset if current.lowest_cut is None else \
                min(current.lowest_cut, frame.offset)
            continue
        try:
            if frame.segment < 0:
                batches = [(header.base_offset, header.last_offset,
                            frame.payload[position:position + header.size])
                           for position, header in iter_batches(frame.payload)]
            else:  # its place in the segment: the plan keeps no segment's bytes alive
                at = frame.end_position - len(frame.payload)
                batches = [(header.base_offset, header.last_offset,
                            (frame.segment, at + position, header.size))
                           for position, header in iter_batches(frame.payload)]
        except AtomlogError as error:
            batches, problem = [], f"unreadable batches: {error.message}"
        else:
            problem = None
        if problem is None and (not batches or batches[0][0] != frame.offset):
            problem = (f"holds batches from {batches[0][0] if batches else 'nothing'}")
        if problem is None and current is not None and current.batches and \
                frame.offset != current.end:
            problem = f"does not continue the last one, which ended at {current.end}"
        if problem is not None:
            failed = current or Plan(frame.offset)
            failed.error = f"a write-ahead frame at {frame.offset} {problem}"
            plans[frame.name] = failed
            continue
        if current is None:
            plans[frame.name] = Plan(frame.offset, batches)
            continue
        if not current.batches:
            # after a cut (or nothing yet): the log continues here, at or above the cut
            current.start = min(current.start, frame.offset)
        current.batches.extend(batches)
    return plans


class SegmentLedger:
    """Which write-ahead segments may go: per segment (oldest first), the end offset of
    each partition's frames in it. A segment goes once it is sealed and every partition
    it names is checkpointed to its end (its file fsynced that far), oldest first. A cut
    lowers what a partition's older frames are waited for to the cut."""

    def __init__(self) -> None:
        self.segments: deque[tuple[int, dict[str, int]]] = deque()  # (sequence, ends)

    def open(self, sequence: int) -> None:
        self.segments.append((sequence, {}))

    def wrote(self, name: str, end: int) -> None:
        ends = self.segments[-1][1]
        if end > ends.get(name, -1):
            ends[name] = end

    def cut(self, name: str, offset: int) -> None:
        for _, ends in self.segments:
            if ends.get(name, -1) > offset:
                ends[name] = offset

    def base(self, name: str) -> None:
        """Every frame of `name` so far is void (a BASE frame): none is waited for."""
        for _, ends in self.segments:
            ends.pop(name, None)

    def removable(self, checkpointed: Callable[[str], int], *, newest: bool = False
                  ) -> list[int]:
        """Sealed segments (all but the newest; the newest too with `newest`, once
        nothing is written any more) whose frames every partition has checkpointed,
        oldest first, stopping at the first that is still needed; they are taken out of
        the ledger."""
        gone: list[int] = []
        while len(self.segments) > (0 if newest else 1):
            sequence, ends = self.segments[0]
            if any(checkpointed(name) < end for name, end in ends.items()):
                break
            self.segments.popleft()
            gone.append(sequence)
        return gone


# ---------------------------------------------------------------------------- shell
def segment_path(directory: Path, sequence: int) -> Path:
    return directory / f"{sequence:020d}{SUFFIX}"


def preallocate(path: Path, size: int) -> int:
    """A file of `size` zeros at `path`, fsynced, opened for writing at its start: the
    next segment (any thread). The caller owns the descriptor. Raises OSError (a full
    disk, or less than four segments' room free: preallocation must not be what fills
    it), leaving nothing behind: the caller then appends to an empty file instead.

    The zeros are written around the page cache (O_DIRECT) where the filesystem allows
    it: written through the cache in large writes, they would sit in large folios, and
    a round's write would share a folio (and wait for its lock) with the previous
    round's pages that its fsync is writing back, which is what the padding is for. Not
    cached, each round's pages get folios of their own."""
    stat = os.statvfs(path.parent)
    if stat.f_bavail * stat.f_frsize < 4 * size:  # leave the room to the partitions
        raise OSError(errno.ENOSPC, f"less than {4 * size} bytes free for {path}")
    fd = -1
    try:
        _zero_fill(path, size)
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        os.fsync(fd)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        path.unlink(missing_ok=True)  # a disk that filled meanwhile: give its room back
        raise
    return fd


def _zero_fill(path: Path, size: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC |
                     getattr(os, "O_DIRECT", 0), 0o644)
        direct = hasattr(os, "O_DIRECT")
    except OSError as error:
        if error.errno != errno.EINVAL:  # a filesystem without O_DIRECT (tmpfs)
            raise
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        direct = False
    try:
        chunk = _direct_zeros() if direct else memoryview(bytes(PAGE_BYTES))
        left = size
        while left > 0:
            step = min(left, len(chunk))
            if direct and step % PAGE_BYTES:
                break  # a tail O_DIRECT cannot write: appends extend the file there
            left -= os.write(fd, chunk[:step])
    finally:
        os.close(fd)


@functools.cache
def _direct_zeros() -> memoryview:
    """1 MiB of zeros in page-aligned memory (what O_DIRECT writes from)."""
    return memoryview(mmap.mmap(-1, MIB))


def list_segments(directory: Path) -> list[int]:
    found = []
    for path in directory.glob("*" + SUFFIX):
        stem = path.name[:-len(SUFFIX)]
        if stem.isdigit():
            found.append(int(stem))
    return sorted(found)


def read_frames(directory: Path, sequences: list[int] | None = None,
                only: bytes | None = None) -> Iterator[Frame]:
    """Every segment's valid prefix (or those of `sequences`), oldest first, one segment
    in memory at a time (`plan` keeps the places of their batches, not their bytes);
    `only`: as decode_frames."""
    for sequence in list_segments(directory) if sequences is None else sequences:
        data = segment_path(directory, sequence).read_bytes()
        frames, _ = decode_frames(data, only, sequence)
        yield from frames


REPLAY_CHUNK_BYTES = 8 * MIB  # the most batch bytes a replay holds at once


class BatchReader:
    """Reads planned batches (BatchAt) back from the segments of `directory`, one segment
    file open at a time. The segments must stay until the reader is closed. Without a
    directory, only batches decoded from memory."""

    def __init__(self, directory: Path | None = None):
        self.directory = directory
        self._sequence, self._fd = -1, -1

    def _read(self, run: list[tuple[int, int, int]]) -> list[memoryview]:
        """The batches of `run` (adjacent places in one segment), read with one pread."""
        sequence, first, _ = run[0]
        size = run[-1][1] + run[-1][2] - first
        if self.directory is None:
            raise ValueError("a batch planned from a segment file, read without its directory")
        if sequence != self._sequence:
            self.close()
            self._fd = os.open(segment_path(self.directory, sequence), os.O_RDONLY)
            self._sequence = sequence
        data = memoryview(os.pread(self._fd, size, first))
        if len(data) != size:  # the segment is shorter than when it was read: fail closed
            raise OSError(errno.EIO, f"write-ahead segment {sequence} of {self.directory} "
                          f"ends before {first + size}, where a planned batch ends")
        return [data[position - first:position - first + length]
                for _, position, length in run]

    def chunks(self, batches: list[tuple[int, int, BatchAt]], limit: int = REPLAY_CHUNK_BYTES
               ) -> Iterator[list[bytes | memoryview]]:
        """The batches' bytes in order, in lists of about `limit` bytes; the batches of a
        frame (adjacent in their segment) are read together."""
        chunk: list[bytes | memoryview] = []
        run: list[tuple[int, int, int]] = []
        size = 0
        for _, _, where in batches:
            if run and (not isinstance(where, tuple) or where[0] != run[0][0]
                        or where[1] != run[-1][1] + run[-1][2]):
                chunk += self._read(run)
                run = []
            if isinstance(where, tuple):
                run.append(where)
                size += where[2]
            else:
                chunk.append(where)
                size += len(where)
            if size >= limit:
                if run:
                    chunk += self._read(run)
                    run = []
                yield chunk
                chunk, size = [], 0
        if run:
            chunk += self._read(run)
        if chunk:
            yield chunk

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._sequence, self._fd = -1, -1

    def __enter__(self) -> BatchReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def replay_into(partition_log: PartitionLog, partition_plan: Plan | None,
                reader: BatchReader | None = None) -> int:
    """Rewrite `partition_log` from its plan (see the module docstring) and fsync it;
    returns the batches appended. Before a WAL tap is set on the log (nothing here is
    framed again). A log in DATA_LOSS is left as it is; a log ending below the plan's
    start enters DATA_LOSS. `reader`: where the plan's batches are read back from (its
    segments' directory); None for a plan of frames decoded from memory."""
    if partition_log.data_loss is not None:
        return 0
    replayed = 0
    if partition_plan is not None and partition_plan.error is not None:
        partition_log.declare_data_loss(partition_log.log_end_offset, partition_plan.error)
        return 0
    if partition_plan is not None:
        # Below the log start: deleted since (retention, DeleteRecords). Below the
        # recovery point the log found at open: fsynced (a flush, a checkpoint, a close)
        # and kept, unless a cut since went lower (its frame is durable, the cut itself
        # maybe not made). From there on, rewritten.
        log_start = partition_log.log_start_offset
        floor = partition_log.recovery.recovery_point
        if partition_plan.lowest_cut is not None:
            floor = min(floor, partition_plan.lowest_cut)
        floor = max(floor, partition_plan.start, log_start)
        batches = [b for b in partition_plan.batches if b[0] >= floor]
        # (frames end at or above the recovery point: it moves only with durable frames)
        start = batches[0][0] if batches else max(min(floor, partition_plan.end), log_start)
        if partition_log.log_end_offset < start:
            partition_log.declare_data_loss(
                partition_log.log_end_offset,
                f"the log ends at {partition_log.log_end_offset}, below {start}, where the "
                "write-ahead file's frames begin: checkpointed data is missing")
            return 0
        if partition_log.log_end_offset > start:
            partition_log.truncate_to(start)
        if batches:
            for chunk in (reader or BatchReader()).chunks(batches):
                partition_log.append_copied([(data, parse_header(data)) for data in chunk])
            replayed = len(batches)
            REPLAYED.inc(replayed)
    # What it appended, fsynced; the rest the open made durable (its recovery fsyncs
    # the last segment, a clean close had), as a cut does.
    partition_log.flush()
    return replayed


KEPT_MANIFEST = "kept.json"  # in a kept-aside directory: why its segments were kept
# The listing of checkpoints: {"partitions": {name: offset}}, every partition attached to
# this file and how far its own file was fsynced (its checkpoint: PartitionLog.
# recoverable_offset, below its high watermark), written durably before any trim deletes
# a segment (`_retire_segments`). See `cut_unframed_tails`.
CHECKPOINTS_FILE = "checkpoints.json"
CUT_CONCURRENCY = 4  # partitions `cut_unframed_tails` opens at once


def _kept_manifests(wal_dir: Path) -> Iterator[tuple[Path, dict]]:
    """(kept directory, its manifest {"missing": [...], "data_loss": [...]}), oldest
    first; directories kept before manifests were written (for an operator only) and
    unreadable manifests are left out."""
    for kept in sorted(wal_dir.glob("kept-*")):
        try:
            manifest = json.loads((kept / KEPT_MANIFEST).read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and all(
                isinstance(manifest.get(key), list) for key in ("missing", "data_loss")):
            yield kept, manifest


def read_checkpoints(directory: Path) -> dict[str, int] | None:
    """The listing of checkpoints a running file wrote before its last trim ({} when
    there is none: no trim since the last start, or a clean close's); None when it
    cannot be read (an event says so; nothing is cut on it)."""
    path = directory / CHECKPOINTS_FILE
    try:
        listing = json.loads(path.read_bytes())["partitions"]
        return {str(name): int(offset) for name, offset in listing.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        event(log, "the write-ahead file's listing of checkpoints is unreadable: tails no "
              "frame covers are kept", logging.ERROR, file=str(path),
              error=f"{type(error).__name__}: {error}")
        return None


def cut_unframed_tails(listing: dict[str, int] | None, plans: dict[str, Plan],
                       data_dir: Path, config: LogConfig) -> dict[str, int]:
    """At a start, for every partition the listing names and no frame of the file does:
    cut what its file holds above its checkpoint, and fsync it. Returns {name: the
    offset it was cut to}.

    Such a partition's frames were all checkpointed and trimmed, so everything it
    acknowledged is at or below the listed checkpoint (the listing is durable before a
    trim deletes a frame), and whatever its file holds above it was written in a round
    that never became durable: a power cut lost the round while the kernel had written
    the partition's page back. Kept, it would stand without the rest of its round: a
    one-round commit's decision in a TC log without its stages in the other partitions
    (docs/coordinator.md, "One round a commit"). Its own recovery point may lag the
    listing (written at most once a recovery_point_interval_ms, not synced) or lead it
    (written after the listing); both are durable offsets, so it is cut to the higher.
    A partition the listing does not name was not under this file at its last start
    (another durability mode, or replicated: its own fsyncs made its tail durable), and
    keeps its tail as such a start would."""
    todo = [(name, checkpoint) for name, checkpoint in sorted((listing or {}).items())
            if name not in plans and (data_dir / name).is_dir()
            and not (data_dir / name / DATA_LOSS_FILE).exists()
            and not _closed_cleanly(data_dir / name)]

    def cut_one(name: str, checkpoint: int) -> int | None:
        partition_log = PartitionLog(data_dir / name, config, trust_tail=False)
        try:
            if partition_log.data_loss is not None:
                return None
            floor = max(checkpoint, partition_log.recovery.recovery_point,
                        partition_log.log_start_offset)
            cut_to = None
            if partition_log.log_end_offset > floor:
                event(log, "a partition's tail that no durable write-ahead frame covers was "
                      "cut (a round a crash lost, written back to its file)",
                      logging.WARNING, partition=name, log_end=partition_log.log_end_offset,
                      cut_to=floor)
                partition_log.truncate_to(floor)
                TAILS_CUT.inc()
                cut_to = floor
            partition_log.flush()
            return cut_to
        finally:
            partition_log.close()

    # As many at once as the owners open at a start (their opens then find these logs
    # closed cleanly, and scan nothing).
    with concurrent.futures.ThreadPoolExecutor(CUT_CONCURRENCY) as pool:
        done = list(pool.map(lambda item: (item[0], cut_one(*item)), todo))
    return {name: floor for name, floor in done if floor is not None}


def write_listing(directory: Path, listing: dict[str, int]) -> None:
    """The listing of checkpoints (CHECKPOINTS_FILE), durably. Blocking."""
    write_atomically(directory / CHECKPOINTS_FILE,
                     json.dumps({"partitions": listing}, sort_keys=True).encode())


def _closed_cleanly(directory: Path) -> bool:
    """Whether a partition's log was closed cleanly and not opened since (its close
    fsynced all it holds after its last round was durable): nothing to cut, and its
    open is left to its owner."""
    try:
        record = json.loads((directory / RECOVERY_POINT_FILE).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and isinstance(record.get(CLEAN_SHUTDOWN_KEY), dict)


def _replay_config(config: LogConfig) -> LogConfig:
    """The storage settings a replay opens partitions with: any topic's batch size."""
    return dataclasses.replace(config, max_batch_bytes=(1 << 31) - 1)


def replay_kept(wal_dir: Path, data_dir: Path, config: LogConfig,
                live: set[str] | frozenset[str] = frozenset()) -> None:
    """Before a start's replay (blocking): the partitions whose frames an earlier start
    kept aside because their directories were missing (a disk swapped, directories
    moved) and whose directories are back get those frames now, oldest kept first. What
    a directory held only in the page cache when it was lost (up to a checkpoint's
    worth of acknowledged writes, gone if the power failed since) comes back from them.

    Only into the same log: its batches from where the frames begin must be the frames'
    own, byte for byte. A directory that holds other batches there is another copy (its
    partition made anew), left as it is and the frames given up for it, logged. One
    still missing, or in DATA_LOSS (the marker of a lost copy), keeps them for a later
    start; `forget_kept` (an operator accepting the loss) gives them up. A kept
    directory with nothing left to replay or keep is deleted. `live`: the partitions the
    file's own segments have frames of; one of them was written since (made anew while
    its directory was missing), so its kept frames are left for an operator."""
    for kept, manifest in _kept_manifests(wal_dir):
        missing = list(manifest["missing"])
        if missing:
            with BatchReader(kept) as reader:
                still = _replay_kept_directory(kept, missing, data_dir, config, live, reader)
        else:
            still = []
        if still or manifest["data_loss"]:
            if still != missing:
                manifest["missing"] = still
                write_atomically(kept / KEPT_MANIFEST, json.dumps(manifest).encode())
        else:
            shutil.rmtree(kept)
        fsync_directory(wal_dir)


def _replay_kept_directory(kept: Path, missing: list[str], data_dir: Path, config: LogConfig,
                           live: set[str] | frozenset[str], reader: BatchReader) -> list[str]:
    """`replay_kept` for the partitions of one kept directory still `missing`: those
    that stay so."""
    plans = plan(read_frames(kept))
    still: list[str] = []
    for name in missing:
        directory = data_dir / name
        partition_plan = plans.get(name)
        if partition_plan is None:
            continue
        if name in live:
            event(log, "write-ahead frames kept aside not replayed: the partition was "
                  "written since", logging.ERROR, partition=name, directory=str(kept))
        if not directory.is_dir() or name in live:
            still.append(name)
            continue
        partition_log = PartitionLog(directory, config)
        try:
            if partition_log.data_loss is not None:
                still.append(name)
                continue
            verdict = _same_log(partition_log, partition_plan, reader)
            if verdict:
                event(log, "write-ahead frames kept aside not replayed: the directory "
                      "back holds another log", logging.ERROR, partition=name,
                      directory=str(kept), detail=verdict)
                continue
            count = replay_into(partition_log, partition_plan, reader)
            event(log, "write-ahead frames kept aside replayed into a directory back",
                  logging.WARNING, partition=name, directory=str(kept), batches=count,
                  log_end_offset=partition_log.log_end_offset)
        finally:
            partition_log.close()
    return still


def _same_log(partition_log: PartitionLog, partition_plan: Plan, reader: BatchReader) -> str:
    """"" when `partition_log` may be continued from `partition_plan` (its batches from
    the plan's start, up to where the plan ends, are the plan's own), else why not.
    Compared a chunk (REPLAY_CHUNK_BYTES) at a time."""
    if partition_plan.error is not None:
        return f"the frames contradict each other: {partition_plan.error}"
    start = partition_plan.start
    upto = min(partition_log.log_end_offset, partition_plan.end)
    if upto <= start or start < partition_log.log_start_offset:
        return ""  # nothing to compare: replay_into appends, or finds data missing
    differs = (f"its batches from offset {start} differ from the frames' (another copy of "
               "the partition)")
    position = start
    for chunk in reader.chunks([b for b in partition_plan.batches if b[0] < upto]):
        framed = memoryview(b"".join(chunk))
        while framed and position < upto:
            held, position = partition_log.read(position, len(framed), upto)
            if not held or held != framed[:len(held)]:
                return differs
            framed = framed[len(held):]
        if position >= upto:
            break
    return ""


KEPT_STATES = {
    "pending": "its directory was missing: replayed into it at the server's next start "
               "once it is back",
    "data-loss": "its copy was in DATA_LOSS: given up when its loss is accepted "
                 "(atomlog partition recover)",
    "done": "nothing left to do here (replayed, or given up)",
    "no-manifest": "kept before the server listed why (2026-12-05): never replayed; an "
                   "operator's to read",
}


def describe_kept(wal_dir: Path, data_dir: Path) -> list[dict]:
    """What the write-ahead file's kept-aside directories hold, for an operator (`atomlog
    partition kept-frames`), read-only: per kept directory and partition with frames in
    it, the offsets they cover, what becomes of them (KEPT_STATES) and the partition's
    directory now ("present", "missing", or "data-loss": present with a loss marker)."""
    manifests = dict(_kept_manifests(wal_dir))
    rows = []
    for kept in sorted(wal_dir.glob("kept-*")):
        manifest = manifests.get(kept)
        stamp = kept.name.removeprefix("kept-")
        kept_at_ms = int(stamp) if stamp.isdigit() else None
        try:
            plans = plan(read_frames(kept))
        except OSError as error:
            rows.append({"kept": kept.name, "kept_at_ms": kept_at_ms, "partition": None,
                         "status": "unreadable", "detail": f"{type(error).__name__}: {error}"})
            continue
        for name, partition_plan in sorted(plans.items()):
            if manifest is None:
                status = "no-manifest"
            elif name in manifest["missing"]:
                status = "pending"
            elif name in manifest["data_loss"]:
                status = "data-loss"
            else:
                status = "done"
            directory = data_dir / name
            rows.append({
                "kept": kept.name, "kept_at_ms": kept_at_ms, "partition": name,
                "status": status, "first_offset": partition_plan.start,
                "end_offset": partition_plan.end, "batches": len(partition_plan.batches),
                "directory": ("missing" if not directory.is_dir() else "data-loss"
                              if (directory / DATA_LOSS_FILE).exists() else "present"),
                "detail": partition_plan.error or KEPT_STATES[status]})
    return rows


def forget_kept(wal_dir: Path, name: str) -> None:
    """Give up the frames kept aside for partition `name` (its loss accepted by an
    operator: its directory starts anew and must never get them). Blocking."""
    for kept, manifest in _kept_manifests(wal_dir):
        changed = False
        for key in ("missing", "data_loss"):
            if name in manifest[key]:
                manifest[key].remove(name)
                changed = True
        if changed:
            write_atomically(kept / KEPT_MANIFEST, json.dumps(manifest).encode())
            event(log, "write-ahead frames kept aside given up: the partition's loss was "
                  "accepted", partition=name, directory=str(kept))


def replay_leftover(directory: Path, data_dir: Path, config: LogConfig) -> dict | None:
    """A server started in another durability mode over a write-ahead file left by an
    earlier one (`partition.durability` changed from wal): what the file holds goes into
    the partitions first, as a start in wal mode would do; the segments go (or are kept
    aside), and frames kept aside by an earlier start go into directories that came back
    (`replay_kept`). None when there is no such file, or only its listing of checkpoints
    (a clean close's; what it lists is cut as a start cuts it: `cut_unframed_tails`).
    Blocking."""
    if not directory.is_dir():
        return None
    if list_segments(directory):
        return WriteAheadLog(directory).recover_all(data_dir, config)
    if (directory / CHECKPOINTS_FILE).exists():  # (cut_unframed_tails; kept frames too)
        WriteAheadLog(directory).recover_all(data_dir, config)
    elif any(directory.glob("kept-*")):
        replay_kept(directory, data_dir, _replay_config(config))
    return None


class WalTap:
    """One partition's way to the write-ahead file (PartitionLog.wal): its writes become
    frames, its cuts CUT frames (durable before the cut), its flushes wait for a round;
    the checkpointer fsyncs `log` and tells `on_failure` if that fails."""

    __slots__ = ("wal", "name", "raw_name", "log", "on_failure", "fatal")

    def __init__(self, wal: WriteAheadLog, name: str):
        self.wal, self.name, self.raw_name = wal, name, name.encode()
        self.log: PartitionLog | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        # While set, this partition's writes are *fatal* frames. The commit lane's
        # one-round step (owner.write_gathered) writes a commit's staged batches and then
        # its decision, so that a durable decision implies durable stages: that holds as
        # long as nothing of the file is lost or cut meanwhile. So while any fatal frame
        # is not yet durable, a failed write or fsync of the file stops the server
        # (WriteAheadLog.on_fatal) instead of reloading partitions one by one: each
        # reload reads the file at its own moment (the kernel may drop a failed fsync's
        # pages in between), and a TC partition would retry a decision whose stages are
        # gone. A start replays the whole file in one pass (PostgreSQL stops on a failed
        # WAL fsync too). A partition failing on its own meanwhile reloads keeping its
        # gathered write (PartitionOwner._fail_closed), or stops the server if it cannot.
        self.fatal = False

    def wrote(self, base_offset: int, buffers: list, end: int) -> None:
        self.wal.queue(self.raw_name, self.name, base_offset, b"".join(buffers), end,
                       self.fatal)

    def wrote_framed(self, head: bytes, payload: bytes, end: int) -> None:
        """`wrote` of a DATA frame already made (`head` over `payload`, as frame_parts
        gives them, with the name `raw_name`)."""
        self.wal.queue_framed(self.name, head, payload, end, self.fatal)

    def cut(self, offset: int) -> None:
        self.wal.write_cut(self.name, offset)

    def sync(self, wake: Callable[[], object] | None) -> durability.SyncTicket:
        return self.wal.sync(self.name, wake)

    def attach(self, partition_log: PartitionLog,
               on_failure: Callable[[BaseException], None]) -> None:
        """The owner's log, loaded (replayed, fsynced, its BASE frame written):
        checkpointed from now on."""
        self.log, self.on_failure = partition_log, on_failure
        with self.wal._lock:
            self.wal._data_loss.discard(self.name)

    def data_loss(self) -> None:
        """The owner's log loaded in DATA_LOSS (never attached, never checkpointed): its
        frames are kept aside when their segments go, for the operator
        (`partition kept-frames`, and `partition recover` gives them up)."""
        with self.wal._lock:
            self.wal._data_loss.add(self.name)

    def detach(self, partition_log: PartitionLog | None) -> None:
        """The owner closed its log: if the close made it durable (a healthy close
        fsyncs), its frames are no longer needed."""
        if partition_log is not None and partition_log.closed_durable:
            self.wal.checkpointed(self.name, partition_log.log_end_offset)
        if self.log is partition_log:
            self.log = None


@dataclass(eq=False)
class _Round:
    tickets: list[tuple[durability.SyncTicket, str]]
    sequence: int  # the segment written
    began: float
    covers: int = 0  # the fatal frames written before its fsync (WalTap.fatal)
    done: bool = False
    error: BaseException | None = None


# The exit status of a server stopped by a failed write or fsync of fatal frames
# (WalTap.fatal): EX_IOERR of sysexits.h.
EXIT_WAL_FAILED = 74


def stop_the_process(error: BaseException) -> None:
    """The default `WriteAheadLog.on_fatal`: log why and end the process at once, with
    nothing more written or answered (PostgreSQL's PANIC on a failed WAL fsync). Its
    supervisor starts it again, and the start replays the file in one pass."""
    event(log, "stopping: the write-ahead file failed under frames whose loss stops the "
          "server; starting again replays it", logging.CRITICAL, error=repr(error),
          exit_status=EXIT_WAL_FAILED)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 — exiting regardless
            pass
    os._exit(EXIT_WAL_FAILED)


SYNC_TURN_WAIT_S = 60.0  # a worker's wait for the fsync in flight before its own


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class WriteAheadLog:
    """The write-ahead file of one partition server (its owners share one event loop).
    Frames are queued by the owners' writes (on the loop) and by cuts (on worker
    threads), under one lock; a round is run once per event-loop turn in which a flush
    asked for one."""

    def __init__(self, directory: Path, *, segment_bytes: int = 16 * MIB,
                 checkpoint_ms: int = 500, max_bytes: int = 1 << 30,
                 checkpoint_bytes: int = 4 * MIB,
                 fsync: Callable[[int], None] = failpoints.fsync):
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.checkpoint_ms = checkpoint_ms
        self.checkpoint_bytes = checkpoint_bytes
        self.max_bytes = max_bytes
        self._fsync = fsync
        self._lock = threading.Lock()
        self._pending: list[bytes] = []
        self._pending_ends: list[tuple[str, int]] = []
        # Fatal frames (WalTap.fatal), counted: queued, written to the file, and made
        # durable by an fsync that succeeded. While some are not durable, a failure of
        # the file stops the server (`_failed`, `stop`; a partition's own failures are
        # its owner's to judge, PartitionOwner._fail_closed):
        # `on_fatal` does (tests put a recorder there), and `_stopped` then fails every
        # later write, for a recorder that returns.
        self._fatal_queued = self._fatal_written = self._fatal_durable = 0
        self.on_fatal: Callable[[BaseException], None] = stop_the_process
        self._stopped: BaseException | None = None
        self._waiting: list[tuple[durability.SyncTicket, str]] = []
        self._names_in: dict[int, set[str]] = {}  # per segment, the partitions framed in it
        self._lost: set[str] = set()  # partitions whose frames may be lost (see _lose)
        # Partitions loaded in DATA_LOSS (no log attached, so never checkpointed): their
        # frames no longer hold the segments back; a segment holding some is kept aside
        # (`kept-*`, as a start keeps them) when it goes. (Before, one such partition held
        # every segment until the file reached wal_max_bytes and refused every write.)
        self._data_loss: set[str] = set()
        self._rounds: deque[_Round] = deque()
        # One fsync of the file at a time (a round's, or a CUT/BASE frame's on a worker
        # thread): `_syncing` while one runs, `_idle` notified when it ends. Concurrent
        # fsyncs of one open file share its write-back error (Linux's errseq reports it to
        # the first fsync that looks), so one that returned success could be answered
        # while another, failing, had not yet poisoned the segment: an acknowledgement of
        # frames that may not be on the disk (found by an audit, 2026-12-06). One at a
        # time, every fsync's verdict covers what happened since the last one ended, and
        # a failure poisons the segment before the next fsync begins.
        self._syncing = False
        self._turn_wanted = 0  # workers waiting for the turn: rounds let them go first
        self._idle = threading.Condition(self._lock)
        self._turn: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sync: durability.LogSync | None = None
        self._fd = -1
        self._sequence = -1
        self._size = 0
        self._sizes: dict[int, int] = {}
        self._retained = 0  # bytes of the segments kept
        self._poisoned: set[int] = set()  # segments a write or fsync failed on
        self._ledger = SegmentLedger()
        self._taps: dict[str, WalTap] = {}
        self._checkpointed: dict[str, int] = {}
        # The listing of checkpoints (`_write_listing`): the generation of the last one
        # asked for, and of the last one written.
        self._listing_generation = self._listing_written = 0
        self._listing_lock = threading.Lock()
        self._checkpointer: asyncio.Task | None = None
        self._in_checkpoint: set[str] = set()
        # Bytes framed since the checkpointer last began: at `checkpoint_bytes` it begins
        # at once instead of at its next interval (`_checkpoints`).
        self._since_checkpoint = 0
        self._checkpoint_now: asyncio.Event | None = None
        self._replays = 0  # owners' reloads reading the segments (no trim meanwhile)
        # Segments a trim took out of the books but could not delete (an unlink failed),
        # with the DATA_LOSS partitions to keep them for: deleted before any newer one, or
        # a newer one gone would leave a hole that a start's replay took for lost frames.
        self._undeleted: tuple[list[int], list[str]] | None = None
        # The next segment, preallocated on a thread of its own (`PREPARED_NAME`): the
        # future of its descriptor. See the module's docstring.
        self._next: concurrent.futures.Future | None = None
        self._preparer: concurrent.futures.ThreadPoolExecutor | None = None
        self.closed = False

    # ------------------------------------------------------------------ start
    def recover_all(self, data_dir: Path, config: LogConfig) -> dict:
        """At start, before anything is served (blocking): replay every partition the
        segments name into its directory under `data_dir`, fsync it and close it, then
        delete the segments. A partition whose directory is gone (its topic deleted, or
        the directory lost) is skipped. If one was skipped, or one is in DATA_LOSS, the
        segments are kept aside (`wal/kept-<unix ms>/`) instead of deleted, with a list
        of those partitions (KEPT_MANIFEST): one whose directory comes back is replayed
        from them at a later start (`replay_kept`). `config`: the server's storage
        settings (any topic's batch size is taken). Returns {name: batches replayed}."""
        make_directory(self.directory)
        config = _replay_config(config)
        plans = plan(read_frames(self.directory))
        replay_kept(self.directory, data_dir, config, live=set(plans))
        listing = read_checkpoints(self.directory)
        replayed: dict[str, int] = {}
        missing: list[str] = []
        lost: list[str] = []
        with BatchReader(self.directory) as reader:
            for name, partition_plan in plans.items():
                directory = data_dir / name
                if not directory.is_dir():
                    event(log, "write-ahead frames of a partition with no directory skipped",
                          logging.WARNING, partition=name)
                    missing.append(name)
                    continue
                partition_log = PartitionLog(directory, config)
                try:
                    replayed[name] = replay_into(partition_log, partition_plan, reader)
                    if partition_log.data_loss is not None:
                        lost.append(name)
                finally:
                    partition_log.close()
        cut_unframed_tails(listing, plans, data_dir, config)
        segments = [segment_path(self.directory, s) for s in list_segments(self.directory)]
        if (missing or lost) and any(path.stat().st_size for path in segments):
            kept = self.directory / f"kept-{int(time.time() * 1000)}"
            kept.mkdir()
            # The list first: segments kept without it would never be replayed.
            write_atomically(kept / KEPT_MANIFEST, json.dumps(
                {"missing": sorted(missing), "data_loss": sorted(lost)}).encode())
            for path in segments:
                path.rename(kept / path.name)
            fsync_directory(kept)
            event(log, "write-ahead segments kept aside: partitions not replayed",
                  logging.ERROR, partitions=sorted(missing + lost), directory=str(kept))
        else:
            for path in segments:
                path.unlink()
        for path in self.directory.glob("*" + NEXT_SUFFIX):  # preallocated, never used
            path.unlink()
        # Last: every partition it listed is durable to its end now (replayed, cut or
        # untouched), and a start in another mode must not find it later.
        (self.directory / CHECKPOINTS_FILE).unlink(missing_ok=True)
        fsync_directory(self.directory)
        if plans:
            event(log, "write-ahead file replayed", partitions=len(plans),
                  batches=sum(replayed.values()))
        return replayed

    async def start(self) -> None:
        """Open a new segment and start the checkpointer (on the owners' event loop)."""
        self._loop = asyncio.get_running_loop()
        make_directory(self.directory)
        existing = list_segments(self.directory)
        if existing:  # recover_all replays and deletes them first
            raise RuntimeError(f"write-ahead segments {existing} in {self.directory} were "
                               "not replayed")
        await asyncio.to_thread(self._open_next)
        self._sync = await asyncio.to_thread(durability.barrier().open, self.directory,
                                             durability.FSYNC, None, self._loop)
        self._checkpointer = asyncio.create_task(self._checkpoints(), name="wal checkpointer")

    def _open_next(self) -> None:
        """Under the lock (or before the loop runs): a new segment becomes the active one.
        The segment it replaces is fsynced first (blocking, as the directory's fsync
        below; once per `segment_bytes`), by the holder of the file's fsync turn (a
        round, or a durable frame: no other fsync of the file runs meanwhile): its
        writes were only ever fsynced by the rounds, and if the new segment's frames
        could be durable before the old one's tail, a power cut might keep them and lose
        the tail they continue, and the replay would refuse their partition as DATA_LOSS
        although nothing acknowledged was lost. A failed fsync poisons the old segment
        as a failed round does (its partitions reload)."""
        if self._fd >= 0 and self._size and self._sequence not in self._poisoned:
            try:
                self._fsync(self._fd)
            except OSError as error:
                self._poisoned.add(self._sequence)
                self._lose(set(self._names_in[self._sequence]), error)
                self._failed(error)
            else:
                self._synced_up_to(self._fatal_written)
        failed = self._fd >= 0 and self._sequence in self._poisoned
        self._sequence += 1
        # A roll away from a failed segment (its writes, its rounds' or its seal's fsync)
        # takes an empty file: failures come in bursts (a failing disk fails every
        # round), and a preallocated segment each would fill the disk with segments
        # nothing can trim while the partitions reload (chaos seed 2809 filled its 768
        # MiB so and never recovered).
        fd = self._empty_segment(self._sequence) if failed else \
            self._take_prepared(self._sequence)
        fsync_directory(self.directory)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._size = fd, 0
        self._sizes[self._sequence] = 0
        self._names_in[self._sequence] = set()
        self._ledger.open(self._sequence)

    def _take_prepared(self, sequence: int) -> int:
        """Under the lock: the preallocated segment (waited for if it is not ready yet: it
        was asked for when the previous one was taken), renamed to segment `sequence`;
        then the next one is asked for. If preallocation failed, an empty file."""
        prepared, self._next = self._next, None
        if prepared is None:
            prepared = self._prepare()
        fd = -1
        try:
            fd = prepared.result()
            os.rename(self.directory / PREPARED_NAME, segment_path(self.directory, sequence))
        except OSError as error:
            if fd >= 0:
                os.close(fd)
            (self.directory / PREPARED_NAME).unlink(missing_ok=True)
            event(log, "a write-ahead segment could not be preallocated; appending to an "
                  "empty one", logging.WARNING, segment=sequence, error=str(error))
            fd = self._empty_segment(sequence)
        if not self.closed:
            self._next = self._prepare()
        return fd

    def _empty_segment(self, sequence: int) -> int:
        return os.open(segment_path(self.directory, sequence), os.O_WRONLY | os.O_CREAT |
                       os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644)

    def _prepare(self) -> concurrent.futures.Future:
        if self._preparer is None:
            self._preparer = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="wal-preallocate")
        return self._preparer.submit(preallocate, self.directory / PREPARED_NAME,
                                     self.segment_bytes)

    def tap(self, name: str) -> WalTap:
        tap = self._taps.get(name)
        if tap is None:
            tap = self._taps[name] = WalTap(self, name)
        return tap

    # ------------------------------------------------------------------ frames
    def queue(self, raw_name: bytes, name: str, offset: int, payload: bytes, end: int,
              fatal: bool = False) -> None:
        """A DATA frame of partition `name` (`raw_name` encoded), written by the next round.
        Not while `name` is lost (`_lose`) until its reload's BASE frame: its flushes fail
        meanwhile, and a frame written after the dropped ones would not continue them, so
        the reload's plan took a gap in what was never acknowledged for a data loss."""
        head, payload = frame_parts(DATA, raw_name, offset, payload)
        self.queue_framed(name, head, payload, end, fatal)

    def queue_framed(self, name: str, head: bytes, payload: bytes, end: int,
                     fatal: bool = False) -> None:
        """`queue` of a DATA frame already made: `head` and `payload` as frame_parts
        gives them (the native core builds the head of a log's append,
        PartitionLog.append_parsed)."""
        with self._lock:
            if fatal:
                self._fatal_queued += 1
            if name in self._lost:
                if fatal:  # (lost between the owner's look and its write: a worker's cut)
                    self.stop(OSError(errno.EIO, f"a fatal frame of {name} would be "
                                      "dropped: its frames are lost until it reloads"))
                return
            self._pending += (head, payload)
            self._pending_ends.append((name, end))
        _DATA_FRAMES.inc()

    def lost(self, name: str) -> bool:
        """Whether partition `name`'s frames are dropped until its reload (`_lose`)."""
        return name in self._lost

    def fatal_exposed(self) -> bool:
        """Whether fatal frames are not yet durable."""
        return self._fatal_queued > self._fatal_durable

    def stop(self, error: BaseException) -> None:
        """Stop the server (`on_fatal`, once): something that fatal frames not yet
        durable depend on failed (WalTap.fatal)."""
        if self._stopped is None:
            self._stopped = error
            self.on_fatal(error)

    def _failed(self, error: BaseException) -> None:
        """Under the lock: a write or fsync of the file failed: fatal if fatal frames
        are not yet durable (they may be lost, or partitions they depend on cut)."""
        if self.fatal_exposed():
            self.stop(error)

    def _synced_up_to(self, covers: int) -> None:
        """Under the lock: an fsync that began after `covers` fatal frames were written
        succeeded."""
        if covers > self._fatal_durable:
            self._fatal_durable = covers

    def _write_pending(self) -> int:
        """Under the lock: write every queued frame to the active segment, then a PAD
        frame to the next page boundary; returns its sequence. Rolls to a new segment
        first when the active one is full or failed."""
        if self._stopped is not None:
            raise OSError(errno.EIO, "the write-ahead file stopped after a failure under "
                          f"fatal frames: {self._stopped!r}")
        if self._sequence in self._poisoned or self._size >= self.segment_bytes:
            try:
                self._open_next()
            except BaseException as error:
                self._failed(error)
                raise
        frames, self._pending = self._pending, []
        ends, self._pending_ends = self._pending_ends, []
        if frames:
            size = sum(map(len, frames))
            pad = padding(self._size + size)
            if pad:
                frames += pad
                size += len(pad[0]) + len(pad[1])
                _PAD_FRAMES.inc()
            try:
                _writev_all(self._fd, frames)
            except OSError as error:
                self._poisoned.add(self._sequence)
                self._lose({name for name, _ in ends} | self._names_in[self._sequence],
                           error)
                self._failed(error)
                raise
            self._names_in[self._sequence].update(name for name, _ in ends)
            self._size += size
            self._sizes[self._sequence] = self._size
            self._retained += size
            self._since_checkpoint += size
            BYTES.inc(size)
            for name, end in ends:
                self._ledger.wrote(name, end)
        self._fatal_written = self._fatal_queued  # (every queued frame is written now)
        return self._sequence

    def _lose(self, names: set[str], error: BaseException) -> None:
        """Under the lock: frames of `names` may not be durable although a later round
        may succeed (a failed write dropped them, or a failed fsync left the pages of
        their segment unknown). Their flushes fail from now on, and their owners reload
        (`on_failure`: the reload rewrites the log from what the file holds, and its
        BASE frame ends this)."""
        fresh = names - self._lost
        self._lost |= names
        for name in fresh:
            tap = self._taps.get(name)
            if tap is not None and tap.on_failure is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(tap.on_failure, error)

    def retained_bytes(self) -> int:
        return self._retained

    def full(self) -> AtomlogError | None:
        """The refusal for new writes while the segments kept reach
        partition.wal_max_bytes (checkpoints not keeping up, or failing), else None. An
        owner asks before it writes anything (frames of what is written are never
        refused: the partition file has the bytes already)."""
        if self._retained < self.max_bytes:
            return None
        return AtomlogError("RESOURCE_EXHAUSTED", f"the write-ahead file keeps "
                            f"{self._retained} bytes, its limit (partition.wal_max_bytes) "
                            f"is {self.max_bytes}: checkpoints are not keeping up",
                            {"retry_after_ms": "100"})

    def write_cut(self, name: str, offset: int) -> None:
        """A CUT frame, durable when this returns (any thread; blocking). Queued frames
        go first, so every frame written before the cut precedes it."""
        self._write_durably(CUT, name, offset)
        _CUT_FRAMES.inc()

    def write_base(self, name: str, offset: int) -> None:
        """A BASE frame (an owner's log loaded, replayed and fsynced, ending at
        `offset`), durable when this returns (a worker thread; blocking)."""
        self._write_durably(BASE, name, offset)
        _BASE_FRAMES.inc()

    def _write_durably(self, kind: int, name: str, offset: int) -> None:
        frame = encode_frame(kind, name, offset)
        with self._lock:
            self._take_sync_turn()  # no round's fsync runs beside this one
            try:
                self._pending.append(frame)
                self._pending_ends.append((name, -1))
                written = self._write_pending()  # the segment it went into
                covers = self._fatal_written
                fd = os.dup(self._fd)
                if kind == CUT:
                    self._ledger.cut(name, offset)
                    if self._checkpointed.get(name, 0) > offset:
                        self._checkpointed[name] = offset
                else:
                    self._ledger.base(name)
                    self._checkpointed[name] = offset
            except BaseException:
                self._end_sync_turn()
                raise
        try:
            self._fsync(fd)
        except OSError as error:
            with self._lock:
                # That segment, not the one active now: the loop may have rolled to a new
                # one meanwhile (and the failed one's partitions would not reload).
                self._poisoned.add(written)
                self._lose(set(self._names_in.get(written, ())), error)
                self._failed(error)
            raise
        else:
            with self._lock:
                self._synced_up_to(covers)
        finally:
            os.close(fd)
            with self._lock:
                self._end_sync_turn()
        if kind == BASE:
            with self._lock:
                self._lost.discard(name)

    def _take_sync_turn(self) -> None:
        """Under the lock, on a worker thread: wait (at most SYNC_TURN_WAIT_S) until no
        fsync of the file runs, then hold the turn (`_end_sync_turn` gives it back).
        Never on the event loop: the round it would wait for ends there."""
        if self._loop is not None and _on_loop(self._loop):
            raise RuntimeError("a durable write-ahead frame is written on a worker thread, "
                               "never on the event loop (it waits for the round's fsync)")
        deadline = time.monotonic() + SYNC_TURN_WAIT_S
        self._turn_wanted += 1  # no round begins before this turn
        try:
            while self._syncing:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OSError(errno.ETIMEDOUT, "the write-ahead file's fsync in flight "
                                  f"did not end within {SYNC_TURN_WAIT_S:.0f} s")
                self._idle.wait(left)
        finally:
            self._turn_wanted -= 1
        self._syncing = True

    def _end_sync_turn(self) -> None:
        """Under the lock: the fsync ended (its failure, if any, recorded first): the next
        may begin; rounds asked for meanwhile run on the loop."""
        self._syncing = False
        self._idle.notify_all()
        loop = self._loop
        if self._waiting and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._resume_rounds)

    def _resume_rounds(self) -> None:
        """On the loop: a round for the flushes that waited while another fsync ran."""
        if self._waiting and self._turn is None and not self.closed:
            self._turn = self._loop.call_soon(self._round)

    def sync(self, name: str, wake: Callable[[], object] | None) -> durability.SyncTicket:
        """A ticket answered once everything partition `name` queued so far is durable
        (the next round), or failed."""
        ticket = durability.SyncTicket(wake)
        self._waiting.append((ticket, name))
        if self._turn is None:
            self._turn = self._loop.call_soon(self._round)
        return ticket

    def _refuse_waiting(self) -> None:
        """Closed: the rounds asked for and not begun fail (nothing is written after
        close; a round run then used to write to a closed descriptor, or roll a new
        segment the close left behind)."""
        if self._turn is not None:
            self._turn.cancel()
            self._turn = None
        waiting, self._waiting = self._waiting, []
        if waiting:
            self._answer(waiting, OSError(errno.EBADF, "the write-ahead file is closed"))

    def _round(self) -> None:
        self._turn = None
        if self.closed:
            self._refuse_waiting()
            return
        if not self._waiting:
            return
        began = time.perf_counter()
        with self._lock:
            if self._syncing or self._turn_wanted:
                # Another fsync of the file runs, or a worker waits for its turn (a CUT or
                # BASE frame goes first): this round follows (`_synced` or
                # `_end_sync_turn` asks for it again).
                return
            tickets, self._waiting = self._waiting, []
            try:
                sequence = self._write_pending()
                round_ = _Round(tickets, sequence, began, self._fatal_written)
                self._syncing = True
                sync_ticket = self._sync.submit(self._fd,
                                                lambda: self._synced(round_, sync_ticket))
                self._rounds.append(round_)
            except BaseException as error:  # (a thread that could not start, too)
                self._syncing = False
                self._idle.notify_all()
                self._failed(error)  # (written, maybe, and never to be fsynced by it)
                failed = error
            else:
                failed = None
        if failed is not None:
            self._answer(tickets, failed if isinstance(failed, OSError) else OSError(
                errno.EIO, f"the write-ahead round could not begin: {failed!r}"))
            if not isinstance(failed, Exception):
                raise failed
            return
        ROUNDS.inc()
        if self._since_checkpoint >= self.checkpoint_bytes and self._checkpoint_now is not None:
            self._checkpoint_now.set()

    def _answer(self, tickets: list[tuple[durability.SyncTicket, str]],
                error: BaseException | None) -> None:
        lost = self._lost
        for ticket, name in tickets:
            ticket.finish(error if error is not None or name not in lost else
                          OSError(5, f"frames of {name} in the write-ahead file were lost "
                                  "(a failed write or fsync); it reloads"))
        for ticket, _ in tickets:
            if ticket.wake is not None:
                ticket.wake()

    def _synced(self, round_: _Round, sync_ticket: durability.SyncTicket) -> None:
        error = sync_ticket.exception()
        with self._lock:
            if error is not None:
                # After a failed fsync the file's pages are unknown: this segment takes no
                # more frames, no round on it counts, and the partitions with frames in it
                # reload (later rounds, on a new segment, would not cover those frames).
                self._poisoned.add(round_.sequence)
                # (.get: a segment trimmed while its round's fsync ran, its partitions
                # made durable by a roll or a close; a KeyError here stopped every round.)
                self._lose(set(self._names_in.get(round_.sequence, ())), error)
                self._failed(error)
            else:
                self._synced_up_to(round_.covers)
            self._syncing = False
            self._idle.notify_all()
        self._resume_rounds()  # what asked meanwhile
        round_.done, round_.error = True, error
        ROUND_SECONDS.observe(time.perf_counter() - round_.began)
        rounds = self._rounds
        while rounds and rounds[0].done:
            ended = rounds.popleft()
            error = ended.error
            if error is None and ended.sequence in self._poisoned:
                error = OSError(5, "an fsync of the write-ahead file failed")
            self._answer(ended.tickets, error)

    # ------------------------------------------------------------------ checkpoints
    def checkpointed(self, name: str, offset: int) -> None:
        """Partition `name`'s file is durable below `offset` (under the lock: a cut on a
        worker thread lowers it)."""
        with self._lock:
            self._raise_checkpoint(name, offset)

    def _raise_checkpoint(self, name: str, offset: int) -> None:
        if offset > self._checkpointed.get(name, -1):
            self._checkpointed[name] = offset

    def _checkpoint_of(self, name: str) -> int:
        """Under the lock."""
        if name in self._data_loss:
            return NEVER_WAITED_FOR  # (its frames are kept aside instead: `_retire`)
        tap = self._taps.get(name)
        if tap is not None and tap.log is not None:
            self._raise_checkpoint(name, tap.log.recoverable_offset)
        return self._checkpointed.get(name, -1)

    async def _checkpoints(self) -> None:
        """Every `checkpoint_ms`, or sooner once `checkpoint_bytes` were framed since the
        last one began. A checkpoint's fsyncs write back what the partitions' files took
        since the last one, and the write-ahead file's rounds share the disk with them: at
        45 MB/s of consume-transform-produce outputs, 500 ms of it is 20 MB at once, and
        on this machine's disk a round beside such a write-back waited up to 11-12 ms
        against 5 ms beside 4 MB (docs/benchmarks.md, "The twenty-third session")."""
        self._checkpoint_now = now = asyncio.Event()
        while True:
            try:
                await asyncio.wait_for(now.wait(), self.checkpoint_ms / 1000)
            except TimeoutError:
                pass
            now.clear()
            with self._lock:
                self._since_checkpoint = 0
            try:
                self.checkpoint()
                await self._trim()
            except Exception:  # noqa: BLE001 — the next interval tries again
                log.exception("write-ahead checkpoint failed")

    def checkpoint(self) -> int:
        """Begin an fsync of every attached partition file written past its checkpoint;
        each ends in `_checkpoint_ended`. Returns how many began."""
        began = 0
        for tap in list(self._taps.values()):
            partition_log = tap.log
            if partition_log is None or tap.name in self._in_checkpoint:
                continue
            started = partition_log.checkpoint_begin()
            if started is None:
                continue
            target, fd, generation = started
            holder: list[durability.SyncTicket] = []
            try:
                holder.append(self._sync.submit(fd, lambda t=tap, lg=partition_log,
                                                tg=target, g=generation, h=holder:
                                                self._checkpoint_ended(t, lg, tg, g, h[0])))
            except Exception as error:  # noqa: BLE001 — this file waits for the next interval
                partition_log.checkpoint_ended(None)  # (no fsync ran: nothing to hear of)
                # (os.dup at the descriptor limit, a worker thread not started.) Marked
                # in checkpoint only once submitted: before, a failed submit left it
                # marked for ever, so this partition was never checkpointed again and its
                # frames held the write-ahead file until it filled and refused every
                # partition's writes; and it skipped the files after it in this round.
                _CHECKPOINTS_FAILED.inc()
                event(log, "a checkpoint's fsync could not begin; the next interval tries "
                      "again", logging.ERROR, partition=tap.name,
                      error=f"{type(error).__name__}: {error}")
                continue
            self._in_checkpoint.add(tap.name)  # (its end runs later, on the loop)
            began += 1
        return began

    def _checkpoint_ended(self, tap: WalTap, partition_log: PartitionLog, target: int,
                          generation: int, ticket: durability.SyncTicket) -> None:
        self._in_checkpoint.discard(tap.name)
        error = ticket.exception()
        partition_log.checkpoint_ended(error)  # first: a failure breaks the log at once
        if error is not None:
            _CHECKPOINTS_FAILED.inc()
            event(log, "a checkpoint's fsync failed: the partition reloads from the "
                  "write-ahead file", logging.ERROR, partition=tap.name, error=str(error))
            if tap.log is partition_log and tap.on_failure is not None:
                tap.on_failure(error)
            return
        _CHECKPOINTS_OK.inc()
        try:
            if partition_log.checkpoint_end(target, generation):
                self.checkpointed(tap.name, partition_log.recoverable_offset)
        except Exception as failure:  # noqa: BLE001 — the recovery point's write failed
            if tap.log is partition_log and tap.on_failure is not None:
                tap.on_failure(failure)

    async def _trim(self) -> None:
        if self._undeleted is not None:
            sequences, keep = self._undeleted
            if not await self._retire(sequences, keep):
                return  # (nothing newer goes while they stay)
            self._undeleted = None
        with self._lock:
            if self._replays:  # an owner's reload is reading the segments
                return
            gone = self._ledger.removable(self._checkpoint_of)
            keep = self._kept_names(gone)
            for sequence in gone:
                self._retained -= self._sizes.pop(sequence, 0)
                self._names_in.pop(sequence, None)
                self._poisoned.discard(sequence)
        RETAINED_BYTES.set(self.retained_bytes())
        if gone and not await self._retire(gone, keep):
            self._undeleted = ([s for s in gone if segment_path(self.directory, s).exists()],
                               keep)

    def _listing_writer(self) -> Callable[[Path], None]:
        """Under the lock: the write of the listing as of now (`_write_listing`, on a
        worker thread, given the directory), numbered after every earlier one."""
        self._listing_generation += 1
        return functools.partial(self._write_listing, self._listing(),
                                 self._listing_generation)

    def _listing(self) -> dict[str, int]:
        """Under the lock: the listing of checkpoints (CHECKPOINTS_FILE) as of now: every
        partition whose log is attached to this file now, and its checkpoint, at least
        what the trims so far counted for it (checkpoints only grow, but for cuts and
        bases, which void the frames above them). Not a partition whose owner closed
        (its close fsynced it, or its frames are not counted checkpointed and stay) or
        whose log is in DATA_LOSS: the same name may be written on its own fsyncs
        meanwhile (a topic deleted and created again with copies, a partition moved
        back), and a stale entry would cut what those acknowledged."""
        listing = {}
        for name, tap in self._taps.items():
            if tap.log is None or name in self._data_loss:
                continue
            checkpoint = self._checkpoint_of(name)
            if checkpoint >= 0:
                listing[name] = checkpoint
        return listing

    async def _retire(self, sequences: list[int], keep: list[str]) -> bool:
        """Delete trimmed segments (`_retire_segments`), the listing of checkpoints made
        durable first; False when that failed."""
        with self._lock:
            write_listing = self._listing_writer()
        try:
            await asyncio.to_thread(_retire_segments, self.directory, sequences, keep,
                                    write_listing)
        except OSError as error:
            event(log, "write-ahead segments could not be deleted; the next trim tries "
                  "again before deleting any newer one", logging.ERROR,
                  segments=sequences, error=f"{type(error).__name__}: {error}")
            return False
        return True

    def _write_listing(self, listing: dict[str, int], generation: int,
                       directory: Path) -> None:
        """A worker thread, before a trim's segments are deleted: the listing of
        checkpoints durable (`write_listing`), unless a later one was written already
        (a cancelled checkpointer's trim may still run beside the close's). One writer
        at a time."""
        with self._listing_lock:
            if generation > self._listing_written:
                write_listing(directory, listing)
                self._listing_written = generation

    def _kept_names(self, gone: list[int]) -> list[str]:
        """Under the lock: the DATA_LOSS partitions with frames in segments `gone`."""
        return sorted({name for sequence in gone for name in self._names_in.get(sequence, ())
                       if name in self._data_loss})

    # ------------------------------------------------------------------ replay
    def replay_one(self, name: str, partition_log: PartitionLog) -> int:
        """An owner's load (a worker thread): rewrite its log from its frames (queued ones
        written first, so none of them lands after this reads the file)."""
        with self._lock:
            if self._fd >= 0:
                # (Its turn: writing the frames may roll the segment, which fsyncs it.)
                self._take_sync_turn()
                try:
                    self._write_pending()
                finally:
                    self._end_sync_turn()
            # The segments kept now, none of which goes while this reads them (`_trim`
            # waits): a segment missing in the middle would look like lost frames.
            sequences = [sequence for sequence, _ in self._ledger.segments]
            self._replays += 1
        try:  # (the replay reads the planned batches back from the segments)
            frames = read_frames(self.directory, sequences, name.encode())
            partition_plan = plan(frames).get(name)
            with BatchReader(self.directory) as reader:
                return replay_into(partition_log, partition_plan, reader)
        finally:
            with self._lock:
                self._replays -= 1

    async def close(self) -> None:
        """Stop the checkpointer; delete the segments nothing needs any more (after a
        clean close of every owner, all of them)."""
        if self.closed:
            return
        self.closed = True
        self._refuse_waiting()
        if self._checkpointer is not None:
            self._checkpointer.cancel()
            try:
                await self._checkpointer
            except asyncio.CancelledError:
                pass
        with self._lock:
            # (Not beside an fsync in flight: writing may roll the segment, whose seal is
            # an fsync of the same file; the frames left are of refused rounds.)
            if self._pending and not self._syncing:
                try:
                    self._write_pending()
                except OSError:
                    pass
            gone = self._ledger.removable(self._checkpoint_of, newest=True)
            keep = self._kept_names(gone)
            write_listing = self._listing_writer()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            prepared, self._next = self._next, None
        if prepared is not None:  # the next segment, never used
            await asyncio.to_thread(_discard_prepared, self.directory, prepared)
        if self._preparer is not None:
            self._preparer.shutdown(wait=False)
        try:
            await asyncio.to_thread(_retire_segments, self.directory, gone, keep,
                                    write_listing)
        except OSError as error:  # (they stay: the next start replays them)
            event(log, "write-ahead segments could not be deleted at close", logging.ERROR,
                  segments=gone, error=f"{type(error).__name__}: {error}")


def _discard_prepared(directory: Path, future: concurrent.futures.Future) -> None:
    try:
        os.close(future.result())
    except OSError:
        pass
    (directory / PREPARED_NAME).unlink(missing_ok=True)


def _retire_segments(directory: Path, sequences: list[int], keep: list[str],
                     write_listing: Callable[[Path], None]) -> None:
    """Delete segments that nothing waits for, the listing of checkpoints made durable
    first (`write_listing`): a partition whose last frames go is cut back to its
    checkpoint at a start (`cut_unframed_tails`). With `keep` (partitions in DATA_LOSS
    with frames in them), first link them into a kept-aside directory for those
    partitions, as a start keeps them (`recover_all`): an operator reads them there
    (`partition kept-frames`) until accepting the loss gives them up (`forget_kept`)."""
    if not sequences:
        return
    try:
        write_listing(directory)
    except OSError as error:
        # (A full disk.) A listing older than the segments' deletion could cut what a
        # checkpoint since made durable and acknowledged: it goes instead (an unlink
        # needs no room), and the start keeps the tails no frame covers, as it did
        # before the listing existed. The trims go on and free the disk.
        event(log, "the write-ahead file's listing of checkpoints could not be written; "
              "removed instead", logging.ERROR, error=f"{type(error).__name__}: {error}")
        (directory / CHECKPOINTS_FILE).unlink(missing_ok=True)
        fsync_directory(directory)
    if keep and sequences:
        stamp = int(time.time() * 1000)
        while (directory / f"kept-{stamp}").exists():
            stamp += 1
        kept = directory / f"kept-{stamp}"
        kept.mkdir()
        # The list first: segments kept without it would never be given up.
        write_atomically(kept / KEPT_MANIFEST, json.dumps(
            {"missing": [], "data_loss": keep}).encode())
        for sequence in sequences:
            path = segment_path(directory, sequence)
            os.link(path, kept / path.name)
        fsync_directory(kept)
        event(log, "write-ahead segments kept aside: partitions in DATA_LOSS",
              logging.ERROR, partitions=keep, directory=str(kept))
    _unlink_segments(directory, sequences)


def _unlink_segments(directory: Path, sequences: list[int]) -> None:
    for sequence in sequences:
        segment_path(directory, sequence).unlink(missing_ok=True)
    if sequences:
        fsync_directory(directory)




__all__ = ["WriteAheadLog", "WalTap", "encode_frame", "decode_frames", "plan", "Plan",
           "SegmentLedger", "replay_into"]
