"""Scrubbing: every copy this server holds read back from disk in the background.

A read finds a damaged batch (docs/replication.md, "Corruption found on a leader"), but
data nobody reads is never looked at: a follower's copy until it is promoted, a leader's
old segments until a consumer rewinds. Bit rot there stays hidden until the day the copy
is needed, and then the damage is all a partition has. So this task reads every copy
this server holds (the partitions it leads or holds alone, and those it follows), batch
by batch with their CRC32C, at a bounded rate, and hands what it finds to the same paths
a read's finding takes:

- a leader's copy (or the only copy) enters DATA_LOSS: with a live in-sync replica the
  partition is handed over to it and this copy is cut at the damage and refetched; alone,
  it waits for an operator (`atomlog partition recover`);
- a follower's copy is cut at the damage and the rest fetched from its leader again.

What it reads: a leader's copy (or an only copy) from its log start up to what is
durable (`segment_spans`, taken on the event loop where its owner acts); a follower's,
its segments whose batches are all durable, whole (`scrub_spans`: taken without reading
an index or a file, so the replication link's thread appending to it needs no pause);
each through a file descriptor of its own opened with
O_DIRECT, so it checks what the disk holds, not the page cache, and leaves the page
cache to consumers. A damaged batch is read a second time before it counts, and the
finding is handed to the copy's owner on the event loop, which acts only if the copy
is still the one that was read (not reloaded, truncated or deleted meanwhile).

A pass walks the copies in (topic, partition) order; the next pass begins
`partition.scrub_interval_ms` after the last one began (at once if that one took
longer). Progress is kept in `<data_dir>/scrub.json`, so a restart carries on where the
pass was instead of starting over. `partition.scrub_bytes_per_s` bounds the reads (0:
no passes). An operator's `scrub_now` (PartitionService.ScrubPartition, `atomlog
partition scrub`) reads one copy at once, unpaced, passes or not.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from partition_server.owner import State
from partition_server.segment import ScanFailure, batch_size_at, check_prefix
from services.errors import AtomlogError
from services.fastmetrics import Counter
from services.logs import event

log = logging.getLogger("atomlog.partition.scrubber")

BLOCK = 4096  # O_DIRECT's alignment (partition_server/direct_io.py)
CHUNK = 4 << 20  # bytes a read takes (and the pacing's unit)
FIRST_PASS_DELAY_S = 60.0  # after a start with no pass on record (or the interval, if less)
SAVE_EVERY_S = 5.0  # progress written at most this often (and at each pass's end)
STATE_FILE = "scrub.json"

SCRUB_BYTES = Counter("atomlog_scrub_bytes_total",
                      "Bytes of partition copies the scrubber read back and checked.")
SCRUB_DAMAGE = Counter("atomlog_scrub_damage_found_total",
                       "Damaged batches the scrubber found, by the copy's role here (label "
                       "`copy`; leader: the partition entered DATA_LOSS and is handed over "
                       "when it can be; follower: the copy is cut at the damage and fetched "
                       "again).", ["copy"])
for _role in ("leader", "follower"):
    SCRUB_DAMAGE.labels(_role)  # (exported at 0: the alert's series exist before damage)
SCRUB_PASSES = Counter("atomlog_scrub_passes_total",
                       "Scrub passes completed (every copy this server holds read back).")


class ScrubProgress:
    """The pure part: where the passes are, what is due, and its record on disk.

    `started_ms` / `completed_ms`: wall-clock times (ms) of the current (or last) pass's
    start and of the last completed pass's end (0: none); `done_through`: the last
    (topic, partition) of the current pass already read (None: none yet; the pass is
    over when `completed_ms >= started_ms`)."""

    def __init__(self, interval_ms: int, started_ms: int = 0, completed_ms: int = 0,
                 done_through: tuple[str, int] | None = None):
        self.interval_ms = interval_ms
        self.started_ms = started_ms
        self.completed_ms = completed_ms
        self.done_through = done_through

    @property
    def in_pass(self) -> bool:
        return self.started_ms > 0 and self.completed_ms < self.started_ms

    def wait_ms(self, now_ms: int, up_ms: int) -> int:
        """How long until the next pass may begin (0: now, or a pass is under way).
        `up_ms`: when this process began: with no pass on record, the first waits a
        little (FIRST_PASS_DELAY_S, or the interval if less) after the start."""
        if self.in_pass:
            return 0
        if self.started_ms == 0:
            return max(0, up_ms + min(int(FIRST_PASS_DELAY_S * 1000), self.interval_ms) - now_ms)
        return max(0, self.started_ms + self.interval_ms - now_ms)

    def begin(self, now_ms: int) -> None:
        if not self.in_pass:
            self.started_ms, self.done_through = max(now_ms, self.completed_ms + 1), None

    def left(self, keys) -> list[tuple[str, int]]:
        """The copies of `keys` (those held now) this pass has still to read, in order."""
        done = self.done_through
        return sorted(k for k in keys if done is None or k > done)

    def copy_done(self, key: tuple[str, int]) -> None:
        self.done_through = key

    def end(self, now_ms: int) -> None:
        self.completed_ms = max(now_ms, self.started_ms)
        self.done_through = None

    def to_json(self) -> bytes:
        return json.dumps({"started_unix_ms": self.started_ms,
                           "completed_unix_ms": self.completed_ms,
                           "done_through": list(self.done_through)
                           if self.done_through else None}).encode()

    @classmethod
    def from_json(cls, data: bytes, interval_ms: int) -> ScrubProgress:
        """A record that does not parse is no record (a pass starts over): it only
        saves work, it never decides what is correct."""
        try:
            record = json.loads(data)
            done = record.get("done_through")
            return cls(interval_ms, int(record["started_unix_ms"]),
                       int(record["completed_unix_ms"]),
                       (str(done[0]), int(done[1])) if done else None)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return cls(interval_ms)


class Pacer:
    """Bounds a thread's reads to `bytes_per_s` (sleeping on `stop`, so a close ends it)."""

    def __init__(self, bytes_per_s: int, stop: threading.Event):
        self.bytes_per_s = bytes_per_s
        self.stop = stop
        self._due = time.monotonic()

    def took(self, n: int) -> None:
        now = time.monotonic()
        # (Idle time earns no credit beyond one chunk: a pass resumed after a wait does
        # not read in a burst.)
        self._due = max(self._due, now - CHUNK / self.bytes_per_s) + n / self.bytes_per_s
        if self._due > now:
            self.stop.wait(self._due - now)


