"""The segmented log of one partition: append, group-commit flush, read, look-ups,
roll, retention, truncation and crash recovery. No gRPC, no threads, no asyncio: the
partition's owner task calls it, one call at a time (it is not thread-safe).

Files in the partition directory (formats in docs/record-format.md):
- `<base_offset:020d>.log`: record batches back to back, exactly as the clients sent them
  except for the server-stamped base_offset and log_append_time_ms.
- `<base_offset:020d>.index`: sparse offset/time index of a *sealed* segment (derived data:
  the active segment's index lives in memory and is rebuilt from the .log on open).
- `recovery-point.json`: an offset below which everything was fsynced (written lazily
  after flushes, so it lags; used to tell a torn tail from lost acknowledged data).
- `data-loss.json`: present while the partition refuses to serve (DATA_LOSS).
- `*.deleted`: a deleted segment's files, renamed (durably) and not unlinked yet; an open
  removes them.

Durability contract: `append` writes (no fsync); `flush` fsyncs and moves the high
watermark to the log end. Rolling a segment fsyncs the old one first, so only the last
segment can ever hold unflushed bytes — corruption anywhere else is data loss. A roll's
disk work (four fsyncs) can run on another thread (`roll_begin`, `RollJob.run`,
`roll_end`): the partition owner does so, so that its event loop never waits for the disk;
the log takes no appends in between.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from partition_server import direct_io, native, record_batch
from partition_server import segment as seg_mod
from partition_server.record_batch import (ATTR_CONTROL, DEFAULT_MAX_BATCH_BYTES, INT64_MIN,
                                           LENGTH_FIELD_END, BatchHeader,
                                           parse_header)
from partition_server.segment import (INDEX_SUFFIX, POSITION_MAX, RELATIVE_OFFSET_MAX,
                                      ScanFailure, Segment, SparseIndex, check_batches,
                                      parse_segment_name, scan, walk_headers)
from partition_server.snapshot_files import make_directory
from services import failpoints
from services.errors import AtomlogError

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
DAY_MS = 24 * 3600 * 1000
RECOVERY_POINT_FILE = "recovery-point.json"
CLEAN_SHUTDOWN_KEY = "clean_shutdown"  # in RECOVERY_POINT_FILE, written by close() only
DATA_LOSS_FILE = "data-loss.json"
RECENT_STARTS = 64  # where the latest appended batches begin, kept for reads from them
TMP_SUFFIX = ".tmp"
# A deleted segment's files are renamed with this suffix (the directory's fsync makes that
# durable) and unlinked later, elsewhere: freeing a 256 MiB file's blocks took 57-146 ms
# on this machine's ext4. An open removes any left by a crash.
DELETED_SUFFIX = ".deleted"
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


@dataclass(frozen=True)
class LogConfig:
    """Per-partition storage settings. Defaults follow Kafka's topic defaults unless noted."""

    # Roll the active segment before it would pass this size (Kafka segment.bytes: 1 GiB).
    # At most 2 GiB: index positions are uint32 and batches start below 2^31.
    segment_bytes: int = 1 * GIB
    # Roll the active segment once its first batch is this old (Kafka segment.ms: 7 days).
    segment_ms: int = 7 * DAY_MS
    # Delete the oldest sealed segments while the rest still hold at least this many bytes;
    # -1 = no size limit (Kafka retention.bytes).
    retention_bytes: int = -1
    # Delete sealed segments whose last batch was appended longer ago; -1 = keep forever
    # (Kafka retention.ms: 7 days).
    retention_ms: int = 7 * DAY_MS
    # One index entry per this many bytes of batches (Kafka index.interval.bytes: 4 KiB).
    index_interval_bytes: int = 4 * KIB
    # Largest batch `append` accepts (partition.max_batch_bytes; Kafka max.message.bytes).
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    # Rewrite recovery-point.json after a flush at most this often. Lower = less data
    # treated as a possibly torn tail after a crash; every write costs a small file rename.
    recovery_point_interval_ms: int = 1_000
    # Open: check every batch of every segment (CRC32C), not just the last segment's and
    # the sealed segments' ends and chaining. O(data) at start-up.
    verify_all_segments_on_open: bool = False
    # Reads check each returned batch's length, offsets and CRC32C before serving it; a
    # mismatch puts the partition in DATA_LOSS. Cost: CRC32C at ~14 GB/s plus ~1 us per
    # batch (page-cache reads measured 7.8 GB/s with 64 KiB batches, 1.6 GB/s with 1 KiB).
    verify_reads: bool = True
    # File descriptors kept open for sealed segments (LRU); the active one is always open.
    max_open_segment_files: int = 64

    def __post_init__(self) -> None:
        checks = [
            (0 < self.segment_bytes <= POSITION_MAX + 1, "segment_bytes must be in 1..2 GiB"),
            (self.segment_ms > 0, "segment_ms must be positive"),
            (self.retention_bytes >= -1, "retention_bytes must be >= -1"),
            (self.retention_ms >= -1, "retention_ms must be >= -1"),
            (self.index_interval_bytes > 0, "index_interval_bytes must be positive"),
            (0 < self.max_batch_bytes < 2**31, "max_batch_bytes must be in 1..2^31-1"),
            (self.recovery_point_interval_ms >= 0, "recovery_point_interval_ms must be >= 0"),
            (self.max_open_segment_files >= 1, "max_open_segment_files must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class DataLoss:
    """Corruption before the log tail: the partition refuses to serve until an operator
    calls `recover_data_loss(file, offset)` with these values."""

    path: str  # absolute path of the segment file
    position: int  # byte position of the first bad batch (the last good one ends here)
    offset: int  # the offset that batch should have had
    detail: str
    detected_unix_ms: int

    @property
    def file_name(self) -> str:
        return Path(self.path).name

    def error(self) -> AtomlogError:
        return AtomlogError(
            "DATA_LOSS",
            f"corrupt log {self.path} at position {self.position} (offset {self.offset}): "
            f"{self.detail}; the partition refuses to serve until an operator recovers it",
            {"file": self.path, "position": self.position, "offset": self.offset})


@dataclass(frozen=True)
class SegmentInfo:
    base_offset: int
    next_offset: int
    size_bytes: int
    path: str
    max_timestamp_ms: int
    last_append_time_ms: int | None


@dataclass(frozen=True)
class SegmentSpan:
    """Where a run of batches lies in one segment file: [position, end_position) of
    `path`, the first batch at `first_offset`. For a reader on another thread, which
    opens the file itself and walks it with segment.walk_headers."""
    segment_base_offset: int
    path: Path
    position: int
    first_offset: int
    end_position: int


@dataclass
class RecoveryReport:
    """What opening (or recovering) the log did, for the owner to log and count."""

    truncated_bytes: int = 0  # torn tail cut off the last segment
    truncated_at_offset: int | None = None
    rebuilt_index_files: list[str] = field(default_factory=list)
    duration_ms: float = 0.0
    # The last segment was trusted as closed cleanly (its index file and the tail after
    # the index's last entry checked) instead of being read batch by batch.
    clean_shutdown: bool = False
    # The recovery point found at open: everything below it had been fsynced (a
    # write-ahead file's replay need not rewrite it).
    recovery_point: int = 0


@dataclass(frozen=True)
class DataLossRecovery:
    truncated_at_offset: int
    removed_bytes: int
    high_watermark: int
    data_loss: DataLoss | None  # set if the log, re-opened, found another corruption


def _now_ms() -> int:
    return int(time.time() * 1000)


_NATIVE_APPEND_STEP = getattr(native.core, "log_append_step", None)


class PartitionLog:
    """The segmented log of one partition. See the module docstring."""

    # The native core's append of a group in one call (partition_server/rust/src/
    # log_append.rs), used by `append_parsed`; None: the Python path, the reference
    # (tests/test_native_log_append.py sets it per log to compare the two).
    _append_step = _NATIVE_APPEND_STEP

    def __init__(self, directory: str | os.PathLike, config: LogConfig | None = None, *,
                 clock_ms: Callable[[], int] = _now_ms, direct_copies: bool = False,
                 trust_tail: bool = True) -> None:
        """`direct_copies`: `append_copied` writes around the page cache (O_DIRECT,
        partition_server/direct_io.py), as a follower's log does; where the file system
        refuses O_DIRECT it writes buffered. `trust_tail=False`: a reopen after a failed
        write or fsync in this process, whose caller cuts the log back (or rewrites it from
        the write-ahead file) next. The open then keeps the recovery point it found instead
        of raising it to the log end: after a writeback error the kernel may have dropped
        the tail's pages while later fsyncs succeed, so the tail proves nothing, and a
        crash before the cut must not find it recorded as durable."""
        self.directory = Path(directory).absolute()
        self.config = config or LogConfig()
        self._clock_ms = clock_ms
        self._trust_tail = trust_tail
        self._direct_copies = direct_copies and direct_io.supported()
        self._direct: direct_io.DirectAppender | None = None  # on the active segment
        self._segments: list[Segment] = []
        self._bases: list[int] = []
        self._open_sealed: OrderedDict[int, Segment] = OrderedDict()
        self._log_end_offset = 0
        self._high_watermark = 0
        self._hw_segment: Segment | None = None  # where the high watermark is, for reads
        self._hw_position = 0
        # Where the latest appended batches begin: base offset -> (segment, position), the
        # last RECENT_STARTS of them. A follower's next fetch (and a tailing consumer's)
        # begins at one, found here instead of by walking headers from the sparse index
        # entry below it. A cut or a reload makes new Segment objects, so an entry of a
        # segment that is gone or was cut never matches (`_position_of`).
        self._recent_starts: dict[int, tuple[Segment, int]] = {}
        self._last_data_offset = -1  # last non-control offset below the high watermark
        self._last_data_offset_written = -1  # ... below the log end
        # Flushes begun and not ended, oldest first: (target, segment, position,
        # last data offset) as of flush_begin. The owner pipelines group commits, so
        # several may be pending (their fsyncs overlap); they end in order.
        self._flush_pending: deque[tuple[int, Segment, int, int]] = deque()
        self._durable_offset = 0  # everything below was fsynced
        self._recovery_point_written = 0
        self._recovery_point_written_ms = INT64_MIN
        # Recovery-point writes are serialized, and each one a caller makes (lowering it
        # before a cut, a clean shutdown) begins a new generation: a deferred periodic
        # write of an older generation is dropped, so it never lands after a lower one.
        self._recovery_point_lock = threading.Lock()
        self._recovery_point_generation = 0
        self._recovery_point_deferred = False  # a periodic write is queued or running
        # Set by an owner on an event loop: runs a periodic recovery-point write
        # elsewhere (a worker thread), as the rename blocks for up to milliseconds
        # under fsync load (ext4's auto_da_alloc). None: written inline.
        self.defer_recovery_point: Callable[[Callable[[], None]], object] | None = None
        # Set by an owner on an event loop likewise: unlinks the files retention and
        # DeleteRecords deleted elsewhere (`unlink_files` on a worker thread), called where
        # they run. None: unlinked inline.
        self.defer_unlink: Callable[[list[Path]], object] | None = None
        # Set by an owner likewise: told (on whatever thread found it) when corruption
        # before the tail is found while the log serves (a read's check), so the
        # partition goes to DATA_LOSS as a load finding it does. None: nobody is told.
        self.on_data_loss: Callable[[DataLoss], object] | None = None
        self._doomed: list[Path] = []  # renamed, the rename synced, not unlinked yet
        self._last_append_time_ms = INT64_MIN
        self._data_loss: DataLoss | None = None
        self._broken: str | None = None
        # A write-ahead checkpoint's fsync of the active segment in flight (wal.py): until
        # its verdict no recovery point is written, and a close syncs nothing (see
        # `checkpoint_ended`); `_closing`: the owner began to close, no checkpoint begins.
        self._checkpointing = False
        self._closing = False
        self._closed = False
        self._rolling: RollJob | None = None  # between roll_begin and roll_end
        # partition.durability=wal (partition_server/wal.py): its writes also go to the
        # server's write-ahead file as frames, its cuts as CUT frames first; its flushes
        # end with durable=False and a checkpoint (checkpoint_begin/end) moves the
        # recovery point. Set by the owner once the log is loaded and replayed.
        self.wal = None
        self._cut_generation = 0  # bumped by every cut: a checkpoint begun before is void
        self.recovery = RecoveryReport()
        make_directory(self.directory)
        self._dir_fd = os.open(self.directory, os.O_RDONLY)
        try:  # one owner per partition, also across processes
            fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._dir_fd)
            raise RuntimeError(f"partition log {self.directory} is open elsewhere") from None
        try:
            self._load()
        except BaseException:
            self._close_files()
            raise

    # --- State ----------------------------------------------------------------------------

    @property
    def log_start_offset(self) -> int:
        return self._segments[0].base_offset if self._segments else 0

    @property
    def last_append_time_ms(self) -> int:
        """The latest append time stamped (or found in the segments at open); appends
        stamp at least this, so append times never go back."""
        return self._last_append_time_ms

    @property
    def log_end_offset(self) -> int:
        """The offset the next appended batch gets (written, maybe not yet flushed)."""
        return self._log_end_offset

    @property
    def high_watermark(self) -> int:
        """End of the flushed log (exclusive): what others may read and acknowledge."""
        return self._high_watermark

    @property
    def data_loss(self) -> DataLoss | None:
        return self._data_loss

    @property
    def segment_count(self) -> int:
        return len(self._segments)

    @property
    def size_bytes(self) -> int:
        return sum(segment.size for segment in self._segments)

    def segments(self) -> list[SegmentInfo]:
        return [SegmentInfo(s.base_offset, s.next_offset, s.size, str(s.log_path),
                            s.max_timestamp_ms, s.last_append_time_ms) for s in self._segments]

    def index_entries(self, base_offset: int) -> list[tuple[int, int, int]]:
        """(offset, position, max_timestamp_before) of one segment's sparse index."""
        return self._index(self._segments[self._bases.index(base_offset)]).entries()

    @property
    def _active(self) -> Segment:
        return self._segments[-1]

    def _check_serving(self) -> None:
        if self._closed:
            raise RuntimeError(f"partition log {self.directory} is closed")
        if self._data_loss is not None:
            raise self._data_loss.error()
        if self._broken is not None:
            raise AtomlogError("INTERNAL", f"partition log {self.directory} failed: {self._broken}; "
                               "reopen it (recovery truncates any torn tail)")

    # --- Append and flush -------------------------------------------------------------------

    def append(self, batches: Sequence[bytes | bytearray | memoryview]) -> list[int]:
        """Append whole batches (already validated by the caller: header, CRC, size) with
        consecutive offsets; return each batch's base offset. Stamps base_offset and
        log_append_time_ms (the server's clock, never decreasing) in the written copy.
        Writes with writev, no fsync: call `flush` before acknowledging. On a header
        problem nothing is written; an OSError leaves the log failed until reopened."""
        max_batch_bytes = self.config.max_batch_bytes
        return self.append_parsed([(batch, parse_header(batch, max_batch_bytes=max_batch_bytes))
                                   for batch in batches])

    def append_parsed(self, items: Sequence[tuple[bytes | bytearray | memoryview, BatchHeader]]
                      ) -> list[int]:
        """`append` for batches whose headers the caller parsed and validated already
        (the owner's produce path: the service ran validate_batch on each). Checks that
        each header's size is its batch's length and its size is within the limit.

        With the native core, a group that rolls nothing is checked, stamped, planned
        and framed for the write-ahead file in one native call (`_append_step`), written,
        and its facts applied here: the reference's work (`_append`: `_plan`,
        `_write_planned`, WalTap.wrote) with the same bytes, answers and errors, in
        about a fifth of its Python-level calls (docs/native-core.md)."""
        step = self._append_step
        if step is None or not items or self._closed or self._data_loss is not None or \
                self._broken is not None or self._rolling is not None:
            return self._append(items, copied=False)  # (raises the refusals)
        now = self._clock_ms()
        if now < self._last_append_time_ms:
            now = self._last_append_time_ms
        config, active, wal = self.config, self._segments[-1], self.wal
        index = active.index
        positions = index.positions
        plan = step(items, self._log_end_offset, now, config.max_batch_bytes, active.size,
                    active.first_append_time_ms, active.base_offset, config.segment_bytes,
                    config.segment_ms, config.index_interval_bytes,
                    positions[-1] if positions else None, index.running_max_timestamp_ms,
                    None if wal is None else wal.raw_name)
        if plan is None:  # a batch rolls the segment: a part at a time
            return self._append_at(items, now, copied=False)
        data, head, next_offset, bases, end, max_ts, last_data, facts = plan
        try:
            if self._direct is not None:
                self._end_direct()
            written = os.write(active.fd, data)
            if written != end - active.size:
                _writev_all(active.fd, [memoryview(data)[written:]])
            if wal is not None:  # after the file: a frame is replayed
                if head is None:  # (frame_parts refuses it: its error, as the reference)
                    wal.wrote(self._log_end_offset, [data], next_offset)
                else:
                    wal.wrote_framed(head, data, next_offset)
        except OSError as error:
            self._broken = f"I/O error while appending: {error}"
            raise
        facts.apply(active, index, self._recent_starts, RECENT_STARTS)
        self._appended(active, end, next_offset, max_ts, now, last_data)
        self._last_append_time_ms = now
        return bases

    def append_copied(self, items: Sequence[tuple[bytes | bytearray | memoryview, BatchHeader]],
                      segment_bases: Collection[int] | None = None) -> list[int]:
        """A follower's append (docs/replication.md): batches copied from the leader's log
        (validated by the caller, CRC included), written byte for byte, so they keep the
        leader's base offsets and append times. The first must start at this log's end
        and each next where the last ended (else OFFSET_OUT_OF_RANGE, nothing written).
        No fsync, as `append`.

        `segment_bases`: where the leader's segments begin (`segment_bases`). The log then
        rolls before each batch starting at one of them and by no rule of its own, so its
        segments start where the leader's do. None: it rolls by its own size, age and
        offset rules (a leader that does not say)."""
        expected = self._log_end_offset
        for _batch, header in items:
            if header.base_offset != expected:
                raise AtomlogError("OFFSET_OUT_OF_RANGE",
                                   f"a copied batch starts at {header.base_offset}; the log "
                                   f"continues at {expected}",
                                   {"log_end_offset": str(self._log_end_offset)})
            expected += header.last_offset_delta + 1
        return self._append(items, copied=True, rolls_at=segment_bases)

    def segment_bases(self, start: int, end: int) -> list[int]:
        """The base offsets of the segments holding [start, end), ascending (the first
        holds `start`): what a follower copying that range needs to start its segments
        where this log's start (`append_copied`)."""
        bases = self._bases
        return bases[max(bisect_right(bases, start) - 1, 0):max(bisect_left(bases, end), 1)]

    def _append(self, items: Sequence[tuple[bytes | bytearray | memoryview, BatchHeader]], *,
                copied: bool, rolls_at: Collection[int] | None = None) -> list[int]:
        self._check_serving()
        self._check_not_rolling("append")
        return self._append_at(items, max(self._clock_ms(), self._last_append_time_ms),
                               copied=copied, rolls_at=rolls_at)

    def _append_at(self, items: Sequence[tuple[bytes | bytearray | memoryview, BatchHeader]],
                   now: int, *, copied: bool, rolls_at: Collection[int] | None = None
                   ) -> list[int]:
        """`_append` once checked, at append time `now`."""
        config = self.config
        if copied:
            record_batch.check_batch_sizes(items, config.max_batch_bytes)
            if items:
                now = max(now, max(header.log_append_time_ms for _, header in items))
        else:
            # Checked, stamped and accounted for in one call (the native core's, when
            # loaded); None when a batch rolls the segment: then a segment's part at a time.
            plan = self._plan(items, now)
            if plan is not None:
                try:
                    self._write_planned(plan, now)
                except OSError as error:
                    self._broken = f"I/O error while appending: {error}"
                    raise
                self._last_append_time_ms = now
                return [base for base, _ in plan[3]]
        base_offsets: list[int] = []
        group: list[tuple[memoryview | bytes, BatchHeader]] = []
        size, next_offset = self._segments[-1].size, self._log_end_offset
        first_time = self._segments[-1].first_append_time_ms
        try:
            for batch, header in items:
                if self._rolls(size, header.size, first_time, next_offset, now, rolls_at):
                    self._write_part(group, now, copied)
                    group = []
                    self._roll()
                    size, first_time = 0, None
                group.append((batch, header))
                base_offsets.append(next_offset)
                size += header.size
                next_offset += header.record_count
                first_time = now if first_time is None else first_time
            self._write_part(group, now, copied)
        except OSError as error:
            self._broken = f"I/O error while appending: {error}"
            raise
        self._last_append_time_ms = now
        return base_offsets

    def _rolls(self, size: int, batch_bytes: int, first_time: int | None, base_offset: int,
               now: int, rolls_at: Collection[int] | None = None) -> bool:
        """Whether a batch of `batch_bytes` at `base_offset` goes to a new segment, the
        active one holding `size` bytes, its first appended at `first_time`: where the
        leader's segments start (`rolls_at`, a follower's copies), else by size or by age;
        and always by the span of offsets its index can hold."""
        config = self.config
        return size != 0 and (
            base_offset - self._segments[-1].base_offset > RELATIVE_OFFSET_MAX
            or (base_offset in rolls_at if rolls_at is not None else
                size + batch_bytes > config.segment_bytes
                or (first_time is not None and now - first_time >= config.segment_ms)))

    def roll_due(self, extra_bytes: int) -> bool:
        """Whether appending batches of `extra_bytes` in all would roll the active segment
        on the way (`extra_bytes` also bounds their records, so their offsets). The owner
        then rolls first, off its event loop (roll_begin, RollJob.run on a worker thread,
        roll_end), instead of inside `append`. False while the log does not serve."""
        if self._closed or self._data_loss is not None or self._broken is not None or \
                self._rolling is not None:
            return False
        active = self._segments[-1]
        if not active.size:  # (an empty segment never rolls: no clock to read)
            return False
        now = self._clock_ms()
        if now < self._last_append_time_ms:
            now = self._last_append_time_ms
        return self._rolls(active.size, extra_bytes, active.first_append_time_ms,
                           self._log_end_offset + extra_bytes, now)

    def roll_for_retention_due(self, now_ms: int) -> bool:
        """Whether the active segment holds only records past retention.ms (`now_ms`):
        the only way it goes is a roll, after which retention deletes it (as Kafka rolls
        an active segment past retention). Retention never deletes the active segment,
        and rolls by age (segment.ms) happen on an append: on a topic nobody writes any
        more, its last segment (up to segment.bytes) outlived any retention.ms."""
        if self._closed or self._data_loss is not None or self._broken is not None or \
                self._rolling is not None:
            return False
        active, retention_ms = self._active, self.config.retention_ms
        return (retention_ms >= 0 and active.size > 0 and active.last_append_time_ms is not None
                and now_ms - active.last_append_time_ms > retention_ms)

    def _check_not_rolling(self, what: str) -> None:
        if self._rolling is not None:  # a caller's bug: the roll's thread may be at work
            raise RuntimeError(f"{what} on partition log {self.directory} while a roll is "
                               "under way (between roll_begin and roll_end)")

    def _plan(self, group: Sequence[tuple[bytes | bytearray | memoryview, BatchHeader]],
              now: int) -> tuple | None:
        """record_batch.plan_log_append of `group` onto the active segment at `now`."""
        config, active = self.config, self._segments[-1]
        index = active.index
        return record_batch.plan_log_append(
            group, self._log_end_offset, now, config.max_batch_bytes, active.size,
            active.first_append_time_ms, active.base_offset, config.segment_bytes,
            config.segment_ms, config.index_interval_bytes,
            index.positions[-1] if index.positions else None, index.running_max_timestamp_ms)

    def _write_part(self, group: list[tuple[bytes | memoryview, BatchHeader]], now: int,
                    copied: bool) -> None:
        """Write the part of an append that goes to the active segment (_append split it
        where the segment rolls, so a plan of it rolls nothing)."""
        if copied:
            self._write_copies(group)
            return
        plan = self._plan(group, now)
        assert plan is not None, "a part of an append that rolls nothing rolled"
        self._write_planned(plan, now)

    def _write_copies(self, group: list[tuple[bytes | memoryview, BatchHeader]]) -> None:
        """Write a follower's copies to the active segment as they are (their prefix
        already holds the offset and append time the leader gave them), then account for
        them."""
        if not group:
            return
        active = self._segments[-1]
        buffers: list = [batch for batch, _ in group]
        if self._direct_copies:
            self._direct_write(active, buffers)
        else:
            self._end_direct()
            _writev_all(active.fd, buffers)
        interval = self.config.index_interval_bytes
        position = active.size
        recent = self._recent_starts
        for _, header in group:
            recent[header.base_offset] = (active, position)
            active.observe(position, header, interval)
            position += header.batch_length + LENGTH_FIELD_END
            if not header.attributes & ATTR_CONTROL:
                self._last_data_offset_written = header.base_offset + header.last_offset_delta
        self._log_end_offset += sum(header.last_offset_delta + 1 for _, header in group)
        self._forget_old_starts()

    def _write_planned(self, plan: tuple, now: int) -> None:
        """Write what record_batch.plan_log_append planned into the active segment (and the
        write-ahead file), then apply the facts the plan computed: batch starts, index
        entries, the segment's size, timestamps and last data offset."""
        (buffers, stamped, next_offset, starts, entries, end, running_max_ts, max_ts,
         last_data) = plan
        if not stamped:
            return
        active = self._segments[-1]
        self._end_direct()
        _writev_all(active.fd, buffers)
        if self.wal is not None:  # after the file: a frame is replayed
            self.wal.wrote(self._log_end_offset, buffers, next_offset)
        recent = self._recent_starts
        for base, position in starts:
            recent[base] = (active, position)
        index = active.index
        index.extend(entries)
        index.running_max_timestamp_ms = running_max_ts
        self._appended(active, end, next_offset, max_ts, now, last_data)
        self._forget_old_starts()

    def _appended(self, active: Segment, end: int, next_offset: int, max_ts: int, now: int,
                  last_data: int | None) -> None:
        """An append's facts on the active segment and the log's end (the native step's
        and `_write_planned`'s): its size, next offset, timestamps, last data offset."""
        active.size = end
        active.next_offset = next_offset
        if max_ts > active.max_timestamp_ms:
            active.max_timestamp_ms = max_ts
        if active.first_append_time_ms is None:
            active.first_append_time_ms = now
        active.last_append_time_ms = now
        if last_data is not None:
            active.last_data_offset = self._last_data_offset_written = last_data
        self._log_end_offset = next_offset

    def _forget_old_starts(self) -> None:
        recent = self._recent_starts
        while len(recent) > RECENT_STARTS:
            del recent[next(iter(recent))]  # the oldest

    def _direct_write(self, active: Segment, buffers: list[bytes | memoryview]) -> None:
        appender = self._direct
        if appender is None:
            try:
                appender = direct_io.DirectAppender(active.log_path, active.size, active.fd)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                self._direct_copies = False  # the file system refuses O_DIRECT (tmpfs)
                _writev_all(active.fd, buffers)
                return
            self._direct = appender
        appender.write(buffers)

    def _end_direct(self, *, cut: bool | None = None) -> None:
        """Stop writing the active segment around the page cache: cut its file back to
        the log's end (direct writes pad the last block with zeros) unless the log failed
        (then recovery decides), and close the direct descriptor. Before any other write,
        a roll, a cut or a close; the next copied append starts again."""
        appender, self._direct = self._direct, None
        if appender is not None:
            appender.finish(cut=(self._broken is None and self._data_loss is None)
                            if cut is None else cut)

    def flush(self) -> int:
        """fsync what was appended and move the high watermark to the log end; returns it.
        The owner's group commit: many appends, one flush, then acknowledge them all."""
        target, fd = self.flush_begin()
        if fd is not None:
            try:
                os.fsync(fd)
            except OSError as error:  # after a failed fsync the page cache is unknown
                self._broken = f"fsync failed: {error}"
                raise
        self.flush_end(target)
        return self._high_watermark

    def flush_begin(self) -> tuple[int, int | None]:
        """First half of a flush whose fsync runs elsewhere (a worker thread): returns the
        target offset (the log end now) and the file descriptor to fsync, or None when
        everything is flushed already. Appends may go on meanwhile, and so may further
        flush_begin calls (pipelined group commits: their fsyncs may overlap);
        `flush_end(target)` moves the high watermark only to `target`, and flushes end
        in the order they began. Everything below `target` is in the active segment or
        in sealed segments, which rolling fsynced already, so an fsync of the returned
        descriptor that starts after this call makes it all durable. Once the segment
        rolls, its descriptor may be closed (at most max_open_segment_files stay open):
        fsync a duplicate (os.dup) when appends may go on during the fsync. If the
        fsync fails, do not call flush_end: call `fail` and reopen the log (the page
        cache is unknown)."""
        if self._closed or self._data_loss is not None or self._broken is not None:
            self._check_serving()  # (raises)
        target = self._log_end_offset
        if target == self._high_watermark:
            return target, None
        active = self._segments[-1]
        self._flush_pending.append((target, active, active.size,
                                    self._last_data_offset_written))
        return target, active.fd

    def fail(self, reason: str) -> None:
        """Record that an fsync of this log failed elsewhere (the owner's worker thread):
        the log refuses everything from now on, and `close` neither fsyncs nor moves
        the recovery point. Reopen it: recovery decides what is on disk."""
        if self._broken is None:
            self._broken = reason

    def flush_end(self, target: int, *, durable: bool = True) -> bool:
        """Second half: the fsync of `flush_begin`'s descriptor succeeded, so move the high
        watermark to `target`. Pass durable=False when the flush policy skipped the fsync:
        the data becomes readable, but the recovery point does not move past it (else a
        power cut could turn a torn tail into a false DATA_LOSS). Returns whether the high
        watermark moved."""
        if self._closed or self._data_loss is not None or self._broken is not None:
            self._check_serving()  # (raises)
        pending = self._flush_pending
        ended = None
        while pending and pending[0][0] <= target:  # flushes end in the order they began
            ended = pending.popleft()
        moved = False
        if ended is not None and ended[0] == target and target > self._high_watermark:
            _, segment, position, last_data_offset = ended
            self._high_watermark = target
            self._hw_segment, self._hw_position = segment, position
            self._last_data_offset = last_data_offset
            if durable:
                self._durable_offset = max(self._durable_offset, target)
            moved = True
        self._maybe_write_recovery_point()
        return moved

    @property
    def durable_offset(self) -> int:
        """Everything below was fsynced (by a flush, a roll, a checkpoint or the load)."""
        return self._durable_offset

    @property
    def recoverable_offset(self) -> int:
        """What a recovery point (and a write-ahead file's checkpoint) may record: the
        durable offset, and under a write-ahead file (`wal`) also at most the high
        watermark. A roll fsyncs the segment it seals, whose tail may hold writes whose
        round has not ended: durable in this file, never acknowledged if that round
        fails or a power cut takes it (a one-round commit's decision without its stages,
        partition_server/wal.py). A replay keeps what is below it."""
        if self.wal is None:
            return self._durable_offset
        return min(self._durable_offset, self._high_watermark)

    @property
    def cut_generation(self) -> int:
        """Bumped by every cut of the log (a truncation, a restart at another offset, a
        data-loss recovery): bytes read at one generation say nothing of the log at
        another."""
        return self._cut_generation

    @property
    def closed_durable(self) -> bool:
        """Closed, and the close fsynced everything (a healthy close)."""
        return self._closed and self._broken is None and \
            self._durable_offset == self._log_end_offset

    def checkpoint_begin(self) -> tuple[int, int, int] | None:
        """A write-ahead log's checkpoint (partition_server/wal.py): (target, descriptor,
        generation) when the high watermark is above what is durable, else None (also
        while a roll is under way, whose own fsyncs cover the sealed segment, or while
        the log does not serve). Everything below `target` is in the active segment or
        in sealed (fsynced) ones, so an fsync of the descriptor (dup it: the log may
        close its own) begun after this makes it durable; then `checkpoint_end`."""
        if self._closed or self._broken is not None or self._data_loss is not None or \
                self._rolling is not None or not self._segments:
            return None
        target = self._high_watermark
        if target <= self._durable_offset or self._checkpointing or self._closing:
            return None
        self._checkpointing = True
        return target, self._active.fd, self._cut_generation

    @property
    def checkpointing(self) -> bool:
        """A checkpoint's fsync (`checkpoint_begin`) has not ended yet."""
        return self._checkpointing

    def checkpoint_ended(self, error: BaseException | None) -> None:
        """The fsync of `checkpoint_begin`'s descriptor ended (`error`: it failed; None
        also when it never began), before `checkpoint_end`. Linux gives a write-back error
        to the first fsync of the file that looks: a roll's fsync that ran meanwhile may
        have succeeded where this one failed, and counted the sealed segment durable (in
        memory). So a failure breaks the log at once, before anything records that
        count (no recovery point is written while a checkpoint's fsync is in flight,
        a close meanwhile syncs nothing): the reload rewrites the log from the
        write-ahead frames above its last recovery point, which are kept."""
        self._checkpointing = False
        if error is not None:
            self.fail(f"a checkpoint's fsync failed: {error}")

    def begin_close(self) -> None:
        """The owner closes: no checkpoint begins from now on (the close's own fsync
        must not run beside one)."""
        self._closing = True

    def checkpoint_end(self, target: int, generation: int) -> bool:
        """The fsync of `checkpoint_begin`'s descriptor succeeded: what is below `target`
        is durable, unless the log was cut (or closed, or failed) since. Moves the
        recovery point as a flush does. Returns whether it counted."""
        if self._closed or self._broken is not None or self._data_loss is not None or \
                generation != self._cut_generation or target > self._log_end_offset:
            return False
        if target > self._durable_offset:
            self._durable_offset = target
            self._maybe_write_recovery_point()
        return True

    def declare_data_loss(self, offset: int, detail: str) -> None:
        """Enter DATA_LOSS at the log's end (`offset`), found missing by a caller that knows
        more than the files (a replay of the write-ahead file)."""
        active = self._active
        self._persist_data_loss(DataLoss(str(active.log_path), active.size, offset, detail,
                                         self._clock_ms()))

    def _maybe_write_recovery_point(self) -> None:
        if self._checkpointing:  # its verdict first (`checkpoint_ended`)
            return
        now = self._clock_ms()
        value = self.recoverable_offset
        if value != self._recovery_point_written and \
                now - self._recovery_point_written_ms >= self.config.recovery_point_interval_ms:
            if self.defer_recovery_point is None:
                self._write_recovery_point(sync=False, offset=value)
            elif not self._recovery_point_deferred:
                self._recovery_point_deferred = True
                try:
                    self.defer_recovery_point(self._periodic_recovery_point_writer(
                        value, self._recovery_point_generation))
                except RuntimeError:  # no worker to take it (the loop's executor shut down)
                    self._recovery_point_deferred = False
                    self._write_recovery_point(sync=False, offset=value)
            self._recovery_point_written_ms = now

    def _periodic_recovery_point_writer(self, value: int, generation: int) -> Callable[[], None]:
        """The deferred write of the periodic recovery point `value` (not synced, as the
        inline one): dropped when the log closed or another write came first. A failure
        breaks the log, as the inline write's exception does, and is raised to whoever
        runs the write (the owner watches it: nothing else would tell a partition that
        writes nothing more that its log is broken)."""
        def write() -> None:
            try:
                with self._recovery_point_lock:
                    if self._closed or generation != self._recovery_point_generation:
                        return
                    self._write_recovery_point_locked(sync=False, offset=value)
            except OSError as error:
                if self._broken is None:
                    self._broken = f"I/O error while writing the recovery point: {error}"
                raise
            finally:
                self._recovery_point_deferred = False
        return write

    @property
    def last_data_offset(self) -> int:
        """Offset of the last data (non-control) record below the high watermark; -1 if the
        log holds none."""
        return self._last_data_offset

    def roll(self) -> None:
        """Seal the active segment now (if it holds anything) and start a new one."""
        self._check_serving()
        if self._active.size:
            try:
                self._roll()
            except OSError as error:
                self._broken = f"I/O error while rolling: {error}"
                raise

    def _roll(self) -> None:
        job = self.roll_begin()
        try:
            job.run()
        except BaseException:
            self._rolling = None  # the caller breaks the log (an OSError) or fails
            raise
        self.roll_end(job)

    def roll_begin(self) -> RollJob:
        """First half of a roll whose disk work runs elsewhere (`RollJob.run`, on a worker
        thread): seals the active segment, which takes no appends (nor cuts) until
        `roll_end`; reads and flushes of what is written go on meanwhile. The active
        segment must hold something (`roll_due`)."""
        self._check_serving()
        self._check_not_rolling("roll")
        old = self._active
        assert old.size, "rolling an empty segment"
        self._end_direct()
        job = RollJob(old, Segment(self.directory, self._log_end_offset),
                      self._index(old).to_bytes(old.base_offset))
        job.sealed_fd = os.dup(old.fd)
        try:
            job.dir_fd = os.dup(self._dir_fd)
        except BaseException:
            os.close(job.sealed_fd)
            raise
        self._rolling = job
        return job

    def roll_end(self, job: RollJob) -> None:
        """Second half, once `job.run()` returned: the new segment becomes the active one
        and the sealed one counts as durable. Call `roll_failed` instead if it raised."""
        assert self._rolling is job and job.fd is not None, "roll_end without a finished roll"
        self._rolling = None
        if self._closed:  # closed meanwhile: the next open finds the (empty) new segment
            os.close(job.fd)
            return
        old, new = job.sealed, job.next
        new.fd, new.index = job.fd, SparseIndex()
        self._durable_offset = max(self._durable_offset, old.next_offset)
        self._segments.append(new)
        self._bases.append(new.base_offset)
        self._open_sealed[old.base_offset] = old
        self._trim_open_files()

    def roll_failed(self, job: RollJob, error: BaseException) -> None:
        """`job.run()` raised (or never ran): the log refuses everything (the page cache
        of the sealed segment is unknown after a failed fsync); reopen it, as after a
        failed flush."""
        assert self._rolling is job, "roll_failed without a roll under way"
        self._rolling = None
        job.release()
        if self._broken is None:
            self._broken = f"I/O error while rolling: {error}"

    def _write_index_file(self, segment: Segment) -> None:
        _atomic_write(segment.index_path, self._index(segment).to_bytes(segment.base_offset),
                      sync=True, dir_fd=self._dir_fd)

    # --- Reads and look-ups -----------------------------------------------------------------

    def read(self, offset: int, max_bytes: int, upper_bound_offset: int | None = None
             ) -> tuple[bytes, int]:
        """Whole batches from the one containing `offset`, up to `max_bytes` (but at least
        one batch), never reaching `upper_bound_offset` (default: the high watermark; a
        batch that would reach past it is left out). Returns (bytes, next_offset): the
        batches back to back as stored, and the offset after the last one (== offset when
        nothing was read). OFFSET_OUT_OF_RANGE below the log start or above the bound."""
        self._check_serving()
        bound = self._high_watermark if upper_bound_offset is None else upper_bound_offset
        if bound > self._log_end_offset:
            raise ValueError(f"upper bound {bound} is past the log end {self._log_end_offset}")
        self._check_range(offset, bound)
        chunks: list[bytes] = []
        total, next_offset = 0, offset
        i = bisect_right(self._bases, offset) - 1
        while next_offset < bound and i < len(self._segments) and (total < max_bytes or not chunks):
            segment = self._segments[i]
            i += 1
            if next_offset >= segment.next_offset:
                continue
            start, start_offset = self._position_of(segment, next_offset)
            end, end_offset = self._end_of(segment, start, start_offset, bound, max_bytes - total,
                                           take_one=not chunks)
            if end == start:
                break
            data = os.pread(self._fd(segment), end - start, start)
            if self.config.verify_reads:
                self._verify_read(segment, start, start_offset, data)
            chunks.append(data)
            total += len(data)
            next_offset = end_offset
            if end < segment.size:
                break
        return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), next_offset

    def _check_range(self, offset: int, bound: int) -> None:
        if not self.log_start_offset <= offset <= bound:
            raise AtomlogError(
                "OFFSET_OUT_OF_RANGE",
                f"offset {offset} is outside [{self.log_start_offset}, {bound}]",
                {"log_start_offset": self.log_start_offset, "high_watermark": self._high_watermark})

    def _position_of(self, segment: Segment, offset: int) -> tuple[int, int]:
        """(position, base offset) of the batch containing `offset` in `segment`, or of the
        segment end when offset >= its end."""
        recent = self._recent_starts.get(offset)
        if recent is not None and recent[0] is segment:
            return recent[1], offset  # a batch that begins there
        entry_offset, position = self._index(segment).floor_by_offset(offset)
        for position, header in self._walk(segment, position, segment.size, entry_offset):
            if header.next_offset > offset:
                return position, header.base_offset
        return segment.size, segment.next_offset

    def _end_of(self, segment: Segment, start: int, start_offset: int, bound: int, budget: int,
                take_one: bool) -> tuple[int, int]:
        """(end position, next offset) of the read starting at batch position `start`."""
        if bound >= segment.next_offset:
            bound_position, bound_offset = segment.size, segment.next_offset
        elif bound == self._high_watermark and segment is self._hw_segment:
            bound_position, bound_offset = self._hw_position, bound
        else:
            bound_position, bound_offset = self._boundary_below(segment, bound)
        if bound_position <= start:
            return start, bound_offset
        limit = start + max(budget, 0)
        if bound_position <= limit:
            return bound_position, bound_offset
        entry_offset, entry_position = self._index(segment).floor_by_position(limit)
        if entry_position < start:
            entry_position, entry_offset = start, start_offset
        end, end_offset = entry_position, entry_offset
        for position, header in self._walk(segment, entry_position, bound_position, entry_offset):
            if position + header.size > limit:
                if position == start and take_one:
                    return position + header.size, header.next_offset
                break
            end, end_offset = position + header.size, header.next_offset
        return end, end_offset

    def _boundary_below(self, segment: Segment, offset: int) -> tuple[int, int]:
        """The position and offset where the last batch ending at or before `offset` ends."""
        entry_offset, position = self._index(segment).floor_by_offset(offset)
        for position, header in self._walk(segment, position, segment.size, entry_offset):
            if header.next_offset > offset:
                return position, header.base_offset
        return segment.size, segment.next_offset

    def _verify_read(self, segment: Segment, start: int, start_offset: int, data: bytes) -> None:
        """Pair assertion on the read path: every returned batch is whole, in sequence and
        passes its CRC, else the partition goes to DATA_LOSS (never serve bad bytes)."""
        failure = check_batches(data, start, start_offset)
        if failure is not None:
            self._enter_data_loss(segment, failure)
            raise self._data_loss.error()

    def offset_for_timestamp(self, timestamp_ms: int) -> tuple[int, int] | None:
        """(base offset, max timestamp) of the first flushed data batch whose max
        timestamp is >= timestamp_ms, or None (ListOffsets BY_TIMESTAMP; batch
        granularity). Markers are passed over: they carry the server's clock, not the
        producers', and no record a consumer reads (one stamped ahead answered every
        time up to its stamp)."""
        self._check_serving()
        for segment in self._segments:
            if segment.base_offset >= self._high_watermark:
                return None
            if segment.max_timestamp_ms < timestamp_ms:
                continue
            entry_offset, position = self._index(segment).floor_by_timestamp(timestamp_ms)
            for _, header in self._walk(segment, position, segment.size, entry_offset):
                if header.base_offset >= self._high_watermark:
                    return None
                if header.max_timestamp_ms >= timestamp_ms and not header.is_control:
                    return header.base_offset, header.max_timestamp_ms
        return None

    def iter_headers(self, from_offset: int | None = None,
                     upper_bound_offset: int | None = None) -> Iterator[BatchHeader]:
        """Headers of the batches from the one containing `from_offset` (default: the log
        start) up to `upper_bound_offset` (default: the log end as of this call): how the
        owner rebuilds producer state and the transaction buffer from a snapshot + tail.
        Do not append while iterating."""
        self._check_serving()
        start = self.log_start_offset if from_offset is None else from_offset
        bound = self._log_end_offset if upper_bound_offset is None else upper_bound_offset
        if bound > self._log_end_offset:
            raise ValueError(f"upper bound {bound} is past the log end {self._log_end_offset}")
        self._check_range(start, self._log_end_offset)
        return self._iter_headers(start, bound)

    def _iter_headers(self, start: int, bound: int) -> Iterator[BatchHeader]:
        i = max(bisect_right(self._bases, start) - 1, 0)
        for segment in self._segments[i:]:
            if segment.base_offset >= bound:
                return
            position, position_offset = self._position_of(segment, max(start, segment.base_offset))
            for _, header in self._walk(segment, position, segment.size, position_offset):
                if header.base_offset >= bound:
                    return
                yield header

    def segment_spans(self, from_offset: int, to_offset: int) -> list[SegmentSpan]:
        """The batches from the one containing `from_offset` up to `to_offset` (a batch
        boundary at or below the log end, e.g. the log end now), as one span per segment:
        what a replay on another thread reads through its own file descriptors, while
        the owner goes on appending above `to_offset` (the spans never change: data below
        the log end is not rewritten; do not delete or truncate segments meanwhile)."""
        self._check_serving()
        if to_offset > self._log_end_offset:
            raise ValueError(f"to_offset {to_offset} is past the log end {self._log_end_offset}")
        self._check_range(from_offset, self._log_end_offset)
        spans = []
        for segment in self._segments[max(bisect_right(self._bases, from_offset) - 1, 0):]:
            if segment.base_offset >= to_offset:
                break
            position, first = self._position_of(segment, max(from_offset, segment.base_offset))
            end = (segment.size if segment.next_offset <= to_offset
                   else self._position_of(segment, to_offset)[0])
            if position < end:
                spans.append(SegmentSpan(segment.base_offset, segment.log_path, position, first,
                                         end))
        return spans

    def scrub_spans(self) -> list[SegmentSpan]:
        """What the scrubber reads (partition_server/scrubber.py): every segment whose
        batches are all durable, whole from its first byte (bytes below the log start
        included: a segment is never rewritten). Unlike segment_spans it reads nothing but
        each segment's size and next offset, no index and no file, so it may be called
        while another thread appends (a follower's copy on the replication link's
        thread): the durable offset is read first, then each segment's size before its
        next offset, so every span ends at a batch boundary below what was durable."""
        if self._closed or self._data_loss is not None or self._broken is not None:
            return []
        durable = self._durable_offset
        spans = []
        for segment in list(self._segments):
            size = segment.size
            if segment.next_offset > durable:
                break
            if size:
                spans.append(SegmentSpan(segment.base_offset, segment.log_path, 0,
                                         segment.base_offset, size))
        return spans

    def report_corruption(self, segment_base_offset: int, position: int, offset: int,
                          detail: str, cut_generation: int | None = None) -> bool:
        """A reader of segment_spans found a damaged batch: the partition enters DATA_LOSS
        (recorded durably) as if this log's own read had found it. False (nothing done)
        when the log was cut since the reader took its spans (`cut_generation`, when
        given), the segment is no longer this log's (deleted meanwhile) or the batch lies
        past its end: what the reader found says nothing of the log now."""
        if cut_generation is not None and cut_generation != self._cut_generation:
            return False
        i = bisect_right(self._bases, segment_base_offset) - 1
        if i < 0 or self._bases[i] != segment_base_offset or position >= self._segments[i].size:
            return False
        if self._data_loss is None:
            self._enter_data_loss(self._segments[i], ScanFailure(position, offset, detail))
        return True

    # --- Retention and truncation -----------------------------------------------------------

    def apply_retention(self, *, keep_from_offset: int | None = None,
                        now_ms: int | None = None) -> int:
        """Delete the oldest sealed, flushed segments past retention_bytes / retention_ms;
        returns how many. The active segment is never deleted (it rolls by size or age).
        `keep_from_offset`: never delete a segment holding this offset or later ones.
        `now_ms`: the time ages count to (default: the log's clock, which an owner keeps
        at its last append: a partition nobody writes needs the wall clock here)."""
        self._check_serving()
        config, now = self.config, self._clock_ms() if now_ms is None else now_ms
        total = self.size_bytes
        limit = self._high_watermark if keep_from_offset is None else min(
            keep_from_offset, self._high_watermark)

        def past_retention(oldest: Segment) -> bool:
            nonlocal total
            by_size = config.retention_bytes >= 0 and total - oldest.size >= config.retention_bytes
            by_age = (config.retention_ms >= 0 and oldest.last_append_time_ms is not None
                      and now - oldest.last_append_time_ms > config.retention_ms)
            if by_size or by_age:
                total -= oldest.size
                return True
            return False

        return self._delete_oldest_segments(limit, past_retention)

    def delete_records(self, before_offset: int) -> int:
        """DeleteRecords: delete every sealed segment that lies entirely below
        `before_offset` (never the active one); returns the new log start offset, which is
        `log_start_after_delete(before_offset)`. Idempotent. `before_offset` must be in
        [0, high watermark] (INVALID_ARGUMENT / OFFSET_OUT_OF_RANGE), so only flushed
        segments go. Same deletion path as retention: oldest first, then one directory
        fsync, so a crash midway leaves a contiguous log whose start is some segment base,
        and the recovery point (at or above the flushed data) stays valid."""
        self._check_serving()
        self._check_delete_records(before_offset)
        self._delete_oldest_segments(before_offset)
        return self.log_start_offset

    def log_start_after_delete(self, before_offset: int) -> int:
        """The log start offset `delete_records(before_offset)` would leave: the base offset
        of the segment holding `before_offset` (the active segment's base at most; the
        current start when before_offset is below it). Changes nothing."""
        self._check_serving()
        self._check_delete_records(before_offset)
        return self._bases[max(bisect_right(self._bases, before_offset) - 1, 0)]

    def _check_delete_records(self, before_offset: int) -> None:
        if before_offset < 0:
            raise AtomlogError("INVALID_ARGUMENT", f"before_offset {before_offset} is negative")
        if before_offset > self._high_watermark:
            raise AtomlogError(
                "OFFSET_OUT_OF_RANGE",
                f"before_offset {before_offset} is above the high watermark {self._high_watermark}",
                {"log_start_offset": self.log_start_offset, "high_watermark": self._high_watermark})

    def _delete_oldest_segments(self, limit: int,
                                wanted: Callable[[Segment], bool] | None = None) -> int:
        """Delete sealed segments from the oldest on while each ends at or below `limit`
        (callers keep it at or below the high watermark) and `wanted(segment)` agrees;
        never the active segment. One directory fsync at the end; returns how many went.
        The shared path of retention and DeleteRecords."""
        deleted = 0
        while len(self._segments) > 1:
            oldest = self._segments[0]
            if oldest.next_offset > limit or (wanted is not None and not wanted(oldest)):
                break
            self._delete_segment(oldest)
            self._segments.pop(0)
            self._bases.pop(0)
            deleted += 1
        if deleted:
            os.fsync(self._dir_fd)
            self._unlink_doomed()
        return deleted

    def truncate_to(self, offset: int) -> int:
        """Remove every batch that does not end at or before `offset` (a batch containing
        it is removed whole); returns the new log end. A segment the cut empties goes too,
        unless it is the first (`_truncate_files`). The rest of the log is re-opened
        through the normal recovery path."""
        self._check_not_rolling("truncate_to")
        self._check_serving()
        if offset >= self._log_end_offset:
            return self._log_end_offset
        if offset < self.log_start_offset:
            self._check_range(offset, self._log_end_offset)
        i = bisect_right(self._bases, offset) - 1
        position, batch_offset = self._position_of(self._segments[i], offset)
        self._truncate_files(self._segments[i].base_offset, position, batch_offset)
        self._reload()
        return self._log_end_offset

    def restart_at(self, offset: int) -> None:
        """A follower whose log has nothing in common with its leader's any more (it ends
        below the leader's log start, or holds offsets the leader's history does not):
        delete every segment and continue, empty, at `offset` (docs/replication.md).
        Durable when it returns. A crash midway leaves the oldest segments (deleted newest
        first, after the recovery point went down to the log start) or an empty log at 0:
        either is a valid log the follower truncates or restarts again."""
        self._check_not_rolling("restart_at")
        self._check_serving()
        if offset < 0:
            raise AtomlogError("INVALID_ARGUMENT", f"offset {offset} is negative")
        if self.wal is not None:  # a follower's move: replicated logs keep their own fsyncs
            raise RuntimeError(f"restart_at on {self.directory}, a log of the write-ahead file")
        self._cut_generation += 1
        self._end_direct(cut=False)  # every segment goes
        self._durable_offset = 0
        self._write_recovery_point(sync=True, offset=self.log_start_offset)
        for segment in self._segments:
            segment.close()
        self._open_sealed.clear()
        for base in sorted(_list_segments(self.directory), reverse=True):
            self._delete_segment(Segment(self.directory, base))
        first = Segment(self.directory, offset)
        os.close(os.open(first.log_path, os.O_RDWR | os.O_CREAT, 0o644))
        os.fsync(self._dir_fd)
        self._write_recovery_point(sync=True, offset=offset)
        self._reload()  # removes the *.deleted files

    def recover_data_loss(self, file: str | os.PathLike, offset: int) -> DataLossRecovery:
        """Operator action (RecoverPartition): accept losing everything from the reported
        corruption on. `file` and `offset` must repeat what DATA_LOSS reported (an absolute
        path, or a path ending in the same file name); else DATA_LOSS_MISMATCH."""
        loss = self.check_recovery(file, offset)
        base = parse_segment_name(loss.file_name)
        # An unreadable marker names itself: accepting it just re-runs recovery.
        removed = 0 if base is None else self._truncate_files(base, loss.position, loss.offset)
        (self.directory / DATA_LOSS_FILE).unlink(missing_ok=True)
        os.fsync(self._dir_fd)
        self._data_loss = None
        self._reload()
        return DataLossRecovery(offset, removed, self._high_watermark, self._data_loss)

    def check_recovery(self, file: str | os.PathLike, offset: int) -> DataLoss:
        """The DATA_LOSS a `recover_data_loss(file, offset)` would accept; raises what it
        would refuse with (nothing changes)."""
        if self._closed:
            raise RuntimeError(f"partition log {self.directory} is closed")
        loss = self._data_loss
        if loss is None:
            raise AtomlogError("PARTITION_NOT_IN_DATA_LOSS",
                               f"partition log {self.directory} is not in DATA_LOSS")
        given = Path(file)
        same_file = given.name == loss.file_name and (
            not given.is_absolute() or given.parent.resolve() == self.directory.resolve())
        if not same_file or offset != loss.offset:
            raise AtomlogError("DATA_LOSS_MISMATCH",
                               f"the corruption is in {loss.path} at offset {loss.offset}, "
                               f"not {file} at offset {offset}",
                               {"file": loss.path, "offset": loss.offset})
        return loss

    def _truncate_files(self, base_offset: int, position: int, new_end_offset: int) -> int:
        """Cut the log at (segment `base_offset`, `position`), deleting later segments
        newest first. Lowers the recovery point durably first, so a crash midway never
        makes the cut look like lost flushed data. Returns the bytes removed.

        A cut at a segment's start (position 0) takes that segment too, unless it is the
        first: the one before it, whole, is the last segment again. A follower cut back
        to where its old leader had begun a segment must not keep a segment start its
        new leader may not have (where the new leader has one, its answers'
        segment_bases start one there again; docs/replication.md). The cost: the last
        segment is checked whole at the reload, as after a crash."""
        bases = sorted(_list_segments(self.directory))
        if position == 0 and bases and bases[0] < base_offset:
            base_offset = bases[bisect_left(bases, base_offset) - 1]
            position = _file_size(Segment(self.directory, base_offset).log_path)
        if self.wal is not None:  # durable before the cut: replay applies both in order
            self.wal.cut(new_end_offset)
        self._cut_generation += 1
        self._end_direct(cut=False)  # cut here below
        self._durable_offset = min(self._durable_offset, new_end_offset)
        # What was fsynced, not the cut's offset: the tail between them may not be on
        # disk until the target's fsync below, and a power cut before it must read as a
        # torn tail, not as lost flushed data.
        self._write_recovery_point(sync=True, offset=self._durable_offset)
        for segment in self._segments:
            segment.close()
        self._open_sealed.clear()
        removed = 0
        for other in reversed(bases):
            if other <= base_offset:
                break
            doomed = Segment(self.directory, other)
            removed += _file_size(doomed.log_path)
            self._delete_segment(doomed)
        target = Segment(self.directory, base_offset)
        target.index_path.unlink(missing_ok=True)
        if target.log_path.exists():
            removed += max(_file_size(target.log_path) - position, 0)
            fd = os.open(target.log_path, os.O_RDWR)
            try:
                os.ftruncate(fd, position)
                os.fsync(fd)
            finally:
                os.close(fd)
        os.fsync(self._dir_fd)
        return removed  # (the callers' _reload removes the *.deleted files)

    def _delete_segment(self, segment: Segment) -> None:
        """Take a segment's files out of the log: renamed to *.deleted. The caller fsyncs
        the directory, then either calls `_unlink_doomed` (retention, DeleteRecords) or
        reloads (a cut: `_load` removes every *.deleted file)."""
        segment.close()
        self._open_sealed.pop(segment.base_offset, None)
        for path in (segment.log_path, segment.index_path):
            doomed = path.with_name(path.name + DELETED_SUFFIX)
            try:
                os.rename(path, doomed)
            except FileNotFoundError:
                continue
            self._doomed.append(doomed)

    def _unlink_doomed(self) -> None:
        """Once the directory's fsync made their renames durable: unlink the deleted
        segments' files, on a worker thread when the owner gave one (`defer_unlink`)."""
        doomed, self._doomed = self._doomed, []
        if doomed:
            if self.defer_unlink is None:
                unlink_files(doomed)
            else:
                self.defer_unlink(doomed)

    # --- Open and recovery --------------------------------------------------------------------

    def _reload(self) -> None:
        self._end_direct()
        self._recent_starts.clear()  # (of segments that go: they would never match)
        for segment in self._segments:
            segment.close()
        self._segments, self._bases = [], []
        self._open_sealed.clear()
        self._load()

    def _load(self) -> None:
        """Recovery: trust sealed segments whose index tail, last batches and chaining check
        out (all of them with verify_all_segments_on_open); check the last segment batch by
        batch and cut a torn tail; anything else wrong is DATA_LOSS."""
        started = time.perf_counter()
        self.recovery = RecoveryReport()
        for path in self.directory.iterdir():
            if path.name in (RECOVERY_POINT_FILE + TMP_SUFFIX, DATA_LOSS_FILE + TMP_SUFFIX) or \
                    path.name.endswith(INDEX_SUFFIX + TMP_SUFFIX):  # only our own files
                path.unlink(missing_ok=True)
            elif path.suffix == INDEX_SUFFIX and not path.with_suffix(".log").exists():
                path.unlink(missing_ok=True)
            elif path.name.endswith(DELETED_SUFFIX):  # deleted by a cut, or before a crash
                path.unlink(missing_ok=True)
        self._doomed = []
        bases = sorted(_list_segments(self.directory))
        self._segments = [Segment(self.directory, base) for base in bases]
        self._bases = list(bases)
        marker = self._read_data_loss_marker()
        if marker is not None:
            self._data_loss = marker
            self._fill_sizes()
            return
        recovery_point, clean = self._read_recovery_point()
        self.recovery.recovery_point = recovery_point
        if not self._segments:
            if recovery_point > 0:
                self._fail_open(DataLoss(str(self.directory / (seg_mod.segment_name(0) + ".log")),
                                         0, 0, f"every segment file is missing, but offsets below "
                                         f"{recovery_point} were flushed", self._clock_ms()))
                return
            self._create_first_segment()
        for segment, following in zip(self._segments, self._segments[1:]):
            failure = self._check_sealed(segment, following.base_offset)
            if failure is not None:
                self._fail_open(self._data_loss_at(segment, failure))
                return
        if clean is None or self.config.verify_all_segments_on_open or \
                not self._open_cleanly_closed(self._active, clean):
            failure = self._recover_last(self._active, recovery_point)
            if failure is not None:
                self._fail_open(self._data_loss_at(self._active, failure))
                return
        self._log_end_offset = self._active.next_offset
        self._high_watermark = self._durable_offset = self._log_end_offset
        self._hw_segment, self._hw_position = self._active, self._active.size
        try:
            self._last_data_offset = self._last_data_offset_written = self._find_last_data_offset()
        except AtomlogError:
            if self._data_loss is None:
                raise
            return  # a sealed segment turned out damaged inside: DATA_LOSS, already recorded
        self._flush_pending.clear()
        self._last_append_time_ms = max((s.last_append_time_ms for s in self._segments
                                         if s.last_append_time_ms is not None), default=INT64_MIN)
        if clean is not None or recovery_point != self._durable_offset or \
                not (self.directory / RECOVERY_POINT_FILE).exists():
            # Also withdraws a clean-shutdown record before anything is appended: from now
            # on the last segment's index file may lag behind it.
            self._write_recovery_point(sync=True, offset=None if self._trust_tail else
                                       min(recovery_point, self._durable_offset))
        self.recovery.duration_ms = (time.perf_counter() - started) * 1000

    def _find_last_data_offset(self) -> int:
        for segment in reversed(self._segments):
            if segment.last_data_offset is None:  # a sealed segment's tail held only markers
                segment.last_data_offset = -1
                for _, header in self._walk(segment, 0, segment.size, segment.base_offset):
                    if not header.is_control:
                        segment.last_data_offset = header.last_offset
            if segment.last_data_offset >= 0:
                return segment.last_data_offset
        return -1

    def _create_first_segment(self) -> None:
        first = Segment(self.directory, 0)
        os.close(os.open(first.log_path, os.O_RDWR | os.O_CREAT, 0o644))
        os.fsync(self._dir_fd)
        self._segments, self._bases = [first], [0]

    def _check_sealed(self, segment: Segment, next_base: int) -> ScanFailure | None:
        """A segment before the last: cheap checks unless configured otherwise, and a full
        scan (rebuilding the index) when the cheap ones cannot vouch for it."""
        fd = self._fd(segment)
        size = segment.size = os.fstat(fd).st_size
        tail = None if self.config.verify_all_segments_on_open else segment.read_index_tail()
        if tail is not None:
            tail_offset, tail_position, tail_max_ts = tail
            data_offsets = [-1]
            result = scan(fd, tail_position, size, tail_offset,
                          observe=lambda _, header: header.is_control or data_offsets.append(
                              header.last_offset))
            if result.failure is None and result.next_offset == next_base and result.last_header:
                segment.last_data_offset = data_offsets[-1] if data_offsets[-1] >= 0 else None
                segment.next_offset = result.next_offset
                segment.max_timestamp_ms = max(tail_max_ts, result.max_timestamp_ms)
                segment.last_append_time_ms = result.last_header.log_append_time_ms
                segment.index = None  # loaded on first use
                return None
        segment.reset()
        result = scan(fd, 0, size, segment.base_offset,
                      observe=lambda position, header: segment.observe(
                          position, header, self.config.index_interval_bytes))
        segment.size = size
        if result.failure is not None:
            return result.failure
        if result.next_offset != next_base:
            return ScanFailure(result.end_position, result.next_offset,
                               f"segment ends at offset {result.next_offset} but the next segment "
                               f"starts at offset {next_base}")
        if segment.read_index_file() != segment.index.to_bytes(segment.base_offset):
            self._write_index_file(segment)
            self.recovery.rebuilt_index_files.append(segment.index_path.name)
        return None

    def _open_cleanly_closed(self, segment: Segment, clean: dict) -> bool:
        """Open the last segment as close() left it, without reading it whole: trust it the
        way sealed segments are trusted, if its size is what close() recorded, its index
        file checks out and the batches after the index's last entry are whole, correctly
        chained and pass their CRC, ending at the recorded next offset. False (nothing
        learned) sends the caller to the batch-by-batch recovery."""
        try:
            base, size, next_offset = (int(clean["segment"]), int(clean["size"]),
                                       int(clean["next_offset"]))
            last_data_offset = int(clean["last_data_offset"])
            first_append = clean["first_append_time_ms"]
            first_append = None if first_append is None else int(first_append)
        except (KeyError, TypeError, ValueError):
            return False
        fd = segment.open(writable=True)
        if base != segment.base_offset or size <= 0 or os.fstat(fd).st_size != size:
            return False
        segment.size = size
        tail = segment.read_index_tail()
        if tail is None:
            return False
        tail_offset, tail_position, tail_max_timestamp = tail
        result = scan(fd, tail_position, size, tail_offset)
        if result.failure is not None or result.next_offset != next_offset or \
                result.last_header is None:
            return False
        index = SparseIndex.from_bytes(segment.read_index_file() or b"", base, size, next_offset)
        if index is None:
            return False
        index.running_max_timestamp_ms = max(tail_max_timestamp, result.max_timestamp_ms)
        segment.index, segment.next_offset = index, next_offset
        segment.max_timestamp_ms = index.running_max_timestamp_ms
        segment.first_append_time_ms = first_append
        segment.last_append_time_ms = result.last_header.log_append_time_ms
        segment.last_data_offset = last_data_offset
        # While open, the last segment's index lives in memory only (as after a full scan).
        segment.index_path.unlink(missing_ok=True)
        self.recovery.clean_shutdown = True
        return True

    def _recover_last(self, segment: Segment, recovery_point: int) -> ScanFailure | None:
        """Check the last segment batch by batch; cut a torn tail above the recovery point."""
        segment.index_path.unlink(missing_ok=True)
        fd = segment.open(writable=True)
        size = os.fstat(fd).st_size
        segment.reset()
        result = scan(fd, 0, size, segment.base_offset,
                      observe=lambda position, header: segment.observe(
                          position, header, self.config.index_interval_bytes))
        if result.failure is not None:
            failure = result.failure
            if failure.offset < recovery_point:
                return ScanFailure(failure.position, failure.offset,
                                   f"{failure.detail} (below the recovery point {recovery_point}: "
                                   "this data had been flushed)")
            os.ftruncate(fd, failure.position)
            self.recovery.truncated_bytes = size - failure.position
            self.recovery.truncated_at_offset = failure.offset
        elif result.next_offset < recovery_point:
            return ScanFailure(result.end_position, result.next_offset,
                               f"the log ends at offset {result.next_offset}, but offsets below "
                               f"{recovery_point} had been flushed (the recovery point)")
        os.fsync(fd)
        return None

    def _fill_sizes(self) -> None:
        for segment in self._segments:
            segment.size = _file_size(segment.log_path)

    def _fail_open(self, loss: DataLoss) -> None:
        self._persist_data_loss(loss)
        self._fill_sizes()

    def _data_loss_at(self, segment: Segment, failure: ScanFailure) -> DataLoss:
        return DataLoss(str(segment.log_path), failure.position, failure.offset, failure.detail,
                        self._clock_ms())

    def _enter_data_loss(self, segment: Segment, failure: ScanFailure) -> None:
        self._persist_data_loss(self._data_loss_at(segment, failure))

    def _persist_data_loss(self, loss: DataLoss) -> None:
        self._data_loss = loss
        _atomic_write(self.directory / DATA_LOSS_FILE, encode_data_loss(loss), sync=True,
                      dir_fd=self._dir_fd)
        if self.on_data_loss is not None:
            self.on_data_loss(loss)

    def _read_data_loss_marker(self) -> DataLoss | None:
        return read_data_loss_marker(self.directory, self._clock_ms)

    def _read_recovery_point(self) -> tuple[int, dict | None]:
        """(recovery point, close()'s record of the last segment if the log was closed
        cleanly and not opened since)."""
        try:
            record = json.loads((self.directory / RECOVERY_POINT_FILE).read_bytes())
            offset = max(int(record["offset"]), 0)
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return 0, None  # absent or torn by a crash: the whole last segment counts as tail
        clean = record.get(CLEAN_SHUTDOWN_KEY)
        return offset, clean if isinstance(clean, dict) else None

    def _write_recovery_point(self, *, sync: bool, offset: int | None = None,
                              clean: dict | None = None) -> None:
        with self._recovery_point_lock:
            self._recovery_point_generation += 1
            self._write_recovery_point_locked(sync=sync, offset=offset, clean=clean)

    def _write_recovery_point_locked(self, *, sync: bool, offset: int | None = None,
                                     clean: dict | None = None) -> None:
        value = self._durable_offset if offset is None else offset
        refused = failpoints.recovery_point_refusal()
        if refused is not None:
            raise refused
        record = {"offset": value} if clean is None else {"offset": value, CLEAN_SHUTDOWN_KEY: clean}
        _atomic_write(self.directory / RECOVERY_POINT_FILE, json.dumps(record).encode(),
                      sync=sync, dir_fd=self._dir_fd if sync else None)
        self._recovery_point_written = value

    # --- Files ----------------------------------------------------------------------------------

    def _fd(self, segment: Segment) -> int:
        if segment.fd is not None:
            if segment.base_offset in self._open_sealed:
                self._open_sealed.move_to_end(segment.base_offset)
            return segment.fd
        fd = segment.open(writable=False)
        self._open_sealed[segment.base_offset] = segment
        self._trim_open_files()
        return fd

    def _trim_open_files(self) -> None:
        while len(self._open_sealed) > self.config.max_open_segment_files:
            _, segment = self._open_sealed.popitem(last=False)
            if self._segments and segment is not self._active:
                segment.close()

    def _index(self, segment: Segment) -> SparseIndex:
        """The segment's index, loading (or rebuilding) a sealed segment's on first use."""
        if segment.index is None:
            index = SparseIndex.from_bytes(segment.read_index_file() or b"", segment.base_offset,
                                           segment.size, segment.next_offset)
            if index is None:
                size, next_offset, max_ts, last_time = (
                    segment.size, segment.next_offset, segment.max_timestamp_ms,
                    segment.last_append_time_ms)
                segment.reset()
                result = scan(self._fd(segment), 0, size, segment.base_offset,
                              observe=lambda position, header: segment.observe(
                                  position, header, self.config.index_interval_bytes))
                if result.failure is not None or result.next_offset != next_offset:
                    failure = result.failure or ScanFailure(result.end_position, result.next_offset,
                                                            "segment changed since it was opened")
                    self._enter_data_loss(segment, failure)
                    raise self._data_loss.error()
                segment.max_timestamp_ms, segment.last_append_time_ms = max_ts, last_time
                segment.size = size
                self._write_index_file(segment)
                index = segment.index
            segment.index = index
        return segment.index

    def _walk(self, segment: Segment, position: int, end: int, expected_offset: int
              ) -> Iterator[tuple[int, BatchHeader]]:
        """walk_headers over verified data; a surprise there is corruption since open."""
        try:
            yield from walk_headers(self._fd(segment), position, end, expected_offset)
        except AtomlogError as error:
            self._enter_data_loss(segment, ScanFailure(int(error.metadata["position"]),
                                                       int(error.metadata["offset"]), error.message))
            raise self._data_loss.error() from error

    def close(self) -> None:
        """Flush (if healthy), record the recovery point and close every file. With a
        checkpoint's fsync in flight (the owner waits for it first: `checkpointing`),
        nothing is synced here: its verdict is unknown, and this fsync's success would
        not tell (the next open replays the write-ahead file's frames)."""
        if self._closed:
            return
        if self._checkpointing:
            self.fail("closed while a checkpoint's fsync was in flight")
        try:
            # (Mid-roll, its thread decides what the files hold: nothing is synced here.)
            if self._data_loss is None and self._broken is None and self._segments and \
                    self._rolling is None:
                self._end_direct()
                self.flush()
                os.fsync(self._active.fd)  # also what flush_end(durable=False) left unsynced
                self._durable_offset = self._log_end_offset
                self._write_recovery_point(sync=True, clean=self._record_clean_shutdown())
        finally:
            self._close_files()

    def _record_clean_shutdown(self) -> dict | None:
        """Write the last segment's index file, as for a sealed segment, and describe the
        segment, so the next open can trust it without reading it whole (a 1 GiB segment
        of small batches takes seconds to check batch by batch). None for an empty one."""
        active = self._active
        if active.size == 0:
            return None
        self._write_index_file(active)
        return {"segment": active.base_offset, "size": active.size,
                "next_offset": active.next_offset,
                "last_data_offset": -1 if active.last_data_offset is None else active.last_data_offset,
                "first_append_time_ms": active.first_append_time_ms}

    def _close_files(self) -> None:
        self._end_direct(cut=False)  # a healthy close cut it already
        for segment in self._segments:
            segment.close()
        os.close(self._dir_fd)  # releases the flock
        self._closed = True

    def __enter__(self) -> PartitionLog:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _writev_all(fd: int, buffers: list[bytes | memoryview]) -> None:
    """os.writev until every byte is written (IOV_MAX buffers per call; short writes resumed)."""
    i = 0
    while i < len(buffers):
        chunk = buffers[i:i + IOV_MAX]
        written = os.writev(fd, chunk)
        i += len(chunk)
        expected = sum(map(len, chunk))
        if written == expected:
            continue
        rest: list[bytes | memoryview] = []
        for buffer in chunk:
            if written >= len(buffer):
                written -= len(buffer)
                continue
            rest.append(memoryview(buffer)[written:])
            written = 0
        buffers = rest + buffers[i:]
        i = 0


