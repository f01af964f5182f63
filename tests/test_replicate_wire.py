"""The spliced answers of Replicate and ReplicateMany (partition_server/replicate_wire.py)
against the generated protobuf classes: the same bytes out, the same messages in. Pure,
but for the last test (a loopback gRPC server in this process)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atomlog.v1 import partition_pb2
from partition_server.replicate_wire import (ReplicateAnswer, ReplicateItem,
                                             ReplicateManyAnswer, WireError, parse_answer,
                                             parse_many, serialize_answer, serialize_many)


def _response(records: bytes = b"", **fields) -> partition_pb2.ReplicateResponse:
    return partition_pb2.ReplicateResponse(records=records, **fields)


def _split(response: partition_pb2.ReplicateResponse) -> ReplicateAnswer:
    message = partition_pb2.ReplicateResponse()
    message.CopyFrom(response)
    message.ClearField("records")
    return ReplicateAnswer(message, response.records)


def _split_many(whole: partition_pb2.ReplicateManyResponse) -> ReplicateManyAnswer:
    items = []
    for result in whole.results:
        head = partition_pb2.ReplicateResult()
        head.CopyFrom(result)
        head.ClearField("response")
        items.append(ReplicateItem(head, _split(result.response)
                                   if result.HasField("response") else None))
    return ReplicateManyAnswer(items)


def _result(topic: str, partition: int, response=None, reason: str = ""):
    result = partition_pb2.ReplicateResult()
    result.topic_partition.topic, result.topic_partition.partition = topic, partition
    if reason:
        result.error.reason = reason
        result.error.message = f"{reason} for {topic}-{partition}"
        result.error.metadata["owner"] = "ps-1"
    if response is not None:
        result.response.CopyFrom(response)
    return result


FULL = _response(b"\x00" * 70 + bytes(range(256)) * 3, high_watermark=12, log_start_offset=3,
                 log_end_offset=40,
                 epochs=[partition_pb2.LeaderEpochEntry(epoch=2, start_offset=5),
                         partition_pb2.LeaderEpochEntry(epoch=4, start_offset=30)],
                 cursors_available=True, cursor_snapshot=b"snap", cursor_first_sequence=9,
                 cursor_frames=b"frames" * 40, cursor_durable_end=11)
DIVERGING = _response(high_watermark=7, log_start_offset=0, log_end_offset=9, diverging=True,
                      diverging_epoch=3, diverging_end_offset=6)
MANY = partition_pb2.ReplicateManyResponse(results=[
    _result("orders", 0, FULL),
    _result("orders", 1, reason="NOT_PARTITION_OWNER"),
    _result("__txn_log", 15, DIVERGING),
    _result("empty", 2, partition_pb2.ReplicateResponse()),  # present, every field default
    _result("big", 3, _response(b"x" * (1 << 20) + b"y", high_watermark=1 << 40)),
])


# ------------------------------------------------------------------ serializing

@pytest.mark.parametrize("response", [FULL, DIVERGING, partition_pb2.ReplicateResponse(),
                                      _response(b"r"), _response(b"r" * 300)],
                         ids=["full", "diverging", "empty", "one byte", "two-byte length"])
def test_an_answer_serializes_as_the_generated_message_does(response):
    assert serialize_answer(_split(response)) == response.SerializeToString()
    assert serialize_answer(response) == response.SerializeToString()  # passed through


def test_many_results_serialize_as_the_generated_message_does():
    assert serialize_many(_split_many(MANY)) == MANY.SerializeToString()
    assert serialize_many(ReplicateManyAnswer()) == b""
    assert serialize_many(MANY) == MANY.SerializeToString()  # passed through


def test_records_may_be_any_buffer_and_are_spliced_whole():
    records = bytearray(b"abc" * 1000)
    answer = ReplicateAnswer(partition_pb2.ReplicateResponse(high_watermark=3),
                             memoryview(records)[3:])
    assert serialize_answer(answer) == _response(bytes(records[3:]),
                                                 high_watermark=3).SerializeToString()


def test_a_message_that_still_carries_records_is_refused():
    with pytest.raises(ValueError, match="must not carry records"):
        serialize_answer(ReplicateAnswer(_response(b"r"), b"s"))
    with pytest.raises(ValueError, match="must not carry its response"):
        serialize_many(ReplicateManyAnswer([ReplicateItem(_result("t", 0, FULL))]))


# ------------------------------------------------------------------ parsing

def test_parsing_keeps_records_as_a_slice_of_the_received_bytes():
    wire = MANY.SerializeToString()
    parsed = parse_many(wire)
    assert parsed.to_message() == MANY
    records = parsed.results[0].response.records
    assert isinstance(records, memoryview) and records.obj is wire
    assert bytes(records) == FULL.records
    # The other fields read as the generated message's, through the answer.
    first = parsed.results[0].response
    assert (first.high_watermark, first.cursor_frames, list(first.epochs)) == \
        (12, FULL.cursor_frames, list(FULL.epochs))
    assert parsed.results[1].error.reason == "NOT_PARTITION_OWNER"
    assert parsed.results[1].response is None
    assert parsed.results[2].topic_partition.topic == "__txn_log"
    assert parsed.results[2].response.diverging and not parsed.results[2].response.records
    assert parsed.results[3].response is not None  # present though empty
    assert parse_answer(FULL.SerializeToString()).to_message() == FULL


def test_empty_input_is_an_empty_answer():
    assert parse_many(b"").results == []
    assert parse_answer(b"").to_message() == partition_pb2.ReplicateResponse()


def _unknown(number: int) -> bytes:
    """Unknown fields of every wire type, field `number` (< 16: one-byte keys; a group
    included)."""
    varint = bytes([number << 3 | 0]) + b"\x96\x01"
    fixed64 = bytes([number << 3 | 1]) + b"12345678"
    delimited = bytes([number << 3 | 2]) + b"\x03abc"
    group = bytes([number << 3 | 3]) + b"\x08\x01" + bytes([number << 3 | 4])
    fixed32 = bytes([number << 3 | 5]) + b"1234"
    return varint + fixed64 + delimited + group + fixed32


def test_unknown_fields_at_every_level_are_kept_as_the_generated_parser_keeps_them():
    response = FULL.SerializeToString() + _unknown(14)
    result = (_result("t", 0).SerializeToString() + _unknown(15)
              + b"\x1a" + bytes([len(response) & 0x7F | 0x80, len(response) >> 7]) + response)
    wire = (b"\x0a" + bytes([len(result) & 0x7F | 0x80, len(result) >> 7]) + result
            + _unknown(14))
    expected = partition_pb2.ReplicateManyResponse.FromString(wire)
    parsed = parse_many(wire)
    assert parsed.to_message() == expected
    assert parsed.to_message().SerializeToString() == expected.SerializeToString()
    assert bytes(parsed.results[0].response.records) == FULL.records
    # Serialized again, they parse back to the same message.
    assert partition_pb2.ReplicateManyResponse.FromString(serialize_many(parsed)) == expected


def test_repeated_fields_merge_as_the_generated_parser_merges_them():
    """A singular field given twice: the last wins; a message field given twice (a
    response in two pieces): the pieces merge."""
    one = _response(b"first", high_watermark=1).SerializeToString()
    two = _response(b"second", log_end_offset=5).SerializeToString()
    wire = b"\x0a" + bytes([2 + 2 + len(one) + len(two)]) + \
        b"\x1a" + bytes([len(one)]) + one + b"\x1a" + bytes([len(two)]) + two
    expected = partition_pb2.ReplicateManyResponse.FromString(wire)
    assert expected.results[0].response.records == b"second"
    assert parse_many(wire).to_message() == expected
    records_twice = _response(b"a").SerializeToString() + _response(b"bb").SerializeToString()
    assert parse_answer(records_twice).to_message() == \
        partition_pb2.ReplicateResponse.FromString(records_twice)


def test_a_field_of_the_wrong_wire_type_is_an_unknown_field_as_for_the_generated_parser():
    records_as_varint = b"\x08\x07" + _response(high_watermark=3).SerializeToString()
    response_as_fixed32 = b"\x1d1234"
    result = response_as_fixed32 + b"\x1a" + bytes([len(records_as_varint)]) + records_as_varint
    wire = b"\x08\x05" + b"\x0a" + bytes([len(result)]) + result  # results as a varint too
    expected = partition_pb2.ReplicateManyResponse.FromString(wire)
    parsed = parse_many(wire)
    assert parsed.to_message() == expected
    assert len(parsed.results) == 1 and not parsed.results[0].response.records
    assert parsed.results[0].response.high_watermark == 3


def test_truncated_input_is_refused_clearly():
    """Cut anywhere (the 1 MiB result left out, to keep it quick): a cut between two
    results leaves a shorter, well-formed message, which both parse alike; every other
    cut leaves a field unfinished, which both refuse (this one saying where)."""
    from google.protobuf.message import DecodeError
    small = partition_pb2.ReplicateManyResponse(results=MANY.results[:4])
    wire = small.SerializeToString()
    refused = 0
    for end in range(len(wire)):
        try:
            expected = partition_pb2.ReplicateManyResponse.FromString(wire[:end])
        except DecodeError:
            with pytest.raises(WireError, match="truncated|runs past|never ends"):
                parse_many(wire[:end])
            refused += 1
        else:
            assert parse_many(wire[:end]).to_message() == expected
            assert len(expected.results) < len(small.results)
    assert refused == len(wire) - len(small.results)  # every cut but the boundaries


@pytest.mark.parametrize("wire, message", [
    (b"\x0a\x80", "truncated varint at byte 1"),
    (b"\x0a\x05ab", "runs past the end"),
    (b"\x0a" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
    (b"\x00\x01", "field number 0"),
    (b"\x0e\x01", "wire type 6"),
    (b"\x0c", "end of a group that did not begin"),
    (b"\x0b\x08\x01", "never ends"),
    (b"\x0b\x14", "ends as field 2"),
    (b"\x0a\x03\x1a\x01\x0a", "truncated varint"),  # inside a response
    (b"\x0a\x04\x1a\x02\x0a\x05", "runs past the end"),  # records longer than the response
], ids=["varint", "length", "long varint", "field 0", "wire type", "end group",
        "open group", "wrong end group", "inner varint", "records length"])
def test_malformed_input_is_refused_saying_where(wire, message):
    with pytest.raises(WireError, match=message):
        parse_many(wire)
    with pytest.raises(Exception):  # the generated parser refuses it too
        partition_pb2.ReplicateManyResponse.FromString(wire)


# ------------------------------------------------------------------ both ways, at random

def _responses():
    entries = st.lists(st.builds(partition_pb2.LeaderEpochEntry,
                                 epoch=st.integers(0, 2**32 - 1),
                                 start_offset=st.integers(-2**63, 2**63 - 1)), max_size=3)
    return st.builds(
        partition_pb2.ReplicateResponse, records=st.binary(max_size=300),
        high_watermark=st.integers(-2**63, 2**63 - 1),
        log_start_offset=st.integers(0, 2**40), log_end_offset=st.integers(0, 2**40),
        epochs=entries, diverging=st.booleans(), diverging_epoch=st.integers(-1, 2**31),
        diverging_end_offset=st.integers(-1, 2**40), cursors_available=st.booleans(),
        cursor_snapshot=st.binary(max_size=20), cursor_first_sequence=st.integers(-1, 2**40),
        cursor_frames=st.binary(max_size=200), cursor_durable_end=st.integers(0, 2**40))


@st.composite
def _many(draw):
    results = []
    for index in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["response", "error", "neither"]))
        results.append(_result(draw(st.text(max_size=8)), draw(st.integers(0, 2**31 - 1)),
                               draw(_responses()) if kind == "response" else None,
                               "FENCED_LEADER_EPOCH" if kind == "error" else ""))
    return partition_pb2.ReplicateManyResponse(results=results)


@settings(max_examples=300, deadline=None)
@given(_many())
def test_at_random_the_bytes_and_the_messages_are_the_generated_classes(many):
    wire = many.SerializeToString()
    assert serialize_many(_split_many(many)) == wire
    parsed = parse_many(wire)
    assert parsed.to_message() == many
    assert serialize_many(parsed) == wire
    for result in many.results:
        if result.HasField("response"):
            assert serialize_answer(_split(result.response)) == \
                result.response.SerializeToString()
            assert parse_answer(result.response.SerializeToString()).to_message() == \
                result.response


# ------------------------------------------------------------------ through gRPC

def test_through_grpc_the_generated_stub_and_the_replica_stub_read_the_same_answers():
    """The shell: `add_partition_service` installs the serializers for the two methods
    (every other method stays as generated), on a loopback server in this process."""
    import asyncio

    import grpc

    from atomlog.v1 import partition_pb2_grpc
    from partition_server.replica import ReplicaStub
    from partition_server.server import add_partition_service

    class Servicer(partition_pb2_grpc.PartitionServiceServicer):
        async def ReplicateMany(self, request, context):
            return _split_many(MANY)

        async def Replicate(self, request, context):
            return _split(FULL)

    async def run():
        server = grpc.aio.server()
        add_partition_service(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                generated = partition_pb2_grpc.PartitionServiceStub(channel)
                ours = ReplicaStub(channel)
                many = partition_pb2.ReplicateManyRequest(replica="b")
                one = partition_pb2.ReplicateRequest(replica="b")
                assert await generated.ReplicateMany(many, timeout=10) == MANY
                parsed = await ours.ReplicateMany(many, timeout=10)
                assert isinstance(parsed, ReplicateManyAnswer) and parsed.to_message() == MANY
                assert await generated.Replicate(one, timeout=10) == FULL
                assert (await ours.Replicate(one, timeout=10)).to_message() == FULL
                with pytest.raises(grpc.aio.AioRpcError) as unimplemented:
                    await ours.Produce(partition_pb2.ProduceRequest(), timeout=10)
                assert unimplemented.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await server.stop(0)

    asyncio.run(run())
