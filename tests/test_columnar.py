"""The columnar records block (batch magic 2) and the SDK's Arrow paths: encoding and
decoding (pure), send_batch() splitting and partitioning (pure), and against the real
cluster send_batch(), poll_arrow() on both consumers, acks of a table, transactions,
row-format data written before the columnar format, and the pandas/polars recipes of
docs/dataframes.md."""

from __future__ import annotations

import struct
import uuid
from pathlib import Path

import crc32c
import pyarrow as pa
import pytest

from atomlog.v1 import common_pb2, partition_pb2
from partition_server import record_batch as rb
from partition_server import record_columns as rc
from services.errors import AtomlogError
from spark_client import Client, columns, errors
from tests.conftest import create_online

EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def records(n: int = 5) -> list[rb.Record]:
    return [rb.Record(key=None if i % 2 else f"k{i}".encode(), value=b"v" * (i * 7),
                      headers=(("h", b"x"), ("n", str(i).encode())) if i == 3 else (),
                      timestamp_ms=1_700_000_000_000 + (i * 13) % 5)
            for i in range(n)]


# ------------------------------------------------------------------ the format (pure)
@pytest.mark.parametrize("codec", list(rb.Compression))
def test_columnar_batch_round_trips_with_every_codec(codec):
    want = records(40)
    batch = rc.encode_records(want, producer_id=7, producer_epoch=2, base_sequence=10,
                              txn=(3, 99), compression=codec)
    header = rb.validate_batch(batch)
    assert header.magic == rb.MAGIC_COLUMNAR and header.compression is codec
    assert (header.record_count, header.base_sequence, header.txn) == (40, 10, (3, 99))
    assert header.base_timestamp_ms == want[0].timestamp_ms
    assert header.max_timestamp_ms == max(r.timestamp_ms for r in want)
    got = rb.decode_records(rb.with_base_offset(batch, 1000))
    assert [r[:4] for r in got] == [r[:4] for r in want]
    assert [r.offset for r in got] == list(range(1000, 1040))


def test_a_block_is_an_arrow_stream_behind_the_published_schema_message():
    batch = rc.encode_records(records())
    table = pa.ipc.open_stream(rc.schema_message() + batch[rb.HEADER_SIZE:] + EOS).read_all()
    assert table.schema == rc.BLOCK_SCHEMA
    assert table.column("value").to_pylist() == [r.value for r in records()]


def test_the_schema_message_in_the_docs_is_the_one_the_code_uses():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "record-format.md").read_text()
    section = doc[doc.index("### 1.6"):doc.index("## 2.")]
    published = section.split("```")[1]
    assert bytes.fromhex("".join(published.split())) == rc.schema_message() + EOS


def _pyarrow_encoded(recs: list[rb.Record], **fields) -> bytes:
    """encode_records through pyarrow's arrays and IPC writer (the path of large batches
    and batches with headers), whatever the batch."""
    stamps = [r.timestamp_ms for r in recs]
    keys, values, deltas, headers = rc.record_arrays(recs, stamps, stamps[0])
    return rc.encode_columns(keys, values, headers, deltas, stamps[0], max(stamps), **fields)


def test_small_batches_written_without_pyarrow_read_as_pyarrow_s_own():
    """plain_block() writes the IPC message itself: for null, empty and filled keys and
    values, equal and differing timestamps, 1 to PLAIN_MAX_RECORDS records, the block
    decodes (validated in full) to exactly what pyarrow's encoding of the same records
    decodes to, and any Arrow reader reads it behind the schema message."""
    import random

    rnd = random.Random(19)
    sizes = [1, 2, 7, 8, 9, 63, 64, 65, rc.PLAIN_MAX_RECORDS] + \
        [rnd.randint(1, 40) for _ in range(300)]
    for trial, n in enumerate(sizes):
        base = 1_700_000_000_000
        recs = [rb.Record(
            key=rnd.choice([None, b"", rnd.randbytes(rnd.randint(1, 20))]),
            value=rnd.choice([None, b"", rnd.randbytes(rnd.randint(1, 300))]),
            timestamp_ms=base if trial % 2 else base + rnd.randint(-5, 5000))
            for _ in range(n)]
        if trial % 5 == 0:  # every key null, every value filled (a producer's usual batch)
            recs = [r._replace(key=None, value=b"x" * 1024) for r in recs]
        if trial % 7 == 0:  # bytes-like, not bytes
            recs = [r._replace(value=bytearray(r.value)) if r.value else r for r in recs]
        assert rc.plain_block(recs, [r.timestamp_ms for r in recs]) is not None
        fields = dict(producer_id=3, producer_epoch=1, base_sequence=trial, txn=(2, trial + 1))
        plain, reference = rc.encode_records(recs, **fields), _pyarrow_encoded(recs, **fields)
        header = rb.parse_header(plain)
        assert header == rb.parse_header(reference)._replace(
            batch_length=header.batch_length, crc=header.crc)
        assert rc.decode_columns(plain).equals(rc.decode_columns(reference)), trial
        assert [r[:4] for r in rb.decode_records(plain)] == [r[:4] for r in recs]
        stream = pa.ipc.open_stream(rc.schema_message() + plain[rb.HEADER_SIZE:] + EOS)
        assert stream.read_all().to_batches()[0].equals(rc.decode_columns(reference))


