"""The transaction buffer of one partition: a pure state machine (no I/O, no clock).

It knows the transactions that have data on the partition and no marker yet (open),
the transactions this partition aborted (the aborted-transaction index read_committed
fetches filter with), the last committed ones, and the highest coordinator epoch of every
TC partition whose marker it wrote. It answers max_read_position (the last stable offset)
and which aborted transactions overlap a fetched range. docs/transaction-buffer.md has
the design rationale and the snapshot format.

Contract with the partition owner (one task owns the partition; per batch, in log order,
with nothing of the same partition in between — the same order as producer_state.py):

    transactional data batch:
        buffer.check_write(txn, pid, epoch)             # may raise; changes nothing
        append the batch at offsets first..last (log append time now_ms), then
        buffer.on_data(txn, pid, epoch, first, last, now_ms)
    marker (EndTxnOnPartition, one target partition):
        plan = buffer.check_marker(txn, decision, coordinator_epoch)   # may raise
        if plan.action is WRITE: append encode_control_batch(decision, txn=txn,
                 coordinator_epoch=..., producer_id=plan.producer_id,
                 producer_epoch=plan.producer_epoch) at offset M, then
                 buffer.on_marker(txn, decision, coordinator_epoch, M); answer M
        if NOOP: append nothing; answer marker_offset -1, already_ended =
                 plan.already_ended, but only once the log is durable past
                 plan.marker_offset (a repeated marker may race its first one's fsync)
    after every fsync:        buffer.on_durable(high_watermark)
    retention/DeleteRecords:  buffer.forget_below(new_log_start_offset) after the deletion;
                              never move the log start past max_read_position(hw) (see
                              below), so no open transaction loses data
    recovery:  restore(snapshot) (SnapshotCorrupt → start from TxnBuffer()), then
               apply_batch(header, marker) for every batch from max(covered_offset, log
               start) to the log end, in log order (decode only control batches:
               decode_control_batch), then forget_below(log start) — after the tail, so
               that a transaction the snapshot shows open ends by its marker in the tail,
               and one whose marker went with deleted segments is dropped — then
               on_durable(log end).

- `check_*` change no decision-relevant state (only counters). If an append fails, do not
  call `on_*`. `on_*` run right after the append, before the fsync, so the buffer is
  authoritative for pipelined batches. If a write or fsync fails the buffer is ahead of
  the log: discard it and recover (restore + replay); never patch it by hand.
- Replay calls only `apply_batch`, once per batch in log order; it never refuses (the log
  is the truth). A data batch of a transaction this buffer had ended (possible only in a
  log written under other rules) reopens it and counts in `anomalies_total`.
- A transaction that ended stays below max_read_position until the high watermark passes
  its marker (`on_durable`), as Kafka's "unreplicated" transactions: max_read_position
  never moves past data whose marker a crash could still lose, so it never goes back.

Rules:
- max_read_position(hw) = min(hw, first offset of the oldest open transaction, first
  offsets of ended transactions whose marker is at or above hw).
- check_write: a transaction ended here (still remembered) → TRANSACTION_NOT_OPEN (a late
  retry after the marker); a new one when max_open_transactions are open →
  RESOURCE_EXHAUSTED. Transactions are tracked by id only: several producers, or a newer
  producer epoch, may write to an open one (fencing is the coordinator's job).
- check_marker: coordinator epoch below the highest one of a marker written here for that
  TC partition → STALE_COORDINATOR_EPOCH. Open here → WRITE. Ended here with the same
  decision, or never seen → NOOP (already_ended says which). Ended here with the other
  decision → TRANSACTION_ABORTED / TRANSACTION_ALREADY_COMMITTED (a coordinator bug: fail
  closed). Only written markers raise the remembered epoch: a NOOP leaves no trace in the
  log, so a replay could not reproduce it (the server-wide CoordinatorEpochs fences those).
- The aborted index keeps, sorted by marker offset, AbortedTxn(txn, producer, first_offset,
  marker_offset, last_stable_offset) — the last as in Kafka's .txnindex: the first offset of
  the oldest transaction still open right after the marker, which bounds the scan of
  `aborted_in`. At most max_aborted_transactions entries: beyond, the oldest is evicted and
  `aborted_index_start` rises past its marker; `aborted_in` then refuses ranges starting
  below it (OFFSET_OUT_OF_RANGE): writers are never held up by old history, and no
  read_committed fetch is ever served with an incomplete abort set.
- The last max_remembered_commits committed transactions are remembered (late writes and
  repeated markers are recognised); older ones are only known to the coordinator.
- forget_below(L) drops aborted and committed entries whose marker is below L, and open
  transactions whose data lies entirely below L. Epochs are kept (a handful, one per TC
  partition). The owner caps retention at max_read_position, so a transaction still open
  never loses data: an "open" one entirely below L is one a restored snapshot older than
  L still shows open although its marker was in the deleted part (were the cap broken, it
  has no data left to hide, and a later marker for it is a NOOP). An open transaction
  with data on both sides of L (cap broken) is kept: max_read_position stays at its first
  offset, below the log start, which is safe (read_committed reads nothing past it).

Equivalences (tests/test_txn_buffer.py checks them after every step of a state machine):
snapshot + replay of the tail equals the live buffer exactly (`state()`). A full replay
from the log start L equals it too, except where retention cut through a transaction:
an aborted transaction whose data begins below L shows its first batch still in the log
(or an empty range at its marker) and a different last_stable_offset — the same batches
are filtered — and coordinator epochs of markers below L exist only in snapshots.
"""

