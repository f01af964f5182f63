"""A measuring prototype, not part of atomlog: the native prototype's hot path
(bench/native_core/main.go) written in lean Python, to tell how much of the combined
server's CPU per one-call transaction is Python itself and how much is the way the
server is built (tasks per partition and per TC partition, queues per destination,
futures, messages between roles, metrics).

It serves CoordinatorService/CommitTxn only, with the same durable work as the Go
prototype and no more, in one asyncio event loop and one committer task:

- the same checks (an idempotency key of 1-256 bytes whose tc_partition_for is
  tc_partition; 1..64 batches, at most one per partition, 1 MiB in all; each batch
  whole with its CRC32C right, neither transactional nor control, no producer id or
  sequence), through atomlog's own record_batch functions;
- a key committed already answers already_ended (the last 100,000 keys);
- group commit: whatever queued while the last group was on disk goes together. Phase 1
  appends each partition's batches (offset, append time, the transaction's id and bit
  stamped into the copy, its CRC computed again) and the previous group's commit
  markers, one write per file, then every written file's fsync in one io_uring
  submission (atomlog's partition_server/uring.py, completions read from an eventfd on
  the loop, as the combined server does); phase 2 appends the group's decisions to
  their TC partitions' logs and fsyncs them the same way; only then are the calls
  answered.

What it leaves out is the Go prototype's list: replication, producer state, transaction
buffers and the max read position, acks and cursors, sessions, snapshots, recovery,
retention, metrics, TLS, the ErrorInfo of a refusal. So beside the Go prototype it is
the same work in another language, and beside the combined server the same language
with the rest of the server left out.

With `--wal`, as the Go prototype's: a group's staged batches, markers and decisions go
to one write-ahead file with one fsync, and the partition and TC files get the same
bytes every 100 ms, many groups at a time, one write and one fsync per file.

With `--cores` (CoreServer), the same loop and group commit run atomlog's own cores and
logs where the prototype has its few lines: the TC partitions' TcPartitionCore and
__txn_log records, each partition's PartitionLog and TxnBuffer. That is the durable work
and state of the real server without its structure (its tasks, queues and messages).
With `--cores --wal`, what the cores' logs append goes to one write-ahead file too: a
group's staged batches and markers, then its TC records, in one write and one fsync (the
decisions after their data in the file, so the stages need no fsync of their own); the
partition and TC logs are written with each group as before (readable at once) and
fsynced by a checkpointer every 100 ms.

It takes the same calls on a link too (services/link_wire.py's frames, one call at a time
per connection, as the SDK's commits reach a coordinator's link); `--nothing` makes the
link a do-nothing one (an empty answer, the request unread), the link's floor.

    .venv/bin/python bench/lean_core.py --dir DIR [--wal] [--cores] | --nothing
    .venv/bin/python bench/lean_core.py --dir DIR --cores [--wal] --in-process 1000
    # prints its gRPC address and its link's, then serves
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import crc32c  # noqa: E402
import grpc  # noqa: E402

from atomlog.v1 import common_pb2, coordinator_pb2, partition_pb2  # noqa: E402
from coordinator.core import OneCallStart, TcPartitionCore  # noqa: E402
from coordinator.records import (Decision, TopicPartition, encode_record,  # noqa: E402
                                 tc_partition_for)
from partition_server import record_batch, uring  # noqa: E402
from partition_server.durability import WATCH_S  # noqa: E402
from partition_server.log import PartitionLog  # noqa: E402
from partition_server.record_batch import (ATTR_CONTROL, ATTR_TRANSACTIONAL,  # noqa: E402
                                           CRC_COVERED_FROM, CRC_OFFSET, NO_PRODUCER_ID,
                                           NO_SEQUENCE, ControlType, Record, TxnId,
                                           encode_batch, parse_header, stamp_transaction,
                                           validate_batch)
from partition_server.txn_buffer import MarkerAction, TxnBuffer  # noqa: E402
from services.errors import AtomlogError  # noqa: E402

TC_PARTITIONS = 16
MAX_KEY_BYTES = 256
MAX_ONE_CALL = 1 << 20
MAX_BATCHES = 64
REMEMBERED_KEYS = 100_000
COMMITTING = coordinator_pb2.TxnState.Value("TXN_STATE_COMMITTING")

_OFFSET = struct.Struct(">q")
_APPEND_TIME = struct.Struct(">q")
_ATTRIBUTES = struct.Struct(">h")
_TXN = struct.Struct(">IQ")
_CRC = struct.Struct(">I")
_DECISION = struct.Struct(">QqH")
_FRAME = struct.Struct(">iI")


class Refused(Exception):
    """A call refused before anything is written: its gRPC status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def check(request) -> list:
    """The request's batches' headers, or Refused (nothing written)."""
    key = request.idempotency_key
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"idempotency_key must be 1-{MAX_KEY_BYTES} bytes")
    if request.tc_partition != tc_partition_for(key, TC_PARTITIONS):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "tc_partition is not the key's")
    if request.abort or len(request.acks) or request.HasField("session"):
        raise Refused(grpc.StatusCode.UNIMPLEMENTED, "the prototype commits batches only")
    batches = request.batches
    if not 1 <= len(batches) <= MAX_BATCHES:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"1-{MAX_BATCHES} batches")
    seen, headers, total = set(), [], 0
    for item in batches:
        tp = item.topic_partition
        name = f"{tp.topic}-{tp.partition}"
        if name in seen:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"two batches for {name}")
        seen.add(name)
        batch = item.record_batch
        total += len(batch)
        try:
            header = record_batch.parse_header(batch)
            if header.size != len(batch):
                raise ValueError(f"batch_length says {header.size} bytes, the batch has "
                                 f"{len(batch)}")
            record_batch.verify_crc(batch, header)
        except (AtomlogError, ValueError) as error:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {error}") from None
        if (header.attributes & (ATTR_TRANSACTIONAL | ATTR_CONTROL)
                or header.producer_id != NO_PRODUCER_ID or header.base_sequence != NO_SEQUENCE):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: a one-call batch has no "
                          "producer id, no sequence and no transaction")
        headers.append((name, header))
    if total > MAX_ONE_CALL:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{total} bytes of batches")
    return headers