@dataclass(eq=False)
class RollJob:
    """The disk work of one roll, between `PartitionLog.roll_begin` and `roll_end`. `run`
    touches no state of the log, only its own descriptors (duplicates, closed by `run`),
    so it may run on any thread. In this order, so that a crash leaves at most an empty
    next segment after a durable sealed one: fsync the sealed segment, write its index
    file (synced), create the next segment's file, fsync the directory."""

    sealed: Segment
    next: Segment
    index_bytes: bytes
    sealed_fd: int = -1
    dir_fd: int = -1
    fd: int | None = None  # the next segment's, once run

    def run(self, fsync: Callable[[int], None] | None = None) -> None:
        """The disk work; `fsync` (default `os.fsync`) syncs the sealed segment and the
        directory (a server passes its failpoint-aware one, so a fault run's slow or
        failing disk reaches rolls too)."""
        fsync = os.fsync if fsync is None else fsync
        try:
            fsync(self.sealed_fd)
            _atomic_write(self.sealed.index_path, self.index_bytes, sync=True,
                          dir_fd=self.dir_fd)
            fd = os.open(self.next.log_path,
                         os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            try:
                fsync(self.dir_fd)
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
        finally:
            self.release()

    def release(self) -> None:
        """Close the job's descriptors (`run` does, and `roll_failed` for a job that never
        ran): the directory's duplicate shares the log's lock on it."""
        for name in ("sealed_fd", "dir_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)


def unlink_files(paths: list[Path]) -> None:
    """Unlink deleted segments' files (`PartitionLog.defer_unlink` runs it on a worker
    thread). One that cannot be unlinked is left for the next open to remove."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


def _atomic_write(path: Path, data: bytes, *, sync: bool, dir_fd: int | None) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if sync and dir_fd is not None:
        os.fsync(dir_fd)


def encode_data_loss(loss: DataLoss) -> bytes:
    """The DATA_LOSS_FILE marker of `loss` (its file by name, in the log's directory)."""
    return json.dumps({"file": loss.file_name, "position": loss.position,
                       "offset": loss.offset, "detail": loss.detail,
                       "detected_unix_ms": loss.detected_unix_ms}).encode()


def read_data_loss_marker(directory: Path, clock_ms: Callable[[], int] = _now_ms
                          ) -> DataLoss | None:
    """The DATA_LOSS_FILE marker in `directory`, or None when there is none."""
    path = directory / DATA_LOSS_FILE
    try:
        record = json.loads(path.read_bytes())
        return DataLoss(str(directory / record["file"]), int(record["position"]),
                        int(record["offset"]), str(record["detail"]),
                        int(record["detected_unix_ms"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as error:
        # An unreadable marker still means an operator has to look: fail closed.
        return DataLoss(str(path), 0, 0, f"unreadable {DATA_LOSS_FILE}: {error}", clock_ms())


def _list_segments(directory: Path) -> list[int]:
    return [base for base in (parse_segment_name(name) for name in os.listdir(directory))
            if base is not None]


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
