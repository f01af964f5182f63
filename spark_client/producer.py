"""The idempotent producer.

`send()` adds a record to its partition's open batch and returns a future. A sender
thread seals batches when they are full or their linger time has passed, and sends each
server one Produce request carrying the ready batches of its partitions, with at most
`max_in_flight` batches per partition outstanding (5: what the servers remember per
producer for deduplication). The requests go on one pipelined connection to the
server's link, in the order they are sent (spark_client/link.py, `Pipeline`), or over
gRPC when the server has no link or it cannot be used. Every batch carries the producer id, epoch and a sequence
number assigned when it is sealed, so a retry after a lost reply is recognised by the
server and answered with the original offsets: each record is written once, in send
order per partition.

Retries: retriable errors (routing, loading, unreachable, timeouts) resend the same
bytes after a backoff and a metadata refresh, in sequence order. A batch that fails for
good fails its futures; the batches behind it on that partition are re-sequenced and
sent again (they were refused as out of order, so nothing of them was written). Unless
it was refused DATA_LOSS after an attempt that went unanswered: that refusal proves only
that its own attempt wrote nothing (the partition had no log to find the earlier one
in), so the partition then takes a new producer id instead of handing the batch's
sequence numbers to other records, and the error says they may or may not have been
written.
Delivery gives up after `delivery_timeout_s` with `DeliveryTimeout`.

Transactions: `send(..., txn=txn)` puts the record in a batch of that transaction only
(a partition's open batch is sealed when the transaction changes). Before the first
batch of a transaction goes to a partition, the sender registers the partition with the
coordinator (one AddPartitionToTxn per transaction for everything ready), and the
transaction tracks each batch so `commit()` waits for them. `transactional_id=` gives a
Kafka-style session: the producer id and epoch come from the session (InitProducerId
on the session's TC partition, which fences any older session with the same id), and
`begin_transaction()` opens transactions bound to it.
"""

from __future__ import annotations

import collections
import itertools
import queue
import random
import threading
import time
from dataclasses import dataclass, field

import crc32c
import grpc

from atomlog.v1 import partition_pb2
from partition_server.record_batch import Compression, Record, uvarint
from partition_server.record_columns import columns_block, encode_records, frame_header
from spark_client import errors, link
from spark_client.columns import HEADER_OVERHEAD, ROW_OVERHEAD, Chunk, prepare
from spark_client.transactions import KeptBy
from services.backoff import Backoff

_new_tuple = tuple.__new__  # Record tuples made without their Python-level __new__ (send())
assert Record._fields == ("key", "value", "headers", "timestamp_ms", "offset")

# Sequences are int32 and batches may not wrap inside themselves: a producer that gets
# near the end rotates to a new producer id (see ProducerIdSource).
SEQUENCE_LIMIT = 2**31 - 1
# A partition's producer id while it waits for a fresh one (_new_identity): never a real
# id, so nothing goes under it, and the partition's next batch asks for one (_encode).
NEEDS_ID = -1
RETRIABLE_ITEM_REASONS = {"NOT_PARTITION_OWNER", "UNKNOWN_TOPIC_OR_PARTITION", "PARTITION_LOADING",
                          "NOT_ENOUGH_REPLICAS",  # the ISR short of min.insync.replicas
                          "SERVER_UNAVAILABLE", "REQUEST_TIMED_OUT", "SHUTTING_DOWN",
                          "RESOURCE_EXHAUSTED", "ZOOKEEPER_UNAVAILABLE",
                          # transactional writes being verified with their coordinator
                          "CONCURRENT_TRANSACTIONS", "COORDINATOR_LOADING", "NOT_COORDINATOR"}
# Bytes of batches in one Produce request: the servers take messages up to
# grpc.max_message_bytes (16 MiB by default); more batches go in further requests.
MAX_REQUEST_BYTES = 8 << 20
SEQUENCE_REFUSALS = {"OUT_OF_ORDER_SEQUENCE", "UNKNOWN_PRODUCER_ID"}
# Refusals that prove nothing of the batch was appended.
DEFINITELY_NOT_WRITTEN = {"BATCH_TOO_LARGE", "CORRUPT_BATCH", "CRC_MISMATCH", "INVALID_ARGUMENT",
                          "UNIMPLEMENTED", "DATA_LOSS", "OFFSET_OUT_OF_RANGE",
                          "TRANSACTION_NOT_OPEN", "TRANSACTION_ABORTED", "TRANSACTION_TIMED_OUT",
                          "PARTITION_NOT_IN_TRANSACTION", "UNKNOWN_TRANSACTION"}
# Of those, the ones a server answers without looking for an earlier attempt of the batch
# (the others come after its producer state told a retry of a written batch, answered as
# the duplicate it is, from a new one): a partition in DATA_LOSS has no log to look in,
# and its copy may come back holding an earlier, unanswered attempt.
UNCHECKED_REFUSALS = {"DATA_LOSS"}
REFRESH_REASONS = {"NOT_PARTITION_OWNER", "UNKNOWN_TOPIC_OR_PARTITION", "SERVER_UNAVAILABLE"}
# Answers that prove the attempt they answer appended nothing (refused before any write).
# Any other failure of an attempt (no answer, a timeout, a leadership lost while the
# write waited for its copies, a closing partition) leaves it possibly written.
REFUSED_UNWRITTEN = DEFINITELY_NOT_WRITTEN | SEQUENCE_REFUSALS | {
    "PARTITION_LOADING", "UNKNOWN_TOPIC_OR_PARTITION", "CONCURRENT_TRANSACTIONS",
    "COORDINATOR_LOADING", "NOT_COORDINATOR"}


