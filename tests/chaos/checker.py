"""The checker of a chaos run: a pure function from a history (see history.py for its
format) to a report of anomalies. Standard library only; no I/O but `check_file`.

    report = check(history)  # {"valid", "anomalies", "examples", "stats", "stalls", "problems"}
    print(format_report(report))

Terms. A *write* is a send op (one value) or one entry of a txn op's "writes". Values are
unique per write, so a value names its write -- except the outputs of consume-transform-
produce (ctp): a retry of an aborted attempt writes the same output value again, so the
checker keeps every writer of a value and calls a write *exclusive* when its value has no
other writer. A value is *visible* when it is in the read_committed final-read (the last
ok one, if there are several). A write's *status* is "committed" (send ok, txn result
committed), "aborted" (txn result aborted, or decision abort whatever its result: a txn
the client never committed must never show), "unknown" (send unknown, txn result unknown
or missing) or "failed" (send fail). Positions are (topic, partition, offset).

Anomalies (adapted from Jepsen's Kafka workload):

lost-write
    A committed write whose value is not visible. ctp adds: an input of the
    read_committed final-read below the final cursor of its partition (acknowledged)
    with no visible output (example kind "ctp-acked-without-output"). One per value.
duplicate
    One value at two or more distinct positions across poll records, both final-reads
    and send ok offsets. Each value once. Read_uncommitted observations of a value with
    several writers are left out (an aborted ctp attempt and its committed retry are
    both in the log, and read_uncommitted readers see both), and so are read_uncommitted
    observations of positions the final read_committed read does not hold: aborted data
    (a one-call transaction staged, then presumed aborted when its coordinator lost the
    TC partition, and run anew under a new transaction id by the SDK's retry). ctp adds: more than one
    visible output for one input (example kind "ctp-output"; merged with the plain
    duplicate of the same value).
aborted-read
    A value seen by a read_committed read (poll or final-read) whose every writer is
    aborted (kind "aborted"), or that no op ever wrote (kind "unknown-write", a phantom).
    A value also written by a non-aborted op (a ctp retry) is not an aborted read. A
    failed send that shows is not reported (the definitions do not cover it).
torn-transaction
    (kind "writes") A txn with two or more writes, some visible and some not. Aborted and
    unknown txns are judged on their exclusive writes only (a shared ctp output may be
    visible through its committed retry). (kind "acks-not-applied") A committed or
    unknown txn with writes and acks, every write visible, and an acked offset o not
    applied: o >= the final cursor C of its (subscription, topic, partition), where C
    comes from a cursor op of process "final". Gap guard: the cursor legitimately stops
    at the first offset no one acknowledged, so o counts only when no record of the
    read_committed final-read between C and o is unacknowledged (acknowledged = acked
    by a committed txn, or by an unknown txn whose writes are all visible).
    (kind "acks-applied-without-writes") An unknown txn whose writes are all invisible
    while an acked offset is applied (o < C) and no other txn acknowledged it (as above).
    A committed txn with no visible write is a lost-write, not torn.
inconsistent-offsets
    One position seen with two different values anywhere (polls, final-reads, send ok
    offsets). One per position.
non-monotonic-poll
    In one assigned-partition reader session (subscription None), for one partition, an
    offset not strictly greater than the previous one the session read there (ops by
    invoke time, records in order). A seek op of the session restarts the partition.
    Subscription sessions are exempt: nacks and ack timeouts redeliver.
skipped-poll
    In one assigned-partition reader session, between consecutive reads a < b of one
    partition, a record c (a < c < b) in the final-read of the session's isolation; or,
    after a seek to s, a record c with s <= c < b before the first read b.
misplaced-write
    A write (a send, or one of a txn's writes: these carry no offset of their own, so
    inconsistent-offsets cannot see them) visible in the read_committed final-read in
    another (topic, partition) than the one it names. Writes that name none are skipped.
cursor-regression
    Two ok cursor observations A, B of one (subscription, topic, partition) with
    A.complete < B.invoke and B's cursor < A's cursor.
fenced-write-visible
    A txn of (transactional_id, epoch e) with a visible exclusive write, although a fence
    of that transactional_id with epoch > e completed ok before the txn's commit_invoke
    (or its invoke when commit_invoke is missing).
lost-ack
    A committed txn acked (subscription, topic, partition, offset), and a poll of that
    subscription returned that position again from a delivery made after the txn
    completed: the poll's "received" (when the SDK sent the Receive that delivered what it
    returns: earlier than the poll for what a prefetching consumer kept), else its
    invoke.
reordered-writes
    Two committed txns of one producer (txn ops with the same "producer" field), the
    earlier invoked first (one producer's transactions send one after another, whether
    they then commit with commit() or commit_async()), and a visible exclusive write of
    the later one at a lower offset of a partition than one of the earlier's: the
    producer's send order did not hold. (kind "txn-order", since 2026-12-06) Within one
    committed txn of a producer, a visible exclusive write at a lower offset of a
    partition than one of the txn's writes listed before it.
hanging-transaction
    In the last ok final-positions op, a partition with max_read_position <
    high_watermark, or with open transactions.
vanished-read
    A value a read_committed poll returned that the read_committed final-read does not
    hold (committed, then gone). Values that are aborted-reads are not counted again.
diverged-replicas
    In the last ok replicas op (replicated runs, after healing): (kind "out-of-sync") a
    partition, of any replicated topic, whose ISR was still not whole a minute after
    healing, so it runs short of copies; or (kinds "segment-bases", "batches") a workload
    partition whose copies, read from the replicas' files, start their segments at
    different offsets or hold different batches. Deleting whole segments (retention,
    DeleteRecords) would then leave replicas different records, and a new leader could
    serve what its old one had deleted.

resurrected-delete
    The trim topic (the log workload's trimmer): a DeleteRecords that completed ok with
    log start S on a partition, and the ok final-trim-read holds a record of that
    partition below S (a replica that had not deleted served after a failover: the
    records came back), or reports a log start below S. (kind "trim-lost-write") An ok
    trim-send at an offset at or above every before_offset a delete of its partition
    was invoked with (whatever its outcome) that the final-trim-read does not hold
    there with its value: a delete took what it must not have.
stream-step-twice
    txn ops naming a stream step (fields "stream", "ordinal", "parent": the spark-lite
    driver's jobs are the steps of a stream, as a Spark streaming query's micro-batches
    are; docs/coordinator.md "Streams") whose writes are all visible in the
    read_committed final-read, of two or more distinct parents for one (stream,
    ordinal): a step committed twice (a replay opened and committed by a key the
    coordinator no longer knew, and the stream's high-water let it through).

Liveness (not an anomaly; a stall makes the report not valid, as a problem does):

stall
    A writer (a process with send or txn ops) that kept trying and made no progress for
    longer than STALL_S: from the invoke of its first op that did not end ok after its
    last ok op (or its start), to the complete of its next ok op, or, if none came, of its
    last op (its invoke, if it never completed); also one ok op that took longer than
    that. Progress is an op that ended ok (a deliberate abort included). A client that
    stops trying (a ctp worker with no input left, a killed client before its restart)
    stalls nothing. Chaos faults each last seconds and the cluster's timeouts are
    seconds (ZooKeeper session 3 s, transactions 5 s), so a writer failing for a minute
    is something that does not heal: a coordinator that never took its TC partitions'
    leases failed one worker's commits and refused the others' for 130 s, with exactly
    once intact. stats "longest_failing_s" is the longest such span of the run, stall or
    not.

Without a read_committed final-read, lost-write, torn-transaction, vanished-read,
reordered-writes, stream-step-twice and the ctp checks are not decided and `problems` says so; without a final-positions op,
hanging-transaction is not decided. A report with problems is not valid.

Readings of the history contract where it is silent: an op whose "f" is unknown, or that
is not a dict, is ignored (counted in stats). A missing "isolation" is read_uncommitted
(the weaker claim: nothing is demanded of it). A missing txn "result" is unknown. Poll
records count whatever the poll's outcome (records present were returned). Only ok
final-read, final-positions, cursor and fence ops count. A ctp workload op without a
"transform" uses the documented "out:".
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple

READ_COMMITTED = "read_committed"
READ_UNCOMMITTED = "read_uncommitted"
MAX_EXAMPLES = 10
DEFAULT_TRANSFORM = "out:"

ANOMALIES = (
    "lost-write",
    "duplicate",
    "aborted-read",
    "torn-transaction",
    "inconsistent-offsets",
    "non-monotonic-poll",
    "skipped-poll",
    "cursor-regression",
    "fenced-write-visible",
    "lost-ack",
    "reordered-writes",
    "misplaced-write",
    "hanging-transaction",
    "vanished-read",
    "diverged-replicas",
    "resurrected-delete",
    "stream-step-twice",
)

STALL_S = 45.0  # a writer failing longer than this without an ok op: a stall

DESCRIPTIONS = {
    "lost-write": "a committed write (send ok, txn committed, or an acknowledged ctp input's "
                  "output) that the read_committed final read does not hold",
    "duplicate": "one value at two or more distinct (topic, partition, offset) positions, or "
                 "more than one visible ctp output for one input",
    "aborted-read": "a read_committed read returned a value of an aborted transaction, or a "
                    "value no operation ever wrote",
    "torn-transaction": "a transaction partly visible, or whose visibility disagrees with "
                        "whether its acks were applied to the final cursor",
    "inconsistent-offsets": "one (topic, partition, offset) seen with two different values",
    "non-monotonic-poll": "an assigned-partition reader session read an offset not above the "
                          "previous one it read in that partition",
    "skipped-poll": "an assigned-partition reader session jumped over a record that the final "
                    "read of its isolation holds",
    "cursor-regression": "a subscription cursor observed lower than one observed before",
    "fenced-write-visible": "a transaction of a fenced producer epoch is visible",
    "lost-ack": "a subscription redelivered a message after a committed transaction "
                "acknowledged it",
    "reordered-writes": "two committed transactions of one producer (or one transaction's "
                        "own writes) landed in a partition in the opposite order of their "
                        "sends",
    "misplaced-write": "a write visible in another partition than the one it was sent to",
    "hanging-transaction": "after healing, a partition still has open transactions or a last "
                           "stable offset below its high watermark",
    "vanished-read": "a value a read_committed poll returned that the final read_committed "
                     "read does not hold (committed, then gone)",
    "diverged-replicas": "after healing, a partition's ISR stays short of a replica, or its "
                         "copies start their segments at different offsets or hold different "
                         "batches",
    "resurrected-delete": "a record below an acknowledged DeleteRecords' log start read "
                          "back at the end, or an acknowledged write above every delete "
                          "gone",
    "stream-step-twice": "one step of a stream (a Spark micro-batch) visible from two "
                         "distinct parent transactions",
}

KNOWN_KINDS = frozenset({"send", "txn", "poll", "seek", "fence", "cursor", "nemesis", "nemesis-target",
                         "final-read", "final-positions", "replicas", "workload",
                         "trim-send", "delete", "final-trim-read",
                         "subscribe",  # a ctp consumer's prefetch: no rule reads it
                         "stream-step"})  # a spark-lite job's open: counted in the stats
DESCRIBED_FIELDS = ("process", "f", "invoke", "complete", "outcome", "error", "txn_id",
                    "result", "decision", "transactional_id", "epoch", "commit_invoke", "producer",
                    "session", "isolation", "subscription", "offset")

Position = tuple  # (topic, partition, offset)
Record = tuple    # (topic, partition, offset, value)
AckKey = tuple    # (subscription, topic, partition, offset)


@dataclass(frozen=True, slots=True, eq=False)
class Write:
    value: str
    topic: Any
    partition: Any
    op: dict
    status: str  # committed, aborted, unknown or failed (see the module doc)


@dataclass(frozen=True, slots=True)
class Transaction:
    """A txn op read once: its status, written values and acks."""
    op: dict
    status: str
    values: list
    acks: list

    def all_visible(self, index: Index) -> bool:
        return bool(self.values) and all(value in index.visible for value in self.values)

    def none_visible(self, index: Index) -> bool:
        return not any(value in index.visible for value in self.values)


@dataclass
class Index:
    """Everything the anomaly functions need, built once by build_index."""
    operations: int = 0
    ignored_ops: int = 0
    sends: list[dict] = field(default_factory=list)
    txns: list[dict] = field(default_factory=list)
    polls: list[dict] = field(default_factory=list)
    seeks: list[dict] = field(default_factory=list)
    fences: list[dict] = field(default_factory=list)      # ok only
    cursors: list[dict] = field(default_factory=list)     # ok only
    faults: list[dict] = field(default_factory=list)
    workload: dict | None = None
    final_reads: dict[str, dict] = field(default_factory=dict)   # isolation -> last ok op
    final_positions: dict | None = None
    final_positions_ops: int = 0
    final_replicas: dict | None = None  # the last ok replicas op
    trim_sends: list[dict] = field(default_factory=list)  # the trimmer's (trim topic)
    stream_steps: dict[str, int] = field(default_factory=dict)  # ok stream-step results
    deletes: list[dict] = field(default_factory=list)  # its DeleteRecords, any outcome
    final_trim_read: dict | None = None  # the last ok final-trim-read op
    replicas_ops: int = 0  # replicas ops, whatever their outcome
    writes: list[Write] = field(default_factory=list)            # in history order
    first_writer: dict[str, Write] = field(default_factory=dict)
    other_writers: dict[str, list[Write]] = field(default_factory=dict)
    visible: dict[str, Position] = field(default_factory=dict)   # value -> first position
    final_offsets: dict[tuple, list] = field(default_factory=dict)  # (iso, t, p) -> sorted
    final_cursors: dict[tuple, Any] = field(default_factory=dict)   # (sub, t, p) -> cursor
    latest_time: float = 0.0

    def writers(self, value: str) -> list[Write]:
        first = self.first_writer.get(value)
        if first is None:
            return []
        return [first, *self.other_writers.get(value, ())]

    def exclusive(self, value: str) -> bool:
        return value in self.first_writer and value not in self.other_writers

    @property
    def has_committed_final_read(self) -> bool:
        return READ_COMMITTED in self.final_reads


# ---------------------------------------------------------------- field readers


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_time(value: Any) -> float | None:
    return float(value) if is_number(value) else None


def invoke_time(op: dict) -> float:
    return as_time(op.get("invoke")) or 0.0


def isolation_of(op: dict) -> str:
    return READ_COMMITTED if op.get("isolation") == READ_COMMITTED else READ_UNCOMMITTED


def well_formed(entry: Any, length: int, number_at: int) -> bool:
    """A list of at least `length` items with a number at `number_at` (an offset, a
    cursor): anything else in a history is skipped rather than trusted."""
    return (isinstance(entry, (list, tuple)) and len(entry) >= length
            and is_number(entry[number_at]))


def records_of(op: dict) -> Iterator[Record]:
    """The well-formed records of a read: (topic, partition, offset, value), the offset
    an int. Inlined checks: this runs over every record of a run several times."""
    for record in op.get("records") or ():
        if type(record) in (list, tuple) and len(record) >= 4 and type(record[2]) is int:
            yield tuple(record[:4])


def txn_writes(op: dict) -> list[tuple]:
    """(topic, partition, value) of each well-formed entry of a txn's writes."""
    return [tuple(entry[:3]) for entry in op.get("writes") or ()
            if isinstance(entry, (list, tuple)) and len(entry) >= 3]


