"""Durable subscription cursors of one partition: an append-only journal of CRC-framed
cursor entries plus periodic snapshots of every cursor (real file I/O; no asyncio, no
gRPC). docs/subscriptions.md has the formats and the owner's call order.

The directory (one per partition, owned by the store alone) holds:
- `<first sequence, 20 digits>.cursor_journal`: a header, then frames; frame n carries
  the journal sequence number n (one global counter per partition), a subscription name
  and one cursor entry (subscription_cursor.encode_entry), closed by a CRC32C.
- `<covered sequence, 20 digits>.cursor_snapshot`: every cursor after entries
  [0, covered); written atomically (tmp, fsync, rename, directory fsync). The last two
  are kept, and the journals the older of them needs; older files are deleted.

Contract with the partition owner (the only caller; one thread at a time, except
`fsync(ticket)`, `rotate(job)` and `write_snapshot(job)`, which may run on worker threads
meanwhile: they touch no cursor):

    entry = store.cursor(name).check_ack(...) / ...plan_*(...) or store.plan_create/
            plan_delete(...)                          # may raise; changes nothing
    seq = store.stage(StoreEntry(name, entry))        # applies it now, buffers the frame
    ... more checks and stages (each check sees every staged entry) ...
    ticket = store.sync_begin()                       # one write() of the staged frames
    store.fsync(ticket)                               # on a worker thread: group commit
    store.sync_end(ticket)                            # durable_end moves
    answer each request whose seq < store.durable_end; a no-op (check returned None)
    once durable_end reaches the appended_end seen when it was decided.

- Entries are applied when staged, before they are durable (as producer_state.py and
  txn_buffer.py apply a batch right after its append): the next check must see them.
  Nothing is answered before its fsync. If a write or fsync fails the store is broken
  (every call raises INTERNAL): the cursors are ahead of the disk; reopen the store
  (`CursorStore.open`), which recovers what is durable.
- `forget_below(log_start_offset)` after retention and once after opening (it is not
  journaled; see subscription_cursor.py).
- Snapshots (due every `snapshot_interval_entries` entries, or at once past
  `max_journal_bytes`: `snapshot_due()`), in five steps so the file I/O runs off the
  owner's thread while entries go on being staged and group-committed:

      job = store.snapshot_begin()      # after sync_end, no fsync in flight: writes the
                                        # staged frames, encodes every cursor at covered =
                                        # appended_end (the consistent point)
      store.rotate(job)                 # worker thread: fsync the journal up to covered,
                                        # then create + fsync the journal starting there
      store.rotate_end(job)             # durable_end = covered; later frames go to the new
                                        # journal (until then: staged only, no sync_begin)
      ... group commits go on ...
      store.write_snapshot(job)         # worker thread: the snapshot file (atomic) and the
                                        # deletion of obsolete files; at most one job
      store.snapshot_end(job)

  A crash at any moment leaves a valid directory: the new journal exists only once the
  old one is durable up to covered, and the snapshot file only once the new journal is
  durable, so recovery replays the new journal on top of whichever snapshot is newest
  readable. A failed step breaks the store like a failed fsync. `close()` while a job is
  in flight abandons its remaining file work (the job still owns the descriptors it uses
  until `rotate_end`). `snapshot()` / `maybe_snapshot()` run the five steps in the
  caller's thread. Whoever may reopen the directory while a step runs on a worker thread
  must serialize `CursorStore.open` with `rotate` and `write_snapshot` (the shell holds a
  lock around all three).

Replication (docs/replication.md, "Cursors"): the leader of a replicated partition opens
its store with `retain_frames=True`: it then keeps in memory a base (every cursor
encoded at a sequence number, `covered`) and every frame written from it on, and
`replication_read(position)` hands a follower the durable frames from its position, or
the base and the frames after it when the position is older than the base (a snapshot
rotated it away) or not in this store's history. A follower replaces its store with the
base (`install_snapshot`: built beside the directory, then swapped in by renames, so a
crash leaves the old store or the new, never a mixture) and appends the frames byte for
byte (`append_copied`: every frame checked before any is applied), at the leader's
sequence numbers, then syncs. A follower promoted to leader opens the directory as a
restart does.

Recovery (`open`): the newest snapshot that decodes (SnapshotCorrupt → the older one),
then every journal frame from its covered sequence on, in order. A torn tail of the
newest journal — a frame cut short, a last frame failing its CRC, or zeros to the end of
the file — is truncated (it was never acknowledged: the fsync did not return). Any other
bad frame, a sequence gap, a missing journal, or no usable snapshot where one is needed
→ AtomlogError("DATA_LOSS") naming the file and byte position: fail closed, never guess.
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice, pairwise
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import crc32c

from partition_server.snapshot_files import (
    TMP_SUFFIX,
    SnapshotCorrupt,
    SnapshotFileNames,
    fsync_directory,
    make_directory,
    seal,
    unseal,
    write_atomically,
)
from partition_server.subscription_cursor import (
    Created,
    CursorEntry,
    CursorLimits,
    Deleted,
    EntryCorrupt,
    SubscriptionCursor,
    decode_entry,
    encode_entry,
    plan_create,
)
from services import failpoints
from services.errors import AtomlogError
from services.topics import validate_topic_name

KIB, MIB = 1 << 10, 1 << 20
# Kafka has no bound on consumer groups; Pulsar's maxSubscriptionsPerTopic is unlimited by
# default. A thousand per partition keeps a snapshot of all of them bounded (worst case
# 1,000 cursors x 10,000 ranges x 16 bytes = 160 MB; a typical cursor is under 100 bytes).
DEFAULT_MAX_SUBSCRIPTIONS = 1_000
# Pulsar snapshots its transaction buffer every 1,000 changes (ARCHITECTURE.md).
DEFAULT_SNAPSHOT_INTERVAL_ENTRIES = 1_000
# A snapshot is forced past this much journal, however few entries (huge acks).
DEFAULT_MAX_JOURNAL_BYTES = 64 * MIB
# A replicating leader keeps every frame since its last snapshot in memory for followers;
# past this many bytes a snapshot is due (which starts the kept frames afresh).
MAX_RETAINED_FRAME_BYTES = 16 * MIB
# An entry is at most ~1 MiB: an Acked of subscription_cursor.MAX_RANGES_BOUND ranges.
MAX_FRAME_BYTES = 1 * MIB
SNAPSHOTS_KEPT = 2

LIMIT_SUBSCRIPTIONS = "partition.max_subscriptions"
LIMIT_JOURNAL = "subscription.max_journal_bytes"


@dataclass(frozen=True, slots=True)
class CursorStoreLimits:
    max_subscriptions: int = DEFAULT_MAX_SUBSCRIPTIONS
    snapshot_interval_entries: int = DEFAULT_SNAPSHOT_INTERVAL_ENTRIES
    max_journal_bytes: int = DEFAULT_MAX_JOURNAL_BYTES
    cursor: CursorLimits = field(default_factory=CursorLimits)

    def __post_init__(self) -> None:
        assert self.max_subscriptions >= 1, self
        assert self.snapshot_interval_entries >= 1, self
        assert self.max_journal_bytes >= 4 * KIB, self


class StoreEntry(NamedTuple):
    """One journal record: a cursor entry for the named subscription."""

    name: str
    entry: CursorEntry


class SyncTicket(NamedTuple):
    fd: int
    target: int  # durable_end once this fsync returned


@dataclass(eq=False)
class SnapshotJob:
    """One snapshot from snapshot_begin to snapshot_end. Built on the owner's thread;
    rotate and write_snapshot read it on a worker thread (they touch no cursor)."""

    covered: int  # the snapshot holds every entry below this sequence number
    data: bytes  # the encoded snapshot (encode_store_snapshot), taken at covered
    old_fd: int | None  # the journal to make durable up to covered; None: no rotation
    new_fd: int | None = None  # the journal starting at covered, once rotate made it
    abandoned: threading.Event = field(default_factory=threading.Event)  # close() ran
    written: bool = False  # the snapshot file is in place


@dataclass
class RecoveryReport:
    snapshot_covered: int | None = None  # covered sequence of the snapshot loaded
    corrupt_snapshots: list[str] = field(default_factory=list)  # "file: problem"
    entries_replayed: int = 0
    torn_bytes_truncated: int = 0
    journal_files: int = 0


# ---------------------------------------------------------------------------------------
# Formats, little-endian (docs/subscriptions.md):
#   journal header  magic "ALCJ", version u16 = 1, reserved u16 = 0, first_sequence u64,
#                   CRC32C u32 of the 16 bytes before it
#   frame           payload_length u32, CRC32C u32 of (sequence + payload), sequence u64,
#                   payload = name_length u8, name (ASCII), cursor entry
#   snapshot        header magic "ALCS", version u16 = 1, reserved u16 = 0,
#                   covered_sequence u64, cursor count u32; per cursor (ascending name):
#                   name_length u8, name, snapshot_length u32, cursor snapshot ("ALSC");
#                   trailer CRC32C u32 of every byte before it
# ---------------------------------------------------------------------------------------

JOURNAL_MAGIC = b"ALCJ"
SNAPSHOT_MAGIC = b"ALCS"
FORMAT_VERSION = 1
_JOURNAL_HEADER = struct.Struct("<4sHHQ")
_CRC = struct.Struct("<I")
JOURNAL_HEADER_SIZE = _JOURNAL_HEADER.size + _CRC.size
_FRAME = struct.Struct("<IIQ")
_SEQUENCE = struct.Struct("<Q")
_SNAPSHOT_HEADER = struct.Struct("<4sHHQI")
_SNAPSHOT_CURSOR = struct.Struct("<I")
_JOURNALS = SnapshotFileNames("cursor_journal")
_SNAPSHOTS = SnapshotFileNames("cursor_snapshot")
journal_file_name, parse_journal_file_name = _JOURNALS.name, _JOURNALS.parse
snapshot_file_name, parse_snapshot_file_name = _SNAPSHOTS.name, _SNAPSHOTS.parse


def validate_subscription_name(name: str) -> None:
    """Subscription names follow the topic name rules (partition.proto)."""
    try:
        validate_topic_name(name, internal_allowed=True)
    except AtomlogError as error:
        raise AtomlogError("INVALID_ARGUMENT", error.message.replace("topic name",
                                                                     "subscription name"),
                           {"field": "subscription"}) from None


def encode_journal_header(first_sequence: int) -> bytes:
    header = _JOURNAL_HEADER.pack(JOURNAL_MAGIC, FORMAT_VERSION, 0, first_sequence)
    return header + _CRC.pack(crc32c.crc32c(header))


def encode_frame(sequence: int, item: StoreEntry) -> bytes:
    name = item.name.encode("ascii")
    payload = bytes([len(name)]) + name + encode_entry(item.entry)
    assert len(payload) + _FRAME.size <= MAX_FRAME_BYTES, len(payload)
    crc = crc32c.crc32c(payload, crc32c.crc32c(_SEQUENCE.pack(sequence)))
    return _FRAME.pack(len(payload), crc, sequence) + payload


def decode_payload(payload: bytes | memoryview) -> StoreEntry:
    """(name, entry) of a frame payload whose CRC matched; EntryCorrupt otherwise."""
    if len(payload) < 2:
        raise EntryCorrupt("payload too short for a name")
    size = payload[0]
    try:
        name = bytes(payload[1:1 + size]).decode("ascii")
        validate_subscription_name(name)
    except (UnicodeDecodeError, AtomlogError) as error:
        raise EntryCorrupt(f"bad subscription name: {error}") from None
    return StoreEntry(name, decode_entry(payload[1 + size:]))


def encode_store_snapshot(covered: int, cursors: Mapping[str, SubscriptionCursor]) -> bytes:
    parts = [_SNAPSHOT_HEADER.pack(SNAPSHOT_MAGIC, FORMAT_VERSION, 0, covered, len(cursors))]
    for name in sorted(cursors):
        encoded, data = name.encode("ascii"), cursors[name].snapshot()
        parts += [bytes([len(encoded)]), encoded, _SNAPSHOT_CURSOR.pack(len(data)), data]
    return seal(b"".join(parts))


def decode_store_snapshot(data: bytes, limits: CursorLimits | None = None
                          ) -> tuple[int, dict[str, SubscriptionCursor]]:
    """(covered sequence, cursors); SnapshotCorrupt if anything is wrong."""
    fields, body = unseal(data, _SNAPSHOT_HEADER, SNAPSHOT_MAGIC, FORMAT_VERSION,
                          "subscription-store")
    _, _, _, covered, count = fields
    cursors: dict[str, SubscriptionCursor] = {}
    position, previous = _SNAPSHOT_HEADER.size, ""
    try:
        for _ in range(count):
            size = body[position]
            name = bytes(body[position + 1:position + 1 + size]).decode("ascii")
            position += 1 + size
            (length,) = _SNAPSHOT_CURSOR.unpack_from(body, position)
            position += _SNAPSHOT_CURSOR.size
            if position + length > len(body):
                raise SnapshotCorrupt(f"cursor {name!r} runs past the end")
            validate_subscription_name(name)
            if name <= previous:
                raise SnapshotCorrupt("subscription names are not unique and ascending")
            cursors[name] = SubscriptionCursor.restore(bytes(body[position:position + length]),
                                                       limits)
            position += length
            previous = name
    except (IndexError, struct.error, UnicodeDecodeError, AtomlogError) as error:
        raise SnapshotCorrupt(f"snapshot is malformed: {error}") from None
    if position != len(body):
        raise SnapshotCorrupt(f"{len(body) - position} unexpected bytes after the cursors")
    return covered, cursors


# ---------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------

class CursorStore:
    """Every subscription cursor of ONE partition, durably. Build it with `open`."""

    def __init__(self, directory: Path, limits: CursorStoreLimits,
                 cursors: dict[str, SubscriptionCursor], report: RecoveryReport) -> None:
        self.directory = directory
        self.limits = limits
        self.recovery = report
        self._cursors = cursors
        self._fd: int | None = None
        self._journal_first = 0
        self._journal_bytes = 0
        self._staged: list[bytes] = []
        self._staged_bytes = 0
        self._appended_end = 0  # next sequence number
        self._written_end = 0
        self._durable_end = 0
        self._sync_in_flight = False
        self._rotating: SnapshotJob | None = None  # between snapshot_begin and rotate_end
        self._snapshot_job: SnapshotJob | None = None  # until snapshot_end
        self._entries_since_snapshot = 0
        self._last_snapshot_bytes = 0
        self._broken: str | None = None
        self._closed = False
        # Replication (retain_frames): the base (covered, encoded cursors) and every frame
        # written since it, in sequence order (frame i has sequence covered + i).
        self._retain = False
        self._base: tuple[int, bytes] | None = None
        self._retained: list[bytes] = []
        self._retained_bytes = 0

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    def open(cls, directory: Path, limits: CursorStoreLimits | None = None,
             retain_frames: bool = False) -> CursorStore:
        """Recover the cursors of the partition from directory (created if missing).
        retain_frames: keep what `replication_read` serves (a replicating leader)."""
        limits = limits or CursorStoreLimits()
        directory = Path(directory)
        _finish_install(directory)
        make_directory(directory)
        for leftover in directory.glob("*" + TMP_SUFFIX):
            leftover.unlink()
        report = RecoveryReport()
        journals = sorted((first, directory / name) for name in os.listdir(directory)
                          if (first := parse_journal_file_name(name)) is not None)
        covered, cursors = _load_snapshot(directory, limits, journals, report)
        store = cls(directory, limits, cursors, report)
        store._retain = retain_frames
        store._replay(journals, covered)
        if retain_frames and (store._base is None or
                              store._base[0] + len(store._retained) != store._appended_end):
            # A new journal was started (or nothing was replayed): the base is now.
            store._set_base(store._appended_end, encode_store_snapshot(
                store._appended_end, store._cursors))
        return store

    def _replay(self, journals: list[tuple[int, Path]], covered: int) -> None:
        report = self.recovery
        needed = [i for i, (first, _) in enumerate(journals) if first <= covered]
        if not journals:
            if report.snapshot_covered is not None:
                raise _data_loss(self.directory, 0, "no journal file, but a snapshot exists: "
                                 "entries after it may be lost")
            self._start_journal(0)
            return
        if not needed:
            first, path = journals[0]
            raise _data_loss(path, 0, f"journal starts at entry {first}; entries from "
                             f"{covered} are missing")
        expected = journals[needed[-1]][0]
        last_path = journals[-1][1]
        for index in range(needed[-1], len(journals)):
            first, path = journals[index]
            if first != expected:
                raise _data_loss(path, 0, f"journal starts at entry {first}, the previous one "
                                 f"ends at {expected}")
            expected = self._replay_file(path, first, covered, path == last_path)
            report.journal_files += 1
        self._appended_end = self._written_end = self._durable_end = max(expected, covered)
        last_first = journals[-1][0]
        if expected < covered or not os.path.exists(last_path):
            # The journal ended before the snapshot's end, or its file was torn while
            # being created: continue in a new one.
            self._start_journal(self._appended_end)
            return
        self._fd = os.open(last_path, os.O_WRONLY | os.O_APPEND)
        os.fsync(self._fd)  # what was replayed may sit only in the page cache
        self._journal_first = last_first
        self._journal_bytes = os.fstat(self._fd).st_size

    def _replay_file(self, path: Path, first: int, covered: int, last: bool) -> int:
        """Apply the frames of one journal with sequence >= covered; returns the sequence
        after its last frame. Truncates a torn tail of the last journal."""
        data = path.read_bytes()
        header_problem, torn = _journal_header_problem(data, first)
        if header_problem:
            if last and torn and len(data) <= JOURNAL_HEADER_SIZE:  # torn while created
                path.unlink()
                self.recovery.torn_bytes_truncated += len(data)
                return first
            raise _data_loss(path, 0, header_problem)
        position, sequence = JOURNAL_HEADER_SIZE, first
        base_at = max(first, covered) if last and self._retain else None
        while position < len(data):
            problem, end, torn = _frame_problem(data, position, sequence)
            if problem is None:
                if sequence == base_at:
                    self._set_base(sequence, encode_store_snapshot(sequence, self._cursors))
                if sequence >= covered:
                    self._replay_entry(path, position, data[position + _FRAME.size:end])
                if base_at is not None and sequence >= base_at:
                    self._retain_frames([data[position:end]])
                sequence, position = sequence + 1, end
                continue
            if not (last and torn):
                raise _data_loss(path, position, problem)
            with open(path, "r+b") as handle:
                handle.truncate(position)
                handle.flush()
                os.fsync(handle.fileno())
            self.recovery.torn_bytes_truncated += len(data) - position
            break
        return sequence

    def _replay_entry(self, path: Path, position: int, payload: bytes) -> None:
        try:
            item = decode_payload(payload)
        except EntryCorrupt as error:
            raise _data_loss(path, position, f"entry does not decode: {error}") from None
        exists = item.name in self._cursors
        if exists == isinstance(item.entry, Created):
            what = "creates an existing" if exists else "changes an unknown"
            raise _data_loss(path, position, f"entry {what} subscription {item.name!r}")
        self._apply(item)
        self.recovery.entries_replayed += 1
        self._entries_since_snapshot += 1

    # -- reads ------------------------------------------------------------------------------

    def cursors(self) -> Mapping[str, SubscriptionCursor]:
        """Every cursor by subscription name (read-only view; change them only through
        check/plan + stage)."""
        return MappingProxyType(self._cursors)

    def cursor(self, name: str) -> SubscriptionCursor:
        cursor = self._cursors.get(name)
        if cursor is None:
            raise AtomlogError("UNKNOWN_SUBSCRIPTION", f"no subscription {name!r} on this "
                               "partition", {"subscription": name})
        return cursor

    @property
    def appended_end(self) -> int:
        """Sequence number the next staged entry gets (entries below it are applied)."""
        return self._appended_end

    @property
    def durable_end(self) -> int:
        """Entries below this sequence number are on disk (fsynced)."""
        return self._durable_end

    @property
    def journal_bytes(self) -> int:
        return self._journal_bytes + self._staged_bytes

    @property
    def entries_since_snapshot(self) -> int:
        return self._entries_since_snapshot

    @property
    def snapshot_in_flight(self) -> bool:
        """A snapshot job has begun and not ended (no other one may begin)."""
        return self._snapshot_job is not None

    @property
    def closed(self) -> bool:
        return self._closed

    # -- decisions --------------------------------------------------------------------------

    def plan_create(self, name: str, cumulative_end: int) -> StoreEntry | None:
        """CreateSubscription: the entry to stage, or None when it exists (its cursor is
        left unchanged). RESOURCE_EXHAUSTED at max_subscriptions; INVALID_ARGUMENT."""
        self._check_usable()
        validate_subscription_name(name)
        if name in self._cursors:
            return None
        if len(self._cursors) >= self.limits.max_subscriptions:
            raise AtomlogError(
                "RESOURCE_EXHAUSTED", f"partition has {len(self._cursors)} subscriptions, the "
                f"limit {LIMIT_SUBSCRIPTIONS}={self.limits.max_subscriptions}: {name!r} cannot "
                "be created", {"limit": LIMIT_SUBSCRIPTIONS})
        return StoreEntry(name, plan_create(cumulative_end))

    def plan_delete(self, name: str) -> StoreEntry:
        """DeleteSubscription: UNKNOWN_SUBSCRIPTION, or TRANSACTION_CONFLICT with pending
        acks."""
        self._check_usable()
        return StoreEntry(name, self.cursor(name).plan_delete())

    # -- writes -----------------------------------------------------------------------------

    def stage(self, item: StoreEntry) -> int:
        """Apply an entry (from a check/plan that just passed) and buffer its frame;
        returns its sequence number. RESOURCE_EXHAUSTED when the journal is twice
        max_journal_bytes (the owner is not snapshotting)."""
        self._check_usable()
        if self.journal_bytes > 2 * self.limits.max_journal_bytes:
            raise AtomlogError(
                "RESOURCE_EXHAUSTED", f"subscription journal of {self.directory} holds "
                f"{self.journal_bytes} bytes, twice {LIMIT_JOURNAL}="
                f"{self.limits.max_journal_bytes}: a snapshot is overdue",
                {"limit": LIMIT_JOURNAL})
        sequence = self._appended_end
        frame = encode_frame(sequence, item)
        self._apply(item)
        self._staged.append(frame)
        self._staged_bytes += len(frame)
        self._appended_end += 1
        self._entries_since_snapshot += 1
        return sequence

    def append(self, items: Sequence[StoreEntry]) -> int:
        """stage every item, then write them (one write); returns appended_end."""
        for item in items:
            self.stage(item)
        self.write()
        return self._appended_end

    def write(self) -> None:
        """One write() of every staged frame (no fsync)."""
        self._check_usable()
        if not self._staged:
            return
        # Frames at or past the covered sequence belong in the journal rotate() creates.
        assert self._rotating is None, "journal write while it is being rotated"
        frames = list(self._staged)
        data = b"".join(frames)
        self._staged.clear()
        self._staged_bytes = 0
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as error:
            self._broken = f"I/O error while writing the journal: {error}"
            raise
        self._journal_bytes += len(data)
        self._written_end = self._appended_end
        if self._retain:
            self._retain_frames(frames)

    def sync_begin(self) -> SyncTicket | None:
        """Write what is staged; the ticket to fsync (None: everything is durable)."""
        self.write()
        if self._durable_end == self._written_end:
            return None
        assert not self._sync_in_flight, "one fsync at a time"
        self._sync_in_flight = True
        return SyncTicket(self._fd, self._written_end)

    def fsync(self, ticket: SyncTicket) -> None:
        """The fsync itself; may run on a worker thread (touches no cursor)."""
        try:
            failpoints.fsync(ticket.fd)
        except OSError as error:
            self.fsync_failed(error)
            raise

    def fsync_failed(self, error: BaseException) -> None:
        """The ticket's sync, made elsewhere (the process's durability barrier), failed:
        the store is broken, as when fsync() raises."""
        self._broken = f"fsync of the journal failed: {error}"

    def sync_end(self, ticket: SyncTicket) -> None:
        """After fsync(ticket) returned (also after it raised: the store is broken then)."""
        self._sync_in_flight = False
        if self._broken is None:
            self._durable_end = max(self._durable_end, ticket.target)

    def sync(self) -> int:
        """sync_begin + fsync + sync_end in one call; returns durable_end."""
        ticket = self.sync_begin()
        if ticket is not None:
            try:
                self.fsync(ticket)
            finally:
                self.sync_end(ticket)
        self._check_usable()
        return self._durable_end

    def forget_below(self, log_start_offset: int) -> None:
        """Retention moved the log start: every cursor acknowledges what went."""
        self._check_usable()
        for cursor in self._cursors.values():
            cursor.forget_below(log_start_offset)

    def truncate_to(self, log_end_offset: int) -> list[str]:
        """After an accepted data loss cut the log back to log_end_offset: journal (and
        fsync, in the caller's thread) a Truncated entry for every cursor holding acks,
        pending acks or a read position above it, so the messages written there next are
        not taken as acknowledged. Returns those subscriptions' names."""
        self._check_usable()
        cut = [StoreEntry(name, entry) for name, cursor in sorted(self._cursors.items())
               if (entry := cursor.plan_truncate(log_end_offset)) is not None]
        if cut:
            if self.snapshot_due():
                self.snapshot()
            self.append(cut)
            self.sync()
        return [item.name for item in cut]

    # -- snapshots --------------------------------------------------------------------------

    def snapshot_due(self) -> bool:
        if self._snapshot_job is not None or self._closed:
            return False  # one at a time; stage() bounds the journal meanwhile
        if self.journal_bytes >= self.limits.max_journal_bytes or \
                self._retained_bytes >= MAX_RETAINED_FRAME_BYTES:
            return True
        # Amortized: never rewrite a big snapshot for a few small entries.
        return self._entries_since_snapshot >= self.limits.snapshot_interval_entries and \
            self.journal_bytes >= self._last_snapshot_bytes // 4

    def maybe_snapshot(self) -> bool:
        if not self.snapshot_due():
            return False
        self.snapshot()
        return True

    def snapshot(self) -> int:
        """Every step of a snapshot in the caller's thread (see snapshot_begin). Returns
        the covered sequence."""
        job = self.snapshot_begin()
        if job is None:
            return self._appended_end
        try:
            try:
                self.rotate(job)
            finally:
                self.rotate_end(job)
            self.write_snapshot(job)
        finally:
            self.snapshot_end(job)
        return job.covered

    def snapshot_begin(self) -> SnapshotJob | None:
        """Owner's thread, no fsync in flight, no snapshot job: write the staged frames and
        encode every cursor as of covered = appended_end. None: nothing was journaled since
        the snapshot at covered. Until rotate_end, entries are only staged."""
        self._check_usable()
        assert not self._sync_in_flight, "snapshot while an fsync is in flight"
        assert self._snapshot_job is None, "one snapshot job at a time"
        self.write()
        covered = self._appended_end
        rotate = self._journal_first != covered
        if not rotate and (self.directory / snapshot_file_name(covered)).exists():
            return None  # nothing was journaled since it
        data = encode_store_snapshot(covered, self._cursors)
        job = SnapshotJob(covered, data, self._fd if rotate else None)
        self._snapshot_job = job
        self._rotating = job if rotate else None
        self._entries_since_snapshot = 0
        self._last_snapshot_bytes = len(data)
        return job

    def rotate(self, job: SnapshotJob) -> None:
        """Any thread: fsync the journal (every entry below job.covered is then durable),
        then create the journal starting at job.covered (file and directory fsynced).
        Never the other way round: a crash must not leave a gap before the new journal."""
        if job.old_fd is None or job.abandoned.is_set():
            return
        try:
            os.fsync(job.old_fd)
            job.new_fd = _create_journal(self.directory, job.covered)
        except OSError as error:
            self._broken = f"I/O error while starting a new journal: {error}"
            raise

    def rotate_end(self, job: SnapshotJob) -> None:
        """Owner's thread, after rotate(job) returned (also after it raised): frames go to
        the new journal, durable_end reaches job.covered. A closed or broken store only
        drops the descriptors the job owns."""
        assert self._rotating is job or job.old_fd is None, "rotate_end of another job"
        self._rotating = None
        if job.old_fd is None:
            return
        if job.new_fd is None and not self._closed and self._broken is None:
            # rotate() did not finish (its caller stopped waiting): the journal may yet be
            # rotated behind our back, so nothing more may be written to either file.
            self._broken = "a journal rotation did not finish"
            job.abandoned.set()
        if self._closed or self._broken is not None or job.new_fd is None:
            if job.new_fd is not None:
                os.close(job.new_fd)
            if self._closed:
                os.close(job.old_fd)  # close() left it to the job
            job.old_fd = job.new_fd = None
            return
        os.close(job.old_fd)
        self._fd, job.old_fd, job.new_fd = job.new_fd, None, None
        self._journal_first = job.covered
        self._journal_bytes = JOURNAL_HEADER_SIZE
        self._durable_end = max(self._durable_end, job.covered)
        if self._retain:
            # Nothing was written since snapshot_begin (write refuses while rotating).
            assert self._written_end == job.covered, (self._written_end, job.covered)
            self._set_base(job.covered, job.data)

    def write_snapshot(self, job: SnapshotJob) -> None:
        """Any thread, after rotate_end(job): write the snapshot atomically (tmp, fsync,
        rename, directory fsync), then delete what no snapshot kept needs. Nothing after
        close() or a failure (the directory stays valid without it)."""
        assert self._rotating is not job, "write_snapshot before rotate_end"
        if job.abandoned.is_set() or self._broken is not None:
            return
        try:
            write_atomically(self.directory / snapshot_file_name(job.covered), job.data)
            job.written = True
            self._delete_obsolete()
        except OSError as error:
            self._broken = f"I/O error while snapshotting: {error}"
            raise

    def snapshot_end(self, job: SnapshotJob) -> None:
        """Owner's thread, after write_snapshot(job) returned (also after it raised, or
        was never called because an earlier step failed): the next job may begin."""
        assert self._snapshot_job is job, "snapshot_end of another job"
        self._snapshot_job = None
        job.abandoned.set()  # a step its caller stopped waiting for and that has not
        # started yet does nothing

    def close(self, sync: bool = True) -> None:
        """Write and sync what is staged, then close (idempotent). sync=False (and a
        broken store) just closes: staged entries are dropped, as a crash would."""
        if self._closed:
            return
        try:
            if sync and self._broken is None and self._fd is not None and \
                    self._rotating is None:  # mid-rotation staged frames are dropped
                self.sync()
        finally:
            self._closed = True
            if self._snapshot_job is not None:
                self._snapshot_job.abandoned.set()
            if self._fd is not None and self._rotating is None:
                os.close(self._fd)  # while rotating, the job owns it (rotate_end)
            self._fd = None

    # -- replication --------------------------------------------------------------------------

    @property
    def retains_frames(self) -> bool:
        return self._retain

    @property
    def replication_base(self) -> tuple[int, int]:
        """(covered sequence, encoded bytes) of the snapshot replication_read starts a
        follower from."""
        assert self._retain and self._base is not None, "opened without retain_frames"
        return self._base[0], len(self._base[1])

    def replication_read(self, position: int, max_bytes: int
                         ) -> tuple[bytes | None, int, bytes]:
        """A replicating leader's answer to a follower whose journal holds every frame
        below `position` (-1: nothing of this store's history): (snapshot to start over
        from or None, sequence of the first frame, frames). Only durable frames; at least
        one frame when there is one, then at most max_bytes."""
        self._check_usable()
        assert self._retain and self._base is not None, "opened without retain_frames"
        covered, data = self._base
        end = self._durable_end
        snapshot = None
        if position < covered or position > end:
            snapshot, position = data, covered
        first = position - covered
        frames: list[bytes] = []
        size = 0
        for frame in islice(self._retained, first, end - covered):
            if frames and size + len(frame) > max_bytes:
                break
            frames.append(frame)
            size += len(frame)
        return snapshot, position, b"".join(frames)

    def append_copied(self, data: bytes | memoryview) -> int:
        """A follower: the leader's frames, byte for byte, continuing at appended_end.
        Every frame is checked first (CRC, sequence, content, that it applies to the
        cursors as they will be); a bad one refuses them all (CORRUPT_BATCH), changing
        nothing. Then they are applied and staged; returns appended_end (sync next)."""
        self._check_usable()
        items: list[tuple[bytes, StoreEntry]] = []
        names = set(self._cursors)
        position, sequence = 0, self._appended_end
        while position < len(data):
            problem, end, _torn = _frame_problem(data, position, sequence)
            item = None
            if problem is None:
                try:
                    item = decode_payload(memoryview(data)[position + _FRAME.size:end])
                except EntryCorrupt as error:
                    problem = f"entry does not decode: {error}"
            if item is not None and (item.name in names) == isinstance(item.entry, Created):
                what = "creates an existing" if item.name in names else "changes an unknown"
                problem = f"entry {what} subscription {item.name!r}"
            if problem is not None:
                raise AtomlogError("CORRUPT_BATCH", f"cursor frames from the leader refused "
                                   f"at entry {sequence} (byte {position}): {problem}; nothing "
                                   "applied", {"sequence": str(sequence)})
            if isinstance(item.entry, Created):
                names.add(item.name)
            elif isinstance(item.entry, Deleted):
                names.discard(item.name)
            items.append((bytes(data[position:end]), item))
            position, sequence = end, sequence + 1
        for frame, item in items:
            self._apply(item)
            self._staged.append(frame)
            self._staged_bytes += len(frame)
            self._appended_end += 1
            self._entries_since_snapshot += 1
        return self._appended_end

    def _set_base(self, covered: int, data: bytes) -> None:
        self._base = (covered, data)
        self._retained = []
        self._retained_bytes = 0

    def _retain_frames(self, frames: list[bytes]) -> None:
        self._retained.extend(frames)
        self._retained_bytes += sum(len(frame) for frame in frames)

    # -- helpers ----------------------------------------------------------------------------

    def _apply(self, item: StoreEntry) -> None:
        name, entry = item
        if isinstance(entry, Created):
            assert name not in self._cursors, name
            self._cursors[name] = SubscriptionCursor.created(entry, self.limits.cursor)
            return
        self._cursors[name].apply(entry)
        if isinstance(entry, Deleted):
            del self._cursors[name]

    def _start_journal(self, first: int) -> None:
        self._fd = _create_journal(self.directory, first)
        self._journal_first = first
        self._journal_bytes = JOURNAL_HEADER_SIZE
        self._appended_end = self._written_end = self._durable_end = max(first,
                                                                         self._appended_end)

    def _delete_obsolete(self) -> None:
        """Keep the newest SNAPSHOTS_KEPT snapshots and the journals they need."""
        snapshots = sorted((covered, self.directory / name)
                           for name in os.listdir(self.directory)
                           if (covered := parse_snapshot_file_name(name)) is not None)
        doomed = [path for _, path in snapshots[:-SNAPSHOTS_KEPT]]
        # With a single snapshot, the fallback is a full replay: keep the journals from 0.
        oldest_kept = snapshots[-SNAPSHOTS_KEPT][0] if len(snapshots) >= SNAPSHOTS_KEPT else 0
        journals = sorted((first, self.directory / name)
                          for name in os.listdir(self.directory)
                          if (first := parse_journal_file_name(name)) is not None)
        for (_, path), (next_first, _) in pairwise(journals):
            if next_first <= oldest_kept:
                doomed.append(path)  # every entry of it is below every kept snapshot
        for path in doomed:
            path.unlink(missing_ok=True)
        if doomed:
            fsync_directory(self.directory)

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"cursor store {self.directory} is closed")
        if self._broken is not None:
            raise AtomlogError("INTERNAL", f"cursor store {self.directory} failed: "
                               f"{self._broken}; reopen it (recovery truncates a torn tail)")