@pytest.mark.parametrize("case", ["headers", "str value", "int key", "compressed", "large"])
def test_batches_plain_block_does_not_write_take_pyarrow_s_path(case):
    recs = [rb.Record(key=None, value=b"v%d" % i, timestamp_ms=5) for i in range(4)]
    fields = {}
    if case == "headers":
        recs[2] = recs[2]._replace(headers=(("h", b"x"),))
    elif case == "str value":
        recs[1] = recs[1]._replace(value="text")
    elif case == "int key":  # refused by pyarrow too
        recs[0] = recs[0]._replace(key=7)
    elif case == "compressed":
        fields["compression"] = rb.Compression.ZSTD
    else:
        recs = [rb.Record(key=None, value=b"v", timestamp_ms=5)] * (rc.PLAIN_MAX_RECORDS + 1)
    stamps = [r.timestamp_ms for r in recs]
    if case in ("headers", "str value", "int key"):
        assert rc.plain_block(recs, stamps) is None
    if case == "int key":
        with pytest.raises((pa.ArrowException, TypeError)):
            rc.encode_records(recs, **fields)
        return
    batch = rc.encode_records(recs, **fields)
    assert batch == _pyarrow_encoded(recs, **fields)
    got = rb.decode_records(batch)
    assert [bytes(r.value) if r.value is not None else None for r in got] == [
        r.value.encode() if isinstance(r.value, str) else r.value for r in recs]


def test_uncompressed_blocks_are_read_without_copying():
    batch = rc.encode_records([rb.Record(value=b"x" * 4096)])
    columns = rc.decode_columns(batch)
    value_buffer = columns.column("value").buffers()[2]
    fetched = pa.py_buffer(batch)
    assert fetched.address <= value_buffer.address < fetched.address + fetched.size


def reseal(batch: bytes, block: bytes) -> bytes:
    """`batch`'s header over another block: length and CRC made right again."""
    header = bytearray(batch[:rb.HEADER_SIZE])
    struct.pack_into(">i", header, 8, rb.HEADER_SIZE - 12 + len(block))
    crc = crc32c.crc32c(block, crc32c.crc32c(bytes(header[rb.CRC_COVERED_FROM:])))
    struct.pack_into(">I", header, rb.CRC_OFFSET, crc)
    return bytes(header) + block


@pytest.mark.parametrize("damage", ["trailing", "truncated", "rows", "schema", "not-arrow",
                                    "offsets"])
def test_malformed_blocks_are_refused_not_misread(damage):
    batch = rc.encode_records(records(4))
    block = batch[rb.HEADER_SIZE:]
    if damage == "trailing":
        bad = reseal(batch, block + b"\0" * 8)
    elif damage == "truncated":
        bad = reseal(batch, block[:-16])
    elif damage == "rows":  # a block of 3 rows under a header that says 4
        bad = reseal(batch, rc.encode_records(records(3))[rb.HEADER_SIZE:])
    elif damage == "schema":  # a record batch of another schema
        other = pa.record_batch([pa.array([1, 2, 3, 4], pa.int64())], names=["x"])
        bad = reseal(batch, other.serialize().to_pybytes())
    elif damage == "not-arrow":
        bad = reseal(batch, b"\x01" * len(block))
    else:  # value offsets that run backwards (a value "ending" before it starts)
        columns = rc.decode_columns(batch)
        values = columns.column("value")
        offsets = bytearray(values.buffers()[1].to_pybytes())
        last = struct.unpack_from("<i", offsets, 4 * len(values))[0]
        struct.pack_into("<i", offsets, 4, last)
        forged = pa.Array.from_buffers(pa.binary(), len(values),
                                       [None, pa.py_buffer(bytes(offsets)), values.buffers()[2]])
        bad = reseal(batch, pa.RecordBatch.from_arrays(
            [columns.column(0), forged, columns.column(2), columns.column(3)],
            schema=rc.BLOCK_SCHEMA).serialize().to_pybytes())
    with pytest.raises(AtomlogError) as info:
        rb.decode_records(bad)
    assert info.value.reason == "CORRUPT_BATCH"


def test_a_flipped_bit_is_a_crc_mismatch():
    batch = bytearray(rc.encode_records(records()))
    batch[-3] ^= 0x10
    with pytest.raises(AtomlogError) as info:
        rb.decode_records(bytes(batch))
    assert info.value.reason == "CRC_MISMATCH"


def test_control_batches_stay_in_the_row_format():
    marker = rb.encode_control_batch(rb.ControlType.COMMIT, txn=(1, 2), coordinator_epoch=3,
                                     timestamp_ms=5)
    assert rb.parse_header(marker).magic == rb.MAGIC
    forged = bytearray(marker)
    forged[12] = rb.MAGIC_COLUMNAR
    with pytest.raises(AtomlogError, match="row format"):
        rb.parse_header(bytes(forged))


def test_row_format_batches_stay_readable():
    old = rb.encode_batch(records())
    assert rb.parse_header(old).magic == rb.MAGIC
    assert [r[:4] for r in rb.decode_records(old)] == [r[:4] for r in records()]


