"""The TC partition core (coordinator/core.py) and its records (coordinator/records.py).

- A Hypothesis state machine plays clients (NewTxn with parents, sessions and idempotency
  keys; partitions; prepare; EndTxn keeping random children; InitProducerId; operator
  aborts), the shell (appends made durable, refused, or written unacknowledged before a
  crash; markers confirmed, duplicated, lost; ticks; snapshots) and crashes (a new owner
  loads by full replay or snapshot + tail). A small model built from the log checks:
  each transaction is decided at most once and never flips (acknowledged commits stay
  commits, markers always carry the logged decision), refusals change nothing, replies
  agree with the model, a full replay and every snapshot + tail equal the live table,
  the bounds hold, and — at the end — every transaction finishes and every target of
  every decided transaction got its marker. Failures print a reproduction blob.
- The transition table walked whole: every allowed transition applies, every other one
  raises IllegalTransition and leaves the table unchanged.
- Record and snapshot encodings: round trips, truncations, bit flips, versions.
- `-k load`: 100,000 finished transactions loaded from a snapshot (and by full replay).
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import struct
import time
from collections import deque
from pathlib import Path

import crc32c
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule,
)

from coordinator import core as core_module
from coordinator import records as records_module
from coordinator.core import (
    ALLOWED, DECIDING, FINISHED, INITIAL_STATE, NO_WORK, TRANSITION_RECORDS, UNDECIDED,
    SEQUENCE_RESERVATION, EndTxnResult, IllegalTransition, Limits, OneCallAborted, OneCallStart,
    SESSION_SWEEP_INTERVAL_MS, ProducerIdNeeded, ProtocolError, SnapshotCorrupt, State,
    TcPartitionCore, _key_row,
    generated_doc, next_producer_epoch, replay,
)
from coordinator.records import (
    PRODUCER_EPOCH_LAST_ISSUED, Completed, DeadlineReset, Decided, Decision, EndCause,
    Opened, Prepared, RecordCorrupt, Registered, SequencesReserved, Session, SessionStarted,
    Staging, StreamCommitted, SubscriptionPartition, TopicPartition, TxnId, TxnStream,
    decode_record, encode_record,
)
from services.errors import AtomlogError

TC = 7
COMMIT, ABORT = Decision.COMMIT, Decision.ABORT

# ---------------------------------------------------------------------------------------
# The state machine
# ---------------------------------------------------------------------------------------

MACHINE_LIMITS = Limits(
    max_open=6, max_partitions=3, max_children=2, default_timeout_ms=1_000,
    max_timeout_ms=5_000, default_prepared_timeout_ms=3_000, max_prepared_timeout_ms=6_000,
    max_finished=3, finished_grace_ms=2_000, max_finished_held=5, max_sessions=3,
    session_expiry_ms=20_000, marker_retry_ms=100, max_decisions_per_tick=2,
    max_markers_per_tick=3, max_streams=2, stream_expiry_ms=30_000)
TARGETS = (TopicPartition("t", 0), TopicPartition("t", 1), TopicPartition("u", 0),
           SubscriptionPartition("t", 0, "s"))
TRANSACTIONAL_IDS = ("a", "b", "c", "d")  # one more than max_sessions
KEYS = ("", "", "k1", "k2")
STREAMS = ("q1", "q2", "q3")  # one more than max_streams
TIMEOUTS_MS = st.sampled_from([0, 0, 500, 5_000, 5_001, -1])
ADVANCES_MS = st.sampled_from([0, 1, 50, 99, 100, 300, 600, 1_000, 3_000, 7_000, 25_000])
# Most client calls see their appends durable at once; the rest leave them in flight.
SETTLE = st.sampled_from([True, True, True, False])
# Whole-request refusals the core may answer with; each must leave everything unchanged.
REFUSALS = {
    "UNKNOWN_TRANSACTION", "TRANSACTION_NOT_OPEN", "TRANSACTION_ABORTED",
    "TRANSACTION_TIMED_OUT", "TRANSACTION_ALREADY_COMMITTED", "TRANSACTION_PREPARED",
    "PARENT_NOT_OPEN", "CHILD_NOT_PREPARED", "TRANSACTION_IS_CHILD",
    "CONCURRENT_TRANSACTIONS", "INVALID_TRANSACTION_TIMEOUT", "PRODUCER_FENCED",
    "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "STREAM_ORDINAL_COMMITTED",
}


class LogModel:
    """What the durable log says, checked as each append becomes durable."""

    def __init__(self) -> None:
        self.opened: dict[TxnId, Opened] = {}
        self.targets: dict[TxnId, set] = {}
        self.children: dict[TxnId, list[TxnId]] = {}
        self.decided: dict[TxnId, Decision] = {}
        self.completed: set[TxnId] = set()
        # Until when each transaction's caller may still retry (its deadline, a reset
        # one, its prepared deadline, its completion): it is not forgotten before.
        self.retried_until: dict[TxnId, int] = {}
        self.last_sequence = 0
        self.streams: dict[str, StreamCommitted] = {}  # each stream's last commit

    def stream_live(self, name: str, now_ms: int) -> StreamCommitted | None:
        last = self.streams.get(name)
        if last is None or now_ms - last.committed_ms > MACHINE_LIMITS.stream_expiry_ms:
            return None
        return last

    def record(self, record) -> None:
        if isinstance(record, StreamCommitted):
            # With its own Decided(COMMIT), after it; and a stream's commits grow while
            # it lives: a step is never committed twice.
            assert self.decided.get(record.txn_id) is COMMIT
            last = self.stream_live(record.stream, record.committed_ms)
            assert last is None or record.ordinal > last.ordinal, (last, record)
            self.streams[record.stream] = record
        elif isinstance(record, Opened):
            # Sequences grow, except one-call transactions' (decided in their Opened's
            # append, within a reservation): never twice.
            assert record.txn_id not in self.opened, "opened twice"
            self.last_sequence = max(self.last_sequence, record.txn_id.sequence)
            self.opened[record.txn_id] = record
            self.retried_until[record.txn_id] = record.deadline_ms
            self.targets[record.txn_id] = {*record.topic_partitions,
                                           *record.subscription_partitions}
            self.children[record.txn_id] = []
            if record.parent is not None:
                self.children[record.parent].append(record.txn_id)
        elif isinstance(record, Registered):
            assert record.txn_id not in self.decided
            self.targets[record.txn_id] |= {*record.topic_partitions,
                                            *record.subscription_partitions}
        elif isinstance(record, Decided):
            for txn_id, decision in ([(record.txn_id, record.decision)]
                                     + [(c, COMMIT) for c in record.kept_children]
                                     + [(c, ABORT) for c in record.aborted_children]):
                assert txn_id not in self.decided, f"{txn_id} decided twice"
                self.decided[txn_id] = decision
            undecided = [c for c in self.children[record.txn_id] if c not in self.decided]
            assert not undecided, f"{record.txn_id} decided, children {undecided} not"
        elif isinstance(record, Completed):
            assert self.decided.get(record.txn_id) is record.decision, "completes as decided"
            assert record.txn_id not in self.completed
            assert all(c in self.completed for c in self.children[record.txn_id])
            self.completed.add(record.txn_id)
            self.retried_until[record.txn_id] = max(self.retried_until[record.txn_id],
                                                    record.completed_ms)
        elif isinstance(record, (Prepared, DeadlineReset)):
            assert record.txn_id not in self.decided
            if isinstance(record, DeadlineReset):
                self.retried_until[record.txn_id] = record.deadline_ms
            else:
                self.retried_until[record.txn_id] = max(self.retried_until[record.txn_id],
                                                        record.prepared_deadline_ms)


class CoordinatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.epoch = 1
        self.core = TcPartitionCore(TC, MACHINE_LIMITS, self.epoch)
        self.now_ms = 1_000_000
        self.log: list[bytes] = []
        self.model = LogModel()
        self.in_flight: deque = deque()  # (Append, caller, reply)
        self.markers: list = []  # sent by this owner, not yet confirmed
        self.confirmed: list = []  # confirmed to this owner (for duplicates)
        self.markers_seen: dict[TxnId, set] = {}  # target -> delivered, per transaction
        self.acknowledged: dict[TxnId, Decision] = {}  # decisions replied to clients
        self.snapshots: list[tuple[bytes, int]] = []
        self.next_producer_id = 1
        self.handed_out: set[TxnId] = set()  # one-call transactions begun
        self.staging: list[TxnId] = []  # begun, not ended (volatile: a crash drops them)
        self.parallel: set[TxnId] = set()  # begun as parallel commits (Staging records)
        self.promised: set[TxnId] = set()  # parallel commits answered "committed"

    # -- helpers ------------------------------------------------------------------------

    def known(self) -> list[TxnId]:
        return sorted(self.model.opened) or [TxnId(TC, 1)]

    def settle(self, settle: bool) -> None:
        while settle and self.in_flight:
            self.append_durable()

    @initialize(count=st.integers(1, 3), reserve=st.sampled_from([True, True, False]))
    def open_some(self, count, reserve):
        if reserve:  # a first block reserved, so one-call transactions may run in parallel
            ready = self.core.begin_one_call(self.now_ms, 0, None, "warm", [TARGETS[0]], [])
            self.handed_out.add(ready.reply.txn_id)
            self.perform(ready, "begin_one_call")
            self.settle(True)
            self.perform(self.core.end_one_call(self.now_ms, ready.reply.txn_id, AtomlogError(
                "TRANSACTION_CONFLICT", "warm-up")), "end_one_call")
        for _ in range(count):
            self.new_txn(0, None, "", [TARGETS[0], TARGETS[3]], True)

    def image(self, core: TcPartitionCore) -> bytes:
        """The logical table at now: a copy without the live core's locks (which keep an
        expired session in memory while a NewTxn in it is being logged), expired
        sessions freed, encoded."""
        copy, _ = TcPartitionCore.restore(core.snapshot(), TC, MACHINE_LIMITS, self.epoch)
        copy.forget_expired_sessions(self.now_ms)
        copy.forget_expired_streams(self.now_ms)
        return copy.snapshot()

    def attempt(self, caller: str, call, predicted: set[str] | None = None):
        """Run an input. A refusal must change nothing (and be predicted, if given)."""
        before = (self.image(self.core), self.core.pending_append_ids)
        try:
            ready = call()
        except AtomlogError as error:
            limit = error.metadata.get("limit")
            event(f"refused {caller}: {error.reason}" + (f" ({limit})" if limit else ""))
            assert error.reason in REFUSALS, error
            if predicted is not None:
                assert error.reason in predicted, (error, predicted)
            assert (self.image(self.core), self.core.pending_append_ids) == before
            return None
        if predicted is not None:
            assert "ok" in predicted, (caller, ready, predicted)
        self.perform(ready, caller)
        return ready

    def perform(self, ready, caller: str) -> None:
        for append in ready.appends:
            self.in_flight.append((append, caller, ready.reply))
        for marker in ready.markers:
            assert marker.coordinator_epoch == self.epoch
            if marker.txn_id in self.handed_out and marker.txn_id not in self.model.decided:
                assert marker.decision is ABORT, "presumed abort: only ABORT, undecided"
            else:
                assert self.model.decided.get(marker.txn_id) is marker.decision, \
                    "a marker carries the logged decision"
            self.markers.append(marker)

    def write(self, append) -> None:
        for record in append.records:
            event(f"logged {type(record).__name__}"
                  + (f" {record.decision.name} {record.cause.name}"
                     if isinstance(record, Decided) else "")
                  + (" keeping children" if getattr(record, "kept_children", ()) else "")
                  + (" aborting children" if getattr(record, "aborted_children", ()) else ""))
            value = encode_record(record)
            assert decode_record(value) == record
            self.log.append(value)
            self.model.record(record)

    # -- clients ------------------------------------------------------------------------

    @rule(timeout_ms=TIMEOUTS_MS, parent=st.one_of(st.none(), st.integers(1, 12)),
          key=st.sampled_from(KEYS), chosen=st.lists(st.sampled_from(TARGETS), max_size=4),
          settle=SETTLE)
    def new_txn(self, timeout_ms, parent, key, chosen, settle):
        parent_id = TxnId(TC, parent) if parent else None
        self.attempt("new_txn", lambda: self.core.new_txn(
            self.now_ms, timeout_ms, parent_id, None, key,
            [t for t in chosen if isinstance(t, TopicPartition)],
            [t for t in chosen if isinstance(t, SubscriptionPartition)]))
        self.settle(settle)

    @rule(name=st.sampled_from(STREAMS), ordinal=st.integers(0, 3),
          again=st.booleans(), commit=st.sampled_from([True, True, False]), settle=SETTLE)
    def stream_step(self, name, ordinal, again, commit, settle):
        """Step `ordinal` of a stream (a Spark micro-batch), opened by its key — or, as
        when that key was forgotten, by another one (`again`) — and committed as its
        place in the stream."""
        stream = TxnStream(name, ordinal)
        last = self.model.stream_live(name, self.now_ms)
        key = f"{name}:{ordinal}" + ("/again" if again else "")
        ready = self.attempt("new_txn", lambda: self.core.new_txn(
            self.now_ms, 0, idempotency_key=key, topic_partitions=[TARGETS[ordinal % 3]],
            stream=stream))
        if ready is not None and not ready.reply.existing and last is not None:
            # Nothing durable of this stream in flight: its high-water holds it back.
            if not any(isinstance(r, StreamCommitted) and r.stream == name
                       for append, _, _ in self.in_flight for r in append.records):
                assert ordinal > last.ordinal, (last, ordinal)
        self.settle(True)
        if ready is None or not commit:
            return
        txn_id = ready.reply.txn_id
        self.attempt("end_txn", lambda: self.core.end_txn(
            self.now_ms, txn_id, COMMIT, stream=stream))
        self.settle(settle)

    @rule(data=st.data(), children=st.integers(1, 3), settle=SETTLE)
    def spark_job(self, data, children, settle):
        """A parent, children that write and (some) prepare, a commit keeping some."""
        ready = self.attempt("new_txn", lambda: self.core.new_txn(self.now_ms, 5_000))
        self.settle(True)
        if ready is None:
            return
        parent = ready.reply.txn_id
        for index in range(children):
            self.attempt("new_txn", lambda: self.core.new_txn(
                self.now_ms, 0, parent, topic_partitions=[TARGETS[index]]))
        self.settle(True)
        for child in self.model.children.get(parent, []):
            if data.draw(st.booleans()):
                self.attempt("prepare", lambda: self.core.prepare(self.now_ms, child))
        self.settle(settle)
        keep = data.draw(st.lists(st.sampled_from(self.model.children.get(parent) or [parent]),
                                  unique=True))
        self.attempt("end_txn", lambda: self.core.end_txn(self.now_ms, parent, COMMIT, keep))
        self.settle(settle)

    @rule(tid=st.sampled_from(TRANSACTIONAL_IDS), stale=st.booleans(),
          timeout_ms=st.sampled_from([0, 500, 5_000]))
    def new_session_txn(self, tid, stale, timeout_ms):
        if self.core.session(tid, self.now_ms) is None:
            self.init_producer_id(tid, "new")
        info = self.core.session(tid, self.now_ms)
        session = info.session if info else Session(tid, 99, 0)
        if stale and session.producer_epoch > 0:
            session = Session(tid, session.producer_id, session.producer_epoch - 1)
        predicted = {"PRODUCER_FENCED"} if (info is None or stale and info.session != session) \
            else None
        self.attempt("new_txn", lambda: self.core.new_txn(
            self.now_ms, timeout_ms, session=session, topic_partitions=[TARGETS[0]]),
            predicted)
        self.settle(True)

    @rule(chosen=st.lists(st.sampled_from(TARGETS), min_size=1, max_size=3),
          key=st.sampled_from(["oc1", "oc2", "oc3", "k1"]),
          tid=st.sampled_from(["", "", "a", "b"]), timeout_ms=st.sampled_from([0, 500, 5_000]),
          parallel=st.sampled_from([True, True, False]), settle=SETTLE)
    def begin_one_call(self, chosen, key, tid, timeout_ms, parallel, settle):
        session = None
        if tid:
            info = self.core.session(tid, self.now_ms)
            session = info.session if info is not None else Session(tid, 99, 0)
        tps = [t for t in chosen if isinstance(t, TopicPartition)]
        subs = [t for t in chosen if isinstance(t, SubscriptionPartition)]
        parallel = parallel and bool(tps) and not subs
        ready = self.attempt("begin_one_call", lambda: self.core.begin_one_call(
            self.now_ms, timeout_ms, session, key, tps, subs, parallel=parallel))
        if ready is None:
            self.settle(True)
            return
        start = ready.reply
        assert isinstance(start, OneCallStart)
        if start.existing is not None:
            assert (self.model.decided.get(start.txn_id) is COMMIT
                    or start.txn_id in self.promised)  # answered "committed" already
            self.settle(True)
            return
        txn_id = start.txn_id
        assert txn_id not in self.handed_out and txn_id not in self.model.opened, \
            "a sequence is handed out once, also across crashes (reservations)"
        self.handed_out.add(txn_id)
        self.staging.append(txn_id)
        assert start.parallel is (parallel and bool(ready.appends) and isinstance(
            ready.appends[0].records[0], Staging))
        if start.parallel:
            self.parallel.add(txn_id)
        # A reservation is durable before anything is staged; a parallel commit's Staging
        # record may still be in flight (the shell stages meanwhile).
        self.settle(settle or not start.parallel)
        for target in TARGETS:
            answer = self.core.verify(txn_id, target)
            assert answer.state is State.OPEN and answer.included is (target in chosen)

    @precondition(lambda self: self.staging)
    @rule(data=st.data(), ok=st.sampled_from([True, True, False]), settle=SETTLE)
    def end_one_call(self, data, ok, settle):
        txn_id = data.draw(st.sampled_from(self.staging))
        if any(r.txn_id == txn_id for append, _, _ in self.in_flight for r in append.records
               if isinstance(r, Staging)):
            return  # the shell waits for its Staging record before it decides
        self.staging.remove(txn_id)
        failure = None if ok else AtomlogError("TRANSACTION_CONFLICT", "staging failed")
        staging = self.core.is_staging(txn_id)
        ready = self.attempt("end_one_call",
                             lambda: self.core.end_one_call(self.now_ms, txn_id, failure))
        if ready is not None and staging:  # a parallel commit: the decision is logged
            (append,) = ready.appends
            (decided,) = append.records
            assert decided.txn_id == txn_id and not ready.markers
            if isinstance(ready.reply, OneCallAborted):
                assert decided.decision is ABORT and not ready.early_reply
                assert ok or ready.reply.error is failure
            else:
                assert ok and decided.decision is COMMIT and ready.early_reply
                self.promised.add(txn_id)  # the client heard "committed" now
        elif ready is not None and isinstance(ready.reply, OneCallAborted):
            assert not ready.appends and all(m.decision is ABORT and m.txn_id == txn_id
                                              for m in ready.markers)
            assert ok or ready.reply.error is failure
            assert self.core.verify(txn_id, TARGETS[0]).state is State.ABORTED
        elif ready is not None:
            records = ready.appends[0].records
            assert isinstance(records[0], Opened) and records[0].txn_id == txn_id
            assert records[1] == Decided(txn_id, COMMIT, EndCause.CLIENT, self.now_ms)
        elif self.core.one_call(txn_id) is not None:
            self.staging.append(txn_id)  # refused for now (CONCURRENT): still staging
        self.settle(settle)

    @precondition(lambda self: self.staging)
    @rule(data=st.data(), failing=st.sampled_from([None, None, 0, 1, 2]), settle=SETTLE)
    def end_one_calls(self, data, failing, settle):
        """A chain (CommitTxns): decisions in one append; after the first that does not
        commit, none does."""
        chained = [t for t in self.staging if t not in self.parallel]
        if not chained:
            return  # chains are never parallel commits
        chain = data.draw(st.lists(st.sampled_from(chained), min_size=1, max_size=3,
                                   unique=True))
        for txn_id in chain:
            self.staging.remove(txn_id)
        failure = AtomlogError("TRANSACTION_CONFLICT", "staging failed")
        items = [(t, failure if i == failing else None) for i, t in enumerate(chain)]
        ready = self.attempt("end_one_call",
                             lambda: self.core.end_one_calls(self.now_ms, items))
        assert len(ready.reply) == len(chain)
        committing = [t for t, r in zip(chain, ready.reply) if not isinstance(r, OneCallAborted)]
        assert committing == chain[:len(committing)], "nothing commits after a failure"
        assert failing is None or failing >= len(committing)
        for txn_id, reply in zip(chain[len(committing):], ready.reply[len(committing):]):
            assert isinstance(reply, OneCallAborted)
            assert self.core.verify(txn_id, TARGETS[0]).state is State.ABORTED
        assert all(m.decision is ABORT and m.txn_id in chain[len(committing):]
                   for m in ready.markers)
        if committing:
            (append,) = ready.appends
            assert [r.txn_id for r in append.records] == [t for t in committing for _ in "od"]
        else:
            assert not ready.appends
        self.settle(settle)

    @rule(key=st.sampled_from(["oc1", "oc2", "oc3", "k1"]), settle=SETTLE)
    def abort_one_call(self, key, settle):
        ready = self.attempt("abort_one_call",
                             lambda: self.core.abort_one_call(self.now_ms, key))
        if ready is not None:
            assert ready.reply in (State.ABORTING, State.ABORTED)
        self.settle(settle)

    @rule(data=st.data(), chosen=st.lists(st.sampled_from(TARGETS), min_size=1, max_size=3))
    def add_targets(self, data, chosen):
        txn_id = data.draw(st.sampled_from(self.known()))
        session = self.session_of(txn_id)
        if all(isinstance(t, SubscriptionPartition) for t in chosen):
            call = lambda: self.core.add_subscriptions(self.now_ms, txn_id, chosen, session)
        else:
            call = lambda: self.core.add_partitions(
                self.now_ms, txn_id, [t for t in chosen if isinstance(t, TopicPartition)],
                session)
        self.attempt("add", call)
        self.settle(True)

    @rule(data=st.data(), timeout_ms=st.sampled_from([0, 50, 6_000, 6_001]), settle=SETTLE)
    def prepare(self, data, timeout_ms, settle):
        txn_id = data.draw(st.sampled_from(self.known()))
        self.attempt("prepare", lambda: self.core.prepare(self.now_ms, txn_id, timeout_ms,
                                                          self.session_of(txn_id)))
        self.settle(settle)

    @rule(data=st.data(), decision=st.sampled_from([COMMIT, COMMIT, ABORT]), settle=SETTLE)
    def end_txn(self, data, decision, settle):
        txn_id = data.draw(st.sampled_from(self.known()))
        children = self.model.children.get(txn_id, [])
        keep = data.draw(st.lists(st.sampled_from(children), unique=True)) if (
            children and decision is COMMIT) else []
        predicted = self.predict_end(txn_id, decision)
        ready = self.attempt("end_txn", lambda: self.core.end_txn(
            self.now_ms, txn_id, decision, keep, self.session_of(txn_id)), predicted)
        if ready is not None and ready.appends:
            (decided,) = [r for r in ready.appends[0].records if isinstance(r, Decided)]
            assert decided.decision is decision and decided.kept_children == tuple(keep)
        self.settle(settle)

    def predict_end(self, txn_id: TxnId, decision: Decision) -> set[str] | None:
        """What EndTxn must answer for a transaction the log has decided (None: no
        prediction). Session-bound ones may also be fenced."""
        logged = self.model.decided.get(txn_id)
        opened = self.model.opened.get(txn_id)
        if logged is None or opened is None:
            return None
        if self.core.is_finished(txn_id) and self.forgotten(txn_id):
            return {"UNKNOWN_TRANSACTION"}
        if opened.parent is not None and decision is COMMIT:
            return {"TRANSACTION_IS_CHILD"}
        fenced = {"PRODUCER_FENCED"} if opened.session is not None else set()
        if logged is decision:
            return {"ok"} | fenced
        if logged is COMMIT:
            return {"TRANSACTION_ALREADY_COMMITTED"} | fenced
        return {"TRANSACTION_ABORTED", "TRANSACTION_TIMED_OUT"} | fenced

    def forgotten(self, txn_id: TxnId) -> bool:
        try:
            self.core.status(txn_id, self.now_ms)
        except AtomlogError as error:
            assert error.reason == "UNKNOWN_TRANSACTION"
            return True
        return False

    def session_of(self, txn_id: TxnId) -> Session | None:
        opened = self.model.opened.get(txn_id)
        return opened.session if opened is not None else None

    @rule(data=st.data(), allow_prepared=st.booleans())
    def operator_abort(self, data, allow_prepared):
        txn_id = data.draw(st.sampled_from(self.known()))
        logged = self.model.decided.get(txn_id)
        predicted = None
        if logged is not None and not self.forgotten(txn_id):
            predicted = {"ok"} if logged is ABORT else {"TRANSACTION_ALREADY_COMMITTED"}
        self.attempt("abort", lambda: self.core.abort(self.now_ms, txn_id, allow_prepared),
                     predicted)

    @rule(tid=st.sampled_from(TRANSACTIONAL_IDS),
          given=st.sampled_from(["new", "current", "stale"]))
    def init_producer_id(self, tid, given):
        info = self.core.session(tid, self.now_ms)
        producer_id, epoch = 0, 0
        if info is not None and given == "current":
            producer_id, epoch = info.session.producer_id, info.session.producer_epoch
        elif info is not None and given == "stale":
            producer_id, epoch = info.session.producer_id, info.session.producer_epoch + 1

        def call():
            try:
                return self.core.init_producer_id(self.now_ms, tid, 0, producer_id, epoch)
            except ProducerIdNeeded:
                self.next_producer_id += 1
                return self.core.init_producer_id(self.now_ms, tid, 0, producer_id, epoch,
                                                  fresh_producer_id=self.next_producer_id)
        predicted = ({"PRODUCER_FENCED", "CONCURRENT_TRANSACTIONS"}
                     if info is not None and given == "stale" else None)
        self.attempt("init", call, predicted)
        self.settle(True)

    # -- the shell ----------------------------------------------------------------------

    @precondition(lambda self: self.in_flight)
    @rule()
    def append_durable(self):
        append, caller, reply = self.in_flight.popleft()
        if caller not in ("end_one_call", "begin_one_call"):
            assert not any(isinstance(r, Opened) and r.txn_id in self.handed_out
                           for r in append.records), "a NewTxn reused a one-call sequence"
        self.write(append)
        ready = self.core.append_done(append.append_id, self.now_ms)
        if caller == "end_txn" and reply is not None:
            self.acknowledged[next(r.txn_id for r in append.records
                                   if isinstance(r, Decided))] = reply.state and (
                COMMIT if reply.state in (State.COMMITTING, State.COMMITTED) else ABORT)
        self.perform(ready, "append_done")

    @precondition(lambda self: self.in_flight)
    @rule()
    def append_refused(self):
        append, _, _ = self.in_flight.popleft()
        decisions = {r.txn_id for r in append.records
                     if type(r) is Opened and self.core.one_call(r.txn_id) is not None}
        ready = self.core.append_failed(append.append_id)
        # A one-call decision not logged: presumed aborted at once (its caller got the
        # failure), ABORT markers for what it staged; nothing else follows a refusal.
        assert not ready.appends
        assert {m.txn_id for m in ready.markers} == decisions
        assert all(self.core.one_call(t) is None for t in decisions)
        self.perform(ready, "append_failed")
        # A reservation not logged: the one-calls it was for are forgotten (their caller
        # hears the failure before staging anything). Logged parallel commits stay.
        self.staging = [t for t in self.staging if self.core.one_call(t) is not None
                        or self.core.is_staging(t)]

    @precondition(lambda self: len(self.in_flight) >= 2)
    @rule()
    def appends_complete_in_order(self):
        with pytest.raises(ProtocolError):
            self.core.append_done(self.in_flight[1][0].append_id, self.now_ms)

    @precondition(lambda self: self.markers)
    @rule(data=st.data())
    def confirm_marker(self, data):
        marker = data.draw(st.sampled_from(self.markers))
        self.markers = [m for m in self.markers
                        if (m.txn_id, m.target) != (marker.txn_id, marker.target)]
        self.markers_seen.setdefault(marker.txn_id, set()).add(marker.target)
        self.confirmed = (self.confirmed + [marker])[-10:]
        self.perform(self.core.marker_confirmed(self.now_ms, marker.txn_id, marker.target),
                     "confirm")

    @precondition(lambda self: self.markers)
    @rule(data=st.data())
    def confirm_markers_at_once(self, data):
        """Several confirmations in one call (one answer's markers), duplicates and
        already confirmed ones among them: ignored as marker_confirmed ignores them."""
        picked = data.draw(st.lists(st.sampled_from(self.markers + self.confirmed),
                                    min_size=1, max_size=6))
        fresh = {(m.txn_id, m.target) for m in picked} & \
            {(m.txn_id, m.target) for m in self.markers}
        self.markers = [m for m in self.markers if (m.txn_id, m.target) not in fresh]
        for marker in picked:
            self.markers_seen.setdefault(marker.txn_id, set()).add(marker.target)
        self.confirmed = (self.confirmed + [m for m in picked
                                            if (m.txn_id, m.target) in fresh])[-10:]
        ready = self.core.markers_confirmed(self.now_ms,
                                            [(m.txn_id, m.target) for m in picked])
        assert len(ready.appends) <= 1
        self.perform(ready, "confirm")

    @precondition(lambda self: self.confirmed)
    @rule(data=st.data())
    def duplicate_confirmation(self, data):
        marker = data.draw(st.sampled_from(self.confirmed))
        if marker in self.markers:  # re-sent since: that send is still unconfirmed
            return
        assert self.core.marker_confirmed(self.now_ms, marker.txn_id, marker.target) \
            == NO_WORK

    @rule(data=st.data(), settle=SETTLE)
    def resolve(self, data, settle):
        """Resolutions of parallel commits nobody decides (after a crash, or a failed
        CommitTxn): the partitions answer yes, no or nothing; yes whenever the client
        heard "committed" (its stages were durable then)."""
        for txn_id, targets in self.core.staged_to_resolve():
            assert txn_id in self.parallel and set(targets) <= self.model.targets[txn_id]
            staged = True if txn_id in self.promised else data.draw(
                st.sampled_from([True, False, None]))
            ready = self.core.resolve_staged(self.now_ms, txn_id, staged)
            assert not ready.markers and (bool(ready.appends) is (staged is not None))
            self.perform(ready, "resolve")
        self.settle(settle)

    @precondition(lambda self: any(t in self.parallel for t in self.staging))
    @rule(data=st.data())
    def commit_call_fails(self, data):
        """A parallel commit's CommitTxn fails before end_one_call: left to a resolution."""
        txn_id = data.draw(st.sampled_from([t for t in self.staging if t in self.parallel]))
        if self.core.is_staging(txn_id):
            self.staging.remove(txn_id)
            self.core.release_staging(txn_id)

    @rule()
    def lose_markers(self):
        self.markers.clear()

    @rule(advance_ms=ADVANCES_MS)
    def tick(self, advance_ms):
        self.now_ms += advance_ms
        self.perform(self.core.tick(self.now_ms), "tick")

    @rule()
    def take_snapshot(self):
        self.snapshots = (self.snapshots + [(self.core.snapshot(len(self.log)),
                                             len(self.log))])[-2:]

    @rule(written=st.integers(0, 3), from_snapshot=st.booleans())
    def crash(self, written, from_snapshot):
        """The owner dies after `written` in-flight appends reached the log unseen."""
        for _ in range(min(written, len(self.in_flight))):
            self.write(self.in_flight.popleft()[0])
        self.in_flight.clear()
        self.markers.clear()
        self.confirmed.clear()
        self.staging.clear()  # volatile: presumed aborted from now on
        self.epoch += 1
        records = [decode_record(value) for value in self.log]
        event("crash with a decision in progress" if any(
            isinstance(r, Decided) and r.txn_id not in self.model.completed for r in records)
            else "crash")
        if from_snapshot and self.snapshots:
            data, covered = self.snapshots[-1]
            base, offset = TcPartitionCore.restore(data, TC, MACHINE_LIMITS, self.epoch)
            assert offset == covered
            self.core = replay(records[covered:], TC, base=base)
        else:
            self.core = replay(records, TC, MACHINE_LIMITS, self.epoch)
        self.perform(self.core.tick(self.now_ms), "tick")

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def decisions_never_flip(self):
        for txn_id, decision in {**self.model.decided, **self.acknowledged}.items():
            assert self.model.decided[txn_id] is decision
            try:
                state = self.core.status(txn_id, self.now_ms).state
            except AtomlogError:
                continue  # forgotten after it finished
            expected = ((State.COMMITTING, State.COMMITTED) if decision is COMMIT
                        else (State.ABORTING, State.ABORTED))
            assert state in expected, (txn_id, state, decision)

    @invariant()
    def promised_commits_never_abort(self):
        for txn_id in self.promised:
            assert self.model.decided.get(txn_id, COMMIT) is COMMIT, txn_id
        for txn_id in self.parallel:
            if self.core.is_staging(txn_id):
                assert txn_id in self.model.opened and txn_id not in self.model.decided
                assert self.core.verify(txn_id, TARGETS[0]).state is State.OPEN

    @invariant()
    def live_table_equals_full_replay_and_snapshot_plus_tail(self):
        records = [decode_record(value) for value in self.log]
        live = self.image(self.core)
        assert self.image(replay(records, TC, MACHINE_LIMITS, self.epoch)) == live
        for data, covered in self.snapshots:
            base, _ = TcPartitionCore.restore(data, TC, MACHINE_LIMITS, self.epoch)
            assert self.image(replay(records[covered:], TC, base=base)) == live
        restored, _ = TcPartitionCore.restore(live, TC, MACHINE_LIMITS, self.epoch)
        assert self.image(restored) == live

    @invariant()
    def each_indexed_key_has_its_snapshot_row(self):
        # The snapshot joins the rows packed as keys were indexed (_keys' values); each
        # must be a fresh packing of its key and the transaction that key names.
        for key, row in self.core._keys.items():
            txn = self.core._lookup_key(key)
            assert txn is not None and txn.idempotency_key == key, (key, txn)
            assert row == _key_row(key, txn.txn_id.sequence)

    @invariant()
    def one_calls_are_open_while_staging_and_presumed_aborted_after(self):
        in_flight = {r.txn_id for append, _, _ in self.in_flight for r in append.records
                     if isinstance(r, Opened)}
        for txn_id in self.handed_out:
            if txn_id in self.model.opened or txn_id in in_flight:
                continue
            answer = self.core.verify(txn_id, TARGETS[0])
            # Staging until ended, or forgotten by a tick past its deadline (or a crash).
            staging = self.core.one_call(txn_id) is not None
            assert not staging or txn_id in self.staging, txn_id
            assert answer.state is (State.OPEN if staging else State.ABORTED), (txn_id, answer)

    @invariant()
    def nothing_is_forgotten_while_its_caller_may_retry(self):
        grace = MACHINE_LIMITS.finished_grace_ms
        for txn_id in self.model.completed:
            if self.model.retried_until[txn_id] + grace > self.now_ms:
                assert not self.forgotten(txn_id), (txn_id, self.now_ms)

    @invariant()
    def bounds_hold(self):
        metrics = self.core.metrics
        assert metrics.unfinished_transactions <= MACHINE_LIMITS.max_open
        # Past max_finished only those whose callers may still retry, and at most
        # max_finished_held (+ those admitted at it, unfinished then).
        assert metrics.finished_transactions <= (MACHINE_LIMITS.max_finished_held
                                                 + MACHINE_LIMITS.max_open)
        assert metrics.pending_appends == len(self.in_flight)
        assert len(self.core._streams) <= MACHINE_LIMITS.max_streams
        for summary in self.core.list_transactions(self.now_ms).transactions:
            assert summary.topic_partition_count + summary.subscription_partition_count \
                <= MACHINE_LIMITS.max_partitions
            assert summary.child_count <= MACHINE_LIMITS.max_children

    def teardown(self):
        """Liveness: with appends durable, markers delivered and time passing, every
        transaction finishes, and every target of a decided one got its marker."""
        for _ in range(40):
            while self.in_flight:
                self.append_durable()
            while self.markers:
                marker = self.markers[0]
                self.markers = [m for m in self.markers
                                if (m.txn_id, m.target) != (marker.txn_id, marker.target)]
                self.markers_seen.setdefault(marker.txn_id, set()).add(marker.target)
                self.perform(self.core.marker_confirmed(self.now_ms, marker.txn_id,
                                                        marker.target), "confirm")
            if not self.in_flight and not self.core.metrics.unfinished_transactions:
                break
            for txn_id in list(self.staging):  # their CommitTxns end (as the shell's do)
                self.staging.remove(txn_id)
                if self.core.is_staging(txn_id):
                    self.core.release_staging(txn_id)
            for txn_id, _ in self.core.staged_to_resolve():
                self.perform(self.core.resolve_staged(self.now_ms, txn_id,
                                                      txn_id in self.promised), "resolve")
            self.tick(MACHINE_LIMITS.max_prepared_timeout_ms)
        assert self.core.metrics.unfinished_transactions == 0
        for txn_id in self.promised:
            assert self.model.decided[txn_id] is COMMIT, txn_id
        for txn_id in self.model.decided:
            assert self.model.targets[txn_id] <= self.markers_seen.get(txn_id, set()), txn_id


CoordinatorMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestCoordinatorMachine = CoordinatorMachine.TestCase


# ---------------------------------------------------------------------------------------
# The transition table, walked whole
# ---------------------------------------------------------------------------------------

T1, CHILD = TxnId(TC, 1), TxnId(TC, 2)
NOW = 10_000


def opened(txn_id: TxnId = T1, **kwargs) -> Opened:
    return Opened(txn_id, NOW, 1_000, NOW + 1_000, **kwargs)


# Records that bring T1 (with targets, no children) to each state.
PATHS: dict[State, list] = {
    State.OPEN: [opened(topic_partitions=(TopicPartition("t", 0),))],
    State.PREPARED: [opened(), Prepared(T1, NOW, 5_000)],
    State.COMMITTING: [opened(), Decided(T1, COMMIT, EndCause.CLIENT, NOW)],
    State.ABORTING: [opened(), Decided(T1, ABORT, EndCause.TIMEOUT, NOW)],
    State.COMMITTED: [opened(), Decided(T1, COMMIT, EndCause.CLIENT, NOW),
                      Completed(T1, COMMIT, NOW)],
    State.ABORTED: [opened(), Decided(T1, ABORT, EndCause.CLIENT, NOW),
                    Completed(T1, ABORT, NOW)],
}
# The record that would move T1 into each state.
INTO: dict[State, object] = {
    State.OPEN: opened(),
    State.PREPARED: Prepared(T1, NOW, 5_000),
    State.COMMITTING: Decided(T1, COMMIT, EndCause.CLIENT, NOW),
    State.ABORTING: Decided(T1, ABORT, EndCause.OPERATOR, NOW),
    State.COMMITTED: Completed(T1, COMMIT, NOW),
    State.ABORTED: Completed(T1, ABORT, NOW),
}


@pytest.mark.parametrize("source", list(State), ids=lambda s: s.name)
@pytest.mark.parametrize("target", list(State), ids=lambda s: s.name)
def test_transition_table_walked_whole(source: State, target: State) -> None:
    core = replay(PATHS[source], TC)
    assert core.status(T1, NOW).state is source
    before = core.snapshot()
    if target in ALLOWED[source]:
        core.apply(INTO[target])
        assert core.status(T1, NOW).state is target
        assert (source, target) in TRANSITION_RECORDS
    else:
        with pytest.raises(IllegalTransition):
            core.apply(INTO[target])
        assert core.snapshot() == before
        assert core.status(T1, NOW).state is source


def test_table_shape() -> None:
    assert INITIAL_STATE is State.OPEN
    assert UNDECIDED | DECIDING | FINISHED == set(State)
    assert all(not ALLOWED[state] for state in FINISHED)
    # Every state is reachable from OPEN and every path ends in a final state.
    reachable, frontier = {State.OPEN}, [State.OPEN]
    while frontier:
        for following in ALLOWED[frontier.pop()]:
            if following not in reachable:
                reachable.add(following)
                frontier.append(following)
    assert reachable == set(State)
    # The decision, once made, has exactly one way forward.
    assert ALLOWED[State.COMMITTING] == {State.COMMITTED}
    assert ALLOWED[State.ABORTING] == {State.ABORTED}
    assert all(not ALLOWED[state] & FINISHED for state in UNDECIDED)  # no skipping the decision


@pytest.mark.parametrize("state", [s for s in State if s is not State.OPEN],
                         ids=lambda s: s.name)
def test_in_place_records_need_open(state: State) -> None:
    core = replay(PATHS[state], TC)
    before = core.snapshot()
    for record in (Registered(T1, (TopicPartition("t", 9),)), DeadlineReset(T1, NOW + 5)):
        with pytest.raises(IllegalTransition):
            core.apply(record)
        assert core.snapshot() == before


def _illegal_cases():
    parent = [opened(), opened(CHILD, parent=T1, topic_partitions=(TopicPartition("t", 1),))]
    session = SessionStarted("x", 5, 3, 1_000, NOW)
    yield "kept child not prepared", parent, Decided(T1, COMMIT, EndCause.CLIENT, NOW,
                                                      kept_children=(CHILD,))
    yield "a child left undecided", parent, Decided(T1, ABORT, EndCause.CLIENT, NOW)
    yield "not a child", [opened(), opened(CHILD)], Decided(
        T1, ABORT, EndCause.CLIENT, NOW, aborted_children=(CHILD,))
    yield "parent completes before its child", parent + [
        Decided(T1, ABORT, EndCause.CLIENT, NOW, aborted_children=(CHILD,))], \
        Completed(T1, ABORT, NOW)
    yield "child of a child", parent, opened(TxnId(TC, 3), parent=CHILD)
    yield "child of a decided parent", [opened(), Decided(T1, ABORT, EndCause.CLIENT, NOW)], \
        opened(CHILD, parent=T1)
    yield "sequence not growing", [opened(CHILD)], opened(T1)
    yield "another TC partition", [], opened(TxnId(TC + 1, 1))
    yield "unknown transaction", [], Prepared(T1, NOW, 1)
    yield "session not current", [session], opened(session=Session("x", 5, 2))
    yield "second open transaction of a session", [session, opened(session=session.session)], \
        opened(CHILD, session=session.session)
    yield "epoch not growing", [session], SessionStarted("x", 5, 3, 1_000, NOW)
    yield "session bump with its transaction undecided", [session,
                                                          opened(session=session.session)], \
        SessionStarted("x", 5, 4, 1_000, NOW)


@pytest.mark.parametrize("name,log,record", list(_illegal_cases()),
                         ids=[case[0] for case in _illegal_cases()])
def test_illegal_records_raise_and_change_nothing(name, log, record) -> None:
    core = replay(log, TC)
    before = core.snapshot()
    with pytest.raises(IllegalTransition):
        core.apply(record)
    assert core.snapshot() == before


# ---------------------------------------------------------------------------------------
# Focused behaviour
# ---------------------------------------------------------------------------------------

def settle(core: TcPartitionCore, ready, now_ms: int = NOW) -> list:
    """Make every append durable (and follow-ups); return the markers sent."""
    markers, queue = list(ready.markers), deque(ready.appends)
    while queue:
        follow = core.append_done(queue.popleft().append_id, now_ms)
        queue.extend(follow.appends)
        markers.extend(follow.markers)
    return markers


def test_replies_wait_for_their_append_and_queries_see_durable_state_only() -> None:
    core = TcPartitionCore(TC)
    ready = core.new_txn(NOW, topic_partitions=[TopicPartition("t", 0)])
    assert ready.reply is not None and len(ready.appends) == 1 and not ready.markers
    txn_id = ready.reply.txn_id
    with pytest.raises(AtomlogError) as caught:
        core.status(txn_id, NOW)
    assert caught.value.reason == "CONCURRENT_TRANSACTIONS"  # being opened: retriable
    settle(core, ready)
    decision = core.end_txn(NOW, txn_id, COMMIT)
    assert decision.reply.state is State.COMMITTING and not decision.markers
    assert core.status(txn_id, NOW).state is State.OPEN  # not durable yet
    markers = settle(core, decision)
    assert [(m.txn_id, m.decision, m.target) for m in markers] == [
        (txn_id, COMMIT, TopicPartition("t", 0))]


def test_init_producer_id_asks_for_a_producer_id_only_when_needed() -> None:
    core = TcPartitionCore(TC)
    with pytest.raises(ProducerIdNeeded):
        core.init_producer_id(NOW, "t1")
    assert core.pending_append_ids == ()
    ready = core.init_producer_id(NOW, "t1", fresh_producer_id=42)
    settle(core, ready)
    assert (ready.reply.producer_id, ready.reply.producer_epoch) == (42, 0)
    again = core.init_producer_id(NOW, "t1", fresh_producer_id=43)
    assert (again.reply.producer_id, again.reply.producer_epoch,
            again.reply.fresh_producer_id_used) == (42, 1, False)


def test_next_producer_epoch_never_issues_65535() -> None:
    assert next_producer_epoch(9, 0) == (9, 1)
    assert next_producer_epoch(9, PRODUCER_EPOCH_LAST_ISSUED - 1) == (9, 65534)
    assert next_producer_epoch(9, PRODUCER_EPOCH_LAST_ISSUED) is None
    with pytest.raises(ValueError):
        Session("x", 9, 65535)


def _init(core: TcPartitionCore, tid: str, given: tuple[int, int] = (0, 0),
          log: list | None = None, fresh: int = 77):
    """InitProducerId made durable (into `log`): its reply, or the refusal's reason."""
    try:
        try:
            ready = core.init_producer_id(NOW, tid, 0, *given)
        except ProducerIdNeeded:
            ready = core.init_producer_id(NOW, tid, 0, *given, fresh_producer_id=fresh)
    except AtomlogError as error:
        return error.reason
    _durable(core, ready, log if log is not None else [])
    return ready.reply


def test_a_prepared_child_waits_for_its_open_parent_past_its_own_prepared_timeout() -> None:
    """A long job's first children are prepared long before its parent commits. Before, a
    child timed out on its own prepared timeout (15 min by default, 1 h at most) while its
    parent was OPEN and kept alive, and the parent's commit failed (CHILD_NOT_PREPARED)
    after all the work. Now a PREPARED child of an OPEN parent waits as long as the
    parent does; the parent's own timeout still aborts both."""
    core = TcPartitionCore(TC, Limits(default_timeout_ms=10_000,
                                      default_prepared_timeout_ms=1_000))
    parent = core.new_txn(NOW, idempotency_key="job")
    settle(core, parent)
    child = core.new_txn(NOW, parent=parent.reply.txn_id, topic_partitions=[TARGETS[0]])
    settle(core, child)
    settle(core, core.prepare(NOW, child.reply.txn_id))
    later = NOW + 8_000  # past the child's prepared timeout, within the parent's
    settle(core, core.tick(later), later)
    waiting = core.status(child.reply.txn_id, later)
    assert waiting.state is State.PREPARED and waiting.remaining_ms == 2_000  # the parent's
    keep_alive = core.new_txn(later, idempotency_key="job")  # the parent's timeout again
    settle(core, keep_alive, later)
    later += 8_000
    settle(core, core.tick(later), later)
    assert core.status(child.reply.txn_id, later).state is State.PREPARED
    settle(core, core.end_txn(later, parent.reply.txn_id, COMMIT, [child.reply.txn_id]),
           later)
    assert core.status(child.reply.txn_id, later).state is State.COMMITTING  # (markers next)
    # A parent that times out (nothing keeps it alive) aborts its prepared child with it.
    dead = core.new_txn(later, idempotency_key="dead job")
    settle(core, dead, later)
    orphan = core.new_txn(later, parent=dead.reply.txn_id, topic_partitions=[TARGETS[0]])
    settle(core, orphan, later)
    settle(core, core.prepare(later, orphan.reply.txn_id), later)
    later += 10_001
    settle(core, core.tick(later), later)
    assert core.status(orphan.reply.txn_id, later).state in (State.ABORTING, State.ABORTED)


def test_a_parallel_commit_s_transaction_takes_no_children() -> None:
    """A parallel commit's one-call transaction is OPEN (its Staging record) until its
    CommitTxn decides it, and that decision decides no children. Before, NewTxn took it as
    a parent: the commit then left its child undecided, a hanging transaction, and the
    core's next append could come out of order (ProtocolError). Found by the state
    machine. Now the child is refused, PARENT_NOT_OPEN, and nothing changes."""
    core, log = TcPartitionCore(TC, coordinator_epoch=1), []
    _durable(core, core.begin_one_call(NOW, 0, None, "reserves", [TARGETS[0]], []), log)
    staged = core.begin_one_call(NOW, 0, None, "oc", [TARGETS[0]], [], parallel=True)
    _durable(core, staged, log)
    parent = staged.reply.txn_id
    assert core.is_staging(parent)
    before = core.snapshot()
    with pytest.raises(AtomlogError) as refused:
        core.new_txn(NOW, parent=parent)
    assert refused.value.reason == "PARENT_NOT_OPEN"
    assert refused.value.metadata["parent_state"] == "STAGING"
    assert core.snapshot() == before and core.pending_append_ids == ()


def test_an_epoch_bump_retried_after_its_answer_was_lost_gets_the_same_session() -> None:
    """KIP-360: a producer bumps its own epoch (InitProducerId carrying it), the answer is
    lost, and the producer asks again with the same epoch. Before, that retry was answered
    PRODUCER_FENCED and the producer could never go on. Now it gets the session its first
    call made, with nothing logged; after a load (by replay or from a snapshot) too."""
    core, log = TcPartitionCore(TC, coordinator_epoch=1), []
    first = _init(core, "app", log=log)
    held = (first.producer_id, first.producer_epoch)
    txn = core.new_txn(NOW, session=Session("app", *held), topic_partitions=[TARGETS[0]])
    _durable(core, txn, log)
    bumped = _init(core, "app", held, log)  # its answer lost
    assert (bumped.producer_id, bumped.producer_epoch) == (held[0], held[1] + 1)
    assert bumped.aborted_txn_id == txn.reply.txn_id
    retry = core.init_producer_id(NOW, "app", 0, *held)
    assert not retry.appends and retry.reply == dataclasses.replace(
        bumped, aborted_txn_id=None)
    for loaded in (replay(log, TC, coordinator_epoch=2),
                   TcPartitionCore.restore(core.snapshot(), TC, coordinator_epoch=2)[0]):
        again = loaded.init_producer_id(NOW, "app", 0, *held)
        assert not again.appends and again.reply == retry.reply
    # The retry is answered only once the bump is durable (before: still being logged).
    pending = core.init_producer_id(NOW, "app", 0, *(retry.reply.producer_id,
                                                    retry.reply.producer_epoch))
    with pytest.raises(AtomlogError) as concurrent:
        core.init_producer_id(NOW, "app", 0, *(retry.reply.producer_id,
                                              retry.reply.producer_epoch))
    assert concurrent.value.reason == "CONCURRENT_TRANSACTIONS"
    _durable(core, pending, log)


def test_a_zombie_s_old_epoch_is_still_fenced() -> None:
    """Only the bump its holder asked for makes the old epoch a retry. A new producer's
    takeover (InitProducerId carrying no epoch) fences the old holder, and so does any
    bump after the one that old epoch asked for."""
    core = TcPartitionCore(TC)
    first = _init(core, "app")
    held = (first.producer_id, first.producer_epoch)
    taken = _init(core, "app")  # a new instance takes the transactional id over
    assert taken.producer_epoch == held[1] + 1
    assert _init(core, "app", held) == "PRODUCER_FENCED"
    # The holder bumps (answer lost); a new instance takes over before the retry.
    mine = (taken.producer_id, taken.producer_epoch)
    _init(core, "app", mine)
    _init(core, "app")
    assert _init(core, "app", mine) == "PRODUCER_FENCED"
    # Two bumps of the holder's own: only the last one's epoch is a retry.
    now = core.session("app", NOW).session
    one = _init(core, "app", (now.producer_id, now.producer_epoch))
    two = _init(core, "app", (one.producer_id, one.producer_epoch))
    assert _init(core, "app", (now.producer_id, now.producer_epoch)) == "PRODUCER_FENCED"
    assert _init(core, "app", (one.producer_id, one.producer_epoch)).producer_epoch == \
        two.producer_epoch


def test_a_bump_to_a_fresh_producer_id_is_retried_too() -> None:
    """At the last epoch the bump rotates to a fresh producer id; its retry carries the old
    id and epoch, and gets the fresh id."""
    core, log = TcPartitionCore(TC), []
    _durable(core, core.init_producer_id(NOW, "app", fresh_producer_id=5), log)
    _durable(core, core.init_producer_id(NOW, "app", fresh_producer_id=6), log)
    last = (5, PRODUCER_EPOCH_LAST_ISSUED)
    core._sessions["app"].session = Session("app", *last)  # (as 65,533 bumps more would)
    rotated = _init(core, "app", last, log, fresh=9)
    assert (rotated.producer_id, rotated.producer_epoch) == (9, 0)
    retry = _init(core, "app", last, log)
    assert (retry.producer_id, retry.producer_epoch, retry.fresh_producer_id_used) == (9, 0,
                                                                                       False)
    assert encode_record(log[-1])[1] == records_module.SESSION_BUMPED_TYPE


def test_markers_are_resent_until_confirmed_and_counted() -> None:
    core = TcPartitionCore(TC, Limits(marker_retry_ms=100))
    ready = core.new_txn(NOW, subscription_partitions=[SubscriptionPartition("t", 0, "s")])
    settle(core, ready)
    txn_id = ready.reply.txn_id
    assert len(settle(core, core.end_txn(NOW, txn_id, ABORT))) == 1
    assert core.tick(NOW + 99).markers == ()
    for attempt in range(1, 4):
        assert len(core.tick(NOW + 100 * attempt).markers) == 1
    assert core.describe(txn_id, NOW).marker_retry_count == 3
    assert core.metrics.marker_resends_total == 3
    follow = core.marker_confirmed(NOW, txn_id, SubscriptionPartition("t", 0, "s"))
    settle(core, follow)
    assert core.status(txn_id, NOW).state is State.ABORTED
    assert core.tick(NOW + 10_000) == NO_WORK


def test_markers_are_resent_after_the_wall_clock_steps_back() -> None:
    """A marker sent at T and lost; the coordinator's clock then stepped back an hour
    (an NTP step, a resumed VM): `now - sent` stayed negative, so no tick re-sent it
    until the clock came back to T, and the partition's readers waited behind the
    transaction all that time. A sent time in the future counts as due, as the session
    sweep's does."""
    core = TcPartitionCore(TC, Limits(marker_retry_ms=1_000))
    at = NOW + 10_000_000
    ready = core.new_txn(at, subscription_partitions=[SubscriptionPartition("t", 0, "s")])
    settle(core, ready, at)
    assert len(settle(core, core.end_txn(at, ready.reply.txn_id, COMMIT), at)) == 1
    back = at - 3_600_000
    assert len(core.tick(back + 1_000).markers) == 1
    assert core.tick(back + 1_500).markers == ()  # (then every marker_retry_ms again)
    assert len(core.tick(back + 2_000).markers) == 1


def test_idle_holds_exactly_when_a_tick_however_late_has_nothing_to_do() -> None:
    """The shell ticks an idle() core about once a second instead of every 100 ms
    (coordinator/tc_partition.py): so idle() must hold only when a tick, however late,
    could do nothing (the sessions it may expire aside)."""
    core = TcPartitionCore(TC, Limits(default_timeout_ms=10, marker_retry_ms=100))
    assert core.idle() and core.tick(NOW + 10**9) == NO_WORK
    ready = core.new_txn(NOW, topic_partitions=[TopicPartition("t", 0)])
    # Being opened: nothing for a tick until the Opened record is durable (append_done
    # is an input too: it wakes the shell's ticker).
    assert core.idle()
    settle(core, ready)
    assert not core.idle()  # open: its timeout is due at NOW + 10
    markers = settle(core, core.tick(NOW + 10))
    assert [m.decision for m in markers] == [ABORT] and not core.idle()
    assert core.tick(NOW + 110).markers  # deciding: re-sent until confirmed
    settle(core, core.marker_confirmed(NOW + 120, markers[0].txn_id, markers[0].target))
    assert core.status(markers[0].txn_id, NOW).state is State.ABORTED
    assert core.idle() and core.tick(NOW + 10**9) == NO_WORK
    start = core.begin_one_call(NOW, 1_000, None, "k", [TopicPartition("t", 1)], [])
    assert not core.idle()  # being staged: forgotten by a tick 5 s past its deadline
    settle(core, start)
    assert not core.idle()
    ready = core.end_one_call(NOW + 5, start.reply.txn_id)
    markers = settle(core, ready)
    assert not core.idle()  # committing: its markers are re-sent until confirmed
    for marker in markers:
        settle(core, core.marker_confirmed(NOW + 6, marker.txn_id, marker.target))
    settle(core, core.tick(NOW + 7))  # its completion is proposed
    assert core.is_finished(start.reply.txn_id)
    assert core.idle() and core.tick(NOW + 10**9) == NO_WORK
    lost = core.begin_one_call(NOW, 1_000, None, "k2", [TopicPartition("t", 2)], [])
    settle(core, lost)
    assert not core.idle()
    assert core.tick(NOW + 1_000 + 5_000).markers  # staged, never ended: aborted by a tick
    assert core.idle()


def test_timeout_decisions_per_tick_are_bounded() -> None:
    core = TcPartitionCore(TC, Limits(max_decisions_per_tick=3, default_timeout_ms=10))
    for _ in range(7):
        settle(core, core.new_txn(NOW))
    batches = []
    for _ in range(3):
        ready = core.tick(NOW + 10)
        batches.append(sum(len(a.records) for a in ready.appends if any(
            isinstance(r, Decided) for r in a.records)))
        settle(core, ready)
    assert batches == [3, 3, 1]
    assert core.metrics.timeouts_total == 7


def test_sessions_expire_logically_and_their_slots_are_reused() -> None:
    core = TcPartitionCore(TC, Limits(max_sessions=1, session_expiry_ms=1_000))
    settle(core, core.init_producer_id(NOW, "a", fresh_producer_id=1))
    with pytest.raises(AtomlogError) as caught:
        core.init_producer_id(NOW + 1_000, "b", fresh_producer_id=2)
    assert caught.value.reason == "RESOURCE_EXHAUSTED"
    assert caught.value.metadata["limit"] == "transaction.max_sessions"
    assert core.session("a", NOW + 1_000) is not None
    assert core.session("a", NOW + 1_001) is None  # expired, still held in memory
    settle(core, core.init_producer_id(NOW + 1_001, "b", fresh_producer_id=2))
    assert core.metrics.sessions == 1


def test_tick_frees_expired_sessions_at_most_once_a_sweep_interval() -> None:
    core = TcPartitionCore(TC, Limits(session_expiry_ms=1_000))
    settle(core, core.init_producer_id(NOW, "a", fresh_producer_id=1))
    core.tick(NOW + 10)  # swept: nothing had expired
    core.tick(NOW + 1_001)  # expired, but the last sweep was under an interval ago
    assert core.metrics.sessions == 1 and core.session("a", NOW + 1_001) is None
    core.tick(NOW + 10 + SESSION_SWEEP_INTERVAL_MS)
    assert core.metrics.sessions == 0
    settle(core, core.init_producer_id(NOW + 5_000, "b", fresh_producer_id=2))
    core.tick(NOW + 5_500)
    core.tick(NOW + 100)  # the clock went back past the last sweep: swept, and from then
    core.tick(NOW + 6_001)  # on intervals count from there ("b" expired at 6,001)
    assert core.metrics.sessions == 0


def _stream_step(core: TcPartitionCore, key: str, stream: TxnStream, now_ms: int = NOW):
    """Open and commit a stream's step (the Spark writer's parent of a micro-batch)."""
    opened = core.new_txn(now_ms, 1_000, idempotency_key=key, stream=stream)
    settle(core, opened, now_ms)
    settle(core, core.end_txn(now_ms, opened.reply.txn_id, COMMIT, stream=stream), now_ms)
    return opened.reply.txn_id


def test_a_stream_keeps_its_committed_step_after_the_transaction_is_forgotten() -> None:
    """A Spark micro-batch replayed after its parent was forgotten (its key free again)
    is refused by the stream's high-water: not written twice. Live, after a full replay
    and from a snapshot; until the stream expires."""
    limits = Limits(max_finished=1, finished_grace_ms=1, stream_expiry_ms=60_000)
    core = TcPartitionCore(TC, limits)
    log: list = []
    real_done = core.append_done

    def logged(append_id, now_ms):
        log.extend(core._pending[0].records)
        return real_done(append_id, now_ms)
    core.append_done = logged
    committed = _stream_step(core, "q:5", TxnStream("q", 5))
    assert core.stream("q", NOW).ordinal == 5
    later = NOW + 5_000
    for index in range(3):  # finished after it, past its grace: it is forgotten
        other = core.new_txn(later, 100, idempotency_key=f"other-{index}")
        settle(core, other, later)
        settle(core, core.end_txn(later, other.reply.txn_id, ABORT), later)
    assert core._lookup_key("q:5") is None
    with pytest.raises(AtomlogError, match="UNKNOWN_TRANSACTION"):
        core.status(committed, later)
    assert any(isinstance(r, StreamCommitted) for r in log)
    tables = {"live": core, "replayed": replay(log, TC, limits),
              "restored": TcPartitionCore.restore(core.snapshot(), TC, limits)[0]}
    for name, table in tables.items():
        for ordinal in (5, 4, 0):
            before = table.snapshot()
            with pytest.raises(AtomlogError) as caught:
                table.new_txn(later, 1_000, idempotency_key=f"q:{ordinal}",
                              stream=TxnStream("q", ordinal))
            assert caught.value.reason == "STREAM_ORDINAL_COMMITTED", name
            assert caught.value.metadata == {
                "stream": "q", "ordinal": str(ordinal), "committed_ordinal": "5",
                "committed_txn_id": str(committed)}
            assert table.snapshot() == before and not table.pending_append_ids
        # The next step goes on; another stream is not held back.
        assert not table.new_txn(later, 1_000, idempotency_key="q:6",
                                 stream=TxnStream("q", 6)).reply.existing
        assert table.new_txn(later, 1_000, idempotency_key="r:0",
                             stream=TxnStream("r", 0)).appends
    # Past stream_expiry_ms after its last commit the stream is forgotten too (7 days
    # by default, as a transactional id's session).
    core = tables["restored"]
    assert core.stream("q", NOW + 60_000) is not None and core.stream("q", NOW + 60_001) is None
    assert core.new_txn(NOW + 60_001, 1_000, idempotency_key="q:5/again",
                        stream=TxnStream("q", 5)).appends


def test_a_commit_of_a_stream_step_committed_already_is_refused_and_changes_nothing() -> None:
    """Two parents of one micro-batch (the second opened by a key the coordinator had
    forgotten, before the first committed): the first commit wins, the second is refused
    with nothing decided, and can be aborted. A commit of the same stream while one is
    being logged waits (CONCURRENT_TRANSACTIONS)."""
    core = TcPartitionCore(TC)
    step = TxnStream("q", 1)
    first = core.new_txn(NOW, 1_000, idempotency_key="q:1", stream=step)
    second = core.new_txn(NOW, 1_000, idempotency_key="q:1/again", stream=step)
    settle(core, first)
    settle(core, second)
    pending = core.end_txn(NOW, first.reply.txn_id, COMMIT, stream=step)
    with pytest.raises(AtomlogError, match="CONCURRENT_TRANSACTIONS"):
        core.end_txn(NOW, second.reply.txn_id, COMMIT, stream=TxnStream("q", 2))
    settle(core, pending)
    before = core.snapshot()
    with pytest.raises(AtomlogError) as caught:
        core.end_txn(NOW, second.reply.txn_id, COMMIT, stream=step)
    assert caught.value.reason == "STREAM_ORDINAL_COMMITTED"
    assert core.snapshot() == before and not core.pending_append_ids
    settle(core, core.end_txn(NOW, second.reply.txn_id, ABORT, stream=step))
    assert core.stream("q", NOW).txn_id == first.reply.txn_id
    # A retried commit of the first is answered as before (the stream is not looked at).
    assert core.end_txn(NOW, first.reply.txn_id, COMMIT, stream=step).reply.already_ended


def test_streams_are_bounded_and_belong_to_top_level_transactions_only() -> None:
    core = TcPartitionCore(TC, Limits(max_streams=1, stream_expiry_ms=1_000))
    _stream_step(core, "a:0", TxnStream("a", 0))
    opened = core.new_txn(NOW, 5_000, idempotency_key="b:0", stream=TxnStream("b", 0))
    settle(core, opened)
    with pytest.raises(AtomlogError) as caught:
        core.end_txn(NOW, opened.reply.txn_id, COMMIT, stream=TxnStream("b", 0))
    assert caught.value.reason == "RESOURCE_EXHAUSTED"
    assert caught.value.metadata["limit"] == "transaction.max_streams"
    # "a" expires: its slot is taken (fail closed until then, never a silent eviction).
    settle(core, core.end_txn(NOW + 1_001, opened.reply.txn_id, COMMIT,
                              stream=TxnStream("b", 0)), NOW + 1_001)
    assert core.stream("a", NOW + 1_001) is None and core.stream("b", NOW + 1_001)
    assert len(core._streams) == 1
    parent = core.new_txn(NOW + 1_001, 1_000)
    settle(core, parent, NOW + 1_001)
    for kwargs in ({"parent": parent.reply.txn_id}, {"session": Session("tid", 1, 0)}):
        with pytest.raises(AtomlogError, match="INVALID_ARGUMENT"):
            core.new_txn(NOW + 1_001, 1_000, stream=TxnStream("c", 0), **kwargs)
    for bad in (("", 0), ("x" * 257, 0), ("q", -1), ("q", 2**64)):
        with pytest.raises(ValueError):
            TxnStream(*bad)


def test_the_finished_table_and_key_index_hold_nothing_the_collector_scans() -> None:
    # At max_finished in 16 TC partitions, tables the collector tracks took 300 ms of each
    # full collection; dicts of ints, strings and bytes are never tracked at all.
    core = TcPartitionCore(TC)
    for index in range(3):
        keyed = core.new_txn(NOW, idempotency_key=f"q/{index}")
        settle(core, keyed)
        settle(core, core.end_txn(NOW, keyed.reply.txn_id, COMMIT if index else ABORT))
    restored, _ = TcPartitionCore.restore(core.snapshot(), TC)
    for table in (core, restored):
        assert table.metrics.finished_transactions == 3
        assert not any(gc.is_tracked(index) for index in (
            table._finished, table._keys)), table
        assert table.new_txn(NOW, idempotency_key="q/2").reply.existing


def test_a_forgotten_transaction_takes_its_idempotency_key_along() -> None:
    limits = Limits(max_finished=1)
    core = TcPartitionCore(TC, limits)
    keyed = core.new_txn(NOW, idempotency_key="q/7")
    settle(core, keyed)
    settle(core, core.end_txn(NOW, keyed.reply.txn_id, COMMIT))
    assert core.new_txn(NOW, idempotency_key="q/7").reply.existing
    other = core.new_txn(NOW)
    settle(core, other)
    settle(core, core.end_txn(NOW, other.reply.txn_id, ABORT))
    # Past max_finished, but its caller may still retry it (a commit whose answer was
    # lost is retried with its key until its timeout): held, its key with it.
    assert core.metrics.evicted_total == 0 and core.metrics.held_total == 1
    assert core.new_txn(NOW, idempotency_key="q/7").reply.existing
    # Its deadline and the grace after it passed: the next completion forgets both.
    later = NOW + limits.default_timeout_ms + limits.finished_grace_ms
    third = core.new_txn(later)
    settle(core, third, later)
    settle(core, core.end_txn(later, third.reply.txn_id, ABORT), later)
    assert core.metrics.evicted_total == 2
    assert core.metrics.finished_transactions == 1
    restored, _ = TcPartitionCore.restore(core.snapshot(), TC, limits)
    for table in (core, restored):
        again = table.new_txn(later, idempotency_key="q/7")
        assert not again.reply.existing and again.reply.txn_id.sequence == 4


def test_a_long_timeout_does_not_hold_back_the_short_ones_finished_after_it() -> None:
    """Finished transactions are looked at oldest first; one held that outlives the
    newest (a 15-minute timeout among one-second ones) moves to the back instead of
    holding every one behind it until its own end."""
    limits = Limits(max_finished=1, finished_grace_ms=1_000)
    core = TcPartitionCore(TC, limits)

    def finish(at: int, timeout_ms: int = 1_000):
        txn = core.new_txn(at, timeout_ms=timeout_ms)
        settle(core, txn, at)
        settle(core, core.end_txn(at, txn.reply.txn_id, ABORT), at)
        return txn.reply.txn_id

    long = finish(NOW, timeout_ms=900_000)
    short = finish(NOW + 1)
    later = NOW + 10_000  # the short one's retries are over, the long one's are not
    newest = finish(later)
    assert core.metrics.evicted_total == 1
    assert core.status(long, later).state is State.ABORTED
    with pytest.raises(AtomlogError, match="UNKNOWN_TRANSACTION"):
        core.status(short, later)
    assert list(core._finished) == [newest.sequence, long.sequence]  # moved back
    restored, _ = TcPartitionCore.restore(core.snapshot(), TC, limits)
    assert list(restored._finished) == list(core._finished)


def test_at_max_finished_held_new_transactions_wait_for_retries_to_end() -> None:
    """Fail closed: a TC partition holding max_finished_held finished transactions
    whose callers may still retry refuses new ones (changing nothing) rather than
    forget a key a retried commit would then find free; once the first of them are past
    their retries it admits one, whose completion forgets them."""
    limits = Limits(max_finished=2, max_finished_held=3, finished_grace_ms=1_000)
    core = TcPartitionCore(TC, limits)
    for index in range(3):
        txn = core.new_txn(NOW + index, idempotency_key=f"k/{index}")
        settle(core, txn, NOW + index)
        settle(core, core.end_txn(NOW + index, txn.reply.txn_id, COMMIT), NOW + index)
    assert core.metrics.finished_transactions == 3 and core.metrics.evicted_total == 0
    before = core.snapshot()
    with pytest.raises(AtomlogError) as refused:
        core.new_txn(NOW + 10)
    assert refused.value.reason == "RESOURCE_EXHAUSTED"
    assert "max_finished_held" in str(refused.value)
    assert core.snapshot() == before  # nothing changed
    # A retried commit still finds its transaction.
    assert core.new_txn(NOW + 10, idempotency_key="k/0").reply.existing
    # The first one's retries are over: admitted, and its completion forgets.
    due = NOW + limits.default_timeout_ms + limits.finished_grace_ms
    with pytest.raises(AtomlogError):
        core.new_txn(due - 1)
    admitted = core.new_txn(due)
    settle(core, admitted, due)
    settle(core, core.end_txn(due, admitted.reply.txn_id, ABORT), due)
    assert core.metrics.evicted_total == 1 and core.metrics.finished_transactions == 3
    assert not core.new_txn(due + 1, idempotency_key="k/0").reply.existing  # (k/1: due + 1)


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="transaction.max_open"):
        Limits(max_open=0)
    with pytest.raises(ValueError, match="exceeds"):
        Limits(default_timeout_ms=10, max_timeout_ms=5)
    with pytest.raises(ValueError, match="65535"):
        Limits(max_partitions=70_000)


