"""Columns for `producer.send_batch()`: user input (Python sequences, NumPy arrays, Arrow
arrays, record batches or tables) turned into per-partition chunks of Arrow columns that
fit a batch, with Arrow kernels: the one loop over records in Python is the partitioner's
CRC32C of keyed records (one C call per key, see crc32c_column).

Pure: no I/O. The partitioner is the one `send()` uses —
CRC32C (Castagnoli) of the key modulo the partition count; keyless records go to one
partition per call (the producer's sticky partition).
"""

from __future__ import annotations

from dataclasses import dataclass

import bisect
import itertools

import crc32c
import pyarrow as pa
import pyarrow.compute as pc

from partition_server.record_batch import Record
from partition_server.record_columns import (binary_column, headers_column, integer_column,
                                             python_columns, timestamp_column)

# Bytes a record costs in a batch beyond its key and value (the columns' offsets and
# timestamp, the batch's share of metadata): what the producer counts against
# batch_max_bytes, like send()'s 32 per record.
ROW_OVERHEAD = 32
HEADER_OVERHEAD = 4
BATCH_OVERHEAD = 1024  # header and Arrow message metadata


def crc32c_column(keys: pa.Array) -> pa.Array:
    """CRC32C of every non-null value of a binary array (null stays null). One C call per
    key: measured on 1,000,000 12-byte keys, 0.18 s, the same as a table-driven NumPy pass
    per byte position (0.17 s) and 4.5x faster than the same with Arrow kernels (0.82 s)."""
    crc = crc32c.crc32c
    return pa.array([None if key is None else crc(key) for key in keys.to_pylist()],
                    pa.uint32())


