"""The state machine of ONE transaction-coordinator (TC) partition: a pure core.

No I/O, no clock, no threads, no grpc or asyncio: every input carries `now_ms` (the
coordinator's clock, milliseconds since the Unix epoch) and returns what the shell must do.
One owner task per TC partition calls it; nothing else touches it (etcd raft's RawNode
shape, Kafka's TransactionCoordinator transitions, h11's table of states).

Transactions: OPEN -> (PREPARED) -> COMMITTING | ABORTING -> COMMITTED | ABORTED, as the
table `ALLOWED` says (docs/coordinator.md draws it). COMMITTING/ABORTING is the durable
decision; nothing ever flips it.

The shell's contract (the "Ready" loop)
---------------------------------------
Every mutating input (new_txn, add_partitions, add_subscriptions, prepare, end_txn, abort,
init_producer_id, tick, marker_confirmed, append_done, append_failed) either raises
AtomlogError — and then changed nothing — or returns a `Ready`, whose parts the shell
performs in this order:

  1. `appends`: append each `Append.records` (encode_record each) to `__txn_log-<k>` as one
     batch, fenced by the coordinator epoch, in the order given and after every earlier
     append; when it is durable call `append_done(append_id, now_ms)` — strictly in append
     order — and perform the Ready that returns (same rules, recursively). If an append is
     known NOT to have been written (refused before writing), call `append_failed`: the
     prepared transition is rolled back. If its outcome is unknown (timeout, lost reply),
     drop the core and load the partition again (replay), since the log may hold it.
  2. `reply`: the answer to the caller of this input. Send it only after every append of
     this same Ready is durable (the decision is in the log before anyone hears of it);
     if an append failed, answer with that failure instead (retriable). A Ready without
     appends may be answered at once.
  3. `markers`: send EndTxnOnPartition for each (the shell batches them per partition
     server: TxnMarker(txn_id, decision, coordinator_epoch, partitions, subscriptions)).
     Markers only ever come from append_done and tick, for decisions already durable, so
     they never wait for the appends of their own Ready. For every confirmed target call
     `marker_confirmed(now_ms, txn_id, target)` (or `markers_confirmed` with every
     target one answer confirmed); ignore failures — `tick` re-sends every
     unconfirmed marker each `marker_retry_ms`. On STALE_COORDINATOR_EPOCH the shell has
     lost the TC partition: drop the core.
  4. follow-up `appends` (Completed records, once every marker of a transaction is
     confirmed) come back from marker_confirmed / tick / append_done and go round 1-3;
     `completed` names the transactions now COMMITTED/ABORTED (EndTxn wait_for_markers).

State changes only in `append_done` (or `apply` during a replay); queries see durable
state only. While an append about a transaction (or its parent, children, session or
idempotency key) is in flight, other inputs on it get CONCURRENT_TRANSACTIONS (retriable).
Call `tick(now_ms)` periodically (every ~100 ms) and once right after loading: it aborts
transactions past their timeouts, logs completions that are due, re-sends markers, and
forgets expired sessions. While `idle()` (nothing unfinished, nothing being staged) a tick
only expires sessions, so about once a second is enough until the next input.

Loading (and why the log stays bounded)
---------------------------------------
`replay(records)` rebuilds the table from the log; `restore(snapshot)` then
`core.apply(record)` for each record after it gives the same table: load = snapshot +
tail. The shell writes `snapshot()` periodically (with the log offset it covers), so
everything below the latest snapshot can be deleted by offset (docs/record-format.md,
section 3): the table itself is bounded — unfinished transactions by `max_open`,
finished ones by `max_finished`, sessions by `max_sessions` — so the snapshot and the
tail are too. After loading, every COMMITTING/ABORTING transaction re-sends its markers on
the first tick (markers are idempotent at the partition servers), OPEN and PREPARED ones
keep their absolute deadlines, and no decision is ever changed.

Marker confirmations are not logged (only Completed is), so after a load every marker of
a deciding transaction is sent again. Session expiry is logical (decided from `now_ms` and
logged times), so decisions never depend on when `tick` ran.

Retention of finished transactions: the last `max_finished` transactions to finish
(COMMITTED/ABORTED, in order of completion) are remembered — their state, cause, times,
counts, session, idempotency key, kept/aborted children — not their partition lists. An
older one is forgotten: calls about it get UNKNOWN_TRANSACTION, and its idempotency key is
free again (a NewTxn with that key starts a NEW transaction, so max_finished must cover
the replay window of idempotent writers such as Spark streaming). But never while its
caller may still be retrying: not before `finished_grace_ms` past its deadline (a commit
whose answer was lost is retried with its key until its timeout, then settled by an
abort with the key, which must find it). Those held past max_finished are looked at
again later (one outliving the newest moves to the back of the order, so a long timeout
holds back none behind it); at `max_finished_held` new transactions
are refused with RESOURCE_EXHAUSTED until some are forgotten. Forgetting happens only
as Completed records are applied, at their logged times, so a load forgets exactly what
the live table did; at the hard bound a new transaction is admitted only when the first
ones its completion will look at include one to forget (`_forgettable`), so the table
stays within `max_finished_held` + `max_open`.

Streams: a top-level transaction may name its place in an ordered stream (TxnStream: a
Spark streaming query and its micro-batch id). The TC partition the stream's name hashes
to keeps each stream's highest committed ordinal (a StreamCommitted record, appended with
the Decided(COMMIT) it belongs to) for `stream_expiry_ms` after its last commit, at most
`max_streams` of them: a NewTxn or a commit of an ordinal at or below it is refused with
STREAM_ORDINAL_COMMITTED, however long ago the transaction itself was forgotten. Expiry
is logical, as sessions'.

Transactional ids: the shell routes each id to tc_partition_for(id) and serves
InitProducerId through `init_producer_id`. When that needs a producer id (a new session,
or an epoch that would reach 65535) it raises `ProducerIdNeeded` (nothing changed); the
shell takes one from its allocator block and calls again with `fresh_producer_id`.
"""

from __future__ import annotations

import argparse
import enum
import heapq
import itertools
import struct
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, NamedTuple, Sequence

import crc32c

from coordinator.records import (
    MAX_IDEMPOTENCY_KEY_BYTES, MAX_TRANSACTIONAL_ID_BYTES, PRODUCER_EPOCH_LAST_ISSUED,
    TIMEOUT_MS_MAX, Completed, DeadlineReset, Decided, Decision, EndCause, Opened, Prepared,
    Reader, Record, RecordCorrupt, Registered, SequencesReserved, Session, SessionStarted,
    Staging, StreamCommitted, SubscriptionPartition, Target, TopicPartition, TxnId,
    TxnStream, Writer,
)
from services.errors import AtomlogError

# ---------------------------------------------------------------------------------------
# States and the transition table
# ---------------------------------------------------------------------------------------


class State(enum.Enum):
    """Values as TxnState in coordinator.proto."""

    __hash__ = object.__hash__  # members are singletons: no Python-level hash of the name

    OPEN = 1
    PREPARED = 2
    COMMITTING = 3
    ABORTING = 4
    COMMITTED = 5
    ABORTED = 6


# Every transition there is; anything else raises IllegalTransition and changes nothing.
# A transaction starts OPEN (record Opened). Registered and DeadlineReset change an OPEN
# transaction in place.
ALLOWED: dict[State, frozenset[State]] = {
    State.OPEN: frozenset({State.PREPARED, State.COMMITTING, State.ABORTING}),
    State.PREPARED: frozenset({State.COMMITTING, State.ABORTING}),
    State.COMMITTING: frozenset({State.COMMITTED}),
    State.ABORTING: frozenset({State.ABORTED}),
    State.COMMITTED: frozenset(),
    State.ABORTED: frozenset(),
}
INITIAL_STATE = State.OPEN
UNDECIDED = frozenset({State.OPEN, State.PREPARED})
DECIDING = frozenset({State.COMMITTING, State.ABORTING})
FINISHED = frozenset({State.COMMITTED, State.ABORTED})
DECIDING_STATE = {Decision.COMMIT: State.COMMITTING, Decision.ABORT: State.ABORTING}
FINISHED_STATE = {Decision.COMMIT: State.COMMITTED, Decision.ABORT: State.ABORTED}
DECISION_OF = {State.COMMITTING: Decision.COMMIT, State.COMMITTED: Decision.COMMIT,
               State.ABORTING: Decision.ABORT, State.ABORTED: Decision.ABORT}
# The record that makes each transition (for docs/coordinator.md and the table walk).
TRANSITION_RECORDS: dict[tuple[State, State], str] = {
    (State.OPEN, State.PREPARED): "Prepared",
    (State.OPEN, State.COMMITTING): "Decided(COMMIT)",
    (State.OPEN, State.ABORTING): "Decided(ABORT)",
    (State.PREPARED, State.COMMITTING): "Decided(COMMIT)",
    (State.PREPARED, State.ABORTING): "Decided(ABORT)",
    (State.COMMITTING, State.COMMITTED): "Completed(COMMIT)",
    (State.ABORTING, State.ABORTED): "Completed(ABORT)",
}
assert set(TRANSITION_RECORDS) == {(a, b) for a, tos in ALLOWED.items() for b in tos}
_TIMEOUT_CAUSES = frozenset({EndCause.TIMEOUT, EndCause.PREPARED_TIMEOUT})


class ProtocolError(Exception):
    """The shell called the core out of order (a bug in the shell): nothing changed."""


class IllegalTransition(ProtocolError):
    """A record does not follow the transition table or the table's rules (a corrupt log
    or a bug): nothing changed; a load that meets one fails (fail closed)."""


class ProducerIdNeeded(Exception):
    """init_producer_id needs a fresh producer id: call again with fresh_producer_id."""


class SnapshotCorrupt(Exception):
    """A snapshot cannot be trusted; load by full replay instead."""


# ---------------------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------------------

LIMIT_PREFIX = "transaction."


@dataclass(frozen=True)
class Limits:
    """Bounds of one TC partition; the config name of each is `transaction.<field>`."""

    # Unfinished transactions (OPEN, PREPARED, COMMITTING, ABORTING, children included)
    # per TC partition; 16 TC partitions make 160,000 per cluster. Full: RESOURCE_EXHAUSTED.
    max_open: int = 10_000
    # Partitions plus subscription partitions per transaction (Kafka has no bound; the
    # decision's markers and the records stay small with one).
    max_partitions: int = 1_000
    # Children per parent: Spark task attempts of one job, speculative ones included.
    max_children: int = 5_000
    # Kafka: transaction.timeout.ms 60 s, transaction.max.timeout.ms 15 min.
    default_timeout_ms: int = 60_000
    max_timeout_ms: int = 900_000
    # PREPARED waits for a driver's decision: longer than the OPEN timeout by default.
    default_prepared_timeout_ms: int = 900_000
    max_prepared_timeout_ms: int = 3_600_000
    # Finished transactions remembered (re-commit answers, idempotency keys); the load
    # benchmark (100,000 finished in well under 2 s) covers the default. One is forgotten
    # only past both: among the last max_finished no more, and its caller's retries
    # over (`finished_grace_ms` past its deadline). Those held past max_finished are
    # bounded by max_finished_held: at it, new transactions are refused (fail closed).
    max_finished: int = 100_000
    finished_grace_ms: int = 60_000
    max_finished_held: int = 400_000
    # Transactional-id sessions, and their idle expiry (Kafka's
    # transactional.id.expiration.ms: 7 days).
    max_sessions: int = 10_000
    session_expiry_ms: int = 604_800_000
    # Streams (TxnStream: a Spark streaming query) whose committed high-water ordinal is
    # kept, and how long past a stream's last commit (as sessions: 7 days). Full of
    # live ones: a commit that would add one is refused with RESOURCE_EXHAUSTED.
    max_streams: int = 10_000
    stream_expiry_ms: int = 604_800_000
    # Unconfirmed markers are re-sent this often (each retry is counted in describe()).
    marker_retry_ms: int = 1_000
    # Work per tick: timeout decisions logged (one batch) and markers (re-)sent.
    max_decisions_per_tick: int = 1_000
    max_markers_per_tick: int = 10_000
    # ListTransactions: default and maximum number of transactions answered.
    default_list_limit: int = 1_000
    max_list_limit: int = 10_000

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{LIMIT_PREFIX}{item.name}={value!r} must be a positive "
                                 "integer")
        if self.max_partitions > 0xFFFF:
            raise ValueError("transaction.max_partitions must fit a record (at most 65535)")
        for default, maximum in (("default_timeout_ms", "max_timeout_ms"),
                                 ("default_prepared_timeout_ms", "max_prepared_timeout_ms"),
                                 ("default_list_limit", "max_list_limit"),
                                 ("max_finished", "max_finished_held")):
            if getattr(self, default) > getattr(self, maximum):
                raise ValueError(f"{LIMIT_PREFIX}{default} exceeds {LIMIT_PREFIX}{maximum}")
        if max(self.max_timeout_ms, self.max_prepared_timeout_ms) > TIMEOUT_MS_MAX:
            raise ValueError("timeouts are uint32 milliseconds")


# ---------------------------------------------------------------------------------------
# Effects and answers (value objects)
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Append:
    """Records to append to `__txn_log-<k>` as ONE batch; then append_done(append_id)."""

    append_id: int
    records: tuple[Record, ...]


class Marker(NamedTuple):
    """EndTxnOnPartition for one target of one transaction. A NamedTuple, as the ids and
    targets are: the marker channel hashes and compares each one it queues (sets of
    markers on their way), and a tuple's hash and == are C code where a dataclass's
    were Python calls."""

    txn_id: TxnId
    decision: Decision
    coordinator_epoch: int
    target: Target


@dataclass(frozen=True, slots=True)
class Ready:
    """What the shell does after an input, in this order: appends, reply, markers."""

    appends: tuple[Append, ...] = ()
    reply: object = None
    markers: tuple[Marker, ...] = ()
    completed: tuple[TxnId, ...] = ()
    # The reply holds before the appends are durable: a parallel commit's COMMIT, whose
    # commit point (its Staging record and every stage durable) has passed already.
    early_reply: bool = False


NO_WORK = Ready()
ItemResult = AtomlogError | None  # None: the item succeeded
# One-call transactions reserve sequences in blocks of this many (one SequencesReserved
# record per block): a coordinator that loads the TC partition starts above the block.
SEQUENCE_RESERVATION = 10_000
# A one-call transaction still staging this long past its deadline is forgotten by tick
# (the shell normally ends it well before): presumed aborted.
ONE_CALL_GRACE_MS = 5_000
# `tick` frees expired sessions' memory at most this often: every session is looked at,
# and a TC partition ticks 10 times a second (10,000 sessions: 2 ms a tick). Decisions
# treat an expired session as absent whenever it is freed, and a full table frees at once.
SESSION_SWEEP_INTERVAL_MS = 1_000


@dataclass(frozen=True, slots=True)
class OneCallStart:
    """begin_one_call's reply: the transaction to stage, or (existing) the state of the
    committed transaction an earlier call with the same idempotency key made."""

    txn_id: TxnId
    timeout_ms: int
    existing: State | None = None
    parallel: bool = False  # a parallel commit: stage while its Staging record is appended


@dataclass(frozen=True, slots=True)
class OneCallAborted:
    """end_one_call's reply when the transaction will not commit: the reason to answer
    with (the Ready carries ABORT markers for whatever may have been staged)."""

    error: AtomlogError


@dataclass(frozen=True, slots=True)
class NewTxnResult:
    txn_id: TxnId
    state: State
    existing: bool
    timeout_ms: int
    topic_partition_results: tuple[ItemResult, ...] = ()
    subscription_partition_results: tuple[ItemResult, ...] = ()


@dataclass(frozen=True, slots=True)
class RegisterResult:
    topic_partition_results: tuple[ItemResult, ...] = ()
    subscription_partition_results: tuple[ItemResult, ...] = ()


@dataclass(frozen=True, slots=True)
class PrepareResult:
    state: State
    prepared_timeout_ms: int