def test_the_core_imports_no_io() -> None:
    """Pure cores: no I/O, clock, randomness, threads or RPC in coordinator/core.py."""
    forbidden = {"asyncio", "grpc", "kazoo", "time", "random", "socket", "threading", "os"}
    for module in (core_module, records_module):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & forbidden, (module.__name__, imported & forbidden)


def test_docs_diagram_is_generated_from_the_table() -> None:
    doc = core_module.DOC_PATH.read_text()
    assert generated_doc() in doc, "run `python -m coordinator.core --write`"
    for (source, target), record in TRANSITION_RECORDS.items():
        assert f"{source.name} --> {target.name}: {record}" in doc


# ---------------------------------------------------------------------------------------
# Encodings
# ---------------------------------------------------------------------------------------

txn_ids = st.builds(TxnId, st.just(TC), st.integers(1, 2**64 - 1))
# A decided transaction's own id: below its children's (a transaction is not its own child).
parent_ids = st.builds(TxnId, st.just(TC), st.integers(1, 10**6 - 1))
names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1,
                max_size=20)
topic_partitions = st.lists(st.builds(TopicPartition, names, st.integers(0, 2**31 - 1)),
                            unique=True, max_size=3).map(tuple)
subscription_partitions = st.lists(st.builds(SubscriptionPartition, names,
                                             st.integers(0, 2**31 - 1), names),
                                   unique=True, max_size=3).map(tuple)
