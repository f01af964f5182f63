"""Idempotent-producer state of one partition: a pure state machine (no I/O, no clock).

Per producer id the table keeps the highest epoch seen and the metadata of the last
`window` (default 5, as Kafka) data batches of that epoch: sequence range, offset range
and append time. It answers whether an incoming batch is new, a retry, or wrong.

Contract with the partition owner (one task owns the partition; per batch, strictly in
this order, with nothing of the same partition in between):

    decision = table.check(pid, epoch, base_sequence, record_count, now_ms)  # may raise
    if decision is APPEND:   append the batch at the log end (timestamp_ms = now_ms),
                             then table.apply(..., timestamp_ms=now_ms)
    else (a Duplicate):      append nothing; answer with decision.base_offset/last_offset,
                             but only once the log is durable past decision.last_offset.

- `check` changes no decision-relevant state (it may only drop producers that are already
  expired, see below, and bump counters). If the append fails, do not call `apply`.
- `apply` runs right after the append, before the fsync: batches are applied in log
  order, so the table is authoritative for pipelined, not-yet-durable batches. If a write
  or fsync then fails, the table is ahead of the log: discard it and rebuild (restore the
  last snapshot, replay the durable log); never patch it by hand.
- Replay (recovery) calls only `apply`, once per batch header in log order. `apply` never
  refuses: the log is the truth. A data batch that does not follow its producer's state
  (possible only in logs written under other rules) restarts that producer's window at
  the batch and counts in `anomalies_total`.

Expiry is logical and deterministic: a producer is expired at time t when
`t - last_timestamp_ms > idle_expiry_ms`, where last_timestamp_ms is the `timestamp_ms` of
its last applied batch or marker (Kafka uses the batch timestamp too). `check(now_ms)` and
`apply(timestamp_ms)` treat an expired producer as absent, so decisions never depend on
when `expire` ran; `expire(now_ms)` only frees memory and counts. Hence a full replay, or
a snapshot plus the tail, equals the live table in `live_entries(now_ms)`, and physically
too after both ran `expire(now_ms)`. Pass the batch's log append time as `timestamp_ms`
and the same value as `now_ms` to `check`, or decisions and replay may diverge at the
expiry edge. As in Kafka, a retry that arrives after its producer expired is not known
as a retry (sequence 0 appends again), so idle_expiry_ms must be far above retry times.

A full table also forgets producers idle for more than `evict_idle_ms` (EVICT_IDLE_MS,
an hour, or the expiry when shorter) to make room for a new one, before refusing it
(RESOURCE_EXHAUSTED): producers that live for one job or task fill a table long before
their expiry. This is the one decision that depends on the table's fullness, not only on
time: a replay keeps such a producer until its expiry, so after a restart it may be known
again. Either way is safe: a known producer goes on in order, an unknown one's next batch
is refused (UNKNOWN_PRODUCER_ID) unless it is its sequence 0, which an hour's silence puts
past any retry.

Control batches (transaction markers, `apply(..., control=True)`; sequences are ignored):
producer id 0 → ignored. Otherwise the marker carries the transaction producer's epoch:
unknown/expired producer → an entry with that epoch and no batches; higher epoch → epoch
bumped, batches forgotten (last_sequence -1); same epoch → last_timestamp_ms refreshed;
lower epoch → ignored. Markers are never refused, so they may push the count above
max_producers until producers expire. A data batch with producer id 0 or base sequence -1
is not idempotent: always APPEND, nothing recorded.

Sequences are int32 counters that wrap from 2**31-1 to 0 (Kafka): a batch of n records
covers base..base+n-1 mod 2**31. A new epoch must start at sequence 0, and so must a
producer the partition does not know (else UNKNOWN_PRODUCER_ID). A retry matches only a
remembered batch with the same epoch, base and last sequence.

Snapshots: `snapshot(covered_offset)` encodes every entry with the log offset it covers
(exclusive: replay resumes at covered_offset) in a versioned binary format closed by a
CRC32C; `restore` rejects anything unreadable with `SnapshotCorrupt` (fall back to full
replay). Take a snapshot only when everything applied is durable, and discard one whose
covered_offset is above the recovered log end.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping

from partition_server.snapshot_files import (SnapshotCorrupt, SnapshotFileNames, seal,
                                              unseal)
from services.errors import AtomlogError

# Kafka's sequence numbers are int32 and wrap to 0 after the maximum.
SEQUENCE_MODULUS = 1 << 31
SEQUENCE_MAX = SEQUENCE_MODULUS - 1
NO_SEQUENCE = -1
# Producer id 0 means "no producer" in a batch header (the allocator never issues it).
NO_PRODUCER_ID = 0
PRODUCER_ID_MAX = (1 << 63) - 1
# Producer epochs are uint32 in the API (protos/atomlog/v1/partition.proto).
PRODUCER_EPOCH_MAX = (1 << 32) - 1
# Kafka keeps the last 5 batches per producer, which bounds in-flight requests at 5.
DEFAULT_WINDOW = 5
# Bound of the window in the snapshot format (one byte per entry holds the count).
WINDOW_MAX = 255
LIMIT_NAME = "partition.max_producers"
# A full table makes room for a new producer by forgetting those idle this long (or the
# expiry, when shorter) before their expiry: far above any retry of a batch (the SDK's
# delivery timeout, 2 min by default) and a transaction's longest timeout (1 h), so a
# producer forgotten this way has nothing in flight that could be appended twice.
EVICT_IDLE_MS = 3_600_000


def sequence_add(sequence: int, delta: int) -> int:
    """`sequence + delta` in the wrapping int32 sequence space."""
    return (sequence + delta) % SEQUENCE_MODULUS


def last_sequence_of(base_sequence: int, record_count: int) -> int:
    """The sequence of a batch's last record."""
    return sequence_add(base_sequence, record_count - 1)