@dataclass(frozen=True, slots=True)
class EndTxnResult:
    state: State
    already_ended: bool
    kept_child_txn_ids: tuple[TxnId, ...] = ()
    aborted_child_txn_ids: tuple[TxnId, ...] = ()


@dataclass(frozen=True, slots=True)
class AbortResult:
    state: State
    already_ended: bool
    aborted_child_txn_ids: tuple[TxnId, ...] = ()


@dataclass(frozen=True, slots=True)
class InitProducerIdResult:
    producer_id: int
    producer_epoch: int
    aborted_txn_id: TxnId | None
    transaction_timeout_ms: int
    fresh_producer_id_used: bool


@dataclass(frozen=True, slots=True)
class TxnStatus:
    state: State
    end_cause: EndCause
    parent: TxnId | None
    remaining_ms: int


@dataclass(frozen=True, slots=True)
class Verification:
    state: State
    included: bool
    session: Session | None
    coordinator_epoch: int


@dataclass(frozen=True, slots=True)
class TxnSummary:
    txn_id: TxnId
    state: State
    end_cause: EndCause
    parent: TxnId | None
    session: Session | None
    start_ms: int
    age_ms: int
    timeout_ms: int
    topic_partition_count: int
    subscription_partition_count: int
    child_count: int


@dataclass(frozen=True, slots=True)
class TxnDescription:
    summary: TxnSummary
    topic_partitions: tuple[TopicPartition, ...]
    subscription_partitions: tuple[SubscriptionPartition, ...]
    children: tuple[TxnSummary, ...]
    marker_pending_topic_partitions: tuple[TopicPartition, ...]
    marker_pending_subscription_partitions: tuple[SubscriptionPartition, ...]
    marker_retry_count: int
    deadline_ms: int
    prepared_timeout_ms: int
    prepared_ms: int
    decided_ms: int
    completed_ms: int
    idempotency_key: str
    kept_child_txn_ids: tuple[TxnId, ...]
    aborted_child_txn_ids: tuple[TxnId, ...]
    coordinator_epoch: int


@dataclass(frozen=True, slots=True)
class TxnList:
    transactions: tuple[TxnSummary, ...]
    truncated: bool


@dataclass(frozen=True, slots=True)
class SessionInfo:
    session: Session
    timeout_ms: int
    last_active_ms: int
    current_txn: TxnId | None


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """A stream's committed high-water: its highest ordinal committed, by which
    transaction, when."""

    ordinal: int
    txn_id: TxnId
    committed_ms: int


@dataclass(frozen=True, slots=True)
class CoreMetrics:
    """Gauges and counters (the shell exports counters as `*_total`)."""

    unfinished_transactions: int
    finished_transactions: int
    sessions: int
    streams: int
    pending_appends: int
    unconfirmed_markers: int
    decisions_total: int
    timeouts_total: int
    marker_resends_total: int
    exhausted_total: int
    fenced_total: int
    concurrent_total: int
    duplicate_confirmations_total: int
    evicted_total: int
    held_total: int


# ---------------------------------------------------------------------------------------
# Table entries (mutable, owned by the core)
# ---------------------------------------------------------------------------------------

@dataclass(slots=True, eq=False)
class Txn:
    txn_id: TxnId
    state: State
    created_ms: int
    timeout_ms: int
    deadline_ms: int
    parent: TxnId | None = None
    session: Session | None = None
    idempotency_key: str = ""
    # Ordered sets; emptied when the transaction finishes (the counts stay).
    topic_partitions: dict[TopicPartition, None] = field(default_factory=dict)
    subscription_partitions: dict[SubscriptionPartition, None] = field(default_factory=dict)
    topic_partition_count: int = 0
    subscription_partition_count: int = 0
    children: list[TxnId] = field(default_factory=list)
    end_cause: EndCause = EndCause.UNSPECIFIED
    prepared_ms: int = 0
    prepared_timeout_ms: int = 0
    decided_ms: int = 0
    completed_ms: int = 0
    kept_children: tuple[TxnId, ...] = ()
    aborted_children: tuple[TxnId, ...] = ()
    # Volatile: not logged, not in snapshots (a load re-sends every marker).
    unconfirmed: dict[Target, None] = field(default_factory=dict)
    markers_sent_ms: int = -1
    marker_retry_count: int = 0
    # A one-call transaction (decided in the append that opened it): nothing writes to
    # it after its decision, so its markers may wait to share a write with the next
    # staged data (coordinator/markers.py). Not compared: a replay does not know it.
    one_call: bool = field(default=False, compare=False, repr=False)
    # Parallel commits (docs/coordinator.md): logged by a Staging record, undecided. Only
    # its CommitTxn (handled), a resolution (ResolveStaged) or, once its commit was
    # answered (promised), tick's re-proposal decides it: never a timeout.
    staging: bool = False
    handled: bool = field(default=False, compare=False, repr=False)
    promised: bool = field(default=False, compare=False, repr=False)
    resolving: bool = field(default=False, compare=False, repr=False)
    fenced: bool = field(default=False, compare=False, repr=False)

    @property
    def prepared_deadline_ms(self) -> int:
        return self.prepared_ms + self.prepared_timeout_ms

    @property
    def target_count(self) -> int:
        return len(self.topic_partitions) + len(self.subscription_partitions)

    def targets(self) -> list[Target]:
        return [*self.topic_partitions, *self.subscription_partitions]

    def timed_out(self, now_ms: int) -> bool:
        """Undecided and past its deadline (the next tick aborts it). A staging one is
        decided by its resolution instead: it may have committed already."""
        if self.staging:
            return False
        if self.state is State.OPEN:
            return now_ms >= self.deadline_ms
        return self.state is State.PREPARED and now_ms >= self.prepared_deadline_ms


@dataclass(slots=True, eq=False)
class OneCall:
    """A one-call transaction between begin_one_call and end_one_call: volatile (nothing
    of it is logged before its decision: presumed abort)."""

    txn_id: TxnId
    created_ms: int
    timeout_ms: int
    session: Session | None
    idempotency_key: str
    topic_partitions: tuple[TopicPartition, ...]
    subscription_partitions: tuple[SubscriptionPartition, ...]
    fenced: bool = False  # InitProducerId started a newer session meanwhile

    @property
    def deadline_ms(self) -> int:
        return self.created_ms + self.timeout_ms

    def includes(self, target: Target) -> bool:
        return target in (self.topic_partitions if isinstance(target, TopicPartition)
                          else self.subscription_partitions)


@dataclass(slots=True, eq=False)
class SessionEntry:
    session: Session
    timeout_ms: int
    last_active_ms: int
    current_txn: TxnId | None = None
    # (producer id, epoch) of the session this one replaced, when its holder asked for
    # the bump (SessionStarted.bumped_from): that InitProducerId again is its retry.
    bumped_from: tuple[int, int] | None = None


@dataclass(slots=True)
class _Pending:
    append_id: int
    records: tuple[Record, ...]
    locks: frozenset
    shared: TxnId | None  # a parent held shared while its child's Opened is in flight
    new_txns: int
    new_sessions: int
    new_streams: int = 0


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------

def _error(reason: str, message: str, **metadata: object) -> AtomlogError:
    return AtomlogError(reason, message, {k: str(v) for k, v in metadata.items()})


def _limit_error(limit: str, value: int, message: str, **metadata: object) -> AtomlogError:
    return _error("RESOURCE_EXHAUSTED", f"{message} (limit {LIMIT_PREFIX}{limit}={value})",
                  limit=LIMIT_PREFIX + limit, **{limit: value}, **metadata)


def _one_call_gone(txn_id: TxnId) -> AtomlogError:
    return _error("TRANSACTION_ABORTED", f"one-call transaction {txn_id} was aborted "
                  "(it outlived its timeout, or the coordinator moved)", txn_id=txn_id)


def _ended_error(txn: Txn, wanted: str) -> AtomlogError:
    """The error for `wanted` (e.g. "commit") on a transaction that is not undecided."""
    facts = {"txn_id": txn.txn_id, "state": txn.state.name, "end_cause": txn.end_cause.name}
    if txn.state in (State.ABORTING, State.ABORTED):
        if txn.end_cause in _TIMEOUT_CAUSES:
            return _error("TRANSACTION_TIMED_OUT",
                          f"cannot {wanted} transaction {txn.txn_id}: it passed its "
                          f"{'prepared ' if txn.end_cause is EndCause.PREPARED_TIMEOUT else ''}"
                          f"timeout and was aborted", **facts)
        return _error("TRANSACTION_ABORTED",
                      f"cannot {wanted} transaction {txn.txn_id}: it was aborted "
                      f"({txn.end_cause.name.lower()})", **facts)
    return _error("TRANSACTION_ALREADY_COMMITTED",
                  f"cannot {wanted} transaction {txn.txn_id}: it is {txn.state.name}", **facts)


def _timed_out_error(txn: Txn, wanted: str) -> AtomlogError:
    which = "OPEN timeout" if txn.state is State.OPEN else "prepared timeout"
    return _error("TRANSACTION_TIMED_OUT",
                  f"cannot {wanted} transaction {txn.txn_id}: it passed its {which} and is "
                  "being aborted", txn_id=txn.txn_id, state=txn.state.name)


def _staging_error(txn: Txn) -> AtomlogError:
    return _error("CONCURRENT_TRANSACTIONS", f"transaction {txn.txn_id} is being committed "
                  "(a parallel commit, decided by its CommitTxn or its resolution); retry "
                  "shortly", txn_id=txn.txn_id, retry_after_ms=10)


def _not_open_error(txn: Txn, now_ms: int, wanted: str) -> AtomlogError | None:
    """None when the transaction is OPEN and not timed out; else the error for `wanted`."""
    if txn.staging:
        return _staging_error(txn)
    if txn.state is State.OPEN and not txn.timed_out(now_ms):
        return None
    if txn.timed_out(now_ms):
        return _timed_out_error(txn, wanted)
    if txn.state in (State.ABORTING, State.ABORTED):
        return _ended_error(txn, wanted)
    return _error("TRANSACTION_NOT_OPEN",
                  f"cannot {wanted} transaction {txn.txn_id}: it is {txn.state.name}, not OPEN",
                  txn_id=txn.txn_id, state=txn.state.name)


def _validate_timeout(timeout_ms: int, default_ms: int, maximum_ms: int, limit: str,
                      what: str) -> int:
    if timeout_ms == 0:
        return default_ms
    if type(timeout_ms) is not int or not 0 < timeout_ms <= maximum_ms:
        raise _error("INVALID_TRANSACTION_TIMEOUT",
                     f"{what} {timeout_ms} ms is outside 1..{maximum_ms} ms "
                     f"({LIMIT_PREFIX}{limit}; 0 means the default)",
                     timeout_ms=timeout_ms, limit=LIMIT_PREFIX + limit)
    return timeout_ms


def _validate_name(field_name: str, value: str, max_bytes: int, *, empty_ok: bool) -> None:
    size = len(value.encode("utf-8"))
    if size > max_bytes or (size == 0 and not empty_ok):
        raise _error("INVALID_ARGUMENT",
                     f"{field_name} must have {0 if empty_ok else 1}..{max_bytes} bytes of "
                     f"UTF-8, has {size}", field=field_name)


def next_producer_epoch(producer_id: int, producer_epoch: int) -> tuple[int, int] | None:
    """The bumped (producer id, epoch) of an idempotent producer, or None when the epoch
    would reach 65535: then the shell issues a fresh producer id with epoch 0."""
    if producer_epoch >= PRODUCER_EPOCH_LAST_ISSUED:
        return None
    return producer_id, producer_epoch + 1


# ---------------------------------------------------------------------------------------
# The core
# ---------------------------------------------------------------------------------------