times = st.integers(-(2**63), 2**63 - 1)
sessions = st.builds(Session, names, st.integers(1, 2**63 - 1),
                     st.integers(0, PRODUCER_EPOCH_LAST_ISSUED))
records = st.one_of(
    st.builds(Opened, txn_ids, times, st.integers(1, 2**32 - 1), times,
              st.none(), st.one_of(st.none(), sessions),
              st.text(max_size=10), topic_partitions, subscription_partitions),
    st.builds(Opened, txn_ids, times, st.integers(1, 2**32 - 1), times,
              st.builds(TxnId, st.just(TC), st.integers(1, 100))),
    st.builds(Registered, txn_ids, topic_partitions.filter(bool), subscription_partitions),
    st.builds(DeadlineReset, txn_ids, times),
    st.builds(Prepared, txn_ids, times, st.integers(1, 2**32 - 1)),
    st.builds(Decided, parent_ids, st.just(ABORT), st.sampled_from(
        [EndCause.CLIENT, EndCause.TIMEOUT, EndCause.OPERATOR]), times,
              st.just(()), st.lists(st.builds(TxnId, st.just(TC), st.integers(10**6, 10**7)),
                                    unique=True, max_size=3).map(tuple)),
    st.builds(Decided, parent_ids, st.just(COMMIT), st.just(EndCause.CLIENT), times,
              st.lists(st.builds(TxnId, st.just(TC), st.integers(10**6, 10**7)),
                       unique=True, max_size=3).map(tuple)),
    st.builds(Completed, txn_ids, st.sampled_from(Decision), times),
    st.builds(SessionStarted, names, st.integers(1, 2**63 - 1),
              st.integers(0, PRODUCER_EPOCH_LAST_ISSUED), st.integers(1, 2**32 - 1), times),
    st.builds(SessionStarted, names, st.integers(2, 2**63 - 1),
              st.integers(0, PRODUCER_EPOCH_LAST_ISSUED), st.integers(1, 2**32 - 1), times,
              st.just(1), st.integers(0, PRODUCER_EPOCH_LAST_ISSUED)),  # bumped from 1
    st.builds(StreamCommitted, names, st.integers(0, 2**64 - 1), txn_ids, times),
)