def txn_acks(op: dict) -> list[AckKey]:
    return [tuple(entry[:4]) for entry in op.get("acks") or () if well_formed(entry, 4, 3)]


def txn_status(op: dict) -> str:
    if op.get("decision") == "abort":
        return "aborted"
    result = op.get("result")
    return result if result in ("committed", "aborted") else "unknown"


def send_status(op: dict) -> str:
    return {"ok": "committed", "fail": "failed"}.get(op.get("outcome"), "unknown")


def session_of(op: dict) -> str:
    session = op.get("session")
    return str(session) if session is not None else f"process:{op.get('process')}"


def describe(op: dict) -> dict:
    """The identifying fields of an op, for examples."""
    return {key: op[key] for key in DESCRIBED_FIELDS if op.get(key) is not None}


# ---------------------------------------------------------------- the index


def build_index(history: list[dict]) -> Index:
    index = Index()
    for op in history:
        index.operations += 1
        if not isinstance(op, dict) or op.get("f") not in KNOWN_KINDS:
            index.ignored_ops += 1
            continue
        note_times(index, op)
        add_operation(index, op)
    index.visible = visible_values(index)
    index.final_offsets = final_offsets(index)
    index.final_cursors = final_cursors(index)
    return index


def note_times(index: Index, op: dict) -> None:
    for key in ("invoke", "complete"):
        moment = as_time(op.get(key))
        if moment is not None and moment > index.latest_time:
            index.latest_time = moment