# ---------------------------------------------------------------------------------------
# Value objects
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class BatchMetadata:
    """What is remembered of one appended data batch."""

    base_sequence: int
    last_sequence: int
    base_offset: int
    last_offset: int
    timestamp_ms: int

    def __post_init__(self) -> None:
        assert 0 <= self.base_sequence <= SEQUENCE_MAX, self
        assert 0 <= self.last_sequence <= SEQUENCE_MAX, self
        assert 0 <= self.base_offset <= self.last_offset, self
        # One offset per record, one sequence per record.
        span = (self.last_sequence - self.base_sequence) % SEQUENCE_MODULUS
        assert span == self.last_offset - self.base_offset, self


@dataclass(frozen=True, slots=True)
class ProducerEntry:
    """One producer's state: its epoch and its last batches of that epoch, oldest first."""

    producer_id: int
    producer_epoch: int
    last_timestamp_ms: int
    batches: tuple[BatchMetadata, ...] = ()

    def __post_init__(self) -> None:
        assert 0 < self.producer_id <= PRODUCER_ID_MAX, self
        assert 0 <= self.producer_epoch <= PRODUCER_EPOCH_MAX, self
        assert len(self.batches) <= WINDOW_MAX, self

    @property
    def last_sequence(self) -> int:
        """Sequence of the last record appended in this epoch; -1 when none."""
        return self.batches[-1].last_sequence if self.batches else NO_SEQUENCE

    @property
    def last_offset(self) -> int:
        """Offset of the last record of the last remembered batch; -1 when none."""
        return self.batches[-1].last_offset if self.batches else -1

    @property
    def next_sequence(self) -> int:
        """The base sequence the next new batch of this epoch must have."""
        return sequence_add(self.last_sequence, 1) if self.batches else 0

    def find_batch(self, base_sequence: int, last_sequence: int) -> BatchMetadata | None:
        for batch in self.batches:
            if batch.base_sequence == base_sequence and batch.last_sequence == last_sequence:
                return batch
        return None

    def is_expired(self, now_ms: int, idle_expiry_ms: int) -> bool:
        return now_ms - self.last_timestamp_ms > idle_expiry_ms


