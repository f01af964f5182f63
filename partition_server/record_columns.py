"""The columnar records block (batch magic 2): one Arrow IPC record batch message of a
fixed schema, after the same 77-byte header as every batch (docs/record-format.md §1.6).

Pure, client side: servers never import this module (they parse headers only, and the
batches they write themselves — transaction markers, the TC log — keep the row format of
magic 1). Producers encode columns here without a loop over records; readers get a
`pyarrow.RecordBatch` whose buffers are slices of the fetched bytes (no copy when the
block is not compressed).

The block holds only the record batch message, not the schema: the schema is fixed by the
format (`BLOCK_SCHEMA`). To read a block with any Arrow library, put `schema_message()`
before it and read the two as an IPC stream.
"""

from __future__ import annotations

import itertools
import struct
import time
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

import crc32c

from partition_server.record_batch import (CRC_OFFSET, DEFAULT_MAX_UNCOMPRESSED_BYTES,
                                           HEADER_SIZE, MAGIC_COLUMNAR, MIN_BATCH_LENGTH,
                                           PREFIX, BatchHeader, Compression, Record, _corrupt,
                                           frame_batch, parse_header, verify_crc)

# --- The schema (fixed by the format; a change is a new magic) ----------------------------
HEADER_STRUCT = pa.struct([pa.field("key", pa.string(), nullable=False),
                           pa.field("value", pa.binary(), nullable=False)])
HEADERS_TYPE = pa.list_(pa.field("header", HEADER_STRUCT, nullable=False))
BLOCK_SCHEMA = pa.schema([
    pa.field("key", pa.binary()),                            # null: no key
    pa.field("value", pa.binary()),                          # null: a null value (tombstone)
    pa.field("timestamp_delta", pa.int64(), nullable=False),  # ms after base_timestamp_ms
    pa.field("headers", HEADERS_TYPE, nullable=False),       # empty list: no headers
])
_CODEC = {Compression.NONE: None, Compression.ZSTD: "zstd", Compression.LZ4: "lz4"}
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_PREFIX = struct.Struct("<Ii")  # IPC continuation marker, metadata length (little-endian)
_CONTINUATION = 0xFFFFFFFF
# The header's batch_length (after the int64 base_offset) and CRC32C fields (big-endian).
_LENGTH, _LENGTH_OFFSET = struct.Struct(">i"), 8
_CRC = struct.Struct(">I")
assert PREFIX.format in (">qibq", b">qibq") and CRC_OFFSET == PREFIX.size


def schema_message() -> bytes:
    """The Arrow IPC stream's schema message of BLOCK_SCHEMA: put it before a block to read
    the block as an IPC stream with any Arrow library (docs/record-format.md)."""
    return _stream_bytes(None, Compression.NONE)[:-len(_EOS)]


def _stream_bytes(batch: pa.RecordBatch | None, compression: Compression) -> bytes:
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=_CODEC[compression])
    with pa.ipc.new_stream(sink, BLOCK_SCHEMA, options=options) as writer:
        if batch is not None:
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


_SCHEMA_LENGTHS: dict[Compression, int] = {}


def _message(batch: pa.RecordBatch, compression: Compression) -> bytes | pa.Buffer:
    """The encapsulated IPC message of `batch` alone (buffers compressed with the codec).
    Uncompressed, the Arrow buffer itself: frame_batch() copies it once, into the batch."""
    if compression is Compression.NONE:
        return batch.serialize()
    skip = _SCHEMA_LENGTHS.get(compression)
    if skip is None:
        skip = _SCHEMA_LENGTHS[compression] = len(_stream_bytes(None, compression)) - len(_EOS)
    return _stream_bytes(batch, compression)[skip:-len(_EOS)]


