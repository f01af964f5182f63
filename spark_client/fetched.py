"""What consumers have fetched and not yet returned: decoded blocks of columns, turned
into `Message` tuples (poll) or an Arrow table (poll_arrow) only when returned, and only
for the rows returned.

A block is a run of consecutive offsets of one partition: a batch's records from the
first one wanted (a slice of its columns, no copy). Columnar batches (magic 2) are read
as Arrow buffers over the fetched bytes; row-format batches (magic 1, written before the
columnar format) are decoded record by record and held as the same columns.
"""

from __future__ import annotations

import collections
import itertools
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from partition_server.record_batch import MAGIC_COLUMNAR, BatchHeader, decode_records
from partition_server.record_columns import (BLOCK_SCHEMA, HEADERS_TYPE, decode_columns,
                                             python_columns, record_arrays)


class Message(NamedTuple):
    """One record as read (a NamedTuple: readers make one per record)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int


# What poll_arrow() returns: one row per record.
TABLE_SCHEMA = pa.schema([
    pa.field("topic", pa.string(), nullable=False),
    pa.field("partition", pa.int32(), nullable=False),
    pa.field("offset", pa.int64(), nullable=False),
    pa.field("key", pa.binary()),
    pa.field("value", pa.binary()),
    pa.field("headers", HEADERS_TYPE, nullable=False),
    pa.field("timestamp", pa.timestamp("ms", tz="UTC"), nullable=False),
])


class Block(NamedTuple):
    topic: str
    partition: int
    first_offset: int
    columns: pa.RecordBatch  # BLOCK_SCHEMA: key, value, timestamp_delta, headers
    base_timestamp_ms: int

    @property
    def end_offset(self) -> int:
        return self.first_offset + self.columns.num_rows


def block_of(topic: str, partition: int, batch, header: BatchHeader,
             start: int = 0, end: int | None = None) -> Block | None:
    """The records of one fetched batch with offsets in [start, end), or None if none."""
    first = max(start, header.base_offset)
    stop = header.next_offset if end is None else min(end, header.next_offset)
    if first >= stop:
        return None
    if header.magic == MAGIC_COLUMNAR:
        columns = decode_columns(batch, header)
    else:
        columns = _row_columns(decode_records(batch), header)
    skip = first - header.base_offset
    return Block(topic, partition, first, columns.slice(skip, stop - first),
                 header.base_timestamp_ms)


def _row_columns(records, header: BatchHeader) -> pa.RecordBatch:
    """Row-format records as BLOCK_SCHEMA columns."""
    return pa.RecordBatch.from_arrays(record_arrays(
        records, [r.timestamp_ms for r in records], header.base_timestamp_ms),
        schema=BLOCK_SCHEMA)


def messages_of(block: Block) -> list[Message]:
    """Message tuples of a block's rows."""
    columns = block.columns
    n = columns.num_rows
    keys, values, headers, stamps = python_columns(
        columns.column(0), columns.column(1), columns.column(2), columns.column(3),
        block.base_timestamp_ms)
    # tuple.__new__ over zipped rows: each Message made in C, half the time of calling
    # the NamedTuple's own __new__ (a Python function) per row.
    return list(map(tuple.__new__, itertools.repeat(Message, n), zip(
        itertools.repeat(block.topic, n), itertools.repeat(block.partition, n),
        range(block.first_offset, block.first_offset + n), keys, values, headers, stamps)))


def _per_row(values: list, type_: pa.DataType, run_ends: list[int]) -> pa.Array:
    """One value per block spread over its rows: one kernel call (a repeat when every
    block has the same value, as a poll of one partition does; else run-end decoding)."""
    if all(v == values[0] for v in values):
        return pa.repeat(pa.scalar(values[0], type_), run_ends[-1])
    return pc.run_end_decode(pa.RunEndEncodedArray.from_arrays(
        pa.array(run_ends, pa.int32()), pa.array(values, type_)))