def add_operation(index: Index, op: dict) -> None:
    kind, ok = op["f"], op.get("outcome") == "ok"
    if kind == "send":
        index.sends.append(op)
        if op.get("value") is not None:
            add_write(index, Write(op["value"], op.get("topic"), op.get("partition"), op,
                                   send_status(op)))
    elif kind == "txn":
        index.txns.append(op)
        status = txn_status(op)
        for topic, partition, value in txn_writes(op):
            add_write(index, Write(value, topic, partition, op, status))
    elif kind == "poll":
        index.polls.append(op)
    elif kind == "seek":
        index.seeks.append(op)
    elif kind == "fence" and ok:
        index.fences.append(op)
    elif kind == "cursor" and ok:
        index.cursors.append(op)
    elif kind == "nemesis":
        index.faults.append(op)
    elif kind == "workload" and index.workload is None:
        index.workload = op
    elif kind == "final-read" and ok:
        previous = index.final_reads.get(isolation_of(op))
        if previous is None or invoke_time(op) >= invoke_time(previous):
            index.final_reads[isolation_of(op)] = op
    elif kind == "trim-send":
        index.trim_sends.append(op)
    elif kind == "stream-step" and ok:
        result = str(op.get("result"))
        index.stream_steps[result] = index.stream_steps.get(result, 0) + 1
    elif kind == "delete":
        index.deletes.append(op)
    elif kind == "final-trim-read" and ok:
        previous = index.final_trim_read
        if previous is None or invoke_time(op) >= invoke_time(previous):
            index.final_trim_read = op
    elif kind == "replicas":
        index.replicas_ops += 1
        previous = index.final_replicas
        if ok and (previous is None or invoke_time(op) >= invoke_time(previous)):
            index.final_replicas = op
    elif kind == "final-positions" and ok:
        index.final_positions_ops += 1
        previous = index.final_positions
        if previous is None or invoke_time(op) >= invoke_time(previous):
            index.final_positions = op


def add_write(index: Index, write: Write) -> None:
    index.writes.append(write)
    if write.value in index.first_writer:
        index.other_writers.setdefault(write.value, []).append(write)
    else:
        index.first_writer[write.value] = write


def visible_values(index: Index) -> dict[str, Position]:
    visible: dict[str, Position] = {}
    final = index.final_reads.get(READ_COMMITTED)
    for topic, partition, offset, value in records_of(final or {}):
        visible.setdefault(value, (topic, partition, offset))
    return visible


def final_offsets(index: Index) -> dict[tuple, list]:
    offsets: dict[tuple, set] = {}
    for isolation, op in index.final_reads.items():
        for topic, partition, offset, _ in records_of(op):
            offsets.setdefault((isolation, topic, partition), set()).add(offset)
    return {key: sorted(found) for key, found in offsets.items()}


def final_cursors(index: Index) -> dict[tuple, Any]:
    """The cursors of the latest ok cursor op of process "final", per partition."""
    cursors: dict[tuple, tuple[float, Any]] = {}
    for op in index.cursors:
        if op.get("process") != "final":
            continue
        for partition, cursor in cursor_positions(op):
            key = (op.get("subscription"), op.get("topic"), partition)
            if key not in cursors or invoke_time(op) >= cursors[key][0]:
                cursors[key] = (invoke_time(op), cursor)
    return {key: cursor for key, (_, cursor) in cursors.items()}