def test_poll_arrow_tables_hold_exactly_what_poll_returns():
    """Fetched blocks of two topics and partitions, one in the row format, skipped
    offsets, rows split across polls: the table and the Message tuples agree."""
    from spark_client.fetched import Fetched, block_of

    fetched_arrow, fetched_rows = Fetched(), Fetched()
    base = 1000
    for k in range(6):
        encode = rb.encode_batch if k == 2 else rc.encode_records
        batch = rb.with_base_offset(encode(records(7)), base)
        header = rb.parse_header(batch)
        for fetched in (fetched_arrow, fetched_rows):
            fetched.add(block_of(f"t{k % 2}", k % 3, batch, header, base + (k % 2), base + 6))
        base += 7
    tables = []
    while len(fetched_arrow):
        tables.append(fetched_arrow.take_table(4))
    table = pa.concat_tables(tables)
    messages = fetched_rows.take_messages(1000)
    assert table.num_rows == len(messages) == 6 * 5 + 3
    columns = ("topic", "partition", "offset", "key", "value", "headers", "timestamp")
    rows = list(zip(*(table.column(c).to_pylist() for c in columns)))
    assert [(t, p, o, k, v, tuple((h["key"], h["value"]) for h in hs),
             int(ts.timestamp() * 1000)) for t, p, o, k, v, hs, ts in rows] == \
        [tuple(m) for m in messages]


TUNING_SCRIPT = """
import sys
from services import allocator
from spark_client.consumer import tune_for_fetches
tuned = sys.argv[1] == "tuned"
if tuned:
    allocator.tune(4 << 20, 32 << 20)  # what Client() does unless tune_allocator=False
tune_for_fetches(8 << 20)
print(*allocator.applied())
"""