class Log:
    """One append-only file (a partition's, a TC partition's, the write-ahead file) and
    the offset its next batch gets."""

    __slots__ = ("fd", "next")

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
        self.next = 0


class Server:
    """The prototype: CommitTxn calls queued by `commit_txn`, committed a group at a time
    by `committer`, fsyncs through one io_uring ring read from an eventfd on the loop
    (the module doc). Needs io_uring (SystemExit where it is refused)."""

    def __init__(self, directory: Path, wal: bool = False):
        self.dir = directory
        self.wal = Log(directory / "wal.log") if wal else None
        self.checkpoint: dict[Log, bytearray] = {}
        self.loop = asyncio.get_running_loop()
        self.queue: list = []  # (request, headers, future)
        self.wake = asyncio.Event()
        self.logs: dict[str, Log] = {}
        self.tc_logs = [Log(directory / f"__tc-{tc}.log") for tc in range(TC_PARTITIONS)]
        self.sequence = [0] * TC_PARTITIONS
        self.keys: dict[str, common_pb2.TxnId] = {}
        self.order: collections.deque = collections.deque()
        self.markers: dict[Log, list[TxnId]] = {}
        self.ring = uring.Ring.open()
        if self.ring is None:
            raise SystemExit("lean core: io_uring is not usable here")
        self.efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.ring.register_eventfd(self.efd)
        self.in_flight: dict[int, asyncio.Future] = {}
        self.next_user_data = 0
        self.looks_again = 0  # fsyncs found done by looking, not by the eventfd
        self.loop.add_reader(self.efd, self._reap)

    async def commit_txn(self, request, context):
        try:
            headers = check(request)
        except Refused as refused:
            await context.abort(refused.code, str(refused))
        future = self.loop.create_future()
        self.queue.append((request, headers, future))
        self.wake.set()
        return await future  # once queued, the outcome is the group's

    async def committer(self) -> None:
        """One group at a time: what queued meanwhile, or (idle, after one turn for
        company) what the last group still owes alone."""
        while True:
            if not self.queue:
                if self.owes():
                    await asyncio.sleep(0)
                if not self.queue and not self.owes():
                    self.wake.clear()
                    await self.wake.wait()
            group, self.queue = self.queue, []
            try:
                await self.commit(group)
            except BaseException:
                # A prototype: a failure here is a bug in it; say so and stop at once
                # (the gRPC server's threads would otherwise keep the process up, deaf).
                import traceback
                traceback.print_exc()
                os._exit(70)

    def owes(self) -> bool:
        """Whether the last group left work for the next (its markers)."""
        return bool(self.markers)

    def log(self, name: str) -> Log:
        log = self.logs.get(name)
        if log is None:
            log = self.logs[name] = Log(self.dir / f"{name}.log")
        return log

    async def fsync(self, logs) -> None:
        """Every log's fsync in one io_uring submission; returns once all are done. (This
        workload's 16 partitions and 16 TC partitions stay within the ring's entries.)"""
        assert len(self.in_flight) + len(logs) <= self.ring.entries
        futures = []
        for log in logs:
            user_data = self.next_user_data
            self.next_user_data += 1
            future = self.loop.create_future()
            self.in_flight[user_data] = future
            self.ring.queue_fsync(log.fd, user_data)
            futures.append(future)
        for user_data, code in self.ring.submit():
            self._done(user_data, code)
        for future in futures:
            while not future.done():
                # As LoopRing._look_again: the eventfd may never ring for a completion
                # left on the kernel's overflow list, so look again every WATCH_S. (Before
                # this, the `--cores` server stalled in about one drive of 30, its loop
                # idle with calls unanswered, as a completion never read leaves it.)
                await asyncio.wait([future], timeout=WATCH_S)
                if not future.done():
                    self.looks_again += 1
                    self._reap()
            code = future.result()
            if code:
                raise OSError(code, os.strerror(code))

    def _reap(self) -> None:
        try:
            os.eventfd_read(self.efd)
        except BlockingIOError:
            pass
        for user_data, code in self.ring.completions():
            self._done(user_data, code)

    def _done(self, user_data: int, code: int) -> None:
        future = self.in_flight.pop(user_data, None)
        if future is not None and not future.done():
            future.set_result(code)

    async def commit(self, group: list) -> None:
        now = int(time.time() * 1000)
        fresh, again, in_group = [], [], set()
        for entry in group:
            key = entry[0].idempotency_key
            known = self.keys.get(key)
            if known is not None:
                entry[2].set_result(coordinator_pb2.CommitTxnResponse(
                    txn_id=known, state=COMMITTING, already_ended=True))
            elif key in in_group:  # a retry racing its first call: answered after it
                again.append(entry)
            else:
                in_group.add(key)
                fresh.append(entry)
        # Phase 1: the staged batches and the previous group's markers.
        buffers: dict[Log, bytearray] = {}
        for log, ids in self.markers.items():
            out = buffers.setdefault(log, bytearray())
            for txn in ids:
                marker = bytearray(record_batch.control_batch_parsed(
                    ControlType.COMMIT, txn=txn, coordinator_epoch=0, timestamp_ms=now)[0])
                _OFFSET.pack_into(marker, 0, log.next)
                _APPEND_TIME.pack_into(marker, 13, now)
                _CRC.pack_into(marker, CRC_OFFSET,
                               crc32c.crc32c(memoryview(marker)[CRC_COVERED_FROM:]))
                out += marker
                log.next += 1
        self.markers = {}
        ids, owed, results = [], [], []
        for request, headers, _ in fresh:
            tc = request.tc_partition
            self.sequence[tc] += 1
            txn = TxnId(tc, self.sequence[tc])
            ids.append(txn)
            wrote, answered = [], []
            for item, (name, header) in zip(request.batches, headers):
                log = self.log(name)
                out = buffers.setdefault(log, bytearray())
                start = len(out)
                out += item.record_batch
                view = memoryview(out)
                _OFFSET.pack_into(out, start, log.next)
                _APPEND_TIME.pack_into(out, start + 13, now)
                _ATTRIBUTES.pack_into(out, start + 25, header.attributes | ATTR_TRANSACTIONAL)
                _TXN.pack_into(out, start + 65, txn.tc_partition, txn.sequence)
                _CRC.pack_into(out, start + CRC_OFFSET, crc32c.crc32c(
                    view[start + CRC_COVERED_FROM:start + header.size]))
                view.release()
                answered.append(partition_pb2.ProduceResult(
                    topic_partition=item.topic_partition, base_offset=log.next,
                    last_offset=log.next + header.last_offset_delta,
                    log_append_time_unix_ms=now))
                log.next += header.last_offset_delta + 1
                wrote.append(log)
            owed.append(wrote)
            results.append(answered)
        decisions: dict[Log, bytearray] = {}
        for (request, _, _), txn in zip(fresh, ids):
            key = request.idempotency_key.encode()
            record = _DECISION.pack(txn.sequence, now, len(key)) + key
            out = decisions.setdefault(self.tc_logs[txn.tc_partition], bytearray())
            out += record + _CRC.pack(crc32c.crc32c(record))
        try:
            if self.wal is not None:
                # One file written in order, read back as its longest valid prefix (each
                # frame has its CRC): a decision that survives a crash has its data
                # before it. The partition files get the same bytes later (checkpointer).
                os.write(self.wal.fd, self.frames(buffers) + self.frames(decisions))
                await self.fsync([self.wal])
                for written in (buffers, decisions):
                    for log, data in written.items():
                        self.checkpoint.setdefault(log, bytearray()).extend(data)
            else:
                for log, data in buffers.items():
                    os.write(log.fd, data)
                await self.fsync(buffers)
                # Phase 2: the decisions, then their fsyncs.
                for log, data in decisions.items():
                    os.write(log.fd, data)
                await self.fsync(decisions)
        except OSError as error:  # as the Go prototype: the outcome is unknown; stop
            for entry in fresh + again:
                if not entry[2].done():
                    entry[2].set_exception(error)
            raise SystemExit(f"lean core: {error}") from error
        for (request, _, future), txn, wrote, answered in zip(fresh, ids, owed, results):
            pb_id = common_pb2.TxnId(tc_partition=txn.tc_partition, sequence=txn.sequence)
            self.remember(request.idempotency_key, pb_id)
            for log in wrote:
                self.markers.setdefault(log, []).append(txn)
            future.set_result(coordinator_pb2.CommitTxnResponse(
                txn_id=pb_id, state=COMMITTING, batch_results=answered))
        for request, _, future in again:
            known = self.keys.get(request.idempotency_key)
            if known is not None:
                future.set_result(coordinator_pb2.CommitTxnResponse(
                    txn_id=known, state=COMMITTING, already_ended=True))
            else:
                future.set_exception(OSError("its first call failed"))

    @staticmethod
    def frames(buffers: dict) -> bytes:
        """The write-ahead file's form of per-log data: for each log, its descriptor
        number (a real file would name it), the data's length, the data and a CRC32C of
        all three."""
        out = bytearray()
        for log, data in buffers.items():
            start = len(out)
            out += _FRAME.pack(log.fd, len(data))
            out += data
            out += _CRC.pack(crc32c.crc32c(memoryview(out)[start:]))
        return bytes(out)

    async def checkpointer(self) -> None:
        """Every 100 ms: what the write-ahead file made durable goes to the partition
        files, one write and one fsync per file for all the groups since."""
        while True:
            await asyncio.sleep(0.1)
            due, self.checkpoint = self.checkpoint, {}
            for log, data in due.items():
                os.write(log.fd, data)
            if due:
                await self.fsync(due)

    def remember(self, key: str, txn_id) -> None:
        self.keys[key] = txn_id
        self.order.append(key)
        if len(self.order) > REMEMBERED_KEYS:
            del self.keys[self.order.popleft()]