# ---------------------------------------------------------------------------------------
# Recovery helpers
# ---------------------------------------------------------------------------------------

def _load_snapshot(directory: Path, limits: CursorStoreLimits,
                   journals: list[tuple[int, Path]], report: RecoveryReport
                   ) -> tuple[int, dict[str, SubscriptionCursor]]:
    """(covered, cursors) of the newest snapshot that decodes; (0, {}) when there is
    none and the journals start at entry 0."""
    snapshots = sorted(((covered, directory / name) for name in os.listdir(directory)
                        if (covered := parse_snapshot_file_name(name)) is not None),
                       reverse=True)
    for covered, path in snapshots:
        try:
            stored, cursors = decode_store_snapshot(path.read_bytes(), limits.cursor)
            if stored != covered:
                raise SnapshotCorrupt(f"covers {stored}, its name says {covered}")
        except SnapshotCorrupt as error:
            report.corrupt_snapshots.append(f"{path.name}: {error}")
            continue
        report.snapshot_covered = covered
        return covered, cursors
    if snapshots and not (journals and journals[0][0] == 0):
        raise _data_loss(snapshots[0][1], 0, "no snapshot is readable and the journals do "
                         f"not start at entry 0 ({'; '.join(report.corrupt_snapshots)})")
    return 0, {}


