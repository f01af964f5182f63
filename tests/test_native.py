"""The native core (partition_server/rust, loaded by partition_server/native.py) against
its reference, the Python functions of record_batch.py (record_batch.python_functions)
and record_columns.plain_block (record_columns.python_plain_block):
on generated batches, and on the same batches damaged (bytes changed, cut short, grown,
given as bytes, bytearray, memoryview of bytes or of signed chars, or Arrow buffer), each pair gives the same answer, or raises the
same error: the same type, and for AtomlogError the same reason, message and metadata
(for ValueError the same message; for struct.error, a field out of range for its place in
the header, the type only).

Also: the loader's modes and its refusal of a module built from other sources."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pyarrow
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partition_server import native
from partition_server import record_batch as rb
from partition_server import record_columns as rc
from partition_server.record_batch import Compression, Record
from services.errors import AtomlogError

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(native.core is None, reason=native.status())

PYTHON = rb.python_functions


@contextlib.contextmanager
def python_reference():
    """record_batch with its Python functions back in place for the block: the reference
    whole, its calls of its own functions (validate_batch's parse_header, say) included,
    as with ATOMLOG_NATIVE=off. (Loaded, the native core replaces them at every call.)"""
    loaded = {name: getattr(rb, name) for name in PYTHON}
    rb.__dict__.update(PYTHON)
    try:
        yield
    finally:
        rb.__dict__.update(loaded)


def reference(name: str, *args, **kwargs):
    """The Python reference's `name`, all in Python."""
    with python_reference():
        return PYTHON[name](*args, **kwargs)


def outcome(function, *args, **kwargs):
    """What a call gives: ("ok", answer) or ("raised", what the error says)."""
    try:
        answer = function(*args, **kwargs)
    except AtomlogError as error:
        return "raised", (AtomlogError, error.reason, error.message, error.metadata)
    except struct.error:  # a field out of its range: struct's own wording aside
        return "raised", (struct.error,)
    except ValueError as error:
        return "raised", (type(error), str(error))
    if isinstance(answer, tuple) and answer and isinstance(answer[-1], rb.BatchHeader):
        assert type(answer[-1]) is rb.BatchHeader  # the same type, not only equal fields
    if isinstance(answer, rb.BatchHeader):
        assert type(answer) is rb.BatchHeader
    return "ok", answer


def same(name: str, *args, **kwargs):
    """The native and the Python `name` agree on these arguments; returns the outcome."""
    expected = outcome(reference, name, *args, **kwargs)
    got = outcome(getattr(native.core, name), *args, **kwargs)
    assert got == expected, (name, args, kwargs)
    return got


records = st.lists(st.builds(Record, key=st.none() | st.binary(max_size=16),
                             value=st.none() | st.binary(max_size=64),
                             timestamp_ms=st.none() | st.integers(0, 2**41)),
                   min_size=1, max_size=5)
producers = st.none() | st.tuples(st.integers(1, 2**63 - 1), st.integers(0, 65535),
                                  st.integers(0, 2**31 - 10))
txns = st.none() | st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 2**64 - 1))


@st.composite
def batches(draw) -> bytes:
    """Batches encode_batch builds, all in Python (python_reference): row or columnar
    magic, every codec, with and without a producer and a transaction, markers too."""
    if draw(st.integers(0, 9)) == 0:
        marker = draw(st.sampled_from(list(rb.ControlType)))
        fields = dict(txn=draw(st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 2**64 - 1))),
                      coordinator_epoch=draw(st.integers(0, 2**64 - 1)),
                      timestamp_ms=draw(st.integers(0, 2**41)))
        with python_reference():
            return rb.encode_control_batch(marker, **fields)
    producer = draw(producers)
    fields = {} if producer is None else dict(zip(
        ("producer_id", "producer_epoch", "base_sequence"), producer))
    chosen, txn = draw(records), draw(txns)
    compression = draw(st.sampled_from(list(Compression)))
    with python_reference():
        batch = rb.encode_batch(chosen, txn=txn, timestamp_ms=1_700_000_000_000,
                                compression=compression, **fields)
    if draw(st.booleans()):  # the magic of a columnar batch: the server reads both alike
        batch = batch[:12] + bytes([rb.MAGIC_COLUMNAR]) + batch[13:]
    return batch


