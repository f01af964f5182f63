"""Subscription cursor of one (subscription, partition): a pure state machine (no I/O, no
clock, no threads; time comes in as `now_ms`). docs/subscriptions.md has the design
rationale, the journal-entry and snapshot formats, and the shell's call order per RPC.

Durable state (journaled, snapshotted, equal after recovery):
- the acknowledged set A: `cumulative_end` (every offset below it is acknowledged) plus
  individual ranges above it — sorted, disjoint, never touching `cumulative_end` (a range
  that reaches it is folded in: the cursor advances past it);
- pending acks per open transaction: a pending cumulative end and/or pending ranges;
- the last `max_remembered_transactions` transactions that ended on this cursor (so a
  late transactional ack, and an opposite marker, are recognised).

Volatile state (never persisted; a restart redelivers): deliveries — offsets out to a
consumer until a deadline (the ack timeout), offsets held back by a Nack delay — and the
read position: every offset below it was handed out at least once since the cursor was
loaded (or is acknowledged / pending). New messages are delivered from the read position;
a *hole* — an offset in [cumulative_end, read_position) that is not acknowledged, not
pending and not out (expired deliveries, Nacks, released consumers, aborted pending acks)
— is redelivered first, lowest offset first.

Contract with the owner (one task owns the partition and calls the cursor; nothing else):

    durable change:  entry = cursor.check_ack(...) / plan_end_txn(...).entry /
                     plan_reset(...) / plan_delete() / plan_create(...)   # may raise;
                     # changes nothing. None: nothing to write (a no-op that succeeds).
                     then in the same step, before the next check on this cursor:
                     write the entry to the journal and cursor.apply(entry)
                     (CursorStore.stage/append does both, in journal order), and answer
                     the caller only once the journal is durable past the entry. A no-op
                     is answered once the journal is durable past everything written
                     before it (it may depend on an entry not yet synced).
    retention:       cursor.forget_below(log_start_offset) after the log start moved,
                     and once after recovery (it is not journaled: it commutes with
                     every entry, and the log start is durable in the log itself).
    recovery:        restore(snapshot) (SnapshotCorrupt: an older one, never a guess),
                     then apply(entry) for every journal entry after it, in order, then
                     forget_below(log start). The result equals the live durable state.

- `apply` never refuses (the journal is the truth): it re-establishes the invariants
  (entries written under these rules never need that; `anomalies_total` counts it).
- If a journal write or fsync fails, the cursor is ahead of the disk: discard it and
  recover (CursorStore.open); never patch it by hand.

Rules (each refusal raises AtomlogError and changes nothing):
- An ack at or above `limit` (the offset end the owner allows acks below: the partition's
  max read position) → OFFSET_OUT_OF_RANGE; malformed ranges → INVALID_ARGUMENT.
- Non-transactional ack: the offsets it newly acknowledges ("claim" = requested minus A)
  must not be pending in any open transaction → TRANSACTION_CONFLICT. Acknowledging
  acknowledged offsets (or a cumulative end at or below the cursor) succeeds as a no-op.
- Transactional ack (txn T): T ended here (remembered) → TRANSACTION_NOT_OPEN (a late
  ack that raced its marker). Any requested offset already acknowledged, or a cumulative
  end at or below `cumulative_end` → TRANSACTION_CONFLICT: the message was consumed
  already, so committing T would process it twice (Pulsar's rule; exactly-once needs it).
  Offsets pending in another open transaction → TRANSACTION_CONFLICT; a pending
  cumulative end claims every unacknowledged offset in [cumulative_end, end), so at most
  one transaction holds one at a time. A repeat of T's own pending acks is a no-op.
- Bounds (CursorLimits): individual ranges plus pending ranges ≤ max_ranges (an ack that
  would grow the table past it → RESOURCE_EXHAUSTED, retriable: acks that fill holes are
  always taken, and new deliveries stop while the table is full); open transactions with
  pending acks ≤ max_pending_transactions (RESOURCE_EXHAUSTED for a new one); offsets out
  to consumers plus holes ≤ max_unacked_offsets (new deliveries stop; redeliveries go on).
- plan_end_txn(T, committed): pending here → TxnEnded entry (commit applies T's acks,
  abort releases them: those offsets are redeliverable at once). Remembered with the same
  decision → no entry, already_ended. Remembered with the other decision → the matching
  TRANSACTION_ABORTED / TRANSACTION_ALREADY_COMMITTED (a coordinator bug: fail closed).
  Never seen → a TxnEnded entry all the same (a tombstone): a transactional ack of T that
  raced the marker is then refused as TRANSACTION_NOT_OPEN instead of hanging forever.
- plan_reset / plan_delete with pending acks → TRANSACTION_CONFLICT.
- forget_below(L): retention deleted every offset below L, so they count as acknowledged
  (cumulative_end rises to L at least); pending acks below L are dropped.
"""

from __future__ import annotations

import enum
import struct
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from partition_server.record_batch import TxnId
from partition_server.snapshot_files import SnapshotCorrupt, seal, unseal
from services.errors import AtomlogError

OFFSET_MAX = (1 << 63) - 1
TC_PARTITION_MAX = (1 << 32) - 1
TXN_SEQUENCE_MAX = (1 << 64) - 1
MAX_CONSUMER_ID_BYTES = 256  # as transactional ids (coordinator.proto)

# Pulsar persists at most 10,000 unacknowledged ranges per cursor
# (managedLedgerMaxUnackedRangesToPersist); 16 bytes each in a snapshot.
DEFAULT_MAX_RANGES = 10_000
# Transactions with pending acks on one cursor: one per consumer in Pulsar's usage, and a
# thousand consumers per subscription partition is far beyond the usual.
DEFAULT_MAX_PENDING_TRANSACTIONS = 1_000
# Pulsar's maxUnackedMessagesPerConsumer (50,000); here per subscription partition.
DEFAULT_MAX_UNACKED_OFFSETS = 50_000
# Ended transactions remembered per cursor (late acks, repeated markers); 13 bytes each
# in a snapshot. The coordinator's verification is the rule, this is defence in depth.
DEFAULT_MAX_REMEMBERED_TRANSACTIONS = 1_000
# One journal frame must hold an Acked entry of max_ranges ranges (16 bytes each) within
# the store's frame bound (1 MiB).
MAX_RANGES_BOUND = 60_000

LIMIT_RANGES = "subscription.max_ranges"
LIMIT_PENDING = "subscription.max_pending_transactions"
LIMIT_UNACKED = "subscription.max_unacked_offsets"
LIMIT_REMEMBERED = "subscription.max_remembered_transactions"


@dataclass(frozen=True, slots=True)
class CursorLimits:
    max_ranges: int = DEFAULT_MAX_RANGES
    max_pending_transactions: int = DEFAULT_MAX_PENDING_TRANSACTIONS
    max_unacked_offsets: int = DEFAULT_MAX_UNACKED_OFFSETS
    max_remembered_transactions: int = DEFAULT_MAX_REMEMBERED_TRANSACTIONS

    def __post_init__(self) -> None:
        assert 1 <= self.max_ranges <= MAX_RANGES_BOUND, self
        assert self.max_pending_transactions >= 1, self
        assert self.max_unacked_offsets >= 1, self
        assert self.max_remembered_transactions >= 0, self


# ---------------------------------------------------------------------------------------
# Value objects
# ---------------------------------------------------------------------------------------

class OffsetRange(NamedTuple):
    """Half-open [start, end) of offsets, as OffsetRange in partition.proto."""

    start: int
    end: int


class InitialPosition(enum.IntEnum):
    """Where a new cursor starts (SubscriptionInitialPosition; UNSPECIFIED is LATEST)."""

    EARLIEST = 1
    LATEST = 2
    OFFSET = 3