from __future__ import annotations

import bisect
import enum
import struct
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from partition_server.record_batch import (BatchHeader, ControlMarker, ControlType, TxnId,
                                            txn_key, txn_key_of)
from partition_server.snapshot_files import (SnapshotCorrupt, SnapshotFileNames, seal,
                                              unseal)
from services.errors import AtomlogError

PRODUCER_ID_MAX = (1 << 63) - 1
PRODUCER_EPOCH_MAX = (1 << 32) - 1
TC_PARTITION_MAX = (1 << 32) - 1
TXN_SEQUENCE_MAX = (1 << 64) - 1
COORDINATOR_EPOCH_MAX = (1 << 64) - 1
OFFSET_MAX = (1 << 63) - 1

# One open transaction per producer at a time is the Kafka pattern, so the same bound as
# the producer table (partition.max_producers, 10,000) keeps the open table in scale.
DEFAULT_MAX_OPEN_TRANSACTIONS = 10_000
# 49 bytes of row each, plus its lookup entry: 100,000 aborts are ~10 MB per partition.
DEFAULT_MAX_ABORTED_TRANSACTIONS = 100_000
# Recognising late writes/repeated markers after a commit is defence in depth (the
# coordinator's verification is the rule); 10,000 covers minutes at the benchmark rate.
DEFAULT_MAX_REMEMBERED_COMMITS = 10_000

LIMIT_OPEN = "partition.max_open_transactions"
LIMIT_ABORTED = "partition.max_aborted_transactions"
LIMIT_COMMITS = "partition.max_remembered_commits"


@dataclass(frozen=True, slots=True)
class TxnBufferLimits:
    max_open_transactions: int = DEFAULT_MAX_OPEN_TRANSACTIONS
    max_aborted_transactions: int = DEFAULT_MAX_ABORTED_TRANSACTIONS
    max_remembered_commits: int = DEFAULT_MAX_REMEMBERED_COMMITS

    def __post_init__(self) -> None:
        assert self.max_open_transactions >= 1, self
        assert self.max_aborted_transactions >= 1, self
        assert self.max_remembered_commits >= 0, self


# ---------------------------------------------------------------------------------------
# Value objects
# ---------------------------------------------------------------------------------------

class OpenTxn(NamedTuple):
    """A transaction with data here and no marker yet (`describe`, `oldest_open`)."""

    txn: TxnId
    producer_id: int  # of its first batch here
    producer_epoch: int
    first_offset: int
    last_offset: int  # last record of its last batch here
    first_timestamp_ms: int  # log append time of its first batch here


class AbortedTxn(NamedTuple):
    """An entry of the aborted-transaction index. Its data lies in [first_offset,
    marker_offset); last_stable_offset is the first offset of the oldest transaction open
    right after the marker (marker_offset + 1 when none)."""

    txn: TxnId
    producer_id: int
    producer_epoch: int
    first_offset: int
    marker_offset: int
    last_stable_offset: int


