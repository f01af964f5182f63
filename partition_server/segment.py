"""One segment of a partition log: `<base_offset:020d>.log` (concatenated batches) and its
sparse index `<base_offset:020d>.index`. Helpers only; `log.PartitionLog` owns the policy.

The index is derived data (rebuilt from the .log whenever missing or inconsistent). It is
written once, when the segment is sealed: a 16-byte header (magic "ALIX", version uint16 = 1,
reserved uint16 = 0, entry count uint32, CRC32C of the entries uint32), then entries. Each
16-byte big-endian entry is (relative_offset uint32, position uint32,
max_timestamp_before int64): the batch at `position` has base offset
`base_offset + relative_offset`, and every batch before it in this segment has a max
timestamp <= max_timestamp_before (INT64_MIN for the first entry). An entry is added for
the first batch and then for each batch starting >= index_interval_bytes after the last
entry, so the same batches always give the same index (rebuild == incremental).
"""

from __future__ import annotations

import os
import struct
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c

from partition_server.record_batch import (CRC_COVERED_FROM, HEADER_SIZE, INT64_MIN, MAGICS,
                                           MIN_BATCH_LENGTH, BatchHeader, parse_header, verify_crc)
from services.errors import AtomlogError

INDEX_HEADER = struct.Struct(">4sHHII")
INDEX_HEADER_SIZE = INDEX_HEADER.size  # 16
INDEX_MAGIC, INDEX_VERSION = b"ALIX", 1
INDEX_ENTRY = struct.Struct(">IIq")
INDEX_ENTRY_SIZE = INDEX_ENTRY.size  # 16
RELATIVE_OFFSET_MAX = 0xFFFFFFFF  # a segment spans at most 2^32 offsets (uint32 in the index)
POSITION_MAX = 0x7FFFFFFF  # positions are uint32; segment_bytes is capped at 2 GiB
LOG_SUFFIX, INDEX_SUFFIX = ".log", ".index"
# Reads of a full scan (recovery, index rebuild): big enough to amortize the syscall.
SCAN_CHUNK_BYTES = 1 << 20
# Reads of a short header walk (index entry -> wanted batch): a bit over the index interval.
WALK_CHUNK_BYTES = 16 << 10


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}"


def parse_segment_name(name: str) -> int | None:
    """The base offset of a `<20 digits>.log` file name, else None."""
    stem, dot, suffix = name.partition(".")
    if dot and "." + suffix == LOG_SUFFIX and len(stem) == 20 and stem.isdigit():
        return int(stem)
    return None


