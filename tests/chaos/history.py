"""The history of a chaos run: what every client did, and every fault, as JSON lines.

Clients write *events* to their own file (`events-<process>.jsonl`), one line when an
operation is invoked and one when it completes, flushed at once, so a client killed with
SIGKILL leaves its in-flight operations behind as invocations without completions. At
the end the runner merges every file into `history.jsonl`: one *operation* a line, in
invocation order. That merged form is what the checker reads.

An operation (a dict) always has:

    "process"  who did it: "producer-0", "reader-2", "ctp-1", "nemesis", "final", ...
    "f"        what kind of operation (below)
    "invoke"   wall-clock seconds (time.time()) when it began
    "complete" wall-clock seconds when its outcome was known; None if it never was
    "outcome"  "ok", "fail" (it definitely did not happen) or "unknown" (timed out, or
               the client died first)
    "error"    optional: the error reason, for a fail or unknown

Kinds ("f") and their own fields:

  send        a non-transactional idempotent write of one unique value.
              "topic", "partition", "value"; on ok also "offset".
  txn         one transaction. "writes": [[topic, partition, value], ...] (unique
              values), "acks": [[subscription, topic, partition, offset], ...]
              (transactional acks of input messages; ctp), "decision": "commit" or
              "abort" (what the client tried), "result": "committed", "aborted" or
              "unknown" (its definite fate as far as the client knows: a failed commit
              that the client then aborted is "aborted"; a commit whose answer was lost
              is "unknown"), "txn_id": "tc:seq" or None, and for Kafka-style sessions
              "transactional_id" and "epoch" (the producer epoch that wrote it);
              optional "producer" (one producer object of one client incarnation:
              its transactions send in invocation order) and "commit" ("async" for
              commit_async()).
  poll        records a reader got. "session" (a reader session id: one per consumer
              object; a restarted reader is a new session), "isolation"
              ("read_committed" or "read_uncommitted"), "subscription" (None for an
              assigned-partition reader), "records": [[topic, partition, offset, value], ...]
              in the order returned.
  seek        an assigned-partition reader session starting at given offsets.
              "session", "isolation", "positions": [[topic, partition, offset], ...]
  fence       a new producer session with a transactional id, fencing older epochs.
              "transactional_id", "epoch" (the new session's epoch); ok once it holds it.
  cursor      an observation of a subscription's cursors. "subscription", "topic",
              "positions": [[partition, cursor, ranges], ...] (cursor = first offset not
              yet acknowledged; everything below it is acknowledged and committed;
              ranges = [[start, end), ...] acknowledged individually above the cursor;
              an offset is acknowledged if it is below cursor or in a range).
  nemesis     a fault: "fault" (kill, pause, net-drop, net-delay, net-oneway,
              disk-fsync, disk-full, client-kill), "target" (process name or a link
              "a->b"), "detail"; invoke = when it began, complete = when it was healed.
  final-read  after healing, a whole read of every partition from its start.
              "isolation", "records": [[topic, partition, offset, value], ...],
              "ends": [[topic, partition, high_watermark], ...]
  final-positions  after healing and waiting past every transaction timeout:
              "partitions": [{"topic", "partition", "high_watermark",
              "max_read_position", "open_txns": ["tc:seq", ...]}, ...]
  workload    metadata, one at the start: "workload", "seed", "topics":
              {name: partitions}, "txn_timeout_s", "input_topic"/"output_topic"/
              "subscription" (ctp), "transform": "out:" prefix (ctp).

Values are strings; every written value is unique in the run, so a value names the one
write that made it. Records carry values decoded as UTF-8.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path

EVENTS_GLOB = "events-*.jsonl"
HISTORY_FILE = "history.jsonl"


class EventLog:
    """A client's side of the history: invoke() and complete() append a line each, written
    and flushed at once (a SIGKILL loses nothing already returned). Thread-safe."""

    def __init__(self, directory: Path, process: str):
        self.process = process
        self._file = open(Path(directory) / f"events-{process}.jsonl", "a", buffering=1)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pid = os.getpid()

    def invoke(self, f: str, **fields) -> str:
        op_id = f"{self.process}/{self._pid}/{next(self._ids)}"
        self._write({"event": "invoke", "id": op_id, "process": self.process, "f": f,
                     "time": time.time(), **fields})
        return op_id

    def complete(self, op_id: str, outcome: str, **fields) -> None:
        assert outcome in ("ok", "fail", "unknown"), outcome
        self._write({"event": "complete", "id": op_id, "time": time.time(),
                     "outcome": outcome, **fields})

    def record(self, f: str, outcome: str = "ok", **fields) -> None:
        """An operation that is invoked and completes at once (an observation)."""
        self.complete(self.invoke(f, **fields), outcome)

    def _write(self, line: dict) -> None:
        text = json.dumps(line, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(text)
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def merge(directory: Path) -> list[dict]:
    """Every events file of a run as operations (see the module doc), by invocation time.
    An invocation without a completion is an operation with outcome "unknown" and
    complete None. A torn last line (the writer was killed mid-write) is dropped."""
    operations: dict[str, dict] = {}
    for path in sorted(Path(directory).glob(EVENTS_GLOB)):
        with open(path) as handle:
            for text in handle:
                try:
                    event = json.loads(text)
                except json.JSONDecodeError:
                    continue  # a torn last line
                kind = event.pop("event")
                op_id = event.pop("id")
                moment = event.pop("time")
                if kind == "invoke":
                    operations[op_id] = {**event, "invoke": moment, "complete": None,
                                         "outcome": "unknown"}
                elif op_id in operations:
                    operations[op_id].update(event, complete=moment)
    return sorted(operations.values(), key=lambda op: op["invoke"])


def write_history(directory: Path, operations: list[dict]) -> Path:
    path = Path(directory) / HISTORY_FILE
    with open(path, "w") as handle:
        for op in operations:
            handle.write(json.dumps(op, separators=(",", ":")) + "\n")
    return path


def read_history(path: Path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