def _journal_header_problem(data: bytes, first: int) -> tuple[str | None, bool]:
    """(problem or None, whether the header may be a torn write)."""
    if len(data) < JOURNAL_HEADER_SIZE:
        return f"journal is {len(data)} bytes, shorter than its header", True
    magic, version, reserved, stored_first = _JOURNAL_HEADER.unpack_from(data, 0)
    (crc,) = _CRC.unpack_from(data, _JOURNAL_HEADER.size)
    if magic != JOURNAL_MAGIC or crc != crc32c.crc32c(data[:_JOURNAL_HEADER.size]):
        return "journal header has a bad magic or CRC32C", True
    if version != FORMAT_VERSION or reserved != 0:
        return f"unsupported journal version {version} (reserved {reserved})", False
    if stored_first != first:
        return f"journal header says it starts at entry {stored_first}, its name {first}", False
    return None, False


def _frame_problem(data: bytes, position: int, sequence: int) -> tuple[str | None, int, bool]:
    """(problem or None, end of the frame, whether a problem is a torn tail)."""
    rest = len(data) - position
    if rest < _FRAME.size:
        return f"frame header cut short ({rest} bytes)", len(data), True
    length, crc, stored_sequence = _FRAME.unpack_from(data, position)
    end = position + _FRAME.size + length
    if _FRAME.size + length > MAX_FRAME_BYTES:
        return (f"frame length {length} exceeds {MAX_FRAME_BYTES}", end,
                end >= len(data) or _zeros_from(data, position))
    if end > len(data):
        return f"frame of {length} bytes cut short at {rest - _FRAME.size}", end, True
    payload = memoryview(data)[position + _FRAME.size:end]
    computed = crc32c.crc32c(payload, crc32c.crc32c(_SEQUENCE.pack(stored_sequence)))
    if computed != crc:
        return (f"frame CRC32C mismatch: stored {crc:#010x}, computed {computed:#010x}", end,
                end == len(data) or _zeros_from(data, position)
                or _zeroed_sectors_from(data) < end)
    if stored_sequence != sequence:
        return f"frame has entry {stored_sequence}, expected {sequence}", end, False
    return None, end, False