class Cursor(NamedTuple):
    """A subscription partition's cursor: every offset below `end` is acknowledged, and
    so is every offset in `ranges` ([start, end) pairs acknowledged individually)."""

    end: Any
    ranges: tuple = ()

    def covers(self, offset: Any) -> bool:
        return offset < self.end or any(start <= offset < stop for start, stop in self.ranges)


def cursor_positions(op: dict) -> list[tuple]:
    """(partition, Cursor) of a cursor op; an entry may carry its individual ranges third."""
    out = []
    for entry in op.get("positions") or ():
        if not well_formed(entry, 2, 1):
            continue
        ranges = entry[2] if len(entry) > 2 and isinstance(entry[2], list) else ()
        out.append((entry[0], Cursor(entry[1], tuple(
            (r[0], r[1]) for r in ranges if isinstance(r, list) and len(r) == 2))))
    return out


def observations(index: Index) -> Iterator[tuple[Position, str, bool]]:
    """Every (position, value, read_committed) a read or a send ok offset showed."""
    for op in index.polls:
        committed = isolation_of(op) == READ_COMMITTED
        for topic, partition, offset, value in records_of(op):
            yield (topic, partition, offset), value, committed
    for isolation, op in index.final_reads.items():
        for topic, partition, offset, value in records_of(op):
            yield (topic, partition, offset), value, isolation == READ_COMMITTED
    for op in index.sends:
        if op.get("outcome") == "ok" and is_number(op.get("offset")):
            yield (op.get("topic"), op.get("partition"), op["offset"]), op.get("value"), True


def committed_reads(index: Index) -> Iterator[tuple[Record, dict]]:
    """Every record a read_committed read returned, with its op (polls, then the final)."""
    for op in index.polls:
        if isolation_of(op) == READ_COMMITTED:
            for record in records_of(op):
                yield record, op
    final = index.final_reads.get(READ_COMMITTED)
    for record in records_of(final or {}):
        yield record, final


def is_aborted_read(index: Index, value: str) -> bool:
    """No writer, or every writer aborted."""
    first = index.first_writer.get(value)
    if first is None:
        return True
    if first.status != "aborted":
        return False
    return all(write.status == "aborted" for write in index.other_writers.get(value, ()))


def acknowledged(index: Index) -> set[AckKey]:
    """Acks that must be applied: of committed txns, and of unknown txns whose writes
    are all visible (so they committed)."""
    keys: set[AckKey] = set()
    for op in index.txns:
        if not op.get("acks"):
            continue
        status = txn_status(op)
        if status == "committed" or (status == "unknown" and all_visible(index, op)):
            keys.update(txn_acks(op))
    return keys


def all_visible(index: Index, op: dict) -> bool:
    writes = txn_writes(op)
    return bool(writes) and all(value in index.visible for _, _, value in writes)


def listed(position: tuple) -> list:
    return list(position)


# ---------------------------------------------------------------- anomalies


def find_lost_writes(index: Index) -> list[dict]:
    lost: dict[str, dict] = {}
    for write in index.writes:
        if write.status == "committed" and write.value not in index.visible \
                and write.value not in lost:
            lost[write.value] = {"kind": write.op.get("f"), "value": write.value,
                                 "topic": write.topic, "partition": write.partition,
                                 "op": describe(write.op)}
    return list(lost.values())


def find_misplaced_writes(index: Index) -> list[dict]:
    """Writes (sends, and a txn's writes, which carry no offset of their own) visible in
    another (topic, partition) than the one they name."""
    found: dict[str, dict] = {}
    for write in index.writes:
        position = index.visible.get(write.value)
        if position is None or write.topic is None or write.partition is None \
                or write.value in found:
            continue
        if (position[0], position[1]) != (write.topic, write.partition):
            found[write.value] = {"kind": write.op.get("f"), "value": write.value,
                                  "sent_to": [write.topic, write.partition],
                                  "visible_at": listed(position), "op": describe(write.op)}
    return list(found.values())


def find_duplicates(index: Index) -> list[dict]:
    final = index.final_reads.get(READ_COMMITTED)
    held = ({(topic, partition, offset) for topic, partition, offset, _ in records_of(final)}
            if final is not None else None)
    first: dict[str, Position] = {}
    more: dict[str, set] = {}
    for position, value, committed in observations(index):
        if not committed and (value in index.other_writers
                              or (held is not None and position not in held)):
            continue
        seen = first.setdefault(value, position)
        if seen != position:
            more.setdefault(value, {seen}).add(position)
    return [{"kind": "positions", "value": value,
             "positions": sorted(map(listed, positions))}
            for value, positions in more.items()]


def find_aborted_reads(index: Index) -> list[dict]:
    found: dict[str, dict] = {}
    for (topic, partition, offset, value), op in committed_reads(index):
        if value in found or not is_aborted_read(index, value):
            continue
        writers = index.writers(value)
        found[value] = {"kind": "aborted" if writers else "unknown-write", "value": value,
                        "position": [topic, partition, offset], "reader": describe(op),
                        "writers": [describe(write.op) for write in writers]}
    return list(found.values())


def find_torn_transactions(index: Index) -> list[dict]:
    must_apply = acknowledged(index)
    first_gaps: dict[tuple, Any] = {}
    torn = []
    for op in index.txns:
        transaction = Transaction(op, txn_status(op), [value for _, _, value in txn_writes(op)],
                                  txn_acks(op))
        instance = (torn_writes(index, transaction)
                    or acks_not_applied(index, transaction, must_apply, first_gaps)
                    or acks_without_writes(index, transaction, must_apply))
        if instance is not None:
            torn.append(instance)
    return torn


def torn_writes(index: Index, transaction: Transaction) -> dict | None:
    committed = transaction.status == "committed"
    values = [value for value in transaction.values if committed or index.exclusive(value)]
    if len(values) < 2:
        return None
    visible = [value for value in values if value in index.visible]
    if not visible or len(visible) == len(values):
        return None
    return {"kind": "writes", "op": describe(transaction.op), "visible": visible,
            "invisible": [value for value in values if value not in index.visible]}


def acks_not_applied(index: Index, transaction: Transaction, must_apply: set[AckKey],
                     first_gaps: dict[tuple, Any]) -> dict | None:
    if not transaction.acks or transaction.status == "aborted" \
            or not transaction.all_visible(index):
        return None
    missing = []
    for subscription, topic, partition, offset in transaction.acks:
        cursor = index.final_cursors.get((subscription, topic, partition))
        if cursor is None or cursor.covers(offset):
            continue
        key = (subscription, topic, partition)
        if key not in first_gaps:
            first_gaps[key] = first_gap(index, key, cursor, must_apply)
        gap = first_gaps[key]
        if gap is None or offset < gap:
            missing.append({"ack": [subscription, topic, partition, offset],
                            "final_cursor": cursor})
    if not missing:
        return None
    return {"kind": "acks-not-applied", "op": describe(transaction.op),
            "values": transaction.values, "acks": missing}