@pytest.mark.parametrize("client_tuned", [True, False])
def test_a_consumer_keeps_its_fetch_replies_on_the_heap_only_if_the_client_tuned(
        client_tuned):
    """A consumer's Fetch replies (up to max_bytes_per_request, held about three times
    over while read) stay under the mmap threshold when Client() tuned glibc's malloc;
    a process that opted out (Client(tune_allocator=False)) is left alone. Run in a
    fresh interpreter against the real C library."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TUNING_SCRIPT,
                           "tuned" if client_tuned else "untouched"],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                          text=True, timeout=60, check=True)
    mmap_threshold, trim_threshold = (int(x) for x in done.stdout.split())
    if client_tuned:
        assert (mmap_threshold, trim_threshold) == (16 << 20, 64 << 20)
    else:
        assert (mmap_threshold, trim_threshold) == (0, 0)


# ------------------------------------------------------------------ send_batch's columns
def test_partitioner_is_send_s_crc32c_of_the_key():
    keys = [uuid.uuid4().bytes[: i % 17] for i in range(300)] + [None]
    assert columns.crc32c_column(pa.array(keys, pa.binary())).to_pylist() == [
        None if k is None else crc32c.crc32c(k) for k in keys]
    chunks = columns.prepare([b"v"] * len(keys), keys=keys, partition_count=7, sticky=4,
                             now_ms=1, batch_max_bytes=1 << 20)
    placed = {k: c.partition for c in chunks for k in c.keys.to_pylist()}
    for key in keys:
        assert placed[key] == (4 if key is None else crc32c.crc32c(key) % 7)
    # a null in a partition column means "by key", as send(partition=None) does
    chunks = columns.prepare([b"a", b"b", b"c"], keys=[b"k1", None, b"k2"],
                             partition=[None, None, 1], partition_count=7, sticky=4,
                             now_ms=1, batch_max_bytes=1 << 20)
    placed = {v: c.partition for c in chunks for v in c.values.to_pylist()}
    assert placed == {b"a": crc32c.crc32c(b"k1") % 7, b"b": 4, b"c": 1}


def test_chunks_keep_input_order_per_partition_and_fit_the_batch_bound():
    values = [f"{i:06d}".encode() * 100 for i in range(2000)]  # 600 B each
    parts = [i % 3 for i in range(2000)]
    chunks = columns.prepare(values, partition=parts, partition_count=3, sticky=0, now_ms=1,
                             batch_max_bytes=64 << 10)
    assert [c.partition for c in chunks[:1]] == [0]
    for p in range(3):
        mine = [v for c in chunks if c.partition == p for v in c.values.to_pylist()]
        assert mine == values[p::3]
    for chunk in chunks:
        batch = rc.encode_columns(chunk.keys, chunk.values, chunk.headers,
                                  chunk.timestamp_deltas, chunk.base_timestamp_ms,
                                  chunk.max_timestamp_ms)
        assert len(batch) <= 64 << 10 and chunk.size <= 64 << 10


@pytest.mark.parametrize("rows", [1, 100, 1_000])
@pytest.mark.parametrize("partition", [None, 2])
def test_a_short_list_of_bytes_is_cut_as_the_arrow_path_cuts_it(rows, partition):
    """prepare()'s path for a short Python list of bytes and nothing else gives the chunks
    the Arrow kernels give for the same rows (forced through them by a tuple of
    bytearrays), and refuses what they refuse."""
    values = [bytes([i % 251]) * (1 + (i * 7919) % 3000) for i in range(rows)]
    options = dict(partition=partition, partition_count=3, sticky=1, now_ms=77,
                   batch_max_bytes=16 << 10)
    plain = columns.prepare(values, **options)
    kernels = columns.prepare(tuple(bytearray(v) for v in values), **options)
    assert len(plain) == len(kernels) >= (1 if rows < 100 else 2)
    for mine, theirs in zip(plain, kernels):
        assert (mine.partition, mine.size, mine.base_timestamp_ms, mine.max_timestamp_ms) \
            == (theirs.partition, theirs.size, theirs.base_timestamp_ms,
                theirs.max_timestamp_ms)
        for column in ("keys", "values", "headers", "timestamp_deltas"):
            assert getattr(mine, column).equals(getattr(theirs, column)), column
    assert columns.prepare([], **options) == []
    with pytest.raises(IndexError):
        columns.prepare([b"x"], **{**options, "partition": 3})
    with pytest.raises(ValueError, match="does not fit"):
        columns.prepare([b"x" * (16 << 10)], **options)


def test_tables_numpy_and_headers_are_accepted_and_bad_input_is_refused():
    table = pa.table({"value": ["a", "b", "c"], "key": [b"x", None, b"y"],
                      "partition": [2, 0, 2], "timestamp": [10, 11, 12],
                      "headers": pa.array([[("h", b"1")], [], None],
                                          pa.map_(pa.string(), pa.binary()))})
    chunks = columns.prepare(table, partition_count=3, sticky=0, now_ms=1,
                             batch_max_bytes=1 << 20)
    assert [(c.partition, c.values.to_pylist()) for c in chunks] == [(2, [b"a", b"c"]),
                                                                    (0, [b"b"])]
    assert chunks[0].headers.to_pylist() == [[{"key": "h", "value": b"1"}], []]
    assert (chunks[0].base_timestamp_ms, chunks[0].max_timestamp_ms) == (10, 12)
    # slices of Arrow header columns, and generators of values
    maps = pa.array([[("a", b"1")], None, [("b", b"2"), ("c", b"3")], []],
                    pa.map_(pa.string(), pa.binary()))
    lists = pa.array([[{"key": "a", "value": b"1"}], [], [{"key": "b", "value": b"2"}]],
                     pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())])))
    assert rc.headers_column(maps.slice(2), 2).to_pylist() == [
        [{"key": "b", "value": b"2"}, {"key": "c", "value": b"3"}], []]
    assert rc.headers_column(lists.slice(1), 2).to_pylist() == [[], [{"key": "b",
                                                                     "value": b"2"}]]
    assert rc.binary_column(v for v in ["a", None]).to_pylist() == [b"a", None]
    numpy = pytest.importorskip("numpy")
    (chunk,) = columns.prepare(numpy.array(["é", "b"]), partition=1, partition_count=2,
                               sticky=0, now_ms=1, batch_max_bytes=1 << 20)
    assert chunk.values.to_pylist() == ["é".encode(), b"b"]
    with pytest.raises(ValueError, match="values"):
        columns.prepare([1, 2], partition_count=1, sticky=0, now_ms=1, batch_max_bytes=1 << 20)
    with pytest.raises(ValueError, match="keys"):
        columns.prepare([b"a"], keys=[b"a", b"b"], partition_count=1, sticky=0, now_ms=1,
                        batch_max_bytes=1 << 20)
    with pytest.raises(ValueError, match="batch_max_bytes"):
        columns.prepare([b"x" * 5000], partition_count=1, sticky=0, now_ms=1,
                        batch_max_bytes=4096)
    with pytest.raises(IndexError):
        columns.prepare([b"a"], partition=[3], partition_count=3, sticky=0, now_ms=1,
                        batch_max_bytes=1 << 20)
    with pytest.raises(ValueError, match="unknown column"):
        columns.prepare(pa.table({"value": [b"a"], "colour": [1]}), partition_count=1,
                        sticky=0, now_ms=1, batch_max_bytes=1 << 20)


def test_produce_requests_stay_under_the_message_limit():
    """Batches for one server go out in Produce requests of at most 8 MiB: the first
    batch of each partition in one, the rest in the next, in sequence order."""
    from spark_client.producer import _Batch, _requests

    batches = [_Batch("t", i % 3, [], None, 0.0, payload=b"x" * (3 << 20)) for i in range(7)]
    groups = _requests(batches, 8 << 20)
    assert [len(g) for g in groups] == [2, 1, 2, 2]
    assert [b for g in groups for b in g] == batches
    assert len({b.partition for b in groups[0] + groups[1]}) == 3
    small = [_Batch("t", p, [], None, 0.0, payload=b"x") for p in (0, 0, 1, 0, 1)]
    assert _requests(small, 8 << 20) == [[small[0], small[2]],
                                         [small[1], small[3], small[4]]]
    big = _Batch("t", 0, [], None, 0.0, payload=b"x" * (9 << 20))
    assert _requests([big, batches[0]], 8 << 20) == [[big], [batches[0]]]


def test_the_producer_s_request_bytes_are_the_protobuf_serialization():
    """The producer serializes ProduceRequest itself, from each batch's pieces (header and
    Arrow block, or send()'s bytes): the same bytes protobuf makes, and they parse back."""
    from spark_client.producer import _Batch, _produce_request

    block = rc.columns_block(pa.nulls(3, pa.binary()), pa.array([b"a", b"bc", b""]),
                             rc.headers_column(None, 3), rc.timestamp_column(None, 3, 5)[0])
    framed = (rc.frame_header(block, count=3, base_timestamp_ms=5, max_timestamp_ms=5,
                              producer_id=9, producer_epoch=1, base_sequence=300), block)
    group = [_Batch("tópico", 0, [], None, 0.0, payload=framed),
             _Batch("t" * 200, 300, [], None, 0.0, payload=b"x" * 70_000),
             _Batch("t", 7, [], None, 0.0, payload=b"")]
    expected = partition_pb2.ProduceRequest(items=[partition_pb2.ProduceItem(
        topic_partition=common_pb2.TopicPartition(topic=b.topic, partition=b.partition),
        record_batch=b"".join(b.payload) if isinstance(b.payload, tuple) else b.payload)
        for b in group]).SerializeToString()
    assert _produce_request(group) == expected
    parsed = partition_pb2.ProduceRequest.FromString(_produce_request(group))
    assert parsed.items[0].record_batch == rc.encode_columns(
        pa.nulls(3, pa.binary()), pa.array([b"a", b"bc", b""]), rc.headers_column(None, 3),
        rc.timestamp_column(None, 3, 5)[0], 5, 5, producer_id=9, producer_epoch=1,
        base_sequence=300)