@dataclass(frozen=True, slots=True)
class Append:
    """Decision: the batch is new and in order; append it, then `apply` it."""


APPEND = Append()


@dataclass(frozen=True, slots=True)
class Duplicate:
    """Decision: a retry of a remembered batch; append nothing, answer with its offsets."""

    base_offset: int
    last_offset: int
    timestamp_ms: int  # when the original was appended
    base_sequence: int
    last_sequence: int

    @classmethod
    def of(cls, batch: BatchMetadata) -> Duplicate:
        return cls(batch.base_offset, batch.last_offset, batch.timestamp_ms,
                   batch.base_sequence, batch.last_sequence)


Decision = Append | Duplicate


@dataclass(frozen=True, slots=True)
class ProducerStateMetrics:
    """Counters since the table was built (the shell exports them as `*_total`)."""

    duplicates_total: int = 0
    out_of_order_total: int = 0
    fenced_total: int = 0
    unknown_producer_total: int = 0
    exhausted_total: int = 0  # new producers refused because the table was full
    expired_total: int = 0
    evicted_total: int = 0  # forgotten before their expiry to make room (EVICT_IDLE_MS)
    anomalies_total: int = 0  # applied batches that did not follow their producer's state


# ---------------------------------------------------------------------------------------
# The decision table of `check`
# ---------------------------------------------------------------------------------------

