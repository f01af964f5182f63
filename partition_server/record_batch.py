"""The record batch: atomlog's one binary data format, shared by the server and the SDK.

Pure: no I/O, no clock except `encode_batch`'s default timestamp. The byte-exact layout is
documented in docs/record-format.md; the constants below are the single source of truth
and a test checks the doc's header table against them.

A batch is a fixed 77-byte big-endian header followed by its records (possibly compressed
as one block). The server touches headers only (`parse_header`, `validate_batch`,
`iter_batches`, `with_base_offset`); `decode_records` is for clients.

    offset size type    field
    0      8    int64   base_offset          set by the server; producers send 0
    8      4    int32   batch_length         bytes after this field (= batch size - 12)
    12     1    int8    magic                = 1
    13     8    int64   log_append_time_ms   set by the server; producers send -1
    21     4    uint32  crc                  CRC32C of bytes [25, end of batch)
    25     2    int16   attributes           bits 0-2 compression, 4 transactional, 5 control
    27     4    int32   last_offset_delta    = record_count - 1
    31     4    int32   record_count         >= 1
    35     8    int64   base_timestamp_ms    timestamp of the first record
    43     8    int64   max_timestamp_ms     largest record timestamp (>= base)
    51     8    int64   producer_id          0 = not idempotent; ids start at 1
    59     2    uint16  producer_epoch       0 when producer_id is 0
    61     4    int32   base_sequence        -1 = none (required when producer_id is 0)
    65     4    uint32  txn_tc_partition     } transaction id; both 0 = not transactional
    69     8    uint64  txn_sequence         } (TC sequences start at 1)
    77          records

The two server-written fields (base_offset, log_append_time_ms) sit before the CRC, so the
server stamps a batch without recomputing its checksum; everything a producer decides is
covered by the CRC.
"""

from __future__ import annotations

import enum
import functools
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import crc32c
import lz4.frame
import zstandard

from services.errors import AtomlogError

# --- Layout -------------------------------------------------------------------------------

MAGIC = 1  # the row format; servers write it (markers, TC log) and read only headers
MAGIC_COLUMNAR = 2  # records block = an Arrow IPC record batch (record_columns.py)
MAGICS = (MAGIC, MAGIC_COLUMNAR)
# (field, offset, size, type): the header table of docs/record-format.md (a test compares).
HEADER_FIELDS = (
    ("base_offset", 0, 8, "int64"),
    ("batch_length", 8, 4, "int32"),
    ("magic", 12, 1, "int8"),
    ("log_append_time_ms", 13, 8, "int64"),
    ("crc", 21, 4, "uint32"),
    ("attributes", 25, 2, "int16"),
    ("last_offset_delta", 27, 4, "int32"),
    ("record_count", 31, 4, "int32"),
    ("base_timestamp_ms", 35, 8, "int64"),
    ("max_timestamp_ms", 43, 8, "int64"),
    ("producer_id", 51, 8, "int64"),
    ("producer_epoch", 59, 2, "uint16"),
    ("base_sequence", 61, 4, "int32"),
    ("txn_tc_partition", 65, 4, "uint32"),
    ("txn_sequence", 69, 8, "uint64"),
)
HEADER = struct.Struct(">qibqIhiiqqqHiIQ")
HEADER_SIZE = HEADER.size  # 77
# The prefix the server rewrites: base_offset, batch_length, magic, log_append_time_ms.
PREFIX = struct.Struct(">qibq")
PREFIX_SIZE = PREFIX.size  # 21
LENGTH_FIELD_END = 12  # batch_length counts the bytes after offset 12
CRC_OFFSET = PREFIX_SIZE  # 21
CRC_COVERED_FROM = CRC_OFFSET + 4  # 25: the CRC covers [25, end of batch)
MIN_BATCH_LENGTH = HEADER_SIZE - LENGTH_FIELD_END  # 65: a header with an empty body

ATTR_COMPRESSION_MASK = 0x0007
ATTR_TRANSACTIONAL = 0x0010
ATTR_CONTROL = 0x0020
ATTR_KNOWN_BITS = ATTR_COMPRESSION_MASK | ATTR_TRANSACTIONAL | ATTR_CONTROL

NO_PRODUCER_ID = 0
NO_SEQUENCE = -1
NO_TIMESTAMP = -1  # what producers put in log_append_time_ms
PRODUCER_EPOCH_MAX = 0xFFFF  # stored as uint16; the coordinator rotates the id before this
INT32_MAX = 2**31 - 1
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# The default batch size limit (partition.max_batch_bytes): Kafka's max.message.bytes is 1 MiB.
DEFAULT_MAX_BATCH_BYTES = 1 << 20
# decode_records refuses to inflate a compressed block past this (decompression bombs).
DEFAULT_MAX_UNCOMPRESSED_BYTES = 64 << 20


class Compression(enum.IntEnum):
    NONE = 0
    ZSTD = 1
    LZ4 = 2


