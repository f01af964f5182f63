"""The answers of `Replicate` and `ReplicateMany` with their records spliced into the wire
bytes instead of copied through protobuf messages (issue 21; docs/replication.md, "The
answer's bytes").

A protobuf message on the wire is its fields' encodings back to back, and a
length-delimited field is a tag, a varint length and the bytes. So a `ReplicateResponse`
is `0x0a, len(records), records` followed by the encoding of every other field, and the
leader can send the batches it read from its log without putting them into a message
(which copies them), copying that message whole (`CopyFrom` into the `ReplicateManyResponse`)
and serializing it (which copies them again). The follower in turn keeps the records as a
slice of the received buffer instead of parsing them into a message (a copy) and reading
the field (another). What travels is exactly the standard messages of
protos/atomlog/v1/partition.proto: only how Python builds and reads the bytes changes.

- `ReplicateAnswer`: a ReplicateResponse in two parts, `message` (every field but
  `records`) and `records` (bytes, or a memoryview of the received buffer). It reads as a
  ReplicateResponse: any other attribute is the message's.
- `ReplicateItem`, `ReplicateManyAnswer`: a ReplicateResult (its `response` as a
  ReplicateAnswer) and the list of them.
- `serialize_answer` / `serialize_many`: the gRPC response serializers of the two methods
  (they also take the generated messages). For messages without unknown fields the bytes
  equal the generated classes' `SerializeToString` (known fields in field-number order).
- `parse_answer` / `parse_many`: the follower's response deserializers. A small strict
  walk of the outer messages (ReplicateManyResponse.results -> ReplicateResult.response
  -> ReplicateResponse.records); every other field, unknown ones included, is parsed by
  the generated classes. Malformed input raises `WireError` saying where.

Pure: no I/O, no gRPC.
"""

from __future__ import annotations

from atomlog.v1 import partition_pb2
from partition_server.record_batch import uvarint as varint

# Wire types (protobuf encoding).
_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5
# The three length-delimited fields split here: field 1 of ReplicateManyResponse
# (results), field 3 of ReplicateResult (response), field 1 of ReplicateResponse
# (records).
_RESULTS_FIELD, _RESPONSE_FIELD, _RECORDS_FIELD = 1, 3, 1
_RESULTS_TAG = bytes([_RESULTS_FIELD << 3 | _LEN])
_RESPONSE_TAG = bytes([_RESPONSE_FIELD << 3 | _LEN])
_RECORDS_TAG = bytes([_RECORDS_FIELD << 3 | _LEN])
_SESSION_FIELD = 2  # ReplicateManyResponse.session_id
_SESSION_TAG = bytes([_SESSION_FIELD << 3 | _VARINT])
# Nested groups in an unknown field (proto2 groups; none in our protos): a bound, as every
# parser has one (protobuf's default recursion limit is 100).
_MAX_GROUP_DEPTH = 100
_MAX_FIELD_NUMBER = (1 << 29) - 1


class WireError(ValueError):
    """The bytes are not a well-formed message (the peer's fault, or a bug)."""


class ReplicateAnswer:
    """A ReplicateResponse in two parts: `message`, every field but `records` (which it
    must not have), and `records`, the batches (bytes or a memoryview). Any attribute other
    than `records` is the message's, so it reads as a ReplicateResponse."""

    __slots__ = ("message", "records")

    def __init__(self, message: partition_pb2.ReplicateResponse | None = None,
                 records: bytes | memoryview = b""):
        self.message = message if message is not None else partition_pb2.ReplicateResponse()
        self.records = records

    def __getattr__(self, name: str):
        if name in ReplicateAnswer.__slots__ or name.startswith("__"):
            raise AttributeError(name)  # not set yet (copy, pickle): never the message's
        return getattr(self.message, name)

    def to_message(self) -> partition_pb2.ReplicateResponse:
        """The whole ReplicateResponse (copies the records: for tests and tools)."""
        whole = partition_pb2.ReplicateResponse()
        whole.CopyFrom(self.message)
        whole.records = bytes(self.records)
        return whole

    def __repr__(self) -> str:
        return f"ReplicateAnswer(records={len(self.records)} bytes, message={self.message!r})"