@pytest.mark.parametrize("codec", list(rb.Compression))
def test_a_header_framed_apart_is_frame_batch_s(codec):
    block = rc.columns_block(pa.array([b"k", None]), pa.array([b"v" * 500, None]),
                             rc.headers_column([{"h": b"1"}, None], 2),
                             pa.array([0, 7], pa.int64()), codec)
    for fields in ({}, {"producer_id": 3, "producer_epoch": 4, "base_sequence": 5},
                   {"producer_id": 3, "producer_epoch": 4, "base_sequence": 5, "txn": (2, 6)}):
        header = rc.frame_header(block, count=2, base_timestamp_ms=10, max_timestamp_ms=17,
                                 compression=codec, **fields)
        assert header + bytes(block) == rb.frame_batch(
            block, magic=rb.MAGIC_COLUMNAR, count=2, base_timestamp_ms=10,
            max_timestamp_ms=17, compression=codec, **fields)


def test_chunks_of_one_timestamp_and_of_many_carry_the_right_ones():
    values = [b"v" * 1000] * 600
    same = columns.prepare(values, partition=0, partition_count=1, sticky=0, now_ms=42,
                           batch_max_bytes=64 << 10)
    assert len(same) > 5
    for chunk in same:
        assert (chunk.base_timestamp_ms, chunk.max_timestamp_ms) == (42, 42)
        assert set(chunk.timestamp_deltas.to_pylist()) == {0}
    stamps = [1000 + (i * 7919) % 600 for i in range(600)]
    many = columns.prepare(values, timestamps_ms=stamps, partition=0, partition_count=1,
                           sticky=0, now_ms=42, batch_max_bytes=64 << 10)
    got = [c.base_timestamp_ms + d for c in many for d in c.timestamp_deltas.to_pylist()]
    assert got == stamps
    for chunk in many:
        mine = [chunk.base_timestamp_ms + d for d in chunk.timestamp_deltas.to_pylist()]
        assert chunk.base_timestamp_ms == mine[0] and chunk.max_timestamp_ms == max(mine)
    (given,) = columns.prepare([b"a", b"b"], timestamps_ms=[7, 7], partition=0,
                               partition_count=1, sticky=0, now_ms=42, batch_max_bytes=1 << 20)
    assert (given.base_timestamp_ms, given.max_timestamp_ms,
            given.timestamp_deltas.to_pylist()) == (7, 7, [0, 0])


def test_a_one_call_transaction_encodes_kept_chunks_and_records_as_sent():
    """What a one-call transaction keeps for a partition (transactions._KeptPartition)
    becomes one batch of exactly the records sent, in order: one chunk from its columns,
    several chunks rebased onto the first one's timestamp, and chunks mixed with send()'s
    records."""
    from types import SimpleNamespace

    from spark_client.transactions import _KeptPartition

    def chunk(values, stamps, headers=None):
        (one,) = columns.prepare(values, keys=[b"k" + v for v in values], headers=headers,
                                 timestamps_ms=stamps, partition=0, partition_count=1,
                                 sticky=0, now_ms=0, batch_max_bytes=1 << 20)
        return one

    def decoded(batch: bytes) -> list:
        header = rb.parse_header(batch)
        return [(r.key, r.value, r.headers, r.timestamp_ms)
                for r in rc.records_of(rc.decode_columns(batch, header), header)]

    first = chunk([b"a", b"bb"], [5_000, 4_990], headers=[{"h": b"1"}, None])
    second = chunk([b"c", b"d", b"e"], [1_000, 9_000, 1_000])
    expected = [(b"ka", b"a", (("h", b"1"),), 5_000), (b"kbb", b"bb", (), 4_990),
                (b"kc", b"c", (), 1_000), (b"kd", b"d", (), 9_000), (b"ke", b"e", (), 1_000)]
    for codec in (rb.Compression.NONE, rb.Compression.ZSTD):
        producer = SimpleNamespace(compression=codec)
        part = _KeptPartition(producer, outcome=None)
        assert part.add_chunk(first) == 0
        assert decoded(part.encode()) == expected[:2]
        assert part.add_chunk(second) == 2
        assert decoded(part.encode()) == expected
        assert part.add_record(rb.Record(b"kf", b"f", (), 7), 10) == 5
        assert part.add_record(rb.Record(None, b"g", (), 8), 10) == 6
        assert part.add_chunk(chunk([b"h"], [3])) == 7
        mixed = expected + [(b"kf", b"f", (), 7), (None, b"g", (), 8), (b"kh", b"h", (), 3)]
        assert decoded(part.encode()) == mixed
        assert [(r.key, r.value, r.headers, r.timestamp_ms) for r in part.records()] == mixed
        assert part.count == 8 and part.size == (first.size + second.size + 20
                                                 + part.pieces[-1].size)