@st.composite
def damaged(draw, batch_strategy=batches()) -> bytes:
    """A batch, maybe damaged: header fields rewritten (CRC right or not), bytes flipped,
    cut short or grown."""
    batch = bytearray(draw(batch_strategy))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.integers(0, 4))
        if kind == 0 and batch:  # a byte anywhere
            position = draw(st.integers(0, len(batch) - 1))
            batch[position] = draw(st.integers(0, 255))
        elif kind == 1 and len(batch) >= rb.HEADER_SIZE:  # a field, the CRC made right
            name, offset, size, _ = draw(st.sampled_from(rb.HEADER_FIELDS))
            batch[offset:offset + size] = draw(st.binary(min_size=size, max_size=size))
            if name != "crc" and draw(st.booleans()):
                struct.pack_into(">I", batch, rb.CRC_OFFSET,
                                 rb.crc32c.crc32c(bytes(batch[rb.CRC_COVERED_FROM:])))
        elif kind == 2:  # cut short
            del batch[draw(st.integers(0, len(batch))):]
        elif kind == 3:  # grown
            batch += draw(st.binary(min_size=1, max_size=8))
    return bytes(batch)


def as_buffer(data: bytes, kind: str):
    if kind == "arrow":  # the columnar SDK frames Arrow's buffers
        return pyarrow.py_buffer(data)
    return {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(data),
            "signed": memoryview(data).cast("b")}[kind]


buffers = st.sampled_from(["bytes", "bytearray", "memoryview", "signed", "arrow"])


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=damaged(), kind=buffers, limit=st.none() | st.integers(0, 400),
       offset=st.integers(0, 3), padding=st.binary(max_size=3))
def test_parse_validate_and_verify_agree_on_whole_and_damaged_batches(batch, kind, limit,
                                                                       offset, padding):
    buffer = as_buffer(batch, kind)
    same("validate_batch", buffer)
    if limit is not None:
        same("validate_batch", buffer, max_batch_bytes=limit)
    shifted = as_buffer(padding[:offset].ljust(offset, b"\0") + batch, kind)
    header = same("parse_header", shifted, offset, max_batch_bytes=limit)
    same("parse_header", buffer)
    same("verify_crc", shifted, None, offset)
    if header[0] == "ok":
        same("verify_crc", shifted, header[1], offset)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=damaged(), kind=buffers,
       txn=st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)).map(
           lambda pair: rb.TxnId(*pair)))
def test_stamp_transaction_agrees(batch, kind, txn):
    """Stamped as StageTxn does: after validate_batch (whatever the header says then),
    and also with a header the batch does not have (the rules apply to what is given)."""
    try:
        header, valid = reference("validate_batch", batch), True
    except AtomlogError:
        if len(batch) < rb.HEADER_SIZE:
            return
        header, valid = rb.BatchHeader._make(rb.HEADER.unpack_from(batch)), False
    result = same("stamp_transaction", as_buffer(batch, kind), header, txn)
    if result[0] == "ok" and valid:
        stamped, stamped_header = result[1]
        assert reference("validate_batch", stamped) == stamped_header


frame_arguments = st.fixed_dictionaries({
    "magic": st.sampled_from([rb.MAGIC, rb.MAGIC_COLUMNAR, 0, 3, 200]),
    "count": st.integers(-2, 5) | st.integers(2**31 - 2, 2**31 + 1),
    "base_timestamp_ms": st.integers(-1, 2**41),
    "max_timestamp_ms": st.integers(-1, 2**41),
}, optional={
    "compression": st.sampled_from([*Compression, 0, 2, 3, -1]),
    "producer_id": st.integers(-1, 2**63 - 1),
    "producer_epoch": st.integers(-1, 65536),
    "base_sequence": st.integers(-2, 2**31),
    "txn": st.none() | st.tuples(st.integers(0, 2**32), st.integers(0, 2**64 - 1))
    | st.tuples(st.integers(0, 3), st.integers(0, 3)).map(lambda pair: rb.TxnId(*pair)),
    # flags as Python reads them: by truthiness
    "transactional": st.none() | st.booleans() | st.integers(0, 2),
    "control": st.booleans() | st.integers(0, 2),
})


@settings(max_examples=1500, deadline=None)
@given(body=st.binary(max_size=40), kind=buffers, arguments=frame_arguments)
def test_frame_batch_parsed_agrees_on_right_and_wrong_arguments(body, kind, arguments):
    result = same("frame_batch_parsed", as_buffer(body, kind), **arguments)
    if result[0] == "ok":
        batch, header = result[1]
        assert reference("validate_batch", batch) == header


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group=st.lists(st.tuples(batches(), buffers), max_size=4),
       next_offset=st.integers(0, 2**62), now=st.integers(-1, 2**42))