@given(records)
@settings(max_examples=300, deadline=None)
def test_record_round_trip_and_truncations(record) -> None:
    data = encode_record(record)
    assert decode_record(data) == record
    for cut in range(len(data)):
        with pytest.raises(RecordCorrupt):
            decode_record(data[:cut])
    with pytest.raises(RecordCorrupt):
        decode_record(data + b"\0")


@pytest.mark.parametrize("data,why", [
    (b"\x02\x06" + b"\0" * 21, "version"),
    (b"\x01\x0c", "type"),
    (b"\x01\x0b\x01\x00q" + b"\0" * 8 + b"\0" * 12 + b"\0" * 8, "stream's txn id (0, 0)"),
    (b"\x01\x0b\x00\x00" + b"\0" * 8 + b"\x07\0\0\0\x01" + b"\0" * 15, "empty stream name"),
    (b"\x01\x0a\x01\x00a" + b"\x01" + b"\0" * 7 + b"\0\0" + b"\x01\0\0\0" + b"\0" * 8
     + b"\0" * 10, "bumped from producer id 0"),
    (b"\x01\x06" + b"\0" * 12 + b"\x01" + b"\0" * 8, "txn id (0, 0)"),
    (b"\x01\x06" + b"\x07\0\0\0\x01" + b"\0" * 7 + b"\x03" + b"\0" * 8, "decision 3"),
])
def test_malformed_records_are_refused(data: bytes, why: str) -> None:
    with pytest.raises(RecordCorrupt):
        decode_record(data)