class SparseIndex:
    """offset -> position and timestamp -> position for one segment, in memory."""

    __slots__ = ("offsets", "positions", "max_timestamps_before", "running_max_timestamp_ms")

    def __init__(self) -> None:
        self.offsets = array("q")
        self.positions = array("q")
        self.max_timestamps_before = array("q")
        self.running_max_timestamp_ms = INT64_MIN

    def __len__(self) -> int:
        return len(self.positions)

    def observe(self, position: int, header: BatchHeader, interval_bytes: int) -> None:
        """Account for the batch `header` written at `position` (in order)."""
        if not self.positions or position - self.positions[-1] >= interval_bytes:
            self.offsets.append(header.base_offset)
            self.positions.append(position)
            self.max_timestamps_before.append(self.running_max_timestamp_ms)
        if header.max_timestamp_ms > self.running_max_timestamp_ms:
            self.running_max_timestamp_ms = header.max_timestamp_ms

    def extend(self, entries: list[tuple[int, int, int]]) -> None:
        """Take entries (offset, position, max timestamp before) computed elsewhere
        (record_batch.plan_log_append), in order, after the last."""
        for offset, position, before in entries:
            self.offsets.append(offset)
            self.positions.append(position)
            self.max_timestamps_before.append(before)

    def entries(self) -> list[tuple[int, int, int]]:
        return list(zip(self.offsets, self.positions, self.max_timestamps_before))

    def floor_by_offset(self, offset: int) -> tuple[int, int]:
        """(offset, position) of the last entry at or below `offset` (the first entry if none)."""
        i = max(bisect_right(self.offsets, offset) - 1, 0)
        return self.offsets[i], self.positions[i]

    def floor_by_position(self, position: int) -> tuple[int, int]:
        i = max(bisect_right(self.positions, position) - 1, 0)
        return self.offsets[i], self.positions[i]

    def floor_by_timestamp(self, timestamp_ms: int) -> tuple[int, int]:
        """The last entry whose earlier batches all have max timestamps < timestamp_ms: the
        first batch with max timestamp >= timestamp_ms is at or after it."""
        i = max(bisect_left(self.max_timestamps_before, timestamp_ms) - 1, 0)
        return self.offsets[i], self.positions[i]

    def to_bytes(self, base_offset: int) -> bytes:
        out = bytearray(INDEX_ENTRY_SIZE * len(self))
        for i, (offset, position, ts) in enumerate(self.entries()):
            INDEX_ENTRY.pack_into(out, i * INDEX_ENTRY_SIZE, offset - base_offset, position, ts)
        header = INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, 0, len(self), crc32c.crc32c(out))
        return header + bytes(out)

    @classmethod
    def from_bytes(cls, data: bytes, base_offset: int, size_bytes: int,
                   next_offset: int) -> SparseIndex | None:
        """Parse an index file; None if it is not a consistent index of a segment of
        `size_bytes` bytes holding offsets [base_offset, next_offset)."""
        if len(data) < INDEX_HEADER_SIZE + INDEX_ENTRY_SIZE:
            return None
        magic, version, _, count, crc = INDEX_HEADER.unpack_from(data)
        entries = memoryview(data)[INDEX_HEADER_SIZE:]
        if magic != INDEX_MAGIC or version != INDEX_VERSION or \
                len(entries) != count * INDEX_ENTRY_SIZE or crc32c.crc32c(entries) != crc:
            return None
        index = cls()
        last_offset = last_position = -1
        last_ts = INT64_MIN
        for relative, position, ts in INDEX_ENTRY.iter_unpack(entries):
            offset = base_offset + relative
            if offset <= last_offset or position <= last_position or ts < last_ts:
                return None
            index.offsets.append(offset)
            index.positions.append(position)
            index.max_timestamps_before.append(ts)
            last_offset, last_position, last_ts = offset, position, ts
        if index.positions[0] != 0 or index.offsets[0] != base_offset or \
                index.max_timestamps_before[0] != INT64_MIN or \
                last_position >= size_bytes or last_offset >= next_offset:
            return None
        return index


@dataclass(frozen=True)
class ScanFailure:
    """Where a scan stopped: the batch at `position` should have had base offset `offset`."""

    position: int
    offset: int
    detail: str


@dataclass(frozen=True)
class ScanResult:
    end_position: int
    next_offset: int
    max_timestamp_ms: int
    first_header: BatchHeader | None
    last_header: BatchHeader | None
    failure: ScanFailure | None


def scan(fd: int, position: int, end_position: int, expected_offset: int, *,
         verify_crc_values: bool = True,
         observe: Callable[[int, BatchHeader], None] | None = None) -> ScanResult:
    """Walk batches in `[position, end_position)` of a segment file, checking each header,
    that base offsets follow on (`expected_offset` first), that every batch is whole and
    (optionally) its CRC32C. Stops at the first bad batch and says why; `observe` sees
    every good batch in order. One pread per ~1 MiB; no per-record work."""
    buf, buf_start = b"", position
    first = last = None
    max_timestamp_ms = INT64_MIN

    def failed(detail: str) -> ScanResult:
        return ScanResult(position, expected_offset, max_timestamp_ms, first, last,
                          ScanFailure(position, expected_offset, detail))

    while position < end_position:
        relative = position - buf_start
        if relative + HEADER_SIZE > len(buf):
            buf = os.pread(fd, min(SCAN_CHUNK_BYTES, end_position - position), position)
            buf_start, relative = position, 0
        try:
            header = parse_header(buf, relative)
        except AtomlogError as error:
            return failed(error.message)
        if header.base_offset != expected_offset:
            return failed(f"batch base_offset {header.base_offset}, expected {expected_offset}")
        if position + header.size > end_position:
            return failed(f"truncated batch: header declares {header.size} bytes, "
                          f"{end_position - position} remain in the file")
        if verify_crc_values:
            if relative + header.size > len(buf):
                buf = os.pread(fd, max(header.size, min(SCAN_CHUNK_BYTES, end_position - position)),
                               position)
                buf_start, relative = position, 0
            try:
                verify_crc(buf, header, relative)
            except AtomlogError as error:
                return failed(error.message)
        if observe is not None:
            observe(position, header)
        first = first or header
        last = header
        if header.max_timestamp_ms > max_timestamp_ms:
            max_timestamp_ms = header.max_timestamp_ms
        expected_offset = header.next_offset
        position += header.size
    return ScanResult(position, expected_offset, max_timestamp_ms, first, last, None)