def test_a_kept_partitions_records_encode_to_what_encode_records_writes():
    """A one-call transaction's send() records are framed by the SDK itself
    (transactions._plain_batch): byte for byte encode_records' batch, and encode_records
    wherever plain_block does not take them (headers, a compression)."""
    from types import SimpleNamespace

    from spark_client.transactions import _KeptPartition, _plain_batch

    value = bytes(range(256)) * 5
    cases = [[rb.Record(None, value, (), 1_700_000_000_123)],
             [rb.Record(b"k%d" % i, value[:i * 37], (), 1_700_000_000_000 + (i * 7919) % 50)
              for i in range(10)],
             [rb.Record(None, b"", (), 5), rb.Record(b"", None, (), 3)]]
    for records in cases:
        assert _plain_batch(records) == rc.encode_records(records)
        rb.parse_header(_plain_batch(records))  # (checks its CRC too)
    with_headers = [rb.Record(b"k", b"v", (("h", b"1"),), 9)]
    assert _plain_batch(with_headers) is None
    assert _plain_batch([rb.Record(b"k", b"v", (), None)]) is None
    for codec in (rb.Compression.NONE, rb.Compression.ZSTD):
        part = _KeptPartition(SimpleNamespace(compression=codec), outcome=None)
        for record in cases[1] + with_headers:
            part.add_record(record, 10)
        assert part.encode() == rc.encode_records(cases[1] + with_headers, compression=codec)


# ------------------------------------------------------------------ against the cluster


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.info["bootstrap"]) as c:
        yield c


def new_topic(client, partitions: int = 3) -> str:
    return create_online(client, f"columnar-{uuid.uuid4().hex[:10]}", partitions)


def read_all(client, topic: str, want: int, **options) -> pa.Table:
    with client.consumer(topic, **options) as consumer:
        tables = []
        for table in consumer.read_until(arrow=True, idle_timeout_s=30):
            tables.append(table)
        got = pa.concat_tables(tables) if tables else pa.table({})
    assert got.num_rows == want
    return got


@pytest.mark.cluster
def test_send_batch_lands_where_send_would_and_reads_back_as_arrow(client):
    topic = new_topic(client)
    keys = [f"user-{i % 11}".encode() for i in range(1000)]
    values = [f"event-{i}".encode() for i in range(1000)]
    with client.producer() as producer:
        meta = producer.send_batch(topic, values, keys=keys,
                                   headers=[{"i": str(i)} if i % 100 == 0 else None
                                            for i in range(1000)]).result(30)
        single = producer.send(topic, b"one", key=b"user-3").result(30)
    assert meta.count == 1000
    got = read_all(client, topic, 1001)
    assert got.schema.names == ["topic", "partition", "offset", "key", "value", "headers",
                                "timestamp"]
    by_key = {}
    for row in got.select(["partition", "key"]).to_pylist():
        by_key.setdefault(row["key"], set()).add(row["partition"])
    assert all(len(p) == 1 for p in by_key.values())
    assert by_key[b"user-3"] == {single.partition}
    # each partition's rows are in send order, and the offsets are those the future gave
    for partition, first, count in meta.ranges:
        rows = got.filter(pa.compute.equal(got.column("partition"), partition))
        sent = [v for k, v in zip(keys, values) if crc32c.crc32c(k) % 3 == partition]
        assert rows.column("value").to_pylist()[:len(sent)] == sent
        assert first in rows.column("offset").to_pylist()
    headed = got.filter(pa.compute.equal(got.column("value"), b"event-100"))
    assert headed.column("headers").to_pylist() == [[{"key": "i", "value": b"100"}]]
    # poll() gives the same records as Message tuples
    with client.consumer(topic) as consumer:
        messages = [m for batch in consumer.read_until(idle_timeout_s=30) for m in batch]
    assert sorted((m.partition, m.offset, m.value) for m in messages) == sorted(
        zip(*(got.column(c).to_pylist() for c in ("partition", "offset", "value"))))