class ReplicateItem:
    """A ReplicateResult: `result` holds its other fields (topic_partition, error) and no
    `response`; `response` is the ReplicateAnswer, or None when the result has none."""

    __slots__ = ("result", "response")

    def __init__(self, result: partition_pb2.ReplicateResult,
                 response: ReplicateAnswer | None = None):
        self.result = result
        self.response = response

    @property
    def topic_partition(self):
        return self.result.topic_partition

    @property
    def error(self):
        return self.result.error

    def to_message(self) -> partition_pb2.ReplicateResult:
        whole = partition_pb2.ReplicateResult()
        whole.CopyFrom(self.result)
        if self.response is not None:
            whole.response.CopyFrom(self.response.to_message())
        return whole


class ReplicateManyAnswer:
    """A ReplicateManyResponse: its results as ReplicateItems, its fetch session's id
    (0: none), and the encoding of any fields it does not know (`unknown`, kept so nothing
    is dropped)."""

    __slots__ = ("results", "unknown", "session_id")

    def __init__(self, results: list[ReplicateItem] | None = None, unknown: bytes = b"",
                 session_id: int = 0):
        self.results = results if results is not None else []
        self.unknown = unknown
        self.session_id = session_id

    def to_message(self) -> partition_pb2.ReplicateManyResponse:
        whole = partition_pb2.ReplicateManyResponse.FromString(self.unknown)
        for item in self.results:
            whole.results.append(item.to_message())
        if self.session_id:
            whole.session_id = self.session_id
        return whole


# --------------------------------------------------------------------------- serializing

def _answer_parts(answer: ReplicateAnswer, parts: list) -> int:
    """Append the encoding of `answer` (records first: field 1) to `parts`; its length."""
    if answer.message.records:
        raise ValueError("a ReplicateAnswer's message must not carry records")
    rest = answer.message.SerializeToString()
    size = len(rest)
    records = answer.records
    if len(records):  # proto3: an empty bytes field is not encoded
        length = varint(len(records))
        parts += (_RECORDS_TAG, length, records)
        size += 1 + len(length) + len(records)
    parts.append(rest)
    return size


def serialize_answer(answer: ReplicateAnswer | partition_pb2.ReplicateResponse) -> bytes:
    """The Replicate method's response serializer."""
    if isinstance(answer, partition_pb2.ReplicateResponse):
        return answer.SerializeToString()
    parts: list = []
    _answer_parts(answer, parts)
    return b"".join(parts)


def serialize_many(answer: ReplicateManyAnswer | partition_pb2.ReplicateManyResponse
                   ) -> bytes:
    """The ReplicateMany method's response serializer: one copy of the records, into the
    returned bytes."""
    if isinstance(answer, partition_pb2.ReplicateManyResponse):
        return answer.SerializeToString()
    parts: list = []
    for item in answer.results:
        if item.result.HasField("response"):
            raise ValueError("a ReplicateItem's result must not carry its response")
        head = item.result.SerializeToString()
        at = len(parts)
        parts += (_RESULTS_TAG, None, head)  # the length once the response is known
        size = len(head)
        if item.response is not None:
            parts += (_RESPONSE_TAG, None)
            inner_at = len(parts) - 1
            inner = _answer_parts(item.response, parts)
            parts[inner_at] = varint(inner)
            size += 1 + len(parts[inner_at]) + inner
        parts[at + 1] = varint(size)
    if answer.session_id:  # (proto3: 0 is not encoded)
        parts += (_SESSION_TAG, varint(answer.session_id))
    parts.append(answer.unknown)
    return b"".join(parts)


# --------------------------------------------------------------------------- parsing

def _read_varint(data, position: int, end: int) -> tuple[int, int]:
    """(value, position after it) of the varint at `position`."""
    value, shift, begin = 0, 0, position
    while True:
        if position >= end:
            raise WireError(f"truncated varint at byte {begin}")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
        if shift >= 70:
            raise WireError(f"varint longer than 10 bytes at byte {begin}")


def _fields(data, start: int, end: int):
    """Walk the fields of the message in data[start:end], yielding (field number, wire
    type, where the field begins, where its value begins, where it ends); a
    length-delimited value is data[value:end of field]."""
    position = start
    while position < end:
        begin = position
        key, position = _read_varint(data, position, end)
        number, wire_type = key >> 3, key & 7
        if not 0 < number <= _MAX_FIELD_NUMBER:
            raise WireError(f"field number {number} at byte {begin}")
        if wire_type == _LEN:
            length, value = _read_varint(data, position, end)
            position = value + length
            if position > end:
                raise WireError(f"field {number} at byte {begin} runs past the end of its "
                                f"message (byte {end})")
            yield number, wire_type, begin, value, position
        else:
            position = _skip(data, number, wire_type, position, end, begin, 0)
            yield number, wire_type, begin, position, position


