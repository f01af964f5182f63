"""The owner of one partition: the only code that mutates its log and producer state.

One asyncio task per partition takes queued produce requests in groups: for each batch,
in order, the producer-state core decides (append, duplicate, or refuse); accepted
batches are appended with one writev; then one fsync makes the whole group durable
(group commit: concurrent producers share it) and only then is anyone acknowledged.
The fsync runs on a worker thread and touches no Python state, so reads (on the event
loop) go on meanwhile and see the high watermark move only after it.

Start-up: the log recovers itself (torn tail truncated, or DATA_LOSS); producer state
comes from the newest readable snapshot plus the log tail, or from a full replay.
A failed write or fsync leaves the in-memory state ahead of the disk: the owner then
reloads everything from disk (the durable log is the truth) before serving again.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from partition_server import metrics as m
from partition_server.log import LogConfig, PartitionLog
from partition_server.producer_state import (APPEND, Duplicate, ProducerStateTable,
                                             SnapshotCorrupt, parse_snapshot_file_name,
                                             snapshot_file_name)
from partition_server.record_batch import BatchHeader
from services.errors import AtomlogError
from services.logs import event

log = logging.getLogger("atomlog.partition")

SNAPSHOTS_KEPT = 2


class State(enum.Enum):
    LOADING = "LOADING"
    ONLINE = "ONLINE"
    DATA_LOSS = "DATA_LOSS"
    CLOSED = "CLOSED"


@dataclass(frozen=True)
class OwnerSettings:
    log: LogConfig
    fsync: bool = True
    max_group_bytes: int = 8 << 20
    max_queued_requests: int = 1_000
    max_producers: int = 10_000
    producer_idle_expiry_ms: int = 86_400_000
    snapshot_interval_batches: int = 1_000
    snapshot_interval_ms: int = 5_000


@dataclass
class Appended:
    base_offset: int
    last_offset: int
    log_append_time_ms: int
    duplicate: bool = False


@dataclass
class _Work:
    batches: list[tuple[bytes, BatchHeader]]
    future: asyncio.Future
    results: list = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(h.size for _, h in self.batches)


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class PartitionOwner:
    def __init__(self, topic: str, partition: int, directory: Path, settings: OwnerSettings):
        self.topic = topic
        self.partition = partition
        self.directory = directory
        self.settings = settings
        self.replayed_batches = 0
        self.state = State.LOADING
        self.log: PartitionLog | None = None
        self.producers = ProducerStateTable(settings.max_producers, settings.producer_idle_expiry_ms)
        self._queue: asyncio.Queue[_Work] = asyncio.Queue(settings.max_queued_requests)
        self._data = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self._stamp_ms = 0  # the log's clock: the owner decides append times
        self._batches_since_snapshot = 0
        self._last_snapshot_ms = 0
        self._labels = (topic,)
        # Labelled children looked up once, not per group.
        self._bytes_in = m.BYTES_IN.labels(topic)
        self._records_in = m.RECORDS_IN.labels(topic)
        self._duplicates = m.DUPLICATES.labels(topic)

    # ------------------------------------------------------------------ lifecycle
    @property
    def name(self) -> str:
        return f"{self.topic}-{self.partition}"

    async def start(self) -> None:
        await self._load()
        self._task = asyncio.create_task(self._run(), name=f"owner {self.name}")

    async def _load(self) -> None:
        self.state = State.LOADING
        began = time.perf_counter()
        self.log, self.producers, replayed = await asyncio.to_thread(self._load_blocking)
        self.replayed_batches = replayed  # batches replayed on top of the snapshot
        if self.log.data_loss is not None:
            self.state = State.DATA_LOSS
            event(log, "partition refuses to serve: corruption before the log tail",
                  logging.ERROR, partition=self.name, file=self.log.data_loss.path,
                  offset=self.log.data_loss.offset)
            return
        self.state = State.ONLINE
        self._stamp_ms = max(self._stamp_ms, _wall_ms())
        self._last_snapshot_ms = _wall_ms()  # the interval counts from the load
        event(log, "partition online", partition=self.name,
              high_watermark=self.log.high_watermark, producers=self.producers.producer_count,
              replayed_batches=replayed, seconds=round(time.perf_counter() - began, 3))

    def _load_blocking(self) -> tuple[PartitionLog, ProducerStateTable, int]:
        partition_log = PartitionLog(self.directory, self.settings.log, clock_ms=self._clock)
        if partition_log.data_loss is not None:
            return partition_log, self.producers, 0
        table, covered = self._restore_snapshot(partition_log)
        replayed = 0
        start = max(covered, partition_log.log_start_offset)
        for header in partition_log.iter_headers(start):
            _apply(table, header)
            replayed += 1
        table.expire(_wall_ms())
        return partition_log, table, replayed

    def _restore_snapshot(self, partition_log: PartitionLog) -> tuple[ProducerStateTable, int]:
        """Newest snapshot that is readable and not beyond the recovered log end; else an
        empty table covering nothing (full replay). Never guesses."""
        settings = self.settings
        for path in self._snapshot_files():
            covered = parse_snapshot_file_name(path.name)
            if covered > partition_log.log_end_offset:
                path.unlink(missing_ok=True)  # describes data lost with a torn tail
                continue
            try:
                table, covered = ProducerStateTable.restore(
                    path.read_bytes(), settings.max_producers, settings.producer_idle_expiry_ms)
                return table, covered
            except (SnapshotCorrupt, OSError) as error:
                event(log, "unreadable producer snapshot; trying an older one", logging.WARNING,
                      partition=self.name, file=str(path), error=str(error))
        return ProducerStateTable(settings.max_producers, settings.producer_idle_expiry_ms), 0

    def _snapshot_files(self) -> list[Path]:
        found = []
        for path in self.directory.glob("*.producer_snapshot"):
            covered = parse_snapshot_file_name(path.name)
            if covered is not None:
                found.append((covered, path))
        return [p for _, p in sorted(found, reverse=True)]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self.state is State.ONLINE:
            await self._snapshot(force=True)
        if self.log is not None:
            self.log.close()
        self.state = State.CLOSED

    def _clock(self) -> int:
        return self._stamp_ms

    # ------------------------------------------------------------------ checks
    def check_serving(self) -> None:
        if self.state is State.ONLINE:
            return
        if self.state is State.DATA_LOSS and self.log is not None and self.log.data_loss:
            raise self.log.data_loss.error()
        if self.state is State.LOADING:
            raise AtomlogError("PARTITION_LOADING", f"partition {self.name} is loading",
                               {"retry_after_ms": "100"})
        raise AtomlogError("SHUTTING_DOWN", f"partition {self.name} is closed")

    # ------------------------------------------------------------------ produce
    async def produce(self, batches: list[tuple[bytes, BatchHeader]]) -> list:
        """Queue validated batches; the result per batch is Appended or an AtomlogError."""
        self.check_serving()
        work = _Work(batches, asyncio.get_running_loop().create_future())
        try:
            self._queue.put_nowait(work)
        except asyncio.QueueFull:
            raise AtomlogError("RESOURCE_EXHAUSTED",
                               f"partition {self.name} has {self._queue.maxsize} produce requests "
                               "queued", {"limit": "partition.max_queued_requests"}) from None
        # No shield needed: if this call is cancelled the future is cancelled too, and the
        # owner (which checks done() before answering) appends the batches all the same.
        return await work.future

    async def _run(self) -> None:
        while True:
            group = [await self._queue.get()]
            size = group[0].size
            while size < self.settings.max_group_bytes and not self._queue.empty():
                work = self._queue.get_nowait()
                group.append(work)
                size += work.size
            try:
                self.check_serving()
            except AtomlogError as error:
                _fail_all(group, error)
                continue
            try:
                await self._commit(group)
            except asyncio.CancelledError:
                _fail_all(group, AtomlogError("SHUTTING_DOWN", f"partition {self.name} closed"))
                raise
            except Exception as error:  # noqa: BLE001 — disk trouble: reload from disk
                log.exception("append failed on %s; reloading from disk", self.name)
                _fail_all(group, AtomlogError("PARTITION_LOADING",
                                              f"write failed on {self.name}: {error}; reloading"))
                await self._reload_after_failure()

    async def _commit(self, group: list[_Work]) -> None:
        self._stamp_ms = now = max(self._stamp_ms, _wall_ms())
        accepted: list[bytes] = []
        expected_bases: list[int] = []
        next_offset = self.log.log_end_offset
        table = self.producers
        duplicates = records = appended_bytes = 0
        for work in group:
            for batch, header in work.batches:
                try:
                    decision = table.check(header.producer_id, header.producer_epoch,
                                           header.base_sequence, header.record_count, now)
                except AtomlogError as error:
                    work.results.append(error)
                    continue
                if decision is APPEND:
                    last = next_offset + header.last_offset_delta
                    table.apply(header.producer_id, header.producer_epoch, header.base_sequence,
                                header.last_sequence, next_offset, last, now,
                                control=header.is_control)
                    work.results.append(Appended(next_offset, last, now))
                    accepted.append(batch)
                    expected_bases.append(next_offset)
                    records += header.record_count
                    appended_bytes += len(batch)
                    next_offset = last + 1
                elif isinstance(decision, Duplicate):
                    duplicates += 1
                    work.results.append(Appended(decision.base_offset, decision.last_offset,
                                                 decision.timestamp_ms, duplicate=True))
        if accepted:
            began = time.perf_counter()
            offsets = self.log.append(accepted)
            m.APPEND_SECONDS.observe(time.perf_counter() - began)
            # Pair assertion: the log assigned exactly the offsets producer state recorded.
            assert offsets == expected_bases, (offsets, expected_bases)
            self._bytes_in.inc(appended_bytes)
            self._records_in.inc(records)
        if duplicates:
            self._duplicates.inc(duplicates)
        await self._flush(len(accepted))
        for work in group:
            if not work.future.done():
                work.future.set_result(work.results)
        self._batches_since_snapshot += len(accepted)
        await self._maybe_snapshot()

    async def _flush(self, batches: int) -> None:
        """Make everything appended durable (or, with fsync off, visible), then wake readers."""
        target, fd = self.log.flush_begin()
        if fd is not None and self.settings.fsync:
            began = time.perf_counter()
            await asyncio.to_thread(os.fsync, fd)
            m.FSYNC_SECONDS.observe(time.perf_counter() - began)
            m.FSYNCS.inc()
            m.PRODUCE_BATCHES_PER_FSYNC.observe(batches)
        moved = self.log.flush_end(target, durable=self.settings.fsync)
        if moved:
            async with self._data:
                self._data.notify_all()

    async def _reload_after_failure(self) -> None:
        self.state = State.LOADING
        try:
            self.log.close()
        except Exception:  # noqa: BLE001
            pass
        await self._load()

    def expire_producers(self) -> int:
        """Forget producers idle past the expiry (bounded scan of the table)."""
        if self.state is not State.ONLINE:
            return 0
        removed = len(self.producers.expire(_wall_ms()))
        m.PRODUCERS_EXPIRED.labels(*self._labels).inc(removed)
        return removed

    async def apply_retention(self) -> int:
        """Delete whole old segments past the retention limits; returns segments removed."""
        if self.state is not State.ONLINE:
            return 0
        return self.log.apply_retention()

    # ------------------------------------------------------------------ delete records
    async def delete_records(self, before_offset: int) -> int:
        """DeleteRecords: delete the whole segments below `before_offset` (the log's shared
        deletion path, as retention); returns the log start offset after it. Refuses a
        partition that is not serving, a negative offset (INVALID_ARGUMENT) and one above
        the high watermark (OFFSET_OUT_OF_RANGE), so only flushed segments ever go.

        Serialized with appends the way retention is: it runs to the end without yielding
        to the event loop, and the owner task changes the log only in steps that do not
        yield either. At the owner's await points (its group fsync, its snapshot write)
        nothing deleted here is in use: the fsync is of the active segment, never deleted,
        and a snapshot being written covers the high watermark, at or above the new start.

        Producer-state snapshots that would describe deleted data (covering less than the
        new log start) are removed first, durably: restoring one of them and replaying
        from the new start would skip the deleted batches. Recovery then uses a newer
        snapshot or replays what is left, as a full replay of the remaining log would."""
        self.check_serving()
        new_start = self.log.log_start_after_delete(before_offset)
        if new_start > self.log.log_start_offset:
            self._remove_snapshots_below(new_start)
            self.log.delete_records(before_offset)
        return self.log.log_start_offset

    def _remove_snapshots_below(self, offset: int) -> None:
        removed = False
        for path in self.directory.iterdir():
            covered = parse_snapshot_file_name(path.name)
            if covered is not None and covered < offset:
                path.unlink(missing_ok=True)
                removed = True
        if removed:
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    # ------------------------------------------------------------------ snapshots
    async def _maybe_snapshot(self) -> None:
        settings = self.settings
        if not self._batches_since_snapshot:
            return
        if self._batches_since_snapshot >= settings.snapshot_interval_batches or \
                _wall_ms() - self._last_snapshot_ms >= settings.snapshot_interval_ms:
            await self._snapshot()

    async def _snapshot(self, force: bool = False) -> None:
        """Write producer state covering everything durable (applied end == high watermark)."""
        if self.log is None or (not force and not self._batches_since_snapshot):
            return
        covered = self.log.high_watermark
        if covered != self.log.log_end_offset:
            return
        data = self.producers.snapshot(covered)
        await asyncio.to_thread(self._write_snapshot, covered, data)
        self._batches_since_snapshot = 0
        self._last_snapshot_ms = _wall_ms()

    def _write_snapshot(self, covered: int, data: bytes) -> None:
        path = self.directory / snapshot_file_name(covered)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        for old in self._snapshot_files()[SNAPSHOTS_KEPT:]:
            old.unlink(missing_ok=True)

    # ------------------------------------------------------------------ reads
    def positions(self) -> dict[str, int]:
        partition_log = self.log
        hw = partition_log.high_watermark
        return {"log_start_offset": partition_log.log_start_offset, "high_watermark": hw,
                # No transactions yet (issue 6): the max read position is the high watermark.
                "max_read_position": hw,
                "last_data_offset": partition_log.last_data_offset}

    def read(self, offset: int, max_bytes: int) -> tuple[bytes, int]:
        self.check_serving()
        data, next_offset = self.log.read(offset, max_bytes, self.log.high_watermark)
        m.BYTES_OUT.labels(*self._labels).inc(len(data))
        return data, next_offset

    async def wait_for_data(self, offset: int, timeout_s: float) -> None:
        """Return when the high watermark passes offset, or after timeout_s."""
        if self.log.high_watermark > offset or timeout_s <= 0:
            return
        async with self._data:
            try:
                await asyncio.wait_for(
                    self._data.wait_for(lambda: self.state is not State.ONLINE
                                        or self.log.high_watermark > offset), timeout_s)
            except asyncio.TimeoutError:
                pass

    def offset_for_timestamp(self, timestamp_ms: int) -> tuple[int, int] | None:
        self.check_serving()
        return self.log.offset_for_timestamp(timestamp_ms)

    # ------------------------------------------------------------------ admin
    async def recover_data_loss(self, file: str, offset: int):
        if self.state is not State.DATA_LOSS:
            raise AtomlogError("PARTITION_NOT_IN_DATA_LOSS",
                               f"partition {self.name} is {self.state.value}, not in DATA_LOSS")
        report = await asyncio.to_thread(self.log.recover_data_loss, file, offset)
        self.log.close()
        await self._load()
        return report


def _apply(table: ProducerStateTable, header: BatchHeader) -> None:
    table.apply(header.producer_id, header.producer_epoch, header.base_sequence,
                header.last_sequence, header.base_offset, header.last_offset,
                header.log_append_time_ms, control=header.is_control)


def _fail_all(group: list[_Work], error: AtomlogError) -> None:
    for work in group:
        if not work.future.done():
            work.future.set_exception(error)
