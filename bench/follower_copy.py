"""Micro-benchmark (issue 21): a follower's CPU on the event loop per copied MB, for the
step between a Replicate answer and the worker thread that appends it.

- before (until 2026-11-25): the records field read twice (each read copies the payload
  out of the parsed message), every batch header parsed and its CRC checked on the loop;
- after: the field read once on the loop; the parse and CRC check run on the worker
  thread with the append (also measured: that thread's share).

One process, the three interleaved, three rounds; a ~1 MB answer of four 256 KiB batches
of 1 KiB records, as bench/replication.py's producers send.

    .venv/bin/python bench/follower_copy.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from atomlog.v1 import partition_pb2  # noqa: E402
from partition_server.record_batch import Record, encode_batch, iter_batches  # noqa: E402

ROUNDS, CALLS = 3, 300


def main() -> None:
    batch = bytes(encode_batch([Record(key=None, value=os.urandom(1000)) for _ in range(256)]))
    wire = partition_pb2.ReplicateResponse(records=batch * 4).SerializeToString()
    message = partition_pb2.ReplicateResponse.FromString(wire)
    megabytes = len(message.records) / 1e6

    def before():
        if not message.records:
            return None
        data = message.records
        return [(memoryview(data)[p:p + h.size], h) for p, h in iter_batches(data, verify=True)]

    def after_loop():
        data = message.records
        return data or None

    def after_thread():
        view = memoryview(message.records)
        return [(view[p:p + h.size], h) for p, h in iter_batches(view, verify=True)]

    def cost(step) -> float:
        began = time.process_time()
        for _ in range(CALLS):
            step()
        return (time.process_time() - began) / CALLS / megabytes * 1000

    for number in range(ROUNDS):
        print(f"round {number + 1}: event loop ms per MB: before {cost(before):.3f}, "
              f"after {cost(after_loop):.3f}; the worker thread's share after "
              f"{cost(after_thread):.3f}")


if __name__ == "__main__":
    main()
