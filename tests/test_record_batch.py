"""The record batch format: round trips, the header patch, and that every kind of damage
is refused with the right reason (CORRUPT_BATCH, CRC_MISMATCH, BATCH_TOO_LARGE).

Every test runs twice: with the native core's functions in record_batch (as servers run)
and with the Python reference's (record_batch.python_functions)."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partition_server import record_batch as rb
from partition_server import native
from partition_server.record_batch import (HEADER, HEADER_SIZE, BatchHeader, Compression,
                                           ControlType, Record, TxnId, decode_control_batch,
                                           decode_records, encode_batch, encode_control_batch,
                                           iter_batches, txn_key, with_base_offset)
from services.errors import AtomlogError


@pytest.fixture(autouse=True, params=["native", "python"])
def implementation(request, monkeypatch):
    """record_batch's functions that have a native copy: the native ones (as loaded), or
    the Python reference's put back for the test (record_batch's own callers, such as
    encode_batch, look them up at each call, so they follow)."""
    if request.param == "native":
        if native.core is None:
            pytest.skip(native.status())
    else:
        for name, function in rb.python_functions.items():
            monkeypatch.setattr(rb, name, function)
    return request.param


# The functions under test, as record_batch holds them at the call (see `implementation`).
def parse_header(*args, **kwargs):
    return rb.parse_header(*args, **kwargs)


def validate_batch(*args, **kwargs):
    return rb.validate_batch(*args, **kwargs)


def verify_crc(*args, **kwargs):
    return rb.verify_crc(*args, **kwargs)

DOC = Path(__file__).resolve().parent.parent / "docs" / "record-format.md"


def reason_of(call) -> str:
    with pytest.raises(AtomlogError) as info:
        call()
    return info.value.reason


def forge(batch: bytes, **changes) -> bytes:
    """The batch with header fields changed and the CRC recomputed (a well-signed lie)."""
    fields = parse_header(batch)._replace(**changes)
    out = bytearray(HEADER.pack(*fields) + batch[HEADER_SIZE:])
    struct.pack_into(">I", out, rb.CRC_OFFSET, crc32c.crc32c(memoryview(out)[rb.CRC_COVERED_FROM:]))
    return bytes(out)


def sample(**kwargs) -> bytes:
    records = [Record(b"key-1", b"value-1", (("trace", b"abc"),), timestamp_ms=1_000),
               Record(None, b"v2", timestamp_ms=1_005), Record(b"k3", None, timestamp_ms=990)]
    kwargs.setdefault("timestamp_ms", 1_000)
    return encode_batch(records, **kwargs)


# --- Layout -----------------------------------------------------------------------------

def test_header_layout_is_77_bytes_with_fields_where_the_table_says():
    assert HEADER_SIZE == 77 and rb.PREFIX_SIZE == rb.CRC_OFFSET == 21
    assert rb.CRC_COVERED_FROM == 25
    expected_offset = 0
    for name, offset, size, _ in rb.HEADER_FIELDS:
        assert offset == expected_offset, name
        expected_offset += size
    assert expected_offset == HEADER_SIZE
    assert [f[0] for f in rb.HEADER_FIELDS] == list(BatchHeader._fields)
    batch = sample(producer_id=7, producer_epoch=3, base_sequence=11, txn=(5, 9))
    header = parse_header(batch)
    for name, offset, size, kind in rb.HEADER_FIELDS:
        code = {"int8": "b", "int16": "h", "int32": "i", "int64": "q", "uint16": "H",
                "uint32": "I", "uint64": "Q"}[kind]
        (value,) = struct.unpack_from(">" + code, batch, offset)
        assert value == getattr(header, name), name
        assert struct.calcsize(code) == size


def test_doc_header_table_matches_the_code():
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\w+)\s*\|\s*`(\w+)`", DOC.read_text(), re.M)
    table = [(name, int(offset), int(size), kind) for offset, size, kind, name in rows]
    assert table[:len(rb.HEADER_FIELDS)] == list(rb.HEADER_FIELDS)


def test_encode_fills_the_header():
    batch = sample(producer_id=7, producer_epoch=65535, base_sequence=11, txn=TxnId(5, 9),
                   compression=Compression.ZSTD)
    header = validate_batch(batch)
    assert (header.base_offset, header.log_append_time_ms, header.magic) == (0, -1, 1)
    assert (header.record_count, header.last_offset_delta) == (3, 2)
    assert (header.base_timestamp_ms, header.max_timestamp_ms) == (1_000, 1_005)
    assert (header.producer_id, header.producer_epoch, header.base_sequence) == (7, 65535, 11)
    assert header.txn == TxnId(5, 9) and header.is_transactional and not header.is_control
    assert header.compression is Compression.ZSTD and header.size == len(batch)
    assert header.last_sequence == 13


# --- Round trips --------------------------------------------------------------------------

header_names = st.text(max_size=20)
records_strategy = st.lists(
    st.builds(Record,
              key=st.none() | st.binary(max_size=64),
              value=st.none() | st.binary(max_size=300),
              headers=st.lists(st.tuples(header_names, st.binary(max_size=20)), max_size=3).map(tuple),
              timestamp_ms=st.none() | st.integers(-2**40, 2**42)),
    min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(records=records_strategy, compression=st.sampled_from(list(Compression)),
       producer=st.none() | st.tuples(st.integers(1, 2**63 - 1), st.integers(0, 65535),
                                      st.integers(0, 2**31 - 100)),
       txn=st.none() | st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 2**64 - 1)),
       base_offset=st.integers(0, 2**62), default_ts=st.integers(0, 2**42))
def test_round_trip(records, compression, producer, txn, base_offset, default_ts):
    producer_id, epoch, sequence = producer or (0, 0, -1)
    batch = encode_batch(records, producer_id=producer_id, producer_epoch=epoch,
                         base_sequence=sequence, txn=txn, compression=compression,
                         timestamp_ms=default_ts)
    stored = with_base_offset(batch, base_offset, log_append_time_ms=123)
    header = validate_batch(stored, max_batch_bytes=1 << 30)
    assert header.base_offset == base_offset and header.log_append_time_ms == 123
    decoded = decode_records(stored)
    timestamps = [default_ts if r.timestamp_ms is None else r.timestamp_ms for r in records]
    assert decoded == [Record(r.key, r.value, r.headers, ts, base_offset + i)
                       for i, (r, ts) in enumerate(zip(records, timestamps))]
    assert header.max_timestamp_ms == max(timestamps)
    assert header.base_timestamp_ms == timestamps[0]


def test_with_base_offset_keeps_the_crc_valid_and_changes_only_the_prefix():
    batch = sample()
    patched = with_base_offset(batch, 2**40 + 5)
    assert patched[rb.PREFIX_SIZE:] == batch[rb.PREFIX_SIZE:]
    verify_crc(patched)
    assert parse_header(patched).base_offset == 2**40 + 5
    assert parse_header(patched).log_append_time_ms == -1
    assert [r.offset for r in decode_records(patched)] == [2**40 + 5, 2**40 + 6, 2**40 + 7]


def test_control_batch_round_trip():
    batch = encode_control_batch(ControlType.ABORT, txn=(3, 44), coordinator_epoch=2**40,
                                 timestamp_ms=77)
    header = validate_batch(batch)
    assert header.is_control and header.is_transactional and header.record_count == 1
    assert header.txn == (3, 44) and header.producer_id == 0
    assert decode_control_batch(batch) == rb.ControlMarker(ControlType.ABORT, 2**40)
    (record,) = decode_records(batch)
    assert record.key == b"\x00\x00\x00\x00"  # version 0, type ABORT
    assert record.value == b"\x00\x00" + (2**40).to_bytes(8, "big")
    assert reason_of(lambda: decode_control_batch(sample())) == "CORRUPT_BATCH"


def test_built_and_stamped_batches_come_with_the_header_parse_header_reads():
    """The server writes a marker and a staged batch with the header handed back by
    control_batch_parsed and stamp_transaction, without parsing them again: it must be
    the header of the bytes, field for field."""
    for epoch in (0, 2**40):
        batch, header = rb.control_batch_parsed(ControlType.COMMIT, txn=(5, 2**33),
                                                coordinator_epoch=epoch, timestamp_ms=77,
                                                producer_id=9, producer_epoch=3)
        assert header == parse_header(batch)
        assert batch == encode_control_batch(ControlType.COMMIT, txn=(5, 2**33),
                                             coordinator_epoch=epoch, timestamp_ms=77,
                                             producer_id=9, producer_epoch=3)
    for compression in (Compression.NONE, Compression.ZSTD):
        raw = sample(compression=compression)
        for txn in (rb.TxnId(0, 1), rb.TxnId(15, 2**63 + 7)):
            stamped, header = rb.stamp_transaction(raw, parse_header(raw), txn)
            assert header == validate_batch(stamped)  # the CRC too
            assert header.txn == tuple(txn) and header.is_transactional
            assert stamped[rb.CRC_COVERED_FROM:] != raw[rb.CRC_COVERED_FROM:]
    # A transaction id the rules refuse (none at all) is refused as a reparse refused it.
    assert reason_of(lambda: rb.stamp_transaction(raw, parse_header(raw), rb.TxnId(0, 0))) \
        == "CORRUPT_BATCH"


def test_iter_batches_walks_concatenated_batches():
    batches = [with_base_offset(sample(), 3 * i) for i in range(4)]
    joined = b"".join(batches)
    walked = list(iter_batches(joined, verify=True))
    assert [p for p, _ in walked] == [sum(map(len, batches[:i])) for i in range(4)]
    assert [h.base_offset for _, h in walked] == [0, 3, 6, 9]
    assert list(iter_batches(b"")) == []
    for cut in range(1, len(batches[-1])):
        assert reason_of(lambda: list(iter_batches(joined[:-cut]))) == "CORRUPT_BATCH"
    flipped = bytearray(joined)
    flipped[len(batches[0]) + 100] ^= 1
    assert reason_of(lambda: list(iter_batches(bytes(flipped), verify=True))) == "CRC_MISMATCH"
    assert len(list(iter_batches(bytes(flipped)))) == 4  # headers only: nothing checked
    assert reason_of(lambda: list(iter_batches(joined, max_batch_bytes=len(batches[0]) - 1))) \
        == "BATCH_TOO_LARGE"


# --- Damage -------------------------------------------------------------------------------

@pytest.mark.parametrize("compression", list(Compression))
def test_every_truncation_is_corrupt(compression):
    batch = sample(compression=compression)
    for length in range(len(batch)):
        assert reason_of(lambda: validate_batch(batch[:length])) == "CORRUPT_BATCH", length
        assert reason_of(lambda: decode_records(batch[:length])) == "CORRUPT_BATCH", length


def test_trailing_bytes_are_corrupt():
    assert reason_of(lambda: validate_batch(sample() + b"\x00")) == "CORRUPT_BATCH"


@pytest.mark.parametrize("compression", list(Compression))
def test_every_bit_flip_is_refused_or_outside_the_crc(compression):
    batch = sample(compression=compression, producer_id=9, base_sequence=0)
    for position in range(len(batch)):
        for bit in range(8):
            damaged = bytearray(batch)
            damaged[position] ^= 1 << bit
            damaged = bytes(damaged)
            field = next(name for name, offset, size, _ in rb.HEADER_FIELDS
                         if offset <= position < offset + size) if position < HEADER_SIZE else "body"
            if field in ("base_offset", "log_append_time_ms"):
                # Not covered by the CRC: the server overwrites both. Only a negative base
                # offset is refused.
                if position == 0 and bit == 7:
                    assert reason_of(lambda: validate_batch(damaged)) == "CORRUPT_BATCH"
                else:
                    validate_batch(damaged)
                continue
            reason = reason_of(lambda: validate_batch(damaged))
            try:
                parse_header(damaged)
                structurally_fine = parse_header(damaged).size == len(damaged)
            except AtomlogError:
                structurally_fine = False
            expected = "CRC_MISMATCH" if structurally_fine else "CORRUPT_BATCH"
            assert reason == expected, (field, position, bit, reason)
            if field in ("crc", "body", "attributes", "record_count", "producer_id"):
                assert reason in ("CRC_MISMATCH", "CORRUPT_BATCH")


def test_crc_mismatch_names_both_values():
    damaged = bytearray(sample())
    damaged[-1] ^= 0xFF
    with pytest.raises(AtomlogError) as info:
        validate_batch(bytes(damaged))
    assert info.value.reason == "CRC_MISMATCH"
    assert "stored 0x" in info.value.message and "computed 0x" in info.value.message


@pytest.mark.parametrize("changes, words", [
    ({"magic": 3}, "magic"),
    ({"magic": 0}, "magic"),
    ({"record_count": 0, "last_offset_delta": -1}, "record_count"),
    ({"last_offset_delta": 5}, "last_offset_delta"),
    ({"record_count": 4}, "last_offset_delta"),
    ({"attributes": 3}, "compression"),
    ({"attributes": 0x0008}, "attribute"),
    ({"attributes": -0x8000}, "attribute"),
    ({"attributes": rb.ATTR_TRANSACTIONAL}, "transaction"),
    ({"attributes": rb.ATTR_CONTROL}, "control"),
    ({"txn_tc_partition": 1}, "transaction"),
    ({"max_timestamp_ms": 0}, "max_timestamp_ms"),
    ({"producer_id": -1}, "producer_id"),
    ({"base_sequence": 3}, "producer_id"),
    ({"producer_epoch": 1}, "producer_id"),
    ({"batch_length": 64}, "batch_length"),
])
def test_inconsistent_headers_are_corrupt(changes, words):
    damaged = forge(sample(), **changes)
    with pytest.raises(AtomlogError) as info:
        validate_batch(damaged)
    assert info.value.reason == "CORRUPT_BATCH"
    assert words in info.value.message


def test_wrong_record_count_is_caught_when_decoding():
    batch = sample()  # 3 records
    for count in (2, 4):
        forged = forge(batch, record_count=count, last_offset_delta=count - 1)
        validate_batch(forged)  # the server cannot know: it never reads records
        assert reason_of(lambda: decode_records(forged)) == "CORRUPT_BATCH"


def test_control_batch_rules():
    marker = encode_control_batch(ControlType.COMMIT, txn=(1, 1), coordinator_epoch=1,
                                  timestamp_ms=0)
    assert "control" in _message(lambda: validate_batch(
        forge(sample(txn=(1, 1)), attributes=rb.ATTR_CONTROL | rb.ATTR_TRANSACTIONAL)))
    assert "control" in _message(lambda: validate_batch(
        forge(marker, attributes=rb.ATTR_CONTROL | rb.ATTR_TRANSACTIONAL | 1)))


def _message(call) -> str:
    with pytest.raises(AtomlogError) as info:
        call()
    return info.value.message


def test_batch_too_large():
    batch = sample()
    assert validate_batch(batch, max_batch_bytes=len(batch)) == parse_header(batch)
    with pytest.raises(AtomlogError) as info:
        validate_batch(batch, max_batch_bytes=len(batch) - 1)
    assert info.value.reason == "BATCH_TOO_LARGE"
    assert info.value.metadata["limit"] == str(len(batch) - 1)
    assert reason_of(lambda: parse_header(batch, max_batch_bytes=100)) == "BATCH_TOO_LARGE"


def test_garbage_compressed_blocks_are_corrupt():
    for compression in (Compression.ZSTD, Compression.LZ4):
        batch = sample(compression=compression)
        garbage = batch[:HEADER_SIZE] + b"\x00" * 40
        forged = forge(garbage, batch_length=len(garbage) - 12)
        validate_batch(forged)
        assert reason_of(lambda: decode_records(forged)) == "CORRUPT_BATCH"


def test_decompression_limit():
    for compression in (Compression.ZSTD, Compression.LZ4):
        batch = encode_batch([Record(value=bytes(1 << 20))], compression=compression,
                             timestamp_ms=0)
        assert len(batch) < 10_000
        assert len(decode_records(batch)[0].value) == 1 << 20
        assert reason_of(lambda: decode_records(batch, max_uncompressed_bytes=1 << 19)) \
            == "CORRUPT_BATCH"


def test_varint_edge_cases_decode():
    records = [Record(b"", b"", timestamp_ms=t) for t in (0, -1, 2**62, -(2**62))]
    batch = encode_batch(records, timestamp_ms=0)
    assert [r.timestamp_ms for r in decode_records(batch)] == [0, -1, 2**62, -(2**62)]


@pytest.mark.parametrize("kwargs", [
    {"txn": (0, 0)},
    {"transactional": True},
    {"base_sequence": 0},
    {"producer_epoch": 1},
    {"producer_id": 1, "producer_epoch": 65536, "base_sequence": 0},
])
def test_encode_refuses_inconsistent_arguments(kwargs):
    with pytest.raises(ValueError):
        encode_batch([Record(value=b"x")], timestamp_ms=0, **kwargs)
    with pytest.raises(ValueError):
        encode_batch([], timestamp_ms=0)


def test_a_txn_id_as_one_int_is_one_to_one_over_the_whole_range():
    ids = [TxnId(0, 1), TxnId(1, 0), TxnId(7, 12345), TxnId((1 << 32) - 1, (1 << 64) - 1),
           TxnId((1 << 32) - 1, 0), TxnId(0, (1 << 64) - 1), TxnId(1, 1)]
    keys = [txn_key(txn) for txn in ids]
    assert [(key >> 64, key & ((1 << 64) - 1)) for key in keys] == ids
    assert len(set(keys)) == len(ids)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.integers(0, 1 << 14), st.integers(0, (1 << 64) - 1)))
def test_uvarint_is_protobufs_varint_and_reads_back(n):
    """One encoder for the record format's unsigned varints and the wire splices' tags
    and lengths (replicate_wire, read_wire, the SDK's hand-built Produce requests)."""
    from google.protobuf.internal.encoder import _VarintBytes

    encoded = rb.uvarint(n)
    assert encoded == _VarintBytes(n)
    assert rb._get_uvarint(encoded, 0, len(encoded)) == (n, len(encoded))


def test_uvarint_refuses_a_negative_number():
    with pytest.raises(ValueError):
        rb.uvarint(-1)