class ControlType(enum.IntEnum):
    """The marker type a control record's key carries (same numbers as Kafka's)."""

    ABORT = 0
    COMMIT = 1


class TxnId(NamedTuple):
    """Transaction id: owning TC partition and its per-TC sequence (both 0 = none)."""

    tc_partition: int
    sequence: int


def txn_key(txn: TxnId) -> int:
    """The id as one int (TC partition < 2**32, sequence < 2**64), for tables held long:
    a dict keyed by ints is never scanned by the garbage collector, one keyed by TxnIds
    (tuples it tracks) at every full collection, the event loop held meanwhile."""
    return txn.tc_partition << 64 | txn.sequence  # (txn_key_of's, without its call)


def txn_key_of(tc_partition: int, sequence: int) -> int:
    """txn_key of the id's two fields (as a stored row holds them)."""
    return tc_partition << 64 | sequence


class BatchHeader(NamedTuple):
    """A parsed batch header. Immutable value object (a NamedTuple rather than a dataclass:
    servers build one per batch on hot paths, and tuple construction is ~5x cheaper)."""

    base_offset: int
    batch_length: int
    magic: int
    log_append_time_ms: int
    crc: int
    attributes: int
    last_offset_delta: int
    record_count: int
    base_timestamp_ms: int
    max_timestamp_ms: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    txn_tc_partition: int
    txn_sequence: int

    @property
    def size(self) -> int:
        """Bytes of the whole batch, header included."""
        return self.batch_length + LENGTH_FIELD_END

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.last_offset_delta + 1

    @property
    def compression(self) -> Compression:
        return Compression(self.attributes & ATTR_COMPRESSION_MASK)

    @property
    def is_transactional(self) -> bool:
        return bool(self.attributes & ATTR_TRANSACTIONAL)

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & ATTR_CONTROL)

    @property
    def txn(self) -> TxnId | None:
        if self.txn_tc_partition == 0 and self.txn_sequence == 0:
            return None
        return TxnId(self.txn_tc_partition, self.txn_sequence)

    @property
    def last_sequence(self) -> int:
        """Sequence of the last record, or -1 without one (no wrap-around: producers rotate)."""
        if self.base_sequence == NO_SEQUENCE:
            return NO_SEQUENCE
        return self.base_sequence + self.last_offset_delta


class Record(NamedTuple):
    """One record. `offset` and `timestamp_ms` are filled in by decode_records; when
    encoding, a None timestamp means the batch's `timestamp_ms`, and `offset` is ignored.
    A NamedTuple, not a frozen dataclass: producers and readers make one per record, and
    a frozen dataclass took 1.5 us to construct against about 0.3 us for this."""

    key: bytes | None = None
    value: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp_ms: int | None = None
    offset: int | None = None


@dataclass(frozen=True)
class ControlMarker:
    """What a control batch says: the decision and the sender's coordinator epoch."""

    type: ControlType
    coordinator_epoch: int


# Control record key: int16 version (0), int16 type. Value: int16 version (0), uint64 epoch.
CONTROL_KEY = struct.Struct(">hh")
CONTROL_VALUE = struct.Struct(">hQ")
CONTROL_VERSION = 0


def _corrupt(message: str, position: int | None = None) -> AtomlogError:
    metadata = {} if position is None else {"position": position}
    return AtomlogError("CORRUPT_BATCH", message, metadata)


# --- Header parsing (server hot path) -----------------------------------------------------

_unpack_header = HEADER.unpack_from
_make_header = BatchHeader._make


def parse_header(buf: bytes | bytearray | memoryview, offset: int = 0, *,
                 max_batch_bytes: int | None = None) -> BatchHeader:
    """Parse and validate the header at `buf[offset:]`. Only the header must be present:
    whether the body fits is the caller's business (`iter_batches`, `validate_batch`).

    Raises AtomlogError CORRUPT_BATCH (truncated header, bad magic, length, attributes,
    counts, timestamps, producer or transaction fields) or BATCH_TOO_LARGE (the header
    declares more than `max_batch_bytes`)."""
    if len(buf) - offset < HEADER_SIZE:
        raise _corrupt(f"truncated batch header: {max(len(buf) - offset, 0)} bytes, "
                       f"a header is {HEADER_SIZE}", offset)
    header = _make_header(_unpack_header(buf, offset))
    if header.magic not in MAGICS:
        raise _corrupt(f"bad magic {header.magic} (expected one of {MAGICS})", offset)
    if header.batch_length < MIN_BATCH_LENGTH:
        raise _corrupt(f"batch_length {header.batch_length} is below the minimum "
                       f"{MIN_BATCH_LENGTH}", offset)
    if max_batch_bytes is not None and header.batch_length + LENGTH_FIELD_END > max_batch_bytes:
        raise AtomlogError("BATCH_TOO_LARGE",
                           f"batch of {header.batch_length + LENGTH_FIELD_END} bytes exceeds "
                           f"the limit of {max_batch_bytes} bytes",
                           {"limit": max_batch_bytes, "position": offset})
    problem = _header_problem(header)
    if problem is not None:
        raise _corrupt(problem, offset)
    return header