class Verdict(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: no Python-level hash of the name

    NEW_PRODUCER = "new_producer"            # unknown (or expired), sequence 0
    UNKNOWN_PRODUCER = "unknown_producer"    # unknown (or expired), sequence not 0
    FENCED = "fenced"                        # epoch below the remembered one
    NEW_EPOCH = "new_epoch"                  # higher epoch, sequence 0
    NEW_EPOCH_NOT_ZERO = "new_epoch_not_zero"
    DUPLICATE = "duplicate"                  # same epoch, a remembered batch
    IN_ORDER = "in_order"                    # same epoch, the next sequence
    NOT_FROM_ZERO = "not_from_zero"          # same epoch, no batch yet, sequence not 0
    GAP = "gap"                              # same epoch, ahead of the next sequence
    TOO_OLD = "too_old"                      # same epoch, behind it, not remembered


@dataclass(frozen=True, slots=True)
class _Rejection:
    reason: str
    counter: str
    message: str  # str.format fields: the `facts` of ProducerStateTable._reject
    metadata: tuple[str, ...]  # facts that go into ErrorInfo.metadata


_SEQUENCE_FACTS = ("producer_id", "producer_epoch", "expected_sequence")


_ACCEPTED = frozenset({Verdict.NEW_PRODUCER, Verdict.NEW_EPOCH, Verdict.IN_ORDER})

_REJECTIONS: dict[Verdict, _Rejection] = {
    Verdict.UNKNOWN_PRODUCER: _Rejection(
        "UNKNOWN_PRODUCER_ID", "unknown_producer_total",
        "producer {producer_id} has no state on this partition (never seen, or idle for more "
        "than {idle_expiry_ms} ms): expected base sequence 0, received {base_sequence}",
        _SEQUENCE_FACTS),
    Verdict.FENCED: _Rejection(
        "PRODUCER_FENCED", "fenced_total",
        "producer {producer_id} epoch {producer_epoch} is fenced: this partition has seen "
        "epoch {current_epoch}", ("producer_id", "producer_epoch", "current_epoch")),
    Verdict.NEW_EPOCH_NOT_ZERO: _Rejection(
        "OUT_OF_ORDER_SEQUENCE", "out_of_order_total",
        "producer {producer_id} epoch {producer_epoch} is new (previous epoch "
        "{current_epoch}) and must start at sequence 0: expected base sequence 0, received "
        "{base_sequence}", _SEQUENCE_FACTS),
    Verdict.NOT_FROM_ZERO: _Rejection(
        "OUT_OF_ORDER_SEQUENCE", "out_of_order_total",
        "producer {producer_id} epoch {producer_epoch} has no batch in this epoch yet: "
        "expected base sequence 0, received {base_sequence}", _SEQUENCE_FACTS),
    Verdict.GAP: _Rejection(
        "OUT_OF_ORDER_SEQUENCE", "out_of_order_total",
        "producer {producer_id} epoch {producer_epoch}: expected base sequence "
        "{expected_sequence}, received {base_sequence} (a gap after sequence {last_sequence})",
        _SEQUENCE_FACTS),
    Verdict.TOO_OLD: _Rejection(
        "OUT_OF_ORDER_SEQUENCE", "out_of_order_total",
        "producer {producer_id} epoch {producer_epoch}: expected base sequence "
        "{expected_sequence}, received {base_sequence}..{batch_last_sequence}, which is not "
        "one of the last {window} batches, so it cannot be deduplicated", _SEQUENCE_FACTS),
}


def judge(entry: ProducerEntry | None, producer_epoch: int, base_sequence: int,
          batch_last_sequence: int) -> Verdict:
    """Classify an idempotent batch against its producer's live entry (None: none)."""
    if entry is None:
        return Verdict.NEW_PRODUCER if base_sequence == 0 else Verdict.UNKNOWN_PRODUCER
    if producer_epoch < entry.producer_epoch:
        return Verdict.FENCED
    if producer_epoch > entry.producer_epoch:
        return Verdict.NEW_EPOCH if base_sequence == 0 else Verdict.NEW_EPOCH_NOT_ZERO
    if entry.find_batch(base_sequence, batch_last_sequence) is not None:
        return Verdict.DUPLICATE
    if not entry.batches:
        return Verdict.IN_ORDER if base_sequence == 0 else Verdict.NOT_FROM_ZERO
    if base_sequence == entry.next_sequence:
        return Verdict.IN_ORDER
    ahead = (base_sequence - entry.next_sequence) % SEQUENCE_MODULUS
    return Verdict.GAP if ahead < SEQUENCE_MODULUS // 2 else Verdict.TOO_OLD


# ---------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------

@dataclass
class ProducerStateTable:
    """Producer state of ONE partition. Single-threaded: only the partition owner calls it."""

    max_producers: int
    idle_expiry_ms: int
    window: int = DEFAULT_WINDOW
    evict_idle_ms: int | None = None  # None: min(EVICT_IDLE_MS, idle_expiry_ms)
    _entries: dict[int, ProducerEntry] = field(default_factory=dict, init=False, repr=False)
    # Each entry's snapshot bytes as of the last snapshot, with the entry they encode: a
    # snapshot packs only the producers that wrote since (10,000 producers took 28 ms of
    # the owner's event loop to pack whole).
    _packed: dict[int, tuple[ProducerEntry, bytes]] = field(default_factory=dict, init=False,
                                                          repr=False)
    _counters: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    # Offset of the last record of the last applied batch (any batch); -1 before any.
    _last_applied_offset: int = field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        assert self.max_producers >= 1, self.max_producers
        assert self.idle_expiry_ms >= 0, self.idle_expiry_ms
        assert 1 <= self.window <= WINDOW_MAX, self.window
        if self.evict_idle_ms is None:
            self.evict_idle_ms = min(EVICT_IDLE_MS, self.idle_expiry_ms)
        assert 0 <= self.evict_idle_ms <= self.idle_expiry_ms, self.evict_idle_ms
        self._counters = dict.fromkeys(ProducerStateMetrics.__dataclass_fields__, 0)

    # -- observability ------------------------------------------------------------------

    @property
    def producer_count(self) -> int:
        """Entries held in memory (expired ones stay until `expire` or a full table)."""
        return len(self._entries)

    @property
    def metrics(self) -> ProducerStateMetrics:
        return ProducerStateMetrics(**self._counters)

    @property
    def last_applied_offset(self) -> int:
        """Last offset covered by `apply` (or by the restored snapshot); -1 when none."""
        return self._last_applied_offset

    def entries(self) -> Mapping[int, ProducerEntry]:
        """Every entry held, expired or not (read-only view)."""
        return MappingProxyType(self._entries)

    def live_entries(self, now_ms: int) -> dict[int, ProducerEntry]:
        """The entries not expired at now_ms: the state that decides `check`."""
        return {pid: entry for pid, entry in self._entries.items()
                if not entry.is_expired(now_ms, self.idle_expiry_ms)}

    def entry(self, producer_id: int, now_ms: int) -> ProducerEntry | None:
        """The producer's entry if it is not expired at now_ms."""
        entry = self._entries.get(producer_id)
        if entry is None or entry.is_expired(now_ms, self.idle_expiry_ms):
            return None
        return entry

    # -- decisions ----------------------------------------------------------------------

    def check(self, producer_id: int, producer_epoch: int, base_sequence: int,
              record_count: int, now_ms: int) -> Decision:
        """Decide a batch before it is appended; raise AtomlogError when it is refused.

        Changes no decision: when a new producer finds the table full, it drops expired
        producers (as `expire` would) before refusing with RESOURCE_EXHAUSTED."""
        _validate_header(producer_id, producer_epoch, base_sequence, record_count)
        if producer_id == NO_PRODUCER_ID or base_sequence == NO_SEQUENCE:
            return APPEND
        entry = self.entry(producer_id, now_ms)
        batch_last_sequence = last_sequence_of(base_sequence, record_count)
        verdict = judge(entry, producer_epoch, base_sequence, batch_last_sequence)
        if verdict is Verdict.DUPLICATE:
            self._count("duplicates_total")
            return Duplicate.of(entry.find_batch(base_sequence, batch_last_sequence))
        if verdict in _REJECTIONS:
            raise self._reject(verdict, entry, producer_id, producer_epoch, base_sequence,
                               batch_last_sequence)
        assert verdict in _ACCEPTED, verdict
        if verdict is Verdict.NEW_PRODUCER:
            self._make_room(producer_id, now_ms)
        return APPEND

    def apply(self, producer_id: int, producer_epoch: int, base_sequence: int,
              last_sequence: int, base_offset: int, last_offset: int, timestamp_ms: int,
              *, control: bool = False) -> None:
        """Record an appended batch (live, after the append; or in replay, per header)."""
        assert 0 <= base_offset <= last_offset, (base_offset, last_offset)
        assert base_offset > self._last_applied_offset, (base_offset, self._last_applied_offset)
        assert 0 <= producer_id <= PRODUCER_ID_MAX, producer_id
        assert 0 <= producer_epoch <= PRODUCER_EPOCH_MAX, producer_epoch
        self._last_applied_offset = last_offset
        if producer_id == NO_PRODUCER_ID:
            return
        entry = self.entry(producer_id, timestamp_ms)
        if control:
            updated = _after_marker(entry, producer_id, producer_epoch, timestamp_ms)
        elif base_sequence == NO_SEQUENCE:
            return
        else:
            batch = BatchMetadata(base_sequence, last_sequence, base_offset, last_offset,
                                  timestamp_ms)
            updated = self._after_batch(entry, producer_id, producer_epoch, batch)
        if updated is not None:
            self._entries[producer_id] = updated

    def expire(self, now_ms: int) -> list[int]:
        """Drop producers idle for more than idle_expiry_ms at now_ms; return their ids."""
        expired = [pid for pid, entry in self._entries.items()
                   if entry.is_expired(now_ms, self.idle_expiry_ms)]
        for pid in expired:
            del self._entries[pid]
        self._count("expired_total", len(expired))
        return sorted(expired)

    # -- snapshots ----------------------------------------------------------------------

    def snapshot(self, covered_offset: int) -> bytes:
        """Encode the table; covered_offset is where replay resumes (exclusive end)."""
        assert covered_offset > self._last_applied_offset, (covered_offset,
                                                            self._last_applied_offset)
        entries, packed = self._entries, self._packed
        if len(packed) > len(entries):
            for gone in packed.keys() - entries.keys():
                del packed[gone]
        rows = []
        for producer_id in sorted(entries):
            entry = entries[producer_id]
            cached = packed.get(producer_id)
            if cached is None or cached[0] is not entry:
                # Entries are immutable: the same object packs to the same bytes, and an
                # older snapshot's covered offset already held its batches below it.
                cached = packed[producer_id] = (entry, _entry_bytes(entry, covered_offset))
            rows.append(cached[1])
        return _sealed(covered_offset, rows)

    @classmethod
    def restore(cls, data: bytes, max_producers: int, idle_expiry_ms: int,
                window: int = DEFAULT_WINDOW) -> tuple[ProducerStateTable, int]:
        """Rebuild from a snapshot: (table, covered_offset). Raises SnapshotCorrupt."""
        covered_offset, entries = decode_snapshot(data)
        table = cls(max_producers, idle_expiry_ms, window)
        for entry in entries:
            table._entries[entry.producer_id] = _trim(entry, window)
        table._last_applied_offset = covered_offset - 1
        return table, covered_offset

    # -- helpers ------------------------------------------------------------------------

    def _after_batch(self, entry: ProducerEntry | None, producer_id: int,
                     producer_epoch: int, batch: BatchMetadata) -> ProducerEntry:
        verdict = judge(entry, producer_epoch, batch.base_sequence, batch.last_sequence)
        if verdict is Verdict.IN_ORDER:
            batches = entry.batches + (batch,)
        else:  # a fresh start: expected for a new producer or epoch, else an anomaly
            if verdict not in _ACCEPTED:
                self._count("anomalies_total")
            batches = (batch,)
        entry = ProducerEntry(producer_id, producer_epoch, batch.timestamp_ms, batches)
        return _trim(entry, self.window)

    def _make_room(self, producer_id: int, now_ms: int) -> None:
        """A new producer on a full table: drop the expired ones, then those idle longer
        than evict_idle_ms (short-lived producers, one per job or task, fill a table long
        before their day's expiry); refused only when none of them is."""
        if len(self._entries) < self.max_producers:
            return
        self.expire(now_ms)
        if len(self._entries) < self.max_producers:
            return
        idle = [pid for pid, entry in self._entries.items()
                if now_ms - entry.last_timestamp_ms > self.evict_idle_ms]
        for pid in idle:
            del self._entries[pid]
        self._count("evicted_total", len(idle))
        if len(self._entries) < self.max_producers:
            return
        self._count("exhausted_total")
        first_free_ms = min(entry.last_timestamp_ms for entry in self._entries.values())
        retry_after_ms = max(first_free_ms + self.evict_idle_ms + 1 - now_ms, 1)
        raise AtomlogError(
            "RESOURCE_EXHAUSTED",
            f"partition tracks {len(self._entries)} producers, the limit "
            f"{LIMIT_NAME}={self.max_producers}, and none has been idle for more than "
            f"{self.evict_idle_ms} ms: producer {producer_id} cannot be added",
            {"limit": LIMIT_NAME, "max_producers": self.max_producers,
             "retry_after_ms": retry_after_ms})

    def _reject(self, verdict: Verdict, entry: ProducerEntry | None, producer_id: int,
                producer_epoch: int, base_sequence: int,
                batch_last_sequence: int) -> AtomlogError:
        rejection = _REJECTIONS[verdict]
        self._count(rejection.counter)
        facts = {
            "producer_id": producer_id, "producer_epoch": producer_epoch,
            "base_sequence": base_sequence, "batch_last_sequence": batch_last_sequence,
            "current_epoch": entry.producer_epoch if entry else -1,
            "last_sequence": entry.last_sequence if entry else NO_SEQUENCE,
            "expected_sequence": _expected_sequence(entry, producer_epoch),
            "window": self.window, "idle_expiry_ms": self.idle_expiry_ms,
        }
        metadata = {key: facts[key] for key in rejection.metadata}
        return AtomlogError(rejection.reason, rejection.message.format(**facts), metadata)

    def _count(self, counter: str, amount: int = 1) -> None:
        self._counters[counter] += amount


def _after_marker(entry: ProducerEntry | None, producer_id: int, producer_epoch: int,
                  timestamp_ms: int) -> ProducerEntry | None:
    """A marker's effect (see the module docstring); None: nothing to record."""
    if entry is None or producer_epoch > entry.producer_epoch:
        return ProducerEntry(producer_id, producer_epoch, timestamp_ms, ())
    if producer_epoch == entry.producer_epoch:
        return ProducerEntry(producer_id, producer_epoch, timestamp_ms, entry.batches)
    return None


def _expected_sequence(entry: ProducerEntry | None, producer_epoch: int) -> int:
    if entry is None or producer_epoch != entry.producer_epoch:
        return 0
    return entry.next_sequence


def _trim(entry: ProducerEntry, window: int) -> ProducerEntry:
    if len(entry.batches) <= window:
        return entry
    return ProducerEntry(entry.producer_id, entry.producer_epoch, entry.last_timestamp_ms,
                         entry.batches[-window:])


# Header fields from the network: (name, minimum, maximum).
_HEADER_RANGES = (
    ("producer_id", NO_PRODUCER_ID, PRODUCER_ID_MAX),
    ("producer_epoch", 0, PRODUCER_EPOCH_MAX),
    ("base_sequence", NO_SEQUENCE, SEQUENCE_MAX),
    ("record_count", 1, SEQUENCE_MAX),
)


def _validate_header(*values: int) -> None:
    for (name, minimum, maximum), value in zip(_HEADER_RANGES, values, strict=True):
        if not minimum <= value <= maximum:
            raise AtomlogError("INVALID_ARGUMENT",
                               f"batch header field {name}={value} is outside "
                               f"[{minimum}, {maximum}]", {"field": name})


# ---------------------------------------------------------------------------------------
# Snapshot format (version 1), little-endian:
#   header  magic "ALPS", version u16, reserved u16 (0), covered_offset i64, entries u32
#   entry   producer_id i64, producer_epoch u32, last_timestamp_ms i64, batches u8
#   batch   base_sequence i32, last_sequence i32, base_offset i64, last_offset i64,
#           timestamp_ms i64
#   trailer CRC32C (Castagnoli) u32 of every byte before it
# ---------------------------------------------------------------------------------------

SNAPSHOT_MAGIC = b"ALPS"
SNAPSHOT_VERSION = 1
_HEADER = struct.Struct("<4sHHqI")
_ENTRY = struct.Struct("<qIqB")
_BATCH = struct.Struct("<iiqqq")
_FILES = SnapshotFileNames("producer_snapshot")
snapshot_file_name = _FILES.name
parse_snapshot_file_name = _FILES.parse


def encode_snapshot(covered_offset: int, entries: Iterable[ProducerEntry]) -> bytes:
    """The snapshot of `entries`, every one packed here (ProducerStateTable.snapshot
    re-packs only the entries changed since its last one: the same bytes, which the tests
    check)."""
    entries = sorted(entries, key=lambda entry: entry.producer_id)
    return _sealed(covered_offset, [_entry_bytes(entry, covered_offset) for entry in entries])


def _entry_bytes(entry: ProducerEntry, covered_offset: int) -> bytes:
    assert all(batch.last_offset < covered_offset for batch in entry.batches), entry
    return _ENTRY.pack(entry.producer_id, entry.producer_epoch, entry.last_timestamp_ms,
                       len(entry.batches)) + b"".join([
        _BATCH.pack(batch.base_sequence, batch.last_sequence, batch.base_offset,
                    batch.last_offset, batch.timestamp_ms) for batch in entry.batches])


def _sealed(covered_offset: int, rows: list[bytes]) -> bytes:
    return seal(_HEADER.pack(SNAPSHOT_MAGIC, SNAPSHOT_VERSION, 0, covered_offset, len(rows))
                + b"".join(rows))


def decode_snapshot(data: bytes) -> tuple[int, list[ProducerEntry]]:
    """(covered_offset, entries) of an encoded snapshot; SnapshotCorrupt if not valid."""
    (_, _, _, covered_offset, count), body = unseal(data, _HEADER, SNAPSHOT_MAGIC,
                                                    SNAPSHOT_VERSION, "producer-state")
    return covered_offset, _decode_entries(body, _HEADER.size, count, covered_offset)


def _decode_entries(body: memoryview, position: int, count: int,
                    covered_offset: int) -> list[ProducerEntry]:
    entries: list[ProducerEntry] = []
    try:
        for _ in range(count):
            entry, position = _decode_entry(body, position)
            entries.append(entry)
    except struct.error as error:
        raise SnapshotCorrupt(f"snapshot ends inside entry {len(entries)}: {error}") from None
    if position != len(body):
        raise SnapshotCorrupt(f"{len(body) - position} unexpected bytes after {count} entries")
    _check_entries(entries, covered_offset)
    return entries


def _decode_entry(body: memoryview, position: int) -> tuple[ProducerEntry, int]:
    producer_id, epoch, last_timestamp_ms, batch_count = _ENTRY.unpack_from(body, position)
    position += _ENTRY.size
    rows = [_BATCH.unpack_from(body, position + index * _BATCH.size)
            for index in range(batch_count)]
    position += batch_count * _BATCH.size
    problem = _entry_problem(producer_id, rows)
    if problem:
        raise SnapshotCorrupt(f"producer {producer_id}: {problem}")
    batches = tuple(BatchMetadata(*row) for row in rows)
    return ProducerEntry(producer_id, epoch, last_timestamp_ms, batches), position


def _entry_problem(producer_id: int, rows: list[tuple[int, ...]]) -> str | None:
    """Check decoded values before building (asserting) value objects from them."""
    if not 0 < producer_id:
        return "producer id is not positive"
    for index, (base_seq, last_seq, base_offset, last_offset, _) in enumerate(rows):
        if not (0 <= base_seq <= SEQUENCE_MAX and 0 <= last_seq <= SEQUENCE_MAX):
            return f"batch {index} has a sequence out of range"
        if not 0 <= base_offset <= last_offset:
            return f"batch {index} has offsets out of order"
        if (last_seq - base_seq) % SEQUENCE_MODULUS != last_offset - base_offset:
            return f"batch {index} spans different numbers of sequences and offsets"
    for index, (previous, current) in enumerate(zip(rows, rows[1:]), start=1):
        if current[0] != sequence_add(previous[1], 1) or current[2] <= previous[3]:
            return f"batch {index} does not follow batch {index - 1}"
    return None


def _check_entries(entries: list[ProducerEntry], covered_offset: int) -> None:
    if covered_offset < 0:
        raise SnapshotCorrupt(f"covered offset {covered_offset} is negative")
    ids = [entry.producer_id for entry in entries]
    if ids != sorted(set(ids)):
        raise SnapshotCorrupt("producer ids are not unique and ascending")
    for entry in entries:
        if entry.batches and entry.batches[-1].last_offset >= covered_offset:
            raise SnapshotCorrupt(f"producer {entry.producer_id} has a batch at or above the "
                                  f"covered offset {covered_offset}")