@pytest.mark.parametrize("bad", [
    lambda: Decided(T1, COMMIT, EndCause.TIMEOUT, NOW),
    lambda: Decided(T1, ABORT, EndCause.CLIENT, NOW, kept_children=(CHILD,)),
    lambda: Decided(T1, COMMIT, EndCause.CLIENT, NOW, (CHILD,), (CHILD,)),
    lambda: Opened(T1, NOW, 0, NOW),
    lambda: Opened(T1, NOW, 1, NOW, parent=TxnId(TC + 1, 1)),
    lambda: Opened(T1, NOW, 1, NOW, parent=CHILD, session=Session("x", 1, 0)),
    lambda: Opened(T1, NOW, 1, NOW, topic_partitions=(TopicPartition("t", 0),) * 2),
    lambda: Registered(T1),
    lambda: TxnId(TC, 0),
    lambda: TopicPartition("", 0),
    lambda: TopicPartition("t" * 250, 0),
])
def test_value_objects_validate_themselves(bad) -> None:
    with pytest.raises(ValueError):
        bad()


def small_table() -> TcPartitionCore:
    core = TcPartitionCore(TC, coordinator_epoch=4)
    settle(core, core.init_producer_id(NOW, "tid", fresh_producer_id=5))
    parent = core.new_txn(NOW, idempotency_key="q/1",
                          topic_partitions=[TopicPartition("t", 0)])
    settle(core, parent)
    child = core.new_txn(NOW, parent=parent.reply.txn_id,
                         subscription_partitions=[SubscriptionPartition("t", 1, "s")])
    settle(core, child)
    settle(core, core.prepare(NOW, child.reply.txn_id))
    settle(core, core.new_txn(NOW, session=Session("tid", 5, 0)))
    done = core.new_txn(NOW, idempotency_key="q/0", stream=TxnStream("q", 0))
    settle(core, done)
    settle(core, core.end_txn(NOW, done.reply.txn_id, COMMIT, stream=TxnStream("q", 0)))
    settle(core, core.end_txn(NOW, parent.reply.txn_id, COMMIT, [child.reply.txn_id]))
    return core