class CoreServer(Server):
    """`--cores`: the same loop and group commit, with atomlog's own cores and logs where
    the prototype has its few lines: each TC partition's TcPartitionCore (begin_one_call,
    end_one_call, append_done, marker_confirmed: its sequences, keys, Opened and
    Decided records, markers and Completed records, encoded as the TC log's records in
    one batch a group), each partition's PartitionLog (segments, index, high watermark)
    and TxnBuffer (the staged transaction open until its marker, the max read position),
    the batches validated and stamped by record_batch as StageTxn does. What it still
    leaves out is the server's structure: the tasks, queues, messages and futures
    between these, and what no one-call transaction of this workload needs (producer
    state, acks, sessions, replication, snapshots, metrics)."""

    def __init__(self, directory: Path, wal: bool = False):
        super().__init__(directory, wal)
        self.dirty: set = set()  # with --wal: PartitionLogs the checkpointer fsyncs next
        self.deferred: list = []  # with --wal: phase 1's (logs, written), for phase 2's
        self.cores = [TcPartitionCore(tc) for tc in range(TC_PARTITIONS)]
        self.tc_plogs = [PartitionLog(directory / f"__txn_log-{tc}")
                         for tc in range(TC_PARTITIONS)]
        self.plogs: dict[str, tuple] = {}  # name -> (PartitionLog, TxnBuffer)
        self.owed_markers: dict[str, list] = {}  # partition name -> [coordinator Marker]
        self.owed_appends: list = []  # (tc, Append): completions for the next group

    def partition(self, name: str) -> tuple:
        found = self.plogs.get(name)
        if found is None:
            found = self.plogs[name] = (PartitionLog(self.dir / name), TxnBuffer())
        return found

    async def durable(self, logs: list, written: list, defer: bool = False) -> None:
        """Every PartitionLog's flush: begun, fsynced in one submission, ended. With
        --wal, `written` ((log, batch bytes) in the order appended) goes to the
        write-ahead file instead, one write and one fsync, and the logs' high watermarks
        move (not their recovery points: the checkpointer fsyncs their files)."""
        if defer:  # with --wal, phase 1: written with phase 2, one fsync for both
            self.deferred.append((logs, written))
            return
        if self.wal is None:
            begun = [(log, *log.flush_begin()) for log in logs]
            await self.fsync([_Fd(fd) for _, _, fd in begun if fd is not None])
            for log, target, _ in begun:
                log.flush_end(target)
            return
        for earlier_logs, earlier in reversed(self.deferred):
            logs, written = earlier_logs + logs, earlier + written
        self.deferred = []
        out = bytearray()
        for log, data in written:
            start = len(out)
            out += _FRAME.pack(id(log) & 0x7FFFFFFF, len(data))
            out += data
            out += _CRC.pack(crc32c.crc32c(memoryview(out)[start:]))
        os.write(self.wal.fd, out)
        await self.fsync([self.wal])
        for log in logs:
            target, _ = log.flush_begin()
            log.flush_end(target, durable=False)
            self.dirty.add(log)

    async def checkpointer(self) -> None:
        """With --wal, every 100 ms: the files the write-ahead file covered, fsynced in
        one submission (their bytes were written with each group)."""
        while True:
            await asyncio.sleep(0.1)
            due, self.dirty = self.dirty, set()
            fds = [_Fd(os.dup(log._active.fd)) for log in due]
            try:
                if fds:
                    await self.fsync(fds)
            finally:
                for fd in fds:
                    os.close(fd.fd)

    def owes(self) -> bool:
        return bool(self.owed_markers or self.owed_appends)

    async def commit(self, group: list) -> None:
        now = int(time.time() * 1000)
        fresh, appends = [], list(self.owed_appends)
        self.owed_appends = []
        for entry in group:
            request, headers, future = entry
            core = self.cores[request.tc_partition]
            tps = [TopicPartition(item.topic_partition.topic, item.topic_partition.partition)
                   for item in request.batches]
            try:
                ready = core.begin_one_call(now, request.timeout_ms, None,
                                            request.idempotency_key, tps, ())
            except AtomlogError as error:
                future.set_exception(Refused(grpc.StatusCode.FAILED_PRECONDITION, str(error)))
                continue
            start: OneCallStart = ready.reply
            if start.existing is not None:
                future.set_result(coordinator_pb2.CommitTxnResponse(
                    txn_id=common_pb2.TxnId(tc_partition=start.txn_id.tc_partition,
                                            sequence=start.txn_id.sequence),
                    state=start.existing.value, already_ended=True))
                continue
            if ready.appends:  # a sequence reservation: durable before anything is staged
                await self.append_tc([(request.tc_partition, a) for a in ready.appends], now)
            fresh.append((entry, start.txn_id))
        # Phase 1: the markers owed, then the stages, each partition's in one append.
        items: dict[str, list] = {}
        confirmations = []
        for name, markers in self.owed_markers.items():
            plog, txns = self.partition(name)
            out = items.setdefault(name, [])
            offset = plog.log_end_offset
            for marker in markers:
                control = (ControlType.COMMIT if marker.decision is Decision.COMMIT
                           else ControlType.ABORT)
                plan = txns.check_marker(marker.txn_id, control, marker.coordinator_epoch)
                if plan.action is MarkerAction.WRITE:
                    out.append(record_batch.control_batch_parsed(
                        control, txn=marker.txn_id, coordinator_epoch=marker.coordinator_epoch,
                        timestamp_ms=now, producer_id=plan.producer_id,
                        producer_epoch=plan.producer_epoch))
                    txns.on_marker(marker.txn_id, control, marker.coordinator_epoch, offset)
                    offset += 1
                confirmations.append(marker)
        self.owed_markers = {}
        results = []
        for (request, _, _), txn in fresh:
            answered = []
            for item in request.batches:
                tp = item.topic_partition
                name = f"{tp.topic}-{tp.partition}"
                plog, txns = self.partition(name)
                out = items.setdefault(name, [])
                data, header = stamp_transaction(item.record_batch,
                                                 validate_batch(item.record_batch), txn)
                first = plog.log_end_offset + sum(h.last_offset_delta + 1 for _, h in out)
                last = first + header.last_offset_delta
                txns.on_data(txn, 0, 0, first, last, now)
                out.append((data, header))
                answered.append(partition_pb2.ProduceResult(
                    topic_partition=tp, base_offset=first, last_offset=last,
                    log_append_time_unix_ms=now))
            results.append(answered)
        written, data = [], []
        for name, out in items.items():
            plog, _ = self.partition(name)
            if out:
                plog.append_parsed(out)
                written.append(plog)
                if self.wal is not None:
                    data += [(plog, batch) for batch, _ in out]
        # With --wal, phase 1 is not awaited: its bytes precede phase 2's in the one
        # write-ahead file, so a decision found there after a crash has its data before
        # it, and one fsync makes both durable.
        await self.durable(written, data, defer=self.wal is not None)
        for plog in written:
            self.plogs[plog.directory.name][1].on_durable(plog.high_watermark)
        for marker in confirmations:
            core = self.cores[marker.txn_id.tc_partition]
            ready = core.marker_confirmed(now, marker.txn_id, marker.target)
            appends += [(marker.txn_id.tc_partition, a) for a in ready.appends]
        # Phase 2: the decisions (Opened and Decided), with the completions owed.
        for (request, _, _), txn in fresh:
            ready = self.cores[request.tc_partition].end_one_call(now, txn, None)
            appends += [(request.tc_partition, a) for a in ready.appends]
        await self.append_tc(appends, now)
        for ((request, _, future), txn), answered in zip(fresh, results):
            future.set_result(coordinator_pb2.CommitTxnResponse(
                txn_id=common_pb2.TxnId(tc_partition=txn.tc_partition, sequence=txn.sequence),
                state=COMMITTING, batch_results=answered))

    async def append_tc(self, appends: list, now: int) -> None:
        """Each TC partition's appends as one batch of its log's records, durable; then
        append_done, whose markers and completions wait for the next group."""
        by_tc: dict[int, list] = {}
        for tc, append in appends:
            by_tc.setdefault(tc, []).append(append)
        logs, data = [], []
        for tc, group in by_tc.items():
            batch = encode_batch([Record(None, encode_record(r)) for a in group
                                  for r in a.records])
            self.tc_plogs[tc].append_parsed([(batch, parse_header(batch))])
            logs.append(self.tc_plogs[tc])
            data.append((self.tc_plogs[tc], batch))
        await self.durable(logs, data)
        for tc, group in by_tc.items():
            for append in group:
                ready = self.cores[tc].append_done(append.append_id, now)
                for marker in ready.markers:
                    self.owed_markers.setdefault(
                        f"{marker.target.topic}-{marker.target.partition}", []).append(marker)
                self.owed_appends += [(tc, a) for a in ready.appends]