def test_stamp_for_log_writes_the_same_bytes_and_headers(group, next_offset, now):
    """What a log writes for a group: the same bytes (Python gives them as pieces, the
    native core as one buffer), the same stamped headers, the same next offset."""
    items = [(as_buffer(batch, kind), reference("validate_batch", batch)) for batch, kind in group]
    expected = reference("stamp_for_log", items, next_offset, now)
    got = native.core.stamp_for_log(items, next_offset, now)
    assert b"".join(got[0]) == b"".join(expected[0])
    assert len(got[0]) == min(len(items), 1)
    assert got[1:] == expected[1:]
    assert all(type(header) is rb.BatchHeader for header in got[1])
    assert [header for _, header in rb.iter_batches(b"".join(got[0]), verify=True)] == got[1]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group=st.lists(st.tuples(batches(), buffers, st.integers(0, 15).map(lambda n: n == 0)),
                     max_size=5),
       next_offset=st.integers(0, 2**40), now=st.integers(0, 2**42),
       max_batch_bytes=st.sampled_from([300, 1 << 20, 1 << 20]),
       size=st.integers(0, 4000), age=st.none() | st.integers(0, 3000),
       span=st.sampled_from([0, 5, 5, 5, 2**32 - 3, 2**32 + 1]),
       segment_bytes=st.integers(1, 20000), segment_ms=st.integers(1, 12000),
       interval_bytes=st.integers(1, 3000), indexed=st.none() | st.integers(0, 4000),
       running_max_ts=st.sampled_from([rb.INT64_MIN, 0, 2**40]))
def test_plan_log_append_agrees(group, next_offset, now, max_batch_bytes, size, age, span,
                                segment_bytes, segment_ms, interval_bytes, indexed,
                                running_max_ts):
    """A log's append planned: the same refusal (a header not its batch's size, a batch
    over the limit), the same "rolls" (None: by size, by age, by the offsets a segment
    spans), or the same bytes, stamped headers, batch starts, index entries and segment
    facts."""
    items = []
    for batch, kind, mismatched in group:
        header = reference("validate_batch", batch)
        if mismatched:  # another size than its batch's
            header = header._replace(batch_length=header.batch_length + 1)
        items.append((as_buffer(batch, kind), header))
    arguments = (items, next_offset, now, max_batch_bytes, size,
                 None if age is None else now - age, max(next_offset - span, 0),
                 segment_bytes, segment_ms, interval_bytes,
                 None if indexed is None else min(indexed, size), running_max_ts)
    expected = outcome(reference, "plan_log_append", *arguments)
    got = outcome(native.core.plan_log_append, *arguments)
    if expected[0] == "ok" and expected[1] is not None and got[0] == "ok" and got[1]:
        assert b"".join(got[1][0]) == b"".join(expected[1][0])
        assert len(got[1][0]) == min(len(items), 1)
        assert all(type(header) is rb.BatchHeader for header in got[1][1])
        got, expected = got[1][1:], expected[1][1:]
    assert got == expected


column_items = st.one_of(
    st.none(), st.binary(max_size=40), st.binary(max_size=40).map(bytearray),
    st.binary(max_size=40).map(memoryview),
    st.binary(max_size=40).map(lambda data: memoryview(data).cast("b")),
    st.binary(min_size=4, max_size=4).map(lambda data: memoryview(data).cast("i")),
    st.text(max_size=3), st.integers(0, 3))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(column_items, column_items,
                               st.sampled_from([(), (), (), None, (("h", b"v"),)]),
                               st.integers(-2**40, 2**40)), min_size=1, max_size=12),
       equal=st.booleans())
def test_plain_block_writes_the_same_block(rows, equal):
    """A small batch's records block written without pyarrow: the same bytes, or the same
    None (headers; a key or value neither bytes-like nor None, or a buffer whose len()
    is not its size), for nulls, empty and filled items of every bytes-like kind."""
    records = [Record(key=key, value=value, headers=headers, timestamp_ms=stamp)
               for key, value, headers, stamp in rows]
    stamps = [rows[0][3] if equal else stamp for *_, stamp in rows]
    expected = outcome(rc.python_plain_block, records, stamps)
    assert outcome(native.core.plain_block, records, stamps) == expected
    if expected == ("ok", None) and all(
            isinstance(item, (bytes, type(None))) for key, value, headers, _ in rows
            for item in (key, value)) and not any(headers for *_, headers, _ in rows):
        raise AssertionError("plain bytes and no headers were refused")


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(column_items, column_items,
                               st.sampled_from([(), (), (), None, (("h", b"v"),)]),
                               st.one_of(st.integers(-2**20, 2**20),
                                         st.integers(-2**63, 2**63 - 1),
                                         st.integers(-2**70, 2**70))),
                     max_size=12),
       extra=st.integers(-2, 2))