class _Reader:
    """One thread's aligned buffer and direct reads of segment files."""

    def __init__(self):
        self._size = CHUNK + BLOCK
        self._buffer = mmap.mmap(-1, self._size)

    def _grow(self, size: int) -> None:
        # (Not closed: views of it may still be held; it goes with the last of them.)
        self._size = size
        self._buffer = mmap.mmap(-1, size)

    def read(self, fd: int, position: int, length: int) -> memoryview:
        """`length` bytes at `position` (fewer at the file's end): an aligned read around
        them, the bytes wanted sliced out."""
        start = position - position % BLOCK
        want = position + length - start
        want += -want % BLOCK
        if want > self._size:
            self._grow(want)
        n = os.preadv(fd, [memoryview(self._buffer)[:want]], start)
        have = max(0, min(n, position + length - start) - (position - start))
        return memoryview(self._buffer)[position - start:position - start + have]


def _open(path) -> int:
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0))
    except OSError as error:
        if error.errno != errno.EINVAL:  # a file system without O_DIRECT (tmpfs)
            raise
        return os.open(path, flags)


def _check_at(reader: _Reader, fd: int, position: int, expected: int, end: int):
    """Check the whole batches of a file from `position` (a chunk's worth, or the one
    batch there if it is larger than a chunk), the copy ending at `end`: (failure or None,
    bytes checked, the offset the next batch must have, bytes read). A batch that does
    not fit in what the copy holds there is a failure (truncated, or its length damaged)."""
    length = min(CHUNK, end - position)
    data = reader.read(fd, position, length)
    read = len(data)
    failure, checked, next_offset = check_prefix(data, position, expected)
    if failure is None and checked == 0:
        size = batch_size_at(data, 0)
        if size is not None and length < size <= end - position and read == length:
            data = reader.read(fd, position, size)  # one batch larger than a chunk
            read += len(data)
            failure, checked, next_offset = check_prefix(data, position, expected)
        if failure is None and checked == 0:
            failure = ScanFailure(position, expected,
                                  f"truncated batch (the copy holds {end - position} bytes "
                                  f"from here, the file {len(data)} of them; the batch "
                                  f"header says {size if size is not None else '?'})")
    return failure, checked, next_offset, read


def scrub_span(span, reader: _Reader, pacer: Pacer, counted=None) -> ScanFailure | None:
    """Check the batches of one `SegmentSpan` (log.segment_spans) as the disk holds them;
    None if whole (or stopped), else the first damaged batch, found at the same place by
    a second read to be sure. A file gone (deleted meanwhile) is nothing found."""
    try:
        fd = _open(span.path)
    except FileNotFoundError:
        return None
    try:
        position, expected, end = span.position, span.first_offset, span.end_position
        while position < end and not pacer.stop.is_set():
            failure, checked, expected, read = _check_at(reader, fd, position, expected, end)
            if counted is not None:
                counted(read)
            pacer.took(read)
            if failure is not None:
                second = _check_at(reader, fd, failure.position, failure.offset, end)[0]
                if second is not None and second.position == failure.position:
                    return failure
                return None  # (not there again: a read's fluke, or the file moved)
            position += checked
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Copy:
    key: tuple[str, int]
    role: str  # leader (or the only copy) / follower
    holder: object  # the PartitionOwner or Follower
    log: object  # its PartitionLog when the spans were taken
    cut_generation: int  # the log's then (a cut since voids what was read)
    spans: list