# --- Building columns ------------------------------------------------------------------------
def binary_column(values, n: int | None = None, name: str = "value") -> pa.Array:
    """`values` as an Arrow binary array: Python bytes/str/None sequences, NumPy arrays of
    bytes or str, Arrow binary/string arrays (large or not, chunked or not). Strings are
    encoded as UTF-8. Raises ValueError (naming `name`) for anything else."""
    if values is None:
        if n is None:
            raise ValueError(f"{name}: give values or a length")
        return pa.nulls(n, pa.binary())
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    if isinstance(values, pa.Array):
        kind = values.type
        if pa.types.is_binary(kind):
            return values
        if pa.types.is_string(kind) or pa.types.is_large_string(kind) or \
                pa.types.is_large_binary(kind) or pa.types.is_null(kind) or \
                pa.types.is_fixed_size_binary(kind) or pa.types.is_binary_view(kind) or \
                pa.types.is_string_view(kind):
            return values.cast(pa.binary())
        raise ValueError(f"{name}: an Arrow array of {kind} is not binary or string")
    if not hasattr(values, "__len__"):
        values = list(values)  # a generator: _is_str_sequence would consume it
    try:
        array = pa.array(values, pa.binary()) if not _is_str_sequence(values) else \
            pa.array(values, pa.string()).cast(pa.binary())
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as error:
        raise ValueError(f"{name}: not bytes, str or None values ({error})") from None
    return array


def _is_str_sequence(values) -> bool:
    dtype = getattr(values, "dtype", None)
    if dtype is not None:
        return getattr(dtype, "kind", "") == "U"
    for value in values:
        if value is not None:
            return isinstance(value, str)
    return False


def headers_column(headers, n: int) -> pa.Array:
    """Per-record headers as HEADERS_TYPE: None (no headers anywhere), or one entry per
    record, each None, a dict {str: bytes|str} or a sequence of (str, bytes|str) pairs;
    or an Arrow list/map array of (key, value) structs."""
    if headers is None:
        return _no_headers(n)
    if isinstance(headers, pa.ChunkedArray):
        headers = headers.combine_chunks()
    if isinstance(headers, pa.Array):
        return _arrow_headers(headers)
    rows = []
    for entry in headers:
        if not entry:
            rows.append([])
            continue
        items = entry.items() if isinstance(entry, dict) else entry
        rows.append([{"key": k, "value": v.encode() if isinstance(v, str) else v}
                     for k, v in items])
    try:
        return pa.array(rows, HEADERS_TYPE)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as error:
        raise ValueError(f"headers: each must be (str, bytes) pairs ({error})") from None


_CACHED_ROWS = 1 << 16
_EMPTY: dict[str, pa.Array] = {}


def _no_headers(n: int) -> pa.Array:
    """n empty header lists (a slice of a cached array: building one costs ~15 us)."""
    if n > _CACHED_ROWS:
        return pa.ListArray.from_arrays(pa.array([0] * (n + 1), pa.int32()),
                                        pa.array([], HEADER_STRUCT), type=HEADERS_TYPE)
    cached = _EMPTY.get("headers")
    if cached is None:
        cached = _EMPTY["headers"] = pa.ListArray.from_arrays(
            pa.array([0] * (_CACHED_ROWS + 1), pa.int32()), pa.array([], HEADER_STRUCT),
            type=HEADERS_TYPE)
    return cached.slice(0, n)


def _zero_deltas(n: int) -> pa.Array:
    if n > _CACHED_ROWS:
        return pa.repeat(pa.scalar(0, pa.int64()), n)
    cached = _EMPTY.get("deltas")
    if cached is None:
        cached = _EMPTY["deltas"] = pa.repeat(pa.scalar(0, pa.int64()), _CACHED_ROWS)
    return cached.slice(0, n)


def _arrow_headers(headers: pa.Array) -> pa.Array:
    kind = headers.type
    if pa.types.is_map(kind) and headers.offset:  # a slice of a map: take the slow road
        return headers_column([row and list(row) for row in headers.to_pylist()],
                              len(headers))
    if pa.types.is_map(kind):
        headers = pa.ListArray.from_arrays(headers.offsets, pa.StructArray.from_arrays(
            [headers.keys, headers.items], ["key", "value"]), mask=headers.is_null())
        kind = headers.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or \
            not pa.types.is_struct(kind.value_type) or \
            [f.name for f in kind.value_type] != ["key", "value"]:
        raise ValueError(f"headers: an Arrow array of {kind} is not a list of "
                         "struct<key: string, value: binary> (or a map)")
    values = headers.flatten()
    keys, items = values.field("key"), values.field("value")
    if keys.null_count or items.null_count:
        raise ValueError("headers: header keys and values must not be null")
    if headers.null_count:  # a null list means no headers (rare: take the slow road)
        return headers_column([row and [(h["key"], h["value"]) for h in row]
                               for row in headers.to_pylist()], len(headers))
    offsets = headers.offsets
    if headers.offset:  # a slice: offsets relative to its values
        offsets = pc.subtract(offsets, offsets[0])
    structs = pa.StructArray.from_arrays(
        [keys.cast(pa.string()), items.cast(pa.binary())], fields=list(HEADER_STRUCT))
    return pa.ListArray.from_arrays(offsets.cast(pa.int32()), structs, type=HEADERS_TYPE)