@dataclass(frozen=True)
class RecordMetadata:
    """Where a record went. `offset` is -1 when it is not known: a record of a one-call
    transaction whose commit was answered by a retry (it committed; the answer does not
    say where)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int = -1


# Guards every _Outcome's settling against its waiters and callbacks (held for a few
# attribute reads and writes; an outcome needs no lock of its own).
_SETTLING = threading.Lock()


class _Outcome:
    """What happened to one batch, shared by the futures of its records (one outcome per
    batch, not per record: a Future per record cost a third of the producer's CPU). Its
    threading.Event is made only when a thread waits before it settles (most outcomes
    settle first). A callback added as it settles runs once, on one side or the other:
    both look at `settled` under _SETTLING (before, one added between the settling's
    event and its taking of the callbacks was lost)."""

    __slots__ = ("topic", "partition", "base_offset", "timestamp_ms", "error", "settled",
                 "_event", "_callbacks", "on_wait")

    def __init__(self, topic: str, partition: int, on_wait=None):
        self.topic, self.partition = topic, partition
        self.base_offset = self.timestamp_ms = -1
        self.error: BaseException | None = None
        self.settled = False
        self._event: threading.Event | None = None
        self._callbacks: list | None = None
        # Records kept by a one-call transaction: waiting for them switches it to
        # ordinary sends (else they would be written only by its commit).
        self.on_wait = on_wait

    def settle(self, base_offset: int, timestamp_ms: int, error: BaseException | None) -> None:
        self.base_offset, self.timestamp_ms, self.error = base_offset, timestamp_ms, error
        with _SETTLING:
            self.settled = True
            event, callbacks = self._event, self._callbacks
            self._callbacks = None
        if event is not None:
            event.set()
        for callback in callbacks or ():
            callback()

    def wait(self, timeout: float | None) -> None:
        if self.settled:
            return
        if self.on_wait is not None:
            self.on_wait()
        with _SETTLING:
            if self.settled:
                return
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        if not event.wait(timeout):
            raise TimeoutError(f"record to {self.topic}-{self.partition} not acknowledged "
                               f"within {timeout} s")

    def add_callback(self, callback) -> None:
        """callback() once settled: now if it is, else on the thread that settles it."""
        with _SETTLING:
            if not self.settled:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        callback()


class RecordFuture:
    """The outcome of one `send()`: `result(timeout)` is RecordMetadata or raises."""

    __slots__ = ("_outcome", "_index")

    def __init__(self, outcome: _Outcome, index: int):
        self._outcome, self._index = outcome, index

    def done(self) -> bool:
        return self._outcome.settled

    def result(self, timeout: float | None = None) -> RecordMetadata:
        outcome = self._outcome
        outcome.wait(timeout)
        if outcome.error is not None:
            raise outcome.error
        # A base offset of -1 is unknown (a one-call commit answered by its retry, which
        # does not say where the batches went): each record's offset is -1 too, not -1
        # plus its index (0, 1, 2, ... read as real offsets).
        base = outcome.base_offset
        return RecordMetadata(outcome.topic, outcome.partition,
                              base + self._index if base >= 0 else -1, outcome.timestamp_ms)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._outcome.wait(timeout)
        return self._outcome.error

    def add_done_callback(self, fn) -> None:
        """fn(future) runs once the outcome is known (on the producer's thread)."""
        self._outcome.add_callback(lambda: fn(self))


@dataclass(frozen=True)
class BatchMetadata:
    """Where the records of one send_batch() went: (partition, first offset, count) per
    batch, in the order the batches were made (input order within a partition)."""

    topic: str
    ranges: tuple[tuple[int, int, int], ...]

    @property
    def count(self) -> int:
        return sum(count for _, _, count in self.ranges)


class BatchFuture:
    """The outcome of one `send_batch()`: `result(timeout)` is BatchMetadata once every
    batch is acknowledged, or raises the first failure."""

    __slots__ = ("_topic", "_parts")

    def __init__(self, topic: str, parts: list[tuple[RecordFuture, int]]):
        self._topic, self._parts = topic, parts

    def done(self) -> bool:
        return all(future.done() for future, _ in self._parts)

    def result(self, timeout: float | None = None) -> BatchMetadata:
        deadline = None if timeout is None else time.monotonic() + timeout
        ranges: list[list[int]] = []
        for future, count in self._parts:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            meta = future.result(remaining)
            last = ranges[-1] if ranges else None
            if last and last[0] == meta.partition and last[1] + last[2] == meta.offset:
                last[2] += count  # kept records of a one-call transaction, one by one
            else:
                ranges.append([meta.partition, meta.offset, count])
        return BatchMetadata(self._topic, tuple(tuple(r) for r in ranges))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The first batch's failure, or None once every batch is acknowledged."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for future, _ in self._parts:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            error = future.exception(remaining)
            if error is not None:
                return error
        return None

    def add_done_callback(self, fn) -> None:
        """fn(future) runs once every batch's outcome is known (on the producer's thread,
        or at once if they are)."""
        remaining = [len(self._parts)]
        lock = threading.Lock()
        if not self._parts:
            fn(self)
            return

        def one_done(_future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                fn(self)
        for future, _ in self._parts:
            future.add_done_callback(one_done)


@dataclass(eq=False)
class _Batch:
    topic: str
    partition: int
    records: list[Record]
    outcome: _Outcome
    created: float
    size: int = 0
    base_sequence: int = -1
    payload: bytes = b""
    attempts: int = 0
    not_before: float = 0.0
    deadline: float = 0.0
    last_error: errors.AtomlogClientError | None = None
    done: bool = False
    txn: object = None  # spark_client.transactions.Transaction
    # Sent while an earlier batch of the partition was unanswered: the server may have
    # taken it first (requests can overtake each other), so a sequence refusal of it
    # may only mean "too early".
    sent_behind: bool = False
    # A resend in flight: nothing later of its partition is sent until it is answered
    # (_may_send).
    alone: bool = False
    producer_id: int | None = None  # the identity it was encoded under
    # An attempt of it failed without proof that nothing was appended (REFUSED_UNWRITTEN):
    # it may be written, so its sequence numbers are never handed to other records.
    maybe_written: bool = False


@dataclass(eq=False)
class _PartitionState:
    open: list[Record] = field(default_factory=list)
    open_outcome: _Outcome | None = None
    open_txn: object = None  # the transaction of the open batch (None: plain records)
    open_bytes: int = 0
    opened_at: float = 0.0
    ready: collections.deque = field(default_factory=collections.deque)  # sealed, unsent
    in_flight: list[_Batch] = field(default_factory=list)  # sent, unanswered, seq order
    # Batches sent, in order, from the oldest one not finished: the servers' 5-batch
    # window of a producer counts from it (acknowledged batches behind it count).
    window: collections.deque = field(default_factory=collections.deque)
    next_sequence: int = 0
    producer_id: int | None = None  # per partition: rotated when an outcome is unknown
    epoch: int = 0


class Producer:
    """Thread-safe. Use as a context manager, or call close()."""

    def __init__(self, client, *, idempotent: bool = True, linger_ms: float = 5.0,
                 batch_max_bytes: int = 256 << 10, max_in_flight: int = 5,
                 delivery_timeout_s: float = 120.0, request_timeout_s: float = 30.0,
                 max_buffered_bytes: int = 64 << 20, max_block_s: float = 60.0,
                 compression: str | None = None, partitioner: str = "sticky",
                 transactional_id: str | None = None, transaction_timeout_s: float = 60.0):
        if not 1 <= max_in_flight <= 5:
            raise ValueError("max_in_flight must be 1..5 (servers deduplicate the last 5 batches)")
        if batch_max_bytes < 1024:
            raise ValueError("batch_max_bytes must be at least 1024")
        if partitioner not in ("sticky", "round_robin"):
            raise ValueError("partitioner must be 'sticky' or 'round_robin'")
        self.client = client
        self.idempotent = idempotent
        self.linger_s = linger_ms / 1000
        self.batch_max_bytes = batch_max_bytes
        self.max_in_flight = max_in_flight
        self.delivery_timeout_s = delivery_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_buffered_bytes = max_buffered_bytes
        self.max_block_s = max_block_s
        self.compression = {None: Compression.NONE, "none": Compression.NONE,
                            "zstd": Compression.ZSTD, "lz4": Compression.LZ4}[compression]
        self.partitioner = partitioner
        self.backoff = Backoff()
        self.transactional_id = transactional_id
        self.transaction_timeout_s = transaction_timeout_s
        self._needs_reinit = False
        self._fenced = False  # a newer session of the transactional id fenced this one
        self._session = None  # coordinator_pb2.TransactionalSession
        self._session_tc = 0
        if transactional_id is not None:
            if not idempotent:
                raise ValueError("a transactional producer is idempotent")
            self._init_session()
        else:
            self._producer_id, self._epoch = (client.allocate_producer_id() if idempotent
                                              else (0, 0))
        self._lock = threading.Condition()
        self._partitions: dict[tuple[str, int], _PartitionState] = {}
        self._sticky: dict[str, int] = {}
        # Each producer starts at a random partition: many short-lived producers (Spark
        # tasks) would otherwise all put their first keyless batch in partition 0.
        self._round_robin = itertools.count(random.randrange(1 << 16))
        self._buffered_bytes = 0
        self._unfinished = 0
        self._completions: queue.SimpleQueue = queue.SimpleQueue()
        # One-call transactions holding records of this producer, in the order of their
        # first record (flush switches them in that order: send order per partition).
        self._kept_by = KeptBy()
        # The transaction whose record send() kept last, remembered by _kept_by already
        # while _kept_by.drops has not moved since (the next record of the same
        # transaction skips remember()). A strong reference: dropped when another
        # transaction keeps a record.
        self._kept_last = None
        self._kept_drops = 0
        self._closed = False
        self._sender = threading.Thread(target=self._run, name="atomlog-producer", daemon=True)
        self._sender.start()

    # ------------------------------------------------------------------ sessions
    def _init_session(self) -> None:
        """InitProducerId for the transactional id, on its TC partition: a fresh epoch
        that fences any older session (aborting its open transaction)."""
        from coordinator.records import tc_partition_for
        from spark_client.transactions import Coordinators, S

        coordinators = Coordinators(self.client)
        self._session_tc = tc_partition_for(self.transactional_id,
                                            coordinators.tc_partition_count())
        current = self._session
        reply = coordinators.call(self._session_tc, "InitProducerId", S.InitProducerIdRequest(
            transactional_id=self.transactional_id,
            transaction_timeout_ms=int(self.transaction_timeout_s * 1000),
            producer_id=current.producer_id if current else 0,
            producer_epoch=current.producer_epoch if current else 0),
            time.monotonic() + self.client.request_timeout_s)
        self._producer_id, self._epoch = reply.producer_id, reply.producer_epoch
        self._session = S.TransactionalSession(transactional_id=self.transactional_id,
                                               producer_id=reply.producer_id,
                                               producer_epoch=reply.producer_epoch)

    def begin_transaction(self, timeout_s: float | None = None):
        """A transaction of this producer's session (transactional_id producers only)."""
        from spark_client.transactions import Transaction

        if self._session is None:
            raise ValueError("begin_transaction() needs a producer made with transactional_id=; "
                             "otherwise use client.begin_transaction()")
        if self._fenced:
            raise errors.ProducerFenced(
                f"transactional id {self.transactional_id!r} was taken over by a newer session "
                f"(producer id {self._producer_id} epoch {self._epoch} is fenced); make a new "
                "producer")
        self._reinit_if_needed()
        return Transaction(self.client, timeout_s or self.transaction_timeout_s,
                           session=self._session, tc_partition=self._session_tc, lazy=True,
                           on_fenced=self._note_fenced)

    def _reinit_if_needed(self) -> None:
        """An earlier write's outcome is unknown, or a partition's sequences broke: a new
        epoch of the same session makes every partition start its sequences afresh
        (KIP-360's epoch bump). At the next begin_transaction(), or the next send outside
        a transaction (until 2026-12-06 such sends went on with the broken sequences, each
        refused, until a begin_transaction())."""
        if not self._needs_reinit:
            return
        self.flush()
        self._init_session()
        with self._lock:
            for state in self._partitions.values():
                state.producer_id, state.epoch, state.next_sequence = None, 0, 0
            self._needs_reinit = False

    def _note_fenced(self) -> None:
        self._fenced = True

    @property
    def producer_id(self) -> int:
        return self._producer_id

    @property
    def epoch(self) -> int:
        return self._epoch

    # ------------------------------------------------------------------ user API
    def _check_sendable(self, txn, accepting: bool = True) -> None:
        """Refuse a send to a closed producer, or in a transaction it may not write to
        (`accepting`: that it still takes sends too; a one-call transaction's
        keep_record checks that itself); before a send outside a transaction,
        re-initialize the session if it needs it."""
        if self._closed:
            raise RuntimeError("producer is closed")
        if txn is None:
            self._reinit_if_needed()
        if txn is not None:
            if not self.idempotent:
                raise ValueError("transactional sends need an idempotent producer")
            if txn.session is not None and self._session is not None and \
                    txn.session.producer_epoch != self._session.producer_epoch:
                raise errors.ProducerFenced("the transaction belongs to an older session of "
                                            "this producer")
            if accepting:
                txn._check_accepting()

    def send(self, topic: str, value: bytes | str | None, key: bytes | str | None = None,
             partition: int | None = None, headers: dict | list | None = None,
             timestamp_ms: int | None = None, txn=None) -> RecordFuture:
        """Queue one record; the future's result is RecordMetadata(topic, partition, offset).
        With txn, the record is part of that transaction (visible to read_committed
        readers only once it commits; commit() waits for it)."""
        one_call = txn is not None and txn._kept is not None  # (Transaction.one_call)
        # (A one-call transaction's keep_record checks that it still takes sends; one
        # that does not is refused here first, as before anything else is looked at.
        # _check_sendable is called only when it has something to check: a one-call
        # transaction's record, the common case, skips the call.)
        if not one_call or self._closed or txn.session is not None or not self.idempotent \
                or txn._ended is not None or txn._committing:
            self._check_sendable(txn, accepting=not one_call or txn._ended is not None
                                 or txn._committing)
        if key is not None and type(key) is not bytes:
            key = _bytes(key)
        if value is not None and type(value) is not bytes:
            value = _bytes(value)
        headers = _headers(headers) if headers else ()
        if timestamp_ms is None:
            timestamp_ms = time.time_ns() // 1_000_000
        # Record(key, value, headers, timestamp_ms) without its Python-level __new__.
        record = _new_tuple(Record, (key, value, headers, timestamp_ms, None))
        # _record_size, inline for the common record without headers.
        size = (_record_size(key, value, headers) if headers else
                ROW_OVERHEAD + (len(key) if key else 0) + (len(value) if value else 0))
        if size + 128 > self.batch_max_bytes:
            raise errors.BatchTooLarge(f"record of about {size} bytes does not fit a batch of "
                                       f"{self.batch_max_bytes} bytes (batch_max_bytes)")
        count = len(self.client.metadata.partitions(topic))
        if partition is None:
            if key is not None:
                partition = crc32c.crc32c(key) % count  # documented: stable across languages
            elif self.partitioner == "round_robin":
                partition = next(self._round_robin) % count
        elif not 0 <= partition < count:
            raise errors.UnknownTopicOrPartition(
                f"topic {topic!r} has {count} partitions; no partition {partition}")
        if one_call:
            # Kept by the transaction for its one-call commit (not under this producer's
            # lock: a transaction that switches hands records back through _adopt).
            if partition is None:
                partition = self._sticky.get(topic)
                if partition is None or partition >= count:
                    partition = self._sticky[topic] = next(self._round_robin) % count
            future = txn.keep_record(self, topic, partition, size, record)
            if future is not None:
                kept_by = self._kept_by
                if self._kept_last is not txn or self._kept_drops != kept_by.drops:
                    kept_by.remember(txn)  # (else the KeptBy has it already)
                    self._kept_last, self._kept_drops = txn, kept_by.drops
                return future
            txn._check_accepting()  # (it switched: sent as any transaction's record)
        with self._lock:
            self._wait_for_room(size)
            if partition is None:  # sticky: keyless records fill one partition's batch
                partition = self._sticky.get(topic)
                if partition is None or partition >= count:
                    partition = self._sticky[topic] = next(self._round_robin) % count
            state = self._partitions.get((topic, partition))
            if state is None:
                state = self._partitions[(topic, partition)] = _PartitionState()
            full = False  # a batch of batch_max_bytes sealed (then the GIL is offered)
            if state.open and (state.open_txn is not txn
                               or state.open_bytes + size > self.batch_max_bytes):
                full = state.open_bytes + size > self.batch_max_bytes
                self._seal(topic, partition, state)
            if not state.open:
                state.opened_at = time.monotonic()
                state.open_outcome = _Outcome(topic, partition)
                state.open_txn = txn
                if txn is not None:
                    txn.track(RecordFuture(state.open_outcome, 0))
                    txn.add_flusher(self._flush_txn)
            future = RecordFuture(state.open_outcome, len(state.open))
            state.open.append(record)
            state.open_bytes += size
            self._buffered_bytes += size
            self._unfinished += 1
            if state.open_bytes >= self.batch_max_bytes or self.linger_s == 0:
                full = full or state.open_bytes >= self.batch_max_bytes
                self._seal(topic, partition, state)
                self._lock.notify_all()
            elif len(state.open) == 1:
                # A new lingering batch: the sender thread may be asleep for up to a
                # second with nothing to wait for; it must wake at this batch's linger end.
                self._lock.notify_all()
        if full:
            # Offer the GIL to the sender thread and the gRPC callbacks now. A caller
            # sending flat out otherwise keeps it for the interpreter's switch interval
            # (5 ms) at a time, and every batch's send and answer waits for it: measured
            # in bench/transactions.py's stream, a batch's round trip fell from 10-13 ms
            # to 5-7 ms with this (docs/benchmarks.md, 2026-11-29). One system call per
            # full batch.
            time.sleep(0)
        return future

    def send_batch(self, topic: str, values, keys=None, headers=None, partition=None,
                   txn=None, timestamps_ms=None) -> BatchFuture:
        """Queue many records at once, as columns: no Python loop over them (except the
        partitioner's CRC32C of keys). `values` (and `keys`) are Python sequences of
        bytes/str/None, NumPy arrays or Arrow binary/string arrays; or `values` is an
        Arrow RecordBatch/Table with a `value` column and optional `key`, `headers`,
        `timestamp` and `partition` columns. `headers`: one entry per record (None, a
        dict or (str, bytes) pairs) or an Arrow list/map array; `timestamps_ms`: Unix ms
        per record (default now). `partition`: None (by key as send() does; keyless
        records of one call go to one partition), one int, or one per record.

        Records are split by partition (in input order within each), then into batches
        of at most batch_max_bytes; the one future's result() is a BatchMetadata with the
        offsets each partition got, once every batch is acknowledged. With `txn`, all of
        them belong to that transaction. Raises ValueError/IndexError for bad input,
        before anything is queued."""
        self._check_sendable(txn)
        count = len(self.client.metadata.partitions(topic))
        with self._lock:
            sticky = self._sticky.get(topic)
            if sticky is None or sticky >= count:
                sticky = next(self._round_robin) % count
        try:
            chunks = prepare(values, keys=keys, headers=headers, timestamps_ms=timestamps_ms,
                             partition=partition, partition_count=count, sticky=sticky,
                             now_ms=time.time_ns() // 1_000_000,
                             batch_max_bytes=self.batch_max_bytes)
        except IndexError as error:
            raise errors.UnknownTopicOrPartition(
                f"topic {topic!r} has {count} partitions: {error}") from None
        parts: list = []
        if txn is not None and txn.one_call:
            chunks = self._keep_in(txn, topic, chunks, parts)
        if chunks:
            futures = self._queue_chunks(topic, chunks, txn)
            parts += zip(futures, map(len, chunks))
        with self._lock:
            if self._sticky.get(topic) == sticky:
                self._sticky.pop(topic)  # the next keyless records move on
        return BatchFuture(topic, parts)

    def _keep_in(self, txn, topic: str, chunks: list[Chunk], parts: list) -> list[Chunk]:
        """Hand the chunks of a send_batch() to a one-call transaction while it keeps
        them (whole, as columns; futures into `parts`); what it no longer keeps (it
        switched to ordinary sends) comes back to queue, in order. A batch larger than
        the one-call bound switches the transaction before anything is kept."""
        if sum(chunk.size for chunk in chunks) > txn.one_call_room():
            txn._switch()
            return chunks
        rest: list[Chunk] = []
        for chunk in chunks:
            if not rest:
                future = txn.keep_chunk(self, topic, chunk)
                if future is not None:
                    parts.append((future, len(chunk)))
                    continue
            rest.append(chunk)  # it switched: this and the rest go out as usual, in order
        if parts:
            self._kept_by.remember(txn)
        return rest

    def _queue_chunks(self, topic: str, chunks: list[Chunk], txn) -> list[RecordFuture]:
        """The chunks of a send_batch(), each as a sealed batch of its partition, behind what
        the partition already holds, under one hold of the lock (one wake-up of the sender).
        Their records blocks are built first, on the caller's thread (the costly part of
        encoding, outside the producer's lock): the sender thread only adds the header
        with the sequence numbers."""
        for chunk in chunks:
            chunk.block = columns_block(chunk.keys, chunk.values, chunk.headers,
                                        chunk.timestamp_deltas, self.compression)
        futures = []
        with self._lock:
            for chunk in chunks:
                if futures and self._buffered_bytes + chunk.size > self.max_buffered_bytes:
                    self._lock.notify_all()  # what is queued must go to free room
                self._wait_for_room(chunk.size)
                state = self._partitions.get((topic, chunk.partition))
                if state is None:
                    state = self._partitions[(topic, chunk.partition)] = _PartitionState()
                self._seal(topic, chunk.partition, state)
                now = time.monotonic()
                outcome = _Outcome(topic, chunk.partition)
                batch = _Batch(topic, chunk.partition, chunk, outcome, now, chunk.size, txn=txn)
                batch.deadline = now + self.delivery_timeout_s
                state.ready.append(batch)
                self._buffered_bytes += chunk.size
                self._unfinished += len(chunk)
                future = RecordFuture(outcome, 0)
                if txn is not None:
                    txn.track(future)
                    txn.add_flusher(self._flush_txn)
                futures.append(future)
            self._lock.notify_all()
        return futures

    def _wait_for_room(self, size: int) -> None:
        """Block (lock held) until `size` more bytes fit the buffer, or max_block_s passes
        (DeliveryTimeout). An empty buffer takes anything (a batch never waits forever)."""
        deadline = time.monotonic() + self.max_block_s
        while self._buffered_bytes and self._buffered_bytes + size > self.max_buffered_bytes:
            if self._closed:
                raise RuntimeError("producer is closed")
            if not self._lock.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise errors.DeliveryTimeout(
                    f"buffer of {self.max_buffered_bytes} bytes stayed full for "
                    f"{self.max_block_s} s (max_buffered_bytes)")

    def _adopt(self, topic: str, partition: int, records: list[Record], size: int,
               outcome: _Outcome, txn) -> None:
        """A one-call transaction switched to ordinary sends: queue what it kept for this
        partition as one sealed batch of `txn`, behind the partition's sealed batches and
        ahead of anything sent to it from now on."""
        with self._lock:
            state = self._partitions.get((topic, partition))
            if state is None:
                state = self._partitions[(topic, partition)] = _PartitionState()
            self._seal(topic, partition, state)
            now = time.monotonic()
            batch = _Batch(topic, partition, records, outcome, now, size, txn=txn)
            batch.deadline = now + self.delivery_timeout_s
            state.ready.append(batch)
            self._buffered_bytes += size
            self._unfinished += len(records)
            txn.track(RecordFuture(outcome, 0))
            txn.add_flusher(self._flush_txn)
            self._lock.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Send everything now and wait until every record sent so far is acknowledged
        (or failed: failures are in the futures). A one-call transaction holding records
        of this producer switches to ordinary sends for it (its records are written now,
        as flush promises; commit() then ends it with EndTxn)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._kept_by.switch_all()
        self._seal_open(lambda state: True)
        with self._lock:
            while self._unfinished:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self._unfinished} records still unacknowledged")
                self._lock.wait(timeout=remaining if remaining is not None else 1.0)

    def _flush_txn(self, txn) -> None:
        """Seal the open batches of a transaction now (commit() is about to wait)."""
        self._seal_open(lambda state: state.open_txn is txn)

    def _seal_open(self, which) -> None:
        """Seal the open batches of the partitions `which(state)` picks, and wake the sender."""
        with self._lock:
            for (topic, partition), state in self._partitions.items():
                if state.open and which(state):
                    self._seal(topic, partition, state)
            self._lock.notify_all()

    def close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        try:
            self.flush(timeout)
        finally:
            with self._lock:
                self._closed = True
                self._lock.notify_all()
            self._sender.join(timeout=5)

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ batching
    def _seal(self, topic: str, partition: int, state: _PartitionState) -> None:
        """Close the open batch of a partition (lock held)."""
        if not state.open:
            return
        batch = _Batch(topic, partition, state.open, state.open_outcome, state.opened_at,
                       state.open_bytes, txn=state.open_txn)
        state.open_outcome = state.open_txn = None
        batch.deadline = state.opened_at + self.delivery_timeout_s
        state.open, state.open_bytes = [], 0
        state.ready.append(batch)
        if self._sticky.get(topic) == partition:
            self._sticky.pop(topic)  # the next keyless record moves on

    def _encode(self, batch: _Batch, state: _PartitionState) -> None:
        records = batch.records
        if self.idempotent:
            if state.producer_id is None or state.producer_id == NEEDS_ID \
                    or state.next_sequence + len(records) > SEQUENCE_LIMIT:
                # A fresh identity for this partition: sequences start again at 0. (Not
                # to be had: AtomlogClientError, and this batch fails.)
                state.producer_id, state.epoch = (
                    (self._producer_id, self._epoch) if state.producer_id is None
                    else self.client.allocate_producer_id())
                state.next_sequence = 0
            batch.base_sequence = state.next_sequence
            batch.producer_id = state.producer_id
            state.next_sequence += len(records)
        fields = dict(producer_id=state.producer_id or 0, producer_epoch=state.epoch,
                      base_sequence=batch.base_sequence if self.idempotent else -1,
                      compression=self.compression,
                      txn=batch.txn.key if batch.txn is not None else None)
        if isinstance(records, Chunk):  # send_batch(): the block its caller built
            # Header and block stay two pieces, joined only into the request (one copy
            # of the block fewer).
            batch.payload = (frame_header(records.block, count=len(records),
                                          base_timestamp_ms=records.base_timestamp_ms,
                                          max_timestamp_ms=records.max_timestamp_ms, **fields),
                             records.block)
        else:
            batch.payload = encode_records(records, **fields)

    # ------------------------------------------------------------------ sender thread
    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    self._drain_completions()
                    now = time.monotonic()
                    self._seal_lingering(now)
                    sendable = self._sendable(now)
                    if sendable or (self._closed and not self._unfinished):
                        break
                    self._lock.wait(timeout=self._next_wake(now))
                if self._closed and not self._unfinished and not sendable:
                    return
            self._send(sendable)

    def _seal_lingering(self, now: float) -> None:
        for (topic, partition), state in self._partitions.items():
            if state.open and now - state.opened_at >= self.linger_s:
                self._seal(topic, partition, state)

    def _next_wake(self, now: float) -> float:
        wake = 1.0
        for state in self._partitions.values():
            if state.open:
                wake = min(wake, state.opened_at + self.linger_s - now)
            if state.ready and _may_send(state, self.max_in_flight):
                wake = min(wake, state.ready[0].not_before - now)
        return max(wake, 0.0005)

    def _sendable(self, now: float) -> list[_Batch]:
        """The batches to send now, encoded — except a transactional batch whose partition
        is not registered with its transaction yet, and every later batch of that
        partition: the transaction may not be open yet (its id goes into the batch), so
        they are encoded after _register, in the same order (_encode_deferred)."""
        out = []
        for key, state in self._partitions.items():
            deferred = False
            while state.ready and state.ready[0].not_before <= now \
                    and _may_send(state, self.max_in_flight):
                batch = state.ready.popleft()
                batch.alone = batch.attempts > 0
                if not batch.payload:
                    deferred = deferred or (batch.txn is not None
                                            and not batch.txn.registered(key))
                    if not deferred:
                        try:
                            self._encode(batch, state)
                        except errors.AtomlogClientError as error:
                            self._fail(batch, error)
                            continue
                if not batch.attempts and batch not in state.window:
                    state.window.append(batch)  # (a batch whose registration failed: in)
                batch.sent_behind = bool(state.in_flight)
                state.in_flight.append(batch)
                out.append(batch)
        return out

    def _encode_deferred(self, batches: list[_Batch]) -> list[_Batch]:
        """Encode the batches _sendable left for after registration; the ones that cannot
        be encoded fail and are left out."""
        if all(batch.payload for batch in batches):
            return batches
        kept = []
        with self._lock:
            for batch in batches:
                if not batch.payload:
                    state = self._partitions[(batch.topic, batch.partition)]
                    try:
                        self._encode(batch, state)
                    except errors.AtomlogClientError as error:
                        _discard(state, batch)
                        self._fail(batch, error)
                        continue
                kept.append(batch)
        return kept

    def _register(self, batches: list[_Batch]) -> list[_Batch]:
        """Register with their transactions the partitions that transactional batches
        are about to reach for the first time (one call per transaction); the batches
        whose registration failed get the error and are left out."""
        wanted: dict[object, set[tuple[str, int]]] = {}
        for batch in batches:
            if batch.txn is not None and not batch.txn.registered((batch.topic, batch.partition)):
                wanted.setdefault(batch.txn, set()).add((batch.topic, batch.partition))
        failed: dict[object, Exception] = {}
        for txn, partitions in wanted.items():
            try:
                txn.register_partitions(sorted(partitions))
            except errors.AtomlogClientError as error:
                failed[txn] = error
        if not failed:
            return batches
        kept = []
        for batch in batches:
            if batch.txn in failed:
                self._completions.put((batch, failed[batch.txn], None, batch.attempts))
            else:
                kept.append(batch)
        return kept

    def _send(self, batches: list[_Batch]) -> None:
        batches = self._encode_deferred(self._register(batches))
        by_address: dict[str, list[_Batch]] = {}
        for batch in batches:
            batch.attempts += 1
            try:
                address = self.client.metadata.route(batch.topic, batch.partition).address
            except errors.AtomlogClientError as error:
                self._completions.put((batch, error, None, batch.attempts))
                continue
            if not address:
                self._completions.put((batch, errors.error_for(
                    "SERVER_UNAVAILABLE", f"owner of {batch.topic}-{batch.partition} is down"),
                    None, batch.attempts))
                continue
            by_address.setdefault(address, []).append(batch)
        for address, batches in by_address.items():
            pipeline = self.client.links.pipeline(
                address, self.client.metadata.partition_links.get(address, ""))
            for group in _requests(batches, MAX_REQUEST_BYTES):
                request = _produce_request(group)
                call = None
                if pipeline is not None:
                    try:
                        call = pipeline.start("Produce", request, self.request_timeout_s)
                    except link.LinkUnavailable:
                        pass  # this call, and the next ones for a while, over gRPC
                if call is None:
                    call = self.client.channels.stub(address, _RawProduce).produce.future(
                        request, timeout=self.request_timeout_s)
                attempts = [b.attempts for b in group]
                call.add_done_callback(
                    lambda f, group=group, attempts=attempts: self._on_reply(group, attempts, f))
        if not by_address:
            with self._lock:
                self._lock.notify_all()

    def _on_reply(self, group: list[_Batch], attempts: list[int], call) -> None:
        """Queue the answer of each batch of a Produce call, with the attempt it answers."""
        try:
            reply = call.result()
            if len(reply.results) != len(group):
                raise errors.error_for(
                    "INTERNAL", f"the server answered {len(reply.results)} results for "
                    f"{len(group)} batches")
            for batch, attempt, result in zip(group, attempts, reply.results, strict=True):
                if result.error.reason:
                    self._completions.put((batch, errors.error_for(
                        result.error.reason, result.error.message, dict(result.error.metadata)),
                        None, attempt))
                else:
                    self._completions.put((batch, None, result, attempt))
        except (grpc.RpcError, errors.AtomlogClientError) as failure:
            error = errors.from_grpc(failure) if isinstance(failure, grpc.RpcError) else failure
            for batch, attempt in zip(group, attempts, strict=True):
                self._completions.put((batch, error, None, attempt))
        with self._lock:
            self._lock.notify_all()

    def _drain_completions(self) -> None:
        """Apply replies, in the sender thread, with the lock held."""
        refresh: set[str] = set()
        while True:
            try:
                batch, error, result, attempt = self._completions.get_nowait()
            except queue.Empty:
                break
            if batch.done:
                continue  # already failed for good; a late reply changes nothing
            if error is not None and attempt != batch.attempts:
                # The failure of an earlier attempt of a batch sent again since: the
                # latest attempt answers for it (taken as this one's, it could fail a
                # batch whose resend was written). A late success is news: kept.
                continue
            state = self._partitions[(batch.topic, batch.partition)]
            if error is None:
                _discard(state, batch)
                self._succeed(batch, result)
                continue
            if error.reason in REFRESH_REASONS:
                refresh.add(batch.topic)
            self._handle_failure(batch, state, error)
        for topic in refresh:
            self.client.metadata.invalidate(topic)

    def _handle_failure(self, batch: _Batch, state: _PartitionState,
                        error: errors.AtomlogClientError) -> None:
        if batch not in state.in_flight:
            return  # rewound by an earlier failure: it is queued to be sent again
        now = time.monotonic()
        index = state.in_flight.index(batch)
        if error.reason not in REFUSED_UNWRITTEN:
            batch.maybe_written = True
        # A sequence refusal of a batch sent behind an unanswered one: that one may have
        # reached the server after it (it sets the sequence, or for a producer new to the
        # partition creates the state, that this batch needs), so resend it. Resent with
        # nothing ahead, a refusal is final.
        retriable = error.reason in RETRIABLE_ITEM_REASONS or (
            error.reason in SEQUENCE_REFUSALS and (index > 0 or batch.sent_behind))
        if retriable and now < batch.deadline:
            batch.last_error = error
            overtook = error.reason in SEQUENCE_REFUSALS and (index > 0 or batch.sent_behind)
            # Resend this batch and every later in-flight one, in sequence order, each
            # alone (_may_send): after a backoff, or at once when it only overtook an
            # earlier batch.
            later = state.in_flight[index:]
            del state.in_flight[index:]
            for b in later[1:]:  # sent, and their answers no longer awaited
                b.maybe_written = True
            for b in reversed(later):
                b.not_before = now if overtook else now + self.backoff.delay(b.attempts)
                state.ready.appendleft(b)
            return
        if not batch.payload:  # its registration failed: never encoded, never sent
            _discard(state, batch)
            self._fail(batch, error)
            return
        if error.reason == "UNKNOWN_PRODUCER_ID" and now < batch.deadline and \
                self._reset_identity(batch, state):
            return
        if retriable:  # out of time: the outcome of this batch is unknown
            timeout = errors.DeliveryTimeout(
                f"{len(batch.records)} records to {batch.topic}-{batch.partition} not "
                f"acknowledged within {self.delivery_timeout_s} s; they may or may not have "
                f"been written. Last error: {error}")
            timeout.__cause__ = error
            self._abandon_partition(state, batch, timeout)
        elif error.reason in DEFINITELY_NOT_WRITTEN and not (
                batch.maybe_written and error.reason in UNCHECKED_REFUSALS):
            _discard(state, batch)
            self._fail(batch, error)
            self._resequence_after(batch, state)
        elif error.reason in DEFINITELY_NOT_WRITTEN:
            # The refusal proves only that this attempt wrote nothing (UNCHECKED_REFUSALS).
            # An earlier one failed unanswered and may have been written: its sequence
            # numbers must never be handed to other records, or a later batch would be
            # answered as a duplicate of these and never written (found by the chaos
            # harness: log workload, seed 2924, misplace).
            self._abandon_partition(state, batch, errors.error_for(
                error.reason, f"{error.message}; an earlier attempt of these "
                f"{len(batch.records)} records got no answer, so they may or may not have "
                "been written", error.metadata))
        else:  # the server lost or rejects this producer's state: start a fresh identity
            self._abandon_partition(state, batch, error)

    def _abandon_partition(self, state: _PartitionState, batch: _Batch,
                           error: errors.AtomlogClientError) -> None:
        """Fail `batch` and every encoded batch behind it, and give the partition a new
        producer id, so nothing already sent can be confused with what is sent next."""
        doomed = [b for b in [*state.in_flight, *state.ready]
                  if b is batch or (b.payload and b.base_sequence > batch.base_sequence)]
        for b in doomed:
            _discard(state, b)
            self._fail(b, error)
        if self._session is not None:
            # A session keeps its producer id: the next begin_transaction() bumps the epoch.
            self._needs_reinit = True
            state.next_sequence = 0 if state.producer_id is None else state.next_sequence
            for b in state.ready:
                b.payload = b""
            return
        self._new_identity(state)
        for b in state.ready:
            b.payload = b""

    def _new_identity(self, state: _PartitionState) -> None:
        """A fresh producer id for the partition, its sequences from 0. When none can be
        had now (ZooKeeper or every coordinator unreachable), the partition's next batch
        asks for one as it is encoded, and fails if it still cannot: this thread must
        not end on it (found by the chaos harness: seed 2754, log workload, a producer's
        sender thread ended on ZOOKEEPER_UNAVAILABLE here and every later send hung).
        Until then NEEDS_ID keeps anything from going while batches of the old id are
        unanswered (_may_send)."""
        try:
            state.producer_id, state.epoch = self.client.allocate_producer_id()
        except errors.AtomlogClientError:
            state.producer_id = NEEDS_ID
        state.next_sequence = 0

    def _reset_identity(self, refused: _Batch, state: _PartitionState) -> bool:
        """UNKNOWN_PRODUCER_ID for the oldest unanswered batch of a partition: it forgot
        this producer (idle past its expiry, or a leader that rebuilt its state from a log
        whose start had passed the producer's last batch). When no attempt of that batch
        or of any batch after it may have been written (every attempt refused unwritten,
        and no producer session or transaction binds them to this id), they are sent
        again under a new producer id from sequence 0 (Kafka's KIP-360 reset), instead of
        failing. Else False: they fail as before (the records may be written)."""
        later = [b for b in [*state.in_flight, *state.ready]
                 if b.payload and b.base_sequence > refused.base_sequence]
        batches = [refused, *later]
        if self._session is not None or any(b.txn is not None or b.maybe_written
                                            for b in batches):
            return False
        for b in batches:
            _discard(state, b)
            b.payload, b.alone, b.sent_behind = b"", False, False
        self._new_identity(state)  # (a stale attempt under the old id is refused there)
        for b in reversed(sorted(batches, key=lambda b: b.base_sequence)):
            state.ready.appendleft(b)
        return True

    def _resequence_after(self, failed: _Batch, state: _PartitionState) -> None:
        """Nothing of `failed` was written: later batches of the partition take over its
        sequence numbers (the server refuses them as out of order otherwise).

        Unless one of them was sent already: an attempt of it may still be on its way
        (queued at the server behind a verification, say). Renumbered under the same
        identity, that stale attempt would be in order again right after its renumbered
        copy, and its records written twice (found by the chaos harness: log workload,
        seed 101, duplicates inside committed transactions after a batch of an aborted
        one was refused). Then the partition takes a new producer id instead, under which
        nothing stale can ever be in order; a session, which keeps its producer id, fails
        them (their transaction aborts) and bumps its epoch at the next begin."""
        if not self.idempotent or failed.base_sequence < 0:
            return
        later = sorted([b for b in [*state.in_flight, *state.ready]
                        if b.payload and b.base_sequence > failed.base_sequence],
                       key=lambda b: b.base_sequence)
        sent = any(b.attempts for b in later)
        if sent and self._session is not None:
            self._abandon_partition(state, later[0], errors.OutOfOrderSequence(
                f"a batch to {failed.topic}-{failed.partition} sent before this one was "
                "refused; what was sent after it cannot be renumbered safely"))
            return
        for b in later:
            _discard(state, b)
            # (Nothing of it was written: it follows `failed`, which nothing of was.)
            b.payload, b.maybe_written = b"", False
        if sent:
            self._new_identity(state)
        else:
            state.next_sequence = failed.base_sequence
        for b in reversed(later):
            state.ready.appendleft(b)

    def _succeed(self, batch: _Batch, result) -> None:
        batch.done = True
        batch.outcome.settle(result.base_offset, result.log_append_time_unix_ms, None)
        self._finish(batch)

    def _fail(self, batch: _Batch, error: Exception) -> None:
        batch.done = True
        batch.outcome.settle(-1, -1, error)
        self._finish(batch)

    def _finish(self, batch: _Batch) -> None:
        state = self._partitions.get((batch.topic, batch.partition))
        if state is not None:
            while state.window and state.window[0].done:
                state.window.popleft()
        self._buffered_bytes -= batch.size
        self._unfinished -= len(batch.records)
        self._lock.notify_all()


def _requests(batches: list[_Batch], limit: int) -> list[list[_Batch]]:
    """The batches bound for one server as Produce requests of at most `limit` bytes (a
    batch larger than that alone): the first ready batch of each partition in one, the
    rest in the next. So a lone partition's batches travel as two calls and the server
    writes the second while the first one's fsync runs; more calls would cost the server
    more than they gain once several producers share it (measured: bench/produce.py, one
    request per batch took the 4x1 cell from 117% of the wire producer to 62%). Each
    partition's batches stay in sequence order; a sequence refusal of one that overtook
    another is retried (_handle_failure)."""
    first: list[_Batch] = []
    rest: list[_Batch] = []
    seen: set[tuple[str, int]] = set()
    for batch in batches:
        key = (batch.topic, batch.partition)
        (rest if key in seen else first).append(batch)
        seen.add(key)
    groups: list[list[_Batch]] = []
    for batches_of_round in (first, rest) if rest else (first,):
        groups.append([])
        size = 0
        for batch in batches_of_round:
            if groups[-1] and size + _payload_size(batch.payload) > limit:
                groups.append([])
                size = 0
            groups[-1].append(batch)
            size += _payload_size(batch.payload)
    return groups


class _RawProduce:
    """PartitionService.Produce taking the request already serialized (_produce_request):
    the batches go from their encoded pieces into the request bytes with one copy, where a
    ProduceRequest message copied each batch in and then out again, and cost about 90 us
    of Python per 256 KiB batch."""

    def __init__(self, channel):
        self.produce = channel.unary_unary(
            "/atomlog.v1.PartitionService/Produce", request_serializer=None,
            response_deserializer=partition_pb2.ProduceResponse.FromString)


_TOPIC_PARTITIONS: dict[tuple[str, int], bytes] = {}


def _topic_partition_field(topic: str, partition: int) -> bytes:
    """ProduceItem field 1 (TopicPartition: topic = 1, partition = 2), tag and length."""
    field_ = _TOPIC_PARTITIONS.get((topic, partition))
    if field_ is None:
        name = topic.encode()
        body = b"\x0a" + uvarint(len(name)) + name + (
            b"\x10" + uvarint(partition) if partition else b"")
        field_ = b"\x0a" + uvarint(len(body)) + body
        if len(_TOPIC_PARTITIONS) < 1 << 16:
            _TOPIC_PARTITIONS[(topic, partition)] = field_
    return field_


def _produce_request(group: list[_Batch]) -> bytes:
    """The ProduceRequest of the group's batches in protobuf wire format, as
    partition_pb2.ProduceRequest(items=[ProduceItem(topic_partition=..., record_batch=...)])
    serializes it (tests/test_columnar.py checks they are the same bytes)."""
    pieces: list = []
    for batch in group:
        payload = batch.payload
        size = _payload_size(payload)
        tp = _topic_partition_field(batch.topic, batch.partition)
        if not size:  # (never sent; proto3 leaves an empty field out)
            pieces += (b"\x0a", uvarint(len(tp)), tp)
            continue
        length = uvarint(size)
        pieces += (b"\x0a", uvarint(len(tp) + 1 + len(length) + size), tp, b"\x12", length)
        if type(payload) is tuple:
            pieces += payload
        else:
            pieces.append(payload)
    return b"".join(pieces)


def _payload_size(payload) -> int:
    """Bytes of an encoded batch: bytes (send()), or (header, block) pieces (send_batch())."""
    if type(payload) is tuple:
        return sum(map(len, payload))
    return len(payload)


def _record_size(key: bytes | None, value: bytes | None, headers) -> int:
    """What a record counts against batch_max_bytes and the buffer (send_batch's columns
    count the same way: spark_client.columns)."""
    size = ROW_OVERHEAD + (len(key) if key else 0) + (len(value) if value else 0)
    if headers:
        size += sum(len(k) + len(v) + HEADER_OVERHEAD for k, v in headers)
    return size


def _may_send(state: _PartitionState, max_in_flight: int) -> bool:
    """Whether the partition's next ready batch may go now (docs/clients.md, idempotence).

    The servers recognise a retry only among a producer's last 5 batches, so a retry
    must still be among them when it arrives:
    - a new batch goes only while fewer than `max_in_flight` were sent since the oldest
      unfinished one (state.window: acknowledged batches behind it count);
    - a resend (a batch sent before) goes alone: once every batch ahead of it is
      answered, and nothing follows it until it is answered (later batches overtaking it
      could push it out of the window, and a resend that had been written would be
      refused as out of order instead of recognised);
    - after the partition took a new producer id, nothing goes under it while batches of
      the old one are unanswered (they could be overtaken); nor does a batch whose
      encoding takes one (its sequences would pass 2^31 - 1)."""
    batch = state.ready[0]
    if batch.attempts:
        return not state.in_flight
    if len(state.window) >= max_in_flight:
        return False
    if state.in_flight and not batch.payload and \
            state.next_sequence + len(batch.records) > SEQUENCE_LIMIT:
        return False  # its encoding rotates to a new producer id (_encode): not yet
    return not any(b.alone or (b.producer_id is not None and b.producer_id != state.producer_id)
                   for b in state.in_flight)  # (None: a transactional batch encoded later)


def _discard(state: _PartitionState, batch: _Batch) -> None:
    if batch in state.in_flight:
        state.in_flight.remove(batch)
    if batch in state.ready:
        state.ready.remove(batch)


def _bytes(value) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"expected bytes or str, got {type(value).__name__}")


def _headers(headers) -> tuple[tuple[str, bytes], ...]:
    if not headers:
        return ()
    items = headers.items() if isinstance(headers, dict) else headers
    return tuple((str(k), _bytes(v) or b"") for k, v in items)