@pytest.mark.cluster
@pytest.mark.parametrize("size", ["one-call", "streaming"])
def test_send_batch_in_transactions_commits_or_aborts_whole(client, size):
    topic = new_topic(client, 2)
    rows = 50 if size == "one-call" else 20_000  # 20,000 × 100 B outgrows the 1 MiB bound
    with client.producer() as producer:
        txn = client.begin_transaction()
        future = producer.send_batch(topic, [b"c" * 100] * rows, txn=txn)
        assert txn.one_call == (size == "one-call")
        txn.commit(wait_for_markers=True)
        assert future.result(30).count == rows
        txn = client.begin_transaction()
        producer.send_batch(topic, [b"a" * 100] * rows, txn=txn)
        txn.abort()
        # read_committed sees the committed rows only
        got = read_all(client, topic, rows)
        assert set(got.column("value").to_pylist()) == {b"c" * 100}
        committed_and_open = client.begin_transaction()
        producer.send_batch(topic, [b"o"] * 3, partition=0, txn=committed_and_open)
        committed_and_open.txn_id  # switches a one-call transaction: its records go out now
        producer.flush()
        read_all(client, topic, rows)  # the open transaction's rows are not readable
        committed_and_open.abort()


@pytest.mark.cluster
@pytest.mark.parametrize("bound", [1 << 20, 6_000])
def test_a_one_call_transaction_keeps_send_batch_rows_in_send_order(cluster, bound):
    """send_batch() into a one-call transaction keeps its chunks whole (as columns),
    beside send()'s records to the same partitions; the commit writes them in send order
    with their keys, headers and timestamps, at the offsets the futures give. With a
    small bound the transaction switches mid-way (the kept chunks go to the producer as
    records) and the outcome is the same."""
    base = 1_700_000_000_000
    with Client(cluster.info["bootstrap"], one_call_max_bytes=bound) as small:
        topic = new_topic(small, 2)
        sent = {0: [], 1: []}  # partition -> (key, value, headers, timestamp) in send order
        with small.producer() as producer:
            txn = small.begin_transaction()
            first = producer.send(topic, b"first", key=b"k", partition=0,
                                  headers={"h": b"1"}, timestamp_ms=base + 5, txn=txn)
            sent[0].append((b"k", b"first", [{"key": "h", "value": b"1"}], base + 5))
            rows = [b"b%03d" % i + b"." * 50 for i in range(40)]
            spread = producer.send_batch(
                topic, rows, keys=[b"x%d" % i for i in range(40)],
                partition=[i % 2 for i in range(40)],
                timestamps_ms=[base + 1000 * i for i in range(40)], txn=txn)
            for i, row in enumerate(rows):
                sent[i % 2].append((b"x%d" % i, row, [], base + 1000 * i))
            assert txn.one_call
            late = [b"c%02d" % i + b"." * 400 for i in range(10)]  # about 4 KiB more
            tail = producer.send_batch(topic, late, partition=0, txn=txn,
                                       headers=[{"n": b"%d" % i} for i in range(10)],
                                       timestamps_ms=[base - 50_000 + i for i in range(10)])
            sent[0] += [(None, row, [{"key": "n", "value": b"%d" % i}], base - 50_000 + i)
                        for i, row in enumerate(late)]
            last = producer.send(topic, b"last", partition=1, timestamp_ms=base, txn=txn)
            sent[1].append((None, b"last", [], base))
            assert txn.one_call == (bound > 6_000)
            txn.commit(wait_for_markers=True)
        got = read_all(small, topic, 52)
    for partition, records in sent.items():
        mine = got.filter(pa.compute.equal(got.column("partition"), partition))
        assert list(zip(mine.column("key").to_pylist(), mine.column("value").to_pylist(),
                        mine.column("headers").to_pylist(),
                        mine.column("timestamp").cast(pa.int64()).to_pylist())) \
            == records
    offsets = {(r["partition"], r["value"]): r["offset"] for r in got.to_pylist()}
    assert first.result(5).offset == offsets[(0, b"first")]
    assert last.result(5).offset == offsets[(1, b"last")]
    for future, values in ((spread, rows), (tail, late)):
        meta = future.result(5)
        assert meta.count == len(values)
        from_ranges = sorted(o for partition, start, count in meta.ranges
                             for o in ((partition, start + i) for i in range(count)))
        assert from_ranges == sorted((p, offsets[(p, v)]) for p, v in offsets
                                     if v in values)


@pytest.mark.cluster
def test_poll_arrow_on_a_subscription_and_ack_of_the_table(client):
    topic = new_topic(client, 2)
    with client.producer() as producer:
        producer.send_batch(topic, [f"{i}".encode() for i in range(500)],
                            partition=[i % 2 for i in range(500)]).result(30)
    subscription = f"s-{uuid.uuid4().hex[:8]}"
    with client.consumer(topic, subscription=subscription) as consumer:
        seen = []
        while len(seen) < 500:
            table = consumer.poll_arrow(timeout_s=5, max_records=120)
            assert table.num_rows, "nothing delivered"
            assert table.num_rows <= 120
            seen.extend(table.column("value").to_pylist())
            consumer.ack(table)
        assert sorted(seen, key=int) == [f"{i}".encode() for i in range(500)]
        assert consumer.poll_arrow(timeout_s=1).num_rows == 0
        cursors = consumer.describe()
        assert all(c.cumulative_end_offset == 250 for c in cursors)