def timestamp_column(timestamps, n: int, default_ms: int) -> tuple[pa.Array, int, int]:
    """(timestamp_delta column, base, max) for per-record timestamps in Unix ms (None: all
    `default_ms`; else a sequence, NumPy or Arrow integer array, or an Arrow timestamp
    array)."""
    if timestamps is None:
        return _zero_deltas(n), default_ms, default_ms
    if isinstance(timestamps, pa.ChunkedArray):
        timestamps = timestamps.combine_chunks()
    if isinstance(timestamps, pa.Array) and pa.types.is_timestamp(timestamps.type):
        timestamps = timestamps.cast(pa.timestamp("ms")).cast(pa.int64())
    array = integer_column(timestamps, pa.int64(), n, "timestamps")
    if array.null_count:
        array = pc.fill_null(array, default_ms)
    base = array[0].as_py()
    largest = pc.max(array).as_py()
    if pc.min(array).as_py() < 0:
        raise ValueError("timestamps: negative Unix ms")
    return pc.subtract(array, base), base, largest


def integer_column(values, type_: pa.DataType, n: int, name: str) -> pa.Array:
    """`values` (a sequence, NumPy or Arrow array, chunked or not) as an Arrow array of
    the integer type_, n long; ValueError naming `name` otherwise."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    try:
        array = (values if isinstance(values, pa.Array) else pa.array(values)).cast(type_)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as error:
        raise ValueError(f"{name}: not integers ({error})") from None
    if len(array) != n:
        raise ValueError(f"{name}: {len(array)} values for {n} records")
    return array


# --- Encoding --------------------------------------------------------------------------------
def columns_block(keys: pa.Array, values: pa.Array, headers: pa.Array,
                  timestamp_deltas: pa.Array,
                  compression: Compression = Compression.NONE) -> bytes | pa.Buffer:
    """The records block of a magic-2 batch (bytes-like): the columns (built by binary_column,
    headers_column and timestamp_column) as one Arrow IPC record batch message. The
    costly part of encoding; record_batch.frame_batch() then adds the header (a producer
    can build the block before it knows the batch's sequence numbers)."""
    count = len(values)
    if count < 1:
        raise ValueError("a batch needs at least one record")
    if not len(keys) == len(headers) == len(timestamp_deltas) == count:
        raise ValueError("columns of different lengths")
    batch = pa.RecordBatch.from_arrays([keys, values, timestamp_deltas, headers],
                                       schema=BLOCK_SCHEMA)
    return _message(batch, Compression(compression))


def frame_header(block, *, count: int, base_timestamp_ms: int, max_timestamp_ms: int,
                 compression: Compression = Compression.NONE, **fields) -> bytes:
    """The 77-byte header of the magic-2 batch around `block` (bytes-like), so that
    `frame_header(block, ...) + block == frame_batch(block, magic=MAGIC_COLUMNAR, ...)`
    without copying the block into a new bytes object: a producer sends the two pieces
    in one request (fields: producer id, epoch, base sequence, txn). frame_batch() checks
    the fields and builds the header of an empty body; the body length and the CRC32C
    are then completed with the block (the CRC covers the header from byte 25 on, then
    the block: continuing the empty body's CRC over the block gives the whole one)."""
    header = bytearray(frame_batch(b"", magic=MAGIC_COLUMNAR, count=count,
                                   base_timestamp_ms=base_timestamp_ms,
                                   max_timestamp_ms=max_timestamp_ms, compression=compression,
                                   **fields))
    _LENGTH.pack_into(header, _LENGTH_OFFSET, MIN_BATCH_LENGTH + len(block))
    _CRC.pack_into(header, CRC_OFFSET, crc32c.crc32c(block, _CRC.unpack_from(header, CRC_OFFSET)[0]))
    parse_header(header)  # pair assertion, as frame_batch
    return bytes(header)


def encode_columns(keys: pa.Array, values: pa.Array, headers: pa.Array,
                   timestamp_deltas: pa.Array, base_timestamp_ms: int, max_timestamp_ms: int,
                   *, compression: Compression = Compression.NONE, **fields) -> bytes:
    """One magic-2 batch of the columns: columns_block() framed by frame_batch()
    (fields: producer id, epoch, base sequence, txn)."""
    return frame_batch(columns_block(keys, values, headers, timestamp_deltas, compression),
                       magic=MAGIC_COLUMNAR, count=len(values),
                       base_timestamp_ms=base_timestamp_ms, max_timestamp_ms=max_timestamp_ms,
                       compression=compression, **fields)


def record_arrays(records: Sequence[Record], stamps: Sequence[int],
                  base_timestamp_ms: int) -> list[pa.Array]:
    """Record tuples (with their timestamps in Unix ms) as the BLOCK_SCHEMA columns, in
    order: key, value, timestamp_delta, headers."""
    n = len(records)
    headers = (pa.array([[{"key": k, "value": v} for k, v in r.headers] for r in records],
                        HEADERS_TYPE)
               if any(r.headers for r in records) else _no_headers(n))
    deltas = (_zero_deltas(n) if all(s == base_timestamp_ms for s in stamps)
              else pa.array([s - base_timestamp_ms for s in stamps], pa.int64()))
    return [pa.array([r.key for r in records], pa.binary()),
            pa.array([r.value for r in records], pa.binary()), deltas, headers]


def encode_records(records: Sequence[Record], *, timestamp_ms: int | None = None,
                   **fields) -> bytes:
    """encode_columns for Record tuples (what producer.send() collects): records without
    a timestamp get `timestamp_ms` (default: now). A small uncompressed batch without
    headers, of bytes-like keys and values, is written by plain_block() without pyarrow."""
    if not records:
        raise ValueError("a batch needs at least one record")
    stamps = [r.timestamp_ms for r in records]
    if None in stamps:
        default_ms = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        stamps = [default_ms if stamp is None else stamp for stamp in stamps]
    if len(records) <= PLAIN_MAX_RECORDS and \
            fields.get("compression", Compression.NONE) is Compression.NONE:
        block = plain_block(records, stamps)
        if block is not None:
            return frame_batch(block, magic=MAGIC_COLUMNAR, count=len(records),
                               base_timestamp_ms=stamps[0], max_timestamp_ms=max(stamps),
                               **fields)
    keys, values, deltas, headers = record_arrays(records, stamps, stamps[0])
    return encode_columns(keys, values, headers, deltas, stamps[0], max(stamps), **fields)


# --- The block of a small batch, written without pyarrow ---------------------------------------
# pyarrow spends 30-50 us of fixed cost on each batch it builds and serializes (arrays
# from Python lists, a RecordBatch, its IPC message), which is most of a small batch's
# encoding: a one-call transaction of 10 records over 4 partitions encodes four batches of
# two or three. plain_block() writes the same message (the same schema, nodes and buffers;
# any Arrow reader decodes it, and decode_columns validates it as any block) with struct
# alone. Its IPC metadata is a flatbuffer of fixed layout, laid out front to back:
#
#   0    root offset -> the Message table at 16
#   4    Message vtable: 4 fields (version, header_type, header, bodyLength)
#   16   Message table: version V5, header_type RecordBatch, bodyLength, header -> 56
#   40   RecordBatch vtable: 3 fields (length, nodes, buffers)
#   56   RecordBatch table: length, nodes -> 84, buffers -> 204
#   84   7 FieldNodes (length, null_count), in the schema's depth-first order
#   204  17 Buffers (offset, length) into the body, each 8-byte aligned and padded
#   480  end (a multiple of 8, as the IPC format asks)
PLAIN_MAX_RECORDS = 128  # measured: faster than pyarrow up to about 250 records of 100 bytes
_META_SIZE = 480
# The whole metadata in one struct (pad bytes are written as zeros): root offset; Message
# vtable (its size, the table's size, the 4 fields' offsets); Message table (soffset back
# to its vtable, version, header_type, pad, bodyLength, header offset, pad); RecordBatch
# vtable and pad; RecordBatch table (soffset, pad, length, nodes and buffers offsets, pad);
# the nodes vector (count, 7 x 2 int64), pad; the buffers vector (count, 17 x 2 int64).
_META = struct.Struct("<I6H" "ihBxqI4x" "5H6x" "i4xqII4x" "I14q4x" "I34q")
assert _META.size == _META_SIZE
_META_HEAD = (16, 12, 24, 4, 6, 16, 8,  # root -> 16; Message vtable at 4
              16 - 4, 4, 3)  # Message table at 16: vtable at 4, version V5, RecordBatch
_META_MIDDLE = (56 - 32, 10, 24, 8, 16, 20,  # header at 32 -> 56; RecordBatch vtable at 40
                56 - 40)  # RecordBatch table at 56: vtable at 40
_META_OFFSETS = (84 - 72, 204 - 76, 7)  # nodes at 72 -> 84, buffers at 76 -> 204; 7 nodes
_PAD = bytes(8)
_EMPTY_OFFSETS = bytes(4)  # a 0-length binary/string array: its one offset


def _binary_buffers(items: tuple, n: int) -> tuple[int, bytes, bytes, bytes] | None:
    """(null count, validity, offsets, data) of a binary column of bytes-like/None items,
    or None when an item is something else (pyarrow's conversions then apply: str is
    encoded as UTF-8) or the data outgrows int32 offsets."""
    try:
        nulls = items.count(None)
        if nulls == n:
            return n, bytes((n + 7) // 8), bytes(4 * (n + 1)), b""
        if nulls:
            present = [item for item in items if item is not None]
            data = b"".join(present)
            lengths = [0 if item is None else len(item) for item in items]
        else:
            data = b"".join(items)
            lengths = list(map(len, items))
    except TypeError:  # str, or not bytes-like at all
        return None
    if len(data) != sum(lengths) or len(data) > 0x7FFFFFFF:  # a view of wider items
        return None
    offsets = struct.pack(f"<{n + 1}i", 0, *itertools.accumulate(lengths))
    if not nulls:
        return 0, b"", offsets, data
    bitmap = bytearray((n + 7) // 8)
    for i, item in enumerate(items):
        if item is not None:
            bitmap[i >> 3] |= 1 << (i & 7)
    return nulls, bytes(bitmap), offsets, data


def plain_block(records: Sequence[Record], stamps: Sequence[int]) -> bytes | None:
    """The uncompressed records block of `records` (timestamps `stamps`, the first the
    base) written directly, or None when pyarrow must write it: a record has headers, or
    a key or value is neither bytes-like nor None."""
    n = len(records)
    key_items, value_items, header_items = list(zip(*records))[:3]  # Record's first fields
    if any(header_items):
        return None
    keys = _binary_buffers(key_items, n)
    values = _binary_buffers(value_items, n) if keys is not None else None
    if values is None:
        return None
    base = stamps[0]
    deltas = bytes(8 * n) if stamps.count(base) == n else \
        struct.pack(f"<{n}q", *[s - base for s in stamps])
    list_offsets = bytes(4 * (n + 1))
    # Buffers in order: key (validity, offsets, data), value (the same), timestamp_delta
    # (validity, data), headers (validity, offsets), the header struct (validity), its
    # key string and value binary (validity, offsets, data each; 0 long).
    buffers = (keys[1], keys[2], keys[3], values[1], values[2], values[3], b"", deltas,
               b"", list_offsets, b"", b"", _EMPTY_OFFSETS, b"", b"", _EMPTY_OFFSETS, b"")
    spans = []
    body = []
    at = 0
    for buffer in buffers:
        size = len(buffer)
        spans += (at, size)
        if size:
            body.append(buffer)
            pad = -size % 8
            if pad:
                body.append(_PAD[:pad])
            at += size + pad
    metadata = _META.pack(*_META_HEAD, at, *_META_MIDDLE, n, *_META_OFFSETS,
                          n, keys[0], n, values[0], n, 0, n, 0, 0, 0, 0, 0, 0, 0,
                          17, *spans)
    return b"".join((_PREFIX.pack(_CONTINUATION, _META_SIZE), metadata, *body))


# --- Decoding --------------------------------------------------------------------------------
def decode_columns(batch: bytes | bytearray | memoryview, header: BatchHeader | None = None, *,
                   verify: bool = True,
                   max_uncompressed_bytes: int = DEFAULT_MAX_UNCOMPRESSED_BYTES
                   ) -> pa.RecordBatch:
    """The block of one magic-2 batch as a RecordBatch of BLOCK_SCHEMA, its buffers slices
    of `batch` when uncompressed. Checks the CRC (unless told not to), that the block is
    exactly one well-formed record batch message of the schema, with `record_count` rows.
    Raises CORRUPT_BATCH / CRC_MISMATCH."""
    if header is None:
        header = parse_header(batch)
    if header.magic != MAGIC_COLUMNAR:
        raise _corrupt(f"magic {header.magic} is not the columnar format")
    if len(batch) < header.size:
        raise _corrupt(f"truncated batch: header declares {header.size} bytes, {len(batch)} present")
    if verify:
        verify_crc(batch, header)
    block = pa.py_buffer(batch).slice(HEADER_SIZE, header.size - HEADER_SIZE)
    if block.size < _PREFIX.size:
        raise _corrupt("the columnar block is shorter than an IPC message prefix")
    continuation, metadata_length = _PREFIX.unpack_from(block, 0)
    if continuation != _CONTINUATION or metadata_length <= 0 or \
            metadata_length % 8 or _PREFIX.size + metadata_length > block.size:
        raise _corrupt("the columnar block does not start with an Arrow IPC message")
    try:
        message = pa.ipc.read_message(block)
        if message.type != "record batch":
            raise _corrupt(f"the columnar block is an Arrow {message.type} message, "
                           "not a record batch")
        if _PREFIX.size + metadata_length + message.body.size != block.size:
            raise _corrupt(f"{block.size - _PREFIX.size - metadata_length - message.body.size}"
                           " bytes after the Arrow message of the columnar block")
        columns = pa.ipc.read_record_batch(message, BLOCK_SCHEMA)
        if header.compression is not Compression.NONE and \
                columns.nbytes > max_uncompressed_bytes:
            raise _corrupt(f"the columnar block holds {columns.nbytes} bytes, limit "
                           f"{max_uncompressed_bytes}")
        columns.validate(full=True)
    except (pa.ArrowException, OSError, MemoryError, ValueError) as error:
        if hasattr(error, "reason"):
            raise
        raise _corrupt(f"the columnar block is not a record batch of the format's schema: "
                       f"{error}") from None
    if columns.num_rows != header.record_count:
        raise _corrupt(f"the columnar block holds {columns.num_rows} rows, the header "
                       f"says {header.record_count}")
    return columns


def python_columns(keys: pa.Array, values: pa.Array, timestamp_deltas: pa.Array,
                   headers: pa.Array, base_timestamp_ms: int) -> tuple[list, list, list, list]:
    """Block columns as Python lists (keys, values, header tuples, absolute timestamps):
    one C-level conversion per column, for callers that want a Python object per record."""
    n = len(values)
    key_list = [None] * n if keys.null_count == n else keys.to_pylist()
    if n > 256:
        bounds = pc.min_max(timestamp_deltas)
        constant = bounds["min"].as_py() == bounds["max"].as_py() == 0
    else:
        constant = False
    stamps = [base_timestamp_ms] * n if constant else [
        base_timestamp_ms + d for d in timestamp_deltas.to_pylist()]
    header_rows = ([tuple((h["key"], h["value"]) for h in row) for row in headers.to_pylist()]
                   if len(headers.values) else [()] * n)
    return key_list, values.to_pylist(), header_rows, stamps


def records_of(columns: pa.RecordBatch, header: BatchHeader) -> list[Record]:
    """Record tuples of a decoded block (offsets and absolute timestamps filled in)."""
    keys, values, headers, stamps = python_columns(
        columns.column(0), columns.column(1), columns.column(2), columns.column(3),
        header.base_timestamp_ms)
    first = header.base_offset
    return list(map(Record, keys, values, headers, stamps, range(first, first + len(values))))


# --- The native core ----------------------------------------------------------------------
# plain_block above is the reference; the native core (partition_server/rust) has it too,
# byte for byte (tests/test_native.py), and takes its place when loaded.
python_plain_block = plain_block


def _use_native() -> None:
    global plain_block
    from partition_server import native
    if native.core is not None:
        plain_block = native.core.plain_block


_use_native()