class TcPartitionCore:
    """The transactions and sessions of one TC partition. Single-threaded."""

    def __init__(self, tc_partition: int, limits: Limits | None = None,
                 coordinator_epoch: int = 0) -> None:
        assert 0 <= tc_partition <= 0xFFFFFFFF, tc_partition
        assert 0 <= coordinator_epoch < 1 << 64, coordinator_epoch
        self.tc_partition = tc_partition
        self.limits = limits or Limits()
        self.coordinator_epoch = coordinator_epoch
        # Durable state (what the log says).
        self._unfinished: dict[TxnId, Txn] = {}  # in order of creation
        # Finished transactions never change: kept as their snapshot entry, decoded on
        # access (`_lookup`), in order of completion (the order they are forgotten in).
        # Keyed by sequence (the TC partition is this one's), as _keys' rows name theirs: a
        # dict of ints, strings and bytes holds nothing the garbage collector tracks, so it
        # is never scanned. With TxnId keys (tuples it tracks) a full collection scanned
        # every entry: 300 ms at max_finished in 16 TC partitions, the event loop held.
        self._finished: dict[int, bytes] = {}
        self._sessions: dict[str, SessionEntry] = {}
        self._streams: dict[str, StreamEntry] = {}  # logically absent once expired
        # Idempotency key -> its snapshot row (the key and its transaction's sequence,
        # _key_row; _key_sequence reads the sequence back): a snapshot joins the rows
        # instead of packing up to max_finished keys on the coordinator's event loop
        # (100,000 took 63 ms).
        self._keys: dict[str, bytes] = {}
        self._last_sequence = 0
        self._reserved = 0  # highest sequence one-call transactions may use (logged)
        # Volatile state.
        self._next_sequence = 1
        self._one_calls: dict[TxnId, OneCall] = {}  # being staged, by id and by key
        # The one being staged in a session (at most one), by transactional id: a session
        # does not expire while it stages (its decision logs an Opened of that session).
        self._one_call_sessions: dict[str, TxnId] = {}
        self._one_call_keys: dict[str, TxnId] = {}
        self._next_append_id = 1
        self._sessions_swept_ms: int | None = None  # tick's last sweep of expired sessions
        self._pending: deque[_Pending] = deque()
        # Pending transitions hold locks: exclusive on a TxnId | ("session", id) |
        # ("key", key); shared on a parent while children are being opened under it (so
        # children open concurrently, but the parent cannot change state meanwhile).
        self._locks: dict[object, int] = {}
        self._shared: dict[TxnId, int] = {}
        self._pending_new_txns = 0
        self._pending_new_sessions = 0
        self._pending_new_streams = 0
        self._counters = dict.fromkeys(
            ("decisions_total", "timeouts_total", "marker_resends_total", "exhausted_total",
             "fenced_total", "concurrent_total", "duplicate_confirmations_total",
             "evicted_total", "held_total"), 0)

    # =================================================================== client inputs

    def new_txn(self, now_ms: int, timeout_ms: int = 0, parent: TxnId | None = None,
                session: Session | None = None, idempotency_key: str = "",
                topic_partitions: Sequence[TopicPartition] = (),
                subscription_partitions: Sequence[SubscriptionPartition] = (),
                stream: TxnStream | None = None) -> Ready:
        """NewTxn. Reply: NewTxnResult (after the append, when there is one). With a
        `stream`: refused (STREAM_ORDINAL_COMMITTED) when the stream committed that
        ordinal or a later one, unless the key finds its transaction."""
        _validate_name("idempotency_key", idempotency_key, MAX_IDEMPOTENCY_KEY_BYTES,
                       empty_ok=True)
        if parent is not None and session is not None:
            raise _error("INVALID_ARGUMENT", "a child transaction has no session of its own; "
                         "its parent's decision ends it", field="session")
        if stream is not None:
            self._check_stream_alone(parent, session)
        records: list[Record] = []
        locks: set[object] = set()
        if idempotency_key:
            self._check_unlocked([("key", idempotency_key)])
            existing = self._lookup_key(idempotency_key)
            if existing is not None and existing.timed_out(now_ms):
                # Replaced like an aborted one; its timeout abort goes in the same batch.
                record, decision_locks = self._decision(existing, Decision.ABORT,
                                                        self._timeout_cause(existing), now_ms)
                records.append(record)
                locks |= decision_locks
            elif existing is not None and existing.state not in (State.ABORTING,
                                                                 State.ABORTED):
                self._check_same_request(existing, parent, session)
                return self._existing(now_ms, existing, session, topic_partitions,
                                      subscription_partitions)
            locks.add(("key", idempotency_key))
        if stream is not None:
            self._check_stream_ahead(stream, now_ms)
        timeout_ms = self._resolve_timeout(timeout_ms, session, now_ms)
        if parent is not None:
            self._check_parent(parent, now_ms)
        if session is not None:
            locks |= self._check_session_free(session, now_ms)
        self._check_room(now_ms)
        new_tps, new_subs, tp_results, sub_results = self._admit_targets(
            None, topic_partitions, subscription_partitions)
        self._check_unlocked(locks)
        txn_id = self._next_txn_id()
        records.append(Opened(txn_id, now_ms, timeout_ms, now_ms + timeout_ms, parent, session,
                              idempotency_key, new_tps, new_subs))
        locks.add(txn_id)
        reply = NewTxnResult(txn_id, State.OPEN, False, timeout_ms, tp_results, sub_results)
        return self._propose(records, locks, reply, shared=parent, new_txns=1)

    def add_partitions(self, now_ms: int, txn_id: TxnId,
                       topic_partitions: Sequence[TopicPartition],
                       session: Session | None = None) -> Ready:
        """AddPartitionToTxn. Reply: RegisterResult (one result per partition)."""
        return self._register(now_ms, txn_id, topic_partitions, (), session)

    def add_subscriptions(self, now_ms: int, txn_id: TxnId,
                          subscription_partitions: Sequence[SubscriptionPartition],
                          session: Session | None = None) -> Ready:
        """AddSubscriptionToTxn. Reply: RegisterResult (one per subscription partition)."""
        return self._register(now_ms, txn_id, (), subscription_partitions, session)

    def prepare(self, now_ms: int, txn_id: TxnId, prepared_timeout_ms: int = 0,
                session: Session | None = None) -> Ready:
        """PrepareTxn: OPEN -> PREPARED. Idempotent. Reply: PrepareResult."""
        txn = self._get(txn_id)
        self._check_session(txn, session, now_ms)
        if txn.state is State.PREPARED and not self._expired(txn, now_ms):
            return Ready(reply=PrepareResult(State.PREPARED, txn.prepared_timeout_ms))
        if txn.state in (State.COMMITTING, State.COMMITTED):
            raise _ended_error(txn, "prepare")
        error = _not_open_error(txn, now_ms, "prepare")
        if error is not None:
            raise error
        prepared_timeout_ms = _validate_timeout(
            prepared_timeout_ms, self.limits.default_prepared_timeout_ms,
            self.limits.max_prepared_timeout_ms, "max_prepared_timeout_ms", "prepared timeout")
        self._check_unlocked([txn_id])
        return self._propose([Prepared(txn_id, now_ms, prepared_timeout_ms)], {txn_id},
                             PrepareResult(State.PREPARED, prepared_timeout_ms))

    def end_txn(self, now_ms: int, txn_id: TxnId, decision: Decision,
                children_to_keep: Sequence[TxnId] = (),
                session: Session | None = None, stream: TxnStream | None = None) -> Ready:
        """EndTxn(COMMIT|ABORT). Reply: EndTxnResult once the decision is durable. A
        COMMIT with a `stream` logs the stream's new high-water with the decision, and is
        refused (STREAM_ORDINAL_COMMITTED, nothing changed) when the stream committed that
        ordinal or a later one already; an ABORT ignores it."""
        txn = self._get(txn_id)
        if txn.staging:
            raise _staging_error(txn)
        if txn.parent is not None and decision is Decision.COMMIT:
            raise _error("TRANSACTION_IS_CHILD",
                         f"transaction {txn_id} is a child of {txn.parent}: its parent's "
                         "EndTxn commits it (only ABORT is accepted on a child)",
                         txn_id=txn_id, parent_txn_id=txn.parent)
        self._check_session(txn, session, now_ms)
        if txn.state in DECIDING or txn.state in FINISHED:
            if DECISION_OF[txn.state] is not decision:
                raise _ended_error(txn, decision.name.lower())
            return Ready(reply=EndTxnResult(txn.state, True, txn.kept_children,
                                            txn.aborted_children))
        if decision is Decision.COMMIT and txn.timed_out(now_ms):
            raise _timed_out_error(txn, "commit")
        if txn.parent is not None and txn.state is State.PREPARED:
            raise _error("TRANSACTION_PREPARED",
                         f"child transaction {txn_id} is PREPARED: only its parent's decision "
                         "(or an operator abort with allow_prepared) ends it",
                         txn_id=txn_id, parent_txn_id=txn.parent)
        keep = self._check_children_to_keep(txn, decision, children_to_keep, now_ms)
        new_streams = 0
        if stream is not None and decision is Decision.COMMIT:
            self._check_stream_alone(txn.parent, txn.session)
            self._check_stream_ahead(stream, now_ms)
            self._check_unlocked([("stream", stream.name)])
            if self._live_stream(stream.name, now_ms) is None:
                self._make_room_for_stream(now_ms)
                new_streams = 1
        record, locks = self._decision(txn, decision, EndCause.CLIENT, now_ms, keep)
        records: list[Record] = [record]
        if stream is not None and decision is Decision.COMMIT:
            records.append(StreamCommitted(stream.name, stream.ordinal, txn_id, now_ms))
            locks.add(("stream", stream.name))
        return self._propose(records, locks, EndTxnResult(
            DECIDING_STATE[decision], False, record.kept_children, record.aborted_children),
            new_streams=new_streams)

    def init_producer_id(self, now_ms: int, transactional_id: str,
                         transaction_timeout_ms: int = 0, producer_id: int = 0,
                         producer_epoch: int = 0,
                         fresh_producer_id: int | None = None) -> Ready:
        """InitProducerId with a transactional id: bump the session's epoch (rotating to a
        fresh producer id before the epoch would reach 65535), abort its undecided
        transaction, fence the old epoch. Raises ProducerIdNeeded (nothing changed) when a
        fresh producer id is needed and none was given. Reply: InitProducerIdResult."""
        _validate_name("transactional_id", transactional_id, MAX_TRANSACTIONAL_ID_BYTES,
                       empty_ok=False)
        timeout_ms = _validate_timeout(transaction_timeout_ms, self.limits.default_timeout_ms,
                                       self.limits.max_timeout_ms, "max_timeout_ms",
                                       "transaction timeout")
        session_lock = ("session", transactional_id)
        self._check_unlocked([session_lock])
        entry = self._live_session(transactional_id, now_ms)
        records: list[Record] = []
        locks: set[object] = {session_lock}
        aborted: TxnId | None = None
        bumped: tuple[int, int] | None = None
        given = (producer_id, producer_epoch)
        bumped_from: tuple[int, int] | None = None
        if entry is not None:
            current = entry.session
            if given != (0, 0) and given == entry.bumped_from:
                # The call that made this session, again: its answer was lost (KIP-360).
                # Only that holder asked for the bump (a new producer's InitProducerId
                # carries 0, 0 and records no bumped_from), so the answer is the same.
                return Ready(reply=InitProducerIdResult(
                    current.producer_id, current.producer_epoch, None, entry.timeout_ms,
                    fresh_producer_id_used=False))
            if given not in ((0, 0), (current.producer_id, current.producer_epoch)):
                self._counters["fenced_total"] += 1
                raise _error("PRODUCER_FENCED",
                             f"transactional id {transactional_id!r} is at producer id "
                             f"{current.producer_id} epoch {current.producer_epoch}; producer "
                             f"id {producer_id} epoch {producer_epoch} is not the current "
                             "session", producer_id=current.producer_id,
                             producer_epoch=current.producer_epoch)
            for one_call in self._one_calls.values():
                if one_call.session == current:
                    one_call.fenced = True  # end_one_call refuses it: presumed abort
            txn = self._unfinished.get(entry.current_txn)
            if txn is not None and txn.staging:
                # It may have committed already: wait for its decision (as Kafka waits
                # for a transaction that is completing).
                self._counters["concurrent_total"] += 1
                raise _staging_error(txn)
            if txn is not None and txn.state in UNDECIDED:
                record, decision_locks = self._decision(txn, Decision.ABORT,
                                                        EndCause.SESSION_FENCED, now_ms)
                records.append(record)
                locks |= decision_locks
                aborted = txn.txn_id
            bumped = next_producer_epoch(current.producer_id, current.producer_epoch)
            if given != (0, 0):
                bumped_from = given
        else:
            self._make_room_for_session(now_ms)
        fresh = bumped is None
        if fresh and fresh_producer_id is None:
            raise ProducerIdNeeded(f"transactional id {transactional_id!r} needs a fresh "
                                   "producer id")
        if fresh:
            assert 0 < fresh_producer_id < 1 << 63, fresh_producer_id
            bumped = (fresh_producer_id, 0)
        records.append(SessionStarted(transactional_id, *bumped, timeout_ms, now_ms,
                                      *(bumped_from or (0, 0))))
        reply = InitProducerIdResult(*bumped, aborted, timeout_ms, fresh_producer_id_used=fresh)
        return self._propose(records, locks, reply, new_sessions=int(entry is None))

    # ============================================================ one-call transactions

    def begin_one_call(self, now_ms: int, timeout_ms: int, session: Session | None,
                       idempotency_key: str, topic_partitions: Sequence[TopicPartition],
                       subscription_partitions: Sequence[SubscriptionPartition],
                       parallel: bool = False) -> Ready:
        """CommitTxn, step one: a transaction id for a one-call transaction, which the
        shell then stages on the partition servers. Nothing is logged but, once per
        SEQUENCE_RESERVATION transactions, a SequencesReserved record (the reply waits for
        it). While staging, the transaction answers verify() as OPEN, counts against
        max_open and holds its session and key. A committed transaction with the same key
        answers `existing` instead. Reply: OneCallStart.

        `parallel` (a parallel commit): a Staging record is
        proposed too, and the shell stages while it is appended instead of waiting for
        it: the reply (OneCallStart.parallel) is good at once (Ready.early_reply); the
        transaction is committed when that append and every stage are durable
        (end_one_call). Not when a reservation is due: nothing may be staged before the
        sequence is covered by a durable one (else a refused append would leave staged
        data under a sequence a new owner may hand out again), so that transaction takes
        the two rounds."""
        _validate_name("idempotency_key", idempotency_key, MAX_IDEMPOTENCY_KEY_BYTES,
                       empty_ok=False)
        self._check_unlocked([("key", idempotency_key)])
        existing = self._lookup_key(idempotency_key)
        if existing is not None and existing.state in (State.COMMITTING, State.COMMITTED):
            self._check_same_request(existing, None, session)
            return Ready(reply=OneCallStart(existing.txn_id, existing.timeout_ms,
                                            existing.state))
        if existing is not None and existing.state in (State.ABORTING, State.ABORTED):
            # abort_one_call's tombstone: a late or retried call must not commit it.
            raise _ended_error(existing, "commit")
        if existing is not None and existing.promised:  # answered "committed" already
            self._check_same_request(existing, None, session)
            return Ready(reply=OneCallStart(existing.txn_id, existing.timeout_ms,
                                            State.COMMITTING))
        if existing is not None and existing.staging:
            raise _staging_error(existing)  # a retry while it is committed or resolved
        if existing is not None:
            raise _error("INVALID_ARGUMENT", f"idempotency key {idempotency_key!r} names "
                         f"transaction {existing.txn_id}, which is {existing.state.name}: "
                         "a one-call transaction needs a key of its own",
                         field="idempotency_key", txn_id=existing.txn_id)
        self._check_key_not_staging(idempotency_key)
        timeout_ms = self._resolve_timeout(timeout_ms, session, now_ms)
        if session is not None:
            self._check_unlocked(self._check_session_free(session, now_ms))
        self._check_room(now_ms)
        tps = tuple(dict.fromkeys(topic_partitions))
        subs = tuple(dict.fromkeys(subscription_partitions))
        if not tps and not subs:
            raise _error("INVALID_ARGUMENT", "a one-call transaction needs at least one "
                         "partition or subscription partition")
        if len(tps) + len(subs) > self.limits.max_partitions:
            self._counters["exhausted_total"] += 1
            raise _limit_error("max_partitions", self.limits.max_partitions,
                               f"the transaction has {len(tps) + len(subs)} partitions and "
                               "subscription partitions")
        txn_id = self._next_txn_id()
        one_call = OneCall(txn_id, now_ms, timeout_ms, session, idempotency_key, tps, subs)
        self._one_calls[txn_id] = one_call
        self._one_call_keys[idempotency_key] = txn_id
        if session is not None:
            self._one_call_sessions[session.transactional_id] = txn_id
        reply = OneCallStart(txn_id, timeout_ms)
        if txn_id.sequence > self._reserved:
            # Logged before anything is staged; the reply waits for it (and every earlier
            # append, so for any reservation still in flight).
            return self._propose([SequencesReserved(txn_id.sequence + SEQUENCE_RESERVATION
                                                    - 1)], set(), reply)
        if not parallel:
            return Ready(reply=reply)
        record = Staging(txn_id, now_ms, timeout_ms, one_call.deadline_ms, None, session,
                         idempotency_key, tps, subs)
        # (The session's lock was checked free above; the id is new.)
        locks = {txn_id} | ({("session", session.transactional_id)} if session else set())
        proposed = self._propose([record], locks, OneCallStart(txn_id, timeout_ms,
                                                               parallel=True))
        return Ready(appends=proposed.appends, reply=proposed.reply, early_reply=True)

    def end_one_call(self, now_ms: int, txn_id: TxnId,
                     failure: AtomlogError | None = None) -> Ready:
        """CommitTxn, step two, once staging ended; `failure` None means every part is
        durable on its partition server. Then, unless the session was fenced or the
        timeout passed meanwhile, the decision is logged — Opened (with the partitions)
        and Decided(COMMIT) in one append — and markers follow as for EndTxn; reply:
        EndTxnResult. Else the transaction is forgotten (presumed abort: nothing of it
        was logged), ABORT markers go to whatever may have been staged, and the reply is
        OneCallAborted with the reason."""
        one_call = self._one_calls.get(txn_id)
        if one_call is None:
            return self._end_staging(now_ms, txn_id, failure)
        failure = failure or self._one_call_refusal(one_call, now_ms)
        if failure is not None:
            return Ready(reply=OneCallAborted(failure), markers=self._forget_one_call(one_call))
        locks = self._one_call_locks(one_call)
        self._check_unlocked(locks)
        return self._propose(self._one_call_records(one_call, now_ms), locks,
                             EndTxnResult(State.COMMITTING, False), new_txns=1)

    def _end_staging(self, now_ms: int, txn_id: TxnId, failure: AtomlogError | None) -> Ready:
        """end_one_call of a parallel commit, its Staging record durable. Committed:
        Decided(COMMIT) is proposed and the reply (EndTxnResult) holds at once
        (early_reply): the commit point has passed, and if that append fails tick proposes
        it again. Not: Decided(ABORT) is logged (the record exists, so the abort is not
        presumed) and the reply is OneCallAborted once it is durable."""
        txn = self._unfinished.get(txn_id)
        if txn is None or not txn.staging:
            found = self._lookup(txn_id)
            if found is None:
                raise _one_call_gone(txn_id)
            if found.state in (State.COMMITTING, State.COMMITTED):
                return Ready(reply=EndTxnResult(found.state, True))
            return Ready(reply=OneCallAborted(_ended_error(found, "commit")))
        txn.handled = False  # whatever follows, its CommitTxn is done with it
        if txn_id in self._locks:  # cannot be: a staging transaction is decided here only
            raise _staging_error(txn)
        failure = failure or self._one_call_refusal(txn, now_ms)
        if failure is not None:
            cause = {"PRODUCER_FENCED": EndCause.SESSION_FENCED,
                     "TRANSACTION_TIMED_OUT": EndCause.TIMEOUT}.get(failure.reason,
                                                                    EndCause.CLIENT)
            return self._propose([Decided(txn_id, Decision.ABORT, cause, now_ms, (), ())],
                                 {txn_id}, OneCallAborted(failure))
        txn.promised = True
        proposed = self._propose([Decided(txn_id, Decision.COMMIT, EndCause.CLIENT, now_ms,
                                          (), ())], {txn_id},
                                 EndTxnResult(State.COMMITTING, False))
        return Ready(appends=proposed.appends, reply=proposed.reply, early_reply=True)

    def release_staging(self, txn_id: TxnId) -> None:
        """The CommitTxn of a parallel commit ended without end_one_call (it failed): the
        transaction is left to a resolution (staged_to_resolve)."""
        txn = self._unfinished.get(txn_id)
        if txn is not None and txn.staging:
            txn.handled = False

    def staged_to_resolve(self) -> list[tuple[TxnId, tuple[TopicPartition
                                                           | SubscriptionPartition, ...]]]:
        """Staging transactions that nobody decides: found by a load, or left by a
        CommitTxn that failed. Each is returned once (marked resolving) with its
        partitions and then its subscription partitions, to ask them (ResolveStaged) and
        then call resolve_staged."""
        found = []
        for txn in self._unfinished.values():
            if (txn.staging and not (txn.handled or txn.promised or txn.resolving)
                    and txn.txn_id not in self._locks):
                txn.resolving = True
                found.append((txn.txn_id, (*txn.topic_partitions,
                                           *txn.subscription_partitions)))
        return found

    def resolve_staged(self, now_ms: int, txn_id: TxnId, staged: bool | None) -> Ready:
        """The answer of a resolution: True, every partition holds the transaction's
        staged data durably (and is fenced against the older owners): COMMIT; False, one
        does not and never will: ABORT; None, no answer yet (it is returned by
        staged_to_resolve again)."""
        txn = self._unfinished.get(txn_id)
        if txn is None or not txn.staging or not txn.resolving:
            return NO_WORK
        txn.resolving = False
        if staged is None or txn_id in self._locks:
            return NO_WORK
        decision, cause = ((Decision.COMMIT, EndCause.CLIENT) if staged
                           else (Decision.ABORT, EndCause.TIMEOUT))
        return self._propose([Decided(txn_id, decision, cause, now_ms, (), ())], {txn_id},
                             None)

    def end_one_calls(self, now_ms: int,
                      items: Sequence[tuple[TxnId, AtomlogError | None]]) -> Ready:
        """CommitTxns, step two: end_one_call for each transaction of a chain (staged in
        order), in order, with every decision in ONE append, so they are durable together
        or not at all. The first that does not commit breaks the chain: each one after
        it is aborted too, with EARLIER_COMMIT_FAILED, so no retry of the earlier one can
        land after a later one that committed. Reply: a tuple with, per item,
        EndTxnResult (committing once the append is durable) or OneCallAborted."""
        replies: list = []
        markers: list[Marker] = []
        records: list[Record] = []
        locks: set[object] = set()
        broken: TxnId | None = None
        for txn_id, failure in items:
            one_call = self._one_calls.get(txn_id)
            if one_call is None:
                replies.append(OneCallAborted(_one_call_gone(txn_id)))
                broken = broken or txn_id
                continue
            if failure is None and broken is not None:
                failure = _error("EARLIER_COMMIT_FAILED", f"transaction {broken} before "
                                 f"{txn_id} in the chain did not commit", txn_id=txn_id)
            failure = failure or self._one_call_refusal(one_call, now_ms)
            own = self._one_call_locks(one_call)
            if failure is None:
                try:
                    self._check_unlocked(own)
                except AtomlogError as error:
                    failure = error
            if failure is not None:
                broken = broken or txn_id
                replies.append(OneCallAborted(failure))
                markers.extend(self._forget_one_call(one_call))
                continue
            locks |= own
            records.extend(self._one_call_records(one_call, now_ms))
            replies.append(EndTxnResult(State.COMMITTING, False))
        if not records:
            return Ready(reply=tuple(replies), markers=tuple(markers))
        proposed = self._propose(records, locks, tuple(replies), new_txns=len(records) // 2)
        return Ready(appends=proposed.appends, reply=proposed.reply, markers=tuple(markers))

    def _one_call_refusal(self, one_call: OneCall | Txn,
                          now_ms: int) -> AtomlogError | None:
        """Why a staged one-call transaction may not commit now (fenced, timed out)."""
        txn_id = one_call.txn_id
        session = one_call.session
        if isinstance(one_call, OneCall) and session is not None and not one_call.fenced:
            entry = self._sessions.get(session.transactional_id)
            # Cannot happen (a session does not expire while it stages, and a newer one
            # fences it): its Opened record would be refused by every replay.
            one_call.fenced = entry is None or entry.session != session
        if one_call.fenced:
            self._counters["fenced_total"] += 1
            return _error("PRODUCER_FENCED", "transactional id "
                          f"{one_call.session.transactional_id!r} started a newer session "
                          f"while transaction {txn_id} was being staged", txn_id=txn_id)
        if now_ms >= one_call.deadline_ms:
            return _error("TRANSACTION_TIMED_OUT", f"one-call transaction {txn_id} was "
                          f"not staged within its timeout of {one_call.timeout_ms} ms",
                          txn_id=txn_id)
        return None

    @staticmethod
    def _one_call_locks(one_call: OneCall) -> set[object]:
        locks: set[object] = {one_call.txn_id, ("key", one_call.idempotency_key)}
        if one_call.session is not None:
            locks.add(("session", one_call.session.transactional_id))
        return locks

    @staticmethod
    def _one_call_records(one_call: OneCall, now_ms: int) -> list[Record]:
        """The decision of a one-call transaction: Opened and Decided(COMMIT)."""
        txn_id = one_call.txn_id
        return [Opened(txn_id, one_call.created_ms, one_call.timeout_ms,
                       one_call.deadline_ms, None, one_call.session,
                       one_call.idempotency_key, one_call.topic_partitions,
                       one_call.subscription_partitions),
                Decided(txn_id, Decision.COMMIT, EndCause.CLIENT, now_ms, (), ())]

    def abort_one_call(self, now_ms: int, idempotency_key: str) -> Ready:
        """CommitTxn with abort: make sure no one-call transaction with this key ever
        commits — for a client whose CommitTxn ended with an unknown outcome and that
        gives up. One that committed: TRANSACTION_ALREADY_COMMITTED. One being staged:
        CONCURRENT_TRANSACTIONS (retry; it ends soon). Else a tombstone is logged — an
        aborted transaction with no targets holding the key — so that a retried or late
        CommitTxn with the key is refused (TRANSACTION_ABORTED). Reply: the State."""
        _validate_name("idempotency_key", idempotency_key, MAX_IDEMPOTENCY_KEY_BYTES,
                       empty_ok=False)
        key_lock = ("key", idempotency_key)
        self._check_unlocked([key_lock])
        self._check_key_not_staging(idempotency_key)
        existing = self._lookup_key(idempotency_key)
        if existing is not None and existing.staging and not existing.promised:
            raise _staging_error(existing)
        if existing is not None and existing.promised:
            raise _error("TRANSACTION_ALREADY_COMMITTED", f"transaction {existing.txn_id} "
                         "with this idempotency key committed", txn_id=existing.txn_id)
        if existing is not None and existing.state in (State.ABORTING, State.ABORTED):
            return Ready(reply=existing.state)
        if existing is not None and existing.state in (State.COMMITTING, State.COMMITTED):
            raise _ended_error(existing, "abort")
        if existing is not None:
            raise _error("INVALID_ARGUMENT", f"idempotency key {idempotency_key!r} names "
                         f"transaction {existing.txn_id}, which is {existing.state.name}: "
                         "end it with EndTxn", field="idempotency_key",
                         txn_id=existing.txn_id)
        self._check_room(now_ms)
        txn_id = self._next_txn_id()
        timeout_ms = self.limits.default_timeout_ms
        records = [Opened(txn_id, now_ms, timeout_ms, now_ms + timeout_ms, None, None,
                          idempotency_key, (), ()),
                   Decided(txn_id, Decision.ABORT, EndCause.CLIENT, now_ms, (), ())]
        return self._propose(records, {txn_id, key_lock}, State.ABORTING, new_txns=1)

    def one_call(self, txn_id: TxnId) -> OneCall | None:
        """The one-call transaction being staged under this id (None: none)."""
        return self._one_calls.get(txn_id)

    def _forget_one_call(self, one_call: OneCall) -> tuple[Marker, ...]:
        """Drop a one-call transaction that will not commit: the ABORT markers for
        everything it may have staged (best effort: a partition server that misses one
        asks, and hears that the transaction is unknown, so aborted)."""
        self._drop_one_call(one_call)
        return tuple([Marker(one_call.txn_id, Decision.ABORT, self.coordinator_epoch, target)
                      for target in (*one_call.topic_partitions,
                                     *one_call.subscription_partitions)])

    def _drop_one_call(self, one_call: OneCall) -> None:
        """Forget a one-call transaction's entry, key and session (it was logged, or will
        not commit)."""
        del self._one_calls[one_call.txn_id]
        if self._one_call_keys.get(one_call.idempotency_key) == one_call.txn_id:
            del self._one_call_keys[one_call.idempotency_key]
        session = one_call.session
        if session is not None and \
                self._one_call_sessions.get(session.transactional_id) == one_call.txn_id:
            del self._one_call_sessions[session.transactional_id]

    # ================================================================= operator inputs

    def abort(self, now_ms: int, txn_id: TxnId, allow_prepared: bool = False) -> Ready:
        """AbortTransaction (operator): a logged decision, then markers. Reply: AbortResult."""
        txn = self._get(txn_id)
        if txn.staging:
            raise _staging_error(txn)
        if txn.state in (State.COMMITTING, State.COMMITTED):
            raise _ended_error(txn, "abort")
        if txn.state in (State.ABORTING, State.ABORTED):
            return Ready(reply=AbortResult(txn.state, True, txn.aborted_children))
        if txn.state is State.PREPARED and not allow_prepared:
            raise _error("TRANSACTION_PREPARED",
                         f"transaction {txn_id} is PREPARED; aborting it breaks its two-phase "
                         "promise: pass allow_prepared to do it anyway", txn_id=txn_id)
        record, locks = self._decision(txn, Decision.ABORT, EndCause.OPERATOR, now_ms)
        return self._propose([record], locks,
                             AbortResult(State.ABORTING, False, record.aborted_children))

    # =================================================================== shell inputs

    def append_done(self, append_id: int, now_ms: int) -> Ready:
        """The append is durable: complete its transitions. Returns markers to send and any
        follow-up append (completions)."""
        pending = self._pop_pending(append_id)
        decided: list[Txn] = []
        completed: list[TxnId] = []
        parents: list[TxnId] = []  # of completed children: their completion may be due
        try:
            for record in pending.records:
                if isinstance(record, Completed):
                    parents.append(self._unfinished[record.txn_id].parent)
                self.apply(record)
                if isinstance(record, Opened) and record.txn_id in self._one_calls:
                    one_call = self._one_calls[record.txn_id]
                    self._drop_one_call(one_call)  # logged: no ABORT markers
                    txn = self._unfinished[record.txn_id]
                    txn.one_call = True
                    txn.handled = isinstance(record, Staging)  # its CommitTxn ends it
                    txn.fenced = one_call.fenced
                if isinstance(record, Decided):
                    decided.append(self._unfinished[record.txn_id])
                    decided.extend(self._unfinished[child] for child in
                                   record.kept_children + record.aborted_children)
                elif isinstance(record, Completed):
                    completed.append(record.txn_id)
        finally:
            self._release(pending)
        markers = self._send_markers(decided, now_ms, resend=False)
        candidates = decided + [self._unfinished[p] for p in parents if p in self._unfinished]
        follow_up = self._completions(candidates, now_ms)
        return Ready(appends=follow_up, markers=markers, completed=tuple(completed))

    def append_failed(self, append_id: int) -> Ready:
        """The append is known not to be in the log: roll back its prepared transitions.
        (Timeouts and completions it carried are proposed again by tick.) One-call
        transactions whose sequence no durable or pending reservation covers any more
        are forgotten: their caller got the failure, and nothing of them was staged. So
        are those whose decision it carried (their caller got the failure): returned are
        the ABORT markers for what they staged."""
        pending = self._pop_pending(append_id)
        self._release(pending)
        markers: list[Marker] = []
        for record in pending.records:
            one_call = self._one_calls.get(record.txn_id) if type(record) is Opened else None
            if one_call is not None:
                # A one-call decision that is not in the log: nothing of the transaction
                # was logged, so it is aborted (presumed abort) now, not left staging,
                # holding its key, its session and its partitions' max read position
                # until its timeout.
                markers.extend(self._forget_one_call(one_call))
        if any(isinstance(r, SequencesReserved) for r in pending.records):
            covered = max([self._reserved] + [r.up_to for p in self._pending for r in p.records
                                              if isinstance(r, SequencesReserved)])
            for one_call in [c for c in self._one_calls.values()
                             if c.txn_id.sequence > covered]:
                self._forget_one_call(one_call)
        return Ready(markers=tuple(markers)) if markers else NO_WORK

    def marker_confirmed(self, now_ms: int, txn_id: TxnId, target: Target) -> Ready:
        """A target confirmed its marker. Duplicates and late confirmations are ignored."""
        return self.markers_confirmed(now_ms, ((txn_id, target),))

    def markers_confirmed(self, now_ms: int,
                          confirmed: Iterable[tuple[TxnId, Target]]) -> Ready:
        """Targets confirmed their markers ((txn_id, target) pairs, e.g. every marker one
        call or one write group carried): as `marker_confirmed` for each in turn, but the
        Completed records of every transaction they complete go in one Append."""
        unfinished = self._unfinished
        txns = []
        for txn_id, target in confirmed:
            txn = unfinished.get(txn_id)
            if txn is None or txn.state not in DECIDING or target not in txn.unconfirmed:
                self._counters["duplicate_confirmations_total"] += 1
                continue
            del txn.unconfirmed[target]
            txns.append(txn)
        if not txns:
            return NO_WORK
        return Ready(appends=self._completions(txns, now_ms))

    def tick(self, now_ms: int) -> Ready:
        """Timeouts (OPEN and PREPARED), due completions, marker re-sends, session expiry."""
        swept = self._sessions_swept_ms
        if swept is None or not 0 <= now_ms - swept < SESSION_SWEEP_INTERVAL_MS:
            self.forget_expired_sessions(now_ms)
            self.forget_expired_streams(now_ms)
            self._sessions_swept_ms = now_ms
        abandoned: list[Marker] = []
        for one_call in list(self._one_calls.values()):
            if (now_ms >= one_call.deadline_ms + ONE_CALL_GRACE_MS
                    and one_call.txn_id not in self._locks):
                abandoned.extend(self._forget_one_call(one_call))
                self._counters["timeouts_total"] += 1
        records: list[Record] = []
        locks: set[object] = set()
        for txn in list(self._unfinished.values()):
            if len(records) >= self.limits.max_decisions_per_tick:
                break
            if txn.staging and txn.promised and txn.txn_id not in self._locks:
                # Its commit was answered and its Decided append failed: again.
                records.append(Decided(txn.txn_id, Decision.COMMIT, EndCause.CLIENT, now_ms,
                                       (), ()))
                locks.add(txn.txn_id)
                continue
            if not self._expired(txn, now_ms) or txn.txn_id in locks:
                continue
            record, decision_locks = self._decision(txn, Decision.ABORT,
                                                    self._timeout_cause(txn), now_ms,
                                                    check_locks=False)
            if any(lock in self._locks or lock in self._shared or lock in locks
                   for lock in decision_locks):
                continue  # in flight; the next tick looks again
            records.append(record)
            locks |= decision_locks
            self._counters["timeouts_total"] += 1
        appends: tuple[Append, ...] = ()
        if records:
            appends = self._propose(records, locks, None).appends
        deciding = [txn for txn in self._unfinished.values() if txn.state in DECIDING]
        appends += self._completions(deciding, now_ms)
        return Ready(appends=appends, markers=tuple(abandoned)
                     + self._send_markers(deciding, now_ms, resend=True))

    # ========================================================================= queries

    def status(self, txn_id: TxnId, now_ms: int) -> TxnStatus:
        """GetTxnStatus. A parallel commit answered "committed" is COMMITTING from then on,
        also while its Decided record is still being appended."""
        txn = self._get(txn_id)
        if txn.promised:
            return TxnStatus(State.COMMITTING, EndCause.CLIENT, None, 0)
        remaining_ms = 0
        if txn.state is State.OPEN:
            remaining_ms = max(0, txn.deadline_ms - now_ms)
        elif txn.state is State.PREPARED:
            deadline_ms = txn.prepared_deadline_ms
            parent = self._open_parent(txn, now_ms)
            if parent is not None:  # it waits as long as its parent is open
                deadline_ms = max(deadline_ms, parent.deadline_ms)
            remaining_ms = max(0, deadline_ms - now_ms)
        return TxnStatus(txn.state, txn.end_cause, txn.parent, remaining_ms)

    def verify(self, txn_id: TxnId, target: Target) -> Verification:
        """VerifyTxnPartitions, one item: accept a write/ack only if state is OPEN and
        included. An OPEN transaction past its deadline answers OPEN until the tick's abort
        is durable (its writes are then aborted with it); a finished transaction keeps no
        partition list, so included is False. A one-call transaction being staged is
        OPEN. Presumed abort: a transaction never known here whose sequence was handed out
        (at most the highest used or reserved) is ABORTED — a one-call transaction that
        never committed, as its decision would be in the log."""
        one_call = self._one_calls.get(txn_id)
        if one_call is not None:
            return Verification(State.OPEN, one_call.includes(target), one_call.session,
                                self.coordinator_epoch)
        if (txn_id.tc_partition == self.tc_partition and self._lookup(txn_id) is None
                and txn_id not in self._locks
                and txn_id.sequence <= max(self._last_sequence, self._reserved)):
            return Verification(State.ABORTED, False, None, self.coordinator_epoch)
        txn = self._get(txn_id)
        included = target in (txn.topic_partitions if isinstance(target, TopicPartition)
                              else txn.subscription_partitions)
        return Verification(txn.state, included, txn.session, self.coordinator_epoch)

    def describe(self, txn_id: TxnId, now_ms: int) -> TxnDescription:
        """DescribeTransaction."""
        txn = self._get(txn_id)
        children = tuple(self._summary(child, now_ms) for c in txn.children
                         if (child := self._lookup(c)) is not None)
        return TxnDescription(
            self._summary(txn, now_ms), tuple(txn.topic_partitions),
            tuple(txn.subscription_partitions), children,
            tuple(t for t in txn.unconfirmed if isinstance(t, TopicPartition)),
            tuple(t for t in txn.unconfirmed if isinstance(t, SubscriptionPartition)),
            txn.marker_retry_count, txn.deadline_ms, txn.prepared_timeout_ms,
            txn.prepared_ms, txn.decided_ms, txn.completed_ms, txn.idempotency_key,
            txn.kept_children, txn.aborted_children, self.coordinator_epoch)

    def list_transactions(self, now_ms: int, states: Iterable[State] = (),
                          min_age_ms: int = 0, limit: int = 0) -> TxnList:
        """ListTransactions for this TC partition: oldest first, at most `limit` (0: the
        default; above the maximum: the maximum)."""
        wanted = frozenset(states) or frozenset(State)
        limit = min(limit or self.limits.default_list_limit, self.limits.max_list_limit)
        newest_start_ms = now_ms - min_age_ms
        wanted_values = {state.value for state in wanted}
        matching = [(txn.created_ms, txn.txn_id.sequence) for txn in self._unfinished.values()
                    if txn.state in wanted and txn.created_ms <= newest_start_ms]
        for entry in self._finished.values():  # the fixed part only: no full decode
            sequence, state, created_ms = _peek_entry(entry)
            if state in wanted_values and created_ms <= newest_start_ms:
                matching.append((created_ms, sequence))
        oldest = heapq.nsmallest(limit + 1, matching)
        return TxnList(tuple(self._summary(self._lookup(TxnId(self.tc_partition, sequence)),
                                           now_ms) for _, sequence in oldest[:limit]),
                       len(oldest) > limit)

    def stream(self, name: str, now_ms: int) -> StreamEntry | None:
        """A stream's committed high-water (None: none committed, or expired)."""
        return self._live_stream(name, now_ms)

    def session(self, transactional_id: str, now_ms: int) -> SessionInfo | None:
        """The live session of a transactional id (None: unknown or expired)."""
        entry = self._live_session(transactional_id, now_ms)
        if entry is None:
            return None
        return SessionInfo(entry.session, entry.timeout_ms, entry.last_active_ms,
                           entry.current_txn)

    def is_one_call(self, txn_id: TxnId) -> bool:
        """Whether an unfinished transaction was a one-call one decided here (volatile:
        false after a load)."""
        txn = self._unfinished.get(txn_id)
        return txn is not None and txn.one_call

    def is_staging(self, txn_id: TxnId) -> bool:
        """A parallel commit whose Staging record is durable and that is undecided."""
        txn = self._unfinished.get(txn_id)
        return txn is not None and txn.staging

    def is_finished(self, txn_id: TxnId) -> bool:
        """COMMITTED or ABORTED (or forgotten after it finished, or never known)."""
        return txn_id not in self._unfinished

    def idle(self) -> bool:
        """No unfinished transaction and no one-call transaction being staged: then
        `tick` has nothing to time out, complete or re-send, only sessions to expire
        (which it does at most every SESSION_SWEEP_INTERVAL_MS), and its shell may tick
        as seldom as that until an input arrives."""
        return not self._unfinished and not self._one_calls

    @property
    def metrics(self) -> CoreMetrics:
        return CoreMetrics(
            len(self._unfinished), len(self._finished), len(self._sessions),
            len(self._streams), len(self._pending),
            sum(len(t.unconfirmed) for t in self._unfinished.values()),
            **self._counters)

    @property
    def pending_append_ids(self) -> tuple[int, ...]:
        return tuple(p.append_id for p in self._pending)

    # ======================================================================== loading

    def apply(self, record: Record) -> None:
        """Apply one durable record (replay, or append_done). An illegal one raises
        IllegalTransition and changes nothing."""
        handler = _APPLY[type(record)]
        handler(self, record)

    def snapshot(self, covered_offset: int = 0) -> bytes:
        """The durable table, versioned and sealed by CRC32C. `covered_offset` is the log
        offset replay resumes at (the shell's bookkeeping; returned by `restore`)."""
        return _encode_snapshot(self, covered_offset)

    @classmethod
    def restore(cls, data: bytes, tc_partition: int, limits: Limits | None = None,
                coordinator_epoch: int = 0) -> tuple[TcPartitionCore, int]:
        """(core, covered_offset) from a snapshot; SnapshotCorrupt if it is not valid."""
        core = cls(tc_partition, limits, coordinator_epoch)
        covered_offset = _decode_snapshot(core, data)
        return core, covered_offset

    # ========================================================= helpers: proposals

    def _propose(self, records: list[Record], locks: set[object], reply: object,
                 shared: TxnId | None = None, new_txns: int = 0,
                 new_sessions: int = 0, new_streams: int = 0) -> Ready:
        append_id = self._next_append_id
        self._next_append_id += 1
        for lock in locks:
            assert lock not in self._locks and lock not in self._shared, lock
            self._locks[lock] = append_id
        if shared is not None:
            assert shared not in self._locks, shared
            self._shared[shared] = self._shared.get(shared, 0) + 1
        self._pending.append(_Pending(append_id, tuple(records), frozenset(locks), shared,
                                      new_txns, new_sessions, new_streams))
        self._pending_new_txns += new_txns
        self._pending_new_sessions += new_sessions
        self._pending_new_streams += new_streams
        return Ready(appends=(Append(append_id, tuple(records)),), reply=reply)

    def _next_txn_id(self) -> TxnId:
        """A sequence never handed out (after a load: above every reservation)."""
        txn_id = TxnId(self.tc_partition, max(self._next_sequence, self._last_sequence + 1))
        self._next_sequence = txn_id.sequence + 1
        return txn_id

    def _check_key_not_staging(self, idempotency_key: str) -> None:
        """CONCURRENT_TRANSACTIONS while a one-call transaction with the key is staged."""
        if idempotency_key in self._one_call_keys:
            self._counters["concurrent_total"] += 1
            raise _error("CONCURRENT_TRANSACTIONS", f"a transaction with idempotency key "
                         f"{idempotency_key!r} is being committed; retry shortly",
                         retry_after_ms=10)

    def _check_room(self, now_ms: int) -> None:
        """RESOURCE_EXHAUSTED when max_open transactions are unfinished (those being
        opened and one-call ones being staged included), or when max_finished_held
        finished ones are remembered because their callers may still retry: forgetting
        one of those would answer a retried commit as a new transaction."""
        unfinished = len(self._unfinished) + self._pending_new_txns + len(self._one_calls)
        if unfinished >= self.limits.max_open:
            self._counters["exhausted_total"] += 1
            raise _limit_error("max_open", self.limits.max_open,
                               f"TC partition {self.tc_partition} has {unfinished} unfinished "
                               "transactions")
        held = self.limits.max_finished_held
        if len(self._finished) >= held and not self._forgettable(now_ms):
            self._counters["exhausted_total"] += 1
            raise _limit_error("max_finished_held", held,
                               f"TC partition {self.tc_partition} remembers "
                               f"{len(self._finished)} finished transactions whose "
                               "callers may still retry them; retry later",
                               retry_after_ms=1_000)

    def _forgettable(self, now_ms: int) -> bool:
        """Whether the next `_forget_finished` at `now_ms` or later forgets one: the walk
        it would make finds one whose caller's retries are over. Changes nothing (a
        refusal changes nothing; forgetting happens only as records are applied, so a
        load forgets what the live table did): a transaction admitted at the bound
        forgets one when it completes."""
        finished, grace = self._finished, self.limits.finished_grace_ms
        if not finished:
            return False
        newest = _retried_until(finished[next(reversed(finished))]) + grace
        for entry in itertools.islice(finished.values(), _FORGET_LOOKS):
            until = _retried_until(entry) + grace
            if until <= now_ms:
                return True
            if until <= newest:
                return False
            newest = until  # (moved back, behind the newest)
        return False

    def _pop_pending(self, append_id: int) -> _Pending:
        if not self._pending or self._pending[0].append_id != append_id:
            raise ProtocolError(f"append {append_id} is not the oldest pending append "
                                f"(pending: {list(self.pending_append_ids)}); appends "
                                "complete in order")
        return self._pending.popleft()

    def _release(self, pending: _Pending) -> None:
        for lock in pending.locks:
            assert self._locks.get(lock) == pending.append_id, lock
            del self._locks[lock]
        if pending.shared is not None:
            self._shared[pending.shared] -= 1
            if not self._shared[pending.shared]:
                del self._shared[pending.shared]
        self._pending_new_txns -= pending.new_txns
        self._pending_new_sessions -= pending.new_sessions
        self._pending_new_streams -= pending.new_streams

    def _check_unlocked(self, locks: Iterable[object]) -> None:
        for lock in locks:
            if lock in self._locks or lock in self._shared:
                self._counters["concurrent_total"] += 1
                what = (f"transaction {lock}" if isinstance(lock, TxnId)
                        else f"{lock[0].replace('key', 'idempotency key')} {lock[1]!r}")
                why = ("has children being opened under it" if lock not in self._locks
                       else "has a state change being logged")
                raise _error("CONCURRENT_TRANSACTIONS", f"{what} {why}; retry shortly",
                             retry_after_ms=10)

    def _get(self, txn_id: TxnId) -> Txn:
        if txn_id.tc_partition != self.tc_partition:
            raise _error("NOT_COORDINATOR",
                         f"transaction {txn_id} belongs to TC partition "
                         f"{txn_id.tc_partition}, not {self.tc_partition}",
                         tc_partition=txn_id.tc_partition)
        txn = self._lookup(txn_id)
        if txn is None and txn_id in self._locks:
            self._counters["concurrent_total"] += 1
            raise _error("CONCURRENT_TRANSACTIONS", f"transaction {txn_id} is being opened; "
                         "retry shortly", retry_after_ms=10)
        if txn is None:
            raise _error("UNKNOWN_TRANSACTION",
                         f"transaction {txn_id} is not known on TC partition "
                         f"{self.tc_partition} (never opened, or finished and forgotten "
                         f"past the last {self.limits.max_finished} finished and its "
                         "caller's retries)",
                         txn_id=txn_id)
        return txn

    def _lookup(self, txn_id: TxnId | None) -> Txn | None:
        """Any known transaction; a finished one is decoded afresh (a read-only copy)."""
        txn = self._unfinished.get(txn_id)
        if txn is not None or txn_id is None:
            return txn
        entry = self._finished_entry(txn_id)
        return None if entry is None else _decode_entry(entry, 0, self.tc_partition)

    def _finished_entry(self, txn_id: TxnId) -> bytes | None:
        if txn_id.tc_partition != self.tc_partition:
            return None
        return self._finished.get(txn_id.sequence)

    def _lookup_key(self, idempotency_key: str) -> Txn | None:
        sequence = self._key_sequence(idempotency_key)
        return None if sequence is None else self._lookup(TxnId(self.tc_partition, sequence))

    def _decision(self, txn: Txn, decision: Decision, cause: EndCause, now_ms: int,
                  keep: tuple[TxnId, ...] = (),
                  check_locks: bool = True) -> tuple[Decided, set[object]]:
        """The Decided record for an undecided transaction and the locks it needs (the
        transaction and its undecided children), checked to be free."""
        assert txn.state in UNDECIDED, txn
        aborted = tuple(c for c in txn.children
                        if c not in keep and (child := self._unfinished.get(c)) is not None
                        and child.state in UNDECIDED)
        locks = {txn.txn_id, *keep, *aborted}
        if check_locks:
            self._check_unlocked(sorted(locks))
        return Decided(txn.txn_id, decision, cause, now_ms, keep, aborted), locks

    @staticmethod
    def _timeout_cause(txn: Txn) -> EndCause:
        return EndCause.TIMEOUT if txn.state is State.OPEN else EndCause.PREPARED_TIMEOUT

    def _resolve_timeout(self, timeout_ms: int, session: Session | None, now_ms: int) -> int:
        if timeout_ms == 0 and session is not None:
            entry = self._live_session(session.transactional_id, now_ms)
            if entry is not None:
                return entry.timeout_ms
        return _validate_timeout(timeout_ms, self.limits.default_timeout_ms,
                                 self.limits.max_timeout_ms, "max_timeout_ms",
                                 "transaction timeout")

    def _check_same_request(self, existing: Txn, parent: TxnId | None,
                            session: Session | None) -> None:
        given_id = session.transactional_id if session else ""
        existing_id = existing.session.transactional_id if existing.session else ""
        if existing.parent != parent or given_id != existing_id:
            raise _error("INVALID_ARGUMENT",
                         f"the idempotency key names transaction {existing.txn_id}, whose "
                         f"parent ({existing.parent or 'none'}) or transactional id "
                         f"({existing_id!r}) differs from this request's",
                         field="idempotency_key",
                         txn_id=existing.txn_id)

    def _existing(self, now_ms: int, txn: Txn, session: Session | None,
                  topic_partitions: Sequence[TopicPartition],
                  subscription_partitions: Sequence[SubscriptionPartition]) -> Ready:
        """NewTxn with the idempotency key of a live transaction: return it; if OPEN,
        restart its timeout and register the partitions."""
        if txn.staging:
            raise _staging_error(txn)
        self._check_session(txn, session, now_ms)
        if txn.state is not State.OPEN:
            not_open = _error("TRANSACTION_NOT_OPEN",
                              f"transaction {txn.txn_id} is {txn.state.name}",
                              txn_id=txn.txn_id, state=txn.state.name)
            return Ready(reply=NewTxnResult(
                txn.txn_id, txn.state, True, txn.timeout_ms,
                tuple(None if t in txn.topic_partitions else not_open
                      for t in topic_partitions),
                tuple(None if s in txn.subscription_partitions else not_open
                      for s in subscription_partitions)))
        self._check_unlocked([txn.txn_id])
        new_tps, new_subs, tp_results, sub_results = self._admit_targets(
            txn, topic_partitions, subscription_partitions)
        records: list[Record] = [DeadlineReset(txn.txn_id, now_ms + txn.timeout_ms)]
        if new_tps or new_subs:
            records.append(Registered(txn.txn_id, new_tps, new_subs))
        reply = NewTxnResult(txn.txn_id, State.OPEN, True, txn.timeout_ms, tp_results,
                             sub_results)
        return self._propose(records, {txn.txn_id}, reply)

    def _expired(self, txn: Txn, now_ms: int) -> bool:
        """`txn.timed_out`, except that a PREPARED child waits for its parent while the
        parent is OPEN within its own deadline (which the parent's keep-alives restart:
        NewTxn by its key). So the parent's timeout, not the child's prepared timeout,
        bounds how long a running job's prepared children wait; a dead parent's timeout
        aborts them with it. (Before, a Spark job whose write ran longer than the
        prepared timeout failed at its commit, CHILD_NOT_PREPARED, after all its work.)"""
        return self._open_parent(txn, now_ms) is None and txn.timed_out(now_ms)

    def _open_parent(self, txn: Txn, now_ms: int) -> Txn | None:
        """The parent a PREPARED child waits for: OPEN and within its deadline; else None."""
        if txn.state is State.PREPARED and txn.parent is not None:
            parent = self._unfinished.get(txn.parent)
            if parent is not None and parent.state is State.OPEN \
                    and not parent.timed_out(now_ms):
                return parent
        return None

    def _check_parent(self, parent_id: TxnId, now_ms: int) -> None:
        if parent_id.tc_partition != self.tc_partition:
            raise _error("INVALID_ARGUMENT",
                         f"parent {parent_id} is on TC partition {parent_id.tc_partition}; a "
                         f"child must be opened on its parent's ({self.tc_partition})",
                         field="parent_txn_id")
        parent = self._get(parent_id)
        if parent.parent is not None:
            raise _error("INVALID_ARGUMENT",
                         f"{parent_id} is itself a child (of {parent.parent}); children "
                         "have no children", field="parent_txn_id")
        if parent.state is not State.OPEN or parent.timed_out(now_ms) or parent.staging:
            # (A staging parent is a parallel commit's one-call transaction: OPEN until its
            # CommitTxn decides it, which decides no children.)
            state = ("TIMED_OUT" if parent.timed_out(now_ms) else
                     "STAGING" if parent.staging else parent.state.name)
            raise _error("PARENT_NOT_OPEN",
                         f"parent {parent_id} is {state}: it takes no new children",
                         parent_state=state, parent_txn_id=parent_id)
        children = len(parent.children) + self._shared.get(parent_id, 0)
        if children >= self.limits.max_children:
            self._counters["exhausted_total"] += 1
            raise _limit_error("max_children", self.limits.max_children,
                               f"parent {parent_id} has {children} child transaction(s)",
                               parent_txn_id=parent_id)
        if parent_id in self._locks:
            self._counters["concurrent_total"] += 1
            raise _error("CONCURRENT_TRANSACTIONS", f"parent {parent_id} has a state change "
                         "being logged; retry shortly", retry_after_ms=10)

    def _check_session_free(self, session: Session, now_ms: int) -> set[object]:
        """NewTxn in a session: the session is current and has no undecided transaction."""
        entry = self._check_current_session(session, now_ms)
        staging = self._one_calls.get(self._one_call_sessions.get(session.transactional_id))
        if staging is not None:
            self._counters["concurrent_total"] += 1
            raise _error("CONCURRENT_TRANSACTIONS",
                         f"session {session.transactional_id!r} is committing transaction "
                         f"{staging.txn_id}; retry shortly", txn_id=staging.txn_id,
                         retry_after_ms=10)
        txn = self._unfinished.get(entry.current_txn)
        if txn is not None and txn.state in UNDECIDED:
            self._counters["concurrent_total"] += 1
            raise _error("CONCURRENT_TRANSACTIONS",
                         f"session {session.transactional_id!r} already has transaction "
                         f"{txn.txn_id} {txn.state.name}; end it first",
                         txn_id=txn.txn_id, state=txn.state.name)
        return {("session", session.transactional_id)}

    def _check_current_session(self, session: Session, now_ms: int) -> SessionEntry:
        entry = self._live_session(session.transactional_id, now_ms)
        if entry is None or entry.session != session:
            self._counters["fenced_total"] += 1
            current = (f"producer id {entry.session.producer_id} epoch "
                       f"{entry.session.producer_epoch}" if entry else
                       "no live session (never initialized, or expired)")
            raise _error("PRODUCER_FENCED",
                         f"producer id {session.producer_id} epoch {session.producer_epoch} "
                         f"is not the current session of transactional id "
                         f"{session.transactional_id!r}: it has {current}; call "
                         "InitProducerId", transactional_id=session.transactional_id)
        return entry

    def _check_session(self, txn: Txn, session: Session | None, now_ms: int) -> None:
        """A call about a session-bound transaction carries its current session."""
        if txn.session is None:
            if session is not None:
                raise _error("INVALID_ARGUMENT", f"transaction {txn.txn_id} is not bound to "
                             "a session; leave session unset", field="session")
            return
        if session is None or session.transactional_id != txn.session.transactional_id:
            raise _error("INVALID_ARGUMENT",
                         f"transaction {txn.txn_id} belongs to transactional id "
                         f"{txn.session.transactional_id!r}: the call must carry that "
                         "session", field="session")
        # Stale: not the session's current producer id and epoch (or, once the session
        # expired, not the transaction's). The current session may ask about an older
        # epoch's transaction: the epoch bump decided it, so the state answers.
        entry = self._live_session(session.transactional_id, now_ms)
        current = entry.session if entry is not None else txn.session
        if session != current or (txn.state in UNDECIDED and session != txn.session):
            self._counters["fenced_total"] += 1
            raise _error("PRODUCER_FENCED",
                         f"producer id {session.producer_id} epoch {session.producer_epoch} "
                         f"is fenced: transactional id {session.transactional_id!r} is at "
                         f"producer id {current.producer_id} epoch {current.producer_epoch} "
                         f"(transaction {txn.txn_id} belongs to epoch "
                         f"{txn.session.producer_epoch})",
                         transactional_id=session.transactional_id, txn_id=txn.txn_id)

    def _check_children_to_keep(self, txn: Txn, decision: Decision,
                                children_to_keep: Sequence[TxnId],
                                now_ms: int) -> tuple[TxnId, ...]:
        keep = tuple(dict.fromkeys(children_to_keep))
        if keep and decision is not Decision.COMMIT:
            raise _error("INVALID_ARGUMENT", "children_to_keep is for a parent's COMMIT only",
                         field="children_to_keep")
        if len(keep) > self.limits.max_children:
            raise _limit_error("max_children", self.limits.max_children,
                               f"{len(keep)} children to keep")
        for child_id in keep:
            child = self._lookup(child_id)
            if child is None or child.parent != txn.txn_id:
                raise _error("INVALID_ARGUMENT",
                             f"{child_id} is not a child of {txn.txn_id}"
                             f"{'' if child else ' (unknown transaction)'}",
                             field="children_to_keep", child_txn_id=child_id)
            if child.state is not State.PREPARED or self._expired(child, now_ms):
                state = "TIMED_OUT" if self._expired(child, now_ms) else child.state.name
                raise _error("CHILD_NOT_PREPARED",
                             f"child {child_id} is {state}, not PREPARED: nothing was "
                             "decided", child_txn_id=child_id, child_state=state,
                             end_cause=child.end_cause.name)
        return keep

    def _admit_targets(self, txn: Txn | None, topic_partitions: Sequence[TopicPartition],
                       subscription_partitions: Sequence[SubscriptionPartition]):
        """New targets (deduplicated, within max_partitions) and per-item results."""
        count = txn.target_count if txn else 0
        new: dict[Target, None] = {}
        results: list[ItemResult] = []
        for target in [*topic_partitions, *subscription_partitions]:
            if txn is not None and (target in txn.topic_partitions
                                    or target in txn.subscription_partitions):
                results.append(None)
            elif target in new:
                results.append(None)
            elif count < self.limits.max_partitions:
                new[target] = None
                count += 1
                results.append(None)
            else:
                self._counters["exhausted_total"] += 1
                results.append(_limit_error("max_partitions", self.limits.max_partitions,
                                            f"transaction already has {count} partitions "
                                            f"and subscription partitions; {target} was not "
                                            "added", target=target))
        new_tps = tuple(t for t in new if isinstance(t, TopicPartition))
        new_subs = tuple(t for t in new if isinstance(t, SubscriptionPartition))
        split = len(topic_partitions)
        return new_tps, new_subs, tuple(results[:split]), tuple(results[split:])

    def _register(self, now_ms: int, txn_id: TxnId,
                  topic_partitions: Sequence[TopicPartition],
                  subscription_partitions: Sequence[SubscriptionPartition],
                  session: Session | None) -> Ready:
        txn = self._get(txn_id)
        self._check_session(txn, session, now_ms)
        error = _not_open_error(txn, now_ms, "add partitions to")
        if error is not None:
            raise error
        new_tps, new_subs, tp_results, sub_results = self._admit_targets(
            txn, topic_partitions, subscription_partitions)
        reply = RegisterResult(tp_results, sub_results)
        if not new_tps and not new_subs:
            return Ready(reply=reply)
        self._check_unlocked([txn_id])
        return self._propose([Registered(txn_id, new_tps, new_subs)], {txn_id}, reply)

    def _completions(self, candidates: Iterable[Txn], now_ms: int) -> tuple[Append, ...]:
        """One Append of Completed records for the candidates that are due: deciding, every
        marker confirmed, every child finished, nothing in flight."""
        records: list[Record] = []
        locks: set[object] = set()
        for txn in dict.fromkeys(candidates):
            if (txn.state in DECIDING and not txn.unconfirmed and txn.txn_id not in locks
                    and txn.txn_id not in self._locks
                    and all(self.is_finished(child) for child in txn.children)):
                records.append(Completed(txn.txn_id, DECISION_OF[txn.state], now_ms))
                locks.add(txn.txn_id)
        if not records:
            return ()
        return self._propose(records, locks, None).appends

    def _send_markers(self, txns: Iterable[Txn], now_ms: int,
                      resend: bool) -> tuple[Marker, ...]:
        markers: list[Marker] = []
        for txn in txns:
            if not txn.unconfirmed:
                continue
            # (A sent time ahead of now, the wall clock stepped back since, counts as due:
            # else no re-send came until the clock caught up with it, and the partitions'
            # readers waited behind the transaction for as long.)
            if resend and 0 <= txn.markers_sent_ms and (
                    0 <= now_ms - txn.markers_sent_ms < self.limits.marker_retry_ms):
                continue
            if resend and len(markers) >= self.limits.max_markers_per_tick:
                break
            if txn.markers_sent_ms >= 0:
                txn.marker_retry_count += 1
                self._counters["marker_resends_total"] += 1
            txn.markers_sent_ms = now_ms
            decision = DECISION_OF[txn.state]
            markers.extend([Marker(txn.txn_id, decision, self.coordinator_epoch, target)
                            for target in txn.unconfirmed])
        return tuple(markers)

    # ========================================================= helpers: sessions

    def _session_expired(self, entry: SessionEntry, now_ms: int) -> bool:
        if entry.current_txn in self._unfinished or \
                entry.session.transactional_id in self._one_call_sessions:
            return False
        return now_ms - entry.last_active_ms > self.limits.session_expiry_ms

    def _live_session(self, transactional_id: str, now_ms: int) -> SessionEntry | None:
        entry = self._sessions.get(transactional_id)
        if entry is None or self._session_expired(entry, now_ms):
            return None
        return entry

    def forget_expired_sessions(self, now_ms: int) -> None:
        """Free the memory of expired sessions (decisions already treat them as absent)."""
        expired = [tid for tid, entry in self._sessions.items()
                   if ("session", tid) not in self._locks
                   and self._session_expired(entry, now_ms)]
        for tid in expired:
            del self._sessions[tid]

    def _make_room_for_session(self, now_ms: int) -> None:
        self._make_room(self._sessions, self._pending_new_sessions, "max_sessions",
                        self.forget_expired_sessions, now_ms, "transactional-id sessions")

    def _make_room(self, table: dict, pending: int, limit: str, forget_expired,
                   now_ms: int, what: str) -> None:
        """Room for one more entry of a bounded table of logically expiring entries
        (sessions, streams): the expired ones are freed when it is full, and if it is
        still full the request is refused (RESOURCE_EXHAUSTED), never a live one evicted."""
        bound = getattr(self.limits, limit)
        if len(table) + pending < bound:
            return
        forget_expired(now_ms)
        if len(table) + pending < bound:
            return
        self._counters["exhausted_total"] += 1
        raise _limit_error(limit, bound, f"TC partition {self.tc_partition} has "
                           f"{len(table)} live {what}")

    def _check_stream_alone(self, parent: TxnId | None, session: Session | None) -> None:
        if parent is not None or session is not None:
            raise _error("INVALID_ARGUMENT", "a transaction of a stream has neither a parent "
                         "nor a session: the stream's own TC partition keeps its place",
                         field="stream")

    def _check_stream_ahead(self, stream: TxnStream, now_ms: int) -> None:
        """STREAM_ORDINAL_COMMITTED when the stream committed this ordinal or a later one."""
        entry = self._live_stream(stream.name, now_ms)
        if entry is not None and entry.ordinal >= stream.ordinal:
            raise _error("STREAM_ORDINAL_COMMITTED",
                         f"stream {stream.name!r} committed ordinal {entry.ordinal} already "
                         f"(transaction {entry.txn_id}): ordinal {stream.ordinal} is not ahead "
                         "of it, so it is not done again", stream=stream.name,
                         ordinal=stream.ordinal, committed_ordinal=entry.ordinal,
                         committed_txn_id=entry.txn_id)

    def _live_stream(self, name: str, now_ms: int) -> StreamEntry | None:
        entry = self._streams.get(name)
        if entry is None or now_ms - entry.committed_ms > self.limits.stream_expiry_ms:
            return None
        return entry

    def forget_expired_streams(self, now_ms: int) -> None:
        """Free the memory of expired streams (decisions already treat them as absent)."""
        expiry = self.limits.stream_expiry_ms
        for name in [name for name, entry in self._streams.items()
                     if now_ms - entry.committed_ms > expiry
                     and ("stream", name) not in self._locks]:
            del self._streams[name]

    def _make_room_for_stream(self, now_ms: int) -> None:
        self._make_room(self._streams, self._pending_new_streams, "max_streams",
                        self.forget_expired_streams, now_ms, "streams")

    # ========================================================= helpers: applying records

    def _illegal(self, record: Record, why: str) -> IllegalTransition:
        return IllegalTransition(f"TC partition {self.tc_partition}: {type(record).__name__} "
                                 f"record {record}: {why}")

    def _existing_txn(self, record: Record) -> Txn:
        txn = self._unfinished.get(record.txn_id)
        if txn is None:
            raise self._illegal(record, "unknown transaction, or finished (final)"
                                if self._finished_entry(record.txn_id) is None else
                                f"{self._lookup(record.txn_id).state.name} is final")
        return txn

    def _check_transition(self, record: Record, txn: Txn, to: State) -> None:
        if to not in ALLOWED[txn.state]:
            raise self._illegal(record, f"{txn.txn_id} cannot go from {txn.state.name} to "
                                f"{to.name}")

    def _apply_opened(self, record: Opened) -> None:
        txn_id = record.txn_id
        if txn_id.tc_partition != self.tc_partition:
            raise self._illegal(record, "transaction of another TC partition")
        if txn_id in self._unfinished or txn_id.sequence in self._finished:
            raise self._illegal(record, "the transaction exists already")
        if self._reserved < txn_id.sequence <= self._last_sequence:
            # Only one-call transactions (within a logged reservation) are logged out of
            # sequence order.
            raise self._illegal(record, f"sequence not above {self._last_sequence} and not "
                                f"reserved (up to {self._reserved})")
        parent = None
        if record.parent is not None:
            parent = self._unfinished.get(record.parent)
            if parent is None or parent.state is not State.OPEN or parent.parent is not None:
                raise self._illegal(record, "the parent is not an OPEN top-level transaction")
        entry = None
        if record.session is not None:
            entry = self._sessions.get(record.session.transactional_id)
            if entry is None or entry.session != record.session:
                raise self._illegal(record, "the session is not current")
            current = self._unfinished.get(entry.current_txn)
            if current is not None and current.state in UNDECIDED:
                raise self._illegal(record, f"the session already has {current.txn_id} open")
        txn = Txn(txn_id, State.OPEN, record.created_ms, record.timeout_ms, record.deadline_ms,
                  record.parent, record.session, record.idempotency_key,
                  dict.fromkeys(record.topic_partitions),
                  dict.fromkeys(record.subscription_partitions))
        self._unfinished[txn_id] = txn
        self._last_sequence = max(self._last_sequence, txn_id.sequence)
        if parent is not None:
            parent.children.append(txn_id)
        if entry is not None:
            entry.current_txn = txn_id
            entry.last_active_ms = max(entry.last_active_ms, record.created_ms)
        if record.idempotency_key:
            self._index_key(record.idempotency_key, txn_id)

    def _apply_staging(self, record: Staging) -> None:
        if not record.topic_partitions and not record.subscription_partitions:
            raise self._illegal(record, "a parallel commit stages at least one partition or "
                                "subscription partition")
        self._apply_opened(record)
        self._unfinished[record.txn_id].staging = True

    def _apply_registered(self, record: Registered) -> None:
        txn = self._existing_txn(record)
        if txn.state is not State.OPEN:
            raise self._illegal(record, f"{txn.txn_id} is {txn.state.name}, not OPEN")
        txn.topic_partitions.update(dict.fromkeys(record.topic_partitions))
        txn.subscription_partitions.update(dict.fromkeys(record.subscription_partitions))

    def _apply_deadline_reset(self, record: DeadlineReset) -> None:
        txn = self._existing_txn(record)
        if txn.state is not State.OPEN:
            raise self._illegal(record, f"{txn.txn_id} is {txn.state.name}, not OPEN")
        txn.deadline_ms = record.deadline_ms

    def _apply_prepared(self, record: Prepared) -> None:
        txn = self._existing_txn(record)
        self._check_transition(record, txn, State.PREPARED)
        txn.state = State.PREPARED
        txn.prepared_ms = record.prepared_ms
        txn.prepared_timeout_ms = record.prepared_timeout_ms

    def _apply_decided(self, record: Decided) -> None:
        txn = self._existing_txn(record)
        self._check_transition(record, txn, DECIDING_STATE[record.decision])
        kept = [self._unfinished.get(c) for c in record.kept_children]
        aborted = [self._unfinished.get(c) for c in record.aborted_children]
        for child in kept + aborted:
            if child is None or child.parent != txn.txn_id:
                raise self._illegal(record, "names a transaction that is not its child")
        for child in kept:
            if child.state is not State.PREPARED:
                raise self._illegal(record, f"keeps child {child.txn_id}, which is "
                                    f"{child.state.name}, not PREPARED")
        for child in aborted:
            self._check_transition(record, child, State.ABORTING)
        named = set(record.kept_children) | set(record.aborted_children)
        for child_id in txn.children:
            child = self._unfinished.get(child_id)
            if child is not None and child.state in UNDECIDED and child_id not in named:
                raise self._illegal(record, f"leaves child {child_id} undecided")
        self._decide(txn, record.decision, record.cause, record.decided_ms)
        if txn.staging:
            txn.staging = txn.handled = txn.promised = txn.resolving = False
            if record.decision is Decision.ABORT and txn.idempotency_key:
                # Its CommitTxn did not commit (or a resolution aborted it): a retry with
                # the key starts afresh, as after a presumed abort.
                if self._key_sequence(txn.idempotency_key) == txn.txn_id.sequence:
                    self._unindex_key(txn.idempotency_key)
                txn.idempotency_key = ""
        txn.kept_children = record.kept_children
        txn.aborted_children = record.aborted_children
        for child in kept:
            self._decide(child, Decision.COMMIT, EndCause.PARENT, record.decided_ms)
        for child in aborted:
            self._decide(child, Decision.ABORT, EndCause.PARENT, record.decided_ms)
        self._counters["decisions_total"] += 1

    @staticmethod
    def _decide(txn: Txn, decision: Decision, cause: EndCause, decided_ms: int) -> None:
        txn.state = DECIDING_STATE[decision]
        txn.end_cause = cause
        txn.decided_ms = decided_ms
        txn.unconfirmed = dict.fromkeys(txn.targets())
        txn.markers_sent_ms = -1

    def _apply_completed(self, record: Completed) -> None:
        txn = self._existing_txn(record)
        self._check_transition(record, txn, FINISHED_STATE[record.decision])
        if not all(self.is_finished(child) for child in txn.children):
            raise self._illegal(record, "a child is not finished")
        txn.state = FINISHED_STATE[record.decision]
        txn.completed_ms = record.completed_ms
        txn.topic_partition_count = len(txn.topic_partitions)
        txn.subscription_partition_count = len(txn.subscription_partitions)
        txn.topic_partitions = txn.subscription_partitions = _NO_TARGETS
        txn.unconfirmed = {}
        del self._unfinished[txn.txn_id]
        self._finished[txn.txn_id.sequence] = _encode_entry(txn)
        if txn.session is not None:
            entry = self._sessions.get(txn.session.transactional_id)
            if entry is not None and entry.current_txn == txn.txn_id:
                entry.last_active_ms = max(entry.last_active_ms, record.completed_ms)
        if len(self._finished) > self.limits.max_finished:
            self._forget_finished(record.completed_ms)

    def _index_key(self, key: str, txn_id: TxnId) -> None:
        self._keys[key] = _key_row(key, txn_id.sequence)

    def _unindex_key(self, key: str) -> None:
        del self._keys[key]

    def _key_sequence(self, key: str) -> int | None:
        """The sequence of the transaction `key` names, None if it names none."""
        row = self._keys.get(key)
        return None if row is None else _U64.unpack_from(row, len(row) - _U64.size)[0]

    def _forget_finished(self, now_ms: int) -> None:
        """Forget the oldest finished transactions past max_finished whose callers are
        done retrying at `now_ms` (`_retried_until`). A held one that outlives the newest
        (a long timeout among short ones) moves to the back, so it holds back none behind
        it and the order stays about that of their ends; any other held one stops the
        call (those behind it end later). At most _FORGET_LOOKS moved back and
        _FORGET_MAX forgotten per call, so no call stalls the loop; those above
        max_finished shrink by that many a completion."""
        finished, grace = self._finished, self.limits.finished_grace_ms
        excess = len(finished) - self.limits.max_finished
        forgotten, looks, most_looks = 0, 0, min(_FORGET_LOOKS, len(finished))
        while excess > 0 and forgotten < _FORGET_MAX and looks < most_looks:
            sequence = next(iter(finished))
            entry = finished[sequence]
            until = _retried_until(entry) + grace
            if until <= now_ms:
                self._evict(sequence)
                excess -= 1
                forgotten += 1
                continue
            self._counters["held_total"] += 1
            if until <= _retried_until(finished[next(reversed(finished))]) + grace:
                return
            del finished[sequence]
            finished[sequence] = entry  # (to the back: dicts keep insertion order)
            looks += 1

    def _evict(self, sequence: int) -> None:
        txn = _decode_entry(self._finished.pop(sequence), 0, self.tc_partition)
        if txn.idempotency_key and self._key_sequence(txn.idempotency_key) == sequence:
            self._unindex_key(txn.idempotency_key)
        self._counters["evicted_total"] += 1

    def _apply_sequences_reserved(self, record: SequencesReserved) -> None:
        self._reserved = max(self._reserved, record.up_to)

    def _apply_session_started(self, record: SessionStarted) -> None:
        entry = self._sessions.get(record.transactional_id)
        if entry is not None:
            current = self._unfinished.get(entry.current_txn)
            if current is not None and current.state in UNDECIDED:
                raise self._illegal(record, f"{current.txn_id} of the old session is undecided")
            old = entry.session
            if old.producer_id == record.producer_id and \
                    record.producer_epoch <= old.producer_epoch:
                raise self._illegal(record, f"epoch does not grow from {old.producer_epoch}")
        self._sessions[record.transactional_id] = SessionEntry(
            record.session, record.timeout_ms, record.started_ms,
            bumped_from=record.bumped_from)

    def _apply_stream_committed(self, record: StreamCommitted) -> None:
        txn = self._unfinished.get(record.txn_id)
        if txn is None or txn.state is not State.COMMITTING or txn.parent is not None:
            raise self._illegal(record, "its transaction is not a top-level one just decided "
                                "COMMIT (the Decided record goes first, in the same append)")
        entry = self._live_stream(record.stream, record.committed_ms)
        if entry is not None and entry.ordinal >= record.ordinal:
            raise self._illegal(record, f"stream {record.stream!r} committed ordinal "
                                f"{entry.ordinal} already")
        self._streams[record.stream] = StreamEntry(record.ordinal, record.txn_id,
                                                   record.committed_ms)

    def _summary(self, txn: Txn, now_ms: int) -> TxnSummary:
        finished = txn.state in FINISHED
        state, cause = ((State.COMMITTING, EndCause.CLIENT) if txn.promised
                        else (txn.state, txn.end_cause))  # (as status)
        return TxnSummary(
            txn.txn_id, state, cause, txn.parent, txn.session, txn.created_ms,
            now_ms - txn.created_ms, txn.timeout_ms,
            txn.topic_partition_count if finished else len(txn.topic_partitions),
            txn.subscription_partition_count if finished else len(txn.subscription_partitions),
            len(txn.children))


# A finished transaction keeps counts, not partition lists (read-only: mutating it fails).
_NO_TARGETS = MappingProxyType({})


_APPLY = {
    SequencesReserved: TcPartitionCore._apply_sequences_reserved,
    Opened: TcPartitionCore._apply_opened,
    Staging: TcPartitionCore._apply_staging,
    Registered: TcPartitionCore._apply_registered,
    DeadlineReset: TcPartitionCore._apply_deadline_reset,
    Prepared: TcPartitionCore._apply_prepared,
    Decided: TcPartitionCore._apply_decided,
    Completed: TcPartitionCore._apply_completed,
    StreamCommitted: TcPartitionCore._apply_stream_committed,
    SessionStarted: TcPartitionCore._apply_session_started,
}


def replay(records: Iterable[Record], tc_partition: int, limits: Limits | None = None,
           coordinator_epoch: int = 0, base: TcPartitionCore | None = None) -> TcPartitionCore:
    """Rebuild a TC partition from its log (onto `base`, a restored snapshot, if given).
    Raises IllegalTransition at the first record that does not follow (fail closed)."""
    core = base if base is not None else TcPartitionCore(tc_partition, limits,
                                                         coordinator_epoch)
    assert core.tc_partition == tc_partition and not core._pending
    for record in records:
        core.apply(record)
    # A load never hands out a sequence a deposed owner may have used (reserved).
    core._next_sequence = max(core._next_sequence, core._last_sequence + 1,
                              core._reserved + 1)
    return core


# ---------------------------------------------------------------------------------------
# Snapshot format (version 1), little-endian:
#   header   magic "ATCS", version u16, reserved u16 (0), tc_partition u32,
#            coordinator_epoch u64 (of the writer; informational), covered_offset i64,
#            last_sequence u64, transactions u32, sessions u32, keys u32
#   txn      length u32 (of the rest of the entry), sequence u64, state u8, end_cause u8,
#            flags u8, created_ms i64, timeout_ms u32, deadline_ms i64, prepared_ms i64,
#            prepared_timeout_ms u32, decided_ms i64, completed_ms i64,
#            topic_partition_count u32, subscription_partition_count u32 (both 0 unless
#            finished), then the parts its flags announce, in this order:
#              1 parent sequence u64;  2 session: transactional_id string, producer_id
#              i64, producer_epoch u16;  4 idempotency_key string;  8 children,
#              16 kept_children, 32 aborted_children: count u32, sequences u64;
#              64 targets: topic_partitions, subscription_partitions as in records
#              (unfinished transactions only);  128 staging (no part: an OPEN
#              transaction of a parallel commit, logged by a Staging record)
#            Unfinished transactions first (in order of creation), then finished ones in
#            order of completion (the order they are forgotten in).
#   session  transactional_id string, producer_id i64, producer_epoch u16, timeout_ms u32,
#            last_active_ms i64, current_txn sequence u64 (0: none), bumped_from
#            producer_id i64, producer_epoch u16 (0, 0: none; not in version 1);
#            by transactional id
#   key      idempotency_key string, sequence u64; in index order (that of the log)
#   streams  (version 3) count u32, then per stream, by name: name string, ordinal u64,
#            sequence u64 (of the transaction that committed it), committed_ms i64
#   trailer  CRC32C (Castagnoli) u32 of every byte before it
# Strings are length u16 + UTF-8. Transaction ids are the snapshot's TC partition plus a
# sequence. Volatile state (marker confirmations, pending appends) is not in it: a load
# re-sends every marker. The core keeps each finished transaction as exactly this entry,
# so a snapshot encodes only the unfinished ones, and a restore slices finished entries
# out without decoding them (they are decoded when asked about).
# ---------------------------------------------------------------------------------------

SNAPSHOT_MAGIC = b"ATCS"
# 2: sessions carry bumped_from; 3: the streams' high-waters follow the keys. Versions 1
# and 2 are still read.
SNAPSHOT_VERSION = 3
_SNAP_HEADER = struct.Struct("<4sHHIQqQIII")
_SNAP_TXN = struct.Struct("<QBBBqIqqIqqII")
_SNAP_PEEK = struct.Struct("<IQBBBq")  # length, sequence, state, end_cause, flags, created
_SNAP_SESSION = struct.Struct("<qHIqQ")
_SNAP_STREAM = struct.Struct("<QQq")
_SESSION_TAIL = struct.Struct("<qH")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_TRAILER = struct.Struct("<I")
_F_PARENT, _F_SESSION, _F_KEY, _F_CHILDREN, _F_KEPT, _F_ABORTED, _F_TARGETS, _F_STAGING = (
    1 << bit for bit in range(8))
_STATES = {state.value: state for state in State}
_CAUSES = {cause.value: cause for cause in EndCause}
_FINISHED_VALUES = frozenset(state.value for state in FINISHED)
# Bounds of one `_forget_finished` call: held transactions moved back, ones forgotten.
_FORGET_LOOKS = 8
_FORGET_MAX = 256


def _retried_until(entry: bytes) -> int:
    """Until when (ms) a finished transaction's caller may still send calls about it:
    its deadline (OPEN's timeout; a PREPARED one's, from when it was prepared), or when
    it completed if later. Read from its snapshot entry's fixed part, undecoded."""
    (_, _, _, _, _, _, deadline_ms, prepared_ms, prepared_timeout_ms, _, completed_ms,
     _, _) = _SNAP_TXN.unpack_from(entry, _U32.size)
    prepared_until = prepared_ms + prepared_timeout_ms if prepared_ms > 0 else 0
    return max(deadline_ms, prepared_until, completed_ms)


def _encode_entry(txn: Txn) -> bytes:
    """A transaction's snapshot entry, length prefix included."""
    finished = txn.state in FINISHED
    has_targets = bool(txn.topic_partitions or txn.subscription_partitions)
    flags = ((txn.parent is not None and _F_PARENT) | (txn.session is not None and _F_SESSION)
             | (bool(txn.idempotency_key) and _F_KEY) | (bool(txn.children) and _F_CHILDREN)
             | (bool(txn.kept_children) and _F_KEPT)
             | (bool(txn.aborted_children) and _F_ABORTED) | (has_targets and _F_TARGETS)
             | (txn.staging and _F_STAGING))
    assert not (finished and has_targets), txn
    out = Writer()
    out.pack(_SNAP_TXN, txn.txn_id.sequence, txn.state._value_, txn.end_cause._value_, flags,
             txn.created_ms, txn.timeout_ms, txn.deadline_ms, txn.prepared_ms,
             txn.prepared_timeout_ms, txn.decided_ms, txn.completed_ms,
             txn.topic_partition_count if finished else 0,
             txn.subscription_partition_count if finished else 0)
    if txn.parent is not None:
        out.pack(_U64, txn.parent.sequence)
    if txn.session is not None:
        out.string(txn.session.transactional_id)
        out.pack(_SESSION_TAIL, txn.session.producer_id, txn.session.producer_epoch)
    if txn.idempotency_key:
        out.string(txn.idempotency_key)
    for ids in (txn.children, txn.kept_children, txn.aborted_children):
        if ids:
            out.parts.append(struct.pack(f"<I{len(ids)}Q", len(ids),
                                         *(i.sequence for i in ids)))
    if has_targets:
        out.targets(tuple(txn.topic_partitions), tuple(txn.subscription_partitions))
    body = out.getvalue()
    return _U32.pack(len(body)) + body


def _peek_entry(entry: bytes) -> tuple[int, int, int]:
    """(sequence, state value, created_ms) of an entry, without decoding the rest."""
    _, sequence, state, _, _, created_ms = _SNAP_PEEK.unpack_from(entry, 0)
    return sequence, state, created_ms


def _decode_entry(data: bytes, offset: int, tc: int) -> Txn:
    """The transaction in the entry at `offset` (its length prefix); ValueError and
    friends if it is malformed."""
    (length,) = _U32.unpack_from(data, offset)
    end = offset + 4 + length
    if end > len(data):
        raise ValueError(f"an entry of {length} bytes at {offset} runs past the end")
    reader = Reader(data, offset + 4)
    (sequence, state, cause, flags, created_ms, timeout_ms, deadline_ms, prepared_ms,
     prepared_timeout_ms, decided_ms, completed_ms, tp_count,
     sub_count) = reader.unpack(_SNAP_TXN)
    txn = Txn(TxnId(tc, sequence), _STATES[state], created_ms, timeout_ms, deadline_ms,
              end_cause=_CAUSES[cause], prepared_ms=prepared_ms,
              prepared_timeout_ms=prepared_timeout_ms, decided_ms=decided_ms,
              completed_ms=completed_ms, topic_partition_count=tp_count,
              subscription_partition_count=sub_count)
    if flags & _F_PARENT:
        txn.parent = TxnId(tc, *reader.unpack(_U64))
    if flags & _F_SESSION:
        tid = reader.string()
        txn.session = Session(tid, *reader.unpack(_SESSION_TAIL))
    if flags & _F_KEY:
        txn.idempotency_key = reader.string()
    for flag, attribute, kind in ((_F_CHILDREN, "children", list),
                                  (_F_KEPT, "kept_children", tuple),
                                  (_F_ABORTED, "aborted_children", tuple)):
        if flags & flag:
            (count,) = reader.unpack(_U32)
            if count * 8 > end - reader.position:
                raise ValueError(f"{count} transaction ids do not fit in the entry")
            sequences = struct.unpack_from(f"<{count}Q", data, reader.position)
            reader.position += 8 * count
            setattr(txn, attribute, kind(TxnId(tc, s) for s in sequences))
    if txn.state in FINISHED:
        txn.topic_partitions = txn.subscription_partitions = _NO_TARGETS
        if flags & _F_TARGETS:
            raise ValueError(f"finished transaction {txn.txn_id} lists partitions")
    elif flags & _F_TARGETS:
        topic_partitions, subscription_partitions = reader.targets()
        txn.topic_partitions = dict.fromkeys(topic_partitions)
        txn.subscription_partitions = dict.fromkeys(subscription_partitions)
    if reader.position != end or flags >> 8:
        raise ValueError(f"entry of {txn.txn_id} does not match its length or flags")
    if flags & _F_STAGING:
        if txn.state is not State.OPEN or txn.parent is not None:
            raise ValueError(f"staging transaction {txn.txn_id} is {txn.state.name}")
        txn.staging = True
    if txn.state not in FINISHED and (tp_count or sub_count):
        raise ValueError(f"unfinished transaction {txn.txn_id} has finished counts")
    return txn


def _encode_snapshot(core: TcPartitionCore, covered_offset: int) -> bytes:
    parts = [_SNAP_HEADER.pack(SNAPSHOT_MAGIC, SNAPSHOT_VERSION, 0, core.tc_partition,
                               core.coordinator_epoch, covered_offset,
                               max(core._last_sequence, core._reserved),
                               len(core._unfinished) + len(core._finished),
                               len(core._sessions), len(core._keys))]
    parts.extend(_encode_entry(txn) for txn in core._unfinished.values())
    parts.extend(core._finished.values())
    out = Writer()
    for tid, entry in sorted(core._sessions.items()):
        out.string(tid)
        out.pack(_SNAP_SESSION, entry.session.producer_id, entry.session.producer_epoch,
                 entry.timeout_ms, entry.last_active_ms,
                 entry.current_txn.sequence if entry.current_txn else 0)
        out.pack(_SESSION_TAIL, *(entry.bumped_from or (0, 0)))
    parts.append(out.getvalue())
    parts.extend(core._keys.values())  # insertion order: deterministic from the log
    out = Writer()
    out.pack(_U32, len(core._streams))
    for name, stream in sorted(core._streams.items()):
        out.string(name)
        out.pack(_SNAP_STREAM, stream.ordinal, stream.txn_id.sequence, stream.committed_ms)
    parts.append(out.getvalue())
    body = b"".join(parts)
    return body + _TRAILER.pack(crc32c.crc32c(body))


def _decode_snapshot(core: TcPartitionCore, data: bytes) -> int:
    if len(data) < _SNAP_HEADER.size + _TRAILER.size:
        raise SnapshotCorrupt(f"snapshot is {len(data)} bytes, shorter than its header")
    body = bytes(data[:-_TRAILER.size])
    (stored_crc,) = _TRAILER.unpack_from(data, len(body))
    if crc32c.crc32c(body) != stored_crc:
        raise SnapshotCorrupt(f"CRC32C mismatch: stored {stored_crc:#010x}, computed "
                              f"{crc32c.crc32c(body):#010x}")
    (magic, version, _, tc_partition, _, covered_offset, last_sequence, txn_count,
     session_count, key_count) = _SNAP_HEADER.unpack_from(body, 0)
    if magic != SNAPSHOT_MAGIC:
        raise SnapshotCorrupt(f"not a TC partition snapshot (magic {bytes(magic)!r})")
    if version not in (1, 2, SNAPSHOT_VERSION):
        raise SnapshotCorrupt(f"unsupported snapshot version {version} (this build reads "
                              f"{SNAPSHOT_VERSION})")
    if tc_partition != core.tc_partition:
        raise SnapshotCorrupt(f"snapshot of TC partition {tc_partition}, not "
                              f"{core.tc_partition}")
    reader = Reader(body, _SNAP_HEADER.size)
    try:
        core._last_sequence = last_sequence
        # The snapshot stores reservations folded into last_sequence: one-call
        # transactions logged after it may still use sequences up to it.
        core._reserved = last_sequence
        core._next_sequence = last_sequence + 1
        _decode_txns(core, reader, last_sequence, txn_count)
        _decode_sessions_and_keys(core, reader, session_count, key_count, version)
        if version >= 3:
            _decode_streams(core, reader)
        _check_restored(core)
    except (RecordCorrupt, ValueError, KeyError, IndexError, struct.error,
            UnicodeDecodeError) as error:
        raise SnapshotCorrupt(f"snapshot of TC partition {tc_partition} is invalid: "
                              f"{error!r}") from None
    if not reader.at_end():
        raise SnapshotCorrupt(f"{len(body) - reader.position} unexpected bytes at the end")
    return covered_offset


def _decode_txns(core: TcPartitionCore, reader: Reader, last_sequence: int,
                 count: int) -> None:
    """Unfinished entries are decoded; finished ones are sliced out as they are (their
    fixed part checked), which is what makes a load of 100,000 of them fast."""
    tc, data, position = core.tc_partition, reader.data, reader.position
    unfinished, finished = core._unfinished, core._finished
    peek, make_id, finished_values, size = (_SNAP_PEEK.unpack_from, tuple.__new__,
                                            _FINISHED_VALUES, len(data))
    for _ in range(count):
        length, sequence, state, cause, flags, _ = peek(data, position)
        end = position + 4 + length
        if not 0 < sequence <= last_sequence or end > size:
            raise ValueError(f"entry at byte {position}: sequence {sequence} outside "
                             f"1..{last_sequence}, or {length} bytes past the end")
        txn_id = make_id(TxnId, (tc, sequence))
        if sequence in finished or txn_id in unfinished:
            raise ValueError(f"transaction {txn_id} appears twice")
        if state in finished_values:
            if cause not in _CAUSES or flags & _F_TARGETS or flags >> 7:
                raise ValueError(f"finished entry of {txn_id} is malformed")
            finished[sequence] = data[position:end]
        else:
            if finished:
                raise ValueError(f"unfinished {txn_id} after finished transactions")
            txn = _decode_entry(data, position, tc)
            if txn.state in DECIDING:
                txn.unconfirmed = dict.fromkeys(txn.targets())
            unfinished[txn_id] = txn
        position = end
    reader.position = position


def _key_row(key: str, sequence: int) -> bytes:
    data = key.encode("utf-8")
    assert len(data) <= 0xFFFF, len(data)
    return _U16.pack(len(data)) + data + _U64.pack(sequence)


def _decode_sessions_and_keys(core: TcPartitionCore, reader: Reader, session_count: int,
                              key_count: int, version: int) -> None:
    tc = core.tc_partition
    for _ in range(session_count):
        tid = reader.string()
        producer_id, epoch, timeout_ms, last_active_ms, current = reader.unpack(_SNAP_SESSION)
        bumped_from = reader.unpack(_SESSION_TAIL) if version >= 2 else (0, 0)
        if tid in core._sessions:
            raise ValueError(f"session {tid!r} appears twice")
        session = Session(tid, producer_id, epoch)
        if bumped_from != (0, 0) and (Session(tid, *bumped_from) == session):
            raise ValueError(f"session {tid!r} is bumped from itself")
        core._sessions[tid] = SessionEntry(session, timeout_ms, last_active_ms,
                                           TxnId(tc, current) if current else None,
                                           bumped_from if bumped_from != (0, 0) else None)
    data, unpack_u16, unpack_u64 = reader.data, _U16.unpack_from, _U64.unpack_from
    position, keys, make_id = reader.position, core._keys, tuple.__new__
    for _ in range(key_count):
        (length,) = unpack_u16(data, position)
        key = data[position + 2:position + 2 + length].decode("utf-8")
        (sequence,) = unpack_u64(data, position + 2 + length)
        if key in keys or (sequence not in core._finished
                           and make_id(TxnId, (tc, sequence)) not in core._unfinished):
            raise ValueError(f"key {key!r} is duplicated or names an unknown transaction")
        keys[key] = bytes(data[position:position + 10 + length])
        position += 10 + length
    reader.position = position


def _decode_streams(core: TcPartitionCore, reader: Reader) -> None:
    (count,) = reader.unpack(_U32)
    for _ in range(count):
        name = reader.string()
        ordinal, sequence, committed_ms = reader.unpack(_SNAP_STREAM)
        if name in core._streams:
            raise ValueError(f"stream {name!r} appears twice")
        # (StreamCommitted validates the fields as the record would.)
        entry = StreamCommitted(name, ordinal, TxnId(core.tc_partition, sequence),
                                committed_ms)
        core._streams[name] = StreamEntry(entry.ordinal, entry.txn_id, entry.committed_ms)


def _check_restored(core: TcPartitionCore) -> None:
    """Pair assertion for what was read: the relations the apply functions maintain."""
    for txn in core._unfinished.values():
        if txn.parent is not None:
            parent = core._unfinished.get(txn.parent)
            if parent is None or txn.txn_id not in parent.children:
                raise ValueError(f"{txn.txn_id} names parent {txn.parent}, which is not "
                                 "unfinished or does not list it")
        if txn.state in DECIDING and any(
                core._unfinished[c].state in UNDECIDED for c in txn.children
                if c in core._unfinished):
            raise ValueError(f"{txn.txn_id} is decided but has an undecided child")
        if txn.idempotency_key and core._keys.get(txn.idempotency_key) is None:
            raise ValueError(f"{txn.txn_id} has key {txn.idempotency_key!r}, not indexed")
    for key in core._keys:
        txn = core._unfinished.get(TxnId(core.tc_partition, core._key_sequence(key)))
        if txn is not None and txn.idempotency_key != key:
            raise ValueError(f"key {key!r} names {txn.txn_id}, which has another key")
    for entry in core._sessions.values():
        if entry.current_txn is not None and entry.current_txn.sequence > core._last_sequence:
            raise ValueError(f"session {entry.session} names an unknown transaction")
    for name, stream in core._streams.items():
        if stream.txn_id.sequence > core._last_sequence:
            raise ValueError(f"stream {name!r} names an unknown transaction")


# ---------------------------------------------------------------------------------------
# docs/coordinator.md: the generated part (`python -m coordinator.core --write`)
# ---------------------------------------------------------------------------------------

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "coordinator.md"
DOC_BEGIN = "<!-- BEGIN GENERATED by `python -m coordinator.core --write`: do not edit -->"
DOC_END = "<!-- END GENERATED -->"


def generated_doc() -> str:
    """The state diagram and transition table, from ALLOWED and TRANSITION_RECORDS."""
    lines = [DOC_BEGIN, "", "```mermaid", "stateDiagram-v2",
             f"    [*] --> {INITIAL_STATE.name}: Opened"]
    for (source, target), record in TRANSITION_RECORDS.items():
        lines.append(f"    {source.name} --> {target.name}: {record}")
    lines += [f"    {state.name} --> [*]" for state in State if not ALLOWED[state]]
    lines += ["```", "", "| from | allowed next states | by record |", "| --- | --- | --- |"]
    for state in State:
        targets = sorted(ALLOWED[state], key=lambda s: s.value)
        by = ", ".join(f"`{TRANSITION_RECORDS[(state, t)]}`" for t in targets)
        lines.append(f"| {state.name} | {', '.join(t.name for t in targets) or '(final)'} "
                     f"| {by or '—'} |")
    lines += ["", "In place (no state change): `Registered` and `DeadlineReset` on OPEN. "
              "Anything else raises `IllegalTransition` and changes nothing.", "", DOC_END]
    return "\n".join(lines)


def splice_doc(text: str) -> str:
    """`text` with its generated part replaced by generated_doc()."""
    begin, end = text.index(DOC_BEGIN), text.index(DOC_END) + len(DOC_END)
    return text[:begin] + generated_doc() + text[end:]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m coordinator.core",
                                     description="Print (or --write into docs/coordinator.md)"
                                                 " the TC state diagram.")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.write:
        DOC_PATH.write_text(splice_doc(DOC_PATH.read_text()))
    else:
        print(generated_doc())


if __name__ == "__main__":
    main()
