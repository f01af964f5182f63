"""The owner of one partition: the only code that mutates its log, producer state and
transaction buffer.

One asyncio task per partition takes queued produce requests in groups: for each batch,
in order, the producer-state core decides (append, duplicate, or refuse); accepted
batches are appended with one writev; then an fsync makes the group durable (group
commit: concurrent producers share it) and only then is anyone acknowledged.

The flush is pipelined. The fsync runs on worker threads: by default the process's
durability barrier (partition_server/durability.py) fsyncs the files of every owner that
asked while its previous round ran, at once, and answers them with one wake-up of the
event loop (settings.durability: "syncfs" makes its round one syncfs of the filesystem;
"executor" runs each owner's own fsync, on a duplicate of the segment's descriptor, on
an executor thread). It touches no Python state, and while it runs the owner task may
go on deciding and writing the next groups (once `write_ahead_bytes` are queued:
smaller amounts wait and go as one group when the fsync ends) and beginning the next
fsyncs, up to `max_fsyncs_in_flight` at once (they overlap in the kernel). Completions are taken
strictly in the order the fsyncs began: a flush that ends moves the high watermark to
the log end as of its start and answers the groups it covers (and any earlier ones),
never a group written after it began. So: durable before acknowledged, the high
watermark moves only with durability, and acks keep log order. A duplicate (a retried
batch) or a refusal is answered with the first flush that covers the log end as of its
decision, as the batches it may depend on are durable then. Reads (on the event loop)
see the high watermark move only at completions. The barrier's answer settles the
ended flushes itself when the owner task is idle and nothing else waits for it (no
request queued or written unflushed, no roll, no snapshot due, no replication): what the
task's next step would have done first, without waking it (`_flush_ended`); a failure
there is raised in the task, which fails closed.

Transactions (docs/transaction-buffer.md): a transactional data batch passes the
producer-state check, then the late-write guard (txn_guard.py: verified with the
coordinator, and no marker for it since) and the buffer's check_write; a marker
(EndTxnOnPartition) goes through the same queue, so writes and markers of a partition are
ordered, and writes a COMMIT/ABORT control batch when the transaction has data here.
After each fsync the buffer learns the high watermark; max_read_position comes from it.

One-call transactions (docs/coordinator.md): a batch its coordinator stages (StageTxn)
needs no verification, but carries the coordinator epoch of its transaction's TC
partition, checked in the owner's write step against the current one (the server's
CoordinatorEpochs, and the markers written here): below it, nothing is written
(STALE_COORDINATOR_EPOCH). Checked there, not before queueing: a ResolveStaged of a
newer coordinator raises the epoch and then queues its question behind everything the
owner took before, so a stage either was taken before the fence (and the answer, given
once it is durable, says staged) or is refused; there is no window between the check and
the append. `resolve_staged` is that question: answered in the owner step (open here, or
ended by a COMMIT marker) and only once everything accepted before it is durable, with
the same flushes that answer writes.

Start-up: the log recovers itself (torn tail truncated, or DATA_LOSS); producer state and
the transaction buffer each come from their newest readable snapshot plus the log tail,
or from a full replay. Plain writes need producer state, so the partition goes ONLINE
once producer state is rebuilt. When the buffer's snapshot covers at least as much as
producer state's (the usual case: both are written together) its replay rides along in
the same pass over the tail. When it covers less (an older or unreadable snapshot: up to
a full replay) the buffer replays in the background instead, on a worker thread reading
the segment files through its own descriptors up to the log end at start-up, then
catches up on the loop with what was appended meanwhile. Until then `txns` is a
stand-in that refuses every use with the retriable PARTITION_LOADING: transactional
batches, markers, read_committed reads, subscription receives and acks, retention and
transaction-buffer snapshots wait; non-transactional writes and read_uncommitted reads
are served (DescribePartition says transaction_buffer_ready=false).
A failed write or fsync fails closed: every request written and not yet acknowledged
(the group that failed, those whose fsyncs were in flight, those written after) gets
PARTITION_LOADING and none of them is acknowledged later; the log refuses further use
(after a failed fsync the page cache is unknown, so nothing above the high watermark is
trusted: the owner cuts the log back to it when it reopens); then the owner reloads
producer state and the transaction buffer from the durable log before serving again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import os
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from partition_server import durability
from partition_server.wal import WalTap, WriteAheadLog, forget_kept
from partition_server import metrics as m
from partition_server import producer_state, txn_buffer
from partition_server.log import LogConfig, PartitionLog, SegmentSpan
from partition_server.producer_state import APPEND, ProducerStateTable
from partition_server.record_batch import (ATTR_TRANSACTIONAL, LENGTH_FIELD_END, BatchHeader,
                                           ControlMarker, ControlType, TxnId,
                                           control_batch_parsed, decode_control_batch,
                                           iter_batches)
from partition_server.cursor_store import CursorStoreLimits
from partition_server.log import RollJob, unlink_files
from partition_server.segment import walk_headers
from partition_server.snapshot_files import SnapshotCorrupt, fsync_directory, write_atomically
from partition_server.subscriptions import PartitionSubscriptions
from partition_server.txn_buffer import AbortedTxn, MarkerAction, TxnBuffer, TxnBufferLimits
from partition_server.txn_guard import TxnGuard
from partition_server import native, write_step
from partition_server.write_step import (Appended, Marker, MarkerResult, _MarkerWork,  # noqa: F401
                                         _Queued, _ResolveWork, _Work)
from services import failpoints
from services.errors import AtomlogError
from services.logs import event

log = logging.getLogger("atomlog.partition")

if native.core is not None:
    # The native core's copies of the transaction buffer and the producer state
    # (partition_server/rust/src/txn_buffer.rs, producer_state.rs): the Python classes
    # stay the reference; tests/test_native_txn_buffer.py, test_native_producer_state.py,
    # test_txn_buffer.py and test_producer_state.py hold each pair to the same answers,
    # errors and snapshot bytes (docs/native-core.md).
    TxnBuffer = native.core.TxnBuffer  # noqa: F811
    ProducerStateTable = native.core.ProducerStateTable  # noqa: F811

# The native write step (partition_server/rust/src/write_step.rs; write_step.py is the
# reference, tests/test_native_write_step.py holds the two together) and the native
# late-write guard (txn_guard.rs): used together, on the native tables only (see _decide).
_native_decide = _NativeTxnBuffer = _NativeProducers = _NativeGuard = None
if native.core is not None and hasattr(native.core, "decide_write_step"):
    TxnGuard = native.core.TxnGuard  # noqa: F811
    _NativeTxnBuffer, _NativeProducers = native.core.TxnBuffer, native.core.ProducerStateTable
    _NativeGuard, _native_decide = native.core.TxnGuard, native.core.decide_write_step

SNAPSHOTS_KEPT = 2


class Gathering:
    """A caller's step that gathers the owners' writes (the commit lane's one-round step,
    coordinator/lane.py): the owners of this event loop given work while it is open are
    noted, in order, instead of woken; the caller writes them in its step
    (`PartitionOwner.write_gathered`), and closing it begins their flushes and wakes
    those that still hold queued work. One at a time per process (a step never awaits)."""

    __slots__ = ("loop", "owners")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.owners: dict[PartitionOwner, bool] = {}  # -> whether it wrote in this step

    def close(self) -> None:
        global _gathering
        if _gathering is self:
            _gathering = None
        for owner, wrote in self.owners.items():
            owner._gathered_end(wrote)


_gathering: Gathering | None = None


def gather() -> Gathering:
    """Open a Gathering on the running loop (close it in a `finally`)."""
    global _gathering
    assert _gathering is None, "a gathering is open already"
    _gathering = Gathering(asyncio.get_running_loop())
    return _gathering


@contextlib.contextmanager
def written_in_step():
    """A request handler's step on this process's owners (a partition server's StageTxn
    and Produce): the owners given work inside it write it before it ends
    (`write_gathered`, not fatal), instead of each in a step of its own task woken for it;
    leaving it begins their flushes and wakes those that could not write. Nothing when a
    gathering is open already (the commit lane's step): its owners are written there."""
    if _gathering is not None:
        yield
        return
    gathering = gather()
    try:
        yield
        for owner in list(gathering.owners):
            owner.write_gathered(fatal=False)
    finally:
        gathering.close()


class State(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: no Python-level hash of the name

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
    # Group-commit fsyncs running at once. 1: groups are decided and written while an
    # fsync runs, and the next fsync (covering all of them) begins when it ends. 2 lets
    # fsyncs overlap (this virtio disk runs them concurrently): lower latency for a
    # lone pipelined producer, but smaller groups, so more fsyncs and CPU per MB; in
    # interleaved A/B runs of bench/produce.py (2026-11-21) 2 was no faster than 1.
    max_fsyncs_in_flight: int = 1
    # How a group commit is made durable (partition_server/durability.py): "fsync":
    # the process's durability barrier fsyncs the files of every owner that asked while
    # its previous round ran, at once, and answers them together; "syncfs": its round is
    # one syncfs per filesystem; "auto": syncfs off the root filesystem, fsync on it;
    # "executor": each owner fsyncs its own file on an executor thread (before the
    # barrier).
    durability: str = durability.FSYNC
    # While every fsync slot is busy, queued requests are written ahead (to be covered by
    # the next fsync) once this many bytes wait; below it they wait for the fsync to end
    # and go as one group. Each group written costs the owner a wake-up, a writev and its
    # bookkeeping, which measured ~10% more server CPU per MB when every 258 KiB request
    # was written on arrival (0 does that: lowest latency).
    write_ahead_bytes: int = 1 << 20
    max_producers: int = 10_000
    producer_idle_expiry_ms: int = 86_400_000
    snapshot_interval_batches: int = 1_000  # batches and markers, for both snapshots
    snapshot_interval_ms: int = 5_000
    txn_limits: TxnBufferLimits = field(default_factory=TxnBufferLimits)
    late_transaction_ms: int = 900_000  # metrics: open longer than this is "late"
    # Transactions whose markers the late-write guard remembers (txn_guard.py). It was
    # 100,000 fixed: about 21 MB per partition, for as long as it stayed open.
    late_write_guard_size: int = 20_000
    cursor_limits: CursorStoreLimits = field(default_factory=CursorStoreLimits)



# The bytes one marker's control batch takes in the log (the same for every marker).
MARKER_BATCH_BYTES = len(control_batch_parsed(ControlType.COMMIT, txn=(0, 1),
                                              coordinator_epoch=0, timestamp_ms=0)[0])


@dataclass(eq=False)
class _Roll:
    """A segment roll under way: the log it was begun on, its disk work on a worker
    thread, and when it began (atomlog_partition_roll_duration_seconds)."""

    log: PartitionLog
    job: RollJob
    future: asyncio.Future
    began: float


@dataclass
class _Flush:
    """One group commit in flight: the fsync begun when the log ended at `target`, and
    the requests it answers once it (and every flush begun before it) succeeded."""

    target: int
    works: list[_Queued]
    batches: int  # batches it makes durable (metric)
    # The fsync on a worker thread (an asyncio.Future, or the barrier's SyncTicket: both
    # answer done() and exception()); None: nothing to sync.
    future: asyncio.Future | durability.SyncTicket | None
    began: float


class RecoveringTxns:
    """Stands in for the transaction buffer while it replays in the background. Every use
    of it (any attribute) raises the retriable PARTITION_LOADING, so no code path can act
    on a buffer that is not known yet: fail closed by construction."""

    __slots__ = ("_detail",)

    def __init__(self, partition: str, from_offset: int, to_offset: int):
        self._detail = (f"the transaction buffer of {partition} is recovering (replaying "
                        f"offsets {from_offset}..{to_offset}); transactional writes, markers, "
                        "read_committed reads and subscription deliveries wait for it")

    def refusal(self) -> AtomlogError:
        return AtomlogError("PARTITION_LOADING", self._detail, {"retry_after_ms": "200"})

    def __getattr__(self, name: str):
        raise self.refusal()


@dataclass
class _Loaded:
    log: PartitionLog
    producers: ProducerStateTable
    txns: TxnBuffer | None  # None only with DATA_LOSS
    txns_from: int  # background: the restored `txns` still replays from here
    last_control: int
    replayed: int
    background: bool = False


class _SpanCorrupt(Exception):
    def __init__(self, span: SegmentSpan, position: int, offset: int, detail: str):
        super().__init__(detail)
        self.span, self.position, self.offset, self.detail = span, position, offset, detail


class _ReplayCancelled(Exception):
    pass


# A reload after a failed write or fsync that fails too (the disk is still full or
# failing) is retried with backoff from 0.1 s up to 5 s, for as long as the partition is
# owned here: about the pace at which an operator frees space, without spinning.
RELOAD_RETRY_FIRST_S = 0.1
RELOAD_RETRY_MAX_S = 5.0
CLOSE_CHECKPOINT_WAIT_S = 10.0  # close's wait for a checkpoint's fsync in flight
# Why a replicated leader whose log has corruption before its tail gives up its epoch.
DATA_LOSS_WHY = "its log has corruption before its tail (DATA_LOSS)"


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class PartitionOwner:
    def __init__(self, topic: str, partition: int, directory: Path, settings: OwnerSettings,
                 *, fsync: Callable[[int], None] = failpoints.fsync,
                 txn_replay_gate: Callable[[], None] | None = None,
                 barrier: durability.DurabilityBarrier | None = None,
                 coordinator_epoch: Callable[[int], int] | None = None,
                 wal: WriteAheadLog | None = None):
        """`fsync` makes a file descriptor durable (os.fsync behind a failpoint the
        fault harness can arm; tests pass one that blocks or fails). It runs on a worker
        thread: an executor thread of its own per fsync when it is not the default (tests
        gate fsyncs that overlap) and no `barrier` is given, else the barrier's thread
        (settings.durability; `barrier` defaults to the process's, durability.barrier()).
        `txn_replay_gate`, when given, is called on the worker thread before a
        background replay of the transaction buffer (tests hold the replay there to look
        at the partition meanwhile). `coordinator_epoch(tc_partition)` is the server's
        current coordinator epoch of a TC partition (CoordinatorEpochs.current), which
        fences staged batches in the write step; None: only the markers written here
        fence them. `wal`: the server's write-ahead file (partition.durability=wal), used
        when this partition is not replicated and acknowledges after durability."""
        assert settings.max_fsyncs_in_flight >= 1, settings.max_fsyncs_in_flight
        self.topic = topic
        self.partition = partition
        self.name = f"{topic}-{partition}"  # (read on every write: kept, not formatted)
        self.directory = directory
        self.settings = settings
        self.replayed_batches = 0
        self.replayed_from_wal = 0  # batches the last load appended again from the write-ahead file
        self.state = State.LOADING
        self.log: PartitionLog | None = None
        self.producers = ProducerStateTable(settings.max_producers, settings.producer_idle_expiry_ms)
        self._evicted_exported = 0  # the table's evicted_total exported so far
        self.txns: TxnBuffer | RecoveringTxns = TxnBuffer(settings.txn_limits)
        # Called with the buffer each time one is ready (after a load, or after its
        # background replay): the server learns the coordinator epochs of its markers.
        self.on_txns_ready: Callable[[TxnBuffer], None] | None = None
        self._coordinator_epoch = coordinator_epoch
        self._txn_replay_gate = txn_replay_gate
        self._txn_recovery: asyncio.Task | None = None
        self._txn_recovery_cancel: threading.Event | None = None
        # Volatile; survives reloads (see txn_guard.py).
        self.guard = TxnGuard(max_ended=settings.late_write_guard_size)
        # The servicer's, for Produce (service.py): per producer id, the last Produce
        # whose batches wait (a verification) before they are queued here; later batches
        # of that producer queue only after it (arrival order is sequence order), and
        # then find its verification cached. Empty when nothing waits; an entry lives as
        # long as its request.
        self.produce_gates: dict[int, asyncio.Future] = {}
        self.verified_acks: OrderedDict = OrderedDict()  # (txn, subscription) -> opener
        self.subscriptions = PartitionSubscriptions(
            self.name, directory / "cursors", settings.cursor_limits,
            lambda: self.log.log_start_offset if self.log is not None else 0,
            lambda: self.replication,  # cursor changes wait for the in-sync replicas too
            self._cursor_sync)
        self.last_control_offset = -1  # highest control batch in the log (fetch fast path)
        self.producer_snapshot_offset = -1
        self.txn_snapshot_offset = -1
        self._fsync = fsync
        self._barrier = barrier
        self._use_barrier = settings.durability != durability.EXECUTOR and (
            barrier is not None or fsync is failpoints.fsync)
        self._log_sync: durability.LogSync | None = None  # per opened log
        self._wal = wal
        self._wal_tap: WalTap | None = None  # set at the load when the write-ahead file is used
        self._loop: asyncio.AbstractEventLoop | None = None  # the owner's (set by _load)
        self._queue: deque[_Queued] = deque()  # bounded by max_queued_requests
        self._queued_bytes = 0
        self._unflushed: list[_Queued] = []  # written, no fsync begun since
        self._unflushed_batches = 0
        self._flushes: deque[_Flush] = deque()  # in flight, oldest first
        # Replicated partitions led here (partition_server/replica.py): the leadership, and
        # the flushes durable here that wait for the in-sync replicas, oldest first.
        self.replication = None
        self._replicating: deque[_Flush] = deque()
        self._wake: asyncio.Future | None = None  # the owner task waits on it when idle
        # The log's end after its last write in a gathering (fatal frames): a reload
        # cutting below it would cut what a decision written in that step depends on.
        self._gathered_to = -1
        self._raise_in_task: Exception | None = None  # _flush_ended's failure, for the task
        self._data_moved: asyncio.Future | None = None  # readers wait on it (long poll)
        self._snapshot_write: asyncio.Future | None = None
        self._roll: _Roll | None = None  # a segment roll whose disk work is under way
        self._retention_roll = False  # roll the active segment, past retention.ms, when idle
        self._task: asyncio.Task | None = None
        self._stamp_ms = 0  # the log's clock: the owner decides append times
        self._batches_since_snapshot = 0
        self._last_snapshot_ms = 0
        self._snapshot_after: tuple[int, int] = (settings.snapshot_interval_batches,
                                                 settings.snapshot_interval_ms)
        self._labels = (topic,)
        # Labelled children looked up once, not per group.
        self._bytes_in = m.BYTES_IN.labels(topic)
        self._records_in = m.RECORDS_IN.labels(topic)
        self._duplicates = m.DUPLICATES.labels(topic)
        self._markers_written: dict = {}  # ControlType -> its metric child, on first use

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self._load()
        self._task = asyncio.create_task(self._run(), name=f"owner {self.name}")

    async def _load(self, truncate_to: int | None = None, keep: int = -1) -> None:
        await self._stop_txn_recovery()
        await self._snapshot_written()  # a reload reads the snapshot files it may write
        await self._roll_finished()  # ... and the segment files a roll may be creating
        self.state = State.LOADING
        self._gathered_to = -1  # (what the log loads is what it holds now)
        began = time.perf_counter()
        if self._wal is not None and self._wal_tap is None and self.replication is None \
                and self.settings.fsync:
            self._wal_tap = self._wal.tap(self.directory.name)
        loaded = await asyncio.to_thread(self._load_blocking, truncate_to, keep)
        self.log, self.producers = loaded.log, loaded.producers
        if self._wal_tap is not None:
            if self.log.data_loss is None:
                self._wal_tap.attach(self.log, self._checkpoint_failed)
            else:  # (never checkpointed: its frames must not hold the file's segments)
                self._wal_tap.data_loss()
        loop = self._loop = asyncio.get_running_loop()
        # Not on this loop: a rename that may block for milliseconds under fsync load.
        # One that fails breaks the log: fail closed and reload (_deferred_write_done).
        opened = self.log

        def defer_recovery_point(write) -> asyncio.Future:
            future = loop.run_in_executor(None, write)
            future.add_done_callback(lambda done: self._deferred_write_done(opened, done))
            return future

        self.log.defer_recovery_point = defer_recovery_point
        # Nor this: freeing a deleted segment's blocks (retention, DeleteRecords).
        self.log.defer_unlink = lambda paths: loop.run_in_executor(None, unlink_files, paths)
        # Corruption a read finds: DATA_LOSS, as a load finding it gives (_data_loss_found).
        self.log.on_data_loss = lambda loss: loop.call_soon_threadsafe(
            self._data_loss_found, opened, loss)
        if self._use_barrier and self.settings.fsync:
            # Taken anew with each opened log: a log opened before a failed syncfs of
            # its filesystem is refused durability, so its owner reopens it (fail closed).
            # (On a worker thread: the first open on a filesystem probes syncfs.)
            self._log_sync = await asyncio.to_thread(
                (self._barrier or durability.barrier()).open, self.directory,
                self._barrier_mode(),
                None if self._fsync is failpoints.fsync else self._fsync,
                asyncio.get_running_loop())
        self.last_control_offset = loaded.last_control
        self.replayed_batches = replayed = loaded.replayed  # on top of the snapshots
        if self.log.data_loss is None:
            self.subscriptions.close()
            await asyncio.to_thread(self.subscriptions.open, self.log.log_start_offset,
                                    self.log.log_end_offset)
        if self.log.data_loss is not None:
            self.state = State.DATA_LOSS
            event(log, "partition refuses to serve: corruption before the log tail",
                  logging.ERROR, partition=self.name, file=self.log.data_loss.path,
                  offset=self.log.data_loss.offset)
            if self.replication is not None:
                # A live in-sync replica holds every acknowledged record intact: it leads
                # instead, and this copy follows it, cut at the damage and the rest fetched
                # from it (LeaderReplication.hand_over).
                self.replication.hand_over(DATA_LOSS_WHY)
            return
        if self.replication is not None:
            self.replication.loaded(self.log.log_start_offset, self.log.log_end_offset)
        if not loaded.background:
            self.txns = loaded.txns
        else:
            end = self.log.log_end_offset
            self.txns = RecoveringTxns(self.name, loaded.txns_from, end)
            # Until the replay says otherwise, reads filter control batches everywhere.
            self.last_control_offset = self.log.log_start_offset
            self._txn_recovery_cancel = threading.Event()
            self._txn_recovery = asyncio.create_task(
                self._recover_txns((loaded.txns, loaded.txns_from), end, loaded.last_control,
                                   self._txn_recovery_cancel),
                name=f"transaction buffer recovery {self.name}")
        self.state = State.ONLINE
        # As the log stamps (never below its last append time: a clock set back, or a
        # leader before whose clock was ahead), so that producer state records the times
        # the log holds and a replay would find.
        self._stamp_ms = max(self._stamp_ms, _wall_ms(), self.log.last_append_time_ms)
        self._snapshot_taken()  # the interval counts from the load
        event(log, "partition online", partition=self.name,
              high_watermark=self.log.high_watermark, producers=self.producers.producer_count,
              open_transactions=("recovering" if loaded.background
                                 else loaded.txns.open_count),
              replayed_batches=replayed, seconds=round(time.perf_counter() - began, 3),
              log_open_seconds=round(self.log.recovery.duration_ms / 1000, 3),
              clean_shutdown=self.log.recovery.clean_shutdown,
              torn_bytes_truncated=self.log.recovery.truncated_bytes)
        if not loaded.background:
            self._txns_ready(loaded.txns)

    def _load_blocking(self, truncate_to: int | None = None, keep: int = -1) -> _Loaded:
        """Open the log (after a failed write or fsync: cut back to `truncate_to`, the
        last durable offset) and rebuild producer state, and the transaction buffer too
        when its replay needs no more of the log than producer state's."""
        # After a failed write or fsync (truncate_to given), or with the write-ahead file
        # (whose replay rewrites the log from its last checkpoint), the tail is cut or
        # rewritten next: until then it is not recorded as durable.
        partition_log = PartitionLog(self.directory, self.settings.log, clock_ms=self._clock,
                                     trust_tail=truncate_to is None and self._wal_tap is None)
        try:
            tap = self._wal_tap
            if tap is not None:
                # The frames rewrite the log from its last checkpoint (the files above it
                # may be what a failed fsync left); then its cuts become frames too.
                self.replayed_from_wal = self._wal.replay_one(tap.name, partition_log)
                if partition_log.data_loss is None and partition_log.log_end_offset < keep:
                    # A write of the commit lane's step the frames did not bring back
                    # (`_fail_closed`): stop before the BASE frame voids the frames a
                    # start replays it from.
                    error = AtomlogError(
                        "INTERNAL", f"{self.name} reloaded to {partition_log.log_end_offset}, "
                        f"below its write in a commit lane's step (to {keep})")
                    self._wal.stop(error)
                    raise error
                if partition_log.data_loss is None:
                    self._wal.write_base(tap.name, partition_log.log_end_offset)
                    partition_log.wal = tap
            return self._load_from(partition_log, truncate_to)
        except BaseException:
            partition_log.fail("the load failed")  # its descriptors go; nothing is synced
            try:
                partition_log.close()
            except Exception:  # noqa: BLE001
                pass
            raise

    def _load_from(self, partition_log: PartitionLog, truncate_to: int | None) -> _Loaded:
        if partition_log.data_loss is not None:
            return _Loaded(partition_log, self.producers, None, 0, -1, 0)
        if truncate_to is not None and partition_log.log_end_offset > truncate_to:
            partition_log.truncate_to(truncate_to)
            if partition_log.data_loss is not None:
                return _Loaded(partition_log, self.producers, None, 0, -1, 0)
        settings = self.settings
        table, table_covered = self._restore(
            partition_log, producer_state, "producer",
            lambda data: ProducerStateTable.restore(data, settings.max_producers,
                                                    settings.producer_idle_expiry_ms),
            lambda: ProducerStateTable(settings.max_producers, settings.producer_idle_expiry_ms))
        txns, txns_from = self._restore_txns(partition_log)
        log_start = partition_log.log_start_offset
        table_from = max(table_covered, log_start)
        # A buffer needing an older part of the log than producer state replays in the
        # background; else it rides along in this pass.
        background = txns_from < table_from
        replayed, last_control = 0, -1
        for header in partition_log.iter_headers(table_from):
            if header.is_control:
                last_control = header.base_offset
            _apply(table, header)
            if not background and header.base_offset >= txns_from:
                txns.apply_batch(header, _marker_of(partition_log, header))
            replayed += 1
        table.expire(_wall_ms())
        if not background:
            last_control = self._finish_txns(txns, partition_log, last_control)
        return _Loaded(partition_log, table, txns, txns_from, last_control, replayed,
                       background)

    def _restore_txns(self, partition_log: PartitionLog) -> tuple[TxnBuffer, int]:
        """The transaction buffer of the newest readable snapshot (else empty) and the
        offset its replay starts from."""
        limits = self.settings.txn_limits
        txns, covered = self._restore(partition_log, txn_buffer, "transaction buffer",
                                      lambda data: TxnBuffer.restore(data, limits),
                                      lambda: TxnBuffer(limits))
        return txns, max(covered, partition_log.log_start_offset)

    @staticmethod
    def _finish_txns(txns: TxnBuffer, partition_log: PartitionLog, last_control: int) -> int:
        """A replayed buffer catches up with the log's start and durable end; returns the
        highest control batch offset reads must filter from."""
        txns.forget_below(partition_log.log_start_offset)
        txns.on_durable(partition_log.high_watermark)
        if last_control < 0 and txns.coordinator_epochs():
            # Markers were written below the replayed tail: filter reads from the start.
            last_control = partition_log.log_start_offset
        return last_control

    # ------------------------------------------------------------------ background replay
    @property
    def txns_recovering(self) -> bool:
        return isinstance(self.txns, RecoveringTxns)

    def check_txns_ready(self) -> None:
        """Raise the retriable PARTITION_LOADING while the buffer replays."""
        if isinstance(self.txns, RecoveringTxns):
            raise self.txns.refusal()

    def _txns_ready(self, txns: TxnBuffer) -> None:
        if self.on_txns_ready is not None:
            self.on_txns_ready(txns)

    async def _recover_txns(self, restored: tuple[TxnBuffer, int] | None, end: int,
                            tail_last_control: int, cancel: threading.Event) -> None:
        """Replay the transaction buffer `restored` at load (its snapshot and the offset
        to replay from) up to `end` (the log end when the partition went online) on a
        worker thread, then, on the loop, what was appended since; then swap it in.
        Retries (with backoff, from the snapshot again) on errors; a damaged batch puts
        the partition in DATA_LOSS, as any read of it would."""
        began, delay = time.perf_counter(), 0.5
        while True:
            try:
                if restored is None:  # a retry: the failed attempt changed the buffer
                    restored = await asyncio.to_thread(self._restore_txns, self.log)
                (txns, txns_from), restored = restored, None
                spans = self.log.segment_spans(txns_from, end)
                replayed, last_control = await asyncio.to_thread(
                    self._replay_spans, txns, spans, cancel)
                # On the loop, without awaiting: nothing is appended meanwhile. While the
                # buffer was replaying, transactional batches and markers were refused, so
                # what was appended since `end` is plain batches; replay it all the same.
                for header in self.log.iter_headers(end):
                    if header.is_control:
                        last_control = header.base_offset
                    txns.apply_batch(header, _marker_of(self.log, header))
                    replayed += 1
                break
            except (asyncio.CancelledError, _ReplayCancelled):
                return
            except _SpanCorrupt as corrupt:
                event(log, "transaction buffer replay found a damaged batch; the partition "
                      "refuses to serve", logging.ERROR, partition=self.name,
                      file=str(corrupt.span.path), offset=corrupt.offset)
                try:
                    self.log.report_corruption(corrupt.span.segment_base_offset,
                                               corrupt.position, corrupt.offset, corrupt.detail)
                except Exception as error:  # noqa: BLE001 — the record not written: reload
                    self._fail_in_task(error)
                    return
                self._poke()
                return
            except Exception as error:  # noqa: BLE001 — I/O trouble: try again
                event(log, "transaction buffer replay failed; retrying", logging.WARNING,
                      partition=self.name, error=f"{type(error).__name__}: {error}",
                      retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        try:
            self.last_control_offset = self._finish_txns(
                txns, self.log, max(last_control, tail_last_control))
        except Exception as error:  # noqa: BLE001 — fail closed: the reload replays again
            # Before, this ended the task alone: the buffer stayed recovering for good,
            # so every transactional batch and marker of the partition was refused
            # PARTITION_LOADING (markers retried for ever, transactions never ended).
            event(log, "transaction buffer recovery could not finish; the partition "
                  "reloads", logging.ERROR, partition=self.name,
                  error=f"{type(error).__name__}: {error}")
            self._fail_in_task(error)
            return
        self.txns = txns
        self._txn_recovery = self._txn_recovery_cancel = None
        # Snapshot it soon, so the next start does not replay all of this again.
        self._batches_since_snapshot += 1
        self._last_snapshot_ms = 0
        self._poke()
        self._notify_readers()
        event(log, "transaction buffer recovered", partition=self.name,
              open_transactions=txns.open_count, replayed_batches=replayed,
              seconds=round(time.perf_counter() - began, 3))
        self._txns_ready(txns)

    def _replay_spans(self, txns: TxnBuffer, spans: list[SegmentSpan],
                      cancel: threading.Event) -> tuple[int, int]:
        """(batches replayed, last control batch offset or -1): on a worker thread, with
        descriptors of its own; touches nothing of the owner's."""
        if self._txn_replay_gate is not None:
            self._txn_replay_gate()
        replayed, last_control = 0, -1
        for span in spans:
            fd = os.open(span.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            position, offset = span.position, span.first_offset
            try:
                for position, header in walk_headers(fd, span.position, span.end_position,
                                                     span.first_offset):
                    if cancel.is_set():
                        raise _ReplayCancelled()
                    offset, marker = header.base_offset, None
                    if header.is_control:
                        last_control = header.base_offset
                        marker = decode_control_batch(os.pread(fd, header.size, position))
                    txns.apply_batch(header, marker)
                    replayed += 1
            except AtomlogError as error:  # CORRUPT_BATCH
                raise _SpanCorrupt(span, int(error.metadata.get("position", position)),
                                   int(error.metadata.get("offset", offset)),
                                   error.message) from error
            finally:
                os.close(fd)
        return replayed, last_control

    async def _stop_txn_recovery(self) -> None:
        task, cancel = self._txn_recovery, self._txn_recovery_cancel
        self._txn_recovery = self._txn_recovery_cancel = None
        if task is None:
            return
        cancel.set()  # the worker thread stops at its next batch
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 — a new load replays anew
            pass

    def _restore(self, partition_log: PartitionLog, module, what: str, restore, empty):
        """(state, covered offset) from the newest snapshot of `module`'s kind that is
        readable and within the recovered log; else an empty state covering nothing
        (full replay). Never guesses."""
        for covered, path in self._snapshot_files(module):
            if not partition_log.log_start_offset <= covered <= partition_log.log_end_offset:
                # Beyond the end, it describes data lost with a torn tail (or an accepted
                # loss). Below the start, data retention deleted since (a crash before
                # apply_retention removed it): replayed from the start, it would miss
                # those batches, and a producer's retry of one would be appended again.
                # The unlink is made durable at once: else, once the log grows past it
                # again, a crash could bring it back to describe a history that is gone.
                path.unlink(missing_ok=True)
                fsync_directory(self.directory)
                continue
            try:
                state, covered = restore(path.read_bytes())
                self._note_snapshot(module, covered)
                return state, covered
            except (SnapshotCorrupt, OSError) as error:
                event(log, f"unreadable {what} snapshot; trying an older one", logging.WARNING,
                      partition=self.name, file=str(path), error=str(error))
        return empty(), 0

    def _note_snapshot(self, module, covered: int) -> None:
        if module is producer_state:
            self.producer_snapshot_offset = covered
        else:
            self.txn_snapshot_offset = covered

    def _snapshot_files(self, module) -> list[tuple[int, Path]]:
        """(covered offset, path) of `module`'s snapshots, newest first."""
        found = []
        for path in self.directory.iterdir():
            covered = module.parse_snapshot_file_name(path.name)
            if covered is not None:
                found.append((covered, path))
        return sorted(found, reverse=True)

    async def close(self) -> None:
        await self._stop_txn_recovery()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._snapshot_written()  # one in the background, or left by a cancelled owner
        await self._roll_finished()  # likewise
        if self.log is not None:
            # No write-ahead checkpoint begins from now on, and the verdict of one in
            # flight comes first: the close's own fsync of the same file would not tell a
            # write-back error the checkpoint's took (a failed one breaks the log).
            self.log.begin_close()
            deadline = time.monotonic() + CLOSE_CHECKPOINT_WAIT_S
            while self.log.checkpointing and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        if self.state is State.ONLINE:
            try:
                await self._flush_everything()  # what was written but never acknowledged
            except Exception as error:  # noqa: BLE001 — recovery decides what is on disk
                log.exception("final flush failed on %s", self.name)
                self.log.fail(f"final flush failed: {error}")
            else:
                await self._snapshot(force=True)
        self.subscriptions.close()
        if self.log is not None:
            self.log.close()
            if self._wal_tap is not None:
                self._wal_tap.detach(self.log)
        self.state = State.CLOSED

    def _clock(self) -> int:
        return self._stamp_ms

    # ------------------------------------------------------------------ checks
    def reconfigure_log(self, config: LogConfig) -> bool:
        """A topic's storage settings changed (AlterTopicConfig): the open log reads them
        from now on (its next append's roll check, the next retention chore), and a reload
        opens with them. Returns whether anything changed."""
        if config == self.settings.log:
            return False
        self.settings = dataclasses.replace(self.settings, log=config)
        if self.log is not None:
            self.log.config = config
        return True

    def check_serving(self) -> None:
        if self.state is State.ONLINE and self.replication is None:
            return  # the usual case, first (on every stage and write)
        self.check_loaded()
        if self.replication is not None:
            self.replication.check_serving()

    def check_loaded(self) -> None:
        """ONLINE (the log and producer state are loaded), whatever replication says."""
        if self.state is State.ONLINE:
            return
        if self.state is State.DATA_LOSS and self.log is not None and self.log.data_loss:
            if self.replication is not None and self.replication.handing_over:
                # An in-sync replica is taking over: the retriable NOT_PARTITION_OWNER
                # sends clients to it, where DATA_LOSS would fail them for good.
                self.replication.check_serving()
            raise self.log.data_loss.error()
        if self.state is State.LOADING:
            raise AtomlogError("PARTITION_LOADING", f"partition {self.name} is loading",
                               {"retry_after_ms": "100"})
        raise AtomlogError("SHUTTING_DOWN", f"partition {self.name} is closed")

    # ------------------------------------------------------------------ produce
    async def produce(self, batches: list[tuple[bytes, BatchHeader]],
                      tokens: list[int | AtomlogError | None] | None = None) -> list:
        """Queue validated batches, with the verification token of each transactional
        one (None: not verified; an AtomlogError: its verification failed, which refuses
        it unless it is a retry of a batch already written); the result per batch is
        Appended or an AtomlogError."""
        return await self.queue_produce(batches, tokens)

    def queue_produce(self, batches: list[tuple[bytes, BatchHeader]],
                      tokens: list[int | AtomlogError | None] | None = None) -> asyncio.Future:
        """`produce` without awaiting: queue the batches (or raise, nothing queued) and
        return the future of their result list."""
        self.check_serving()
        work = _Work(batches, tokens, asyncio.get_running_loop().create_future(),
                     size=sum(header.size for _, header in batches))
        self._queue_work(work)
        return work.future

    async def stage(self, txn: TxnId, batch: bytes, header: BatchHeader, *,
                    coordinator_epoch: int) -> Appended:
        """Append the batch (stamped with `txn`) a coordinator stages for a one-call
        transaction, unless `txn` is open here already (a repeated stage: its offsets,
        duplicate). `coordinator_epoch` is the stager's epoch of txn's TC partition: in
        the write step, below the current one (`current_coordinator_epoch`) nothing is
        written and STALE_COORDINATOR_EPOCH is raised. Returns Appended once durable, or
        raises."""
        [outcome] = await self.queue_stage(txn, batch, header,
                                           coordinator_epoch=coordinator_epoch)
        if isinstance(outcome, AtomlogError):
            raise outcome
        return outcome

    def queue_stage(self, txn: TxnId, batch: bytes, header: BatchHeader, *,
                    coordinator_epoch: int) -> asyncio.Future:
        """`stage` without awaiting: queue the batch (or raise, nothing queued) and
        return the future of its one-element result list (Appended or an AtomlogError;
        set to an AtomlogError exception when the owner fails the group). StageTxn
        queues every part of a call this way in one step, with no task per part."""
        return self.queue_stage_work(txn, batch, header,
                                     coordinator_epoch=coordinator_epoch).future

    def queue_stage_work(self, txn: TxnId, batch: bytes, header: BatchHeader, *,
                         coordinator_epoch: int) -> "_Work":
        """`queue_stage`, returning the queued work: its `results` once written (in a
        gathering: `write_gathered`), its `future` once durable."""
        self.check_serving()
        work = _Work([(batch, header)], None, asyncio.get_running_loop().create_future(),
                     size=header.size, staged=txn, stage_epoch=coordinator_epoch)
        self._queue_work(work)
        return work

    async def resolve_staged(self, txn: TxnId) -> bool:
        """Whether `txn`'s staged data is durable here (ResolveStaged): True when it is
        open here or ended by a COMMIT marker, False when it was never seen or ended by
        an ABORT. Queued like a write, so it is decided after everything the owner took
        before it, and answered only once all of that is durable (fsync, and on a
        replicated leader the in-sync replicas' high watermark): the same flushes that
        answer writes. Raises what a write would (NOT_PARTITION_OWNER, PARTITION_LOADING,
        NOT_ENOUGH_REPLICAS, a failed fsync's PARTITION_LOADING): the caller retries."""
        self.check_serving()
        [outcome] = await self._enqueue(_ResolveWork(
            txn, asyncio.get_running_loop().create_future()))
        if isinstance(outcome, AtomlogError):
            raise outcome
        return outcome

    def _cursor_sync(self, directory: Path) -> durability.LogSync | None:
        """The subscriptions' journal's way to the durability barrier (on a worker thread,
        as it opens): in this owner's rounds and mode, with its log. None (an fsync of the
        journal's own on a worker thread, as before the barrier) in executor mode and
        where a test replaced the owner's fsync."""
        if not self._use_barrier or self._fsync is not failpoints.fsync or self._loop is None:
            return None
        return (self._barrier or durability.barrier()).open(
            directory, self._barrier_mode(), None, self._loop)

    def _barrier_mode(self) -> str:
        """The barrier's mode for this owner's own fsyncs (in wal mode: a final flush,
        the cursor journal), which are per file there."""
        mode = self.settings.durability
        return durability.FSYNC if mode == durability.WAL else mode

    def check_stage_epoch(self, txn: TxnId, epoch: int, what: str = "stage") -> None:
        """Raise STALE_COORDINATOR_EPOCH when a stage (a batch, or an ack on this
        partition's subscriptions) of `txn` by a coordinator of `epoch` is older than the
        current epoch of its TC partition here. Called in the step that appends the
        stage (the owner's write step, the cursor store's change), so no fence can come
        between the check and the append."""
        write_step.check_stage_epoch(self.name, self.txns, self._coordinator_epoch, txn,
                                     epoch, what)

    def current_coordinator_epoch(self, tc_partition: int) -> int:
        """The epoch below which a stage of the TC partition is stale here: the server's
        (ZooKeeper, accepted markers, stages and resolutions) and the markers this
        partition wrote (durable in its log). Needs the transaction buffer (raises
        PARTITION_LOADING while it replays)."""
        known = self._coordinator_epoch(tc_partition) if self._coordinator_epoch else 0
        return max(known, self.txns.coordinator_epochs().get(tc_partition, 0))

    async def end_transactions(self, markers: list[Marker]) -> list:
        """Apply markers in order; the result per marker is MarkerResult (durable) or an
        AtomlogError (STALE_COORDINATOR_EPOCH, conflicting decision, ...)."""
        return await self.queue_markers(markers)

    def queue_markers(self, markers: list[Marker]) -> asyncio.Future:
        """`end_transactions` without awaiting: queue the markers (or raise, nothing
        queued) and return the future of their result list."""
        return self.queue_marker_work(markers).future

    def queue_marker_work(self, markers: list[Marker]) -> "_MarkerWork":
        """`queue_markers`, returning the queued work: its `results` once written (in a
        gathering: `write_gathered`), its `future` once durable."""
        self.check_serving()
        work = _MarkerWork(markers, asyncio.get_running_loop().create_future(),
                           size=len(markers) * MARKER_BATCH_BYTES)
        self._queue_work(work)
        return work

    async def _enqueue(self, work: _Queued) -> list:
        self._queue_work(work)
        # No shield needed: if this call is cancelled the future is cancelled too, and the
        # owner (which checks done() before answering) applies the work all the same.
        return await work.future

    def _queue_work(self, work: _Queued) -> None:
        """Queue `work` for the owner task (waking it when it may write), or raise with
        nothing queued."""
        if self.replication is not None:
            if not isinstance(work, _Work):
                # Markers: NOT_ENOUGH_REPLICAS, nothing written. A resolution too: its
                # answer would wait for the ISR to grow back; the caller retries instead.
                self.replication.check_writable()
            else:
                # Batches: NOT_ENOUGH_REPLICAS is decided in _write, after the producer
                # state has told a retry of a written batch (a duplicate, answered with its
                # offsets once replicated) from a new one (refused: nothing written).
                self.replication.check_serving()
        if len(self._queue) >= self.settings.max_queued_requests:
            raise AtomlogError("RESOURCE_EXHAUSTED",
                               f"partition {self.name} has {len(self._queue)} requests "
                               "queued", {"limit": "partition.max_queued_requests"})
        self._queue.append(work)
        self._queued_bytes += work.size
        gathering = _gathering
        if gathering is not None and gathering.loop is self._loop:
            gathering.owners.setdefault(self, False)
        elif self._may_write():
            self._poke()

    def takes_gathered(self) -> bool:
        """Whether a request queued now would be written in the caller's gathering
        (`write_gathered`): room in the queue, and `_writes_gathered`."""
        return len(self._queue) < self.settings.max_queued_requests and \
            self._writes_gathered()

    def _writes_gathered(self) -> bool:
        """Whether `write_gathered` writes now: the task parked, nothing else due, the
        write-ahead file in use, taking this partition's frames and not full."""
        wake, tap = self._wake, self._wal_tap
        return (wake is not None and not wake.done() and self._roll is None
                and self._raise_in_task is None and self.replication is None
                and tap is not None and self.log is not None and not tap.wal.lost(tap.name)
                and tap.wal.full() is None and self.state is State.ONLINE
                and self._may_write() and not self._snapshot_due())

    def write_gathered(self, fatal: bool = True) -> bool:
        """In an open Gathering (`gather`): write every queued request now, as the owner
        task's write branch would, when the task is parked and nothing else is due: no
        roll, snapshot, failure or replication, the write-ahead file in use and this
        partition's frames not being dropped there (WriteAheadLog.lost), the queue one
        group that rolls no segment. Its frames are fatal (WalTap.fatal) unless not
        `fatal` (a handler's step, `written_in_step`: nothing else is written in the same
        round on the strength of them, so a failure is answered as the task's own write's
        would be). Whether it wrote; if not, the task writes them (woken when the
        gathering closes). The flush begins when the gathering closes, after every write
        of the step."""
        if not (self._queue and self._writes_gathered()):
            return False
        tap = self._wal_tap
        count, size = self._group_extent()
        if count != len(self._queue) or self.log.roll_due(size):
            return False
        tap.fatal = fatal
        try:
            self._write(self._take_group(count, size))
        except Exception as error:  # noqa: BLE001 — raised in the task, which fails closed
            self._raise_in_task = error  # (the group is in _unflushed: failed with it)
            return False
        finally:
            tap.fatal = False
            if fatal:
                self._gathered_to = self.log.log_end_offset
        if _gathering is not None:
            _gathering.owners[self] = True
        return True

    def _gathered_end(self, wrote: bool) -> None:
        """The Gathering closed: begin the flush of what was written in it, and wake the
        task for whatever is left (or went wrong)."""
        if wrote and self._raise_in_task is None:
            try:
                self._begin_flushes()
            except Exception as error:  # noqa: BLE001 — raised in the task, as above
                self._raise_in_task = error
        flushes = self._flushes
        if self._raise_in_task is not None or (self._queue and self._may_write()) or (
                flushes and flushes[0].future is None):
            # (A flush with nothing to sync, as for a group of duplicates only, ends in
            # the task's next step: no round will call back for it.)
            self._poke()

    def _may_write(self) -> bool:
        """Whether the owner writes queued requests now (else once an fsync ends)."""
        return (len(self._flushes) < self.settings.max_fsyncs_in_flight
                or self._queued_bytes >= self.settings.write_ahead_bytes)

    def _poke(self, _future: object = None) -> None:
        """Wake the owner task (new work, or an fsync ended)."""
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _flush_ended(self) -> None:
        """The durability barrier's answer to a flush. When the owner task is idle (parked
        on its wake-up) and nothing but ended flushes waits for it, they are settled here,
        in the barrier's callback, as the task's next step would settle them first: one
        task step less per group commit. Otherwise (requests queued or written but not
        yet flushing, a roll, replication, a failed fsync, a snapshot due) the task is
        woken to do it all in its step."""
        wake = self._wake
        if (wake is None or wake.done() or self._queue or self._unflushed
                or self._roll is not None or self.replication is not None):
            self._poke()
            return
        try:
            self._complete_flushes()
        except Exception as error:  # noqa: BLE001 — raised in the task, which fails closed
            self._raise_in_task = error
            self._poke()
            return
        if self._snapshot_due():
            self._poke()

    async def _run(self) -> None:
        """The owner task: answer ended flushes, write queued groups, begin fsyncs; sleep
        when none of that can progress. Only the awaits below yield to the event loop."""
        while True:
            try:
                error, self._raise_in_task = self._raise_in_task, None
                if error is not None:
                    raise error  # from _flush_ended's settling, as if it had happened here
                self._complete_flushes()
                self._check_snapshot_write()
                self._check_roll()
                if self._retention_roll and self._roll is None and not self._queue:
                    self._retention_roll = False
                    if self.log is not None and self.log.roll_for_retention_due(_wall_ms()):
                        self._begin_flushes()  # what it holds: on its way
                        self._begin_roll()  # (then the next retention pass deletes it)
                        continue
                if self._queue and self._may_write() and self._roll is None and (
                        not self._snapshot_due() or self._refusing_writes()):
                    count, size = self._group_extent()
                    if self.log is not None and self.log.roll_due(size):
                        self._begin_flushes()  # what the old segment holds: on its way
                        self._begin_roll()  # no writes until it ends; answers go on
                        continue
                    self._write(self._take_group(count, size))
                    self._begin_flushes()
                    flushes = self._flushes
                    if self._queue or self._raise_in_task is not None or \
                            self._replicating or (flushes and (
                                flushes[0].future is None or flushes[0].future.done())):
                        continue
                    # Else the top of the loop would find nothing to do (its pass cost a
                    # fifth of a write step): what ends meanwhile (an fsync, a roll, a
                    # snapshot write) ends in a later step of the loop and wakes this
                    # task. So on to the idle checks.
                else:
                    self._begin_flushes()
                if not self._flushes and not self._unflushed and not self._replicating \
                        and self._snapshot_due():
                    await self._snapshot()  # drained: everything applied is durable
                    continue
                if self._flushes and self._flushes[0].future is None:
                    continue
                self._wake = asyncio.get_running_loop().create_future()
                await self._wake
            except asyncio.CancelledError:
                error = AtomlogError("SHUTTING_DOWN", f"partition {self.name} closed")
                stashed, self._raise_in_task = self._raise_in_task, None
                self._fail_unanswered(error, stashed.flush.works
                                      if isinstance(stashed, _FlushFailed) else None)
                _fail_all(self._queue, error)
                self._queue.clear()
                self._queued_bytes = 0
                raise
            except _FlushFailed as failure:
                await self._fail_closed(failure.error, failure.flush.works)
            except Exception as error:  # noqa: BLE001 — disk trouble: reload from disk
                await self._fail_closed(error, [])

    def _refusing_writes(self) -> bool:
        """The ISR is below min.insync.replicas: a write refuses new batches and appends
        nothing, so it needs no snapshot first. (The snapshot waits until what is
        written is replicated, which a short ISR may hold back for good: writes that
        waited for it hung, unanswered, instead of being refused.)"""
        return self.replication is not None and \
            self.replication.not_enough_replicas() is not None

    def _group_extent(self) -> tuple[int, int]:
        """(requests, bytes) of the next group: the oldest queued requests, at least one,
        until they reach max_group_bytes."""
        count = size = 0
        limit = self.settings.max_group_bytes
        for work in self._queue:
            count += 1
            size += work.size
            if size >= limit:
                break
        return count, size

    def _take_group(self, count: int, size: int) -> list[_Queued]:
        """Dequeue the group `_group_extent` measured."""
        popleft = self._queue.popleft
        group = [popleft() for _ in range(count)]
        self._queued_bytes -= size
        return group

    # ------------------------------------------------------------------ segment rolls
    def _begin_roll(self) -> None:
        """Roll the active segment before the next group would cross its bounds, its disk
        work (four fsyncs) on a worker thread: the event loop every partition and TC
        partition of the process shares never waits for the disk. This partition writes
        nothing until it ends (`_check_roll`); flushes end and are answered meanwhile."""
        job = self.log.roll_begin()
        try:  # an executor's future, not a task: nothing cancels it while the thread works
            future = asyncio.get_running_loop().run_in_executor(None, job.run, self._fsync)
        except BaseException as error:  # no thread to run it (shutting down)
            self.log.roll_failed(job, error)
            raise
        self._roll = _Roll(self.log, job, future, time.perf_counter())
        future.add_done_callback(self._poke)

    def _check_roll(self) -> None:
        """The owner task, at each step: a roll whose disk work ended takes effect; one
        that failed raises its error here, to fail closed and reload as a write does."""
        if self._roll is not None and self._roll.future.done():
            error = self._settle_roll()
            if error is not None:
                raise error

    def _settle_roll(self) -> BaseException | None:
        """The ended roll takes effect in the log (or breaks it): its error, or None."""
        roll, self._roll = self._roll, None
        error = roll.future.exception()
        if error is not None:
            roll.log.roll_failed(roll.job, error)
            return error
        roll.log.roll_end(roll.job)
        m.ROLL_SECONDS.observe(time.perf_counter() - roll.began)
        return None

    async def _roll_finished(self) -> None:
        """Wait for a roll under way, if any, and settle it: close and a reload need the
        files as it leaves them (its thread may be creating the next segment's file)."""
        roll = self._roll
        if roll is None:
            return
        await asyncio.wait([roll.future])
        if self._roll is roll:
            error = self._settle_roll()
            if error is not None:
                log.warning("segment roll failed on %s: %s", self.name, error)

    def _write(self, group: list[_Queued]) -> None:
        """Decide and append one group (no await). Its requests are answered when a flush
        begun after this covers them; on an exception the group is failed with the rest."""
        try:
            self.check_serving()
        except AtomlogError as error:
            _fail_all(group, error)
            return
        if self._wal_tap is not None:
            full = self._wal_tap.wal.full()
            if full is not None:  # refused before anything is written
                _fail_all(group, full)
                return
        self._unflushed.extend(group)  # first: a failure below fails the group too
        self._stamp_ms = now = max(self._stamp_ms, _wall_ms())
        # Too few in-sync replicas: new batches are refused (nothing written), retries of
        # written ones still answered as duplicates, so a refusal always means "not in the
        # log" (a client may give a refused batch's sequence numbers to the next one).
        too_few = (self.replication.not_enough_replicas()
                   if self.replication is not None else None)
        decided = self._decide(group, now, self.log.log_end_offset, too_few)
        accepted = decided.accepted
        expected_bases = decided.expected_bases
        if decided.last_control_offset is not None:
            self.last_control_offset = decided.last_control_offset
        for decision, count in ((ControlType.COMMIT, decided.commits_written),
                                (ControlType.ABORT, decided.aborts_written)):
            if count:
                counter = self._markers_written.get(decision)
                if counter is None:
                    counter = self._markers_written[decision] = m.MARKERS_WRITTEN.labels(
                        self.topic, decision.name.lower())
                counter.inc(count)
        appended_bytes, records, duplicates = (decided.appended_bytes, decided.records,
                                               decided.duplicates)
        if accepted:
            began = time.perf_counter()
            offsets = self.log.append_parsed(accepted)
            m.APPEND_SECONDS.observe(time.perf_counter() - began)
            # Pair assertion: the log assigned exactly the offsets producer state recorded.
            assert offsets == expected_bases, (offsets, expected_bases)
            if self.replication is not None:  # followers copy it while the fsync runs
                self.replication.appended(self.log.log_end_offset)
            self._bytes_in.inc(appended_bytes)
            self._records_in.inc(records)
            self._unflushed_batches += len(accepted)
            self._batches_since_snapshot += len(accepted)
        if duplicates:
            self._duplicates.inc(duplicates)
        if too_few is not None:
            # Requests refused whole for too few in-sync replicas wrote nothing and wait
            # for nothing: answered now, not once a flush is replicated (which may be
            # never while the ISR stays short).
            refused = {id(w): w for w in group if isinstance(w, _Work) and w.results
                       and all(r is too_few for r in w.results)}
            if refused:
                for work in refused.values():
                    if not work.future.done():
                        work.future.set_result(work.results)
                # (By identity: a dataclass's == would compare the batches' bytes.)
                self._unflushed = [w for w in self._unflushed if id(w) not in refused]

    def _begin_flushes(self) -> None:
        """Begin a flush for the requests written since the last one began, while fewer
        than max_fsyncs_in_flight run (else they wait for the next free one)."""
        settings = self.settings
        while self._unflushed:
            if not self._unflushed_batches and self._flushes and \
                    self._flushes[-1].target == self.log.log_end_offset:
                # Nothing appended since the last flush began (duplicates, refusals):
                # answer with it, as everything they may depend on is below its target.
                self._flushes[-1].works.extend(self._unflushed)
                self._unflushed = []
                return
            if len(self._flushes) >= settings.max_fsyncs_in_flight:
                return
            works, batches = self._unflushed, self._unflushed_batches
            self._unflushed, self._unflushed_batches = [], 0
            target, fd = self.log.flush_begin()
            future = None
            if fd is not None and settings.fsync:
                if self._wal_tap is not None:  # the write-ahead file's next round
                    future = self._wal_tap.sync(self._flush_ended)
                elif self._log_sync is not None:  # the barrier's answer settles it
                    future = self._log_sync.submit(fd, self._flush_ended)
                else:
                    future = asyncio.get_running_loop().run_in_executor(
                        None, _fsync_duplicate, self._fsync, os.dup(fd))
                    future.add_done_callback(self._poke)
            self._flushes.append(_Flush(target, works, batches, future, time.perf_counter()))

    def _complete_flushes(self) -> None:
        """Take ended flushes in the order they began: move the high watermark, wake
        readers, answer the requests. Raises _FlushFailed for a failed fsync, or for a flush
        the log could not end (its requests fail with the partition, closed)."""
        flushes = self._flushes
        moved = False
        try:
            while flushes and (flushes[0].future is None or flushes[0].future.done()):
                flush = flushes.popleft()
                if flush.future is not None:
                    error = flush.future.exception()
                    if error is not None:
                        raise _FlushFailed(flush, error)
                    m.FSYNC_SECONDS.observe(time.perf_counter() - flush.began)
                    m.FSYNCS.inc()
                    m.PRODUCE_BATCHES_PER_FSYNC.observe(flush.batches)
                if self.replication is not None:
                    # Durable here; answered once the in-sync replicas hold it too.
                    self.replication.durable(flush.target)
                    self._replicating.append(flush)
                    continue
                moved |= self._end_flush(flush)
        finally:
            if self._replicating:
                moved |= self._release_replicated()
            if moved:
                if not self.txns_recovering:
                    self.txns.on_durable(self.log.high_watermark)
                self._notify_readers()

    def _release_replicated(self) -> bool:
        """Answer the flushes the high watermark of the in-sync replicas covers, in order:
        only now does the log's high watermark (what is readable) move past them. Nothing
        while the ISR is below min.insync.replicas: what only the leader (or too few
        replicas) holds waits until the ISR grows back, or fails when the leadership ends."""
        if not self.replication.progress.may_acknowledge():
            return False
        hw = self.replication.high_watermark
        replicating = self._replicating
        moved = False
        while replicating and replicating[0].target <= hw:
            moved |= self._end_flush(replicating.popleft())
        return moved

    def _end_flush(self, flush: _Flush) -> bool:
        """Move the log's high watermark to a flush that is durable (and, replicated, held
        by the in-sync replicas) and answer its requests; whether the watermark moved.
        Raises _FlushFailed when the log cannot end it: its requests then fail with the
        partition instead of waiting for ever."""
        try:
            moved = self.log.flush_end(
                flush.target, durable=self.settings.fsync and flush.future is not None
                and self._wal_tap is None)
        except Exception as error:
            raise _FlushFailed(flush, error) from error
        for work in flush.works:
            if not work.future.done():
                work.future.set_result(work.results)
        return moved

    def replicated(self) -> None:
        """The in-sync replicas' high watermark may have moved (a follower fetched, the ISR
        changed): wake the owner task, which answers what it covers. Not here: moving the
        log's high watermark may write its recovery point, and a failure there must fail
        the partition closed in the owner task, not escape into a follower's call."""
        if self._replicating:
            self._poke()

    def _snapshot_due(self) -> bool:
        since = self._batches_since_snapshot
        writing = self._snapshot_write is not None and not self._snapshot_write.done()
        return bool(since) and self.state is State.ONLINE and not writing and (
            since >= self._snapshot_after[0]
            or _wall_ms() - self._last_snapshot_ms >= self._snapshot_after[1])

    def _snapshot_taken(self) -> None:
        """Start the next snapshot interval (the batch count is the caller's), each bound
        drawn at 75-125% of its setting: partitions loaded together (a server's start) or
        equally loaded would otherwise snapshot in the same instant, every one of them
        draining its writes and fsyncing its files at once, a stall of the whole server
        every interval."""
        self._last_snapshot_ms = _wall_ms()
        self._snapshot_after = tuple(max(1, round(bound * random.uniform(0.75, 1.25)))
                                     for bound in (self.settings.snapshot_interval_batches,
                                                   self.settings.snapshot_interval_ms))

    def _fail_unanswered(self, error: AtomlogError, first: list | None = None) -> None:
        """Fail every request written and not answered (in flight or waiting for an fsync)."""
        for works in ([first or []] + [f.works for f in self._replicating]
                      + [f.works for f in self._flushes] + [self._unflushed]):
            _fail_all(works, error)
        self._replicating.clear()
        self._flushes.clear()
        self._unflushed, self._unflushed_batches = [], 0

    async def _fail_closed(self, error: BaseException, failed: list) -> None:
        """A write or fsync failed: fail everything unanswered, stop using the log, and
        reload from what is durable (the high watermark: nothing above it was acknowledged,
        and after a failed fsync the page cache above it is not to be trusted)."""
        tap = self._wal_tap
        keep = -1
        if tap is not None and self.log is not None and \
                self._gathered_to > self.log.high_watermark:
            # A decision written in the commit lane's step depends on what this owner
            # wrote in it (WalTap.fatal), durable or not yet: its reload keeps that, where
            # it would cut back to the high watermark (which moves only once a flush is
            # durable). The load's replay writes the file's pending frames and rewrites the
            # log from them, and its BASE frame's fsync makes them durable; a failed write
            # or fsync of the file before that stops the server (fatal frames not durable),
            # and so does a load that could not bring the write back (`_load_blocking`).
            # Before, any such failure stopped the server: a full disk failing a snapshot
            # or recovery-point write under a steady load of one-call commits.
            keep = self._gathered_to
            event(log, "partition reloads keeping a write of the commit lane's step",
                  logging.WARNING, partition=self.name, keep_to=keep,
                  high_watermark=self.log.high_watermark, error=str(error))
        corrupt = isinstance(error, AtomlogError) and error.reason == "DATA_LOSS"
        if corrupt:  # (a read found it: `_data_loss_found`)
            event(log, "corruption found before the log tail; failing unacknowledged "
                  "requests and reloading", logging.ERROR, partition=self.name,
                  error=str(error))
        else:
            log.error("append or fsync failed on %s; failing unacknowledged requests and "
                      "reloading from disk", self.name, exc_info=error)
        if self.replication is not None:
            # Followers copy before the leader's fsync: they may hold records cut below.
            # This leadership serves nothing more and gives its epoch up once reloaded
            # (LeaderReplication.give_up; docs/replication.md, "Writes").
            self.replication.give_up(DATA_LOSS_WHY if corrupt
                                     else f"a write or fsync failed: {error}")
        if keep < 0:
            refusal = AtomlogError("PARTITION_LOADING",
                                   f"write failed on {self.name}: {error}; reloading")
        else:  # (Not PARTITION_LOADING, which tells a client nothing was written.)
            refusal = AtomlogError(
                "SERVER_UNAVAILABLE", f"write failed on {self.name}: {error}; reloading, "
                "keeping what the commit lane wrote: the request may be in the log")
        self._fail_unanswered(refusal, failed)
        durable = None
        if self.log is not None:
            self.log.fail(f"{type(error).__name__}: {error}")
            durable = self.log.high_watermark
            if self.replication is not None:
                # Keep what is durable here (the epoch changes anyway; above it the page
                # cache is not to be trusted after a failed fsync).
                durable = max(durable, self.replication.local_durable_end)
        if durable is not None:
            durable = max(durable, keep)
        delay_s = RELOAD_RETRY_FIRST_S
        while True:
            try:
                await self._reload_after_failure(durable, keep)
                return
            except Exception as reload_error:  # noqa: BLE001 — the disk may come back
                # The partition stays LOADING (refusing produce and reads with the
                # retriable PARTITION_LOADING) and tries again: a full disk or a failing
                # device that recovers must not leave it offline until a restart.
                _fail_all(self._queue, AtomlogError(
                    "PARTITION_LOADING", f"partition {self.name} failed to reload: "
                    f"{reload_error}; retrying"))
                self._queue.clear()
                self._queued_bytes = 0
                event(log, "partition reload failed; retrying", logging.ERROR,
                      partition=self.name, error=f"{type(reload_error).__name__}: "
                      f"{reload_error}", retry_in_seconds=round(delay_s, 2))
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, RELOAD_RETRY_MAX_S)

    async def _flush_everything(self) -> None:
        """Make everything appended durable now (close): no request is answered."""
        target, fd = self.log.flush_begin()
        if fd is not None and self.settings.fsync:
            if self._log_sync is not None:
                await self._log_sync.sync(fd)
            else:
                await asyncio.get_running_loop().run_in_executor(
                    None, _fsync_duplicate, self._fsync, os.dup(fd))
        if self.log.flush_end(target, durable=self.settings.fsync):
            if not self.txns_recovering:
                self.txns.on_durable(self.log.high_watermark)
            self._notify_readers()

    def verify_again(self, txn: TxnId) -> AtomlogError:
        """The retriable refusal of a write whose verification a marker overtook."""
        return write_step.verify_again(self.name, txn)

    def _decide(self, group: list[_Queued], now: int, next_offset: int,
                too_few: AtomlogError | None) -> write_step.Decided:
        """The decision part of the write step (write_step.py): the native core's when
        the owner's tables are its classes, else the Python reference."""
        txns, producers, guard = self.txns, self.producers, self.guard
        if (_native_decide is not None and type(txns) is _NativeTxnBuffer
                and type(producers) is _NativeProducers and type(guard) is _NativeGuard):
            return _native_decide(group, now, next_offset, too_few, producers, txns, guard,
                                  self.name, self._coordinator_epoch)
        return write_step.decide(group, now, next_offset, too_few, producers, txns, guard,
                                 self.name, self._coordinator_epoch)

    def _notify_readers(self) -> None:
        moved, self._data_moved = self._data_moved, None
        if moved is not None and not moved.done():
            moved.set_result(None)

    async def _reload_after_failure(self, truncate_to: int | None = None,
                                    keep: int = -1) -> None:
        self.state = State.LOADING
        self._notify_readers()
        try:
            self.log.close()
        except Exception:  # noqa: BLE001
            pass
        if self._wal_tap is not None:
            self._wal_tap.detach(self.log)
        await self._load(truncate_to, keep)

    def _deferred_write_done(self, opened: PartitionLog, done: asyncio.Future) -> None:
        """A periodic recovery-point write on a worker thread ended. One that failed (a
        full disk) broke `opened`: if it is still this owner's log, fail closed in the
        task and reload, as after a failed write. Otherwise nothing would: a partition
        that writes nothing more (an idle __txn_log partition whose TC partition is
        loading, chaos seed 2791) found out only at its next write, and its readers were
        refused INTERNAL until then."""
        error = None if done.cancelled() else done.exception()
        if error is not None and self.log is opened:
            log.warning("the recovery point of %s could not be written: %s; reloading",
                        self.name, error)
            self._checkpoint_failed(error)

    def _data_loss_found(self, opened: PartitionLog, loss) -> None:
        """A read of this owner's log found corruption before its tail (the log refuses
        every use from then on and has recorded it): fail closed in the task and reload,
        which finds the record and takes the partition to DATA_LOSS, so its state,
        metrics and `atomlog partition recover` say what its reads already do. Before, it
        stayed ONLINE in all of them until a restart."""
        if self.log is opened:
            self._checkpoint_failed(loss.error())

    def _checkpoint_failed(self, error: BaseException) -> None:
        """The write-ahead file's checkpointer could not fsync this log (its pages are
        unknown), frames of this log were lost by a failed write or fsync of the file, or
        a deferred recovery-point write failed: fail closed in the task and reload (the
        load rewrites the log from the frames above its last checkpoint)."""
        self._fail_in_task(error)

    def _fail_in_task(self, error: BaseException) -> None:
        """Fail closed in the owner task (as a failed write does: it reloads), from a
        callback or a background task of this owner that cannot do it itself."""
        # (While LOADING too: a checkpoint that failed between the log's attach and
        # ONLINE broke the log, and the task raises it at its first step.)
        if self._raise_in_task is None and self.state in (State.ONLINE, State.LOADING):
            self._raise_in_task = error if isinstance(error, Exception) else OSError(str(error))
            self._poke()

    def expire_producers(self) -> int:
        """Forget producers idle past the expiry (bounded scan of the table)."""
        if self.state is not State.ONLINE:
            return 0
        removed = len(self.producers.expire(_wall_ms()))
        m.PRODUCERS_EXPIRED.labels(*self._labels).inc(removed)
        evicted = self.producers.metrics.evicted_total
        if evicted < self._evicted_exported:
            self._evicted_exported = 0  # (a table rebuilt by a load counts from 0)
        m.PRODUCERS_EVICTED.labels(*self._labels).inc(evicted - self._evicted_exported)
        self._evicted_exported = evicted
        return removed

    async def apply_retention(self) -> int:
        """Delete whole old segments past the retention limits, never at or above the max
        read position (an open transaction keeps its data); returns segments removed."""
        if self.state is not State.ONLINE or self.txns_recovering:
            return 0  # (a recovering buffer still reads the old segments)
        before = self.log.log_start_offset
        # Ages count to now (the wall clock), not to the last append (the log's clock): a
        # partition nobody writes any more kept its data past retention.ms until its next
        # write. Not to the append clock either, which never goes back: one write while
        # the clock ran a week ahead made every segment look a week old (all deleted at
        # once) and then froze ages until real time caught up; a segment stamped ahead
        # looks young instead, as in Kafka.
        now_ms = _wall_ms()
        removed = self.log.apply_retention(keep_from_offset=self.max_read_position(),
                                           now_ms=now_ms)
        if self.log.roll_for_retention_due(now_ms):
            self._retention_roll = True  # the owner task rolls it; the next pass deletes it
            self._poke()
        if self.log.log_start_offset != before:
            # Snapshots covering less than the new start describe deleted data (as for
            # delete_records); a load would also refuse them.
            self._remove_snapshots_below(self.log.log_start_offset)
            self._snapshot_soon()
            # (Only a move: it is news for every follower of a leader, which a pass that
            # deleted nothing, every few seconds on every partition, is not.)
            self._log_start_moved()
        return removed

    # ------------------------------------------------------------------ delete records
    async def delete_records(self, before_offset: int) -> int:
        """DeleteRecords: delete the whole segments below `before_offset` (the log's shared
        deletion path, as retention); returns the log start offset after it. Refuses a
        partition that is not serving, a negative offset (INVALID_ARGUMENT) and one above
        the high watermark (OFFSET_OUT_OF_RANGE), so only flushed segments ever go.
        Segments at or above the max read position stay (an open transaction keeps its
        data: the deletion stops below the oldest open transaction's first offset).

        Serialized with appends the way retention is: once no snapshot is being written
        (it waits for one: the owner goes on writing meanwhile, so the high watermark, and
        the new start with it, may pass what that snapshot covers), it runs to the end
        without yielding to the event loop, and the owner task changes the log only in
        steps that do not yield either. While the owner waits for its group fsyncs nothing
        deleted here is in use: an fsync in flight is of a segment holding data above the
        high watermark, never deleted (and on a duplicate descriptor).

        Producer-state snapshots that would describe deleted data (covering less than the
        new log start) are removed first, durably: restoring one of them and replaying
        from the new start would skip the deleted batches. Recovery then uses a newer
        snapshot or replays what is left, as a full replay of the remaining log would."""
        while self._snapshot_write is not None and not self._snapshot_write.done():
            await self._snapshot_written()
        self.check_serving()
        if before_offset > self.log.high_watermark:
            self.log.delete_records(before_offset)  # raises OFFSET_OUT_OF_RANGE
        before_offset = min(before_offset, self.max_read_position())
        new_start = self.log.log_start_after_delete(before_offset)
        if new_start > self.log.log_start_offset:
            self._remove_snapshots_below(new_start)
            self.log.delete_records(before_offset)
            self._log_start_moved()
            self._snapshot_soon()
        return self.log.log_start_offset

    def _log_start_moved(self) -> None:
        """Retention or DeleteRecords moved the log start: what the transaction buffer,
        the subscriptions and a leader's epochs hold below it goes."""
        start = self.log.log_start_offset
        self.txns.forget_below(start)
        self.subscriptions.forget_below(start)
        if self.replication is not None:
            self.replication.log_start_moved(start)

    def _snapshot_soon(self) -> None:
        """The log start moved past the snapshots (removed): the next one is taken at the
        owner's next drained step, not at the end of its interval. Until then a crash
        leaves none, and producers whose last batches were deleted are unknown to the
        load: the first batch of one (sequence 0) retried after a lost answer would be
        appended a second time. (An idle partition took none for hours.)"""
        self._last_snapshot_ms = 0
        self._batches_since_snapshot = max(1, self._batches_since_snapshot)
        self._poke()

    def _remove_snapshots_below(self, offset: int) -> None:
        removed = False
        for path in self.directory.iterdir():
            covered = producer_state.parse_snapshot_file_name(path.name)
            if covered is None:
                covered = txn_buffer.parse_snapshot_file_name(path.name)
            if covered is not None and covered < offset:
                path.unlink(missing_ok=True)
                removed = True
        if removed:
            fsync_directory(self.directory)

    # ------------------------------------------------------------------ snapshots
    async def _snapshot(self, force: bool = False) -> None:
        """Snapshot producer state and the transaction buffer, both covering everything
        durable (applied end == high watermark): the state is encoded here, at once; the
        files are written on a worker thread while the owner goes on writing (the next
        snapshot is not due until they are), except with `force` (close), which waits."""
        if force:
            await self._snapshot_written()
        if self.log is None or (not force and not self._batches_since_snapshot):
            return
        covered = self.log.high_watermark
        if covered != self.log.log_end_offset:
            # Not everything applied is durable (close after a failed final flush):
            # skip; the owner takes snapshots only when drained, so it never is here.
            self._batches_since_snapshot = 0
            self._snapshot_taken()
            return
        producers = self.producers.snapshot(covered)
        # A recovering buffer keeps its old snapshot (the one it replays from).
        txns = None if self.txns_recovering else self.txns.snapshot(covered)
        self._batches_since_snapshot = 0
        self._snapshot_taken()
        # Not awaited by the owner task (a write and two fsyncs, which held every write
        # of the partition up to hundreds of ms under load); close() and a reload wait for
        # it (two writers of the same file would race on its .tmp).
        self._snapshot_write = asyncio.ensure_future(asyncio.to_thread(
            self._write_snapshots, covered, producers, txns))
        if force:
            await self._snapshot_written()
        else:
            self._snapshot_write.add_done_callback(self._poke)  # _check_snapshot_write

    def _check_snapshot_write(self) -> None:
        """The owner task, at each step: a snapshot write that ended is forgotten, and one
        that failed raises its error here, to fail closed and reload as a write does."""
        write = self._snapshot_write
        if write is not None and write.done():
            self._snapshot_write = None
            if write.exception() is not None:
                raise write.exception()

    async def _snapshot_written(self) -> None:
        """Wait for the snapshot write under way, if any. A failed one is logged and left
        for the owner task (_check_snapshot_write), which fails the partition closed; a
        load falls back to the older files."""
        write = self._snapshot_write
        if write is None:
            return
        await asyncio.wait([write])
        if write.exception() is not None:
            log.warning("snapshot write failed on %s: %s", self.name, write.exception())
        elif self._snapshot_write is write:
            self._snapshot_write = None

    def _write_snapshots(self, covered: int, producers: bytes, txns: bytes | None) -> None:
        self._write_snapshot(producer_state, covered, producers)
        if txns is not None:
            self._write_snapshot(txn_buffer, covered, txns)

    def _write_snapshot(self, module, covered: int, data: bytes) -> None:
        write_atomically(self.directory / module.snapshot_file_name(covered), data)
        self._note_snapshot(module, covered)
        for _, old in self._snapshot_files(module)[SNAPSHOTS_KEPT:]:
            old.unlink(missing_ok=True)

    # ------------------------------------------------------------------ reads
    def oldest_flush_began(self) -> float | None:
        """When (time.perf_counter) the oldest fsync in flight began, or None. Read from the
        metrics thread at scrape time: the deque may change under it."""
        try:
            return self._flushes[0].began
        except IndexError:
            return None

    def max_read_position(self) -> int:
        return self.txns.max_read_position(self.log.high_watermark)

    def positions(self) -> dict[str, int]:
        partition_log = self.log
        hw = partition_log.high_watermark
        return {"log_start_offset": partition_log.log_start_offset, "high_watermark": hw,
                "max_read_position": (-1 if self.txns_recovering
                                      else self.txns.max_read_position(hw)),
                "last_data_offset": partition_log.last_data_offset}

    def read(self, offset: int, max_bytes: int, *, committed: bool = False,
             include_control: bool = False) -> tuple[bytes, int, list[AbortedTxn]]:
        """Whole batches from `offset`: (bytes, next offset, aborted transactions).
        committed (read_committed): nothing at or above the max read position, and the
        batches of aborted transactions removed here; else everything below the high
        watermark, with the aborted transactions overlapping the range listed. Control
        batches only with include_control. next offset is past everything read or
        filtered out, so a reader never reads the same batches twice."""
        self.check_serving()
        partition_log = self.log
        hw = partition_log.high_watermark
        bound = self.txns.max_read_position(hw) if committed else hw
        if offset >= bound:
            if offset > hw:  # past the log end: the same refusal as a plain read
                partition_log.read(offset, max_bytes, hw)
            return b"", offset, []
        data, next_offset = partition_log.read(offset, max_bytes, bound)
        aborted: list[AbortedTxn] = []
        if self.last_control_offset >= 0 and data:
            first = _first_offset(data)
            try:
                aborted = self.txns.aborted_in(first, next_offset)
            except AtomlogError:
                if committed:
                    raise  # fail closed: the abort set of this range is unknown
                aborted = []
            if aborted or (not include_control and self.last_control_offset >= first):
                data = _filter(data, aborted if committed else (), include_control)
        m.BYTES_OUT.labels(*self._labels).inc(len(data))
        return data, next_offset, ([] if committed else aborted)

    async def wait_for_data(self, offset: int, timeout_s: float, committed: bool = False) -> None:
        """Return when the readable end (max read position, or high watermark) passes
        offset, or after timeout_s."""
        def ready() -> bool:
            if self.state is not State.ONLINE or (committed and self.txns_recovering):
                return True  # the caller's next read answers
            hw = self.log.high_watermark
            return (self.txns.max_read_position(hw) if committed else hw) > offset

        if ready() or timeout_s <= 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not ready():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            if self._data_moved is None:
                self._data_moved = loop.create_future()
            try:  # shielded: a waiter that times out leaves the shared future alone
                await asyncio.wait_for(asyncio.shield(self._data_moved), remaining)
            except asyncio.TimeoutError:
                return

    def offset_for_timestamp(self, timestamp_ms: int) -> tuple[int, int] | None:
        self.check_serving()
        return self.log.offset_for_timestamp(timestamp_ms)

    # ------------------------------------------------------------------ admin
    async def recover_data_loss(self, file: str, offset: int):
        if self.state is not State.DATA_LOSS:
            raise AtomlogError("PARTITION_NOT_IN_DATA_LOSS",
                               f"partition {self.name} is {self.state.value}, not in DATA_LOSS")
        if self._wal is not None:
            # The loss accepted: frames an earlier start kept aside for this partition
            # (its directory was missing then) must never be replayed into what starts
            # now. Given up first: a crash between the two leaves it in DATA_LOSS still.
            self.log.check_recovery(file, offset)
            await asyncio.to_thread(forget_kept, self._wal.directory, self.name)
            if self.log.wal is None and self._wal_tap is not None:
                # A log loaded in DATA_LOSS has no tap, so its cut would be no frame, and
                # the reload's replay would find the log ending below the frames (loaded
                # at a higher offset): DATA_LOSS again. Framed first, as every cut is.
                await asyncio.to_thread(self._wal.write_cut, self._wal_tap.name, offset)
        report = await asyncio.to_thread(self.log.recover_data_loss, file, offset)
        self.log.close()
        await self._load()
        return report


def _apply(table: ProducerStateTable, header: BatchHeader) -> None:
    table.apply(header.producer_id, header.producer_epoch, header.base_sequence,
                header.last_sequence, header.base_offset, header.last_offset,
                header.log_append_time_ms, control=header.is_control)


def _marker_of(partition_log: PartitionLog, header: BatchHeader) -> ControlMarker | None:
    """The decoded marker of a control batch (read from the log); None for data."""
    if not header.is_control:
        return None
    data, _ = partition_log.read(header.base_offset, header.size, partition_log.log_end_offset)
    return decode_control_batch(data[:header.size])


def _first_offset(data: bytes) -> int:
    return next(iter_batches(data))[1].base_offset


def _filter(data: bytes, aborted, include_control: bool) -> bytes:
    """The batches of `data` minus aborted transactions' data batches (and control
    batches unless include_control). Headers only; kept runs are sliced, not copied."""
    ranges: dict[TxnId, list[tuple[int, int]]] = {}
    for entry in aborted:
        ranges.setdefault(entry.txn, []).append((entry.first_offset, entry.marker_offset))
    view = memoryview(data)
    kept: list[memoryview] = []
    run_start = run_end = 0
    for position, header in iter_batches(view):
        if header.is_control:
            keep = include_control
        elif header.is_transactional and header.txn in ranges:
            base = header.base_offset
            keep = not any(first <= base < marker for first, marker in ranges[header.txn])
        else:
            keep = True
        if keep:
            if position != run_end:
                if run_end > run_start:
                    kept.append(view[run_start:run_end])
                run_start = position
            run_end = position + header.size
    if run_end > run_start:
        kept.append(view[run_start:run_end])
    if len(kept) == 1 and len(kept[0]) == len(data):
        return data
    return b"".join(kept)


def _fail_all(group, error: AtomlogError) -> None:
    for work in group:
        if not work.future.done():
            work.future.set_exception(error)


class _FlushFailed(Exception):
    """A flush that failed (its fsync, or the log ending it): its requests fail with the
    partition, which fails closed."""

    def __init__(self, flush: _Flush, error: BaseException):
        super().__init__(str(error))
        self.flush, self.error = flush, error


def _fsync_duplicate(fsync: Callable[[int], None], fd: int) -> None:
    """On a worker thread: fsync a duplicate descriptor of the segment, then close it (the
    duplicate keeps the file open even if the log closes its own descriptor meanwhile)."""
    try:
        fsync(fd)
    finally:
        os.close(fd)