class _Fd:
    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd


class _LinkContext:
    """commit_txn's context for a call that came over the link: abort raises."""

    async def abort(self, code: grpc.StatusCode, message: str):
        raise Refused(code, message)


async def serve_link(server: Server | None, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
    """One link connection (services/link_wire.py's format, MAGIC: one call at a time):
    CommitTxn call frames, each answered with the CommitTxnResponse or an ItemError.
    `server` None: the do-nothing link server (an empty response, the request unread)."""
    from services import link_wire

    try:
        if await reader.readexactly(len(link_wire.MAGIC)) != link_wire.MAGIC:
            return
        context = _LinkContext()
        while True:
            length, kind = link_wire.HEAD.unpack(await reader.readexactly(link_wire.HEAD.size))
            body = await reader.readexactly(length - 1)
            method, _, token_bytes = link_wire.CALL_HEAD.unpack_from(body)
            if kind != link_wire.KIND_CALL or method != link_wire.CALL_NUMBERS[
                    ("CoordinatorService", "CommitTxn")]:
                return  # the prototype takes CommitTxn calls only
            if server is None:
                answer, kind = b"", link_wire.KIND_ANSWER
            else:
                try:
                    response = await server.commit_txn(coordinator_pb2.CommitTxnRequest.FromString(
                        body[link_wire.CALL_HEAD.size + token_bytes:]), context)
                    answer, kind = response.SerializeToString(), link_wire.KIND_ANSWER
                except Refused as refused:
                    answer = partition_pb2.ItemError(reason=refused.code.name,
                                                     message=str(refused)).SerializeToString()
                    kind = link_wire.KIND_ERROR
            writer.write(link_wire.HEAD.pack(1 + len(answer), kind) + answer)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(directory: Path, listen: str, wal: bool, cores: bool = False,
                nothing: bool = False) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    server = CoreServer(directory, wal) if cores else Server(directory, wal)
    grpc_server = grpc.aio.server()
    grpc_server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "atomlog.v1.CoordinatorService", {"CommitTxn": grpc.unary_unary_rpc_method_handler(
            server.commit_txn,
            request_deserializer=coordinator_pb2.CommitTxnRequest.FromString,
            response_serializer=coordinator_pb2.CommitTxnResponse.SerializeToString)})])
    port = grpc_server.add_insecure_port(listen)
    await grpc_server.start()
    link = await asyncio.start_server(
        lambda reader, writer: serve_link(None if nothing else server, reader, writer),
        "127.0.0.1", 0)
    link_port = link.sockets[0].getsockname()[1]
    committer = asyncio.create_task(server.committer())
    if wal:
        checkpointer = asyncio.create_task(server.checkpointer())
        checkpointer.add_done_callback(lambda task: task.cancelled() or task.result())
    # The driver reads the addresses from here: gRPC's, then the link's.
    print(f"127.0.0.1:{port} 127.0.0.1:{link_port}", flush=True)
    await asyncio.wait([committer, asyncio.ensure_future(grpc_server.wait_for_termination())],
                       return_when=asyncio.FIRST_COMPLETED)
    committer.result()