_MAX_CODEC = max(Compression)  # (iterating the enum on every header cost measurable CPU)


def _header_problem(h: BatchHeader) -> str | None:
    """Cross-field rules; None when the header is consistent."""
    if h.base_offset < 0:
        return f"negative base_offset {h.base_offset}"
    if h.attributes & ~ATTR_KNOWN_BITS & 0xFFFF:
        return f"unknown attribute bits set in 0x{h.attributes & 0xFFFF:04x}"
    if (h.attributes & ATTR_COMPRESSION_MASK) > _MAX_CODEC:
        return f"unknown compression codec {h.attributes & ATTR_COMPRESSION_MASK}"
    if h.record_count < 1:
        return f"record_count {h.record_count} (a batch holds at least one record)"
    if h.last_offset_delta != h.record_count - 1:
        return (f"last_offset_delta {h.last_offset_delta} does not match record_count "
                f"{h.record_count}")
    if h.max_timestamp_ms < h.base_timestamp_ms:
        return (f"max_timestamp_ms {h.max_timestamp_ms} is below base_timestamp_ms "
                f"{h.base_timestamp_ms}")
    if h.producer_id < 0:
        return f"negative producer_id {h.producer_id}"
    if h.base_sequence < NO_SEQUENCE:
        return f"base_sequence {h.base_sequence} (must be -1 or >= 0)"
    if h.producer_id == NO_PRODUCER_ID and (h.producer_epoch != 0 or h.base_sequence != NO_SEQUENCE):
        return "producer_epoch and base_sequence must be 0 and -1 without a producer_id"
    if h.producer_id != NO_PRODUCER_ID and h.base_sequence + h.last_offset_delta > INT32_MAX:
        return f"base_sequence {h.base_sequence} + record count overflows int32"
    has_txn = h.txn_tc_partition != 0 or h.txn_sequence != 0
    if bool(h.attributes & ATTR_TRANSACTIONAL) != has_txn:
        return "the transactional bit must be set exactly when a transaction id is present"
    if h.attributes & ATTR_CONTROL:
        if not has_txn:
            return "a control batch must carry a transaction id"
        if h.record_count != 1 or h.attributes & ATTR_COMPRESSION_MASK or h.magic != MAGIC:
            return "a control batch holds exactly one uncompressed record in the row format"
    return None


def verify_crc(batch: bytes | bytearray | memoryview, header: BatchHeader | None = None,
               position: int = 0) -> None:
    """Check the CRC32C of the batch at `batch[position:]` (whose body must be present).
    Raises CRC_MISMATCH naming the stored and computed values."""
    if header is None:
        header = parse_header(batch, position)
    end = position + header.size
    if len(batch) < end:
        raise _corrupt(f"truncated batch: header declares {header.size} bytes, "
                       f"{len(batch) - position} present", position)
    computed = crc32c.crc32c(memoryview(batch)[position + CRC_COVERED_FROM:end])
    if computed != header.crc:
        raise AtomlogError("CRC_MISMATCH",
                           f"CRC32C mismatch: stored 0x{header.crc:08x}, computed 0x{computed:08x}",
                           {"position": position, "stored_crc": f"0x{header.crc:08x}",
                            "computed_crc": f"0x{computed:08x}"})