def _zeros_from(data: bytes, position: int) -> bool:
    """Only zero bytes from position to the end (a file extended but never written)."""
    return not any(memoryview(data)[position:])


SECTOR = 512


def _zeroed_sectors_from(data: bytes) -> int:
    """Where the file's trailing run of whole zero sectors begins (its length if none).
    A power cut can keep a write's first sectors and lose the rest, which read back as
    zeros to the end of the file: a frame whose bytes reach into such a run was being
    written, not damaged after it was synced (a synced frame is never followed by
    sectors that were never written)."""
    zeros_from = len(data.rstrip(b"\0"))
    aligned = -(-zeros_from // SECTOR) * SECTOR
    return aligned if aligned < len(data) else len(data)


def _data_loss(path: Path, position: int, detail: str) -> AtomlogError:
    return AtomlogError(
        "DATA_LOSS", f"subscription cursors: corrupt {path} at position {position}: {detail}; "
        "the partition's subscriptions refuse to load until an operator acts",
        {"file": str(path), "position": position})


INSTALL_SUFFIX = ".new"
RETIRED_SUFFIX = ".old"


def install_snapshot(directory: Path, data: bytes,
                     limits: CursorStoreLimits | None = None) -> int:
    """A follower starts over from its leader's snapshot (encode_store_snapshot bytes):
    replace the store in `directory` (closed) by one holding exactly that snapshot and an
    empty journal from its covered sequence. Built and fsynced in `<directory>.new`, then
    swapped in by two renames and a parent fsync; `open` finishes a swap a crash cut
    short. Returns the covered sequence. SnapshotCorrupt (nothing changed) if it does not
    decode."""
    limits = limits or CursorStoreLimits()
    directory = Path(directory)
    covered, _cursors = decode_store_snapshot(data, limits.cursor)  # check before use
    building = directory.with_name(directory.name + INSTALL_SUFFIX)
    retired = directory.with_name(directory.name + RETIRED_SUFFIX)
    _finish_install(directory)
    if not directory.exists():
        # So that a `.new` without the store beside it always means "swap it in".
        make_directory(directory)
    building.mkdir()
    write_atomically(building / snapshot_file_name(covered), data)
    os.close(_create_journal(building, covered))  # fsyncs the journal and `building`
    directory.rename(retired)
    building.rename(directory)
    fsync_directory(directory.parent)
    _remove_tree(retired)
    return covered


def _finish_install(directory: Path) -> None:
    """After a crash during install_snapshot: a complete `.new` whose swap did not
    finish goes in; a `.new` still being built (the store is still in place: it exists
    before building begins) and a retired store go."""
    building = directory.with_name(directory.name + INSTALL_SUFFIX)
    retired = directory.with_name(directory.name + RETIRED_SUFFIX)
    if building.exists():
        if directory.exists():
            _remove_tree(building)  # built only partly: the swap begins after it is whole
        else:
            building.rename(directory)
            fsync_directory(directory.parent)
    elif retired.exists() and not directory.exists():
        retired.rename(directory)  # not reachable by install_snapshot's order; be safe
        fsync_directory(directory.parent)
    _remove_tree(retired)


def _remove_tree(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def _create_journal(directory: Path, first: int) -> int:
    """A new journal starting at entry `first`, its header and name durable; its fd."""
    path = directory / journal_file_name(first)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
    try:
        header = encode_journal_header(first)
        assert len(header) == JOURNAL_HEADER_SIZE
        os.write(fd, header)
        os.fsync(fd)
        fsync_directory(directory)
    except OSError:
        os.close(fd)
        raise
    return fd


__all__ = [
    "CursorStore", "CursorStoreLimits", "RecoveryReport", "SnapshotJob", "StoreEntry",
    "SyncTicket", "install_snapshot",
    "decode_payload", "decode_store_snapshot", "encode_frame", "encode_journal_header",
    "encode_store_snapshot", "journal_file_name", "parse_journal_file_name",
    "parse_snapshot_file_name", "snapshot_file_name", "validate_subscription_name",
]