def first_gap(index: Index, key: tuple, cursor: Any, must_apply: set[AckKey]) -> Any:
    """The first offset >= cursor with a visible record that nobody had to acknowledge:
    the cursor may rightly stop there. None when there is none."""
    subscription, topic, partition = key
    offsets = index.final_offsets.get((READ_COMMITTED, topic, partition), [])
    for position in range(bisect.bisect_left(offsets, cursor.end), len(offsets)):
        if (subscription, topic, partition, offsets[position]) not in must_apply \
                and not cursor.covers(offsets[position]):
            return offsets[position]
    return None


def acks_without_writes(index: Index, transaction: Transaction,
                        must_apply: set[AckKey]) -> dict | None:
    if not transaction.acks or transaction.status != "unknown" or not transaction.values \
            or not transaction.none_visible(index):
        return None
    applied = []
    for subscription, topic, partition, offset in transaction.acks:
        cursor = index.final_cursors.get((subscription, topic, partition))
        ack = (subscription, topic, partition, offset)
        if cursor is not None and cursor.covers(offset) and ack not in must_apply:
            applied.append({"ack": list(ack), "final_cursor": cursor})
    if not applied:
        return None
    return {"kind": "acks-applied-without-writes", "op": describe(transaction.op),
            "values": transaction.values, "acks": applied}


def find_inconsistent_offsets(index: Index) -> list[dict]:
    first: dict[Position, str] = {}
    more: dict[Position, set] = {}
    for position, value, _ in observations(index):
        seen = first.setdefault(position, value)
        if seen != value:
            more.setdefault(position, {seen}).add(value)
    return [{"position": list(position), "values": sorted(values, key=str)}
            for position, values in more.items()]


def assigned_sessions(index: Index) -> dict[str, list[dict]]:
    """Polls (subscription None) and seeks per session, by invoke time."""
    sessions: dict[str, list[dict]] = {}
    for op in index.polls:
        if op.get("subscription") is None:
            sessions.setdefault(session_of(op), []).append(op)
    for op in index.seeks:
        if session_of(op) in sessions:
            sessions[session_of(op)].append(op)
    for ops in sessions.values():
        ops.sort(key=invoke_time)  # stable: a seek listed after a poll of the same time
    return sessions


def seek_positions(op: dict) -> list[tuple]:
    return [tuple(entry[:3]) for entry in op.get("positions") or ()
            if well_formed(entry, 3, 2)]


def find_non_monotonic_polls(index: Index) -> list[dict]:
    found = []
    for session, ops in assigned_sessions(index).items():
        previous: dict[tuple, tuple] = {}  # (topic, partition) -> (offset, value)
        for op in ops:
            if op["f"] == "seek":
                for topic, partition, _ in seek_positions(op):
                    previous.pop((topic, partition), None)
                continue
            for topic, partition, offset, value in records_of(op):
                last = previous.get((topic, partition))
                if last is not None and offset <= last[0]:
                    found.append({"session": session, "topic": topic, "partition": partition,
                                  "previous": {"offset": last[0], "value": last[1]},
                                  "offset": offset, "value": value, "op": describe(op)})
                previous[(topic, partition)] = (offset, value)
    return found


def find_skipped_polls(index: Index) -> list[dict]:
    found = []
    for session, ops in assigned_sessions(index).items():
        lower: dict[tuple, tuple] = {}  # (topic, partition) -> (first unread offset, how)
        for op in ops:
            if op["f"] == "seek":
                for topic, partition, offset in seek_positions(op):
                    lower[(topic, partition)] = (offset, "seek")
                continue
            isolation = isolation_of(op)
            if isolation not in index.final_reads:
                continue  # not decidable; find_problems says so
            for topic, partition, offset, _ in records_of(op):
                start = lower.get((topic, partition))
                if start is not None and start[0] < offset:
                    skipped = skipped_offsets(index, isolation, topic, partition,
                                              start[0], offset)
                    if skipped:
                        found.append({"session": session, "isolation": isolation,
                                      "topic": topic, "partition": partition,
                                      "after": start[1], "from": start[0], "read": offset,
                                      "skipped": skipped[:MAX_EXAMPLES],
                                      "skipped_count": len(skipped), "op": describe(op)})
                lower[(topic, partition)] = (offset + 1, "read")
    return found


def skipped_offsets(index: Index, isolation: str, topic: Any, partition: Any,
                    start: int, end: int) -> list:
    """Offsets start <= c < end holding a record in the final read of that isolation."""
    offsets = index.final_offsets.get((isolation, topic, partition), [])
    return offsets[bisect.bisect_left(offsets, start):bisect.bisect_left(offsets, end)]


def find_cursor_regressions(index: Index) -> list[dict]:
    series: dict[tuple, list[tuple]] = {}
    for op in index.cursors:
        for partition, cursor in cursor_positions(op):
            key = (op.get("subscription"), op.get("topic"), partition)
            series.setdefault(key, []).append((invoke_time(op), as_time(op.get("complete")),
                                               cursor, op))
    found = []
    for key, observed in series.items():
        found.extend(regressions(key, observed))
    return found


def regressions(key: tuple, observed: list[tuple]) -> list[dict]:
    """Sweep by invoke time, holding the highest cursor of the observations that completed
    before the current one was invoked."""
    completed = sorted((item for item in observed if item[1] is not None),
                       key=lambda item: item[1])
    highest, next_completed, found = None, 0, []
    for invoked, _, cursor, op in sorted(observed, key=lambda item: item[0]):
        while next_completed < len(completed) and completed[next_completed][1] < invoked:
            candidate = completed[next_completed]
            highest = candidate if highest is None else \
                (highest[0], highest[1], union(highest[2], candidate[2]), candidate[3])
            next_completed += 1
        if highest is not None and (cursor.end < highest[2].end
                                    or uncovered(highest[2], cursor)):
            subscription, topic, partition = key
            found.append({"subscription": subscription, "topic": topic,
                          "partition": partition, "earlier": list(highest[2]),
                          "later": list(cursor), "earlier_op": describe(highest[3]),
                          "later_op": describe(op)})
    return found


def union(first: Cursor, second: Cursor) -> Cursor:
    """Everything either cursor acknowledged."""
    end = max(first.end, second.end)
    ranges = sorted((max(a, end), b) for a, b in (*first.ranges, *second.ranges) if b > end)
    merged: list[tuple] = []
    for start, stop in ranges:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    if merged and merged[0][0] == end:  # contiguous with the cursor
        end = merged.pop(0)[1]
    return Cursor(end, tuple(merged))