def validate_batch(batch: bytes | bytearray | memoryview, *,
                   max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> BatchHeader:
    """Everything the server checks on one produced batch (one ProduceItem.record_batch):
    size limit, header, exact length, CRC. Returns the header; raises BATCH_TOO_LARGE,
    CORRUPT_BATCH or CRC_MISMATCH. Records are not read."""
    if len(batch) > max_batch_bytes:
        raise AtomlogError("BATCH_TOO_LARGE",
                           f"batch of {len(batch)} bytes exceeds the limit of "
                           f"{max_batch_bytes} bytes", {"limit": max_batch_bytes})
    header = parse_header(batch, 0)
    if header.size != len(batch):
        raise _corrupt(f"batch_length says {header.size} bytes, but the batch has {len(batch)}"
                       + (" (truncated)" if header.size > len(batch) else " (trailing bytes)"))
    verify_crc(batch, header)
    return header


_ATTRIBUTES = struct.Struct(">h")
_TXN_FIELDS = struct.Struct(">IQ")
_CRC = struct.Struct(">I")


def check_stageable(header: BatchHeader) -> None:
    """A batch a one-call transaction may carry (CommitTxn, StageTxn): not transactional,
    not control, no producer id. INVALID_ARGUMENT otherwise."""
    if header.attributes & (ATTR_TRANSACTIONAL | ATTR_CONTROL):
        raise AtomlogError("INVALID_ARGUMENT", "a one-call transaction's batch must not be "
                           "transactional or a control batch: the coordinator assigns it its "
                           "transaction")
    if header.producer_id != NO_PRODUCER_ID:
        raise AtomlogError("INVALID_ARGUMENT", "a one-call transaction's batch has no producer "
                           "id (0) and no sequence (-1): it is deduplicated by its transaction")


def stamp_transaction(batch: bytes, header: BatchHeader, txn: TxnId) -> tuple[bytes, BatchHeader]:
    """The validated, stageable `batch` made part of `txn`: transactional bit and
    transaction id set, CRC32C recomputed (the CRC was checked before: the new one covers
    the same bytes). Returns the new bytes and header."""
    check_stageable(header)
    out = bytearray(batch)
    attributes = header.attributes | ATTR_TRANSACTIONAL
    _ATTRIBUTES.pack_into(out, 25, attributes)
    _TXN_FIELDS.pack_into(out, 65, txn.tc_partition, txn.sequence)
    crc = crc32c.crc32c(memoryview(out)[CRC_COVERED_FROM:])
    _CRC.pack_into(out, CRC_OFFSET, crc)
    # The header as parse_header would read the new bytes (only these fields changed),
    # held to the same cross-field rules.
    stamped = header._replace(attributes=attributes, crc=crc, txn_tc_partition=txn.tc_partition,
                              txn_sequence=txn.sequence)
    problem = _header_problem(stamped)
    if problem is not None:
        raise _corrupt(problem, 0)  # as parse_header of the new bytes would refuse them
    return bytes(out), stamped


def iter_batches(buf: bytes | bytearray | memoryview, *, verify: bool = False,
                 max_batch_bytes: int | None = None) -> Iterator[tuple[int, BatchHeader]]:
    """Walk concatenated batches (a Fetch response, a segment slice), yielding
    (position, header). Every batch must be whole; with `verify` its CRC is checked too.
    Raises CORRUPT_BATCH / CRC_MISMATCH / BATCH_TOO_LARGE with the batch's position."""
    position, end = 0, len(buf)
    while position < end:
        header = parse_header(buf, position, max_batch_bytes=max_batch_bytes)
        if position + header.size > end:
            raise _corrupt(f"truncated batch at position {position}: header declares "
                           f"{header.size} bytes, {end - position} remain", position)
        if verify:
            verify_crc(buf, header, position)
        yield position, header
        position += header.size


def with_base_offset(batch: bytes | bytearray | memoryview, base_offset: int,
                     log_append_time_ms: int | None = None) -> bytes:
    """A copy of the batch with base_offset (and, if given, log_append_time_ms) rewritten.
    Both fields precede the CRC, so the CRC stays valid. The log itself avoids this copy
    (it writes a new 21-byte prefix and the rest of the original buffer with writev)."""
    view = memoryview(batch)
    old = PREFIX.unpack_from(view, 0)
    append_time = old[3] if log_append_time_ms is None else log_append_time_ms
    return PREFIX.pack(base_offset, old[1], old[2], append_time) + bytes(view[PREFIX_SIZE:])


def stamp_for_log(group: list[tuple[bytes | memoryview, BatchHeader]], next_offset: int,
                  now: int) -> tuple[list, list[BatchHeader], int]:
    """A log's write of whole batches (each with its header) from `next_offset` on, at
    append time `now`: the buffers to write, whose concatenation is the batches with
    their offsets and append time stamped (fields before the CRC, so it stays right);
    each batch's header as stamped; and the offset after them. Here the buffers are a
    new 21-byte prefix and a view of the rest of each batch, no copy (the native core
    gives one buffer of all of them)."""
    buffers: list = []
    stamped: list[BatchHeader] = []
    pack = PREFIX.pack
    for batch, header in group:
        buffers.append(pack(next_offset, header.batch_length, header.magic, now))
        buffers.append(memoryview(batch)[PREFIX_SIZE:])
        stamped.append(header._replace(base_offset=next_offset, log_append_time_ms=now))
        next_offset += header.last_offset_delta + 1
    return buffers, stamped, next_offset


SEGMENT_OFFSETS_MAX = 0xFFFFFFFF  # segment.RELATIVE_OFFSET_MAX: offsets one segment spans


def check_batch_sizes(group: Iterable[tuple[bytes | memoryview, BatchHeader]],
                      max_batch_bytes: int) -> None:
    """Each batch's header says its batch's size (else CORRUPT_BATCH), within
    `max_batch_bytes` (else BATCH_TOO_LARGE), in order: what a log checks before it
    appends anything of a group."""
    for batch, header in group:
        batch_size = header.batch_length + LENGTH_FIELD_END
        if batch_size != len(batch):
            raise AtomlogError("CORRUPT_BATCH", f"batch_length says {batch_size} bytes, "
                               f"the batch has {len(batch)}")
        if batch_size > max_batch_bytes:
            raise AtomlogError("BATCH_TOO_LARGE", f"batch of {batch_size} bytes exceeds "
                               f"the limit of {max_batch_bytes} bytes",
                               {"limit": max_batch_bytes})


def plan_log_append(group: Sequence[tuple[bytes | memoryview, BatchHeader]], next_offset: int,
                    now: int, max_batch_bytes: int, size: int, first_time: int | None,
                    segment_base: int, segment_bytes: int, segment_ms: int,
                    interval_bytes: int, last_indexed: int | None, running_max_ts: int):
    """A log's append of whole batches (each with its header) in one go: checked, stamped
    and accounted for, for PartitionLog to write and apply. The active segment holds
    `size` bytes from offset `segment_base` on, its first batch appended at `first_time`
    (None: empty); its sparse index's last entry is at byte `last_indexed` (None: none),
    with `running_max_ts` the largest timestamp before its end.

    Raises CORRUPT_BATCH (a header's size is not its batch's) or BATCH_TOO_LARGE, checking
    every batch in order before anything else. None when a batch would roll the segment
    (by size, by age, or by the offsets one segment spans): the caller then splits it where
    the segment rolls and plans each part. Else (buffers, stamped, next_offset as
    stamp_for_log gives them; then starts, (base offset, byte position) of each batch;
    index entries, (offset, position, max timestamp before) of each batch the index
    takes, one every `interval_bytes`; the segment's size after; running_max_ts after;
    the largest max timestamp of the batches; the last offset of the last non-control
    batch, None if none)."""
    check_batch_sizes(group, max_batch_bytes)
    offset, end = next_offset, size
    for _, header in group:  # PartitionLog._rolls for each batch, none copied
        batch_size = header.batch_length + LENGTH_FIELD_END
        if end and (offset - segment_base > SEGMENT_OFFSETS_MAX
                    or end + batch_size > segment_bytes
                    or (first_time is not None and now - first_time >= segment_ms)):
            return None
        end += batch_size
        offset += header.last_offset_delta + 1
        first_time = now if first_time is None else first_time
    buffers, stamped, after = stamp_for_log(group, next_offset, now)
    position = size
    starts, entries = [], []
    max_ts, last_data = INT64_MIN, None
    for header in stamped:  # Segment.observe and SparseIndex.observe for each batch
        starts.append((header.base_offset, position))
        if last_indexed is None or position - last_indexed >= interval_bytes:
            entries.append((header.base_offset, position, running_max_ts))
            last_indexed = position
        if header.max_timestamp_ms > running_max_ts:
            running_max_ts = header.max_timestamp_ms
        if header.max_timestamp_ms > max_ts:
            max_ts = header.max_timestamp_ms
        if not header.attributes & ATTR_CONTROL:
            last_data = header.base_offset + header.last_offset_delta
        position += header.batch_length + LENGTH_FIELD_END
    return (buffers, stamped, after, starts, entries, position, running_max_ts, max_ts,
            last_data)


# --- Varints ------------------------------------------------------------------------------

def _put_uvarint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


_ONE_BYTE = tuple(bytes((n,)) for n in range(0x80))


def _uvarint(n: int) -> bytes:
    """n (>= 0) as a varint; the one- and two-byte forms (every length of a record under
    16 KiB) without a loop."""
    if n < 0x80:
        return _ONE_BYTE[n]
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    _put_uvarint(out, n)
    return bytes(out)


def uvarint(n: int) -> bytes:
    """n as a varint, refusing a negative n (ValueError). The same base-128 encoding is
    protobuf's varint: the wire splices (replicate_wire, read_wire) and the SDK's
    hand-built Produce requests use it for tags and lengths."""
    if n < 0:
        raise ValueError(f"a varint here holds n >= 0, not {n}")
    return _uvarint(n)


def _zvarint(n: int) -> bytes:
    return _uvarint((n << 1) ^ (n >> 63))


def _get_uvarint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise _corrupt("truncated varint in records")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >> 64:
                raise _corrupt("varint overflows 64 bits")
            return result, pos
        shift += 7
        if shift >= 70:
            raise _corrupt("varint longer than 10 bytes")


def _get_zvarint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    u, pos = _get_uvarint(buf, pos, end)
    return (u >> 1) ^ -(u & 1), pos


# --- Encoding (SDK side) ------------------------------------------------------------------

_NULL = _zvarint(-1)
_NO_HEADERS = _uvarint(0)


def _encode_record(pieces: list, record: Record, timestamp_delta: int, offset_delta: int) -> None:
    """Append the pieces of one record (length first) to `pieces`; the batch joins them
    once, so a value is copied once, not once per layer."""
    key, value, headers = record.key, record.value, record.headers
    # attributes (reserved: 0), timestamp delta, offset delta, key length
    head = b"\x00" + _zvarint(timestamp_delta) + _uvarint(offset_delta) + (
        _NULL if key is None else _zvarint(len(key)))
    value_length = _NULL if value is None else _zvarint(len(value))
    if headers:
        tail = bytearray(_uvarint(len(headers)))
        for name, header_value in headers:
            encoded = name.encode("utf-8")
            tail += _uvarint(len(encoded))
            tail += encoded
            tail += _uvarint(len(header_value))
            tail += header_value
    else:
        tail = _NO_HEADERS
    size = len(head) + len(value_length) + len(tail) + (0 if key is None else len(key)) + (
        0 if value is None else len(value))
    pieces.append(_uvarint(size))
    pieces.append(head)
    if key is not None:
        pieces.append(key)
    pieces.append(value_length)
    if value is not None:
        pieces.append(value)
    pieces.append(tail)


def row_block(records: Sequence[Record], deltas: Sequence[int]) -> bytes | None:
    """The uncompressed row-format records block of `records` (their timestamp deltas
    `deltas`, their offset deltas their places), as _encode_record writes it: for
    records without headers whose keys and values are bytes or None; else None (the
    caller encodes them one by one). The native core has it too (the __txn_log's
    batches, three records a transaction)."""
    for record, delta in zip(records, deltas, strict=True):
        if record[2] or not (type(record[0]) is bytes or record[0] is None) or not (
                type(record[1]) is bytes or record[1] is None) or \
                not -(1 << 63) <= delta < 1 << 63:
            return None
    return _rows(records, deltas)


def _rows(records: Sequence[Record], deltas: Sequence[int]) -> bytes:
    """Every record's row (_encode_record), their offset deltas their places."""
    pieces: list = []
    for index, (record, delta) in enumerate(zip(records, deltas, strict=True)):
        _encode_record(pieces, record, delta, index)
    return b"".join(pieces)


def _compress(block: bytes, compression: Compression) -> bytes:
    if compression is Compression.ZSTD:
        return zstandard.ZstdCompressor().compress(block)
    if compression is Compression.LZ4:
        return lz4.frame.compress(block)
    return block


def encode_batch(records: Iterable[Record], *, producer_id: int = NO_PRODUCER_ID,
                 producer_epoch: int = 0, base_sequence: int = NO_SEQUENCE,
                 txn: TxnId | tuple[int, int] | None = None,
                 compression: Compression = Compression.NONE,
                 transactional: bool | None = None, timestamp_ms: int | None = None,
                 control: bool = False) -> bytes:
    """Build one row-format batch (base_offset 0, log_append_time -1: the server sets
    both). `transactional` defaults to whether `txn` is given; records without a
    timestamp get `timestamp_ms` (default: now). Raises ValueError for caller mistakes."""
    records = list(records)
    if not records:
        raise ValueError("a batch needs at least one record")
    compression = Compression(compression)
    default_ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    timestamps = [default_ts if r.timestamp_ms is None else r.timestamp_ms for r in records]
    base_ts = timestamps[0]
    deltas = [ts - base_ts for ts in timestamps]
    block = row_block(records, deltas)
    if block is None:  # (headers, or keys or values of other types)
        block = _rows(records, deltas)
    return frame_batch(_compress(block, compression), magic=MAGIC,
                       count=len(records), base_timestamp_ms=base_ts,
                       max_timestamp_ms=max(timestamps), compression=compression,
                       producer_id=producer_id, producer_epoch=producer_epoch,
                       base_sequence=base_sequence, txn=txn, transactional=transactional,
                       control=control)


def frame_batch(body: bytes, **fields) -> bytes:
    """A batch of `count` records around a records block already built in the format
    `magic` names (rows: encode_batch; columns: record_columns): the header, its CRC32C,
    base_offset 0 and log_append_time -1 (the server sets both). Raises ValueError for
    caller mistakes. The keyword fields are frame_batch_parsed's."""
    return frame_batch_parsed(body, **fields)[0]


def frame_batch_parsed(body: bytes, *, magic: int, count: int, base_timestamp_ms: int,
                       max_timestamp_ms: int, compression: Compression = Compression.NONE,
                       producer_id: int = NO_PRODUCER_ID, producer_epoch: int = 0,
                       base_sequence: int = NO_SEQUENCE,
                       txn: TxnId | tuple[int, int] | None = None,
                       transactional: bool | None = None,
                       control: bool = False) -> tuple[bytes, BatchHeader]:
    """frame_batch, with the batch's header as parse_header reads it (a server that
    writes the batch needs both: no second parse)."""
    if transactional is None:
        transactional = txn is not None
    if transactional != (txn is not None) or (txn is not None and tuple(txn) == (0, 0)):
        raise ValueError("transactional batches need a non-zero txn id, and only they may carry one")
    tc_partition, txn_sequence = tuple(txn) if txn is not None else (0, 0)
    if producer_id == NO_PRODUCER_ID and (producer_epoch != 0 or base_sequence != NO_SEQUENCE):
        raise ValueError("producer_epoch/base_sequence need a producer_id")
    if not 0 <= producer_epoch <= PRODUCER_EPOCH_MAX:
        raise ValueError(f"producer_epoch {producer_epoch} outside 0..{PRODUCER_EPOCH_MAX}")
    attributes = int(Compression(compression)) | (ATTR_TRANSACTIONAL if transactional else 0) | (
        ATTR_CONTROL if control else 0)
    header = bytearray(HEADER.pack(0, MIN_BATCH_LENGTH + len(body), magic, NO_TIMESTAMP, 0,
                                   attributes, count - 1, count, base_timestamp_ms,
                                   max_timestamp_ms, producer_id, producer_epoch, base_sequence,
                                   tc_partition, txn_sequence))
    crc = crc32c.crc32c(body, crc32c.crc32c(memoryview(header)[CRC_COVERED_FROM:]))
    struct.pack_into(">I", header, CRC_OFFSET, crc)
    batch = bytes(header) + body
    return batch, parse_header(batch)  # a pair assertion too: what we build, we accept


def encode_control_batch(marker: ControlType, **fields) -> bytes:
    """A transaction marker: control + transactional bits, one record whose key is
    (version 0, type) and whose value is (version 0, coordinator_epoch). The keyword
    fields are control_batch_parsed's."""
    return control_batch_parsed(marker, **fields)[0]


def control_batch_parsed(marker: ControlType, *, txn: TxnId | tuple[int, int],
                         coordinator_epoch: int, timestamp_ms: int,
                         producer_id: int = NO_PRODUCER_ID,
                         producer_epoch: int = 0) -> tuple[bytes, BatchHeader]:
    """encode_control_batch, with the marker's header (frame_batch_parsed)."""
    return frame_batch_parsed(_control_body(int(marker), coordinator_epoch), magic=MAGIC,
                              count=1, base_timestamp_ms=timestamp_ms,
                              max_timestamp_ms=timestamp_ms, producer_id=producer_id,
                              producer_epoch=producer_epoch, txn=txn, control=True)


@functools.lru_cache(maxsize=256)
def _control_body(marker: int, coordinator_epoch: int) -> bytes:
    """The records block of a marker: one record, deltas 0 (the same for every marker of
    a decision and epoch, so built once: a server writes one per transaction and
    partition)."""
    record = Record(key=CONTROL_KEY.pack(CONTROL_VERSION, int(ControlType(marker))),
                    value=CONTROL_VALUE.pack(CONTROL_VERSION, coordinator_epoch))
    pieces: list = []
    _encode_record(pieces, record, 0, 0)
    return b"".join(pieces)


# --- Decoding (client side; per-record work belongs here, never on the server) ------------

def _decompress(block: memoryview, compression: Compression, limit: int) -> bytes:
    try:
        if compression is Compression.ZSTD:
            size = zstandard.frame_content_size(block)
            if size > limit:
                raise _corrupt(f"compressed block inflates to {size} bytes, limit {limit}")
            return zstandard.ZstdDecompressor().decompress(block, max_output_size=limit)
        decompressor = lz4.frame.LZ4FrameDecompressor()
        data = decompressor.decompress(bytes(block), max_length=limit + 1)
        if len(data) > limit:
            raise _corrupt(f"compressed block inflates past the limit of {limit} bytes")
        if not decompressor.eof or decompressor.unused_data:
            raise _corrupt("lz4 block is truncated or has trailing bytes")
        return data
    except (zstandard.ZstdError, RuntimeError) as error:
        raise _corrupt(f"cannot decompress {compression.name} block: {error}") from error


def decode_records(batch: bytes | bytearray | memoryview, *, verify: bool = True,
                   max_uncompressed_bytes: int = DEFAULT_MAX_UNCOMPRESSED_BYTES) -> list[Record]:
    """Decode every record of one batch (client side), in either format. Checks the CRC
    unless told not to, then that the records are exactly `record_count` well-formed
    records."""
    header = parse_header(batch)
    if len(batch) < header.size:
        raise _corrupt(f"truncated batch: header declares {header.size} bytes, {len(batch)} present")
    if header.magic == MAGIC_COLUMNAR:
        from partition_server import record_columns  # pyarrow: clients only

        return record_columns.records_of(record_columns.decode_columns(
            batch, header, verify=verify, max_uncompressed_bytes=max_uncompressed_bytes),
            header)
    if verify:
        verify_crc(batch, header)
    block = memoryview(batch)[HEADER_SIZE:header.size]
    data = bytes(block) if header.compression is Compression.NONE else _decompress(
        block, header.compression, max_uncompressed_bytes)
    try:
        records, pos = _decode_block(data, header)
    except IndexError:  # a varint read ran off the end of the block
        raise _corrupt("records end inside a field (truncated block)") from None
    if pos != len(data):
        raise _corrupt(f"{len(data) - pos} bytes after the last of {header.record_count} records")
    return records


def _decode_block(data: bytes, header: BatchHeader) -> tuple[list[Record], int]:
    """The records of an uncompressed block and where they end. One-byte varints (all but
    the lengths of records and values over 63 bytes) are read inline: this loop is the
    readers' CPU cost per record. A varint that runs past its record is caught by the
    record's end check; one past the block raises IndexError (the caller's CORRUPT_BATCH)."""
    records: list[Record] = []
    append = records.append
    base_timestamp, base_offset = header.base_timestamp_ms, header.base_offset
    pos, end = 0, len(data)
    for index in range(header.record_count):
        byte = data[pos]
        if byte < 0x80:
            length, pos = byte, pos + 1
        else:
            length, pos = _get_uvarint(data, pos, end)
        record_end = pos + length
        if record_end > end:
            raise _corrupt(f"record {index} declares {length} bytes, {end - pos} remain")
        if length == 0 or data[pos] != 0:
            raise _corrupt(f"record {index}: missing or non-zero record attributes")
        byte = data[pos + 1]
        if byte < 0x80:
            timestamp_delta, pos = (byte >> 1) ^ -(byte & 1), pos + 2
        else:
            timestamp_delta, pos = _get_zvarint(data, pos + 1, record_end)
        byte = data[pos]
        if byte < 0x80:
            offset_delta, pos = byte, pos + 1
        else:
            offset_delta, pos = _get_uvarint(data, pos, record_end)
        if offset_delta != index:
            raise _corrupt(f"record {index} has offset delta {offset_delta}")
        key, pos = _get_nullable_bytes(data, pos, record_end, index)
        value, pos = _get_nullable_bytes(data, pos, record_end, index)
        if pos < record_end and data[pos] == 0:
            headers, pos = (), pos + 1
        else:
            headers, pos = _decode_headers(data, pos, record_end, index)
        if pos != record_end:
            raise _corrupt(f"record {index}: {record_end - pos} unread bytes"
                           if pos < record_end else f"record {index}: fields run past its end")
        append(Record(key, value, headers, base_timestamp + timestamp_delta,
                      base_offset + offset_delta))
    return records, pos


def _get_nullable_bytes(data: bytes, pos: int, end: int, index: int) -> tuple[bytes | None, int]:
    """A key or value: zigzag length (-1: null), then that many bytes."""
    byte = data[pos]
    if byte < 0x80:
        length, pos = (byte >> 1) ^ -(byte & 1), pos + 1
    else:
        length, pos = _get_zvarint(data, pos, end)
    if length == -1:
        return None, pos
    if 0 <= length <= end - pos:
        return data[pos:pos + length], pos + length
    raise _corrupt(f"record {index}: bad key/value length {length}")


def _decode_headers(data: bytes, pos: int, end: int, index: int) -> tuple[tuple, int]:
    count, pos = _get_uvarint(data, pos, end)
    headers = []
    for _ in range(count):
        name_length, pos = _get_uvarint(data, pos, end)
        if pos + name_length > end:
            raise _corrupt(f"record {index}: truncated header key")
        try:
            name = data[pos:pos + name_length].decode("utf-8")
        except UnicodeDecodeError as error:
            raise _corrupt(f"record {index}: header key is not UTF-8") from error
        pos += name_length
        value_length, pos = _get_uvarint(data, pos, end)
        if pos + value_length > end:
            raise _corrupt(f"record {index}: truncated header value")
        headers.append((name, data[pos:pos + value_length]))
        pos += value_length
    return tuple(headers), pos


def decode_control_batch(batch: bytes | bytearray | memoryview, *, verify: bool = True) -> ControlMarker:
    """The marker of a control batch. Raises CORRUPT_BATCH if it is not a well-formed one."""
    header = parse_header(batch)
    if not header.is_control:
        raise _corrupt("not a control batch")
    (record,) = decode_records(batch, verify=verify)
    if record.key is None or len(record.key) != CONTROL_KEY.size or record.value is None or \
            len(record.value) != CONTROL_VALUE.size:
        raise _corrupt("control record key/value have the wrong size")
    key_version, marker = CONTROL_KEY.unpack(record.key)
    value_version, epoch = CONTROL_VALUE.unpack_from(record.value)
    if key_version != CONTROL_VERSION or value_version != CONTROL_VERSION:
        raise _corrupt(f"unknown control record version {key_version}/{value_version}")
    try:
        return ControlMarker(ControlType(marker), epoch)
    except ValueError as error:
        raise _corrupt(f"unknown control type {marker}") from error


# --- The native core ----------------------------------------------------------------------
# partition_server/rust has these functions in Rust (partition_server/native.py loads
# them). The Python ones above stay the reference, under these names, and keep serving
# when the native core is off or not built; tests/test_native.py holds the pairs together.
python_functions = {"parse_header": parse_header, "verify_crc": verify_crc,
                    "validate_batch": validate_batch, "stamp_transaction": stamp_transaction,
                    "frame_batch_parsed": frame_batch_parsed, "stamp_for_log": stamp_for_log,
                    "plan_log_append": plan_log_append, "row_block": row_block}


def _use_native() -> None:
    from partition_server import native
    if native.core is None:
        return
    native.core.init(BatchHeader, AtomlogError)
    globals().update({name: getattr(native.core, name) for name in python_functions})


_use_native()
