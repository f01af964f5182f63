"""read_wire: Fetch and Receive answers with their batches spliced into the wire bytes
parse, with the generated classes, into exactly the messages built whole; in process they
read as those messages."""

from __future__ import annotations

import os

import pytest
from atomlog.v1 import common_pb2, partition_pb2

from partition_server import read_wire
from partition_server.read_wire import SplicedResponse


def fetch_results():
    """(fields, batches) of FetchResults of every shape a handler builds."""
    tp = common_pb2.TopicPartition
    return [
        (dict(topic_partition=tp(topic="t", partition=0), next_fetch_offset=7,
              log_start_offset=0, high_watermark=9, max_read_position=9,
              last_data_offset=8), os.urandom(300_000)),
        (dict(topic_partition=tp(topic="t", partition=1), next_fetch_offset=3,
              high_watermark=3, max_read_position=3), b""),  # nothing readable yet
        (dict(topic_partition=tp(topic="u", partition=2), next_fetch_offset=5,
              error=partition_pb2.ItemError(reason="NOT_PARTITION_OWNER", message="moved",
                                         metadata={"k": "v"}),
              log_start_offset=-1, high_watermark=-1), b""),
        (dict(topic_partition=tp(topic="v" * 300, partition=3), next_fetch_offset=200,
              high_watermark=1 << 40), memoryview(os.urandom(1_000))[10:900]),
    ]


def test_a_spliced_fetch_answer_is_the_message_built_whole():
    spliced, whole = SplicedResponse(partition_pb2.FetchResponse()), \
        partition_pb2.FetchResponse()
    for fields, batches in fetch_results():
        result = spliced.results.add(record_batches=batches, **fields)
        result.aborted_transactions.add(txn_id=common_pb2.TxnId(tc_partition=3, sequence=4),
                                        first_offset=1, marker_offset=2)
        full = whole.results.add(record_batches=bytes(batches), **fields)
        full.aborted_transactions.add(txn_id=common_pb2.TxnId(tc_partition=3, sequence=4),
                                      first_offset=1, marker_offset=2)
    wire = read_wire.serialize(spliced)
    assert partition_pb2.FetchResponse.FromString(wire) == whole
    assert len(wire) == whole.ByteSize()  # the same fields, only in another order
    assert spliced.SerializeToString() == wire
    assert spliced.to_message() == whole
    # In process it reads as the response.
    assert len(spliced.results) == 4
    assert [r.record_batches for r in spliced.results] == [r.record_batches
                                                           for r in whole.results]
    first = spliced.results[0]
    assert first.next_fetch_offset == 7 and first.topic_partition.topic == "t"
    assert spliced.results[2].error.reason == "NOT_PARTITION_OWNER"
    assert read_wire.serialize(whole) == whole.SerializeToString()  # a message as is


def test_a_spliced_receive_answer_is_the_message_built_whole():
    sp = common_pb2.SubscriptionPartition(topic="in", partition=0, subscription="s")
    spliced, whole = SplicedResponse(partition_pb2.ReceiveResponse()), \
        partition_pb2.ReceiveResponse()
    batches = os.urandom(520_000)
    for target in (spliced, whole):
        result = target.results.add(
            subscription_partition=sp, cumulative_end_offset=10, high_watermark=600,
            max_read_position=600,
            record_batches=batches if target is spliced else bytes(batches))
        result.delivered_ranges.add(start_offset=10, end_offset=510)
        result.redelivered_ranges.add(start_offset=3, end_offset=4)
        target.results.add(subscription_partition=sp,
                           error=partition_pb2.ItemError(reason="UNKNOWN_SUBSCRIPTION"),
                           cumulative_end_offset=-1)
    assert partition_pb2.ReceiveResponse.FromString(read_wire.serialize(spliced)) == whole
    assert read_wire.serialize(SplicedResponse(partition_pb2.ReceiveResponse())) == b""


def test_a_result_carrying_its_own_batches_or_a_missing_entry_is_refused():
    spliced = SplicedResponse(partition_pb2.FetchResponse())
    spliced.message.results.add(record_batches=b"x")  # around add(): no kept entry
    with pytest.raises(ValueError, match="one kept batch entry per result"):
        read_wire.serialize(spliced)
    spliced.records.append(b"")
    with pytest.raises(ValueError, match="must not carry record_batches"):
        read_wire.serialize(spliced)