def uncovered(earlier: Cursor, later: Cursor) -> list[tuple]:
    """The offset ranges `earlier` acknowledged individually that `later` no longer does."""
    left = [(max(start, later.end), stop) for start, stop in earlier.ranges if stop > later.end]
    for start, stop in later.ranges:
        left = [piece for a, b in left
                for piece in ((a, min(b, start)), (max(a, stop), b)) if piece[0] < piece[1]]
    return left


def fence_timelines(index: Index) -> dict[Any, tuple[list[float], list[tuple]]]:
    """Per transactional_id: the completion times of its ok fences, ascending, and beside
    each the highest (epoch, fence op) completed by then."""
    timelines: dict[Any, tuple[list[float], list[tuple]]] = {}
    fences = [op for op in index.fences
              if as_time(op.get("complete")) is not None and is_number(op.get("epoch"))]
    for op in sorted(fences, key=lambda op: float(op["complete"])):
        completes, highest = timelines.setdefault(op.get("transactional_id"), ([], []))
        keep = highest and highest[-1][0] >= op["epoch"]
        completes.append(float(op["complete"]))
        highest.append(highest[-1] if keep else (op["epoch"], op))
    return timelines


def find_fenced_writes_visible(index: Index) -> list[dict]:
    timelines = fence_timelines(index)
    found = []
    for op in index.txns:
        instance = fenced_write(index, op, timelines)
        if instance is not None:
            found.append(instance)
    return found


def fenced_write(index: Index, op: dict, timelines: dict) -> dict | None:
    epoch, transactional_id = op.get("epoch"), op.get("transactional_id")
    if not is_number(epoch) or transactional_id not in timelines:
        return None
    moment = as_time(op.get("commit_invoke"))
    moment = moment if moment is not None else invoke_time(op)
    completes, highest = timelines[transactional_id]
    before = bisect.bisect_left(completes, moment)  # fences completed strictly before
    if before == 0 or highest[before - 1][0] <= epoch:
        return None
    visible = [value for _, _, value in txn_writes(op)
               if value in index.visible and index.exclusive(value)]
    if not visible:
        return None
    fence_epoch, fence = highest[before - 1]
    return {"transactional_id": transactional_id, "epoch": epoch, "fence_epoch": fence_epoch,
            "visible": visible, "op": describe(op), "fence": describe(fence)}


def delivered_time(poll: dict) -> float:
    """When the server delivered what a subscription poll returned: its "received" time,
    else (older histories, or nothing received yet) its invoke."""
    received = poll.get("received")
    return received if is_number(received) else invoke_time(poll)


def find_lost_acks(index: Index) -> list[dict]:
    acked: dict[AckKey, tuple[float, dict]] = {}
    for op in index.txns:
        complete = as_time(op.get("complete"))
        if txn_status(op) != "committed" or complete is None:
            continue
        for ack in txn_acks(op):
            if ack not in acked or complete < acked[ack][0]:
                acked[ack] = (complete, op)
    found: dict[AckKey, dict] = {}
    for poll in index.polls:
        subscription = poll.get("subscription")
        if subscription is None:
            continue
        for topic, partition, offset, value in records_of(poll):
            key = (subscription, topic, partition, offset)
            if key in acked and key not in found and delivered_time(poll) > acked[key][0]:
                found[key] = {"ack": list(key), "value": value,
                              "txn": describe(acked[key][1]), "poll": describe(poll)}
    return list(found.values())


def find_reordered_writes(index: Index) -> list[dict]:
    last: dict[tuple, tuple] = {}  # (producer, topic, partition) -> (offset, value, op)
    found = []
    for op in sorted(index.txns, key=invoke_time):
        producer = op.get("producer")
        if producer is None or txn_status(op) != "committed":
            continue
        for topic, partition, value in txn_writes(op):
            position = index.visible.get(value)
            if position is None or not index.exclusive(value) or not is_number(position[2]):
                continue
            key = (producer, topic, partition)
            before = last.get(key)
            if before is not None and position[2] < before[0]:
                # (Within one transaction too: its writes to a partition land in the
                # order they were sent, as the SDK promises for every send.)
                found.append({"kind": "partition-order" if before[2] is not op
                              else "txn-order", "producer": producer,
                              "value": value, "position": listed(position),
                              "earlier_value": before[1],
                              "earlier_position": [topic, partition, before[0]],
                              "op": describe(op), "earlier_op": describe(before[2])})
            if before is None or position[2] > before[0]:
                last[key] = (position[2], value, op)
    return found


def find_hanging_transactions(index: Index) -> list[dict]:
    found = []
    for entry in (index.final_positions or {}).get("partitions") or ():
        if not isinstance(entry, dict):
            continue
        high, read = entry.get("high_watermark"), entry.get("max_read_position")
        open_txns = list(entry.get("open_txns") or ())
        if open_txns or (is_number(high) and is_number(read) and read < high):
            found.append({"topic": entry.get("topic"), "partition": entry.get("partition"),
                          "high_watermark": high, "max_read_position": read,
                          "open_txns": open_txns})
    return found


def find_diverged_replicas(index: Index) -> list[dict]:
    """Partitions of the last ok replicas op whose copies differ: each copy is
    {"server", "bases" (where its segments start), "end" (its log end), "digest" (of its
    whole batches)}."""
    found = [{"kind": "out-of-sync", "partition": name}
             for name in (index.final_replicas or {}).get("out_of_sync") or ()]
    for entry in (index.final_replicas or {}).get("partitions") or ():
        if not isinstance(entry, dict):
            continue
        copies = [c for c in entry.get("copies") or () if isinstance(c, dict)]
        kinds = []
        if len({tuple(c.get("bases") or ()) for c in copies}) > 1:
            kinds.append("segment-bases")
        if len({(c.get("end"), c.get("digest")) for c in copies}) > 1:
            kinds.append("batches")
        if kinds:
            found.append({"kind": "+".join(kinds), "topic": entry.get("topic"),
                          "partition": entry.get("partition"), "copies": copies})
    return found


def find_vanished_reads(index: Index) -> list[dict]:
    found: dict[str, dict] = {}
    for op in index.polls:
        if isolation_of(op) != READ_COMMITTED:
            continue
        for topic, partition, offset, value in records_of(op):
            if value in index.visible or value in found or is_aborted_read(index, value):
                continue
            found[value] = {"value": value, "position": [topic, partition, offset],
                            "poll": describe(op),
                            "writers": [describe(write.op) for write in index.writers(value)]}
    return list(found.values())


