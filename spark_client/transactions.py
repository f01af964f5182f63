"""Transactions in the SDK: `client.begin_transaction()` / `with client.transaction():`.

A transaction lives on one TC partition, chosen by hashing a random idempotency key
(coordinator.proto's tc_partition_for), so a NewTxn retried after a lost reply finds the
same transaction instead of opening a second one; a one-call transaction's key is made to
hash to the lowest TC partition of a coordinator, where every client's one-call commits
gather (Coordinators.gathering_tc_partition). Every coordinator call goes to the
current owner of that TC partition (from the metadata cache) and is retried on the
retriable answers — the lease moving (NOT_COORDINATOR), a TC partition loading
(COORDINATOR_LOADING), CONCURRENT_TRANSACTIONS, a server unreachable — until the
transaction's own deadline. `commit()` therefore ends in a definite outcome: committed
(committing twice is safe: the coordinator answers "already committed"), or a typed
error that says what happened (TransactionAborted, TransactionTimedOut, ...).

`client.begin_transaction()` is lazy (as Kafka's beginTransaction): the NewTxn call waits
for the first registration and carries it, so a transaction costs one call fewer, and one
that wrote nothing commits without any.

Writes (`producer.send(..., txn=txn)`) and transactional acks join a transaction through
`register_partitions` / `register_subscriptions` (which producers and consumers call
before their first write or ack) and `track` (commit waits until each tracked future is
acknowledged). The producer registers partitions itself, batched, before the first
batch of the transaction goes to each partition; partition servers verify that with the
coordinator (no hanging transactions).

Two-phase commit (the Spark data source): `Transaction(client, t, key=K)` opens — or, for a
key already known and not aborted, finds — the transaction keyed K (`existing`,
`state_at_open`); `Transaction(client, t, parent=p)` opens a child, `prepare()` ends its
phase one, and the parent's `commit(keep_children=...)` commits those children and aborts
every other. `Transaction.resume(client, (tc, seq))` is a handle on a transaction another
process opened. `Transaction(client, t, key=K, stream=(name, n))` is step n of an ordered
stream (a Spark streaming query's micro-batch n): it lives on the stream's TC partition,
which remembers the stream's highest committed step for days, and once n or a later step
committed, opening or committing n again fails with StreamOrdinalCommitted — also long
after the transaction itself was forgotten (coordinator.proto, TxnStream).

Sessions (Kafka's transactional.id): `client.producer(transactional_id=...)` holds a
session; its transactions carry it, and a newer session with the same id fences the
older one (its calls fail with ProducerFenced; its open transaction is aborted).

One-call transactions. A transaction from `client.begin_transaction()` or a session's
`producer.begin_transaction()` starts by keeping its records and transactional acks
here, while they are small (at most `client.one_call_max_bytes` together, each
partition's records at most its producer's batch_max_bytes): no call is made until
`commit()`, which sends everything in ONE CommitTxn call to the transaction's
coordinator — it stages the parts on the partition servers, logs the decision and
answers. Retried after an unknown outcome it is safe (the idempotency key names the
transaction). A transaction that outgrows the bound, or whose id is asked for, switches
to NewTxn/Produce/EndTxn on the spot: what it kept is registered in the NewTxn and handed
to its producers (and its acks sent), in order, so the caller sees no difference except
when errors surface: a conflicting ack or a refused batch of a one-call transaction is
raised by `commit()` (which then reports the transaction aborted), not by `ack()`/the
send's future before it. The futures of kept sends complete when commit() does.
`abort()` of a one-call transaction sends nothing: nothing reached any server.

Pipelined one-call commits (commit_async(), or commits from several threads) of the same
producers go in turn, so records reach each partition in send order; the commits queued
while one is in flight leave together in the next call, one CommitTxns that stages them
in order (_Carpool, docs/coordinator.md).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import struct
import threading
import time
import uuid
import weakref
from _thread import RLock as _RLock  # (threading.RLock() is a Python call that makes one)
from collections.abc import Iterable

import crc32c
import grpc
import pyarrow as pa
import pyarrow.compute as pc

from atomlog.v1 import common_pb2, coordinator_pb2, partition_pb2
from coordinator.records import TxnStream, tc_partition_for
from partition_server.record_batch import (
    CRC_COVERED_FROM,
    CRC_OFFSET,
    HEADER,
    MAGIC_COLUMNAR,
    MIN_BATCH_LENGTH,
    NO_PRODUCER_ID,
    NO_SEQUENCE,
    NO_TIMESTAMP,
    Compression,
)
from partition_server.record_columns import (
    PLAIN_MAX_RECORDS,
    encode_columns,
    encode_records,
    plain_block,
)
from partition_server.subscription_cursor import merge_ranges
from spark_client import errors, link
from spark_client.columns import records_of_chunk
from services.backoff import Backoff

_log = logging.getLogger("atomlog.client.transactions")

S = coordinator_pb2
# Answers after which the same call is retried (after a metadata refresh for routing).
_ROUTING = frozenset({"NOT_COORDINATOR", "SERVER_UNAVAILABLE", "SHUTTING_DOWN",
                      "REQUEST_TIMED_OUT"})
_RETRY = _ROUTING | {"COORDINATOR_LOADING", "CONCURRENT_TRANSACTIONS", "ZOOKEEPER_UNAVAILABLE"}
# CommitTxn answers these only when the transaction did not commit and never will (it was
# refused before its decision was logged). Any other failure leaves the outcome unknown:
# commit() may be retried (same key), and abort() asks the coordinator to make sure.
_NOT_COMMITTED = frozenset({
    "INVALID_ARGUMENT", "CORRUPT_BATCH", "BATCH_TOO_LARGE", "CRC_MISMATCH",
    "UNKNOWN_TOPIC_OR_PARTITION", "PRODUCER_FENCED", "INVALID_TRANSACTION_TIMEOUT",
    "TRANSACTION_ABORTED", "TRANSACTION_TIMED_OUT", "TRANSACTION_CONFLICT",
    "TRANSACTION_NOT_OPEN", "DATA_LOSS", "OFFSET_OUT_OF_RANGE", "UNIMPLEMENTED",
    "EARLIER_COMMIT_FAILED"})
_STATE_NAMES = {value: name.removeprefix("TXN_STATE_")
                for name, value in S.TxnState.items()}
# Orders one-call commits of the same producers (see _in_turn).
_TURNS = threading.Lock()
_SUBMITS = threading.Lock()  # commit_async(): a turn and its place in the executor at once
# One-call transactions gather (Coordinators.gathering_tc_partition) only with a timeout
# up to this: a gathered TC partition holds its coordinator's one-call commits alone, and
# each finished one is remembered until its deadline + transaction.finished_grace_ms, so
# longer ones would fill it (transaction.max_finished_held) at a lower rate
# (docs/coordinator.md, "Gathered one-call commits").
GATHER_MAX_TIMEOUT_S = 60.0


def gathering_tc_partitions(routes: dict[int, str]) -> list[int]:
    """The TC partitions one-call commits gather on (Coordinators.gathering_tc_
    partition): the lowest-numbered one each coordinator owns in `routes` (TC partition
    -> its owner's address, "" for none), in ascending order."""
    lowest: dict[str, int] = {}
    for k, address in routes.items():
        if address and (address not in lowest or k < lowest[address]):
            lowest[address] = k
    return sorted(lowest.values())


class Coordinators:
    """Calls to whichever coordinator owns a TC partition now (`of`: one per client)."""

    @staticmethod
    def of(client) -> "Coordinators":
        """The client's (it holds no state of a call: made once, not per transaction)."""
        coordinators = getattr(client, "_coordinators", None)
        if coordinators is None:
            coordinators = client._coordinators = Coordinators(client)
        return coordinators

    def __init__(self, client):
        self.client = client
        # At most 0.25 s between tries: a TC partition whose coordinator died is served
        # again within a few seconds (docs/benchmarks.md, coordinator failover), and a
        # longer wait would add up to itself to what the caller sees.
        self._backoff = Backoff(initial_s=0.02, maximum_s=0.25)
        self._gathering: tuple[dict | None, list[int]] = (None, [])
        self._turns = itertools.count()  # next() is atomic: no lock needed

    def gathering_tc_partition(self) -> int | None:
        """Where a one-call transaction of a random key goes: the lowest TC partition of
        one of the coordinators, each coordinator in turn (None before the metadata
        names any owner). Every client picks the same partition of a coordinator, so
        its one-call commits share that TC partition's appends (its decisions and
        completions in one append while the last is under way) instead of each taking
        an append of its own on one of its eight: docs/coordinator.md, "Gathered
        one-call commits"."""
        routes = self.client.metadata.tc_routes
        gathering = self._gathering
        if gathering[0] is not routes:  # the routes were refreshed (a new dict)
            gathering = self._gathering = (routes, gathering_tc_partitions(routes))
        partitions = gathering[1]
        if not partitions:
            return None
        return partitions[next(self._turns) % len(partitions)]

    def tc_partition_count(self) -> int:
        metadata = self.client.metadata
        if not metadata.tc_partition_count:
            metadata.refresh()
        return metadata.tc_partition_count

    def call(self, k: int, method: str, request, deadline: float):
        """`method` on the owner of TC partition k, retried until `deadline`
        (time.monotonic()); raises the typed error of a definite failure."""
        metadata = self.client.metadata
        attempt = 0
        while True:
            attempt += 1
            address = metadata.tc_routes.get(k, "")
            last = None
            if not address:
                last = self._refresh()
                address = metadata.tc_routes.get(k, "")
            remaining = deadline - time.monotonic()
            if address:
                timeout = max(0.05, min(remaining, self.client.request_timeout_s))
                try:
                    if method in link.METHODS:  # its link, when it has one
                        on_link = self.client.links.get(
                            address, metadata.coordinator_links.get(address, ""))
                        if on_link is not None:
                            try:
                                return on_link.call(method, request, timeout)
                            except link.LinkUnavailable:
                                pass  # over gRPC
                    return getattr(self.client.channels.coordinator(address), method)(
                        request, timeout=timeout)
                except grpc.RpcError as rpc_error:
                    error = errors.from_grpc(rpc_error)
                    if error.reason not in _RETRY:
                        raise error from None
                    if error.reason in _ROUTING:
                        self._refresh()
                    last = error
            else:
                last = last or errors.error_for("NOT_COORDINATOR",
                                                f"TC partition {k} has no owner now")
            delay = self._backoff.delay(attempt)
            if time.monotonic() + delay >= deadline:
                raise last
            time.sleep(delay)

    def _refresh(self) -> errors.AtomlogClientError | None:
        """Refresh the metadata; a failure (the server asked has no ZooKeeper session,
        say) is returned, not raised: the call it serves is retried all the same."""
        try:
            self.client.metadata.refresh()
        except errors.AtomlogClientError as error:
            return error
        return None


class _KeptPartition:
    """What a one-call transaction keeps for one partition, in send order: one batch.
    `pieces` holds runs of send()'s Record tuples (lists) and send_batch()'s chunks
    (columns.Chunk) as they came; a chunk stays columns until the commit encodes it, so
    a send_batch() into a one-call transaction makes no Python loop over its rows."""

    __slots__ = ("producer", "pieces", "count", "size", "outcome")

    def __init__(self, producer, outcome):
        self.producer = producer
        self.pieces: list = []
        self.count = 0  # records kept: the next one's index in the batch
        self.size = 0
        self.outcome = outcome

    def add_record(self, record, size: int) -> int:
        """Keep one record; its index in the batch."""
        pieces = self.pieces
        if pieces and type(pieces[-1]) is list:
            pieces[-1].append(record)
        else:
            pieces.append([record])
        self.size += size
        self.count += 1
        return self.count - 1

    def add_chunk(self, chunk) -> int:
        """Keep a chunk of send_batch(); the index of its first record in the batch."""
        self.pieces.append(chunk)
        self.size += chunk.size
        self.count += len(chunk)
        return self.count - len(chunk)

    def records(self) -> list:
        """Every kept record as Record tuples, in order (for a switch to the producer)."""
        return [record for piece in self.pieces
                for record in (piece if type(piece) is list else records_of_chunk(piece))]

    def encode(self) -> bytes:
        """The kept records as one batch: records as the producer encodes them; chunks
        from their columns (several rebased onto the first one's timestamp); a mix of
        both through Record tuples."""
        compression = self.producer.compression
        pieces = self.pieces
        if len(pieces) == 1 and type(pieces[0]) is list:  # records only (send())
            if compression is Compression.NONE:
                batch = _plain_batch(pieces[0])
                if batch is not None:
                    return batch
            return encode_records(pieces[0], compression=compression)
        if all(type(piece) is not list for piece in pieces):
            return _encode_chunks(pieces, compression)
        records = pieces[0] if len(pieces) == 1 else self.records()
        return encode_records(records, compression=compression)


_CRC = struct.Struct(">I")


def _plain_batch(records: list) -> bytes | None:
    """encode_records(records) (uncompressed) for a one-call transaction's records from
    send(): the same bytes (tests/test_one_call.py holds them together), or None when
    plain_block does not take them (headers, too many records) or a timestamp is
    missing. Its header is framed here: frame_batch also parses the batch it built
    (the servers' pair assertion: a BatchHeader object per batch, which a client only
    threw away), and the path went through two more Python-level calls."""
    if len(records) > PLAIN_MAX_RECORDS:
        return None
    stamps = [record[3] for record in records]
    if None in stamps:
        return None
    block = plain_block(records, stamps)
    if block is None:
        return None
    count = len(records)
    batch = bytearray(HEADER.pack(0, MIN_BATCH_LENGTH + len(block), MAGIC_COLUMNAR,
                                  NO_TIMESTAMP, 0, 0, count - 1, count, stamps[0],
                                  max(stamps), NO_PRODUCER_ID, 0, NO_SEQUENCE, 0, 0))
    batch += block
    _CRC.pack_into(batch, CRC_OFFSET, crc32c.crc32c(memoryview(batch)[CRC_COVERED_FROM:]))
    return bytes(batch)


def _encode_chunks(chunks: list, compression) -> bytes:
    if len(chunks) == 1:
        chunk = chunks[0]
        return encode_columns(chunk.keys, chunk.values, chunk.headers, chunk.timestamp_deltas,
                              chunk.base_timestamp_ms, chunk.max_timestamp_ms,
                              compression=compression)
    base = chunks[0].base_timestamp_ms
    deltas = [chunk.timestamp_deltas if chunk.base_timestamp_ms == base
              else pc.add(chunk.timestamp_deltas.cast(pa.int64()),
                          chunk.base_timestamp_ms - base).cast(chunks[0].timestamp_deltas.type)
              for chunk in chunks]
    return encode_columns(pa.concat_arrays([c.keys for c in chunks]),
                          pa.concat_arrays([c.values for c in chunks]),
                          pa.concat_arrays([c.headers for c in chunks]),
                          pa.concat_arrays(deltas), base,
                          max(chunk.max_timestamp_ms for chunk in chunks),
                          compression=compression)


class _Kept:
    """Everything a one-call transaction keeps until commit (or until it switches)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.size = 0
        self.partitions: dict[tuple[str, int], _KeptPartition] = {}
        # (topic, partition, subscription) -> [consumer, cumulative end, ranges]
        self.acks: dict[tuple[str, int, str], list] = {}

    def fail(self, error: Exception) -> None:
        for part in self.partitions.values():
            part.outcome.settle(-1, -1, error)


class Transaction:
    """One transaction; see the module docstring. Thread-safe."""

    def __init__(self, client, timeout_s: float, *, parent: Transaction | None = None,
                 session: S.TransactionalSession | None = None, tc_partition: int | None = None,
                 key: str | None = None, lazy: bool = False,
                 partitions: Iterable[tuple[str, int]] = (),
                 subscriptions: Iterable[tuple[str, int, str]] = (),
                 stream: tuple[str, int] | None = None,
                 _resume: common_pb2.TxnId | None = None, on_fenced=None):
        if not 0 < timeout_s <= 4_294_967:
            raise ValueError("timeout_s must be positive (at most the coordinator's maximum)")
        self._coordinators = Coordinators.of(client)
        self.timeout_s = timeout_s
        self.session = session
        self._lock = threading.Lock()
        self._registered: set[tuple[str, int]] = set()
        self._subscriptions: set[tuple[str, int, str]] = set()
        self._pending: list = []  # anything with .result(timeout)
        self._flushers: list = []  # called before commit waits (producers' lingering batches)
        self._ended: str | None = None  # "committed" | "aborted"
        self._committing = False  # commit() or commit_async() began: no new sends or acks
        # Held while a one-call commit's CommitTxn is under way (abort() waits for it; a
        # lock, not an Event: an Event's Condition cost a fifth of a begin).
        self._one_call_running = threading.Lock()
        self.kept_children: list[common_pb2.TxnId] = []
        self.existing = False  # NewTxn found this transaction by its idempotency key
        self.state_at_open = "OPEN"  # for an existing one: its state then (e.g. COMMITTED)
        if parent is not None and key is not None:
            raise ValueError("a child transaction has no idempotency key of its own")
        if lazy and (parent is not None or key is not None or _resume is not None):
            raise ValueError("only a plain transaction can be opened lazily")
        # (name, ordinal): its place in a stream, whose TC partition keeps the stream's
        # committed high-water (coordinator.proto, TxnStream); sent by NewTxn and commit().
        self._stream = None
        if stream is not None:
            if parent is not None or session is not None or lazy:
                raise ValueError("a transaction of a stream has no parent or session, and "
                                 "is not lazy")
            checked = TxnStream(*stream)  # (ValueError: the coordinator's own bounds)
            self._stream = S.TxnStream(name=checked.name, ordinal=checked.ordinal)
        count = self._coordinators.tc_partition_count()
        if parent is not None:
            self.tc_partition = parent.tc_partition
        elif stream is not None:  # the stream's TC partition, the key's too
            self.tc_partition = tc_partition_for(stream[0], count)
        elif key is not None:  # the caller's key decides the TC partition
            self.tc_partition = tc_partition_for(key, count)
        elif tc_partition is not None:  # a session's TC partition
            self.tc_partition = tc_partition
        elif lazy and timeout_s <= GATHER_MAX_TIMEOUT_S and client.gather_one_calls \
                and client.one_call_max_bytes and (
                gathered := self._coordinators.gathering_tc_partition()) is not None:
            # A random key on the TC partition where its coordinator gathers the one-call
            # commits of every client (Coordinators.gathering_tc_partition).
            self.tc_partition = gathered
            key = _key_for(gathered, count)
        else:  # a random key, and the TC partition it hashes to
            key = _KEYS.next()  # (_random_key(), a Python-level call less)
            self.tc_partition = tc_partition_for(key, count)
        # A one-call commit of a random key may move to the TC partition of the commit
        # before it of the same producers, while that one is under way (_take_turn): then
        # the carpool can carry them in one call.
        self._movable = lazy and tc_partition is None  # (lazy: no parent, key or _resume)
        # A random key on the transaction's TC partition makes NewTxn retry-safe (children
        # are found through their parent instead).
        self._new_txn_key = key if key is not None else (
            "" if parent is not None or _resume is not None
            else _key_for(self.tc_partition, count))
        self._parent = parent
        self._began = time.monotonic()
        self._open_lock = threading.Lock()
        # One-call: what it keeps (None once it switched, or when it cannot be one-call).
        limit = client.one_call_max_bytes
        self._kept: _Kept | None = _Kept(limit) if lazy and limit > 0 else None
        self._switch_lock = _RLock()
        self._on_fenced = on_fenced  # a session's producer learns it was fenced
        # A CommitTxn of the kept transaction ended with an unknown outcome: commit()
        # retries it, abort() makes sure it never commits (CommitTxn with abort).
        self._commit_unknown = False
        self._turn: _in_turn | None = None  # a one-call commit's place among its producers'
        self._txn_id: common_pb2.TxnId | None = _resume
        # Registered by the NewTxn call, whenever it is made.
        self._upfront = (list(dict.fromkeys((t, int(p)) for t, p in partitions))
                         if partitions else [],
                         list(dict.fromkeys((t, int(p), n) for t, p, n in subscriptions))
                         if subscriptions else [])
        if _resume is not None and (self._upfront[0] or self._upfront[1]):
            raise ValueError("a resumed transaction is open already: register partitions "
                             "with register_partitions()")
        if _resume is None and not lazy:
            self._open([], [])

    @property
    def txn_id(self) -> common_pb2.TxnId:
        """The coordinator's id (a lazy transaction is opened by asking for it; a one-call
        one switches to NewTxn/Produce/EndTxn for it, unless it committed already)."""
        if self._txn_id is None:
            if self._kept is not None and self._committing:
                raise errors.error_for(
                    "TRANSACTION_NOT_OPEN", "the transaction's one-call commit is under way: "
                    "its id is known once commit() returns")
            if self._kept is not None:
                self._switch()
            if self._txn_id is None:
                self._open([], [])
        return self._txn_id

    # ------------------------------------------------------------------ one-call
    @property
    def one_call(self) -> bool:
        """Whether the transaction still keeps its records and acks for one CommitTxn."""
        return self._kept is not None

    def one_call_room(self) -> int:
        """Bytes this one-call transaction may still keep (0 when it is not one-call)."""
        with self._lock:
            kept = self._kept
            return 0 if kept is None else max(0, kept.limit - kept.size)

    def keep_chunk(self, producer, topic: str, chunk):
        """keep_record for a chunk of producer.send_batch(..., txn=self) (columns.Chunk),
        kept whole as columns: the future of its first record, or None."""
        return self.keep_record(producer, topic, chunk.partition, chunk.size, chunk=chunk)

    def keep_record(self, producer, topic: str, partition: int, size: int, record=None,
                    chunk=None):
        """Keep a record of producer.send(..., txn=self) (or a `chunk` of send_batch) for
        the one-call commit if `size` more bytes fit the one-call bound and the
        partition's batch: its future (the RecordFuture of its index). Else None, when
        the transaction is not (or no longer) one-call, and the producer sends it as
        usual: a record that would pass the bound switches the transaction first. Raises
        TRANSACTION_NOT_OPEN when the transaction takes no more sends (the producer
        checks that itself only for what it sends).

        Under the switch lock alone: everything that takes or replaces what is kept
        (commit, abort, a switch) holds it, and the readers under `_lock` alone
        (one_call_room, kept_claims) read a size or the acks, which this does not
        change. It runs once per record: one lock, and _KeptPartition.add_record
        inline (about a third of a send's Python-level calls before)."""
        RecordFuture, _Outcome = _PRODUCER_TYPES or _producer_types()
        with self._switch_lock:
            kept = self._kept
            if kept is None:
                return None
            if self._ended is not None or self._committing:  # (no call when it takes)
                self._check_accepting()
            part = kept.partitions.get((topic, partition))
            if (kept.size + size <= kept.limit
                    and (part.size if part else 0) + size + 128 <= producer.batch_max_bytes):
                if part is None:
                    part = kept.partitions[(topic, partition)] = _KeptPartition(
                        producer, _Outcome(topic, partition, on_wait=self._switch))
                kept.size += size
                if chunk is not None:
                    return RecordFuture(part.outcome, part.add_chunk(chunk))
                pieces = part.pieces  # part.add_record(record, size), inline
                if pieces and type(pieces[-1]) is list:
                    pieces[-1].append(record)
                else:
                    pieces.append([record])
                part.size += size
                index = part.count
                part.count = index + 1
                return RecordFuture(part.outcome, index)
            self._switch()
            return None

    def keep_acks(self, consumer, acks: dict) -> bool:
        """Keep transactional acks ({(topic, partition): (cumulative end, ranges)}) of one
        subscription consumer for the one-call commit; False when the transaction is not
        one-call (the consumer sends them as usual)."""
        with self._switch_lock:
            kept = self._kept
            if kept is None:
                return False
            with self._lock:
                self._check_open()
                size = sum(64 + 16 * len(ranges) for _, ranges in acks.values())
                if kept.size + size <= kept.limit:
                    for (topic, partition), (cumulative, ranges) in acks.items():
                        entry = kept.acks.setdefault((topic, partition, consumer.subscription),
                                                     [consumer, 0, []])
                        entry[1] = max(entry[1], cumulative)
                        entry[2].extend(ranges)
                    kept.size += size
                    return True
            self._switch()
            return False

    def kept_claims(self, topic: str, partition: int, subscription: str) -> list:
        """The offsets ([start, end) ranges) this one-call transaction keeps acks for on
        one subscription partition (a kept cumulative ack claims everything below it)."""
        with self._lock:
            kept = self._kept
            entry = kept.acks.get((topic, partition, subscription)) if kept else None
            if entry is None:
                return []
            return ([(0, entry[1])] if entry[1] else []) + list(entry[2])

    def _switch(self) -> None:
        """Turn a one-call transaction into an ordinary one: NewTxn registering what it
        kept, its records handed to their producers (ahead of anything sent after), its
        acks sent. A failure there fails the transaction (commit() raises it)."""
        with self._switch_lock:
            if self._committing:
                return  # commit() sends what is kept (a waiter hears from it)
            kept, self._kept = self._kept, None
            if kept is None or not (kept.partitions or kept.acks):
                return  # nothing kept: the caller opens it as usual, if it needs to
            try:
                self._open(list(kept.partitions), list(kept.acks))
            except errors.AtomlogClientError:
                # Nothing of it was sent: it stays kept (commit() sends it in one call, or
                # a later switch tries again), and the caller hears why.
                with self._lock:
                    self._kept = kept
                raise
            try:
                for (topic, partition), part in kept.partitions.items():
                    part.producer._adopt(topic, partition, part.records(), part.size,
                                         part.outcome, self)
                by_consumer: dict[int, tuple] = {}
                for (topic, partition, _), (consumer, cumulative, ranges) in kept.acks.items():
                    by_consumer.setdefault(id(consumer), (consumer, {}))[1][
                        (topic, partition)] = (cumulative, merge_ranges(ranges))
                for consumer, acks in by_consumer.values():
                    consumer._ack(acks, self)
            except errors.AtomlogClientError as error:
                kept.fail(error)
                failed: concurrent.futures.Future = concurrent.futures.Future()
                failed.set_exception(error)
                with self._lock:
                    self._pending.append(failed)  # commit() raises it (and aborts)

    def _commit_one_call(self, kept: _Kept, wait_for_markers: bool) -> None:
        """The one CommitTxn call (retried on retriable answers until the timeout: the
        idempotency key makes a retry find a transaction that committed)."""
        parts = list(kept.partitions.items())
        remaining_ms = int((self.timeout_s - (time.monotonic() - self._began)) * 1000)
        if remaining_ms <= 0:
            if self._commit_unknown:
                # An earlier attempt's outcome is unknown: it may have committed (its
                # answer was lost). Not a definite timeout, then: settled first (the
                # coordinator says it committed, or its tombstone makes it aborted for
                # good); a settling call that fails leaves it unknown (raised as such).
                try:
                    self._abort_one_call(kept)
                except errors.TransactionAlreadyCommitted:
                    self._commit_unknown = False
                    return  # committed: where its batches were written is not known
                self._commit_unknown = False
                raise errors.error_for(
                    "TRANSACTION_TIMED_OUT", f"the transaction's timeout of {self.timeout_s} s "
                    "ran out before it was committed (an earlier attempt, whose outcome was "
                    "unknown, did not commit: the coordinator aborted it)")
            error = errors.error_for("TRANSACTION_TIMED_OUT", "the transaction's timeout of "
                                     f"{self.timeout_s} s ran out before it was committed")
            self._end_kept(kept, error)
            raise error
        acks = [partition_pb2.AckItem(
            subscription_partition=common_pb2.SubscriptionPartition(
                topic=topic, partition=partition, subscription=subscription),
            cumulative_end_offset=cumulative,
            individual_ranges=[partition_pb2.OffsetRange(start_offset=s, end_offset=e)
                               for s, e in merge_ranges(ranges)])
            for (topic, partition, subscription), (_, cumulative, ranges) in kept.acks.items()]
        request = S.CommitTxnRequest(
            tc_partition=self.tc_partition, idempotency_key=self._new_txn_key,
            timeout_ms=remaining_ms, wait_for_markers=wait_for_markers, acks=acks)
        if self.session is not None:
            request.session.CopyFrom(self.session)
        # Each batch built in its place in the request: ProduceItem(...) messages given to
        # the constructor are copied in, record batch and all (twice the time).
        add_item = request.batches.add
        for (topic, partition), part in parts:
            target = add_item(record_batch=part.encode()).topic_partition
            target.topic = topic
            target.partition = partition
        try:
            reply = self._commit_call(kept, request)  # commit() releases or holds the turn
        except errors.AtomlogClientError as error:
            if error.reason in _NOT_COMMITTED:  # definite: it did not commit, and never will
                self._end_kept(kept, error)
            else:  # unknown: commit() retries with the same key; abort() makes sure
                with self._lock:
                    self._kept = kept
                self._commit_unknown = True
            raise
        self._txn_id = reply.txn_id
        results = list(reply.batch_results) or [None] * len(parts)
        for (_, part), result in zip(parts, results, strict=True):
            if result is None:  # answered by a retry: where it was written is not known
                part.outcome.settle(-1, -1, None)  # (its futures answer offset -1)
            else:
                part.outcome.settle(result.base_offset, result.log_append_time_unix_ms, None)
        self._ended = "committed"
        if wait_for_markers and reply.state != S.TXN_STATE_COMMITTED:
            self._wait_for_markers()

    def _commit_call(self, kept: _Kept, request) -> S.CommitTxnResponse:
        """The CommitTxn of a one-call commit once its turn came: alone, or carried with
        the commits queued behind it in one CommitTxns call (_Carpool). A commit of such
        a call that answers EARLIER_COMMIT_FAILED, or a retriable refusal of its own,
        takes its turn again (the same key: that attempt did not commit), until the
        transaction's timeout."""
        turn = self._take_turn(kept)
        carpool = _carpool_of(self._coordinators.client)
        deadline = self._began + self.timeout_s
        backoff = None  # made at the first retry
        attempt = 0
        settled = False
        try:
            while True:
                attempt += 1
                reply, refusal = carpool.ride(self, turn, request)
                if refusal is None:
                    settled = True
                    return reply
                if refusal.reason != "EARLIER_COMMIT_FAILED" and refusal.reason not in _RETRY:
                    raise refusal
                if refusal.reason in _ROUTING:
                    self._coordinators._refresh()
                if backoff is None:
                    backoff = Backoff(initial_s=0.01, maximum_s=0.25)
                delay = 0.0 if refusal.reason == "EARLIER_COMMIT_FAILED" \
                    else backoff.delay(attempt)
                remaining = deadline - time.monotonic() - delay
                if remaining <= 0:
                    raise refusal
                time.sleep(delay)
                request.timeout_ms = max(1, int(remaining * 1000))
        except errors.AtomlogClientError as failure:
            settled = failure.reason in _NOT_COMMITTED
            raise
        finally:
            if settled:
                turn.before = []  # waited for: turns must not chain up in memory
            else:
                # Unknown (commit() may retry it): the held turns before it stay, so
                # that the retry waits for them again. Before, they were forgotten, and
                # a retry of a commit carried with an earlier one of its producer (one
                # CommitTxns, outcome unknown) could stage its records before that
                # one's retry did. Only the turns not over yet are kept.
                turn.before = [previous for previous in turn.before if not previous.over()]

    def _abort_one_call(self, kept: _Kept) -> None:
        """abort() after a CommitTxn with an unknown outcome: the coordinator makes sure
        no call with this key commits later; raises TransactionAlreadyCommitted when one
        did (as abort() of a committed transaction does)."""
        try:
            self._call("CommitTxn", S.CommitTxnRequest(
                tc_partition=self.tc_partition, idempotency_key=self._new_txn_key,
                session=self.session, abort=True))
        except errors.TransactionAlreadyCommitted:
            for part in kept.partitions.values():  # written, where is not known here
                part.outcome.settle(-1, -1, None)
            self._ended = "committed"
            raise
        except errors.AtomlogClientError:
            with self._lock:
                self._kept = kept  # still unknown: abort() or commit() may be tried again
            raise
        self._end_kept(kept, errors.error_for("TRANSACTION_ABORTED",
                                              f"transaction {self._name} was aborted"))

    def _end_kept(self, kept: _Kept, error: errors.AtomlogClientError) -> None:
        kept.fail(error)
        self._ended = "aborted"


    @property
    def key(self) -> tuple[int, int]:
        """(tc partition, sequence), as record batches carry it."""
        txn_id = self.txn_id
        return (txn_id.tc_partition, txn_id.sequence)

    @property
    def opened(self) -> bool:
        """Whether the coordinator knows this transaction yet (a lazy one is opened by its
        first write, ack or `id`)."""
        return self._txn_id is not None

    def _open(self, partitions: list[tuple[str, int]],
              subscriptions: list[tuple[str, int, str]]) -> bool:
        """NewTxn, registering `partitions` and `subscriptions` in the same call; False
        (and nothing registered) when the transaction was open already. The timeout of a
        lazy transaction counts from begin_transaction(): what is left of it is asked for,
        and a transaction whose time ran out before its first write is timed out."""
        with self._open_lock:
            if self._txn_id is not None:
                return False
            self._check_open()
            asked = {*partitions, *subscriptions}
            partitions = list(dict.fromkeys([*self._upfront[0], *partitions]))
            subscriptions = list(dict.fromkeys([*self._upfront[1], *subscriptions]))
            remaining_ms = int((self.timeout_s - (time.monotonic() - self._began)) * 1000)
            if remaining_ms <= 0:
                self._ended = "aborted"
                raise errors.error_for("TRANSACTION_TIMED_OUT", "the transaction's timeout of "
                                       f"{self.timeout_s} s ran out before its first write")
            request = S.NewTxnRequest(
                tc_partition=self.tc_partition, timeout_ms=remaining_ms,
                idempotency_key=self._new_txn_key,
                parent_txn_id=self._parent.txn_id if self._parent else None,
                session=self.session, stream=self._stream,
                topic_partitions=[common_pb2.TopicPartition(topic=t, partition=p)
                                  for t, p in partitions],
                subscription_partitions=[common_pb2.SubscriptionPartition(
                    topic=t, partition=p, subscription=n) for t, p, n in subscriptions])
            reply = self._call("NewTxn", request)
            partition_errors = [r.error for r in reply.topic_partition_results]
            subscription_errors = [r.error for r in reply.subscription_partition_results]
            # Recorded before the lock is released: a thread that waited for this NewTxn
            # then sees what it registered and makes no AddPartition call of its own.
            self._record_registered(partitions, partition_errors, self._registered)
            self._record_registered(subscriptions, subscription_errors, self._subscriptions)
            self._txn_id = reply.txn_id
            self.existing = reply.existing
            self.state_at_open = _STATE_NAMES.get(reply.state, "UNSPECIFIED")
        # A refused target given to begin_transaction() is not this caller's failure: it
        # stays unregistered, and a write to it is refused when it registers itself.
        self._raise_item_errors(e for t, e in zip(partitions, partition_errors, strict=True)
                                if t in asked)
        self._raise_item_errors(e for t, e in zip(subscriptions, subscription_errors,
                                                  strict=True) if t in asked)
        return True

    def _record_registered(self, targets: list, item_errors: list, registered: set) -> None:
        with self._lock:
            registered.update(t for t, e in zip(targets, item_errors, strict=True)
                              if not e.reason)

    def _settle_registration(self, targets: list, item_errors: list, registered: set) -> None:
        """Remember the targets registered; raise the first refusal."""
        self._record_registered(targets, item_errors, registered)
        self._raise_item_errors(item_errors)

    def _unregistered(self, targets: list, registered: set) -> list:
        with self._lock:
            return [t for t in targets if t not in registered]

    @classmethod
    def resume(cls, client, txn_id: tuple[int, int], timeout_s: float = 60.0,
               stream: tuple[str, int] | None = None) -> Transaction:
        """A handle on a transaction another process opened, from its (tc partition,
        sequence): to commit or abort it, or to open children under it. `timeout_s`
        bounds this handle's calls, not the transaction. `stream`: the place in a stream
        it was opened with, which its commit carries again."""
        tc_partition, sequence = txn_id
        handle = cls(client, timeout_s, tc_partition=tc_partition,
                     _resume=common_pb2.TxnId(tc_partition=tc_partition, sequence=sequence))
        if stream is not None:
            handle._stream = S.TxnStream(name=stream[0], ordinal=stream[1])
        return handle

    # ------------------------------------------------------------------ identity
    @property
    def id(self) -> str:
        """"<tc partition>:<sequence>", as `atomlog txn describe` takes it."""
        return f"{self.txn_id.tc_partition}:{self.txn_id.sequence}"

    def __repr__(self) -> str:
        return f"Transaction({self._name}, {self._ended or 'open'})"

    @property
    def _name(self) -> str:
        """The id for messages, without opening a lazy transaction."""
        return self.id if self._txn_id is not None else "(not opened yet)"

    # ------------------------------------------------------------------ membership
    def register_partitions(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Add partitions (before the first write to each); idempotent and cached. A
        one-call transaction switches to ordinary sends first."""
        if self._kept is not None:
            self._switch()
        with self._lock:
            self._check_open()
            new = [p for p in dict.fromkeys(partitions) if p not in self._registered]
        if not new or self._open(new, []):
            return
        # Another thread's NewTxn may have registered them meanwhile.
        new = self._unregistered(new, self._registered)
        if not new:
            return
        reply = self._call("AddPartitionToTxn", S.AddPartitionToTxnRequest(
            txn_id=self.txn_id, topic_partitions=[common_pb2.TopicPartition(
                topic=t, partition=p) for t, p in new]))
        self._settle_registration(new, [r.error for r in reply.results], self._registered)

    def register_subscriptions(self, targets: Iterable[tuple[str, int, str]]) -> None:
        """Add subscription partitions (before the first transactional ack to each)."""
        if self._kept is not None:
            self._switch()
        with self._lock:
            self._check_open()
            new = [t for t in dict.fromkeys(targets) if t not in self._subscriptions]
        if not new or self._open([], new):
            return
        new = self._unregistered(new, self._subscriptions)
        if not new:
            return
        reply = self._call("AddSubscriptionToTxn", S.AddSubscriptionToTxnRequest(
            txn_id=self.txn_id, subscription_partitions=[common_pb2.SubscriptionPartition(
                topic=t, partition=p, subscription=s) for t, p, s in new]))
        self._settle_registration(new, [r.error for r in reply.results], self._subscriptions)

    def registered(self, partition: tuple[str, int]) -> bool:
        return partition in self._registered

    def track(self, future) -> None:
        """commit() waits for this send or ack (anything with .result(timeout)) to be
        acknowledged first."""
        with self._lock:
            self._check_accepting()
            self._pending.append(future)

    def add_flusher(self, flush) -> None:
        """flush() is called before commit() waits (sends what a producer still lingers on)."""
        with self._lock:
            if flush not in self._flushers:
                self._flushers.append(flush)

    # ------------------------------------------------------------------ ending
    def prepare(self, prepared_timeout_s: float = 0) -> None:
        """Two-phase commit, phase one (children of a parent)."""
        self._wait_pending()
        self._call("PrepareTxn", S.PrepareTxnRequest(
            txn_id=self.txn_id, prepared_timeout_ms=int(prepared_timeout_s * 1000)))

    def commit(self, *, wait_for_markers: bool = False,
               keep_children: Iterable[tuple[int, int]] = ()) -> None:
        """Wait for every tracked send/ack, then commit. Returns once the decision is
        durable (or, with wait_for_markers, delivered to every partition). Safe to call
        again. Raises TransactionAborted / TransactionTimedOut when it cannot commit.

        A parent commits the PREPARED children named in `keep_children` ((tc partition,
        sequence) pairs) with it, and every other child is aborted in the same decision;
        `kept_children` then holds what the coordinator kept (also when this commit is a
        retry of one that already happened)."""
        if self._ended == "committed":
            return
        if self._ended == "aborted":
            raise errors.error_for("TRANSACTION_ABORTED", f"transaction {self._name} was "
                                   "aborted; it cannot commit")
        with self._lock:
            self._committing = True
        turn = self._take_turn()
        try:
            try:
                self._wait_pending()
            except errors.AtomlogClientError:
                self.abort()
                raise
            with self._switch_lock:
                kept, self._kept = self._kept, None
                if kept is not None and (kept.partitions or kept.acks):
                    self._one_call_running.acquire()  # abort() waits for its outcome
            if kept is not None and (kept.partitions or kept.acks):
                try:
                    self._commit_one_call(kept, wait_for_markers)
                finally:
                    self._one_call_running.release()
                return
        finally:
            if self._commit_unknown and self._ended is None:
                # The outcome is unknown and a retry (commit() again) may still stage
                # this transaction's records: the producer's next commits wait for it,
                # else they reach a partition before it (chaos seed 1903's
                # reordered-writes). abort() releases the turn; past the transaction's
                # timeout (and a margin) the coordinator can no longer commit it.
                turn.hold(self._began + self.timeout_s + _TURN_HOLD_MARGIN_S)
            else:
                turn.release()  # done, failed, or not a one-call commit: the next may go
        if self._commit_unopened():
            return
        reply = self._end(partition_pb2.TXN_DECISION_COMMIT, wait_for_markers,
                          [common_pb2.TxnId(tc_partition=t, sequence=q) for t, q in keep_children])
        self.kept_children = list(reply.kept_child_txn_ids)
        self._ended = "committed"
        if wait_for_markers and reply.state != S.TXN_STATE_COMMITTED:
            self._wait_for_markers()

    def _wait_for_markers(self) -> None:
        """commit(wait_for_markers=True) answered COMMITTING: the coordinator's own wait for
        the markers ended with the call's deadline (a partition server slow or restarting).
        The commit is decided; its rows are readable only once the markers land, which the
        caller asked to wait for (a Spark write returns, and a read planned right after it
        would miss them). So wait on, polling, up to the transaction's timeout again;
        then log that the markers are late and return: raising would tell the caller the
        commit failed, and a caller that redoes the work would write it twice."""
        bound_s = max(self.timeout_s, self._coordinators.client.request_timeout_s)
        deadline = time.monotonic() + bound_s
        backoff = Backoff(initial_s=0.05, maximum_s=1.0)
        attempt = 0
        while time.monotonic() < deadline:
            attempt += 1
            try:
                if self.state() == "COMMITTED":
                    return
            except errors.AtomlogClientError as error:
                if error.reason == "UNKNOWN_TRANSACTION":
                    return  # finished, and forgotten since (its TC partition's bound)
                if not error.retriable:
                    raise
            time.sleep(min(backoff.delay(attempt), max(0.0, deadline - time.monotonic())))
        _log.warning("transaction %s committed, but its markers were not all delivered "
                     "within %.0f s: readers may not see its records yet", self._name, bound_s)

    def commit_async(self, *, wait_for_markers: bool = False) -> concurrent.futures.Future:
        """Begin commit() on one of the client's commit threads and return at once: the
        future's result() is None once the transaction committed, or raises what commit()
        would have raised. From this call on the transaction takes no new sends or acks.
        The caller can go on producing in its next transaction meanwhile (one producer may
        have many transactions open) instead of waiting for the last acks and the
        coordinator. It does not make a CPU-bound producer faster: the commit runs on a
        thread of the same process (bench/transactions.py measures both)."""
        with self._lock:
            if self._ended is None:
                self._committing = True
        # The turn is taken here, not on a commit thread (they start in any order), and
        # with the submit under one lock: the executor runs commits in the order of their
        # turns, so a commit thread never waits for a turn queued behind it.
        with _SUBMITS:
            self._take_turn()
            return self._coordinators.client.commit_executor().submit(
                self.commit, wait_for_markers=wait_for_markers)

    def _take_turn(self, kept: _Kept | None = None) -> _in_turn:
        """This one-call commit's turn among the commits of its records' producers: taken
        once, at the first commit() or commit_async() (kept records no longer change
        then); a transaction that keeps no records takes an empty one."""
        with self._switch_lock:
            if self._turn is None:
                kept = kept or self._kept
                producers = ({id(part.producer): part.producer
                              for part in kept.partitions.values()}.values()
                             if kept is not None else ())
                self._turn = _in_turn(producers, self.tc_partition,
                                      movable=self._movable and kept is not None)
                if self._turn.tc_partition != self.tc_partition:  # nothing was sent yet
                    self.tc_partition = self._turn.tc_partition
                    self._new_txn_key = _key_for(self.tc_partition,
                                                 self._coordinators.tc_partition_count())
            return self._turn

    def abort(self) -> None:
        """Abort (safe to call again, and after the coordinator aborted it itself). While
        a one-call commit of it is under way (commit_async() on another thread), waits
        for that commit's outcome first: raises TransactionAlreadyCommitted if it
        committed, as for a transaction that committed on the ordinary path."""
        if self._ended == "aborted":
            return
        # Before, abort() found nothing kept (the commit had taken it) and nothing opened,
        # said "aborted" at once, and the commit under way committed all the same (or,
        # its outcome unknown, was never made sure of).
        with self._one_call_running:
            pass
        if self._ended == "committed":
            raise errors.error_for("TRANSACTION_ALREADY_COMMITTED",
                                   f"transaction {self._name} committed before abort()")
        if self._ended == "aborted":
            return
        with self._switch_lock:
            kept, self._kept = self._kept, None
            turn = self._turn
        if kept is not None and self._commit_unknown:
            try:
                self._abort_one_call(kept)
            finally:
                # Released once settled (aborted for good, or found committed). While it
                # stays unknown (the abort's own call failed) the turn stays held, to its
                # deadline: a later commit() may still stage the records, and the
                # producer's next commits must not pass them (before, it was released
                # first).
                if turn is not None and self._ended is not None:
                    turn.release()
            return
        if turn is not None:
            turn.release()  # a commit that will not run lets the next one go
        if kept is not None:  # one-call: nothing reached any server
            kept.fail(errors.error_for("TRANSACTION_ABORTED", f"transaction {self._name} "
                                       "was aborted"))
        with self._open_lock:
            if self._txn_id is None:  # never opened: nothing to abort anywhere
                self._ended = "aborted"
                return
        # A transaction that acked waits for its ABORT markers (bounded by the call's
        # deadline): the marker is what releases its pending acks, and until it lands an
        # ack of the same messages in the next transaction would be refused as a
        # TRANSACTION_CONFLICT. Without acks, the decision durable is enough.
        with self._lock:
            acked = bool(self._subscriptions)
        try:
            self._end(partition_pb2.TXN_DECISION_ABORT, acked)
        except (errors.TransactionAborted, errors.TransactionTimedOut):
            pass  # already aborted: what we wanted
        self._ended = "aborted"

    def state(self) -> str:
        """The coordinator's view: OPEN, PREPARED, COMMITTING, COMMITTED, ABORTING, ABORTED.
        A lazy transaction the coordinator has not heard of answers from here: OPEN, or
        how it ended (COMMITTED/ABORTED) if it ended before its first write."""
        if self._txn_id is None:
            return {"committed": "COMMITTED", "aborted": "ABORTED"}.get(self._ended, "OPEN")
        reply = self._call("GetTxnStatus", S.GetTxnStatusRequest(txn_id=self.txn_id))
        return _STATE_NAMES.get(reply.state, "UNSPECIFIED")

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    # ------------------------------------------------------------------ plumbing
    def _commit_unopened(self) -> bool:
        """Commit a lazy transaction that nothing was written or acked in: there is nothing
        to commit, so no call is made (True); past its timeout it is timed out instead,
        as the coordinator would have done. False once it is open."""
        with self._open_lock:
            if self._txn_id is not None:
                return False
            if time.monotonic() - self._began > self.timeout_s:
                self._ended = "aborted"
                raise errors.error_for("TRANSACTION_TIMED_OUT", "the transaction's timeout of "
                                       f"{self.timeout_s} s ran out before it was committed")
            self._ended = "committed"
            return True

    def _end(self, decision: int, wait_for_markers: bool, children=()):
        stream = self._stream if decision == partition_pb2.TXN_DECISION_COMMIT else None
        return self._call("EndTxn", S.EndTxnRequest(txn_id=self.txn_id, decision=decision,
                                                    wait_for_markers=wait_for_markers,
                                                    children_to_keep=children,
                                                    session=self.session, stream=stream))

    def _wait_pending(self) -> None:
        with self._lock:
            if not self._flushers and not self._pending:
                return  # (a one-call transaction's: its records are kept, not sent)
            flushers = list(self._flushers)
        for flush in flushers:
            flush(self)
        with self._lock:
            pending, self._pending = self._pending, []
        deadline = time.monotonic() + self.timeout_s
        first_error = None
        for future in pending:
            try:
                future.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise errors.error_for("REQUEST_TIMED_OUT", f"sends of transaction {self._name} "
                                       f"were not acknowledged in {self.timeout_s} s") from None
            except Exception as error:  # noqa: BLE001 — the first failure is raised
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def _call(self, method: str, request):
        if self.session is not None and hasattr(request, "session") and \
                not request.HasField("session"):
            request.session.CopyFrom(self.session)
        deadline = time.monotonic() + max(self.timeout_s, self._coordinators.client.request_timeout_s)
        try:
            return self._coordinators.call(self.tc_partition, method, request, deadline)
        except errors.ProducerFenced:
            if self._on_fenced is not None:
                self._on_fenced()
            raise

    def _check_open(self) -> None:
        if self._ended is not None:
            raise errors.error_for("TRANSACTION_NOT_OPEN", f"transaction {self._name} is "
                                   f"{self._ended}")

    def _check_accepting(self) -> None:
        """New sends and acks: not once a commit began (registering the partitions of
        what was sent before stays allowed while commit() flushes it)."""
        self._check_open()
        if self._committing:
            raise errors.error_for("TRANSACTION_NOT_OPEN", f"transaction {self._name} is "
                                   "committing: it takes no new sends or acks")

    @staticmethod
    def _raise_item_errors(item_errors) -> None:
        for item in item_errors:
            if item.reason:
                raise errors.error_for(item.reason, item.message, dict(item.metadata))


class KeptBy:
    """The one-call transactions keeping something of one producer or consumer, in the
    order they first did (weak references: a transaction that is gone drops out).
    `switch_all()` sends what they keep — producer.flush(), consumer.describe()/reset(),
    which promise server state that includes it."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}
        # Bumped whenever transactions are dropped (switch_all, the pruning in remember):
        # a caller that skips remember() for the transaction it told last (the producer's
        # send(), _kept_last) tells it again once this moved.
        self.drops = 0

    def remember(self, txn: Transaction) -> None:
        ref = self._refs.get(id(txn))
        if ref is not None and ref() is txn:
            return
        self._refs.pop(id(txn), None)  # an id reused by a new object
        if len(self._refs) >= 64:  # drop the ones that ended or switched: it stays small
            self.drops += 1
            self._refs = {key: old for key, old in self._refs.items()
                          if (held := old()) is not None and held.one_call}
        self._refs[id(txn)] = weakref.ref(txn)

    def live(self) -> list[Transaction]:
        """Those still keeping something."""
        return [txn for ref in list(self._refs.values())
                if (txn := ref()) is not None and txn.one_call]

    def switch_all(self) -> None:
        txns = self.live()
        self._refs = {}
        self.drops += 1
        for txn in txns:
            txn._switch()


# How long past a transaction's timeout a one-call commit with an unknown outcome keeps
# its producers' next commits waiting (_in_turn.hold): the coordinator refuses to decide it
# after its deadline, which it counts from when the call arrived; a call arrives at most
# its gRPC deadline (at most the transaction's remaining time) after it was sent.
_TURN_HOLD_MARGIN_S = 5.0


class _in_turn:
    """One-call commits holding records of the same producer go out one after the
    other, in the order commit() or commit_async() was called: the producer's records
    then reach each partition in send order also when commit_async() runs several at
    once (as ordinary sends would). The turn is taken when the object is made, in the
    caller's thread (the commit threads may start in any order), under one lock, so the
    order is total (no cycle between transactions of several producers); wait_before()
    (or `with`) waits for the turns before it, and release() (or leaving the `with`) lets
    the next go; hold() keeps the turn of a commit with an unknown outcome, which a retry
    may still stage, until released or its transaction's timeout is past."""

    _taken = 0  # turns taken so far (their order)

    def __init__(self, producers, tc_partition: int | None = None, movable: bool = False):
        """`tc_partition`: the commit's; with `movable`, that of a commit before it still
        under way, if any (so the carpool can carry both)."""
        self.done = _TurnEnd()
        self.before: list[_in_turn] = []
        self.held_until: float | None = None  # time.monotonic(); see hold()
        with _TURNS:
            _in_turn._taken += 1
            self.order = _in_turn._taken
            for producer in producers:
                previous = getattr(producer, "_one_call_turn", None)
                # (A released turn is over for good: nothing waits for it. A producer
                # committing one transaction after another finds its last one released.)
                if previous is not None and not previous.done.is_set:
                    self.before.append(previous)
                producer._one_call_turn = self
            self.tc_partition = tc_partition
            if movable and self.before:
                self.tc_partition = next(
                    (previous.tc_partition for previous in self.before
                     if previous.tc_partition is not None and not previous.over()),
                    tc_partition)

    def wait_before(self) -> None:
        """Wait for the turns before this one (then forgets them: turns must not chain
        up in memory)."""
        for previous in self.before:
            previous.wait()
        self.before = []

    def __enter__(self):
        self.wait_before()
        return self

    def over(self) -> bool:
        """Released, or past the time a held turn is held to."""
        held_until = self.held_until
        return self.done.done() or (held_until is not None and time.monotonic() >= held_until)

    def wait(self) -> None:
        """Until released, or past the time a held turn is held to."""
        while not self.done.done():
            held_until = self.held_until
            if held_until is not None and time.monotonic() >= held_until:
                return
            self.done.wait(0.5)

    def hold(self, until: float) -> None:
        """Keep the turn after a commit with an unknown outcome (commit() may retry it)
        until it is released or `until` (time.monotonic()) passes."""
        self.held_until = until

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        self.done.set()


class _TurnEnd:
    """The end of a turn (_in_turn.done): set once; wait() and callbacks, as a
    concurrent.futures.Future's result would give them, but made for the cost of a few
    attributes: a Future builds a Condition (and its lock) per turn, and one turn is
    taken per transaction. Its threading.Event is made only when a thread waits before
    the turn ends (rare: a producer's commits one after another find their turns
    before them ended). Settled under _TURNS, as _in_turn.release did."""

    __slots__ = ("is_set", "_event", "_callbacks")

    def __init__(self) -> None:
        self.is_set = False
        self._event: threading.Event | None = None
        self._callbacks: list | None = None

    def done(self) -> bool:
        return self.is_set

    def set(self) -> None:
        with _TURNS:
            if self.is_set:
                return
            self.is_set = True
            event, callbacks = self._event, self._callbacks
            self._callbacks = None
        if event is not None:
            event.set()
        for callback in callbacks or ():
            try:
                callback(self)
            except Exception:  # noqa: BLE001 — as a Future's callbacks: logged, not raised
                _log.exception("a callback of a turn's end failed")

    def add_done_callback(self, callback) -> None:
        """callback(self) once set: now if it is, else on the thread that sets it."""
        with _TURNS:
            if not self.is_set:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        callback(self)

    def wait(self, timeout_s: float) -> bool:
        """Whether it is set, waiting up to `timeout_s` for it."""
        if self.is_set:
            return True
        with _TURNS:
            if self.is_set:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout_s)


class _Seat:
    """A one-call commit waiting in the carpool: its request and, once a call carried
    it, the answer (reply, refusal, or the failure of the whole call)."""

    __slots__ = ("txn", "turn", "request", "taken", "answer")

    def __init__(self, txn: "Transaction", turn: _in_turn, request):
        self.txn = txn
        self.turn = turn
        self.request = request
        self.taken = False  # a call carries it (its own, or another commit's)
        self.answer: tuple | None = None  # (reply, refusal, call failure)


class _Carpool:
    """One-call commits waiting for their turn leave together (one per Client).

    A commit whose turn comes (every commit before it of the same producers ended)
    takes with it the commits queued behind it whose turns wait only for it or for
    commits it takes, that belong to no session and to the same TC partition, in turn
    order, and sends them all in ONE CommitTxns call, which stages them in that order
    and decides them in one append (coordinator.proto). Alone it sends CommitTxn. So a producer pipelining commits
    (commit_async) has one call in flight at a time, as before, but what queued
    meanwhile leaves in the next call instead of one call after another: the call in
    flight is the linger, and the records still reach each partition in send order."""

    MAX_COMMITS = 64  # CommitTxns' bound (coordinator.proto)
    MAX_BYTES = 4 << 20

    def __init__(self, client):
        self._client = client
        self._cond = threading.Condition()
        self._waiting: list[_Seat] = []  # in turn order
        self._chained = True  # False once a coordinator answered CommitTxns UNIMPLEMENTED
        self.calls = 0  # CommitTxns calls made (tests, benchmarks)
        self.most_carried = 0  # the most commits one CommitTxns call carried

    def _poke(self, _future=None) -> None:
        with self._cond:
            self._cond.notify_all()

    def ride(self, txn: "Transaction", turn: _in_turn, request):
        """Wait for the turn, then send the commit, alone or carrying others; or be
        carried. Returns (reply, None) or (None, refusal of this commit); raises the
        failure of the call."""
        seat = _Seat(txn, turn, request)
        for previous in turn.before:
            if not previous.over():  # (one over already needs no wake-up: checked below)
                previous.done.add_done_callback(self._poke)
        with self._cond:
            index = len(self._waiting)
            while index and self._waiting[index - 1].turn.order > turn.order:
                index -= 1
            self._waiting.insert(index, seat)
            while seat.answer is None:
                if not seat.taken and (not turn.before
                                       or all(previous.over() for previous in turn.before)):
                    seat.taken = True
                    self._waiting.remove(seat)
                    riders = self._riders(seat)
                    break
                self._cond.wait(0.5)  # held turns end by the clock
            else:
                return self._answer(seat)
        answers = None
        try:
            answers = self._send(seat, riders)
        finally:
            if answers is None:  # a bug: those carried must not wait forever
                answers = [(None, None, errors.error_for("INTERNAL", "the call carrying "
                                                         "this commit failed"))] * (
                    1 + len(riders))
            with self._cond:
                for rider, answer in zip(riders, answers[1:]):
                    rider.answer = answer
                if riders or self._waiting:  # (else no one waits: a Python-level call less)
                    self._cond.notify_all()
        seat.answer = answers[0]
        return self._answer(seat)

    @staticmethod
    def _answer(seat: _Seat):
        reply, refusal, failure = seat.answer
        if failure is not None:
            raise failure
        return reply, refusal

    def _riders(self, driver: _Seat) -> list[_Seat]:
        """The waiting commits `driver` takes along (under the lock)."""
        if not self._chained or driver.txn.session is not None or not self._waiting:
            return []
        k = driver.txn.tc_partition
        chosen = {id(driver.turn)}
        riders: list[_Seat] = []
        size = driver.request.ByteSize()
        for seat in self._waiting:
            if len(riders) + 1 >= self.MAX_COMMITS:
                break
            if seat.taken or seat.txn.session is not None or seat.txn.tc_partition != k:
                continue
            if not all(id(previous) in chosen or previous.over()
                       for previous in seat.turn.before):
                continue
            request_size = seat.request.ByteSize()
            if size + request_size > self.MAX_BYTES:
                continue
            seat.taken = True
            chosen.add(id(seat.turn))
            riders.append(seat)
            size += request_size
        for rider in riders:
            self._waiting.remove(rider)
        return riders

    def _send(self, driver: _Seat, riders: list[_Seat]) -> list[tuple]:
        """The call; an answer (reply, refusal, call failure) per commit, driver first."""
        try:
            if not riders:
                return [(driver.txn._call("CommitTxn", driver.request), None, None)]
            self.calls += 1
            self.most_carried = max(self.most_carried, 1 + len(riders))
            reply = driver.txn._call("CommitTxns", S.CommitTxnsRequest(
                commits=[driver.request, *(rider.request for rider in riders)]))
        except errors.AtomlogClientError as failure:
            if riders and failure.reason == "UNIMPLEMENTED":
                # A coordinator without CommitTxns: nothing was done; each goes alone.
                self._chained = False
                again = errors.error_for("EARLIER_COMMIT_FAILED", "CommitTxns is not "
                                         "implemented by the coordinator")
                return [(None, again, None)] * (1 + len(riders))
            return [(None, None, failure)] * (1 + len(riders))
        if len(reply.results) != 1 + len(riders):
            failure = errors.error_for("INTERNAL", f"CommitTxns answered {len(reply.results)} "
                                       f"results for {1 + len(riders)} commits")
            return [(None, None, failure)] * (1 + len(riders))
        return [(None, errors.error_for(result.error.reason, result.error.message,
                                        dict(result.error.metadata)), None)
                if result.error.reason else (result.response, None, None)
                for result in reply.results]


_CARPOOLS = threading.Lock()


def _carpool_of(client) -> _Carpool:
    carpool = getattr(client, "_one_call_carpool", None)
    if carpool is None:
        with _CARPOOLS:
            carpool = getattr(client, "_one_call_carpool", None)
            if carpool is None:
                carpool = client._one_call_carpool = _Carpool(client)
    return carpool


class _Keys:
    """Idempotency keys no other process or client makes: a random 128-bit prefix per
    process (made again in a forked child, which would otherwise repeat its parent's
    keys) and a counter. A uuid4 per key read the kernel's random source each time, and
    `_key_for` tries about 16 keys per transaction: py-spy put a third of a pipelining
    worker's busy samples there (bench/transactions.py --only-ctp --profile-worker),
    though the worker's CPU fell by less than a tenth without them."""

    def __init__(self):
        self.renew()

    def renew(self) -> None:
        self.prefix = f"sdk-{uuid.UUID(bytes=os.urandom(16))}-"
        self.counter = itertools.count()  # next() is atomic: no lock needed

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter):x}"


_KEYS = _Keys()
os.register_at_fork(after_in_child=_KEYS.renew)


def _random_key() -> str:
    return _KEYS.next()


# spark_client.producer's RecordFuture and _Outcome, for the records a transaction keeps.
# That module imports this one, so they are taken at the first keep, not at import (an
# import statement on every kept record cost 0.6 us).
_PRODUCER_TYPES: tuple | None = None


def _producer_types() -> tuple:
    global _PRODUCER_TYPES
    from spark_client.producer import RecordFuture, _Outcome
    _PRODUCER_TYPES = (RecordFuture, _Outcome)
    return _PRODUCER_TYPES


def _key_for(tc_partition: int, count: int) -> str:
    """A random idempotency key that hashes to tc_partition (about `count` tries)."""
    while True:
        key = _random_key()
        if tc_partition_for(key, count) == tc_partition:
            return key