def merge_ranges(ranges) -> list[OffsetRange]:
    """[start, end) ranges, sorted, with overlapping and touching ones joined."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [OffsetRange(start, end) for start, end in merged]


def resolve_initial_position(initial: InitialPosition, start_offset: int,
                             log_start_offset: int, high_watermark: int) -> int:
    """The cumulative end of a new cursor: the log start, the high watermark, or
    start_offset clamped to [log start, high watermark]."""
    assert 0 <= log_start_offset <= high_watermark, (log_start_offset, high_watermark)
    initial = InitialPosition(initial)
    if initial is InitialPosition.EARLIEST:
        return log_start_offset
    if initial is InitialPosition.LATEST:
        return high_watermark
    return min(max(start_offset, log_start_offset), high_watermark)


# Journal entries: small, immutable, validated when built (decode checks before building).

@dataclass(frozen=True, slots=True)
class Created:
    """A cursor came into being with every offset below cumulative_end acknowledged."""

    cumulative_end: int

    def __post_init__(self) -> None:
        assert 0 <= self.cumulative_end <= OFFSET_MAX, self


@dataclass(frozen=True, slots=True)
class Deleted:
    """The cursor is gone (the store forgets its name)."""


@dataclass(frozen=True, slots=True)
class Reset:
    """Seek: exactly the offsets below cumulative_end are acknowledged now."""

    cumulative_end: int

    def __post_init__(self) -> None:
        assert 0 <= self.cumulative_end <= OFFSET_MAX, self


@dataclass(frozen=True, slots=True)
class Truncated:
    """The log was cut back to log_end (an accepted data loss): nothing at or above it
    is acknowledged, pending or out any more; the offsets written there next are new
    messages."""

    log_end: int

    def __post_init__(self) -> None:
        assert 0 <= self.log_end <= OFFSET_MAX, self


@dataclass(frozen=True, slots=True)
class Acked:
    """An ack: applied at once without txn, pending until txn ends with it."""

    txn: TxnId | None
    cumulative_end: int  # 0: none
    ranges: tuple[OffsetRange, ...]  # ascending, disjoint, not touching

    def __post_init__(self) -> None:
        assert self.txn is None or _txn_problem(self.txn) is None, self
        assert 0 <= self.cumulative_end <= OFFSET_MAX, self
        assert self.cumulative_end or self.ranges, self
        assert _ranges_problem(self.ranges, 0) is None, self


@dataclass(frozen=True, slots=True)
class TxnEnded:
    """A marker: commit applies txn's pending acks, abort releases them."""

    txn: TxnId
    committed: bool

    def __post_init__(self) -> None:
        assert _txn_problem(self.txn) is None, self


CursorEntry = Created | Deleted | Reset | Acked | TxnEnded | Truncated


def plan_create(cumulative_end: int) -> Created:
    """The entry creating a cursor at cumulative_end (resolve_initial_position)."""
    if not 0 <= cumulative_end <= OFFSET_MAX:
        raise AtomlogError("INVALID_ARGUMENT", f"start offset {cumulative_end} is out of "
                           "range", {"field": "start_offset"})
    return Created(cumulative_end)


@dataclass(frozen=True, slots=True)
class EndTxnPlan:
    entry: TxnEnded | None  # None: nothing to write
    already_ended: bool  # the transaction had ended here with this decision


class PendingAck(NamedTuple):
    """The acks of one open transaction (PendingAck in partition.proto)."""

    txn: TxnId
    cumulative_end: int  # 0: none
    ranges: tuple[OffsetRange, ...]


class CursorState(NamedTuple):
    """Everything durable: what snapshots keep and recovery must reproduce."""

    cumulative_end: int
    ranges: tuple[OffsetRange, ...]
    pending: tuple[PendingAck, ...]  # by transaction id
    ended: tuple[tuple[TxnId, bool], ...]  # oldest first; bool: committed


class ReadPlan(NamedTuple):
    """What the owner should read for a Receive: the batches holding `redeliver` (holes,
    lowest first), then the log from `new_from` when `new_allowed`."""

    redeliver: tuple[OffsetRange, ...]
    new_from: int
    new_allowed: bool


class Delivery(NamedTuple):
    """The outcome of next_delivery."""

    delivered: tuple[OffsetRange, ...]    # ascending, disjoint: out to the consumer now
    redelivered: tuple[OffsetRange, ...]  # the part of `delivered` delivered before
    skip: Acked | None  # scanned offsets that are not messages: stage it (not urgent)
    read_position: int


class CursorDescription(NamedTuple):
    """SubscriptionCursor in partition.proto, plus the read position."""

    cumulative_end: int
    individual_ranges: tuple[OffsetRange, ...]
    pending_acks: tuple[PendingAck, ...]
    delivered_unacknowledged_count: int
    redelivery_backlog_count: int
    backlog_records: int
    read_position: int


@dataclass(frozen=True, slots=True)
class CursorMetrics:
    """Counters since the cursor was built (the shell exports them as `*_total`)."""

    acks_total: int = 0              # entries applied that acknowledge (not pending)
    pending_acks_total: int = 0      # transactional ack entries applied
    noop_acks_total: int = 0         # acks that changed nothing (repeats)
    conflicts_total: int = 0         # TRANSACTION_CONFLICT refusals
    exhausted_total: int = 0         # RESOURCE_EXHAUSTED refusals
    late_acks_total: int = 0         # TRANSACTION_NOT_OPEN refusals
    commits_total: int = 0
    aborts_total: int = 0
    delivered_offsets_total: int = 0    # new deliveries
    redelivered_offsets_total: int = 0
    skipped_offsets_total: int = 0      # scanned offsets that are not messages
    expired_offsets_total: int = 0      # deliveries past their ack timeout
    nacked_offsets_total: int = 0
    anomalies_total: int = 0            # applied entries that broke a rule (replay)
    truncations_total: int = 0          # cut back to a log end (an accepted data loss)


# ---------------------------------------------------------------------------------------
# Range sets (module-private): sorted, disjoint, non-touching half-open ranges kept in two
# parallel lists, so every lookup is a bisect.
# ---------------------------------------------------------------------------------------

def _within(starts: list[int], ends: list[int], start: int, end: int) -> list[tuple[int, int]]:
    """The pieces of the ranges inside [start, end)."""
    pieces = []
    index = bisect_right(ends, start)
    while index < len(starts) and starts[index] < end:
        pieces.append((max(starts[index], start), min(ends[index], end)))
        index += 1
    return pieces


def _gaps(starts: list[int], ends: list[int], start: int, end: int) -> list[tuple[int, int]]:
    """[start, end) minus the ranges."""
    pieces, position = [], start
    for piece_start, piece_end in _within(starts, ends, start, end):
        if piece_start > position:
            pieces.append((position, piece_start))
        position = piece_end
    if position < end:
        pieces.append((position, end))
    return pieces