def failing_spans(index: Index) -> Iterator[dict]:
    """Per writer, each span in which it tried and made no progress (see "stall" in the
    module doc): {"process", "from", "to", "seconds", "attempts" (ops that did not end ok
    in it), "errors" (their reasons, the most frequent first), "ended" ("ok": an ok op
    ended it; "never": the history ended first)}. Ops are taken in invoke order (a
    client's pipelined commits may complete out of it; the spans are approximate by
    that much)."""
    by_process: dict[str, list[dict]] = {}
    for op in index.sends + index.txns:
        if as_time(op.get("invoke")) is not None:
            by_process.setdefault(str(op.get("process")), []).append(op)
    for process, ops in sorted(by_process.items()):
        ops.sort(key=invoke_time)
        began, last, errors = None, None, {}
        for op in ops:
            invoked = invoke_time(op)
            ended = as_time(op.get("complete"))
            if op.get("outcome") == "ok":
                start = began if began is not None else invoked
                if ended is not None and ended > start:
                    yield {"process": process, "from": start, "to": ended,
                           "seconds": ended - start,
                           "attempts": sum(errors.values()),
                           "errors": sorted(errors, key=errors.get, reverse=True)[:3],
                           "ended": "ok"}
                began, last, errors = None, None, {}
                continue
            if began is None:
                began = invoked
            last = max(invoked if last is None else last,
                       ended if ended is not None else invoked)
            reason = str(op.get("error") or op.get("outcome"))[:120]
            errors[reason] = errors.get(reason, 0) + 1
        if began is not None:
            yield {"process": process, "from": began, "to": last, "seconds": last - began,
                   "attempts": sum(errors.values()),
                   "errors": sorted(errors, key=errors.get, reverse=True)[:3],
                   "ended": "never"}


def find_stalls(index: Index, limit_s: float = STALL_S) -> tuple[list[dict], float]:
    """The failing spans longer than `limit_s`, and the longest span of all (0 if none)."""
    stalls, longest = [], 0.0
    for span in failing_spans(index):
        longest = max(longest, span["seconds"])
        if span["seconds"] > limit_s:
            stalls.append({**span, "seconds": round(span["seconds"], 3)})
    return stalls, longest


def check_consume_transform_produce(index: Index) -> dict[str, list[dict]]:
    """Exactly-once processing of a ctp workload: every visible input has at most one
    visible output (transform + input value), and one if it was acknowledged (below the
    final cursor of the workload's subscription). {anomaly name: instances}."""
    workload = index.workload or {}
    input_topic, output_topic = workload.get("input_topic"), workload.get("output_topic")
    final = index.final_reads.get(READ_COMMITTED)
    if not input_topic or not output_topic or final is None:
        return {}
    transform = workload.get("transform")
    transform = DEFAULT_TRANSFORM if transform is None else str(transform)
    subscription = workload.get("subscription")
    outputs: dict[str, list[list]] = {}
    inputs: list[Record] = []
    for record in records_of(final):
        if record[0] == output_topic:
            outputs.setdefault(record[3], []).append(listed(record[:3]))
        if record[0] == input_topic:
            inputs.append(record)
    found: dict[str, list[dict]] = {"duplicate": [], "lost-write": []}
    for topic, partition, offset, value in inputs:
        output = f"{transform}{value}"
        positions = outputs.get(output, [])
        base = {"value": output, "input": {"value": value,
                                          "position": [topic, partition, offset]}}
        if len(positions) > 1:
            found["duplicate"].append({"kind": "ctp-output", **base, "positions": positions})
        cursor = index.final_cursors.get((subscription, topic, partition))
        if not positions and cursor is not None and cursor.covers(offset):
            found["lost-write"].append({"kind": "ctp-acked-without-output", **base,
                                        "final_cursor": cursor})
    return found


def merge_by_value(plain: list[dict], extra: list[dict]) -> list[dict]:
    """One instance per value: an extra instance of a value already found is folded into
    the plain one (its kind wins, the plain one's fields stay)."""
    by_value = {instance["value"]: instance for instance in plain}
    merged = list(plain)
    for instance in extra:
        existing = by_value.get(instance["value"])
        if existing is None:
            by_value[instance["value"]] = instance
            merged.append(instance)
        else:
            existing.update({key: item for key, item in instance.items()
                             if key not in existing or key == "kind"})
    return merged


# ---------------------------------------------------------------- the report


def find_stream_steps_twice(index: Index) -> list[dict]:
    parents: dict[tuple, dict[str, dict]] = {}  # (stream, ordinal) -> parent -> an op
    for op in index.txns:
        stream, ordinal = op.get("stream"), op.get("ordinal")
        if stream is None or ordinal is None or not all_visible(index, op):
            continue
        parents.setdefault((str(stream), str(ordinal)), {}).setdefault(
            str(op.get("parent")), op)
    return [{"stream": stream, "ordinal": ordinal, "parents": sorted(found),
             "ops": [describe(op) for op in list(found.values())[:4]]}
            for (stream, ordinal), found in sorted(parents.items()) if len(found) > 1]


def find_resurrected_deletes(index: Index) -> list[dict]:
    """See the module doc: per partition of the trim topic, the records (or the log
    start) the final-trim-read shows below the highest log start an ok delete answered,
    and the ok trim-sends above every attempted delete that it does not hold."""
    final = index.final_trim_read
    if final is None:
        return []
    acknowledged: dict[Any, tuple[int, dict]] = {}  # partition -> (highest start, its op)
    attempted: dict[Any, int] = {}  # partition -> highest before_offset of any delete
    for op in index.deletes:
        partition, before = op.get("partition"), op.get("before_offset")
        if is_number(before):
            attempted[partition] = max(attempted.get(partition, before), before)
        start = op.get("log_start")
        if op.get("outcome") == "ok" and is_number(start) and \
                start > acknowledged.get(partition, (-1, None))[0]:
            acknowledged[partition] = (start, op)
    held: dict[tuple, Any] = {}
    for entry in final.get("records") or ():
        if well_formed(entry, 3, 1):
            held[(entry[0], entry[1])] = entry[2]
    found = []
    starts = {entry[0]: entry[1] for entry in final.get("starts") or ()
              if isinstance(entry, list) and len(entry) == 2}
    for partition, (start, op) in sorted(acknowledged.items(), key=lambda kv: str(kv[0])):
        below = [offset for (p, offset) in held if p == partition and offset < start]
        shown_start = starts.get(partition)
        if below or (is_number(shown_start) and shown_start < start):
            found.append({"kind": "read-below-start", "partition": partition,
                          "acknowledged_start": start, "final_start": shown_start,
                          "records_below": len(below), "lowest": min(below, default=None),
                          "op": describe(op)})
    for op in index.trim_sends:
        partition, offset, value = op.get("partition"), op.get("offset"), op.get("value")
        if op.get("outcome") != "ok" or not is_number(offset):
            continue
        if offset < attempted.get(partition, -1):
            continue  # a delete may have taken it
        if held.get((partition, offset)) != value:
            found.append({"kind": "trim-lost-write", "partition": partition,
                          "offset": offset, "value": value,
                          "read": held.get((partition, offset)), "op": describe(op)})
    return found