@dataclass(frozen=True)
class ScrubReport:
    """What `Scrubber.scrub_now` read of one copy, and found."""
    role: str
    segments: int
    bytes: int
    damage: tuple | None  # (span, ScanFailure) of the first damaged batch
    acted_on: bool  # the damage handed to the copy's owner (not moved on meanwhile)


UNPACED = 1 << 40  # bytes/s: an operator's scrub_now reads as fast as the disk gives


_scrubbers: weakref.WeakSet = weakref.WeakSet()


class Scrubber:
    """`start()` runs the background passes (when `bytes_per_s` > 0); `scrub_now` reads
    one copy at once for an operator (PartitionService.ScrubPartition), either way."""

    def __init__(self, manager, data_dir: Path, *, bytes_per_s: int, interval_ms: int,
                 clock_ms=lambda: int(time.time() * 1000)):
        self.manager = manager
        self.path = Path(data_dir) / STATE_FILE
        self.bytes_per_s = bytes_per_s
        self.clock_ms = clock_ms
        self.up_ms = clock_ms()
        self.progress = ScrubProgress(interval_ms)
        self._stop = threading.Event()
        self._task: asyncio.Task | None = None
        self._now = asyncio.Lock()  # one scrub_now at a time
        self._saved_at = 0.0
        self._pass_bytes = 0  # read in this pass since this process began it or carried it on
        _scrubbers.add(self)

    def start(self) -> None:
        if not self.bytes_per_s:
            return
        try:
            self.progress = ScrubProgress.from_json(self.path.read_bytes(),
                                                    self.progress.interval_ms)
        except FileNotFoundError:
            pass
        self._task = asyncio.create_task(self._run(), name="scrubber")

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        # (The reader's buffer is never closed: a worker thread may still be reading
        # into it when this task is cancelled; it goes with the last reference.)
        reader = _Reader()
        pacer = Pacer(self.bytes_per_s, self._stop)
        while True:
            wait_ms = self.progress.wait_ms(self.clock_ms(), self.up_ms)
            if wait_ms:
                await asyncio.sleep(min(wait_ms / 1000, 60.0))
                continue
            try:
                await self.scrub_pass(reader, pacer)
            except Exception:  # noqa: BLE001 — logged; the pass carries on next time
                log.exception("scrub pass failed")
                await asyncio.sleep(10.0)

    async def scrub_pass(self, reader: _Reader, pacer: Pacer) -> None:
        """Carry on with (or begin) a pass, to its end."""
        if not self.progress.in_pass:
            self.progress.begin(self.clock_ms())
            event(log, "scrub pass begins", copies=len(self._keys()))
            self._save(force=True)
        copies = 0
        for key in self.progress.left(self._keys()):
            copy = self._copy(key)
            if copy is not None and copy.spans:
                copies += 1
                found, read = await asyncio.to_thread(self._scrub_copy, copy, reader, pacer)
                self._pass_bytes += read
                if self._stop.is_set():
                    return
                if found is not None:
                    self._found(copy, *found)
            self.progress.copy_done(key)
            self._save()
        self.progress.end(self.clock_ms())
        SCRUB_PASSES.inc()
        self._save(force=True)
        event(log, "scrub pass complete", copies=copies, bytes_read=self._pass_bytes,
              seconds=round((self.progress.completed_ms - self.progress.started_ms) / 1000, 1))
        self._pass_bytes = 0

    async def scrub_now(self, key: tuple[str, int]) -> ScrubReport:
        """Read this server's copy of `key` back at once (not paced) and act on what it
        finds as a pass does. Raises UNKNOWN_TOPIC_OR_PARTITION (no copy here),
        PARTITION_LOADING (opening) or DATA_LOSS (already known damaged)."""
        async with self._now:
            copy = self._copy(key)
            if copy is None:
                raise self._unavailable(key)
            found, read = await asyncio.to_thread(self._scrub_copy, copy, _Reader(),
                                                  Pacer(UNPACED, self._stop))
            acted = found is not None and self._found(copy, *found)
            return ScrubReport(copy.role, len(copy.spans), read, found, acted)

    def _unavailable(self, key) -> AtomlogError:
        topic, partition = key
        owner = self.manager.owners.get(key)
        follower = self.manager.followers.get(key)
        if owner is None and follower is None:
            return AtomlogError("UNKNOWN_TOPIC_OR_PARTITION",
                                f"{self.manager.server_name} holds no copy of "
                                f"{topic}-{partition}")
        partition_log = owner.log if owner is not None else follower.log
        if partition_log is not None and partition_log.data_loss is not None:
            return partition_log.data_loss.error()
        return AtomlogError("PARTITION_LOADING",
                            f"the copy of {topic}-{partition} on {self.manager.server_name} "
                            "is opening; retry", {"retry_after_ms": "500"})

    def _keys(self) -> set:
        return set(self.manager.owners) | set(self.manager.followers)

    def _copy(self, key) -> _Copy | None:
        """The copy to read for `key` as it is now, with its spans (None: not here, not
        loaded, or refusing). On the event loop, where the logs' owners act."""
        owner = self.manager.owners.get(key)
        follower = self.manager.followers.get(key)
        if owner is not None:
            role, holder, partition_log = "leader", owner, owner.log
            if owner.state is not State.ONLINE:
                return None
        elif follower is not None:
            role, holder, partition_log = "follower", follower, follower.log
        else:
            return None
        if partition_log is None or partition_log.data_loss is not None:
            return None
        generation = partition_log.cut_generation
        if role == "follower":
            spans = partition_log.scrub_spans()  # (its link's thread may be appending)
        else:
            # The owner acts on this loop: its log's own spans, up to what is durable,
            # take in the active segment's durable part too (a leader in wal mode is
            # durable only up to its last checkpoint while it takes writes).
            try:
                spans = partition_log.segment_spans(partition_log.log_start_offset,
                                                    partition_log.durable_offset)
            except AtomlogError as error:  # refusing (or nothing durable above the start)
                log.debug("not scrubbing %s now: %s", key, error)
                return None
        return _Copy(key, role, holder, partition_log, generation, spans)

    @staticmethod
    def _scrub_copy(copy: _Copy, reader: _Reader, pacer: Pacer):
        """On a worker thread: ((span, failure) of the first damage or None, bytes read)."""
        read = 0

        def counted(n: int) -> None:
            nonlocal read
            SCRUB_BYTES.inc(n)
            read += n

        for span in copy.spans:
            failure = scrub_span(span, reader, pacer, counted)
            if failure is not None:
                return (span, failure), read
            if pacer.stop.is_set():
                break
        return None, read

    def _found(self, copy: _Copy, span, failure: ScanFailure) -> bool:
        """On the event loop: hand a damaged batch to the copy's owner, if the copy is
        still the one read; whether it was."""
        topic, partition = copy.key
        detail = f"found by the scrubber: {failure.detail}"
        if failure.offset < copy.log.log_start_offset:
            return False  # below the log start: no read serves those bytes any more
        if copy.role == "leader":
            owner = self.manager.owners.get(copy.key)
            if owner is not copy.holder or owner.log is not copy.log or \
                    owner.state is not State.ONLINE:
                return False
            if not copy.log.report_corruption(span.segment_base_offset, failure.position,
                                              failure.offset, detail, copy.cut_generation):
                return False
        else:
            follower = self.manager.followers.get(copy.key)
            if follower is not copy.holder or follower.log is not copy.log or \
                    copy.log.cut_generation != copy.cut_generation:
                return False
            follower.damage_found(copy.log, span.segment_base_offset, failure.position,
                                  failure.offset, detail, copy.cut_generation)
        SCRUB_DAMAGE.labels(copy.role).inc()
        event(log, "scrubber found a damaged batch", logging.ERROR,
              partition=f"{topic}-{partition}", role=copy.role, file=str(span.path),
              position=failure.position, offset=failure.offset, detail=failure.detail)
        return True

    def _save(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._saved_at < SAVE_EVERY_S:
            return
        self._saved_at = now
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_bytes(self.progress.to_json())
            os.replace(tmp, self.path)
        except OSError as error:  # a full disk: progress is only a saving of work
            log.warning("scrub progress not saved: %s", error)


class _ScrubCollector(Collector):
    def collect(self):
        gauge = GaugeMetricFamily(
            "atomlog_scrub_last_pass_completed_timestamp_seconds",
            "When the scrubber last completed a pass over every copy this server holds "
            "(Unix time; 0: never).")
        for scrubber in list(_scrubbers):
            if scrubber.bytes_per_s:
                gauge.add_metric([], scrubber.progress.completed_ms / 1000)
                break
        yield gauge


REGISTRY.register(_ScrubCollector())
