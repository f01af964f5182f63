"""Interaction scripts for the TC partition core (coordinator/core.py), etcd-raft style.

Each script drives the core step by step through a `Shell` that plays the coordinator's
shell: it holds the TC log (the records made durable so far), the appends in flight, the
markers in flight and the replies waiting for their append. The script decides what
happens and when: an append becomes durable, fails, or is written without the owner
hearing of it; a marker is confirmed late, twice, or lost; the clock moves; the owner
crashes and a new one (next coordinator epoch) loads the log — by full replay or from a
snapshot plus the tail. Every step is printed; the transcript is compared with
tests/golden/coordinator/<script>.txt. `UPDATE_GOLDEN=1 pytest tests/test_coordinator_scripts.py`
rewrites the golden files (review the diff: it is the behaviour).
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections import deque
from pathlib import Path

import pytest

from coordinator.core import (
    Append, Limits, Marker, ProducerIdNeeded, Ready, TcPartitionCore, replay,
)
from coordinator.records import (
    Decision, Opened, Session, SessionStarted, SubscriptionPartition, TopicPartition, TxnId,
    decode_record, encode_record,
)
from services.errors import AtomlogError

GOLDEN_DIR = Path(__file__).parent / "golden" / "coordinator"
TC = 3
COMMIT, ABORT = Decision.COMMIT, Decision.ABORT


def tp(name: str) -> TopicPartition:
    topic, partition = name.split("/")
    return TopicPartition(topic, int(partition))


def sub(name: str) -> SubscriptionPartition:
    target, subscription = name.split("@")
    topic, partition = target.split("/")
    return SubscriptionPartition(topic, int(partition), subscription)


def txn(sequence: int) -> TxnId:
    return TxnId(TC, sequence)


# ---------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------

def fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, (TxnId, TopicPartition, SubscriptionPartition, Session)):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, AtomlogError):
        return f"! {value.reason}: {value.message}"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(fmt(item) for item in value) + "]"
    if dataclasses.is_dataclass(value):
        shown = []
        for item in dataclasses.fields(value):
            field_value = getattr(value, item.name)
            if field_value in (None, "", (), []) and item.name != "reply":
                continue
            shown.append(f"{item.name}={fmt(field_value)}")
        return f"{type(value).__name__}({' '.join(shown)})"
    return str(value)


def fmt_markers(markers: tuple[Marker, ...]) -> list[str]:
    grouped: dict[tuple[TxnId, Decision, int], list[str]] = {}
    for marker in markers:
        key = (marker.txn_id, marker.decision, marker.coordinator_epoch)
        grouped.setdefault(key, []).append(str(marker.target))
    return [f"marker {txn_id} {decision.name} epoch={epoch} -> {', '.join(targets)}"
            for (txn_id, decision, epoch), targets in grouped.items()]


def fmt_call(method: str, args: tuple, kwargs: dict) -> str:
    shown = [fmt(arg) for arg in args] + [f"{k}={fmt(v)}" for k, v in kwargs.items()]
    return f"{method}({', '.join(shown)})"


# ---------------------------------------------------------------------------------------
# The shell, played by the script
# ---------------------------------------------------------------------------------------

class Shell:
    def __init__(self, title: str, limits: Limits | None = None, log: tuple = (),
                 start_ms: int = 1_000) -> None:
        self.limits = limits or Limits()
        self.lines = [f"# {title}"]
        self.coordinator_epoch = 1
        self.log: list[bytes] = [encode_record(record) for record in log]
        self.core = replay(self.records(), TC, self.limits, self.coordinator_epoch)
        self.now_ms = start_ms
        self.in_flight: deque[Append] = deque()
        self.waiting: dict[int, tuple[str, object]] = {}  # append id -> (caller, reply)
        self.markers: list[Marker] = []  # sent, not confirmed
        self.snapshot: tuple[bytes, int] | None = None  # (data, log length it covers)
        self.next_producer_id = 1000
        if log:
            self.say(f"(the log starts with {len(log)} records)")

    def records(self):
        return [decode_record(value) for value in self.log]

    def say(self, text: str) -> None:
        self.lines.append(text)

    def note(self, text: str) -> None:
        self.lines.append(f"-- {text}")

    def advance(self, ms: int) -> None:
        self.now_ms += ms

    # -- inputs -------------------------------------------------------------------------

    def call(self, method: str, *args, **kwargs) -> object:
        """Call a client or operator input; print the outcome; return the reply (None on
        error or when the reply waits for an append)."""
        self.say(f"t={self.now_ms} {fmt_call(method, args, kwargs)}")
        return self._run(method, lambda: getattr(self.core, method)(self.now_ms, *args,
                                                                   **kwargs))

    def init_producer_id(self, transactional_id: str, **kwargs) -> object:
        """InitProducerId as the shell serves it: ask the allocator only when needed."""
        self.say(f"t={self.now_ms} {fmt_call('init_producer_id', (transactional_id,), kwargs)}")
        try:
            return self._run("init_producer_id", lambda: self.core.init_producer_id(
                self.now_ms, transactional_id, **kwargs), quiet_errors=(ProducerIdNeeded,))
        except ProducerIdNeeded as needed:
            self.say(f"  needs a producer id ({needed}); the allocator gives "
                     f"{self.next_producer_id}")
            self.next_producer_id += 1
            return self._run("init_producer_id", lambda: self.core.init_producer_id(
                self.now_ms, transactional_id, fresh_producer_id=self.next_producer_id - 1,
                **kwargs))

    def _run(self, caller: str, thunk, quiet_errors: tuple = ()) -> object:
        try:
            ready = thunk()
        except AtomlogError as error:
            self.say(f"  {fmt(error)}")
            return None
        except quiet_errors:
            raise
        return self._perform(ready, caller)

    def _perform(self, ready: Ready, caller: str) -> object:
        for append in ready.appends:
            self.in_flight.append(append)
            self.say(f"  append #{append.append_id}: {fmt(list(append.records))}")
        if ready.reply is not None and ready.appends:
            self.waiting[ready.appends[-1].append_id] = (caller, ready.reply)
            self.say(f"  (reply waits for append #{ready.appends[-1].append_id})")
        elif ready.reply is not None:
            self.say(f"  reply: {fmt(ready.reply)}")
        for line in fmt_markers(ready.markers):
            self.say(f"  {line}")
        self.markers.extend(ready.markers)
        if ready.completed:
            self.say(f"  completed: {fmt(ready.completed)}")
        return ready.reply if not ready.appends else None

    def durable(self, count: int = 1) -> None:
        """The oldest `count` appends in flight become durable; the owner hears of it."""
        for _ in range(count):
            append = self.in_flight.popleft()
            self.log.extend(encode_record(record) for record in append.records)
            self.say(f"t={self.now_ms} append #{append.append_id} durable")
            ready = self.core.append_done(append.append_id, self.now_ms)
            if append.append_id in self.waiting:
                caller, reply = self.waiting.pop(append.append_id)
                self.say(f"  reply to {caller}: {fmt(reply)}")
            self._perform(ready, "append_done")

    def settle(self) -> None:
        """Every append in flight (and every follow-up) becomes durable."""
        while self.in_flight:
            self.durable()

    def append_fails(self) -> None:
        """The oldest append is refused before it is written (known not in the log)."""
        append = self.in_flight.popleft()
        self.say(f"t={self.now_ms} append #{append.append_id} refused (not written)")
        self._perform(self.core.append_failed(append.append_id), "append_failed")
        if append.append_id in self.waiting:
            caller, _ = self.waiting.pop(append.append_id)
            self.say(f"  reply to {caller}: the append's failure (retriable)")

    def written_unacknowledged(self) -> None:
        """The oldest append reaches the log, but the owner never hears of it."""
        append = self.in_flight.popleft()
        self.log.extend(encode_record(record) for record in append.records)
        self.say(f"t={self.now_ms} append #{append.append_id} written; the owner is not told")

    def confirm(self, txn_id: TxnId, target_name: str, *, again: bool = False) -> None:
        """A partition server confirms a marker (again=True: a duplicate or late one)."""
        target = sub(target_name) if "@" in target_name else tp(target_name)
        matching = [m for m in self.markers if m.txn_id == txn_id and m.target == target]
        assert matching or again, f"no marker {txn_id} -> {target} in flight"
        for marker in matching:
            self.markers.remove(marker)
        self.say(f"t={self.now_ms} confirm {txn_id} {target}"
                 f"{' (duplicate/late)' if again else ''}")
        self._perform(self.core.marker_confirmed(self.now_ms, txn_id, target), "confirm")

    def confirm_all(self) -> None:
        while self.markers:
            marker = self.markers[0]
            self.confirm(marker.txn_id, str(marker.target))

    def lose_markers(self) -> None:
        self.say(f"t={self.now_ms} {len(self.markers)} markers in flight are lost")
        self.markers.clear()

    def tick(self, advance_ms: int = 0) -> None:
        self.advance(advance_ms)
        self.say(f"t={self.now_ms} tick")
        self._perform(self.core.tick(self.now_ms), "tick")

    def take_snapshot(self) -> None:
        data = self.core.snapshot(covered_offset=len(self.log))
        self.snapshot = (data, len(self.log))
        self.say(f"t={self.now_ms} snapshot covering {len(self.log)} log records")

    def crash(self, from_snapshot: bool = False) -> None:
        """The owner dies: appends in flight, replies waiting and markers in flight are
        lost. The next owner (coordinator epoch + 1) loads the log and ticks."""
        self.coordinator_epoch += 1
        lost = [a.append_id for a in self.in_flight]
        self.in_flight.clear()
        self.waiting.clear()
        self.markers.clear()
        records = self.records()
        if from_snapshot:
            assert self.snapshot is not None
            data, covered = self.snapshot
            base, covered_offset = TcPartitionCore.restore(data, TC, self.limits,
                                                           self.coordinator_epoch)
            assert covered_offset == covered
            self.core = replay(records[covered:], TC, base=base)
            how = f"snapshot + {len(records) - covered} tail records"
        else:
            self.core = replay(records, TC, self.limits, self.coordinator_epoch)
            how = f"{len(records)} log records"
        self.say(f"t={self.now_ms} CRASH (appends lost: {fmt(lost)}); new owner, coordinator "
                 f"epoch {self.coordinator_epoch}, loads {how}")
        self.tick()

    # -- queries ------------------------------------------------------------------------

    def status(self, txn_id: TxnId) -> None:
        try:
            self.say(f"  status {txn_id}: {fmt(self.core.status(txn_id, self.now_ms))}")
        except AtomlogError as error:
            self.say(f"  status {txn_id}: {fmt(error)}")

    def describe(self, txn_id: TxnId) -> None:
        description = self.core.describe(txn_id, self.now_ms)
        summary = description.summary
        parts = [f"{summary.state.name}", f"cause={summary.end_cause.name}"]
        if description.topic_partitions or description.subscription_partitions:
            parts.append("targets=" + fmt([*description.topic_partitions,
                                           *description.subscription_partitions]))
        pending = [*description.marker_pending_topic_partitions,
                   *description.marker_pending_subscription_partitions]
        if pending:
            parts.append(f"markers_pending={fmt(pending)}")
        if description.marker_retry_count:
            parts.append(f"marker_retries={description.marker_retry_count}")
        if description.children:
            parts.append("children=[" + ", ".join(
                f"{c.txn_id}:{c.state.name}" for c in description.children) + "]")
        if description.kept_child_txn_ids:
            parts.append(f"kept={fmt(description.kept_child_txn_ids)}")
        if description.aborted_child_txn_ids:
            parts.append(f"aborted={fmt(description.aborted_child_txn_ids)}")
        self.say(f"  describe {txn_id}: {' '.join(parts)}")

    def transcript(self) -> str:
        return "\n".join(self.lines) + "\n"


# ---------------------------------------------------------------------------------------
# Scripts
# ---------------------------------------------------------------------------------------

def script_commit_happy_path() -> Shell:
    s = Shell("commit: open, register, decide, markers, complete; retries of each step")
    s.call("new_txn", topic_partitions=[tp("orders/0"), tp("orders/1")],
           subscription_partitions=[sub("events/0@billing")])
    s.durable()
    s.call("add_partitions", txn(1), [tp("orders/1"), tp("audit/0")])
    s.note("orders/1 is already registered: only audit/0 is logged")
    s.durable()
    s.call("add_partitions", txn(1), [tp("audit/0")])
    s.note("nothing new: answered at once, nothing logged")
    s.call("end_txn", txn(1), COMMIT)
    s.call("end_txn", txn(1), COMMIT)
    s.note("a retry while the decision is being logged is told to retry")
    s.durable()
    s.status(txn(1))
    s.call("end_txn", txn(1), COMMIT)
    s.call("end_txn", txn(1), ABORT)
    s.call("add_partitions", txn(1), [tp("audit/1")])
    s.call("prepare", txn(1))
    s.confirm_all()
    s.settle()
    s.describe(txn(1))
    s.call("end_txn", txn(1), COMMIT)
    s.call("abort", txn(1))
    s.call("end_txn", txn(99), COMMIT)
    s.call("end_txn", TxnId(4, 1), COMMIT)
    return s


def script_crash_at_each_step() -> Shell:
    s = Shell("crash at each step of a commit: decisions never flip, markers are re-sent")
    s.note("1. crash with the Opened record in flight: the transaction never existed")
    s.call("new_txn", topic_partitions=[tp("orders/0")])
    s.crash()
    s.status(txn(1))
    s.note("2. crash after Opened was written but before the owner heard: it exists")
    s.call("new_txn", topic_partitions=[tp("orders/0")])
    s.written_unacknowledged()
    s.crash()
    s.status(txn(1))
    s.note("sequences continue after the log's last one")
    s.call("new_txn", topic_partitions=[tp("orders/1")])
    s.durable()
    s.note("3. crash with the COMMIT decision in flight: not decided, still OPEN")
    s.call("end_txn", txn(1), COMMIT)
    s.crash()
    s.status(txn(1))
    s.note("4. crash after the decision was written, before the reply: the new owner "
           "finishes the COMMIT (markers with its epoch)")
    s.call("end_txn", txn(1), COMMIT)
    s.written_unacknowledged()
    s.crash()
    s.status(txn(1))
    s.note("the client's retry learns the outcome; an abort cannot flip it")
    s.call("end_txn", txn(1), COMMIT)
    s.call("abort", txn(1))
    s.note("5. crash after some markers were confirmed: unconfirmed state is volatile, "
           "every marker goes out again")
    s.call("add_partitions", txn(2), [tp("orders/2")])
    s.durable()
    s.call("end_txn", txn(2), ABORT)
    s.durable()
    s.confirm(txn(2), "orders/1")
    s.crash()
    s.describe(txn(2))
    s.note("6. crash after every marker confirmed, with Completed in flight")
    s.confirm_all()
    s.crash()
    s.describe(txn(1))
    s.note("7. crash after Completed was written: nothing left to do")
    s.confirm_all()
    s.written_unacknowledged()
    s.written_unacknowledged()
    s.crash()
    s.status(txn(1))
    s.status(txn(2))
    s.note("8. the same, loaded from a snapshot plus the tail")
    s.call("new_txn", topic_partitions=[tp("orders/3")])
    s.durable()
    s.take_snapshot()
    s.call("end_txn", txn(3), COMMIT)
    s.durable()
    s.crash(from_snapshot=True)
    s.confirm_all()
    s.settle()
    s.status(txn(3))
    return s


def script_markers_delayed_duplicated_lost() -> Shell:
    s = Shell("markers: late, duplicated, out of order, lost; re-sent every "
              "marker_retry_ms until confirmed", limits=Limits(marker_retry_ms=500))
    s.call("new_txn", topic_partitions=[tp("a/0"), tp("a/1")],
           subscription_partitions=[sub("b/0@s1")])
    s.durable()
    s.call("end_txn", txn(1), COMMIT)
    s.durable()
    s.confirm(txn(1), "b/0@s1")
    s.confirm(txn(1), "b/0@s1", again=True)
    s.confirm(txn(1), "c/9", again=True)
    s.lose_markers()
    s.tick(100)
    s.note("not yet: the last send was 100 ms ago")
    s.tick(400)
    s.describe(txn(1))
    s.lose_markers()
    s.tick(500)
    s.confirm(txn(1), "a/1")
    s.confirm(txn(1), "a/0")
    s.confirm(txn(1), "a/0", again=True)
    s.note("a confirmation arriving while Completed is being logged changes nothing")
    s.durable()
    s.confirm(txn(1), "a/1", again=True)
    s.tick(1000)
    s.note("no transaction without targets sends markers; it completes right away")
    s.call("new_txn")
    s.durable()
    s.call("end_txn", txn(2), ABORT)
    s.settle()
    s.status(txn(2))
    return s


def script_timeouts() -> Shell:
    s = Shell("timeouts: OPEN and PREPARED (its own, longer); limits here: OPEN default 10 s, "
              "max 60 s; PREPARED default 30 s, max 120 s",
              limits=Limits(default_timeout_ms=10_000, max_timeout_ms=60_000,
                            default_prepared_timeout_ms=30_000,
                            max_prepared_timeout_ms=120_000))
    s.call("new_txn", timeout_ms=-1)
    s.call("new_txn", timeout_ms=60_001)
    s.call("new_txn", topic_partitions=[tp("t/0")])
    s.call("new_txn", timeout_ms=20_000, topic_partitions=[tp("t/1")])
    s.settle()
    s.tick(9_999)
    s.status(txn(1))
    s.note("at the deadline: calls are refused before the tick even runs")
    s.advance(1)
    s.call("end_txn", txn(1), COMMIT)
    s.call("add_partitions", txn(1), [tp("t/2")])
    s.call("prepare", txn(1))
    s.tick()
    s.settle()
    s.confirm_all()
    s.settle()
    s.call("end_txn", txn(1), COMMIT)
    s.call("end_txn", txn(1), ABORT)
    s.status(txn(1))
    s.note("PREPARED is not aborted by the OPEN timeout, only by its prepared timeout")
    s.call("prepare", txn(2), prepared_timeout_ms=120_001)
    s.call("prepare", txn(2), prepared_timeout_ms=50_000)
    s.durable()
    s.call("prepare", txn(2))
    s.tick(20_000)
    s.status(txn(2))
    s.tick(39_999)
    s.call("end_txn", txn(2), COMMIT)
    s.status(txn(2))
    s.note("a tick with a timeout abort in flight does not propose it again")
    s.tick()
    s.tick()
    s.durable()
    s.confirm_all()
    s.settle()
    s.call("end_txn", txn(2), COMMIT)
    s.note("an explicit abort of a timed-out transaction is still accepted")
    s.call("new_txn", timeout_ms=1_000)
    s.durable()
    s.advance(5_000)
    s.call("end_txn", txn(3), ABORT)
    s.settle()
    s.status(txn(3))
    return s


def script_sessions_and_fencing() -> Shell:
    s = Shell("transactional ids: epochs, fencing, aborting the old session's transaction")
    s.init_producer_id("writer-1")
    s.durable()
    first = Session("writer-1", 1000, 0)
    s.call("new_txn", session=first, topic_partitions=[tp("t/0")])
    s.durable()
    s.call("new_txn", session=first)
    s.note("one OPEN or PREPARED transaction per session")
    s.call("add_partitions", txn(1), [tp("t/1")])
    s.call("add_partitions", txn(1), [tp("t/1")], session=Session("writer-1", 1000, 7))
    s.note("a new instance takes the id over: epoch bumped, old transaction aborted")
    s.init_producer_id("writer-1", producer_id=1000, producer_epoch=3)
    s.init_producer_id("writer-1")
    s.durable()
    s.confirm_all()
    s.settle()
    s.call("end_txn", txn(1), COMMIT, session=first)
    s.call("new_txn", session=first)
    second = Session("writer-1", 1000, 1)
    s.call("end_txn", txn(1), COMMIT, session=second)
    s.call("new_txn", session=second)
    s.durable()
    s.status(txn(1))
    s.status(txn(2))
    s.note("re-initializing with the current epoch bumps again")
    s.init_producer_id("writer-1", producer_id=1000, producer_epoch=1,
                       transaction_timeout_ms=5_000)
    s.durable()
    s.settle()
    s.note("the session's timeout is the default for its transactions")
    s.call("new_txn", session=Session("writer-1", 1000, 2))
    s.durable()
    s.crash()
    s.note("after a crash the session is the same")
    s.call("new_txn", session=Session("writer-1", 1000, 2))
    s.call("end_txn", txn(3), COMMIT, session=Session("writer-1", 1000, 2))
    s.settle()
    return s


def script_epoch_exhaustion() -> Shell:
    started = SessionStarted("writer-9", 77, 65_533, 60_000, 500)
    opened = Opened(txn(1), 600, 60_000, 60_600, session=started.session)
    s = Shell("epoch exhaustion: 65535 is never issued; a new producer id starts at 0",
              log=(started, opened))
    s.init_producer_id("writer-9")
    s.durable()
    s.init_producer_id("writer-9")
    s.settle()
    s.init_producer_id("writer-9", producer_id=1000, producer_epoch=0)
    s.durable()
    s.call("new_txn", session=Session("writer-9", 77, 65_534))
    s.status(txn(1))
    return s


def script_parent_and_children() -> Shell:
    s = Shell("parent/child (Spark writer): one decision record keeps some children, aborts "
              "the others")
    s.call("new_txn", idempotency_key="query-7/batch-3")
    s.durable()
    parent = txn(1)
    for partition in range(3):
        s.call("new_txn", parent=parent, topic_partitions=[tp(f"out/{partition}")])
        s.durable()
    s.call("new_txn", parent=TxnId(4, 1))
    s.call("new_txn", parent=txn(2))
    s.call("new_txn", parent=parent, session=Session("x", 1, 0))
    s.call("prepare", txn(2))
    s.call("prepare", txn(3))
    s.settle()
    s.note("task 3's attempt is still OPEN: it may not be kept")
    s.call("end_txn", parent, COMMIT, children_to_keep=[txn(2), txn(4)])
    s.call("end_txn", parent, COMMIT, children_to_keep=[txn(2), txn(99)])
    s.call("end_txn", parent, ABORT, children_to_keep=[txn(2)])
    s.describe(parent)
    s.call("end_txn", txn(2), COMMIT)
    s.call("end_txn", txn(2), ABORT)
    s.note("the driver keeps the attempts that succeeded (3:2, 3:3); 3:4 aborts in the same "
           "record")
    s.call("end_txn", parent, COMMIT, children_to_keep=[txn(2), txn(3)])
    s.durable()
    s.call("new_txn", parent=parent)
    s.note("the parent completes only after every child has")
    s.confirm(txn(2), "out/0")
    s.confirm(txn(4), "out/2")
    s.settle()
    s.describe(parent)
    s.confirm(txn(3), "out/1")
    s.settle()
    s.describe(parent)
    s.note("the streaming batch is replayed after a restart: same key, same parent, which "
           "is committed; committing it again succeeds")
    s.call("new_txn", idempotency_key="query-7/batch-3")
    s.call("end_txn", parent, COMMIT)
    s.note("a dead driver: the parent times out and everything aborts")
    s.call("new_txn", timeout_ms=5_000)
    s.durable()
    s.call("new_txn", parent=txn(5), timeout_ms=900_000, topic_partitions=[tp("out/0")])
    s.durable()
    s.call("prepare", txn(6))
    s.durable()
    s.tick(5_000)
    s.durable()
    s.describe(txn(5))
    s.confirm_all()
    s.settle()
    s.status(txn(6))
    s.note("an OPEN child may abort itself; a PREPARED one waits for its parent")
    s.call("new_txn")
    s.durable()
    s.call("new_txn", parent=txn(7))
    s.call("new_txn", parent=txn(7))
    s.settle()
    s.call("prepare", txn(9))
    s.durable()
    s.call("end_txn", txn(8), ABORT)
    s.call("end_txn", txn(9), ABORT)
    s.settle()
    s.call("end_txn", txn(7), COMMIT, children_to_keep=[txn(8)])
    s.call("end_txn", txn(7), COMMIT, children_to_keep=[txn(9)])
    s.settle()
    s.describe(txn(7))
    return s


def script_idempotency_keys() -> Shell:
    s = Shell("idempotency keys: a retried NewTxn returns the same transaction",
              limits=Limits(default_timeout_ms=10_000))
    s.call("new_txn", idempotency_key="k1", topic_partitions=[tp("t/0")])
    s.call("new_txn", idempotency_key="k1")
    s.durable()
    s.advance(6_000)
    s.note("OPEN: returned, its timeout restarts from now, new partitions are registered")
    s.call("new_txn", idempotency_key="k1", topic_partitions=[tp("t/0"), tp("t/1")])
    s.durable()
    s.status(txn(1))
    s.call("new_txn", idempotency_key="k1", parent=txn(1))
    s.call("prepare", txn(1))
    s.durable()
    s.call("new_txn", idempotency_key="k1", topic_partitions=[tp("t/0"), tp("t/5")])
    s.call("end_txn", txn(1), ABORT)
    s.settle()
    s.note("aborted: replaced by a new transaction")
    s.call("new_txn", idempotency_key="k1")
    s.durable()
    s.note("timed out but not yet aborted by a tick: its abort and the new one share a batch")
    s.advance(10_000)
    s.call("new_txn", idempotency_key="k1")
    s.settle()
    s.status(txn(2))
    s.status(txn(3))
    s.call("new_txn", idempotency_key="x" * 257)
    return s


def script_concurrency_and_failed_appends() -> Shell:
    s = Shell("pending transitions: CONCURRENT_TRANSACTIONS; a refused append rolls back")
    s.call("new_txn", topic_partitions=[tp("t/0")])
    s.call("add_partitions", txn(1), [tp("t/1")])
    s.durable()
    s.call("prepare", txn(1))
    s.call("add_partitions", txn(1), [tp("t/1")])
    s.call("end_txn", txn(1), ABORT)
    s.append_fails()
    s.status(txn(1))
    s.note("rolled back: the transaction is OPEN and takes partitions again")
    s.call("add_partitions", txn(1), [tp("t/1")])
    s.durable()
    s.note("a sequence is never reused, even after a refused append")
    s.call("new_txn")
    s.append_fails()
    s.call("new_txn")
    s.durable()
    s.note("appends complete in order: the shell may not skip one")
    s.call("end_txn", txn(1), COMMIT)
    s.call("end_txn", txn(3), COMMIT)
    appends = list(s.in_flight)
    try:
        s.core.append_done(appends[1].append_id, s.now_ms)
    except Exception as error:  # ProtocolError
        s.say(f"  append_done(#{appends[1].append_id}) first: {type(error).__name__}: {error}")
    s.settle()
    s.confirm_all()
    s.settle()
    s.status(txn(1))
    s.status(txn(3))
    return s


def script_bounds() -> Shell:
    s = Shell("bounds: open transactions, partitions per transaction, children, finished "
              "transactions remembered",
              limits=Limits(max_open=3, max_partitions=2, max_children=1, max_finished=2))
    s.call("new_txn", topic_partitions=[tp("t/0"), tp("t/1"), tp("t/2")],
           subscription_partitions=[sub("t/0@s")])
    s.call("new_txn", parent=txn(1))
    s.call("new_txn")
    s.call("new_txn")
    s.note("three unfinished, counting the ones being opened: the table is full")
    s.call("new_txn")
    s.settle()
    s.call("add_partitions", txn(1), [tp("t/0"), tp("t/9")])
    s.call("new_txn", parent=txn(1))
    s.call("end_txn", txn(3), ABORT)
    s.settle()
    s.call("new_txn", parent=txn(1))
    s.note("room for one more transaction, but the parent has its one child")
    s.call("new_txn", parent=txn(1))
    s.note("the parent cannot be decided while a child is being opened under it")
    s.call("end_txn", txn(1), ABORT)
    s.settle()
    s.call("end_txn", txn(2), ABORT)
    s.call("end_txn", txn(1), ABORT)
    s.settle()
    s.confirm_all()
    s.settle()
    s.note("four finished, two more than max_finished; but their callers may still retry "
           "them (until their deadline + finished_grace_ms), so all four are remembered")
    for sequence in range(1, 5):
        s.status(txn(sequence))
    s.call("end_txn", txn(1), ABORT)
    s.call("end_txn", txn(3), ABORT)
    s.advance(121_000)
    s.call("new_txn")
    s.settle()
    s.call("end_txn", txn(5), ABORT)
    s.settle()
    s.note("their retries over (60 s timeouts, 60 s grace), the next completion forgets all "
           "but the last two to finish")
    for sequence in range(1, 6):
        s.status(txn(sequence))
    s.call("end_txn", txn(3), ABORT)
    return s


def script_operator() -> Shell:
    s = Shell("operator: list, describe, abort (allow_prepared)")
    s.call("new_txn", topic_partitions=[tp("t/0")])
    s.durable()
    s.advance(1_000)
    s.call("new_txn", subscription_partitions=[sub("t/0@s")])
    s.durable()
    s.call("prepare", txn(2))
    s.durable()
    s.advance(1_000)
    for states, min_age_ms in (((), 0), ((), 1_500), (("PREPARED",), 0)):
        from coordinator.core import State
        listing = s.core.list_transactions(s.now_ms, [State[x] for x in states], min_age_ms)
        s.say(f"  list states={list(states)} min_age_ms={min_age_ms}: "
              + ", ".join(f"{t.txn_id}:{t.state.name}:age={t.age_ms}"
                          for t in listing.transactions)
              + (" (truncated)" if listing.truncated else ""))
    listing = s.core.list_transactions(s.now_ms, limit=1)
    s.say(f"  list limit=1: {[str(t.txn_id) for t in listing.transactions]} "
          f"truncated={listing.truncated}")
    s.call("abort", txn(2))
    s.call("abort", txn(2), allow_prepared=True)
    s.call("abort", txn(1))
    s.settle()
    s.call("abort", txn(1))
    s.describe(txn(1))
    s.confirm_all()
    s.settle()
    s.describe(txn(2))
    s.call("abort", txn(2))
    return s


SCRIPTS = {name[len("script_"):]: function for name, function in sorted(globals().items())
           if name.startswith("script_")}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_matches_golden(name: str) -> None:
    transcript = SCRIPTS[name]().transcript()
    golden = GOLDEN_DIR / f"{name}.txt"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(transcript)
    assert golden.exists(), f"no golden file {golden}; run with UPDATE_GOLDEN=1"
    assert transcript == golden.read_text(), (
        f"transcript of {name} differs from {golden} (UPDATE_GOLDEN=1 to accept)")


def test_every_golden_file_has_a_script() -> None:
    assert sorted(p.stem for p in GOLDEN_DIR.glob("*.txt")) == sorted(SCRIPTS)