def find_problems(index: Index) -> list[str]:
    problems = []
    if not index.has_committed_final_read:
        problems.append("no ok read_committed final-read: lost-write, torn-transaction, "
                        "vanished-read, reordered-writes, stream-step-twice and the ctp "
                        "checks were not decided")
    if index.final_positions is None:
        problems.append("no ok final-positions op: hanging-transaction was not decided")
    if index.replicas_ops and index.final_replicas is None:
        problems.append("no ok replicas op: diverged-replicas was not decided")
    if (index.trim_sends or index.deletes) and index.final_trim_read is None:
        problems.append("trim-sends or deletes but no ok final-trim-read: "
                        "resurrected-delete was not decided")
    if READ_UNCOMMITTED not in index.final_reads and any(
            isolation_of(op) == READ_UNCOMMITTED and op.get("subscription") is None
            for op in index.polls):
        problems.append("read_uncommitted reader sessions but no ok read_uncommitted "
                        "final-read: their skipped-poll was not decided")
    workload = index.workload or {}
    if workload.get("input_topic") and workload.get("output_topic"):
        subscription = workload.get("subscription")
        if not any(key[0] == subscription and key[1] == workload["input_topic"]
                   for key in index.final_cursors):
            problems.append(f"ctp workload but no final cursor of subscription "
                            f"{subscription!r} on {workload['input_topic']!r}: acknowledged "
                            f"inputs without output were not checked")
    return problems


def compute_stats(index: Index) -> dict:
    statuses = [txn_status(op) for op in index.txns]
    outcomes = [op.get("outcome") for op in index.sends]
    return {
        "ops": index.operations,
        "ignored_ops": index.ignored_ops,
        "committed_txns": statuses.count("committed"),
        "aborted_txns": statuses.count("aborted"),
        "unknown_txns": statuses.count("unknown"),
        "sends_ok": outcomes.count("ok"),
        "sends_failed": outcomes.count("fail"),
        "sends_unknown": len(outcomes) - outcomes.count("ok") - outcomes.count("fail"),
        "polls": len(index.polls),
        "records_read": sum(len(op.get("records") or ()) for op in index.polls),
        "final_read_records": {isolation: len(op.get("records") or ())
                               for isolation, op in sorted(index.final_reads.items())},
        "visible_values": len(index.visible),
        "cursor_observations": len(index.cursors),
        "final_positions_ops": index.final_positions_ops,
        "trim_sends_ok": sum(op.get("outcome") == "ok" for op in index.trim_sends),
        "deletes_ok": sum(op.get("outcome") == "ok" for op in index.deletes),
        # spark-lite's job opens by result: opened, found (by its key, committed) or
        # refused (a replay the stream held back: stream-step-twice's other side)
        "stream_steps": dict(sorted(index.stream_steps.items())),
        "faults": len(index.faults),
        "fault_seconds": round(sum(fault_seconds(index, op) for op in index.faults), 3),
    }


def fault_seconds(index: Index, op: dict) -> float:
    """A fault lasts from invoke to complete (healed); never healed: to the history's end."""
    began = as_time(op.get("invoke"))
    if began is None:
        return 0.0
    ended = as_time(op.get("complete"))
    return max(0.0, (ended if ended is not None else index.latest_time) - began)


def check(history: list[dict]) -> dict:
    """The report of a history; see the module doc for every anomaly."""
    index = build_index(history)
    found = {name: [] for name in ANOMALIES}
    found["duplicate"] = find_duplicates(index)
    found["aborted-read"] = find_aborted_reads(index)
    found["inconsistent-offsets"] = find_inconsistent_offsets(index)
    found["non-monotonic-poll"] = find_non_monotonic_polls(index)
    found["skipped-poll"] = find_skipped_polls(index)
    found["cursor-regression"] = find_cursor_regressions(index)
    found["fenced-write-visible"] = find_fenced_writes_visible(index)
    found["lost-ack"] = find_lost_acks(index)
    found["hanging-transaction"] = find_hanging_transactions(index)
    found["diverged-replicas"] = find_diverged_replicas(index)
    found["resurrected-delete"] = find_resurrected_deletes(index)
    if index.has_committed_final_read:
        found["lost-write"] = find_lost_writes(index)
        found["torn-transaction"] = find_torn_transactions(index)
        found["vanished-read"] = find_vanished_reads(index)
        found["reordered-writes"] = find_reordered_writes(index)
        found["misplaced-write"] = find_misplaced_writes(index)
        found["stream-step-twice"] = find_stream_steps_twice(index)
    for name, instances in check_consume_transform_produce(index).items():
        found[name] = merge_by_value(found[name], instances)
    problems = find_problems(index)
    stalls, longest = find_stalls(index)
    problems += [f"stall: {stall['process']} made no progress for {stall['seconds']:.0f} s "
                 f"({stall['attempts']} attempts; {', '.join(stall['errors']) or 'one slow op'}"
                 f"{'; never recovered' if stall['ended'] == 'never' else ''})"
                 for stall in stalls]
    anomalies = {name: len(found[name]) for name in ANOMALIES}
    return {"valid": not problems and not any(anomalies.values()),
            "anomalies": anomalies,
            "examples": {name: found[name][:MAX_EXAMPLES] for name in ANOMALIES},
            "stats": {**compute_stats(index), "longest_failing_s": round(longest, 3)},
            "stalls": stalls[:MAX_EXAMPLES],
            "problems": problems}


def format_report(report: dict, examples_per_anomaly: int = 3) -> str:
    anomalies = report.get("anomalies") or {}
    problems = report.get("problems") or []
    lines = [f"valid: {report.get('valid')} ({sum(anomalies.values())} anomalies, "
             f"{len(problems)} problems)"]
    lines += [f"problem: {problem}" for problem in problems]
    width = max(map(len, ANOMALIES))
    lines += [f"{name:<{width}}  {anomalies.get(name, 0):>7}  {DESCRIPTIONS[name]}"
              for name in ANOMALIES]
    stats = report.get("stats") or {}
    lines.append("stats: " + ", ".join(f"{key}={value}" for key, value in stats.items()))
    for name in ANOMALIES:
        if not anomalies.get(name):
            continue
        shown = (report.get("examples") or {}).get(name, [])[:examples_per_anomaly]
        lines.append(f"{name} examples:")
        lines += ["  " + json.dumps(example, sort_keys=True, default=str) for example in shown]
        if anomalies[name] > len(shown):
            lines.append(f"  ... {anomalies[name] - len(shown)} more")
    return "\n".join(lines)


def check_file(path) -> dict:
    """check() of a merged history file (history.jsonl)."""
    from .history import read_history
    return check(read_history(path))