def table_of(blocks: list[Block]) -> pa.Table:
    """Blocks as one Table of TABLE_SCHEMA: key, value and headers are the blocks' own
    buffers (a chunk per block); topic, partition, offset and timestamp are computed for
    all rows at once, so the cost per block is a few list entries, not kernel calls."""
    if not blocks:
        return TABLE_SCHEMA.empty_table()
    rows, ends = 0, []
    for block in blocks:
        rows += block.columns.num_rows
        ends.append(rows)
    starts = [0] + ends[:-1]
    counting = pa.array(range(rows), pa.int64()) if rows > len(_COUNTING) else \
        _COUNTING.slice(0, rows)
    offsets = pc.add(counting, _per_row([b.first_offset - start
                                         for b, start in zip(blocks, starts)], pa.int64(), ends))
    deltas = pa.chunked_array([b.columns.column(2) for b in blocks]).combine_chunks()
    stamps = pc.add(deltas, _per_row([b.base_timestamp_ms for b in blocks], pa.int64(), ends))
    return pa.Table.from_arrays([
        _per_row([b.topic for b in blocks], pa.string(), ends),
        _per_row([b.partition for b in blocks], pa.int32(), ends),
        offsets,
        pa.chunked_array([b.columns.column(0) for b in blocks], pa.binary()),
        pa.chunked_array([b.columns.column(1) for b in blocks], pa.binary()),
        pa.chunked_array([b.columns.column(3) for b in blocks], HEADERS_TYPE),
        stamps.view(pa.timestamp("ms", tz="UTC"))], schema=TABLE_SCHEMA)


_COUNTING = pa.array(range(1 << 16), pa.int64())


class Fetched:
    """Blocks in the order they were fetched; each poll takes from the front."""

    def __init__(self):
        self._blocks: collections.deque[Block] = collections.deque()
        self._rows = 0

    def __len__(self) -> int:
        return self._rows

    def add(self, block: Block | None) -> None:
        if block is not None:
            self._blocks.append(block)
            self._rows += block.columns.num_rows

    def clear(self) -> None:
        self._blocks.clear()
        self._rows = 0

    def drop(self, topic: str, partition: int) -> None:
        """Forget what is held of one partition (after a seek)."""
        self.drop_partitions({(topic, partition)})

    def drop_partitions(self, partitions: set[tuple[str, int]]) -> None:
        """Forget what is held of these (topic, partition)s, in one pass."""
        kept = [b for b in self._blocks if (b.topic, b.partition) not in partitions]
        self._blocks = collections.deque(kept)
        self._rows = sum(b.columns.num_rows for b in kept)

    def position(self, topic: str, partition: int) -> int | None:
        """The first offset held of the partition, or None."""
        for block in self._blocks:
            if block.topic == topic and block.partition == partition:
                return block.first_offset
        return None

    def _take(self, max_records: int, ends: dict | None) -> list[Block]:
        """Blocks of up to max_records rows from the front (the last one split if need
        be); with `ends` ({(topic, partition): offset}), rows at or past their partition's
        end are dropped."""
        taken: list[Block] = []
        room = max_records
        while self._blocks and room > 0:
            block = self._blocks.popleft()
            n = block.columns.num_rows
            self._rows -= n
            if n > room:
                rest = Block(block.topic, block.partition, block.first_offset + room,
                             block.columns.slice(room), block.base_timestamp_ms)
                self._blocks.appendleft(rest)
                self._rows += rest.columns.num_rows
                block = block._replace(columns=block.columns.slice(0, room))
                n = room
            room -= n
            if ends is not None:
                end = ends.get((block.topic, block.partition), 0)
                if block.first_offset >= end:
                    continue
                if block.end_offset > end:
                    block = block._replace(columns=block.columns.slice(
                        0, end - block.first_offset))
            taken.append(block)
        return taken

    def take_blocks(self, max_records: int, ends: dict | None = None) -> list[Block]:
        """The blocks themselves (see _take): for readers that build their own columns."""
        return self._take(max_records, ends)

    def take_messages(self, max_records: int, ends: dict | None = None) -> list[Message]:
        out: list[Message] = []
        for block in self._take(max_records, ends):
            out.extend(messages_of(block))
        return out

    def take_table(self, max_records: int, ends: dict | None = None) -> pa.Table:
        return table_of(self._take(max_records, ends))