def test_snapshot_round_trip_keeps_everything_but_marker_progress() -> None:
    core = small_table()
    data = core.snapshot(covered_offset=123)
    restored, covered = TcPartitionCore.restore(data, TC, coordinator_epoch=5)
    again = restored.snapshot(123)
    assert covered == 123 and again[:12] == data[:12]
    assert again[20:-4] == data[20:-4]  # all but the writer's epoch (and so the CRC)
    for txn_id in (TxnId(TC, s) for s in range(1, 5)):
        assert restored.describe(txn_id, NOW).summary == core.describe(txn_id, NOW).summary
    # The new owner re-sends every marker of the deciding transactions, with its epoch.
    markers = restored.tick(NOW).markers
    assert {(m.txn_id.sequence, m.coordinator_epoch) for m in markers} == {(1, 5), (2, 5)}


def test_every_bit_flip_and_truncation_of_a_snapshot_is_detected() -> None:
    data = small_table().snapshot()
    for index in range(len(data)):
        for bit in (0, 3, 7):
            flipped = bytearray(data)
            flipped[index] ^= 1 << bit
            with pytest.raises(SnapshotCorrupt):
                TcPartitionCore.restore(bytes(flipped), TC)
    for cut in range(len(data)):
        with pytest.raises(SnapshotCorrupt):
            TcPartitionCore.restore(data[:cut], TC)