def walk_headers(fd: int, position: int, end_position: int, expected_offset: int
                 ) -> Iterator[tuple[int, BatchHeader]]:
    """Headers of the (already verified) batches in [position, end_position), no CRC work,
    checking that base offsets follow on from `expected_offset`. Raises CORRUPT_BATCH with
    "position" and "offset" metadata if not (the caller turns it into DATA_LOSS)."""
    buf, buf_start = b"", position
    while position < end_position:
        relative = position - buf_start
        if relative + HEADER_SIZE > len(buf):
            buf = os.pread(fd, min(WALK_CHUNK_BYTES, end_position - position), position)
            buf_start, relative = position, 0
        try:
            header = parse_header(buf, relative)
        except AtomlogError as error:
            raise AtomlogError("CORRUPT_BATCH", error.message,
                               {"position": position, "offset": expected_offset}) from error
        if header.base_offset != expected_offset or position + header.size > end_position:
            raise AtomlogError("CORRUPT_BATCH",
                               f"batch at position {position} has base_offset {header.base_offset} "
                               f"and {header.size} bytes; expected offset {expected_offset}, "
                               f"ending by position {end_position}",
                               {"position": position, "offset": expected_offset})
        yield position, header
        position += header.size
        expected_offset = header.next_offset


# The leading header fields a read check needs: base_offset, batch_length, magic,
# log_append_time_ms, crc, attributes, last_offset_delta.
_CHECK = struct.Struct(">qibqIhi")


def check_batches(data: bytes, start_position: int, expected_offset: int) -> ScanFailure | None:
    """Fast pair check of bytes about to be served: whole batches, offsets following on from
    `expected_offset`, CRC32C. Lighter than a full header parse (the headers were validated
    when appended; the CRC vouches for them still being what was validated)."""
    failure, checked, next_offset = check_prefix(data, start_position, expected_offset)
    if failure is not None or checked == len(data):
        return failure
    if len(data) - checked < HEADER_SIZE:
        return ScanFailure(start_position + checked, next_offset, "truncated batch header")
    _, length, magic, *_ = _CHECK.unpack_from(data, checked)
    return ScanFailure(start_position + checked, next_offset,
                       f"bad batch header (magic {magic}, batch_length {length})")


def check_prefix(data, start_position: int, expected_offset: int
                 ) -> tuple[ScanFailure | None, int, int]:
    """`check_batches` over the whole batches `data` begins with, for a reader taking a
    file in chunks (the scrubber): (failure or None, bytes checked, the offset the next
    batch must have). A batch cut off by the end of `data` ends the check without a
    failure; the caller reads on from there (or, at the end of what it meant to read,
    calls it truncated)."""
    view, position, end = memoryview(data), 0, len(data)
    unpack, crc = _CHECK.unpack_from, crc32c.crc32c
    while end - position >= HEADER_SIZE:
        base_offset, length, magic, _, stored_crc, _, last_offset_delta = unpack(data, position)
        size = length + 12
        if magic not in MAGICS or length < MIN_BATCH_LENGTH:
            return (ScanFailure(start_position + position, expected_offset,
                                f"bad batch header (magic {magic}, batch_length {length})"),
                    position, expected_offset)
        if position + size > end:
            break
        if base_offset != expected_offset:
            return (ScanFailure(start_position + position, expected_offset,
                                f"batch base_offset {base_offset}, expected {expected_offset}"),
                    position, expected_offset)
        computed = crc(view[position + CRC_COVERED_FROM:position + size])
        if computed != stored_crc:
            return (ScanFailure(start_position + position, expected_offset,
                                f"CRC32C mismatch: stored 0x{stored_crc:08x}, "
                                f"computed 0x{computed:08x}"),
                    position, expected_offset)
        expected_offset = base_offset + last_offset_delta + 1
        position += size
    return None, position, expected_offset