def _skip(data, number: int, wire_type: int, position: int, end: int, begin: int,
          depth: int) -> int:
    """The position after the value of a field whose key ended at `position`."""
    if wire_type == _VARINT:
        _value, position = _read_varint(data, position, end)
    elif wire_type == _I64:
        position += 8
    elif wire_type == _I32:
        position += 4
    elif wire_type == _LEN:
        length, position = _read_varint(data, position, end)
        position += length
    elif wire_type == _SGROUP:
        if depth >= _MAX_GROUP_DEPTH:
            raise WireError(f"groups nested deeper than {_MAX_GROUP_DEPTH} at byte {begin}")
        while True:
            if position >= end:
                raise WireError(f"group of field {number} at byte {begin} never ends")
            inner_begin = position
            key, position = _read_varint(data, position, end)
            if key & 7 == _EGROUP:
                if key >> 3 != number:
                    raise WireError(f"group of field {number} at byte {begin} ends as "
                                    f"field {key >> 3} at byte {inner_begin}")
                break
            if not 0 < key >> 3 <= _MAX_FIELD_NUMBER:
                raise WireError(f"field number {key >> 3} at byte {inner_begin}")
            position = _skip(data, key >> 3, key & 7, position, end, inner_begin, depth + 1)
    elif wire_type == _EGROUP:
        raise WireError(f"end of a group that did not begin, at byte {begin}")
    else:
        raise WireError(f"wire type {wire_type} (field {number}) at byte {begin}")
    if position > end:
        raise WireError(f"field {number} at byte {begin} runs past the end of its message "
                        f"(byte {end})")
    return position


def _parse_response(view: memoryview, spans: list[tuple[int, int]]) -> ReplicateAnswer:
    """The ReplicateResponse made of the concatenation of `spans` (a message field may
    come in pieces: they merge): records as a slice of `view` (the last occurrence wins,
    as for any singular field), every other field parsed by the generated class."""
    records: memoryview | bytes = b""
    rest: list = []
    for start, end in spans:
        kept = start
        for number, wire_type, begin, value, after in _fields(view, start, end):
            if number == _RECORDS_FIELD and wire_type == _LEN:
                rest.append(view[kept:begin])
                records, kept = view[value:after], after
        rest.append(view[kept:end])
    message = partition_pb2.ReplicateResponse.FromString(b"".join(rest))
    return ReplicateAnswer(message, records)


def _parse_result(view: memoryview, start: int, end: int) -> ReplicateItem:
    rest: list = []
    responses: list[tuple[int, int]] = []
    kept = start
    for number, wire_type, begin, value, after in _fields(view, start, end):
        if number == _RESPONSE_FIELD and wire_type == _LEN:
            rest.append(view[kept:begin])
            responses.append((value, after))
            kept = after
    rest.append(view[kept:end])
    result = partition_pb2.ReplicateResult.FromString(b"".join(rest))
    return ReplicateItem(result, _parse_response(view, responses) if responses else None)


def parse_answer(data: bytes) -> ReplicateAnswer:
    """The Replicate method's response deserializer (records: a slice of `data`)."""
    view = memoryview(data)
    return _parse_response(view, [(0, len(view))])


def parse_many(data: bytes) -> ReplicateManyAnswer:
    """The ReplicateMany method's response deserializer (each result's records: a slice of
    `data`, which the slices keep alive)."""
    view = memoryview(data)
    results: list[ReplicateItem] = []
    unknown: list = []
    session_id = 0
    for number, wire_type, begin, value, after in _fields(view, 0, len(view)):
        if number == _RESULTS_FIELD and wire_type == _LEN:
            results.append(_parse_result(view, value, after))
        elif number == _SESSION_FIELD and wire_type == _VARINT:
            # (the last occurrence wins, as protobuf's; a uint64 keeps the low 64 bits)
            session_id = _read_varint(view, _read_varint(view, begin, after)[1], after)[0] \
                & 0xFFFFFFFFFFFFFFFF
        else:
            unknown.append(view[begin:after])
    answer = ReplicateManyAnswer(results, b"".join(unknown), session_id)
    if unknown:  # as the generated parser would: refuse what it refuses
        partition_pb2.ReplicateManyResponse.FromString(answer.unknown)
    return answer
