"""Fetch and Receive answers with their record batches spliced into the wire bytes instead
of copied through protobuf messages, as replicate_wire does for Replicate (issue 19;
docs/benchmarks.md, "Read answers spliced").

The protobuf runtime (upb) serializes a large bytes field at about 1 GB/s on the benchmark
machine: 0.50 ms for a 520 KB Receive answer, 6.1 ms for an 8 MB Fetch answer, on the
event loop's thread. Joining the same bytes behind the other fields' encoding takes 0.03
and 0.7 ms. A `FetchResponse` and a `ReceiveResponse` are each their results back to
back (field 1: `0x0a`, a varint length, the result), and in both a result's
`record_batches` is field 3 (`0x1a`, a varint length, the batches). So the handlers build
every result without its batches, keep the batches beside it (`SplicedResponse`), and
the serializer writes each result's other fields and then field 3. That is another field
order than the generated serializer's (which writes by field number), and every protobuf
parser accepts it: what travels is the same message of protos/atomlog/v1/partition.proto.
An in-process caller (the combined server's TC log reading its partition) gets the
`SplicedResponse`, which reads as the response.

Pure: no I/O, no gRPC.
"""

from __future__ import annotations

from partition_server.record_batch import uvarint as varint

_LEN = 2  # wire type: length-delimited
_RESULTS_TAG = bytes([1 << 3 | _LEN])  # FetchResponse.results, ReceiveResponse.results
_BATCHES_TAG = bytes([3 << 3 | _LEN])  # FetchResult/ReceiveResult.record_batches


class SplicedResult:
    """One result as a caller reads it: `record_batches` is the kept batches (bytes),
    anything else is the result message's."""

    __slots__ = ("message", "_records")

    def __init__(self, message, records):
        self.message, self._records = message, records

    @property
    def record_batches(self) -> bytes:
        return bytes(self._records)

    def __getattr__(self, name: str):
        if name in SplicedResult.__slots__ or name.startswith("__"):
            raise AttributeError(name)  # not set yet (copy, pickle): never the message's
        return getattr(self.message, name)


class SplicedResults:
    """`SplicedResponse.results`: `add()` as a repeated field's (record_batches kept
    beside the message), and read as a sequence of `SplicedResult`."""

    __slots__ = ("_response",)

    def __init__(self, response: SplicedResponse):
        self._response = response

    def add(self, record_batches: bytes | memoryview = b"", **fields):
        """A new result with `fields`, its batches kept aside; returns the result message
        (to add repeated fields to, as with a generated message's `results.add`)."""
        result = self._response.message.results.add(**fields)
        self._response.records.append(record_batches)
        return result

    def __len__(self) -> int:
        return len(self._response.records)

    def __getitem__(self, index: int) -> SplicedResult:
        response = self._response
        return SplicedResult(response.message.results[index], response.records[index])

    def __iter__(self):
        response = self._response
        return map(SplicedResult, response.message.results, response.records)


class SplicedResponse:
    """A FetchResponse or ReceiveResponse (`message`, whose results carry no
    record_batches) with each result's batches kept beside it (`records`, in order)."""

    __slots__ = ("message", "records")

    def __init__(self, message):
        self.message = message
        self.records: list[bytes | memoryview] = []

    @property
    def results(self) -> SplicedResults:
        return SplicedResults(self)

    def SerializeToString(self) -> bytes:  # noqa: N802 — the generated messages' name
        return serialize(self)

    def to_message(self):
        """The whole response (copies the batches: for tests and tools)."""
        whole = type(self.message)()
        whole.CopyFrom(self.message)
        for result, records in zip(whole.results, self.records):
            result.record_batches = bytes(records)
        return whole

    def __repr__(self) -> str:
        sizes = [len(records) for records in self.records]
        return f"SplicedResponse(record batch bytes {sizes}, message={self.message!r})"


def serialize(response) -> bytes:
    """The Fetch and Receive methods' response serializer: a SplicedResponse with one
    copy of the batches (into the returned bytes), or a generated message as is."""
    if not isinstance(response, SplicedResponse):
        return response.SerializeToString()
    message = response.message
    if len(message.results) != len(response.records):
        raise ValueError("a SplicedResponse needs one kept batch entry per result")
    parts: list = []
    for result, records in zip(message.results, response.records):
        if result.record_batches:
            raise ValueError("a SplicedResponse's result must not carry record_batches")
        head = result.SerializeToString()
        size = len(head)
        if records:
            length = varint(len(records))
            size += len(_BATCHES_TAG) + len(length) + len(records)
            parts += (_RESULTS_TAG, varint(size), head, _BATCHES_TAG, length, records)
        else:
            parts += (_RESULTS_TAG, varint(size), head)
    return b"".join(parts)