@dataclass
class Chunk:
    """Records for one partition, as the columns of one batch."""

    partition: int
    keys: pa.Array
    values: pa.Array
    headers: pa.Array
    timestamp_deltas: pa.Array
    base_timestamp_ms: int
    max_timestamp_ms: int
    size: int  # what it counts against batch_max_bytes and the producer's buffer
    # The records block (record_columns.columns_block), once built: by send_batch()'s
    # caller, so the producer's sender thread only frames it.
    block: bytes | None = None

    def __len__(self) -> int:
        return len(self.values)

    def slice(self, start: int) -> Chunk:
        """The records from `start` on (size prorated; timestamps keep their base)."""
        n = len(self)
        return Chunk(self.partition, self.keys.slice(start), self.values.slice(start),
                     self.headers.slice(start), self.timestamp_deltas.slice(start),
                     self.base_timestamp_ms, self.max_timestamp_ms,
                     BATCH_OVERHEAD + (self.size - BATCH_OVERHEAD) * (n - start) // n)


def records_of_chunk(chunk: Chunk) -> list[Record]:
    """The chunk's records as Record tuples (for a one-call transaction that keeps them)."""
    return list(map(Record, *python_columns(chunk.keys, chunk.values, chunk.timestamp_deltas,
                                            chunk.headers, chunk.base_timestamp_ms)))


def _column(table, name: str):
    if table is None or name not in table.schema.names:
        return None
    return table.column(name)


def prepare(values, *, keys=None, headers=None, timestamps_ms=None, partition=None,
            partition_count: int, sticky: int, now_ms: int, batch_max_bytes: int
            ) -> list[Chunk]:
    """Split one send_batch() call into chunks: by partition (in the order partitions
    first appear, rows in input order within each), then by batch_max_bytes. `values`
    may be a RecordBatch or Table with a `value` column (and optional `key`, `headers`,
    `timestamp`, `partition` columns; explicit arguments win). `partition`: None (by key,
    keyless rows to `sticky`), an int for every row, or one per row (a null: by key).
    Raises ValueError for malformed input, IndexError for a partition outside
    0..partition_count-1."""
    if (keys is None and headers is None and timestamps_ms is None
            and type(values) in (list, tuple) and len(values) <= PLAIN_MAX_ROWS
            and (partition is None or (type(partition) is int))
            and all(type(value) is bytes for value in values)):
        return _prepare_plain(values, sticky if partition is None else partition,
                              partition_count, now_ms, batch_max_bytes)
    table = None
    if isinstance(values, (pa.RecordBatch, pa.Table)):
        table = values
        if "value" not in table.schema.names:
            raise ValueError("a record batch or table needs a `value` column")
        unknown = set(table.schema.names) - {"value", "key", "headers", "timestamp", "partition"}
        if unknown:
            raise ValueError(f"unknown column(s) {sorted(unknown)}; allowed: value, key, "
                             "headers, timestamp, partition")
        values = table.column("value")
        keys = keys if keys is not None else _column(table, "key")
        headers = headers if headers is not None else _column(table, "headers")
        timestamps_ms = timestamps_ms if timestamps_ms is not None else _column(table, "timestamp")
        partition = partition if partition is not None else _column(table, "partition")
    values = binary_column(values, name="values")
    n = len(values)
    if n == 0:
        return []
    keys = binary_column(keys, n, name="keys")
    if len(keys) != n:
        raise ValueError(f"keys: {len(keys)} for {n} values")
    headers = headers_column(headers, n)
    if len(headers) != n:
        raise ValueError(f"headers: {len(headers)} for {n} values")
    deltas, base, largest_ts = timestamp_column(timestamps_ms, n, now_ms)
    # One timestamp for every row (none given, the common case): each chunk takes it as
    # its base and zero deltas, with no kernel per chunk.
    constant_ts = base if timestamps_ms is None or (
        base == largest_ts and pc.min(deltas).as_py() == 0) else None
    absolute = deltas if constant_ts is not None else pc.add(deltas, base)

    parts = _partitions(partition, keys, n, partition_count, sticky)
    sizes = pc.add(pc.add(pc.fill_null(pc.binary_length(values), 0),
                          pc.fill_null(pc.binary_length(keys), 0)), ROW_OVERHEAD)
    if headers.null_count == 0 and len(headers.values):
        flat = headers.flatten()
        per_header = pc.add(pc.add(pc.binary_length(flat.field("key").cast(pa.binary())),
                                   pc.binary_length(flat.field("value"))), HEADER_OVERHEAD)
        sizes = pc.add(sizes, _sum_per_list(headers, per_header))
    _check_fits(pc.max(sizes).as_py(), batch_max_bytes)
    columns = pa.RecordBatch.from_arrays([keys, values, headers, absolute, sizes],
                                         ["key", "value", "headers", "ts", "size"])
    chunks: list[Chunk] = []
    if isinstance(parts, int):
        _cut(chunks, parts, columns, batch_max_bytes, constant_ts)
        return chunks
    order = pc.sort_indices(parts)  # stable: rows keep their order within a partition
    ordered = columns.take(order)
    ordered_parts = parts.take(order)
    counts = pc.value_counts(ordered_parts)
    first_seen = {p: i for i, p in enumerate(pc.unique(parts).to_pylist())}
    start = 0
    spans = []
    for entry in counts.to_pylist():  # value_counts of sorted input: in sorted order
        spans.append((entry["values"], start, entry["counts"]))
        start += entry["counts"]
    for p, begin, count in sorted(spans, key=lambda s: first_seen[s[0]]):
        _cut(chunks, p, ordered.slice(begin, count), batch_max_bytes, constant_ts)
    return chunks


# prepare() for a short Python list of bytes values and nothing else (no keys, headers or
# timestamps; one partition or none): the same chunks, sized and cut in Python instead of
# by Arrow kernels, whose fixed cost per call (about 20 us each, ten of them) was most of
# a 100-row call's 250 us (docs/benchmarks.md).
PLAIN_MAX_ROWS = 1_000


def _prepare_plain(values, partition: int, count: int, now_ms: int,
                   batch_max_bytes: int) -> list[Chunk]:
    n = len(values)
    if n == 0:
        return []
    _check_partition_range(partition, partition, count)
    sizes = [len(value) + ROW_OVERHEAD for value in values]
    _check_fits(max(sizes), batch_max_bytes)
    column = pa.array(values, pa.binary())
    keys, headers = binary_column(None, n), headers_column(None, n)
    deltas, _, _ = timestamp_column(None, n, now_ms)
    return [Chunk(partition, keys.slice(begin, count), column.slice(begin, count),
                  headers.slice(begin, count), deltas.slice(begin, count), now_ms, now_ms,
                  size + BATCH_OVERHEAD)
            for begin, count, size in _spans(list(itertools.accumulate(sizes)),
                                             batch_max_bytes - BATCH_OVERHEAD)]


def _check_fits(largest: int, batch_max_bytes: int) -> None:
    if largest + BATCH_OVERHEAD > batch_max_bytes:
        raise ValueError(f"a record of about {largest} bytes does not fit a batch of "
                         f"{batch_max_bytes} bytes (batch_max_bytes)")


def _spans(cumulative, room: int):
    """(first row, rows, bytes) of each chunk, in order: as many rows as fit `room` by
    the running sum of their sizes (at least one), found by a binary search over it."""
    begin, done, n = 0, 0, len(cumulative)
    while begin < n:
        end = max(bisect.bisect_right(cumulative, done + room, lo=begin + 1), begin + 1)
        total = cumulative[end - 1]
        yield begin, end - begin, total - done
        done, begin = total, end


def _sum_per_list(lists: pa.Array, per_item: pa.Array) -> pa.Array:
    """Sum of per_item (one value per list item) over each list, 0 for empty ones: the
    difference of the running sum at each list's end and start (Arrow kernels)."""
    offsets = lists.offsets
    offsets = pc.subtract(offsets, offsets[0])  # a slice: relative to its items
    running = pa.concat_arrays([pa.array([0], pa.int64()),
                                pc.cumulative_sum(per_item).cast(pa.int64())])
    n = len(lists)
    return pc.subtract(pc.take(running, offsets.slice(1, n)), pc.take(running, offsets.slice(0, n)))


def _by_key(keys: pa.Array, n: int, count: int, sticky: int):
    """send()'s partitioner: CRC32C of the key modulo the count; keyless rows to `sticky`."""
    if keys.null_count == n:
        return sticky
    hashes = crc32c_column(keys).cast(pa.int64())
    by_key = pc.cast(pc.subtract(hashes, pc.multiply(pc.divide(hashes, count), count)),
                     pa.int32())
    return pc.fill_null(by_key, sticky) if keys.null_count else by_key


def _partitions(partition, keys: pa.Array, n: int, count: int, sticky: int):
    """An int (every row to it) or an int32 array of partitions: `partition` where given,
    else by key (a null in a partition column means "by key", as send()'s None does)."""
    if partition is None:
        return _by_key(keys, n, count, sticky)
    if isinstance(partition, int) and not isinstance(partition, bool):
        _check_partition_range(partition, partition, count)
        return partition
    array = integer_column(partition, pa.int32(), n, "partition")
    if array.null_count:
        by_key = _by_key(keys, n, count, sticky)
        array = pc.if_else(array.is_valid(), array, by_key if isinstance(by_key, pa.Array)
                           else pa.scalar(by_key, pa.int32()))
    bounds = pc.min_max(array)
    _check_partition_range(bounds["min"].as_py(), bounds["max"].as_py(), count)
    return array


def _check_partition_range(low: int, high: int, count: int) -> None:
    if low < 0 or high >= count:
        raise IndexError(f"partition {low if low < 0 else high} outside 0..{count - 1}")


def _cut(chunks: list[Chunk], partition: int, rows: pa.RecordBatch, limit: int,
         constant_ts: int | None = None) -> None:
    """Rows of one partition as chunks of at most `limit` bytes (by the size column): the
    cut points are found by a binary search over the running sum of sizes, read in place
    from its Arrow buffer (no Python object per row). `constant_ts`: every row's timestamp
    when they share one (column 3 then holds zeros): no kernel per chunk."""
    cumulative = _int64_view(pc.cumulative_sum(rows.column(4).cast(pa.int64())))
    keys, values, headers, stamps = (rows.column(i) for i in range(4))
    for begin, count, size in _spans(cumulative, limit - BATCH_OVERHEAD):
        if constant_ts is not None:
            deltas, base, largest = stamps.slice(begin, count), constant_ts, constant_ts
        else:
            piece = stamps.slice(begin, count)
            bounds = pc.min_max(piece)
            base, largest = piece[0].as_py(), bounds["max"].as_py()
            deltas = pc.subtract(piece, pa.scalar(base, pa.int64()))
        chunks.append(Chunk(partition, keys.slice(begin, count), values.slice(begin, count),
                            headers.slice(begin, count), deltas, base, largest,
                            size + BATCH_OVERHEAD))


def _int64_view(array: pa.Array) -> memoryview:
    """The values of an int64 array without nulls as a memoryview of its buffer (indexing
    it gives Python ints; bisect searches it without a list of them)."""
    assert array.type == pa.int64() and not array.null_count
    return memoryview(array.buffers()[1]).cast("q")[array.offset:array.offset + len(array)]