class _RangeSet:
    __slots__ = ("ends", "size", "starts")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.size = 0  # offsets covered
        for start, end in ranges:
            self.add(start, end)

    def __len__(self) -> int:
        return len(self.starts)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.starts, self.ends)

    def copy(self) -> _RangeSet:
        other = _RangeSet()
        other.starts, other.ends, other.size = self.starts[:], self.ends[:], self.size
        return other

    def ranges(self) -> tuple[OffsetRange, ...]:
        return tuple(OffsetRange(start, end) for start, end in self)

    def add(self, start: int, end: int) -> int:
        """Cover [start, end); returns how many offsets were not covered before."""
        if start >= end:
            return 0
        first = bisect_left(self.ends, start)  # touching ranges merge too
        last = bisect_right(self.starts, end)
        old = 0
        if first < last:
            old = sum(self.ends[i] - self.starts[i] for i in range(first, last))
            start, end = min(start, self.starts[first]), max(end, self.ends[last - 1])
        self.starts[first:last] = [start]
        self.ends[first:last] = [end]
        added = end - start - old
        self.size += added
        return added

    def remove(self, start: int, end: int) -> int:
        """Uncover [start, end); returns how many offsets were covered."""
        first = bisect_right(self.ends, start)
        last = bisect_left(self.starts, end)
        if start >= end or first >= last:
            return 0
        kept_starts, kept_ends = [], []
        if self.starts[first] < start:
            kept_starts.append(self.starts[first])
            kept_ends.append(start)
        if self.ends[last - 1] > end:
            kept_starts.append(end)
            kept_ends.append(self.ends[last - 1])
        old = sum(self.ends[i] - self.starts[i] for i in range(first, last))
        kept = sum(e - s for s, e in zip(kept_starts, kept_ends))
        self.starts[first:last] = kept_starts
        self.ends[first:last] = kept_ends
        self.size -= old - kept
        return old - kept

    def overlaps(self, start: int, end: int) -> bool:
        index = bisect_right(self.ends, start)
        return index < len(self.starts) and self.starts[index] < end

    def covers(self, start: int, end: int) -> bool:
        index = bisect_right(self.starts, start) - 1
        return index >= 0 and self.ends[index] >= end

    def within(self, start: int, end: int) -> list[tuple[int, int]]:
        return _within(self.starts, self.ends, start, end)

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        return _gaps(self.starts, self.ends, start, end)

    def count_within(self, start: int, end: int) -> int:
        return sum(e - s for s, e in self.within(start, end))

    def length_after_add(self, start: int, end: int) -> int:
        """len(self) once [start, end) is added (not changing anything)."""
        first = bisect_left(self.ends, start)
        last = bisect_right(self.starts, end)
        return len(self.starts) - (last - first) + 1


class _Deliveries:
    """Disjoint ranges of offsets out to a consumer (owner) until deadline_ms; owner None:
    held back by a Nack delay until deadline_ms. Volatile."""

    __slots__ = ("deadlines", "ends", "owners", "size", "starts")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.owners: list[str | None] = []
        self.deadlines: list[int] = []
        self.size = 0

    def __len__(self) -> int:
        return len(self.starts)

    def records(self) -> Iterator[tuple[int, int, str | None, int]]:
        return zip(self.starts, self.ends, self.owners, self.deadlines)

    def remove(self, start: int, end: int) -> list[tuple[int, int, str | None, int]]:
        """Take [start, end) out; returns the removed pieces with their owner/deadline."""
        first = bisect_right(self.ends, start)
        last = bisect_left(self.starts, end)
        if start >= end or first >= last:
            return []
        removed, keep = [], []
        for index in range(first, last):
            s, e = self.starts[index], self.ends[index]
            owner, deadline = self.owners[index], self.deadlines[index]
            removed.append((max(s, start), min(e, end), owner, deadline))
            if s < start:
                keep.append((s, start, owner, deadline))
            if e > end:
                keep.append((end, e, owner, deadline))
        self._replace(first, last, keep)
        self.size -= sum(e - s for s, e, _, _ in removed)
        return removed

    def put(self, start: int, end: int, owner: str | None, deadline_ms: int) -> None:
        self.remove(start, end)
        index = bisect_left(self.starts, start)
        self._replace(index, index, [(start, end, owner, deadline_ms)])
        self.size += end - start

    def drop(self, predicate) -> list[tuple[int, int, str | None, int]]:
        """Remove every record whose (owner, deadline) matches; returns them."""
        kept, dropped = [], []
        for record in self.records():
            (dropped if predicate(record[2], record[3]) else kept).append(record)
        if dropped:
            self.starts = [r[0] for r in kept]
            self.ends = [r[1] for r in kept]
            self.owners = [r[2] for r in kept]
            self.deadlines = [r[3] for r in kept]
            self.size -= sum(r[1] - r[0] for r in dropped)
        return dropped

    def clear(self) -> None:
        self.__init__()

    def _replace(self, first: int, last: int, records: list) -> None:
        self.starts[first:last] = [r[0] for r in records]
        self.ends[first:last] = [r[1] for r in records]
        self.owners[first:last] = [r[2] for r in records]
        self.deadlines[first:last] = [r[3] for r in records]


class _Pending:
    """Mutable pending acks of one transaction."""

    __slots__ = ("cumulative_end", "ranges")

    def __init__(self) -> None:
        self.cumulative_end = 0
        self.ranges = _RangeSet()

    def public(self, txn: TxnId) -> PendingAck:
        return PendingAck(txn, self.cumulative_end, self.ranges.ranges())


# ---------------------------------------------------------------------------------------
# The cursor
# ---------------------------------------------------------------------------------------