class MarkerAction(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: no Python-level hash of the name

    WRITE = "write"  # append a control batch, then on_marker
    NOOP = "noop"    # nothing to write: not open here


@dataclass(frozen=True, slots=True)
class MarkerPlan:
    action: MarkerAction
    already_ended: bool = False  # NOOP: ended here before (a repeated marker)
    marker_offset: int = -1      # NOOP + already_ended: the earlier marker (wait for it)
    producer_id: int = 0         # WRITE: to put in the control batch header
    producer_epoch: int = 0


@dataclass(frozen=True, slots=True)
class TxnBufferMetrics:
    """Counters since the buffer was built (the shell exports them as `*_total`)."""

    markers_written_total: int = 0
    markers_noop_total: int = 0
    stale_markers_total: int = 0
    conflicting_markers_total: int = 0  # COMMIT after ABORT here, or the reverse
    late_writes_total: int = 0          # writes refused: the transaction ended here
    exhausted_total: int = 0            # new transactions refused: table full
    aborted_evicted_total: int = 0      # aborted entries dropped at the bound
    anomalies_total: int = 0            # replayed data of a transaction that had ended
    open_dropped_total: int = 0         # open transactions whose data all went below the
                                        # log start (forget_below)


class _Open:
    """Mutable twin of OpenTxn (one update per batch, no allocation)."""

    __slots__ = ("first_offset", "first_timestamp_ms", "last_offset", "producer_epoch",
                 "producer_id")

    def __init__(self, producer_id: int, producer_epoch: int, first_offset: int,
                 last_offset: int, first_timestamp_ms: int) -> None:
        self.producer_id = producer_id
        self.producer_epoch = producer_epoch
        self.first_offset = first_offset
        self.last_offset = last_offset
        self.first_timestamp_ms = first_timestamp_ms

    def public(self, txn: TxnId) -> OpenTxn:
        return OpenTxn(txn, self.producer_id, self.producer_epoch, self.first_offset,
                       self.last_offset, self.first_timestamp_ms)


class TxnBufferState(NamedTuple):
    """Everything decision-relevant and durable: what snapshots keep and tests compare."""

    log_start_offset: int
    aborted_evicted_below: int
    epochs: tuple[tuple[int, int], ...]
    open: tuple[OpenTxn, ...]
    aborted: tuple[tuple[AbortedTxn, bool], ...]  # (entry, still the txn's lookup entry)
    committed: tuple[tuple[TxnId, int], ...]


# ---------------------------------------------------------------------------------------
# The buffer
# ---------------------------------------------------------------------------------------

class TxnBuffer:
    """Transaction buffer of ONE partition. Single-threaded: only its owner calls it."""

    def __init__(self, limits: TxnBufferLimits | None = None) -> None:
        self.limits = limits or TxnBufferLimits()
        self._open: OrderedDict[TxnId, _Open] = OrderedDict()  # by first offset
        # The aborted index holds up to max_aborted_transactions (100,000) entries for
        # long. Kept as objects (AbortedTxn tuples, a dict of TxnIds) the garbage collector
        # scanned them all at each full collection, the event loop held, and a snapshot
        # packed them all (540 ms at 100,000). So each entry is its snapshot row, written
        # once: rows back to back in a bytearray (its indexed flag, the last byte, kept
        # current), the marker offsets in an array beside them (bisect), the lookup a dict
        # of ints; none of these holds an object the collector tracks. Entries from
        # _aborted_head on, by marker offset.
        self._aborted_rows = bytearray()
        self._aborted_markers = array("q")
        self._aborted_head = 0
        self._aborted_lookup: dict[int, int] = {}  # txn_key -> marker offset of its entry
        # The remembered commits, kept alike: rows from _committed_head on, by marker
        # offset (each row holds its marker offset: no bisect here, so no array of them),
        # and the lookup. A commit forgotten out of order (its transaction ended again:
        # replayed anomalies) leaves a dead row, skipped by the snapshot and dropped when
        # it is the oldest; a row is live while the lookup gives its marker offset.
        self._committed_rows = bytearray()
        self._committed_head = 0
        self._committed: dict[int, int] = {}  # txn_key -> marker offset
        self._committed_dead = 0
        self._epochs: dict[int, int] = {}  # TC partition -> highest written marker epoch
        # Ended, marker not yet durable: (marker_offset, first_offset), by marker offset.
        self._unreplicated: list[tuple[int, int]] = []
        self._log_start_offset = 0
        self._aborted_evicted_below = 0  # every evicted entry's marker is below this
        self._last_applied_offset = -1
        self._changes = 0
        self._counters = dict.fromkeys(TxnBufferMetrics.__dataclass_fields__, 0)

    # -- observability ------------------------------------------------------------------

    @property
    def changes(self) -> int:
        """State changes since construction: the owner snapshots every N of them."""
        return self._changes

    @property
    def metrics(self) -> TxnBufferMetrics:
        return TxnBufferMetrics(**self._counters)

    @property
    def last_applied_offset(self) -> int:
        """Last offset covered by on_*/apply_batch (or the restored snapshot); -1: none."""
        return self._last_applied_offset

    @property
    def log_start_offset(self) -> int:
        return self._log_start_offset

    @property
    def open_count(self) -> int:
        return len(self._open)

    @property
    def aborted_count(self) -> int:
        return len(self._aborted_markers) - self._aborted_head

    @property
    def aborted_index_start(self) -> int:
        """`aborted_in` answers exactly for ranges starting at or above this offset."""
        return max(self._log_start_offset, self._aborted_evicted_below)

    def oldest_open(self) -> OpenTxn | None:
        """The open transaction holding max_read_position down (lag = hw - its first
        offset in records, now - first_timestamp_ms in time)."""
        for txn, entry in self._open.items():
            return entry.public(txn)
        return None

    def describe(self) -> list[OpenTxn]:
        """Every open transaction, oldest first (`atomlog partition describe`)."""
        return [entry.public(txn) for txn, entry in self._open.items()]

    def count_older_than(self, now_ms: int, age_ms: int) -> int:
        """Open transactions whose first batch is more than age_ms old (late ones). Append
        times never decrease, so this stops at the first young one."""
        count = 0
        for entry in self._open.values():
            if now_ms - entry.first_timestamp_ms <= age_ms:
                break
            count += 1
        return count

    def coordinator_epochs(self) -> Mapping[int, int]:
        """Highest coordinator epoch per TC partition among the markers written here
        (seed the server-wide CoordinatorEpochs with it after recovery)."""
        return MappingProxyType(self._epochs)

    def open_transaction(self, txn: TxnId) -> OpenTxn | None:
        entry = self._open.get(txn)
        return entry.public(txn) if entry else None

    def ended(self, txn: TxnId) -> tuple[ControlType, int] | None:
        """(decision, marker offset) of a transaction ended here and remembered (every
        abort still in the aborted index, the last max_remembered_commits commits)."""
        key = txn_key(txn)
        marker_offset = self._aborted_lookup.get(key)
        if marker_offset is not None:
            return ControlType.ABORT, marker_offset
        marker_offset = self._committed.get(key)
        if marker_offset is not None:
            return ControlType.COMMIT, marker_offset
        return None

    def state(self) -> TxnBufferState:
        rows = self._aborted_rows
        aborted = tuple((self._aborted_entry(index), rows[(index + 1) * _ABORTED.size - 1] == 1)
                        for index in range(self._aborted_head, len(self._aborted_markers)))
        return TxnBufferState(self._log_start_offset, self._aborted_evicted_below,
                              tuple(sorted(self._epochs.items())), tuple(self.describe()),
                              aborted, tuple(
                                  (TxnId(tc, sequence), marker_offset)
                                  for tc, sequence, marker_offset in map(
                                      self._commit_at, self._live_commits())))

    # -- reads --------------------------------------------------------------------------

    def max_read_position(self, high_watermark: int) -> int:
        """The last stable offset: read_committed readers get nothing at or above it."""
        position = high_watermark
        for entry in self._open.values():
            position = min(position, entry.first_offset)
            break
        for marker_offset, first_offset in self._unreplicated:
            if marker_offset >= high_watermark:
                position = min(position, first_offset)
        return position

    def aborted_in(self, start: int, end: int) -> list[AbortedTxn]:
        """The aborted transactions whose data range [first_offset, marker_offset)
        overlaps [start, end), by marker offset: every aborted transaction with a batch
        in the range is among them. Raises OFFSET_OUT_OF_RANGE when start is below
        aborted_index_start (entries were evicted or retained away)."""
        assert 0 <= start <= end, (start, end)
        if start < self.aborted_index_start:
            raise AtomlogError(
                "OFFSET_OUT_OF_RANGE",
                f"read_committed from offset {start}: the aborted-transaction index of this "
                f"partition starts at {self.aborted_index_start} ({LIMIT_ABORTED}="
                f"{self.limits.max_aborted_transactions} entries, or retention)",
                {"aborted_index_start": self.aborted_index_start, "limit": LIMIT_ABORTED})
        result = []
        first = bisect.bisect_right(self._aborted_markers, start, lo=self._aborted_head)
        for index in range(first, len(self._aborted_markers)):
            entry = self._aborted_entry(index)
            if entry.marker_offset <= end:
                result.append(entry)
                continue
            if entry.first_offset < end:
                result.append(entry)
            if entry.last_stable_offset >= end:
                break  # every later abort began at or after end (see the module doc)
        return result

    # -- decisions ----------------------------------------------------------------------

    def check_write(self, txn: TxnId, producer_id: int, producer_epoch: int) -> None:
        """Before appending a transactional data batch. Raises TRANSACTION_NOT_OPEN for a
        transaction that ended here, RESOURCE_EXHAUSTED for a new one when the table is
        full, INVALID_ARGUMENT for fields out of range. Changes nothing but counters."""
        _validate_txn(txn)
        _validate_producer(producer_id, producer_epoch)
        if txn in self._open:
            return
        ended = self.ended(txn)
        if ended is not None:
            decision, marker_offset = ended
            self._count("late_writes_total")
            raise AtomlogError(
                "TRANSACTION_NOT_OPEN",
                f"transaction {_name(txn)} was {_past(decision)} on this partition (marker at "
                f"offset {marker_offset}); it takes no more writes",
                {"txn_id": _name(txn), "marker_offset": marker_offset})
        if len(self._open) >= self.limits.max_open_transactions:
            self._count("exhausted_total")
            raise AtomlogError(
                "RESOURCE_EXHAUSTED",
                f"partition has {len(self._open)} open transactions, the limit {LIMIT_OPEN}="
                f"{self.limits.max_open_transactions}: transaction {_name(txn)} cannot start "
                "here until one ends",
                {"limit": LIMIT_OPEN, "max_open_transactions": self.limits.max_open_transactions})

    def check_marker(self, txn: TxnId, decision: ControlType,
                     coordinator_epoch: int) -> MarkerPlan:
        """Before writing a marker: WRITE or NOOP. Raises STALE_COORDINATOR_EPOCH, or
        TRANSACTION_ABORTED / TRANSACTION_ALREADY_COMMITTED for the opposite decision of
        one already applied here. Changes nothing but counters."""
        entry = self._open.get(txn)
        if entry is not None and type(decision) is ControlType and \
                self._epochs.get(txn[0], 0) <= coordinator_epoch <= COORDINATOR_EPOCH_MAX:
            # The usual case, first: open here (so a valid id), the epoch current.
            return MarkerPlan(MarkerAction.WRITE, False, -1, entry.producer_id,
                              entry.producer_epoch)
        _validate_txn(txn)
        decision = ControlType(decision)
        assert 0 <= coordinator_epoch <= COORDINATOR_EPOCH_MAX, coordinator_epoch
        current = self._epochs.get(txn.tc_partition, 0)
        if coordinator_epoch < current:
            self._count("stale_markers_total")
            raise AtomlogError(
                "STALE_COORDINATOR_EPOCH",
                f"marker for {_name(txn)} has coordinator epoch {coordinator_epoch}; this "
                f"partition wrote a marker of TC partition {txn.tc_partition} with epoch "
                f"{current}",
                {"tc_partition": txn.tc_partition, "coordinator_epoch": coordinator_epoch,
                 "current_epoch": current})
        entry = self._open.get(txn)
        if entry is not None:
            return MarkerPlan(MarkerAction.WRITE, producer_id=entry.producer_id,
                              producer_epoch=entry.producer_epoch)
        ended = self.ended(txn)
        if ended is not None and ended[0] is not decision:
            self._count("conflicting_markers_total")
            reason = ("TRANSACTION_ABORTED" if ended[0] is ControlType.ABORT
                      else "TRANSACTION_ALREADY_COMMITTED")
            raise AtomlogError(
                reason,
                f"{decision.name} marker for {_name(txn)}, which this partition "
                f"{_past(ended[0])} (marker at offset {ended[1]})",
                {"txn_id": _name(txn), "marker_offset": ended[1]})
        self._count("markers_noop_total")
        if ended is None:
            return MarkerPlan(MarkerAction.NOOP)
        return MarkerPlan(MarkerAction.NOOP, already_ended=True, marker_offset=ended[1])

    # -- transitions (live) -------------------------------------------------------------

    def on_data(self, txn: TxnId, producer_id: int, producer_epoch: int, first_offset: int,
                last_offset: int, timestamp_ms: int) -> None:
        """After a transactional data batch is in the log (check_write passed)."""
        assert txn in self._open or self.ended(txn) is None, txn
        self._advance(first_offset, last_offset)
        self._record_data(txn, producer_id, producer_epoch, first_offset, last_offset,
                          timestamp_ms)

    def on_marker(self, txn: TxnId, decision: ControlType, coordinator_epoch: int,
                  marker_offset: int) -> None:
        """After the control batch of a WRITE plan is in the log at marker_offset."""
        entry = self._open.get(txn)
        assert entry is not None, txn
        assert coordinator_epoch >= self._epochs.get(txn.tc_partition, 0), coordinator_epoch
        self._advance(marker_offset, marker_offset)
        self._counters["markers_written_total"] += 1
        self._end(txn, decision if type(decision) is ControlType else ControlType(decision),
                  coordinator_epoch, marker_offset, entry.producer_id, entry.producer_epoch,
                  entry)

    def on_durable(self, high_watermark: int) -> None:
        """After an fsync: ended transactions whose marker is below high_watermark stop
        holding max_read_position."""
        if self._unreplicated and self._unreplicated[0][0] < high_watermark:
            self._unreplicated = [item for item in self._unreplicated
                                  if item[0] >= high_watermark]

    def forget_below(self, log_start_offset: int) -> None:
        """After retention or DeleteRecords moved the log start: forget what ended below."""
        if log_start_offset <= self._log_start_offset:
            return
        self._log_start_offset = log_start_offset
        self._changes += 1
        while (self._aborted_head < len(self._aborted_markers)
               and self._aborted_markers[self._aborted_head] < log_start_offset):
            self._drop_oldest_aborted()
        self._compact_aborted()
        while (self._committed_head < self._committed_count()
               and self._commit_at(self._committed_head)[2] < log_start_offset):
            self._drop_oldest_commit()
        self._compact_commits()
        gone = [txn for txn, entry in self._open.items() if entry.last_offset < log_start_offset]
        for txn in gone:  # all its data is gone: it ended (see the module doc)
            del self._open[txn]
        self._count("open_dropped_total", len(gone))

    # -- replay -------------------------------------------------------------------------

    def apply_batch(self, header: BatchHeader, marker: ControlMarker | None = None) -> None:
        """Replay one batch of the log (any batch; control batches need their decoded
        marker). The same transitions as on_data/on_marker; never refuses."""
        self._advance(header.base_offset, header.last_offset)
        txn = header.txn
        if txn is None or not header.is_transactional:
            return
        if header.is_control:
            assert marker is not None, "a control batch needs its decoded marker"
            entry = self._open.get(txn)
            producer = ((entry.producer_id, entry.producer_epoch) if entry
                        else (header.producer_id, header.producer_epoch))
            self._end(txn, marker.type, marker.coordinator_epoch, header.base_offset, *producer)
            return
        if txn not in self._open and self.ended(txn) is not None:
            self._count("anomalies_total")
            self._unindex_aborted(txn)
            self._forget_commit(txn_key(txn))
        self._record_data(txn, header.producer_id, header.producer_epoch, header.base_offset,
                          header.last_offset, header.log_append_time_ms)

    # -- snapshots ----------------------------------------------------------------------

    def snapshot(self, covered_offset: int) -> bytes:
        """Encode the durable state; covered_offset is where replay resumes (exclusive).
        Take it only when everything applied is durable (hw >= covered_offset)."""
        assert covered_offset > self._last_applied_offset, (covered_offset,
                                                            self._last_applied_offset)
        return _encode(covered_offset, self._log_start_offset, self._aborted_evicted_below,
                       sorted(self._epochs.items()), self.describe(), self.aborted_count,
                       self._aborted_rows[self._aborted_head * _ABORTED.size:],
                       len(self._committed), self._committed_rows_bytes())

    @classmethod
    def restore(cls, data: bytes, limits: TxnBufferLimits | None = None
                ) -> tuple[TxnBuffer, int]:
        """(buffer, covered_offset) from a snapshot. Raises SnapshotCorrupt: then rebuild
        by full replay, never guess. Limits lower than the snapshot's contents evict the
        oldest aborted/committed entries as live operation would have."""
        covered_offset, state = decode_snapshot(data)
        buffer = cls(limits)
        buffer._log_start_offset = state.log_start_offset
        buffer._aborted_evicted_below = state.aborted_evicted_below
        buffer._epochs = dict(state.epochs)
        for item in state.open:
            buffer._open[item.txn] = _Open(*item[1:])
        for entry, indexed in state.aborted:
            buffer._aborted_rows += _aborted_row(entry, indexed)
            buffer._aborted_markers.append(entry.marker_offset)
            if indexed:
                buffer._aborted_lookup[txn_key(entry.txn)] = entry.marker_offset
        for txn, marker_offset in state.committed:
            buffer._remember_commit(txn, marker_offset)
        buffer._enforce_bounds()
        buffer._last_applied_offset = covered_offset - 1
        return buffer, covered_offset

    # -- helpers ------------------------------------------------------------------------

    def _advance(self, first_offset: int, last_offset: int) -> None:
        assert 0 <= first_offset <= last_offset <= OFFSET_MAX, (first_offset, last_offset)
        assert first_offset > self._last_applied_offset, (first_offset,
                                                          self._last_applied_offset)
        self._last_applied_offset = last_offset

    def _record_data(self, txn: TxnId, producer_id: int, producer_epoch: int,
                     first_offset: int, last_offset: int, timestamp_ms: int) -> None:
        self._changes += 1
        entry = self._open.get(txn)
        if entry is None:
            self._open[txn] = _Open(producer_id, producer_epoch, first_offset, last_offset,
                                    timestamp_ms)
        else:
            entry.last_offset = last_offset

    def _end(self, txn: TxnId, decision: ControlType, coordinator_epoch: int,
             marker_offset: int, producer_id: int, producer_epoch: int,
             entry: _Open | None = None) -> None:
        """`entry`: the caller's lookup of txn in the open table (None: looked up here)."""
        self._changes += 1
        tc = txn[0]
        current = self._epochs.get(tc)
        if current is None or coordinator_epoch > current:
            self._epochs[tc] = coordinator_epoch
        entry = self._open.pop(txn, None) if entry is None else self._open.pop(txn)
        first_offset = entry.first_offset if entry else marker_offset  # data retained away
        if entry is not None:
            self._unreplicated.append((marker_offset, first_offset))
        key = txn_key(txn)
        self._forget_commit(key)
        if self._aborted_lookup:  # (empty while nothing aborted here)
            self._unindex_aborted(txn)
        if decision is ControlType.COMMIT:
            self._remember_commit(txn, marker_offset)
        else:
            oldest = self.oldest_open()
            lso = oldest.first_offset if oldest else marker_offset + 1
            aborted = AbortedTxn(txn, producer_id, producer_epoch, first_offset,
                                 marker_offset, lso)
            self._aborted_rows += _aborted_row(aborted, True)
            self._aborted_markers.append(marker_offset)
            self._aborted_lookup[key] = marker_offset
        self._enforce_bounds()

    def _enforce_bounds(self) -> None:
        """Drop what is past the bounds and compact the rows, after each transaction
        ends; each compaction is called only when its own condition can hold (a dead
        row, or a head past 64), so a transaction's end mostly costs the comparisons."""
        limits = self.limits
        while len(self._committed) > limits.max_remembered_commits:
            self._drop_oldest_commit()
        if self._committed_dead or self._committed_head > 64:
            self._compact_commits()
        while self.aborted_count > limits.max_aborted_transactions:
            evicted_marker = self._drop_oldest_aborted()
            self._aborted_evicted_below = max(self._aborted_evicted_below, evicted_marker + 1)
            self._count("aborted_evicted_total")
        if self._aborted_head > 64:
            self._compact_aborted()

    def _remember_commit(self, txn: TxnId, marker_offset: int) -> None:
        self._committed_rows += _committed_row(txn, marker_offset)
        self._committed[txn_key(txn)] = marker_offset

    def _forget_commit(self, key: int) -> None:
        """Forget a commit out of order: its row stays, dead."""
        if self._committed.pop(key, None) is not None:
            self._committed_dead += 1

    def _committed_count(self) -> int:
        """Rows held, dead ones and those before _committed_head included."""
        return len(self._committed_rows) // _COMMITTED.size

    def _commit_at(self, index: int) -> tuple[int, int, int]:
        """(tc partition, sequence, marker offset) of the row at `index`."""
        return _COMMITTED.unpack_from(self._committed_rows, index * _COMMITTED.size)

    def _commit_is_live(self, index: int) -> bool:
        tc, sequence, marker_offset = self._commit_at(index)
        return self._committed.get(txn_key_of(tc, sequence)) == marker_offset

    def _drop_oldest_commit(self) -> None:
        index = self._committed_head
        self._committed_head += 1
        if self._commit_is_live(index):
            tc, sequence, _ = self._commit_at(index)
            del self._committed[txn_key_of(tc, sequence)]
        else:
            self._committed_dead -= 1

    def _live_commits(self) -> range | list[int]:
        """Indexes of the live rows, oldest first."""
        indexes = range(self._committed_head, self._committed_count())
        if not self._committed_dead:
            return indexes
        return [index for index in indexes if self._commit_is_live(index)]

    def _committed_rows_bytes(self) -> bytes | bytearray:
        """The live rows back to back."""
        size = _COMMITTED.size
        if not self._committed_dead:
            return self._committed_rows[self._committed_head * size:]
        rows = self._committed_rows
        return b"".join([rows[index * size:(index + 1) * size]
                         for index in self._live_commits()])

    def _compact_commits(self) -> None:
        head = self._committed_head
        if self._committed_dead > len(self._committed) + 64:  # mostly dead: keep the live
            self._committed_rows = bytearray(self._committed_rows_bytes())
            self._committed_head = self._committed_dead = 0
        elif head > 64 and head * 2 > self._committed_count():
            del self._committed_rows[:head * _COMMITTED.size]
            self._committed_head = 0

    def _aborted_entry(self, index: int) -> AbortedTxn:
        tc, sequence, *fields, _ = _ABORTED.unpack_from(self._aborted_rows,
                                                         index * _ABORTED.size)
        return AbortedTxn(TxnId(tc, sequence), *fields)

    def _drop_oldest_aborted(self) -> int:
        """Drop the oldest entry of the aborted index; its marker offset."""
        index = self._aborted_head
        self._aborted_head += 1
        marker_offset = self._aborted_markers[index]
        key = txn_key_of(*_ABORTED_TXN.unpack_from(self._aborted_rows, index * _ABORTED.size))
        if self._aborted_lookup.get(key) == marker_offset:
            del self._aborted_lookup[key]
        return marker_offset

    def _unindex_aborted(self, txn: TxnId) -> None:
        """The txn's aborted entry (if any) stays in the index for its range but is no
        longer the one its id finds: its snapshot row's indexed flag goes to 0."""
        marker_offset = self._aborted_lookup.pop(txn_key(txn), None)
        if marker_offset is not None:
            index = bisect.bisect_left(self._aborted_markers, marker_offset,
                                       lo=self._aborted_head)
            assert self._aborted_markers[index] == marker_offset, (txn, index)
            self._aborted_rows[(index + 1) * _ABORTED.size - 1] = 0

    def _compact_aborted(self) -> None:
        head = self._aborted_head
        if head > 64 and head * 2 > len(self._aborted_markers):
            del self._aborted_markers[:head]
            del self._aborted_rows[:head * _ABORTED.size]
            self._aborted_head = 0

    def _count(self, counter: str, amount: int = 1) -> None:
        self._counters[counter] += amount


def _name(txn: TxnId) -> str:
    return f"({txn.tc_partition}, {txn.sequence})"


def _past(decision: ControlType) -> str:
    return "committed" if decision is ControlType.COMMIT else "aborted"


def _validate_txn(txn: TxnId) -> None:
    tc, sequence = txn
    if not (0 <= tc <= TC_PARTITION_MAX and 0 <= sequence <= TXN_SEQUENCE_MAX) or (
            tc, sequence) == (0, 0):
        raise AtomlogError("INVALID_ARGUMENT", f"transaction id ({tc}, {sequence}) is not a "
                           "valid transaction", {"field": "txn_id"})


def _validate_producer(producer_id: int, producer_epoch: int) -> None:
    if not 0 <= producer_id <= PRODUCER_ID_MAX:
        raise AtomlogError("INVALID_ARGUMENT", f"producer_id {producer_id} is out of range",
                           {"field": "producer_id"})
    if not 0 <= producer_epoch <= PRODUCER_EPOCH_MAX:
        raise AtomlogError("INVALID_ARGUMENT", f"producer_epoch {producer_epoch} is out of "
                           "range", {"field": "producer_epoch"})


# ---------------------------------------------------------------------------------------
# Snapshot format (version 1), little-endian:
#   header    magic "ALTB", version u16, reserved u16 (0), covered_offset i64,
#             log_start_offset i64, aborted_evicted_below i64,
#             epoch count u32, open count u32, aborted count u32, committed count u32
#   epoch     tc_partition u32, coordinator_epoch u64               (ascending tc)
#   open      tc u32, sequence u64, producer_id i64, producer_epoch u32,
#             first_offset i64, last_offset i64, first_timestamp_ms i64  (by first_offset)
#   aborted   tc u32, sequence u64, producer_id i64, producer_epoch u32, first_offset i64,
#             marker_offset i64, last_stable_offset i64, indexed u8   (by marker_offset)
#   committed tc u32, sequence u64, marker_offset i64                 (by marker_offset)
#   trailer   CRC32C (Castagnoli) u32 of every byte before it
# ---------------------------------------------------------------------------------------

SNAPSHOT_MAGIC = b"ALTB"
SNAPSHOT_VERSION = 1
_HEADER = struct.Struct("<4sHHqqqIIII")
_EPOCH = struct.Struct("<IQ")
_OPEN = struct.Struct("<IQqIqqq")
_ABORTED = struct.Struct("<IQqIqqqB")
_ABORTED_TXN = struct.Struct("<IQ")  # the start of an _ABORTED row
_COMMITTED = struct.Struct("<IQq")
_FILES = SnapshotFileNames("txn_snapshot")
snapshot_file_name = _FILES.name
parse_snapshot_file_name = _FILES.parse



def encode_snapshot(covered_offset: int, state: TxnBufferState) -> bytes:
    """The snapshot of `state`, every row packed here (TxnBuffer.snapshot joins the rows
    it packed as its entries came: the same bytes, which the tests check)."""
    data = _encode(covered_offset, state.log_start_offset, state.aborted_evicted_below,
                   state.epochs, state.open, len(state.aborted),
                   b"".join([_aborted_row(entry, indexed) for entry, indexed in state.aborted]),
                   len(state.committed),
                   b"".join([_committed_row(txn, marker) for txn, marker in state.committed]))
    assert decode_snapshot(data) == (covered_offset, state)  # pair assertion
    return data


def _encode(covered_offset: int, log_start_offset: int, aborted_evicted_below: int,
            epochs, opens, aborted_count: int, aborted_rows: bytes | bytearray,
            committed_count: int, committed_rows: bytes) -> bytes:
    parts = [_HEADER.pack(SNAPSHOT_MAGIC, SNAPSHOT_VERSION, 0, covered_offset,
                          log_start_offset, aborted_evicted_below, len(epochs), len(opens),
                          aborted_count, committed_count)]
    parts.extend(_EPOCH.pack(tc, epoch) for tc, epoch in epochs)
    parts.extend(_OPEN.pack(*item.txn, *item[1:]) for item in opens)
    parts += (aborted_rows, committed_rows)
    return seal(b"".join(parts))


def _aborted_row(entry: AbortedTxn, indexed: bool) -> bytes:
    return _ABORTED.pack(*entry.txn, *entry[1:], indexed)


def _committed_row(txn: TxnId, marker_offset: int) -> bytes:
    return _COMMITTED.pack(*txn, marker_offset)


def decode_snapshot(data: bytes) -> tuple[int, TxnBufferState]:
    """(covered_offset, state) of an encoded snapshot; SnapshotCorrupt if not valid."""
    fields, body = unseal(data, _HEADER, SNAPSHOT_MAGIC, SNAPSHOT_VERSION,
                          "transaction-buffer")
    (_, _, _, covered_offset, log_start, evicted_below, epoch_count, open_count,
     aborted_count, committed_count) = fields
    sections = ((_EPOCH, epoch_count), (_OPEN, open_count), (_ABORTED, aborted_count),
                (_COMMITTED, committed_count))
    expected = _HEADER.size + sum(layout.size * count for layout, count in sections)
    if expected != len(body):
        raise SnapshotCorrupt(f"snapshot body is {len(body)} bytes; its counts say {expected}")
    rows, position = [], _HEADER.size
    for layout, count in sections:
        rows.append([layout.unpack_from(body, position + i * layout.size) for i in range(count)])
        position += layout.size * count
    state = _state_of(log_start, evicted_below, *rows)
    problem = _state_problem(covered_offset, state)
    if problem:
        raise SnapshotCorrupt(problem)
    return covered_offset, state


def _state_of(log_start: int, evicted_below: int, epochs: list, opens: list, aborted: list,
              committed: list) -> TxnBufferState:
    return TxnBufferState(
        log_start, evicted_below, tuple(epochs),
        tuple(OpenTxn(TxnId(row[0], row[1]), *row[2:]) for row in opens),
        tuple((AbortedTxn(TxnId(row[0], row[1]), *row[2:7]), row[7]) for row in aborted),
        tuple((TxnId(row[0], row[1]), row[2]) for row in committed))


def _state_problem(covered: int, state: TxnBufferState) -> str | None:
    """Check decoded values (nothing is trusted just because its CRC matched)."""
    if not 0 <= state.log_start_offset <= covered or state.aborted_evicted_below < 0:
        return "log start, covered offset or eviction bound out of range"
    tcs = [tc for tc, _ in state.epochs]
    if tcs != sorted(set(tcs)):
        return "epochs are not by unique ascending TC partition"
    txns = [item.txn for item in state.open] + [txn for txn, _ in state.committed] + [
        entry.txn for entry, indexed in state.aborted if indexed]
    if len(set(txns)) != len(txns) or TxnId(0, 0) in txns:
        return "a transaction id is invalid or in more than one table"
    if any(flag not in (0, 1) for _, flag in state.aborted):
        return "an aborted entry has an indexed flag other than 0 or 1"
    previous = -1
    for item in state.open:
        if not previous < item.first_offset <= item.last_offset < covered:
            return f"open transaction {_name(item.txn)} has offsets out of order"
        previous = item.first_offset
    for name, markers in (("aborted", [entry.marker_offset for entry, _ in state.aborted]),
                          ("committed", [offset for _, offset in state.committed])):
        if markers != sorted(set(markers)) or (markers and not 0 <= markers[0]) or (
                markers and markers[-1] >= covered):
            return f"{name} markers are not unique, ascending and below the covered offset"
    for entry, _ in state.aborted:
        if not (0 <= entry.first_offset <= entry.marker_offset
                and 0 <= entry.last_stable_offset <= entry.marker_offset + 1
                and 0 <= entry.producer_id <= PRODUCER_ID_MAX):
            return f"aborted transaction {_name(entry.txn)} has fields out of range"
    return None


__all__ = [
    "AbortedTxn", "MarkerAction", "MarkerPlan", "OpenTxn", "SnapshotCorrupt", "TxnBuffer",
    "TxnBufferLimits", "TxnBufferMetrics", "TxnBufferState", "decode_snapshot",
    "encode_snapshot", "parse_snapshot_file_name", "snapshot_file_name",
]