@pytest.mark.cluster
def test_row_format_data_written_before_stays_readable(client, cluster):
    """A batch of the row format (magic 1), produced by a raw call as an older SDK would,
    is read by poll() and poll_arrow() next to columnar ones."""
    topic = new_topic(client, 1)
    route = client.metadata.route(topic, 0)
    stub = client.channels.partition(route.address)
    old = rb.encode_batch([rb.Record(key=b"k", value=b"old", headers=(("h", b"1"),))])
    reply = stub.Produce(partition_pb2.ProduceRequest(items=[partition_pb2.ProduceItem(
        topic_partition=common_pb2.TopicPartition(topic=topic, partition=0),
        record_batch=old)]), timeout=30)
    assert not reply.results[0].error.reason
    with client.producer() as producer:
        producer.send(topic, b"new", partition=0).result(30)
    got = read_all(client, topic, 2)
    assert got.column("value").to_pylist() == [b"old", b"new"]
    assert got.column("headers").to_pylist()[0] == [{"key": "h", "value": b"1"}]


@pytest.mark.cluster
def test_send_batch_refuses_bad_input_and_sends_nothing(client):
    topic = new_topic(client, 1)
    with client.producer() as producer:
        with pytest.raises(errors.UnknownTopicOrPartition):
            producer.send_batch(topic, [b"a"], partition=5)
        with pytest.raises(ValueError):
            producer.send_batch(topic, [1, 2, 3])
        producer.flush()
    with client.consumer(topic) as consumer:
        assert consumer.end_offsets() == {(topic, 0): 0}


@pytest.mark.cluster
def test_pandas_and_polars_recipes(client):
    """docs/dataframes.md, as written there."""
    pandas = pytest.importorskip("pandas")
    polars = pytest.importorskip("polars")
    topic = new_topic(client, 1)
    frame = pandas.DataFrame({"key": [b"a", b"b"], "value": [b"1", b"2"]})
    with client.producer() as producer:
        producer.send_batch(topic, pa.Table.from_pandas(frame, preserve_index=False)).result(30)
    with client.consumer(topic) as consumer:
        table = consumer.poll_arrow(timeout_s=10)
    df = table.to_pandas()
    assert list(df["value"]) == [b"1", b"2"] and list(df["offset"]) == [0, 1]
    frame = polars.from_arrow(table)
    assert frame["key"].to_list() == [b"a", b"b"]
    latest = frame.filter(polars.col("offset") == frame["offset"].max())
    assert latest["value"].to_list() == [b"2"]
    with client.producer() as producer:  # polars' Arrow form (binary views) goes back in
        producer.send_batch(topic, frame.select("key", "value").to_arrow()).result(30)
    with client.consumer(topic) as consumer:
        again = pa.concat_tables(consumer.read_until(arrow=True, idle_timeout_s=30))
    assert again.column("value").to_pylist() == [b"1", b"2", b"1", b"2"]


def test_a_resend_goes_alone_and_a_new_identity_waits_for_the_old():
    """The sending rules of docs/clients.md (idempotence): a new batch goes only while
    fewer than 5 were sent since the oldest unfinished one (acknowledged batches behind
    it count: the servers' 5-batch window counts from it); a batch sent before goes
    again only once the batches ahead of it are answered, and nothing follows it until
    it is answered; after a new producer id, nothing goes under it until the old id's
    batches are answered."""
    from spark_client.producer import _Batch, _may_send, _PartitionState

    def batch(attempts: int = 0, done: bool = False) -> _Batch:
        return _Batch("t", 0, [], None, 0.0, attempts=attempts, done=done)

    def sent(count: int) -> list[_Batch]:
        out = [batch(attempts=1) for _ in range(count)]
        state.window.extend(out)
        state.in_flight.extend(out)
        return out

    state = _PartitionState()
    state.ready.extend([batch(), batch()])
    assert _may_send(state, 5)
    first = sent(4)
    assert _may_send(state, 5)
    sent(1)
    assert not _may_send(state, 5)  # five in flight
    # Four answered, the first one not: they still count (the server wrote them after it).
    del state.in_flight[1:]
    for b in list(state.window)[1:]:
        b.done = True
    assert not _may_send(state, 5)
    first[0].done = True  # answered: the window starts after it
    state.in_flight.clear()
    state.window.clear()
    assert _may_send(state, 5)
    # A resend waits for the batches ahead of it, then goes alone.
    ahead = sent(1)[0]
    state.ready.appendleft(batch(attempts=1))
    state.window.append(state.ready[0])
    assert not _may_send(state, 5)
    ahead.done = True
    state.in_flight.clear()
    state.window.popleft()
    assert _may_send(state, 5)
    resend = state.ready.popleft()
    resend.alone = True  # as _sendable marks a resend
    state.in_flight.append(resend)
    assert state.ready[0].attempts == 0 and not _may_send(state, 5)  # nothing follows it
    state.in_flight.clear()
    state.window.clear()
    assert _may_send(state, 5)
    # A new producer id: nothing goes under it while the old one's batches are unanswered.
    state.producer_id = 7
    old = sent(1)[0]
    old.producer_id = 7
    assert _may_send(state, 5)
    state.producer_id = 8
    assert not _may_send(state, 5)
    state.in_flight.clear()
    state.window.clear()
    assert _may_send(state, 5)