class SubscriptionCursor:
    """Cursor of ONE subscription on ONE partition. Single-threaded: only its owner."""

    def __init__(self, cumulative_end: int = 0, limits: CursorLimits | None = None) -> None:
        assert 0 <= cumulative_end <= OFFSET_MAX, cumulative_end
        self.limits = limits or CursorLimits()
        self._acked = _RangeSet([(0, cumulative_end)])  # A: holds [0, cumulative_end)
        self._pending: dict[TxnId, _Pending] = {}
        self._pending_union = _RangeSet()  # every pending range (disjoint across txns)
        self._pending_range_count = 0      # sum of len(ranges) over pending transactions
        self._ended: OrderedDict[TxnId, bool] = OrderedDict()  # txn -> committed
        self._deliveries = _Deliveries()
        self._read_position = cumulative_end
        self._deleted = False
        self._changes = 0
        # The log start forget_below last saw (volatile: the owner applies it after every
        # open): offsets below it are gone, and no longer in any transaction's pending acks.
        self._log_start = 0
        self._counters = dict.fromkeys(CursorMetrics.__dataclass_fields__, 0)

    @classmethod
    def created(cls, entry: Created, limits: CursorLimits | None = None) -> SubscriptionCursor:
        return cls(entry.cumulative_end, limits)

    # -- observability ------------------------------------------------------------------

    @property
    def cumulative_end(self) -> int:
        """Every offset below it is acknowledged."""
        if self._acked.starts and self._acked.starts[0] == 0:
            return self._acked.ends[0]
        return 0

    @property
    def read_position(self) -> int:
        return self._read_position

    @property
    def deleted(self) -> bool:
        return self._deleted

    @property
    def changes(self) -> int:
        """Entries applied since construction (plus forget_below calls that moved)."""
        return self._changes

    @property
    def metrics(self) -> CursorMetrics:
        return CursorMetrics(**self._counters)

    @property
    def range_count(self) -> int:
        """Individual ranges plus pending ranges: what max_ranges bounds."""
        return self._individual_count(self._acked) + self._pending_range_count

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def individual_ranges(self) -> tuple[OffsetRange, ...]:
        ranges = self._acked.ranges()
        return ranges[1:] if ranges and ranges[0].start == 0 else ranges

    def pending_acks(self) -> tuple[PendingAck, ...]:
        return tuple(self._pending[txn].public(txn) for txn in sorted(self._pending))

    def is_pending(self, txn: TxnId) -> bool:
        """Whether `txn` holds a pending entry here (until its marker ends it)."""
        return txn in self._pending

    def pending_transactions(self) -> list[TxnId]:
        """Transactions holding pending acks (the owner may ask their coordinators about
        old ones, as Pulsar's low watermark does, and end those that ended)."""
        return sorted(self._pending)

    def state(self) -> CursorState:
        return CursorState(self.cumulative_end, self.individual_ranges(), self.pending_acks(),
                           tuple(self._ended.items()))

    def is_acknowledged(self, offset: int) -> bool:
        return self._acked.covers(offset, offset + 1)

    def describe(self, max_read_position: int, now_ms: int) -> CursorDescription:
        """SubscriptionCursor of partition.proto. backlog_records counts the offsets in
        [cumulative_end, max_read_position) neither acknowledged nor pending (markers
        included: an estimate)."""
        self._expire(now_ms)
        cumulative_end = self.cumulative_end
        claims = self._claims()
        held_back = sum(e - s for s, e, owner, _ in self._deliveries.records() if owner is None)
        holes = sum(e - s for s, e in self._holes(claims))
        backlog = 0
        for start, end in self._acked.gaps(cumulative_end, max(max_read_position,
                                                               cumulative_end)):
            backlog += end - start - claims.count_within(start, end)
        return CursorDescription(
            cumulative_end, self.individual_ranges(), self.pending_acks(),
            self._deliveries.size - held_back, holes + held_back, backlog,
            self._read_position)

    # -- decisions (change nothing but counters) -----------------------------------------

    def check_ack(self, cumulative_end: int = 0, ranges: Sequence[tuple[int, int]] = (),
                  txn: TxnId | None = None, *, limit: int) -> Acked | None:
        """Decide an AckItem. Returns the entry to journal and apply, or None for a no-op
        that succeeds. Raises INVALID_ARGUMENT, OFFSET_OUT_OF_RANGE, TRANSACTION_CONFLICT,
        TRANSACTION_NOT_OPEN or RESOURCE_EXHAUSTED (see the module doc)."""
        self._check_live()
        requested = self._validate_ack(cumulative_end, ranges, txn, limit)
        if txn is None:
            return self._check_plain_ack(cumulative_end, requested)
        return self._check_pending_ack(txn, cumulative_end, requested)

    def plan_end_txn(self, txn: TxnId, committed: bool) -> EndTxnPlan:
        """Decide a marker for this cursor (see the module doc)."""
        self._check_live()
        _validate_txn(txn)
        if txn in self._pending:
            return EndTxnPlan(TxnEnded(txn, bool(committed)), already_ended=False)
        ended = self._ended.get(txn)
        if ended is None:
            return EndTxnPlan(TxnEnded(txn, bool(committed)), already_ended=False)
        if ended == bool(committed):
            return EndTxnPlan(None, already_ended=True)
        reason = "TRANSACTION_ALREADY_COMMITTED" if ended else "TRANSACTION_ABORTED"
        raise AtomlogError(reason, f"{'COMMIT' if committed else 'ABORT'} marker for "
                           f"{_name(txn)}, which this subscription "
                           f"{'committed' if ended else 'aborted'}", {"txn_id": _name(txn)})

    def plan_reset(self, cumulative_end: int) -> Reset:
        """Seek (the owner clamps the position to [log start, high watermark])."""
        self._check_live()
        if not 0 <= cumulative_end <= OFFSET_MAX:
            raise AtomlogError("INVALID_ARGUMENT", f"reset offset {cumulative_end} is out of "
                               "range", {"field": "offset"})
        self._refuse_with_pending("reset")
        return Reset(cumulative_end)

    def plan_truncate(self, log_end: int) -> Truncated | None:
        """After the log was cut back to log_end (an accepted data loss): the entry that
        forgets every ack, pending ack and read position at or above it; None when the
        cursor holds nothing there. Never refuses: the messages are gone."""
        self._check_live()
        acked_top = self._acked.ends[-1] if self._acked.ends else 0
        pending_top = max((max(p.cumulative_end, p.ranges.ends[-1] if p.ranges.ends else 0)
                           for p in self._pending.values()), default=0)
        if max(acked_top, pending_top, self._read_position) <= log_end:
            return None
        return Truncated(log_end)

    def plan_delete(self) -> Deleted:
        self._check_live()
        self._refuse_with_pending("delete")
        return Deleted()

    # -- transitions ----------------------------------------------------------------------

    def apply(self, entry: CursorEntry) -> None:
        """Apply a journal entry (live right after its check, or in replay). Never refuses."""
        self._check_live()
        self._changes += 1
        if isinstance(entry, Acked):
            if entry.txn is None:
                self._apply_ack(entry)
            else:
                self._apply_pending_ack(entry)
        elif isinstance(entry, TxnEnded):
            self._apply_end(entry)
        elif isinstance(entry, Reset):
            self._apply_reset(entry)
        elif isinstance(entry, Truncated):
            self._apply_truncate(entry)
        elif isinstance(entry, Deleted):
            self._deleted = True
            self._deliveries.clear()
        else:
            raise TypeError(f"{entry!r} is not applied to an existing cursor")

    def forget_below(self, log_start_offset: int) -> None:
        """Retention deleted every offset below log_start_offset: acknowledge them."""
        self._log_start = max(self._log_start, log_start_offset)
        if log_start_offset <= self.cumulative_end:
            # (A recovery replays the journal before this: a transaction's commit replayed
            # there may have passed another's pending cumulative end that the live cursor
            # had set to 0 here, before the commit. Normalized the same way.)
            if any(0 < p.cumulative_end <= self.cumulative_end for p in self._pending.values()):
                self._normalize_pending()
            return
        self._changes += 1
        self._acked.add(0, log_start_offset)
        self._normalize_pending()
        self._after_acked_changed()

    # -- deliveries (volatile) ------------------------------------------------------------

    def read_plan(self, now_ms: int, max_offsets: int) -> ReadPlan:
        """Where a Receive should read: holes to redeliver (lowest first, up to
        max_offsets offsets), then the log from the read position."""
        self._check_live()
        assert max_offsets >= 1, max_offsets
        self._expire(now_ms)
        holes = self._holes(self._claims())
        redeliver, budget = [], max_offsets
        for start, end in holes:
            if budget <= 0:
                break
            taken = min(end - start, budget)
            redeliver.append(OffsetRange(start, start + taken))
            budget -= taken
        return ReadPlan(tuple(redeliver), self._read_position,
                        self._new_deliveries_allowed(holes))

    def next_delivery(self, consumer_id: str, readable: Sequence[tuple[int, int]],
                      scanned: Sequence[tuple[int, int]], now_ms: int, ack_timeout_ms: int,
                      max_offsets: int) -> Delivery:
        """Hand offsets to consumer_id: holes first (lowest first), then new offsets from
        the read position, at most max_offsets, each out until now_ms + ack_timeout_ms.

        `scanned`: the log regions the owner read (all below the reader's limit), e.g.
        [start, next_offset) of each read; `readable`: the offsets in them that are
        messages for this reader (data batches, after isolation filtering). Scanned
        offsets that are neither (control batches, aborted data) and not acknowledged
        or pending come back in `skip`, an ack to stage: they are never delivered, and
        the cursor advances past them."""
        self._check_live()
        validate_consumer_id(consumer_id)
        assert max_offsets >= 1 and ack_timeout_ms >= 1, (max_offsets, ack_timeout_ms)
        readable_set, scanned_set = _RangeSet(readable), _RangeSet(scanned)
        assert all(scanned_set.covers(s, e) for s, e in readable_set), "readable ⊄ scanned"
        self._expire(now_ms)
        claims = self._claims()
        holes = self._holes(claims)
        redelivered, hole_skips, budget = self._take_holes(holes, readable_set, scanned_set,
                                                          max_offsets)
        new, new_skips, read_position = [], [], self._read_position
        if budget > 0 and self._new_deliveries_allowed(holes):
            room = self.limits.max_unacked_offsets - self._deliveries.size - sum(
                e - s for s, e in holes)
            new, new_skips, read_position = self._take_new(
                claims, readable_set, scanned_set, min(budget, room))
        skips, cut = self._bound_skips(hole_skips, new_skips)
        if cut is not None:
            new = [(s, e) for s, e in new if s < cut]
            read_position = cut
        deadline_ms = now_ms + ack_timeout_ms
        for start, end in redelivered + new:
            self._deliveries.put(start, end, consumer_id, deadline_ms)
        self._read_position = read_position
        self._count("redelivered_offsets_total", sum(e - s for s, e in redelivered))
        self._count("delivered_offsets_total", sum(e - s for s, e in new))
        self._count("skipped_offsets_total", sum(e - s for s, e in skips))
        skip = Acked(None, 0, tuple(OffsetRange(*r) for r in _RangeSet(skips))) if skips \
            else None
        return Delivery(_RangeSet(redelivered + new).ranges(), _RangeSet(redelivered).ranges(),
                        skip, read_position)

    def nack(self, consumer_id: str, ranges: Sequence[tuple[int, int]] | None, now_ms: int,
             delay_ms: int) -> int:
        """Offsets out to consumer_id (in ranges; None: all of them) become redeliverable
        after delay_ms (0: at once). Others are ignored. Returns the offsets nacked."""
        self._check_live()
        validate_consumer_id(consumer_id)
        assert delay_ms >= 0, delay_ms
        self._expire(now_ms)
        targets = [(s, e) for s, e, owner, _ in self._deliveries.records()
                   if owner == consumer_id]
        if ranges is not None:
            wanted = _RangeSet(_validated_ranges(ranges, "ranges"))
            targets = [piece for s, e in targets for piece in wanted.within(s, e)]
        for start, end in targets:
            if delay_ms:
                self._deliveries.put(start, end, None, now_ms + delay_ms)
            else:
                self._deliveries.remove(start, end)
        count = sum(e - s for s, e in targets)
        self._count("nacked_offsets_total", count)
        return count

    def release_consumer(self, consumer_id: str) -> int:
        """The consumer is gone: what was out to it is redeliverable at once."""
        dropped = self._deliveries.drop(lambda owner, _: owner == consumer_id)
        return sum(e - s for s, e, _, _ in dropped)

    def next_deadline_ms(self) -> int | None:
        """Earliest delivery deadline or Nack delay end (a long poll wakes up then)."""
        return min(self._deliveries.deadlines, default=None)

    # -- snapshots ------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """Encode the durable state (the store journals what follows)."""
        self._check_live()
        return encode_snapshot(self.state())

    @classmethod
    def restore(cls, data: bytes, limits: CursorLimits | None = None) -> SubscriptionCursor:
        """Rebuild from a snapshot. Raises SnapshotCorrupt: never guess. Limits lower than
        the contents only stop new growth (what is there stays)."""
        return cls.from_state(decode_snapshot(data), limits)

    @classmethod
    def from_state(cls, state: CursorState, limits: CursorLimits | None = None
                   ) -> SubscriptionCursor:
        cursor = cls(state.cumulative_end, limits)
        for start, end in state.ranges:
            cursor._acked.add(start, end)
        for pending in state.pending:
            entry = cursor._pending[pending.txn] = _Pending()
            entry.cumulative_end = pending.cumulative_end
            for start, end in pending.ranges:
                entry.ranges.add(start, end)
        cursor._rebuild_pending_index()
        cursor._ended.update(state.ended)
        cursor._enforce_remembered()
        cursor._read_position = cursor.cumulative_end
        return cursor

    # -- checks ---------------------------------------------------------------------------

    def _validate_ack(self, cumulative_end: int, ranges: Sequence[tuple[int, int]],
                      txn: TxnId | None, limit: int) -> _RangeSet:
        if txn is not None:
            _validate_txn(txn)
        assert 0 <= limit <= OFFSET_MAX, limit
        if not 0 <= cumulative_end <= OFFSET_MAX:
            raise AtomlogError("INVALID_ARGUMENT", f"cumulative_end_offset {cumulative_end} "
                               "is out of range", {"field": "cumulative_end_offset"})
        if len(ranges) > self.limits.max_ranges:
            raise AtomlogError("INVALID_ARGUMENT", f"{len(ranges)} individual ranges in one "
                               f"ack; at most {LIMIT_RANGES}={self.limits.max_ranges}",
                               {"field": "individual_ranges", "limit": LIMIT_RANGES})
        requested = _RangeSet(_validated_ranges(ranges, "individual_ranges"))
        if not cumulative_end and not requested:
            raise AtomlogError("INVALID_ARGUMENT", "an ack needs a cumulative_end_offset or "
                               "individual_ranges", {"field": "cumulative_end_offset"})
        end = max(cumulative_end, requested.ends[-1] if requested else 0)
        # What was delivered can be acknowledged too: a READ_UNCOMMITTED reader is given
        # offsets up to the high watermark, past the max read position while a
        # transaction is open (before, its acks of them were refused, and they came back
        # every ack timeout until the transaction ended).
        if end > max(limit, self._read_position):
            raise AtomlogError(
                "OFFSET_OUT_OF_RANGE", f"ack up to offset {end} (exclusive): only offsets "
                f"below {max(limit, self._read_position)} (the max read position {limit}, "
                f"or the end of what was delivered, {self._read_position}) can be "
                "acknowledged",
                {"field": "individual_ranges" if end != cumulative_end
                 else "cumulative_end_offset", "max_read_position": limit})
        return requested

    def _check_plain_ack(self, cumulative_end: int, requested: _RangeSet) -> Acked | None:
        claim = self._unacked_pieces(cumulative_end, requested)
        if not claim:
            self._count("noop_acks_total")
            return None
        holder = self._conflict(claim, except_txn=None)
        if holder is not None:
            raise self._conflict_error(holder, "are pending in open transaction")
        if self._individual_count(self._acked) + len(claim) + self._pending_range_count > \
                self.limits.max_ranges:
            after = self._acked.copy()
            for start, end in claim:
                after.add(start, end)
            grown = self._individual_count(after) - self._individual_count(self._acked)
            if grown > 0 and self._individual_count(after) + self._pending_range_count > \
                    self.limits.max_ranges:
                raise self._exhausted_ranges(grown)
        return Acked(None, cumulative_end, requested.ranges())

    def _check_pending_ack(self, txn: TxnId, cumulative_end: int,
                           requested: _RangeSet) -> Acked | None:
        if txn in self._ended:
            self._count("late_acks_total")
            raise AtomlogError(
                "TRANSACTION_NOT_OPEN", f"transaction {_name(txn)} already "
                f"{'committed' if self._ended[txn] else 'aborted'} on this subscription; it "
                "takes no more acks", {"txn_id": _name(txn)})
        current = self.cumulative_end
        pending = self._pending.get(txn)
        if pending is not None and self._repeats_pending(pending, cumulative_end, requested):
            self._count("noop_acks_total")
            return None
        acked = next(((s, e) for s, e in requested if self._acked.overlaps(s, e)), None)
        if acked is not None or 0 < cumulative_end <= current:
            self._count("conflicts_total")
            what = (f"offsets in [{acked[0]}, {acked[1]}) are" if acked is not None
                    else f"every offset below {cumulative_end} is")
            raise AtomlogError(
                "TRANSACTION_CONFLICT", f"transaction {_name(txn)}: {what} already "
                "acknowledged (consumed before), so the transaction would process them "
                "twice", {"txn_id": _name(txn), "cumulative_end_offset": current})
        claim = list(requested) + (self._acked.gaps(current, cumulative_end)
                                   if cumulative_end else [])
        holder = self._conflict(claim, except_txn=txn)
        if holder is not None:
            raise self._conflict_error(holder, "are pending in transaction",
                                       f" (acked by transaction {_name(txn)})")
        pending = self._pending.get(txn)
        if pending is not None and cumulative_end <= pending.cumulative_end and all(
                pending.ranges.covers(s, e) for s, e in requested):
            self._count("noop_acks_total")
            return None
        if pending is None and len(self._pending) >= self.limits.max_pending_transactions:
            self._count("exhausted_total")
            raise AtomlogError(
                "RESOURCE_EXHAUSTED", f"subscription has acks pending in {len(self._pending)} "
                f"open transactions, the limit {LIMIT_PENDING}="
                f"{self.limits.max_pending_transactions}: transaction {_name(txn)} cannot ack "
                "here until one ends", {"limit": LIMIT_PENDING})
        before = len(pending.ranges) if pending else 0
        after = pending.ranges.copy() if pending else _RangeSet()
        for start, end in requested:
            after.add(start, end)
        grown = len(after) - before
        if grown > 0 and self.range_count + grown > self.limits.max_ranges:
            raise self._exhausted_ranges(grown)
        return Acked(txn, cumulative_end, requested.ranges())

    def _unacked_pieces(self, cumulative_end: int, requested: _RangeSet) -> list:
        wanted = requested.copy()
        wanted.add(0, cumulative_end)
        return [gap for s, e in wanted for gap in self._acked.gaps(s, e)]

    def _conflict(self, pieces: list, except_txn: TxnId | None) -> tuple | None:
        """(holder txn, start, end) of the first piece pending in another transaction."""
        current = self.cumulative_end
        for txn, pending in self._pending.items():
            if txn != except_txn and pending.cumulative_end > current:
                for start, end in pieces:
                    if start < pending.cumulative_end and end > current:
                        return txn, max(start, current), min(end, pending.cumulative_end)
        own = self._pending.get(except_txn) if except_txn is not None else None
        for start, end in pieces:
            for s, e in self._pending_union.within(start, end):
                if own is not None and own.ranges.covers(s, e):
                    continue
                holder = next(txn for txn, p in self._pending.items()
                              if txn != except_txn and p.ranges.overlaps(s, e))
                return holder, s, e
        return None

    def _conflict_error(self, holder: tuple, what: str, suffix: str = "") -> AtomlogError:
        txn, start, end = holder
        self._count("conflicts_total")
        return AtomlogError(
            "TRANSACTION_CONFLICT", f"offsets [{start}, {end}) {what} {_name(txn)}{suffix}; "
            "nothing was acknowledged", {"txn_id": _name(txn), "start_offset": start,
                                         "end_offset": end})

    def _exhausted_ranges(self, grown: int) -> AtomlogError:
        self._count("exhausted_total")
        return AtomlogError(
            "RESOURCE_EXHAUSTED", f"subscription tracks {self.range_count} acknowledged and "
            f"pending ranges, the limit {LIMIT_RANGES}={self.limits.max_ranges}; this ack "
            f"would add {grown}. Acks of the oldest unacknowledged messages go through and "
            "shrink the table; retry", {"limit": LIMIT_RANGES,
                                       "cumulative_end_offset": self.cumulative_end})

    def _refuse_with_pending(self, what: str) -> None:
        if self._pending:
            self._count("conflicts_total")
            txns = ", ".join(_name(txn) for txn in sorted(self._pending)[:5])
            raise AtomlogError(
                "TRANSACTION_CONFLICT", f"cannot {what} the subscription: acks are pending in "
                f"{len(self._pending)} open transaction(s) ({txns}); end them first",
                {"pending_transactions": len(self._pending)})

    def _check_live(self) -> None:
        assert not self._deleted, "the cursor was deleted"

    # -- transitions (helpers) --------------------------------------------------------------

    def _apply_ack(self, entry: Acked) -> None:
        self._count("acks_total")
        self._acked.add(0, entry.cumulative_end)
        for start, end in entry.ranges:
            self._acked.add(start, end)
        if any(self._acked.overlaps(s, e) for s, e in self._pending_union) or any(
                p.cumulative_end and p.cumulative_end <= self.cumulative_end
                for p in self._pending.values()):
            self._count("anomalies_total")
            self._normalize_pending()
        self._after_acked_changed(entry.ranges)

    def _apply_pending_ack(self, entry: Acked) -> None:
        if entry.txn in self._ended:  # never written under these rules: ignore it
            self._count("anomalies_total")
            return
        self._count("pending_acks_total")
        current = self.cumulative_end
        pending = self._pending.setdefault(entry.txn, _Pending())
        if entry.cumulative_end > current:
            pending.cumulative_end = max(pending.cumulative_end, entry.cumulative_end)
            self._deliveries.remove(current, entry.cumulative_end)
        elif entry.cumulative_end:
            self._count("anomalies_total")
        before = len(pending.ranges)
        for start, end in entry.ranges:
            for s, e in self._acked.gaps(start, end):
                pending.ranges.add(s, e)
                self._pending_union.add(s, e)
                self._deliveries.remove(s, e)
        self._pending_range_count += len(pending.ranges) - before

    def _apply_end(self, entry: TxnEnded) -> None:
        pending = self._pending.pop(entry.txn, None)
        self._count("commits_total" if entry.committed else "aborts_total")
        if pending is not None:
            if entry.committed:
                self._acked.add(0, pending.cumulative_end)
                for start, end in pending.ranges:
                    self._acked.add(start, end)
            self._rebuild_pending_index()
            if entry.committed:
                self._after_acked_changed(pending.ranges)
        self._ended.pop(entry.txn, None)
        self._ended[entry.txn] = entry.committed
        self._enforce_remembered()

    def _apply_reset(self, entry: Reset) -> None:
        self._acked = _RangeSet([(0, entry.cumulative_end)])
        self._deliveries.clear()
        self._read_position = entry.cumulative_end
        if self._pending:
            self._count("anomalies_total")
            self._normalize_pending()

    def _apply_truncate(self, entry: Truncated) -> None:
        end = entry.log_end
        self._count("truncations_total")
        self._acked.remove(end, OFFSET_MAX)
        for pending in self._pending.values():
            pending.ranges.remove(end, OFFSET_MAX)
            pending.cumulative_end = min(pending.cumulative_end, end)
        self._normalize_pending()
        self._deliveries.remove(end, OFFSET_MAX)
        self._read_position = min(self._read_position, end)

    def _after_acked_changed(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        current = self.cumulative_end
        self._deliveries.remove(0, current)
        for start, end in ranges:
            self._deliveries.remove(start, end)
        self._read_position = max(self._read_position, current)

    def _repeats_pending(self, pending, cumulative_end: int, requested: _RangeSet) -> bool:
        """Whether a transaction's ack names only offsets it has pending already, or
        offsets below the log start (retention deleted them and took them out of its
        pending acks, `_normalize_pending`): then it repeats what stands. (Before, such a
        repeat, a retry after a lost answer, was refused TRANSACTION_CONFLICT as if the
        offsets had been consumed by someone else.)"""
        floor = self._log_start
        if not floor:
            return False  # (the ordinary repeat check below answers it)
        if cumulative_end > floor and cumulative_end > pending.cumulative_end:
            return False
        return all(pending.ranges.covers(max(s, floor), e) for s, e in requested if e > floor)

    def _normalize_pending(self) -> None:
        """Pending acks never cover acknowledged offsets; a pending cumulative end at or
        below cumulative_end claims nothing (retention, or a replayed anomaly)."""
        current = self.cumulative_end
        for pending in self._pending.values():
            for start, end in list(pending.ranges):
                for s, e in self._acked.within(start, end):
                    pending.ranges.remove(s, e)
            if pending.cumulative_end <= current:
                pending.cumulative_end = 0
        self._rebuild_pending_index()

    def _rebuild_pending_index(self) -> None:
        self._pending_union = _RangeSet()
        self._pending_range_count = 0
        for pending in self._pending.values():
            self._pending_range_count += len(pending.ranges)
            for start, end in pending.ranges:
                self._pending_union.add(start, end)

    def _enforce_remembered(self) -> None:
        while len(self._ended) > self.limits.max_remembered_transactions:
            self._ended.popitem(last=False)

    # -- deliveries (helpers) ---------------------------------------------------------------

    def _claims(self) -> _RangeSet:
        """Every offset some pending ack claims (cumulative claims as whole windows)."""
        claims = self._pending_union.copy()
        current = self.cumulative_end
        top = max((p.cumulative_end for p in self._pending.values()), default=0)
        if top > current:
            claims.add(current, top)
        return claims

    def _holes(self, claims: _RangeSet) -> list[tuple[int, int]]:
        """Offsets below the read position that are redeliverable now."""
        pieces = self._acked.gaps(self.cumulative_end, self._read_position)
        pieces = [gap for s, e in pieces for gap in claims.gaps(s, e)]
        out = self._deliveries
        return [gap for s, e in pieces for gap in _gaps(out.starts, out.ends, s, e)]

    def _new_deliveries_allowed(self, holes: list[tuple[int, int]]) -> bool:
        tracked = self._deliveries.size + sum(e - s for s, e in holes)
        return tracked < self.limits.max_unacked_offsets and \
            self.range_count < self.limits.max_ranges

    def _take_holes(self, holes: list, readable: _RangeSet, scanned: _RangeSet,
                    budget: int) -> tuple[list, list, int]:
        taken, skips = [], []
        for start, end in holes:
            if budget <= 0:
                break
            for s, e in scanned.within(start, end):
                skips.extend(readable.gaps(s, e))
            for s, e in readable.within(start, end):
                if budget <= 0:
                    break
                e = min(e, s + budget)
                taken.append((s, e))
                budget -= e - s
        return taken, skips, budget

    def _take_new(self, claims: _RangeSet, readable: _RangeSet, scanned: _RangeSet,
                  budget: int) -> tuple[list, list, int]:
        """From the read position through the scanned run that contains it."""
        position = self._read_position
        index = bisect_right(scanned.starts, position) - 1
        if budget <= 0 or index < 0 or scanned.ends[index] <= position:
            return [], [], position
        run_end = scanned.ends[index]
        taken, skips = [], []
        for start, end in self._acked.gaps(position, run_end):
            for s, e in claims.gaps(start, end):
                skips.extend(readable.gaps(s, e))
                for rs, re in readable.within(s, e):
                    re = min(re, rs + budget)
                    taken.append((rs, re))
                    budget -= re - rs
                    if budget <= 0:
                        return taken, [g for g in skips if g[0] < re], re
        return taken, skips, run_end

    def _bound_skips(self, hole_skips: list, new_skips: list) -> tuple[list, int | None]:
        """Skips within max_ranges: a hole skip that would overflow is left for later; the
        first new-region skip that would overflow cuts the read position there."""
        accepted: list = []
        if not hole_skips and not new_skips:
            return accepted, None
        after = self._acked.copy()
        budget = self.limits.max_ranges - self._pending_range_count
        for start, end in sorted(hole_skips):
            if self._fits(after, start, end, budget):
                after.add(start, end)
                accepted.append((start, end))
        for start, end in new_skips:
            if not self._fits(after, start, end, budget):
                return accepted, start
            after.add(start, end)
            accepted.append((start, end))
        return accepted, None

    def _fits(self, acked: _RangeSet, start: int, end: int, budget: int) -> bool:
        length = acked.length_after_add(start, end)
        zero = start == 0 or (acked.starts and acked.starts[0] == 0)
        individual = length - (1 if zero else 0)
        return individual <= max(budget, self._individual_count(acked))

    def _expire(self, now_ms: int) -> None:
        if not self._deliveries.deadlines or min(self._deliveries.deadlines) > now_ms:
            return
        dropped = self._deliveries.drop(lambda _, deadline: deadline <= now_ms)
        self._count("expired_offsets_total", sum(e - s for s, e, owner, _ in dropped
                                                 if owner is not None))

    @staticmethod
    def _individual_count(acked: _RangeSet) -> int:
        return len(acked) - (1 if acked.starts and acked.starts[0] == 0 else 0)

    def _count(self, counter: str, amount: int = 1) -> None:
        self._counters[counter] += amount


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------

def _name(txn: TxnId) -> str:
    return f"({txn.tc_partition}, {txn.sequence})"


def _txn_problem(txn: TxnId) -> str | None:
    tc, sequence = txn
    if not (0 <= tc <= TC_PARTITION_MAX and 0 <= sequence <= TXN_SEQUENCE_MAX) or (
            tc, sequence) == (0, 0):
        return f"transaction id ({tc}, {sequence}) is not a valid transaction"
    return None


def _validate_txn(txn: TxnId) -> None:
    problem = _txn_problem(txn)
    if problem:
        raise AtomlogError("INVALID_ARGUMENT", problem, {"field": "txn_id"})


def validate_consumer_id(consumer_id: str) -> None:
    if not isinstance(consumer_id, str) or not 0 < len(consumer_id.encode()) <= \
            MAX_CONSUMER_ID_BYTES:
        raise AtomlogError("INVALID_ARGUMENT", f"consumer_id must have 1..{MAX_CONSUMER_ID_BYTES}"
                           " bytes of UTF-8", {"field": "consumer_id"})


def _validated_ranges(ranges: Sequence[tuple[int, int]], field: str) -> list[tuple[int, int]]:
    for index, (start, end) in enumerate(ranges):
        if not 0 <= start < end <= OFFSET_MAX:
            raise AtomlogError("INVALID_ARGUMENT", f"{field}[{index}] = [{start}, {end}) is "
                               "not a non-empty range of valid offsets", {"field": field})
    return [(start, end) for start, end in ranges]


def _ranges_problem(ranges: Sequence[tuple[int, int]], floor: int) -> str | None:
    """Ranges must be non-empty, ascending, non-touching and at or above floor."""
    previous = floor - 1
    for start, end in ranges:
        if not (previous < start < end <= OFFSET_MAX):
            return f"range [{start}, {end}) is empty, out of order or touches another"
        previous = end
    return None


# ---------------------------------------------------------------------------------------
# Journal entries, little-endian:
#   kind u8, then
#   1 Created   cumulative_end i64
#   2 Deleted   -
#   3 Reset     cumulative_end i64
#   4 Acked     tc u32, sequence u64 ((0, 0): not transactional), cumulative_end i64
#               (0: none), range count u32, ranges (start i64, end i64) ascending
#   5 TxnEnded  tc u32, sequence u64, committed u8
# ---------------------------------------------------------------------------------------

class EntryCorrupt(Exception):
    """A journal entry cannot be decoded (the frame's CRC matched: not a torn write)."""


class EntryKind(enum.IntEnum):
    CREATED = 1
    DELETED = 2
    RESET = 3
    ACKED = 4
    TXN_ENDED = 5
    TRUNCATED = 6


_KIND = struct.Struct("<B")
_POSITION = struct.Struct("<q")
_ACK = struct.Struct("<IQqI")
_END = struct.Struct("<IQB")
_RANGE = struct.Struct("<qq")


def encode_entry(entry: CursorEntry) -> bytes:
    if isinstance(entry, Created):
        data = _KIND.pack(EntryKind.CREATED) + _POSITION.pack(entry.cumulative_end)
    elif isinstance(entry, Deleted):
        data = _KIND.pack(EntryKind.DELETED)
    elif isinstance(entry, Reset):
        data = _KIND.pack(EntryKind.RESET) + _POSITION.pack(entry.cumulative_end)
    elif isinstance(entry, Truncated):
        data = _KIND.pack(EntryKind.TRUNCATED) + _POSITION.pack(entry.log_end)
    elif isinstance(entry, Acked):
        txn = entry.txn or TxnId(0, 0)
        data = b"".join([_KIND.pack(EntryKind.ACKED),
                         _ACK.pack(*txn, entry.cumulative_end, len(entry.ranges)),
                         *(_RANGE.pack(*r) for r in entry.ranges)])
    else:
        data = _KIND.pack(EntryKind.TXN_ENDED) + _END.pack(*entry.txn, entry.committed)
    return data


def decode_entry(data: bytes | memoryview) -> CursorEntry:
    """The entry encoded in data; EntryCorrupt if it is not exactly one valid entry."""
    try:
        entry, size = _decode_entry(memoryview(data))
    except struct.error as error:
        raise EntryCorrupt(f"entry is truncated: {error}") from None
    if size != len(data):
        raise EntryCorrupt(f"{len(data) - size} bytes after the entry")
    return entry


def _decode_entry(data: memoryview) -> tuple[CursorEntry, int]:
    (kind,) = _KIND.unpack_from(data, 0)
    position = _KIND.size
    if kind in (EntryKind.CREATED, EntryKind.RESET, EntryKind.TRUNCATED):
        (offset,) = _POSITION.unpack_from(data, position)
        if offset < 0:
            raise EntryCorrupt(f"negative offset {offset}")
        entry_type = {EntryKind.CREATED: Created, EntryKind.RESET: Reset,
                      EntryKind.TRUNCATED: Truncated}[kind]
        return entry_type(offset), position + _POSITION.size
    if kind == EntryKind.DELETED:
        return Deleted(), position
    if kind == EntryKind.ACKED:
        tc, sequence, cumulative_end, count = _ACK.unpack_from(data, position)
        position += _ACK.size
        if count > MAX_RANGES_BOUND:
            raise EntryCorrupt(f"{count} ranges")
        ranges = tuple(OffsetRange(*_RANGE.unpack_from(data, position + i * _RANGE.size))
                       for i in range(count))
        position += count * _RANGE.size
        txn = None if (tc, sequence) == (0, 0) else TxnId(tc, sequence)
        problem = _ranges_problem(ranges, 0)
        if problem or cumulative_end < 0 or not (cumulative_end or ranges):
            raise EntryCorrupt(problem or f"bad cumulative end {cumulative_end}")
        return Acked(txn, cumulative_end, ranges), position
    if kind == EntryKind.TXN_ENDED:
        tc, sequence, committed = _END.unpack_from(data, position)
        txn = TxnId(tc, sequence)
        if _txn_problem(txn) or committed not in (0, 1):
            raise EntryCorrupt(f"bad transaction end ({tc}, {sequence}, {committed})")
        return TxnEnded(txn, bool(committed)), position + _END.size
    raise EntryCorrupt(f"unknown entry kind {kind}")


# ---------------------------------------------------------------------------------------
# Snapshot format (version 1), little-endian:
#   header   magic "ALSC", version u16, reserved u16 (0), cumulative_end i64,
#            range count u32, pending count u32, ended count u32
#   range    start i64, end i64                                       (ascending)
#   pending  tc u32, sequence u64, cumulative_end i64 (0: none), range count u32,
#            then its ranges                                           (ascending txn)
#   ended    tc u32, sequence u64, committed u8                        (oldest first)
#   trailer  CRC32C (Castagnoli) u32 of every byte before it
# ---------------------------------------------------------------------------------------

SNAPSHOT_MAGIC = b"ALSC"
SNAPSHOT_VERSION = 1
_HEADER = struct.Struct("<4sHHqIII")
_PENDING = struct.Struct("<IQqI")
_ENDED = struct.Struct("<IQB")


def encode_snapshot(state: CursorState) -> bytes:
    parts = [_HEADER.pack(SNAPSHOT_MAGIC, SNAPSHOT_VERSION, 0, state.cumulative_end,
                          len(state.ranges), len(state.pending), len(state.ended))]
    parts.extend(_RANGE.pack(*r) for r in state.ranges)
    for pending in state.pending:
        parts.append(_PENDING.pack(*pending.txn, pending.cumulative_end, len(pending.ranges)))
        parts.extend(_RANGE.pack(*r) for r in pending.ranges)
    parts.extend(_ENDED.pack(*txn, committed) for txn, committed in state.ended)
    data = seal(b"".join(parts))
    assert decode_snapshot(data) == state  # pair assertion
    return data


def decode_snapshot(data: bytes) -> CursorState:
    """The state in a cursor snapshot; SnapshotCorrupt if anything is wrong."""
    fields, body = unseal(data, _HEADER, SNAPSHOT_MAGIC, SNAPSHOT_VERSION, "subscription-cursor")
    _, _, _, cumulative_end, range_count, pending_count, ended_count = fields
    position = _HEADER.size
    try:
        ranges, position = _read_ranges(body, position, range_count)
        pending = []
        for _ in range(pending_count):
            tc, sequence, pending_end, count = _PENDING.unpack_from(body, position)
            own, position = _read_ranges(body, position + _PENDING.size, count)
            pending.append(PendingAck(TxnId(tc, sequence), pending_end, own))
        ended = []
        for _ in range(ended_count):
            tc, sequence, committed = _ENDED.unpack_from(body, position)
            position += _ENDED.size
            ended.append((TxnId(tc, sequence), committed))
    except struct.error as error:
        raise SnapshotCorrupt(f"snapshot ends early: {error}") from None
    if position != len(body):
        raise SnapshotCorrupt(f"{len(body) - position} unexpected bytes after the snapshot")
    problem = _state_problem(cumulative_end, ranges, pending, ended)
    if problem:
        raise SnapshotCorrupt(problem)
    return CursorState(cumulative_end, ranges, tuple(pending),
                       tuple((txn, bool(committed)) for txn, committed in ended))


def _read_ranges(body: memoryview, position: int, count: int) -> tuple[tuple, int]:
    if count > (len(body) - position) // _RANGE.size:
        raise struct.error(f"{count} ranges do not fit")
    ranges = tuple(OffsetRange(*_RANGE.unpack_from(body, position + i * _RANGE.size))
                   for i in range(count))
    return ranges, position + count * _RANGE.size


def _state_problem(cumulative_end: int, ranges: tuple, pending: list,
                   ended: list) -> str | None:
    """Check decoded values (nothing is trusted because its CRC matched)."""
    if not 0 <= cumulative_end <= OFFSET_MAX:
        return f"cumulative end {cumulative_end} out of range"
    problem = _ranges_problem(ranges, cumulative_end + 1)
    if problem:
        return f"acknowledged ranges: {problem}"
    acked = _RangeSet([(0, cumulative_end), *ranges])
    txns = [p.txn for p in pending]
    if txns != sorted(set(txns)) or any(_txn_problem(txn) for txn in txns):
        return "pending transactions are not valid, unique and ascending"
    claimed, holders = _RangeSet(), 0
    for item in pending:
        problem = _ranges_problem(item.ranges, cumulative_end)
        if problem or any(acked.overlaps(s, e) or claimed.overlaps(s, e)
                          for s, e in item.ranges):
            return f"pending ranges of {_name(item.txn)} are invalid or claimed twice"
        if item.cumulative_end and not cumulative_end < item.cumulative_end <= OFFSET_MAX:
            return f"pending cumulative end of {_name(item.txn)} out of range"
        holders += bool(item.cumulative_end)
        for start, end in item.ranges:
            claimed.add(start, end)
    for item in pending:  # a cumulative claim covers [cumulative_end, its end)
        if item.cumulative_end and any(
                other.txn != item.txn and _RangeSet(other.ranges).overlaps(
                    cumulative_end, item.cumulative_end) for other in pending):
            return f"pending cumulative end of {_name(item.txn)} overlaps another's ranges"
    if holders > 1:
        return "more than one transaction holds a pending cumulative ack"
    ended_txns = [txn for txn, _ in ended]
    if len(set(ended_txns)) != len(ended_txns) or set(ended_txns) & set(txns) or any(
            _txn_problem(txn) or committed not in (0, 1) for txn, committed in ended):
        return "ended transactions are invalid, repeated or still pending"
    return None


__all__ = [
    "Acked",
    "Created",
    "CursorDescription",
    "CursorEntry",
    "CursorLimits",
    "CursorMetrics",
    "CursorState",
    "Deleted",
    "Delivery",
    "EndTxnPlan",
    "EntryCorrupt",
    "EntryKind",
    "InitialPosition",
    "OffsetRange",
    "PendingAck",
    "ReadPlan",
    "Reset",
    "SnapshotCorrupt",
    "SubscriptionCursor",
    "TxnEnded",
    "decode_entry",
    "decode_snapshot",
    "encode_entry",
    "encode_snapshot",
    "plan_create",
    "resolve_initial_position",
]