def test_version_1_and_2_snapshots_are_still_read() -> None:
    """Version 3 added the streams' high-waters after the keys, version 2 each session's
    bumped_from; a snapshot written before either restores to the same table, with no
    stream and no bump to retry."""
    core = small_table()
    data = core.snapshot()
    body = bytearray(data[:-4])
    assert struct.unpack_from("<H", body, 4) == (3,)
    streams = struct.pack("<I", 1) + b"\x01\x00q" + struct.pack("<QQq", 0, 4, NOW)
    assert body.endswith(streams)
    del body[-len(streams):]
    struct.pack_into("<H", body, 4, 2)
    version_2 = bytes(body) + struct.pack("<I", crc32c.crc32c(bytes(body)))
    restored, _ = TcPartitionCore.restore(version_2, TC)
    assert restored.stream("q", NOW) is None and core.stream("q", NOW) is not None
    data = restored.snapshot()  # (version 3, no streams)
    assert data[20:-4] == bytes(body[20:]) + struct.pack("<I", 0)
    struct.pack_into("<H", body, 4, 1)
    session = b"\x03\x00tid"  # the one session's entry, then its bumped_from (none)
    at = bytes(body).rindex(session) + len(session) + core_module._SNAP_SESSION.size
    assert body[at:at + 10] == b"\0" * 10
    del body[at:at + 10]
    version_1 = bytes(body) + struct.pack("<I", crc32c.crc32c(bytes(body)))
    restored, _ = TcPartitionCore.restore(version_1, TC)
    assert restored.snapshot()[20:-4] == data[20:-4]


def test_a_snapshot_of_another_tc_partition_is_refused() -> None:
    with pytest.raises(SnapshotCorrupt, match="TC partition"):
        TcPartitionCore.restore(small_table().snapshot(), TC + 1)


# ---------------------------------------------------------------------------------------
# Load: 100,000 finished transactions
# ---------------------------------------------------------------------------------------

def finished_log(count: int) -> list:
    log = []
    for sequence in range(1, count + 1):  # one every 10 ms: 1,000 s of them
        txn_id, at = TxnId(TC, sequence), NOW + 10 * sequence
        log.append(Opened(txn_id, at, 60_000, at + 60_000,
                          idempotency_key=f"query-{sequence % 997}/batch-{sequence}",
                          topic_partitions=(TopicPartition("orders", sequence % 12),
                                            TopicPartition("audit", 0))))
        log.append(Decided(txn_id, COMMIT, EndCause.CLIENT, at + 1))
        log.append(Completed(txn_id, COMMIT, at + 2))
    return log


def test_load_100000_finished_transactions(capsys) -> None:
    count = 100_000
    values = [encode_record(record) for record in finished_log(count)]
    began = time.perf_counter()
    core = replay((decode_record(value) for value in values), TC)
    full_replay_s = time.perf_counter() - began
    began = time.perf_counter()
    data = core.snapshot()
    snapshot_s = time.perf_counter() - began
    # Load = snapshot + tail: the tail here is the records after it (a few hundred).
    tail = [decode_record(encode_record(r)) for r in finished_log(count + 100)[3 * count:]]
    began = time.perf_counter()
    restored, _ = TcPartitionCore.restore(data, TC)
    replay(tail, TC, base=restored)
    load_s = time.perf_counter() - began
    assert restored.metrics.finished_transactions == count  # the oldest 100 forgotten
    assert restored.status(TxnId(TC, count), NOW).state is State.COMMITTED
    with pytest.raises(AtomlogError, match="UNKNOWN_TRANSACTION"):
        restored.status(TxnId(TC, 100), NOW)
    with capsys.disabled():
        print(f"\n[load] {count} finished transactions: snapshot+tail load {load_s:.3f} s "
              f"(snapshot {len(data) / 1e6:.1f} MB, written in {snapshot_s:.3f} s); full "
              f"replay of {len(values)} records {full_replay_s:.2f} s")
    assert load_s < 2.0
    assert full_replay_s < 30.0  # the fallback when a snapshot is unreadable


# ---------------------------------------------------------------------------------------
# One-call transactions (CommitTxn): presumed abort, reservations, keys, fencing
# ---------------------------------------------------------------------------------------

def _durable(core: TcPartitionCore, ready, log: list) -> None:
    for append in ready.appends:
        log.extend(append.records)
        _durable(core, core.append_done(append.append_id, NOW), log)


def test_one_call_reserves_sequences_and_a_load_never_hands_them_out_again():
    core, log = TcPartitionCore(TC, coordinator_epoch=1), []
    ready = core.begin_one_call(NOW, 0, None, "k-1", [TopicPartition("t", 0)], [])
    assert ready.appends[0].records == (SequencesReserved(SEQUENCE_RESERVATION),)
    _durable(core, ready, log)
    first = ready.reply.txn_id
    second = core.begin_one_call(NOW, 0, None, "k-2", [TopicPartition("t", 1)], [])
    assert not second.appends  # inside the reservation: nothing to log
    assert core.verify(first, TopicPartition("t", 0)).state is State.OPEN
    assert not core.verify(first, TopicPartition("t", 1)).included
    # The owner dies before deciding either: a new owner presumes both aborted and starts
    # above the reservation (a deposed owner may have staged anything below it).
    loaded = replay(log, TC, coordinator_epoch=2)
    for txn_id in (first, second.reply.txn_id):
        answer = loaded.verify(txn_id, TopicPartition("t", 0))
        assert answer.state is State.ABORTED and answer.coordinator_epoch == 2
    fresh = loaded.new_txn(NOW, topic_partitions=[TopicPartition("t", 0)])
    assert fresh.reply.txn_id.sequence == SEQUENCE_RESERVATION + 1
    with pytest.raises(AtomlogError) as unknown:  # never handed out: not presumed anything
        loaded.verify(TxnId(TC, 3 * SEQUENCE_RESERVATION), TopicPartition("t", 0))
    assert unknown.value.reason == "UNKNOWN_TRANSACTION"


def test_one_call_commits_in_one_append_and_a_retry_with_its_key_finds_it():
    core, log = TcPartitionCore(TC, coordinator_epoch=1), []
    targets = [TopicPartition("t", 0), TopicPartition("u", 1)]
    start = core.begin_one_call(NOW, 0, None, "key", targets, [SubscriptionPartition("t", 0, "s")])
    _durable(core, start, log)
    txn_id = start.reply.txn_id
    with pytest.raises(AtomlogError) as busy:  # the same key while it is being staged
        core.begin_one_call(NOW, 0, None, "key", targets, [])
    assert busy.value.reason == "CONCURRENT_TRANSACTIONS"
    ready = core.end_one_call(NOW + 5, txn_id)
    (append,) = ready.appends
    assert [type(r) for r in append.records] == [Opened, Decided]
    assert ready.reply.state is State.COMMITTING
    done = core.append_done(append.append_id, NOW + 6)
    assert {m.target for m in done.markers} == {*targets, SubscriptionPartition("t", 0, "s")}
    assert core.one_call(txn_id) is None and core.status(txn_id, NOW).state is State.COMMITTING
    again = core.begin_one_call(NOW + 7, 0, None, "key", targets, [])
    assert again.reply == OneCallStart(txn_id, again.reply.timeout_ms, State.COMMITTING)
    # Replaying the log gives the same table (Opened out of sequence order is allowed
    # inside a reservation).
    log.extend(append.records)
    assert replay(log, TC, coordinator_epoch=1).snapshot() == core.snapshot()


def test_one_call_failures_log_nothing_and_abort_what_was_staged():
    core, log = TcPartitionCore(TC, coordinator_epoch=3), []
    start = core.begin_one_call(NOW, 1_000, None, "k", [TopicPartition("t", 0)], [])
    _durable(core, start, log)
    txn_id = start.reply.txn_id
    failure = AtomlogError("TRANSACTION_CONFLICT", "an ack is pending elsewhere")
    ready = core.end_one_call(NOW, txn_id, failure)
    assert isinstance(ready.reply, OneCallAborted) and ready.reply.error is failure
    assert not ready.appends
    assert [(m.decision, m.target, m.coordinator_epoch) for m in ready.markers] == [
        (ABORT, TopicPartition("t", 0), 3)]
    assert core.verify(txn_id, TopicPartition("t", 0)).state is State.ABORTED
    with pytest.raises(AtomlogError) as gone:
        core.end_one_call(NOW, txn_id)
    assert gone.value.reason == "TRANSACTION_ABORTED"
    # Staged past its timeout: refused as timed out; a forgotten one is dropped by tick.
    late = core.begin_one_call(NOW, 1_000, None, "k2", [TopicPartition("t", 0)], []).reply
    assert core.end_one_call(NOW + 1_000, late.txn_id).reply.error.reason == \
        "TRANSACTION_TIMED_OUT"
    lost = core.begin_one_call(NOW, 1_000, None, "k3", [TopicPartition("t", 1)], []).reply
    assert not core.tick(NOW + 1_000 + 4_999).markers
    swept = core.tick(NOW + 1_000 + 5_000)
    assert [m.txn_id for m in swept.markers] == [lost.txn_id]
    assert core.one_call(lost.txn_id) is None


def test_a_chain_of_one_call_transactions_is_decided_in_one_append_or_not_at_all():
    """end_one_calls (CommitTxns): every decision of the chain in one append; the first
    that does not commit aborts every one after it (EARLIER_COMMIT_FAILED); a failed
    append commits none of them."""
    core, log = TcPartitionCore(TC, coordinator_epoch=2), []
    tp = TopicPartition("t", 0)

    def begin(key: str) -> TxnId:
        start = core.begin_one_call(NOW, 1_000, None, key, [tp], [])
        _durable(core, start, log)
        return start.reply.txn_id

    first, second, third = begin("a"), begin("b"), begin("c")
    ready = core.end_one_calls(NOW + 1, [(first, None), (second, None), (third, None)])
    (append,) = ready.appends
    assert [type(r) for r in append.records] == [Opened, Decided] * 3
    assert [r.state for r in ready.reply] == [State.COMMITTING] * 3 and not ready.markers
    _durable(core, ready, log)
    assert {core.status(t, NOW).state for t in (first, second, third)} == {State.COMMITTING}
    # A failure in the middle: the one before commits, the ones after are aborted.
    before, failing, after, last = begin("d"), begin("e"), begin("f"), begin("g")
    conflict = AtomlogError("TRANSACTION_CONFLICT", "an ack is pending elsewhere")
    ready = core.end_one_calls(NOW + 2, [(before, None), (failing, conflict), (after, None),
                                         (last, None)])
    (append,) = ready.appends
    assert [r.txn_id for r in append.records] == [before, before]
    assert ready.reply[0].state is State.COMMITTING
    assert ready.reply[1].error is conflict
    assert [r.error.reason for r in ready.reply[2:]] == ["EARLIER_COMMIT_FAILED"] * 2
    assert sorted(m.txn_id.sequence for m in ready.markers) == sorted(
        t.sequence for t in (failing, after, last))
    assert {m.decision for m in ready.markers} == {ABORT}
    _durable(core, ready, log)
    for txn_id in (failing, after, last):
        assert core.verify(txn_id, tp).state is State.ABORTED
    # One timed out first: nothing of the chain commits, nothing is appended.
    late, later = begin("h"), begin("i")
    ready = core.end_one_calls(NOW + 1_000, [(late, None), (later, None)])
    assert not ready.appends
    assert [r.error.reason for r in ready.reply] == ["TRANSACTION_TIMED_OUT",
                                                     "EARLIER_COMMIT_FAILED"]
    # A failed append: both roll back, together, and are aborted (presumed abort: nothing
    # of them is logged). Until 2026-12-06 they stayed staging, holding their keys, their
    # sessions and their partitions' max read position until their timeouts.
    one, two = begin("j"), begin("k")
    ready = core.end_one_calls(NOW + 3, [(one, None), (two, None)])
    (append,) = ready.appends
    failed = core.append_failed(append.append_id)
    assert sorted(m.txn_id for m in failed.markers) == sorted([one, two])
    assert {m.decision for m in failed.markers} == {ABORT}
    assert [core.verify(t, tp).state for t in (one, two)] == [State.ABORTED] * 2
    again = core.begin_one_call(NOW + 4, 0, None, "j", [tp], [])  # the key is free
    assert isinstance(again.reply, OneCallStart) and again.reply.txn_id not in (one, two)
    core.end_one_call(NOW + 4, again.reply.txn_id, AtomlogError("INTERNAL", "(test)"))
    assert replay(log, TC, coordinator_epoch=2).snapshot() == core.snapshot()