def test_row_block_writes_the_same_block(rows, extra):
    """The __txn_log's batches' records block (row format): the same bytes, or the same
    None (headers; a key or value neither bytes nor None; a delta beyond 64 bits), or the
    same ValueError when there are more or fewer deltas than records."""
    records = [Record(key=key, value=value, headers=headers, timestamp_ms=None)
               for key, value, headers, _ in rows]
    deltas = [delta for *_, delta in rows]
    deltas = deltas[:len(deltas) + extra] if extra < 0 else deltas + [0] * extra
    expected = same("row_block", records, deltas)
    if expected[0] == "ok" and expected[1] is not None:
        # What encode_batch made of them before, record by record.
        pieces: list = []
        for index, (record, delta) in enumerate(zip(records, deltas)):
            rb._encode_record(pieces, record, delta, index)
        assert expected[1] == b"".join(pieces)
    elif expected == ("ok", None) and all(
            type(item) is bytes or item is None for key, value, *_ in rows
            for item in (key, value)) and not any(headers for *_, headers, _ in rows) and \
            all(-2**63 <= delta < 2**63 for delta in deltas):
        raise AssertionError("plain bytes and no headers were refused")


def test_encode_batch_writes_what_it_wrote_record_by_record():
    """encode_batch's block through row_block (native or not), and the records with
    headers still one by one: every batch decodes to its records."""
    records = [Record(b"k", b"v" * 300), Record(None, None), Record(b"", b"x", (("h", b"1"),)),
               Record(b"key", b"value", timestamp_ms=5)]
    for batch_records in (records[:2], records, records[3:]):
        batch = rb.encode_batch(batch_records, timestamp_ms=1_000)
        decoded = rb.decode_records(batch)
        assert [(r.key, r.value, tuple(r.headers or ())) for r in decoded] == [
            (r.key, r.value, tuple(r.headers or ())) for r in batch_records]
        assert [r.timestamp_ms for r in decoded] == [
            1_000 if r.timestamp_ms is None else r.timestamp_ms for r in batch_records]


def test_record_columns_serves_the_native_plain_block_when_loaded():
    assert rc.plain_block is native.core.plain_block
    assert rc.python_plain_block is not native.core.plain_block


def test_record_batch_serves_the_native_functions_when_loaded():
    for name, function in PYTHON.items():
        assert getattr(rb, name) is getattr(native.core, name), name
    assert native.status() == "native"


def test_a_header_comes_back_as_a_batch_header_with_its_properties():
    batch = rb.encode_batch([Record(b"k", b"v")] * 3, producer_id=5, base_sequence=7,
                            txn=(3, 4), timestamp_ms=10)
    header = native.core.validate_batch(batch)
    assert type(header) is rb.BatchHeader
    assert (header.size, header.last_sequence, header.txn) == (len(batch), 9, (3, 4))
    assert header._replace(base_offset=1).base_offset == 1


def _python(code: str, **environment) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **environment})


def test_atomlog_native_off_serves_the_python_functions():
    run = _python("from partition_server import native, record_batch as rb\n"
                  "print(native.status(), rb.parse_header is rb.python_functions['parse_header'])",
                  ATOMLOG_NATIVE="off")
    assert run.stdout.split() == ["python", "(ATOMLOG_NATIVE=off)", "True"], run.stderr


def test_an_unknown_mode_is_refused_by_name():
    run = _python("import partition_server.record_batch", ATOMLOG_NATIVE="fast")
    assert run.returncode != 0
    assert "ATOMLOG_NATIVE='fast': expected one of auto, require, off" in run.stderr


def test_a_module_built_from_other_sources_is_not_used(tmp_path, monkeypatch):
    """A stale build (the crate edited since; the module carries the digest of the
    sources it was built from): `auto` falls back to Python and says why, `require`
    refuses to start. So do unreadable sources."""
    assert native.core.SOURCES_DIGEST == native.sources_digest()
    monkeypatch.setattr(native, "sources_digest", lambda: "0" * 64)  # the crate edited
    for mode, expected in (("auto", "python (the native core is not current: "),
                           ("require", None)):
        monkeypatch.setenv("ATOMLOG_NATIVE", mode)
        if expected is None:
            with pytest.raises(ImportError, match="ATOMLOG_NATIVE=require: the native core "
                                                  "is not current: it was built from other"):
                native._load()
        else:
            core, status = native._load()
            assert core is None and status.startswith(expected)
    monkeypatch.undo()
    (tmp_path / "Cargo.toml").write_text("")  # a crate without its lock file and sources
    monkeypatch.setattr(native, "CRATE", tmp_path)
    monkeypatch.setenv("ATOMLOG_NATIVE", "auto")
    assert "the crate's sources cannot be read" in native._load()[1]
    monkeypatch.undo()
    assert native._load() == (native.core, "native")