def batch_size_at(data, position: int) -> int | None:
    """The size of the batch whose header begins at `position` of `data` (None: the
    header is not all there)."""
    if len(data) - position < HEADER_SIZE:
        return None
    return _CHECK.unpack_from(data, position)[1] + 12


class Segment:
    """The in-memory facts about one segment file. The log keeps them consistent."""

    def __init__(self, directory: Path, base_offset: int) -> None:
        self.base_offset = base_offset
        self.log_path = directory / (segment_name(base_offset) + LOG_SUFFIX)
        self.index_path = directory / (segment_name(base_offset) + INDEX_SUFFIX)
        self.fd: int | None = None
        self.size = 0
        self.next_offset = base_offset
        self.max_timestamp_ms = INT64_MIN
        self.first_append_time_ms: int | None = None
        self.last_append_time_ms: int | None = None
        self.index: SparseIndex | None = None  # None: not loaded yet (sealed segments)
        # Last offset of a non-control batch: -1 none, None unknown (not scanned whole).
        self.last_data_offset: int | None = -1

    def __repr__(self) -> str:
        return (f"Segment({self.log_path.name}, offsets [{self.base_offset}, {self.next_offset}), "
                f"{self.size} bytes)")

    def open(self, *, writable: bool) -> int:
        if self.fd is None:
            flags = (os.O_RDWR | os.O_CREAT | os.O_APPEND) if writable else os.O_RDONLY
            self.fd = os.open(self.log_path, flags | getattr(os, "O_CLOEXEC", 0), 0o644)
        return self.fd

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def observe(self, position: int, header: BatchHeader, interval_bytes: int) -> None:
        """Account for a batch appended (or recovered) at `position`."""
        assert self.index is not None
        self.index.observe(position, header, interval_bytes)
        self.size = position + header.size
        self.next_offset = header.next_offset
        if header.max_timestamp_ms > self.max_timestamp_ms:
            self.max_timestamp_ms = header.max_timestamp_ms
        if self.first_append_time_ms is None:
            self.first_append_time_ms = header.log_append_time_ms
        self.last_append_time_ms = header.log_append_time_ms
        if not header.is_control:
            self.last_data_offset = header.last_offset

    def reset(self) -> None:
        """Forget everything learned from the file (before a full scan)."""
        self.size, self.next_offset = 0, self.base_offset
        self.max_timestamp_ms = INT64_MIN
        self.first_append_time_ms = self.last_append_time_ms = None
        self.last_data_offset = -1
        self.index = SparseIndex()

    def read_index_file(self) -> bytes | None:
        try:
            return self.index_path.read_bytes()
        except FileNotFoundError:
            return None

    def read_index_tail(self) -> tuple[int, int, int] | None:
        """(offset, position, max_timestamp_before) of the index file's last entry, after a
        cheap check of its header, size and first entry (the CRC is checked when the whole
        index is loaded); None if missing or implausible."""
        try:
            with open(self.index_path, "rb") as file:
                fd = file.fileno()
                length = os.fstat(fd).st_size
                head = os.pread(fd, INDEX_HEADER_SIZE + INDEX_ENTRY_SIZE, 0)
                magic, version, _, count, _ = INDEX_HEADER.unpack_from(head)
                first = INDEX_ENTRY.unpack_from(head, INDEX_HEADER_SIZE)
                last = INDEX_ENTRY.unpack(os.pread(fd, INDEX_ENTRY_SIZE, length - INDEX_ENTRY_SIZE))
        except (FileNotFoundError, struct.error, OSError):
            return None
        if magic != INDEX_MAGIC or version != INDEX_VERSION or not count or \
                length != INDEX_HEADER_SIZE + count * INDEX_ENTRY_SIZE or \
                first != (0, 0, INT64_MIN) or last[1] >= self.size:
            return None
        return self.base_offset + last[0], last[1], last[2]