def test_one_call_of_a_session_is_fenced_by_a_newer_session():
    core, log = TcPartitionCore(TC, coordinator_epoch=1), []
    with pytest.raises(ProducerIdNeeded):
        core.init_producer_id(NOW, "app")
    ready = core.init_producer_id(NOW, "app", fresh_producer_id=50)
    _durable(core, ready, log)
    session = Session("app", 50, 0)
    start = core.begin_one_call(NOW, 0, session, "k", [TopicPartition("t", 0)], [])
    _durable(core, start, log)
    with pytest.raises(AtomlogError) as busy:  # one transaction per session at a time
        core.begin_one_call(NOW, 0, session, "k2", [TopicPartition("t", 0)], [])
    assert busy.value.reason == "CONCURRENT_TRANSACTIONS"
    _durable(core, core.init_producer_id(NOW, "app", 0, 50, 0), log)  # a newer session
    ended = core.end_one_call(NOW, start.reply.txn_id)
    assert ended.reply.error.reason == "PRODUCER_FENCED" and not ended.appends
    with pytest.raises(AtomlogError) as stale:
        core.begin_one_call(NOW, 0, session, "k3", [TopicPartition("t", 0)], [])
    assert stale.value.reason == "PRODUCER_FENCED"


@pytest.mark.parametrize("meanwhile", ["sweep", "new instance"])
def test_a_session_does_not_expire_while_its_one_call_transaction_is_staged(meanwhile):
    """The session's expiry fell inside its one-call transaction's staging. The tick's
    sweep freed it, or a new instance's InitProducerId found it expired and started a
    fresh one without fencing the transaction; the commit then logged an Opened record of
    a session that was not current, which append_done (and every later replay) refused:
    the TC partition could never load again. Now a session with a transaction being
    staged is live, so a new instance bumps it and fences the transaction."""
    limits = Limits(session_expiry_ms=1_000)
    core, log = TcPartitionCore(TC, limits, coordinator_epoch=1), []
    _durable(core, core.init_producer_id(NOW, "app", fresh_producer_id=50), log)
    session = Session("app", 50, 0)
    start = core.begin_one_call(NOW + 900, 0, session, "k", [TopicPartition("t", 0)], [])
    _durable(core, start, log)
    if meanwhile == "sweep":
        core.tick(NOW + 1_500)
        ended = core.end_one_call(NOW + 1_600, start.reply.txn_id)
        assert isinstance(ended.reply, EndTxnResult)  # still its session's: it commits
    else:
        bumped = core.init_producer_id(NOW + 1_500, "app", fresh_producer_id=51)
        assert (bumped.reply.producer_id, bumped.reply.producer_epoch) == (50, 1)
        _durable(core, bumped, log)
        ended = core.end_one_call(NOW + 1_600, start.reply.txn_id)
        assert ended.reply.error.reason == "PRODUCER_FENCED" and not ended.appends
    _durable(core, ended, log)
    loaded = replay(log, TC, limits, coordinator_epoch=2)
    assert loaded.verify(start.reply.txn_id, TopicPartition("t", 0)).state is (
        State.COMMITTING if meanwhile == "sweep" else State.ABORTED)


def test_sequences_reserved_records_round_trip_and_bad_ones_are_refused():
    record = SequencesReserved(12_345)
    assert decode_record(encode_record(record)) == record
    with pytest.raises(ValueError):
        SequencesReserved(0)
    with pytest.raises(RecordCorrupt):
        decode_record(encode_record(record) + b"\x00")


def test_abort_one_call_leaves_a_tombstone_that_no_late_call_commits_past():
    core, log = TcPartitionCore(TC, coordinator_epoch=1), []
    ready = core.abort_one_call(NOW, "gave-up")
    assert ready.reply is State.ABORTING
    _durable(core, ready, log)  # Opened + Decided(ABORT); no targets, so Completed at once
    assert [type(r) for r in log] == [Opened, Decided, Completed]
    with pytest.raises(AtomlogError) as late:
        core.begin_one_call(NOW, 0, None, "gave-up", [TopicPartition("t", 0)], [])
    assert late.value.reason == "TRANSACTION_ABORTED"
    assert core.abort_one_call(NOW, "gave-up").reply is State.ABORTED  # again: fine
    start = core.begin_one_call(NOW, 0, None, "done", [TopicPartition("t", 0)], [])
    _durable(core, start, log)
    with pytest.raises(AtomlogError) as busy:
        core.abort_one_call(NOW, "done")
    assert busy.value.reason == "CONCURRENT_TRANSACTIONS"
    _durable(core, core.end_one_call(NOW, start.reply.txn_id), log)
    with pytest.raises(AtomlogError) as committed:
        core.abort_one_call(NOW, "done")
    assert committed.value.reason == "TRANSACTION_ALREADY_COMMITTED"


def test_a_reservation_that_is_not_logged_forgets_its_one_call():
    core = TcPartitionCore(TC, coordinator_epoch=1)
    ready = core.begin_one_call(NOW, 0, None, "k", [TopicPartition("t", 0)], [])
    (append,) = ready.appends
    assert core.append_failed(append.append_id) == NO_WORK
    assert core.one_call(ready.reply.txn_id) is None  # its caller heard the failure
    again = core.begin_one_call(NOW, 0, None, "k", [TopicPartition("t", 0)], [])
    assert again.appends  # the key is free, and the reservation is asked for again


def test_a_tc_log_append_refused_after_an_unknown_outcome_reloads_instead_of_rolling_back():
    """TxnLog.append's rule (coordinator/txn_log.py, after_failed_append): a definite
    refusal rolls the batch's transitions back only while no earlier attempt's outcome is
    unknown. After a timeout the leader may have appended the batch; a retry refused with
    NOT_ENOUGH_REPLICAS says nothing about that first attempt, so the owner gives the TC
    partition up and it is loaded again from the log (chaos seed 2580: a Completed record
    rolled back in memory but present in the log was written again, and the TC partition
    could never be replayed)."""
    from coordinator.txn_log import RETRY_REASONS, UNKNOWN_OUTCOME_REASONS, after_failed_append

    assert UNKNOWN_OUTCOME_REASONS <= RETRY_REASONS
    for reason in RETRY_REASONS:
        assert after_failed_append(reason, False) == after_failed_append(reason, True) == "retry"
    for reason in ("NOT_ENOUGH_REPLICAS", "INVALID_ARGUMENT", "MESSAGE_TOO_LARGE"):
        assert after_failed_append(reason, False) == "reject"
        assert after_failed_append(reason, True) == "reload"
    assert after_failed_append("PRODUCER_FENCED", False) == "reload"


def test_an_append_s_outcome_reads_the_owner_s_list_and_the_partition_server_s_result():
    """A TC-log append started in a callback (TxnLog.append_here) is answered by this
    process's owner (a one-element list) or by a partition server's ProduceResult; a
    refusal with a reason this server does not know (a newer server's) reads as INTERNAL,
    where building the AtomlogError from it raised in the callback and left the append's
    callers unanswered."""
    from atomlog.v1 import partition_pb2
    from coordinator.txn_log import append_outcome

    refused = AtomlogError("NOT_ENOUGH_REPLICAS", "two of three")
    assert append_outcome([refused]) is refused
    ok = partition_pb2.ProduceResult(base_offset=4, last_offset=6)
    assert append_outcome(ok) is ok
    error = append_outcome(partition_pb2.ProduceResult(error=partition_pb2.ItemError(
        reason="NOT_ENOUGH_REPLICAS", message="two of three", metadata={"isr": "2"})))
    assert (error.reason, error.message, error.metadata) == (
        "NOT_ENOUGH_REPLICAS", "two of three", {"isr": "2"})
    newer = append_outcome(partition_pb2.ProduceResult(error=partition_pb2.ItemError(
        reason="A_REASON_FROM_A_NEWER_SERVER", message="?")))
    assert newer.reason == "INTERNAL"


def test_a_parallel_commit_resolution_that_fails_gives_the_tc_partition_up():
    """The resolution of a Staging transaction nobody decides runs in a task of its own.
    An error escaping it (a defect; the resolver's own failures are asked again at a
    later tick) used to end that task unread, leaving the transaction Staging (which
    never times out) and its partitions' max read position held. Now it is guarded as
    the writer and the ticker are: logged, and the lease given up so that a fresh owner
    reloads the TC partition from its log and resolves it."""
    import asyncio

    from coordinator.tc_partition import Phase, Settings, TcPartition

    txn = TxnId(3, 9)
    fenced, resolved = [], []

    class Core:
        def staged_to_resolve(self):
            return [(txn, (TopicPartition("t", 0),))]

        def resolve_staged(self, now, txn_id, staged):
            resolved.append((txn_id, staged))
            raise RuntimeError("a defect in resolve_staged (test)")

    async def resolver(txn_id, epoch, targets):
        return True

    async def on_fenced(tc_partition):
        fenced.append(tc_partition)

    async def scenario():
        partition = TcPartition(3, 1, 1000, coordinator_name="c", routes=None,
                                log_channel=None, markers=None, limits=Limits(),
                                settings=Settings(), on_fenced=on_fenced, resolver=resolver)
        partition.phase, partition.core = Phase.ACTIVE, Core()
        partition._start_resolutions()
        for _ in range(200):
            if fenced:
                break
            await asyncio.sleep(0.01)
        assert resolved == [(txn, True)] and fenced == [3]
        assert partition.phase is Phase.STOPPED and partition.core is None
        assert not partition._resolving

    asyncio.run(scenario())


def test_an_append_completed_in_a_callback_that_fails_gives_the_tc_partition_up():
    """An append made in this process (the commit lane's decisions on the combined
    server) is completed in its future's callback. An error there (a defect: the core's
    append_done refusing it) went to asyncio's handler only: the core's pending appends
    were never completed and every later one refused, while the TC partition kept its
    lease, deaf. Now it is given up as the writer's failure is."""
    import asyncio
    import time as time_module
    from types import SimpleNamespace

    from coordinator.core import Append
    from coordinator.tc_partition import Phase, Settings, TcPartition

    fenced = []

    class Core:
        def append_done(self, append_id, now):
            raise IllegalTransition("a defect in append_done (test)")

    async def on_fenced(tc_partition):
        fenced.append(tc_partition)

    async def scenario():
        partition = TcPartition(3, 1, 1000, coordinator_name="c", routes=None,
                                log_channel=None, markers=None, limits=Limits(),
                                settings=Settings(), on_fenced=on_fenced)
        partition.phase, partition.core = Phase.ACTIVE, Core()
        partition.log = SimpleNamespace(appended=lambda count: None)
        waiting = partition._append_futures[1] = asyncio.get_running_loop().create_future()
        done = asyncio.get_running_loop().create_future()
        done.set_result([SimpleNamespace(last_offset=41)])
        partition._in_flight = ([Append(1, ())], [b"record"], time_module.perf_counter(),
                                done)
        partition._appended_here(done)
        for _ in range(200):
            if fenced:
                break
            await asyncio.sleep(0.01)
        assert fenced == [3] and partition.phase is Phase.STOPPED
        assert waiting.done() and waiting.exception().reason == "NOT_COORDINATOR"

    asyncio.run(scenario())



def test_an_append_made_in_this_process_not_answered_in_time_is_sent_again():
    """An append made in this process (the commit lane's decisions on the combined
    server) waits on its owner's future. One never answered held the TC partition's
    appends for good, every commit gathered on it with them, and nothing was logged.
    Now it counts as an attempt whose outcome is unknown once
    coordinator.log_request_timeout_ms passes: the writer sends the same batch again
    (the log's producer sequence de-duplicates it), the append completes once, and the
    owner's late answer changes nothing."""
    import asyncio
    from types import SimpleNamespace

    from coordinator.core import Append
    from coordinator.tc_partition import Phase, Settings, TcPartition

    done_appends, attempts, appended_here = [], [], []

    class Core:
        def append_done(self, append_id, now):
            done_appends.append(append_id)
            return SimpleNamespace(appends=[], markers=[], completed=[])

    async def on_fenced(tc_partition):
        raise AssertionError("not fenced (test)")

    async def scenario():
        loop = asyncio.get_running_loop()
        never = loop.create_future()  # the owner's answer, late

        class Log:
            def append_here(self, entries):
                return never

            def appended(self, count):
                appended_here.append(count)

            async def append(self, entries, failed=None):
                attempts.append((entries, failed))
                return 40, 41

        partition = TcPartition(3, 1, 1000, coordinator_name="c", routes=None,
                                log_channel=None, markers=None, limits=Limits(),
                                settings=Settings(log_request_timeout_ms=100),
                                on_fenced=on_fenced)
        partition.phase, partition.core = Phase.ACTIVE, Core()
        partition.log = Log()
        waiting = partition._append_futures[1] = loop.create_future()
        partition._queue.append(Append(1, ()))
        partition._append_now()
        assert partition._in_flight is not None and not partition._queue
        writer = asyncio.ensure_future(partition._writer())
        partition._wake.set()
        await asyncio.wait_for(asyncio.shield(waiting), 5)
        assert waiting.result() is None and done_appends == [1]
        assert len(attempts) == 1 and attempts[0][1].reason == "REQUEST_TIMED_OUT"
        assert partition._in_flight is None and partition._returned is None
        never.set_result([SimpleNamespace(last_offset=41)])  # the late answer
        await asyncio.sleep(0.05)
        assert done_appends == [1] and appended_here == [] and len(attempts) == 1
        partition.phase = Phase.STOPPED
        partition._wake.set()
        await asyncio.wait_for(writer, 5)

    asyncio.run(scenario())