async def in_process(directory: Path, wal: bool, groups: int, profile: Path | None) -> None:
    """`--in-process`: the `--cores` server's commit() driven directly, `groups` groups of
    8 CommitTxn requests as bench/native_core.py's clients build them (built beforehand;
    checked by `check` in the window), no sockets and no other process: the CPU per
    transaction of the cores' work and the group commit alone (process time, the
    kernel's io_uring workers included), optionally under cProfile into `profile`."""
    import uuid

    import native_core  # bench/native_core.py: the workload's constants

    directory.mkdir(parents=True, exist_ok=True)
    server = CoreServer(directory, wal)
    loop = asyncio.get_running_loop()

    def request(index: int):
        key = uuid.uuid4().hex
        counts = [native_core.RECORDS // 4 + (i < native_core.RECORDS % 4) for i in range(4)]
        return coordinator_pb2.CommitTxnRequest(
            tc_partition=tc_partition_for(key, TC_PARTITIONS), idempotency_key=key,
            timeout_ms=30_000, batches=[partition_pb2.ProduceItem(
                topic_partition=common_pb2.TopicPartition(
                    topic=native_core.TOPIC, partition=(index * 4 + i) % native_core.PARTITIONS),
                record_batch=encode_batch([Record(None, native_core.RECORD)] * n))
                for i, n in enumerate(counts)])

    warm = 50
    requests = [[request(index) for index in range(8)] for _ in range(warm + groups)]

    async def run(batches) -> float:
        began = time.process_time()
        for group in batches:
            await server.commit([(r, check(r), loop.create_future()) for r in group])
        return time.process_time() - began

    # With --wal, the checkpointer's fsyncs of the files are part of the cost, as served.
    checkpointer = asyncio.create_task(server.checkpointer()) if wal else None
    await run(requests[:warm])
    profiler = None
    if profile is not None:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    cpu = await run(requests[warm:])
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    if checkpointer is not None:
        checkpointer.cancel()
    print(f"{'--cores --wal' if wal else '--cores'}, in process: {groups} groups of 8, "
          f"{cpu / (groups * 8) * 1e3:.3f} ms of CPU a transaction"
          + (" (under cProfile)" if profiler is not None else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="data directory")
    parser.add_argument("--listen", default="127.0.0.1:0", help="gRPC address")
    parser.add_argument("--wal", action="store_true",
                        help="one write-ahead file, one fsync per group (as the Go "
                             "prototype's --wal); with --cores, for the cores' logs")
    parser.add_argument("--cores", action="store_true",
                        help="atomlog's own cores and logs in the same loop (CoreServer)")
    parser.add_argument("--nothing", action="store_true",
                        help="the link answers every CommitTxn at once, empty, unread (the "
                             "link's do-nothing floor)")
    parser.add_argument("--in-process", type=int, metavar="GROUPS", default=0,
                        help="with --cores: serve nothing; drive commit() directly with "
                             "GROUPS groups of 8 transactions and print the CPU a "
                             "transaction")
    parser.add_argument("--profile", type=Path, metavar="FILE",
                        help="with --in-process: cProfile the window into FILE")
    args = parser.parse_args()
    if args.in_process:
        if not args.cores:
            parser.error("--in-process drives the --cores server")
        asyncio.run(in_process(args.dir, args.wal, args.in_process, args.profile))
        return
    asyncio.run(serve(args.dir, args.listen, args.wal, args.cores, args.nothing))


if __name__ == "__main__":
    main()
