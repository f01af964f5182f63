"""Micro-benchmark (issue 21): CPU per copied MB of a ReplicateMany answer's bytes, the
leader's side (from the records read from the log to the serialized answer) and the
follower's (from the received bytes to the records it appends), through protobuf messages
as before 2026-11-25 against replicate_wire's splicing (docs/replication.md, "The
answer's bytes"). gRPC's own copies (one on send, several on receive) are the same for
both and not counted.

One process, the two interleaved, three rounds; an answer of one partition's records of
~1 MB (what a follower's round carried in bench/replication.py) and of 4 MiB (the
per-partition bound).

    .venv/bin/python bench/replicate_answer.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atomlog.v1 import partition_pb2  # noqa: E402
from partition_server.replicate_wire import (ReplicateAnswer, ReplicateItem,  # noqa: E402
                                             ReplicateManyAnswer, parse_many, serialize_many)

ROUNDS = 3


def fields() -> dict:
    return dict(high_watermark=123456, log_start_offset=0, log_end_offset=123999,
                epochs=[partition_pb2.LeaderEpochEntry(epoch=3, start_offset=100)])


def leader_before(records: bytes) -> bytes:
    response = partition_pb2.ReplicateResponse(records=records, **fields())
    many = partition_pb2.ReplicateManyResponse()
    result = many.results.add()
    result.topic_partition.topic, result.topic_partition.partition = "bench", 0
    result.response.CopyFrom(response)
    return many.SerializeToString()


def leader_after(records: bytes) -> bytes:
    result = partition_pb2.ReplicateResult()
    result.topic_partition.topic, result.topic_partition.partition = "bench", 0
    answer = ReplicateAnswer(partition_pb2.ReplicateResponse(**fields()), records)
    return serialize_many(ReplicateManyAnswer([ReplicateItem(result, answer)]))


def follower_before(wire: bytes):
    many = partition_pb2.ReplicateManyResponse.FromString(wire)
    return [result.response.records for result in many.results]


def follower_after(wire: bytes):
    return [item.response.records for item in parse_many(wire).results]


def cost(step, argument, megabytes: float) -> float:
    calls = max(20, int(200 / megabytes))
    began = time.process_time()
    for _ in range(calls):
        step(argument)
    return (time.process_time() - began) / calls / megabytes * 1000


def main() -> None:
    for size in (1 << 20, 4 << 20):
        records = os.urandom(size)
        wire = leader_before(records)
        assert leader_after(records) == wire
        assert bytes(follower_after(wire)[0]) == follower_before(wire)[0]
        megabytes = size / 1e6
        for number in range(ROUNDS):
            print(f"{size >> 20} MiB, round {number + 1}: ms per MB, leader before "
                  f"{cost(leader_before, records, megabytes):.3f}, after "
                  f"{cost(leader_after, records, megabytes):.3f}; follower before "
                  f"{cost(follower_before, wire, megabytes):.3f}, after "
                  f"{cost(follower_after, wire, megabytes):.3f}")


if __name__ == "__main__":
    main()
