"""The durable log of one TC partition: partition k of the internal topic `__txn_log`,
on the partition servers, written by the TC partition's current owner only.

Fencing. The owner writes as an idempotent producer whose producer id is fixed per TC
partition (`/tc/<k>` in ZooKeeper) and whose producer epoch IS its coordinator epoch.
Taking a lease bumps the epoch, and the new owner's first append (a fence record) makes
the partition server reject every later append of an older epoch with PRODUCER_FENCED: a
deposed or paused owner can no longer change the log. An append whose outcome is unknown
is retried as the same batch (same sequence), so the server answers it from its
de-duplication window instead of appending it twice.

Record values in the log (record keys tell them apart):

    key None        a transaction record (coordinator/records.py)
    key "fence"     written first by each new owner: JSON {"coordinator", "epoch"}
    key "snapshot"  one chunk of a snapshot of the TC partition: chunk header
                    (snapshot_id u64, index u32, count u32, little-endian) then bytes of
                    TcPartitionCore.snapshot(); a snapshot is all `count` chunks of one
                    id in consecutive batches, and it is used only when complete

Everything below the first chunk of a durable, complete snapshot can be deleted
(DeleteRecords, whole segments): the log stays bounded by the snapshot interval.

Appends of every TC partition of a process that go to the same partition server share
calls (AppendChannel): one call in flight per server, and whatever TC partitions queue
meanwhile leaves together in the next one — 16 TC partitions whose logs live on 3
servers cost at most 3 calls at a time, however many transactions they decide. While
the process's staging calls to that server are busy, an append rides with them instead
(StageTxnRequest.appends, coordinator/staging.py): a decision leaves with the one-call
transactions' parts queued for the same server, in one call and one write-ahead round
there; otherwise (and for snapshot chunks, and a server that does not take them) it goes
by a Produce call. When the
partition server is this process (the combined server), an append is queued on its
partition's owner at once instead (PartitionServicer.produce_here): appends of different
TC partitions go to different owners anyway, whose fsyncs one event-loop turn submits
together, so the queue would share nothing and cost a task's hop and a request's
messages (docs/benchmarks.md, "TC-log appends on their owners").
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from atomlog.v1 import common_pb2, partition_pb2

from coordinator import metrics as coordinator_metrics
from coordinator.routing import PARTITION_SERVICE, PartitionRoutes
from partition_server.record_batch import (
    Record,
    decode_records,
    encode_batch,
    iter_batches,
)
from services import local, metrics
from services.backoff import Backoff
from services.batching import PerDestination
from services.errors import AtomlogError, from_item, from_rpc_error
from services.logs import event
from services.topics import TXN_LOG_TOPIC

log = logging.getLogger("atomlog.coordinator.txn_log")

_PRODUCE_HERE = metrics.LOCAL_CALLS.labels(f"/{PARTITION_SERVICE}/Produce")
_ON_THE_OWNER = coordinator_metrics.LOG_PRODUCES.labels("owner")
_BY_CALL = coordinator_metrics.LOG_PRODUCES.labels("call")

TOPIC = TXN_LOG_TOPIC
KEY_FENCE = b"fence"
KEY_SNAPSHOT = b"snapshot"
SNAPSHOT_CHUNK = struct.Struct("<QII")  # snapshot_id, index, count
SNAPSHOT_CHUNK_BYTES = 512 << 10  # well inside the default 1 MiB batch limit
READ_MAX_BYTES = 8 << 20
SEQUENCE_MAX = (1 << 31) - 1  # batch header base_sequence is int32
# Item reasons after which the same batch may be sent again (nothing was appended, or
# the outcome is unknown and the retry is de-duplicated).
RETRY_REASONS = frozenset({
    "NOT_PARTITION_OWNER", "PARTITION_LOADING", "SERVER_UNAVAILABLE", "REQUEST_TIMED_OUT",
    "SHUTTING_DOWN", "RESOURCE_EXHAUSTED", "DATA_LOSS", "UNKNOWN_TOPIC_OR_PARTITION",
    "INTERNAL",
})
# Of those, the reasons after which the batch may be in the log although the call failed
# (a timeout, a connection lost mid-call, a server failing or stopping under the write).
UNKNOWN_OUTCOME_REASONS = frozenset({"REQUEST_TIMED_OUT", "SERVER_UNAVAILABLE", "INTERNAL",
                                     "DATA_LOSS", "SHUTTING_DOWN"})
_BACKOFF = Backoff(initial_s=0.02, maximum_s=1.0)


def after_failed_append(reason: str, outcome_unknown: bool) -> str:
    """What an append does after an attempt of its batch failed with `reason`, given
    whether an earlier attempt's outcome is unknown: "retry" (the same batch: nothing was
    appended, or the retry is de-duplicated by the batch's producer sequence), "reject"
    (refused for good: nothing of it is in the log, its transitions roll back) or "reload"
    (refused now, but an earlier attempt may be in the log, where a refusal of the retry
    cannot tell, e.g. NOT_ENOUGH_REPLICAS after a timed-out attempt that the leader did
    append: rolling back would leave this owner's state behind its own log, and its next
    batch would reuse the sequence of records that are there. The log decides: the owner
    gives the TC partition up and it is loaded again from the log)."""
    if reason == "PRODUCER_FENCED":
        return "reload"
    if reason in RETRY_REASONS:
        return "retry"
    return "reload" if outcome_unknown else "reject"
ROUTING_REASONS = frozenset({"NOT_PARTITION_OWNER", "UNKNOWN_TOPIC_OR_PARTITION",
                             "SERVER_UNAVAILABLE"})


class Fenced(Exception):
    """A newer owner has written to the log: this owner's lease is gone."""


class AppendRejected(Exception):
    """The partition server refused the batch for good: it was not appended."""

    def __init__(self, error: AtomlogError):
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True, slots=True)
class LogEntry:
    offset: int
    key: bytes | None
    value: bytes


def _topic_partition(k: int) -> common_pb2.TopicPartition:
    return common_pb2.TopicPartition(topic=TOPIC, partition=k)


class AppendChannel:
    """Produce calls shared by the TC logs of a process, per partition server
    (services/batching.py): appends queued while a call to that server is in flight
    leave together in the next one. With a `stager` (the process's staging channel,
    coordinator/staging.py) those to a server its staging calls are busy with ride in
    its queue instead, with the one-call transactions' parts (StageTxnRequest.appends)."""

    def __init__(self, routes: PartitionRoutes, request_timeout_s: float = 5.0,
                 stager=None):
        self.routes = routes
        self.request_timeout_s = request_timeout_s
        self._calls = PerDestination(self._produce, what="TC-log append", max_items=1_000,
                                     max_bytes=8 << 20, size=lambda i: len(i.record_batch))
        self.stager = stager
        if stager is not None:
            stager.produce = self._produce

    async def produce(self, address: str, item: partition_pb2.ProduceItem):
        """The ProduceResult of `item`, sent to `address` with whatever else is queued;
        raises AtomlogError when the call itself failed. When this process hosts
        `address` (the combined server) the item is queued on its partition's owner at
        once (PartitionServicer.produce_here): the owner's group commit is what the
        appends share there, and a queue in front of it would only add a task's hop."""
        here = local.servicer(address, PARTITION_SERVICE)
        if here is not None:
            _PRODUCE_HERE.inc()  # an in-process call, as a LocalStub's would be counted
            _ON_THE_OWNER.inc()
            return await here.produce_here(item, self.request_timeout_s)
        _BY_CALL.inc()
        return await asyncio.shield(self.submit(address, item))

    def submit(self, address: str, item: partition_pb2.ProduceItem) -> asyncio.Future:
        """`item` queued for the next call to `address` (another process) — a staging
        call when the stager takes it (its calls there are busy), else a Produce call:
        the future of its ProduceResult (failing with the call's AtomlogError)."""
        stager = self.stager
        if stager is not None and stager.takes_append(address, item):
            return stager.submit_append(address, item)
        return self._calls.submit(address, item)

    async def _produce(self, address: str, items: list) -> list:
        try:
            response = await self.routes.stub(address).Produce(
                partition_pb2.ProduceRequest(items=items), timeout=self.request_timeout_s)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return list(response.results)

    async def close(self) -> None:
        await self._calls.close()


class TxnLog:
    """Appends and reads of `__txn_log-<k>` for the owner holding coordinator epoch `epoch`.
    One append at a time (the TC partition's writer batches everything queued into it)."""

    def __init__(self, routes: PartitionRoutes, channel: AppendChannel, tc_partition: int,
                 producer_id: int, epoch: int, request_timeout_s: float = 5.0):
        if not 0 < epoch <= 0xFFFE:
            raise ValueError(f"coordinator epoch {epoch} does not fit a producer epoch")
        self.routes = routes
        self.tc_partition = tc_partition
        self.producer_id = producer_id
        self.epoch = epoch
        self.request_timeout_s = request_timeout_s
        self._next_sequence = 0
        self.appends_retried = 0
        self.channel = channel

    # ------------------------------------------------------------------ writing

    async def fence(self, coordinator: str) -> int:
        """The new owner's first append; returns its offset (the log's end before it)."""
        value = json.dumps({"coordinator": coordinator, "epoch": self.epoch}).encode()
        base, _ = await self.append([(KEY_FENCE, value)])
        return base

    def append_here(self, entries: list[tuple[bytes | None, bytes]]):
        """Start appending (key, value) records as one batch in the caller's step, with
        no task (a TC partition's appends, coordinator/tc_partition.py): on this
        process's owner of the log's partition, or queued on the AppendChannel's call to
        the partition server the routes' cache names. The future of a one-element result
        list (Appended, or an AtomlogError), or of the ProduceResult of the call (it fails
        with the call's AtomlogError); None when that cannot be done now (not serving
        here, the partition's server unknown; the caller appends with `append`). Once it
        succeeds the caller calls `appended(len(entries))`; when it fails, it calls
        `append(entries, failed=the error)`, which goes on as after a failed attempt of
        the same batch (same sequence)."""
        if self._next_sequence + len(entries) > SEQUENCE_MAX:
            return None
        address = self.routes.cached_owner(TOPIC, self.tc_partition)
        if not address:
            return None
        tp = _topic_partition(self.tc_partition)
        here = local.servicer(address, PARTITION_SERVICE)
        if here is None:
            _BY_CALL.inc()
            return self.channel.submit(address, partition_pb2.ProduceItem(
                topic_partition=tp, record_batch=self._batch(entries)))
        outcome = here.queue_produce_here(tp, self._batch(entries))
        if isinstance(outcome, AtomlogError):
            return None
        _ON_THE_OWNER.inc()
        return outcome

    def takes_gathered(self, records: int) -> bool:
        """Whether an `append_here` of `records` records now would be written by this
        process's owner of the log's partition in the caller's gathering, in the
        write-ahead file (PartitionServicer.takes_gathered)."""
        here = self._servicer_here()
        return (here is not None and self._next_sequence + records <= SEQUENCE_MAX
                and here.takes_gathered(_topic_partition(self.tc_partition)))

    def here(self) -> bool:
        """Whether this process hosts the log's partition (by the routes' cache)."""
        return self._servicer_here() is not None

    def _servicer_here(self):
        """This process's partition servicer when it hosts the log's partition (by the
        routes' cache), else None."""
        address = self.routes.cached_owner(TOPIC, self.tc_partition)
        return local.servicer(address, PARTITION_SERVICE) if address else None

    def appended(self, count: int) -> None:
        """An `append_here` of `count` records succeeded."""
        self._next_sequence += count

    def _batch(self, entries: list[tuple[bytes | None, bytes]]) -> bytes:
        return encode_batch([Record(key=k, value=v) for k, v in entries],
                            producer_id=self.producer_id, producer_epoch=self.epoch,
                            base_sequence=self._next_sequence)

    async def append(self, entries: list[tuple[bytes | None, bytes]],
                     failed: AtomlogError | None = None) -> tuple[int, int]:
        """Append (key, value) records as one batch, durably; (base, last) offsets.
        Retries (the same batch) until it is appended or refused for good; raises
        Fenced or AppendRejected. Cancel the task to stop retrying. `failed`: the error
        of an attempt made already (`append_here`), whose outcome this goes on from."""
        if self._next_sequence + len(entries) > SEQUENCE_MAX:
            # 2^31 records under one epoch: fail closed; a reload takes a new epoch.
            raise Fenced("sequence space of this coordinator epoch is used up; reload")
        item = partition_pb2.ProduceItem(topic_partition=_topic_partition(self.tc_partition),
                                         record_batch=self._batch(entries))
        attempt, outcome_unknown = 0, False
        while True:
            if failed is not None:
                error, result, failed = failed, None, None
            else:
                try:
                    address = await self.routes.owner(TOPIC, self.tc_partition)
                    result = await self.channel.produce(address, item)
                    outcome = append_outcome(result)
                    error = outcome if isinstance(outcome, AtomlogError) else None
                except AtomlogError as raised:
                    error, result = raised, None
            if error is None:
                self._next_sequence += len(entries)
                return result.base_offset, result.last_offset
            verdict = after_failed_append(error.reason, outcome_unknown)
            if verdict == "reload":
                raise Fenced(error.message if error.reason == "PRODUCER_FENCED" else
                             f"TC log append refused ({error.reason}: {error.message}) after "
                             "an attempt whose outcome is unknown; loading again from the log")
            if verdict == "reject":
                raise AppendRejected(error)
            outcome_unknown = outcome_unknown or error.reason in UNKNOWN_OUTCOME_REASONS
            attempt += 1
            self.appends_retried += 1
            if attempt in (1, 10) or attempt % 100 == 0:
                event(log, "TC log append failed; retrying the same batch",
                      tc_partition=self.tc_partition, attempt=attempt, reason=error.reason,
                      detail=error.message)
            await self._backoff(attempt, error)

    # ------------------------------------------------------------------ reading

    async def offsets(self) -> tuple[int, int]:
        """(log start offset, high watermark)."""
        request = partition_pb2.ListOffsetsRequest(items=[partition_pb2.ListOffsetsItem(
            topic_partition=_topic_partition(self.tc_partition),
            spec=partition_pb2.OFFSET_SPEC_EARLIEST)])
        attempt = 0
        while True:
            response = await self._retrying("ListOffsets", request)
            item = response.results[0]
            if not item.error.reason:
                return item.log_start_offset, item.high_watermark
            attempt += 1
            await self._backoff(attempt, AtomlogError(item.error.reason, item.error.message))

    async def read(self, start: int, end: int) -> AsyncIterator[LogEntry]:
        """Every record in [start, end), in order, CRC-checked."""
        offset = start
        attempt = 0
        while offset < end:
            request = partition_pb2.FetchRequest(
                items=[partition_pb2.FetchItem(topic_partition=_topic_partition(self.tc_partition),
                                               fetch_offset=offset, max_bytes=READ_MAX_BYTES)],
                isolation_level=common_pb2.ISOLATION_LEVEL_READ_UNCOMMITTED,
                max_bytes=READ_MAX_BYTES, max_wait_ms=0)
            response = await self._retrying("Fetch", request)
            item = response.results[0]
            if item.error.reason:
                error = AtomlogError(item.error.reason, item.error.message,
                                     dict(item.error.metadata))
                if error.reason not in RETRY_REASONS:
                    raise error
                attempt += 1
                await self._backoff(attempt, error)
                continue
            attempt = 0
            if not item.record_batches:
                raise AtomlogError("INTERNAL", f"{TOPIC}-{self.tc_partition}: no batch at "
                                   f"offset {offset} below the end {end}")
            view = memoryview(item.record_batches)
            for position, header in iter_batches(view):
                for record in decode_records(view[position:position + header.size]):
                    if record.offset >= end:
                        return
                    if record.offset >= offset:
                        yield LogEntry(record.offset, record.key, record.value or b"")
            offset = max(offset, item.next_fetch_offset)

    async def delete_before(self, offset: int) -> int:
        """Delete whole segments below `offset`; returns the new log start offset."""
        request = partition_pb2.DeleteRecordsRequest(items=[partition_pb2.DeleteRecordsItem(
            topic=TOPIC, partition=self.tc_partition, before_offset=offset)])
        response = await self._retrying("DeleteRecords", request, attempts=5)
        item = response.results[0]
        if item.error.reason:
            raise AtomlogError(item.error.reason, item.error.message, dict(item.error.metadata))
        return item.log_start_offset

    # ------------------------------------------------------------------ plumbing

    async def _call(self, method: str, request):
        address = await self.routes.owner(TOPIC, self.tc_partition)
        try:
            return await getattr(self.routes.stub(address), method)(
                request, timeout=self.request_timeout_s)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    async def _retrying(self, method: str, request, attempts: int = 0):
        """A read-only call, retried on retriable failures (`attempts` 0: for ever)."""
        attempt = 0
        while True:
            try:
                return await self._call(method, request)
            except AtomlogError as error:
                attempt += 1
                if not error.retriable and error.reason not in RETRY_REASONS:
                    raise
                if attempts and attempt >= attempts:
                    raise
                await self._backoff(attempt, error)

    async def _backoff(self, attempt: int, error: AtomlogError) -> None:
        if error.reason in ROUTING_REASONS:
            await self.routes.refresh(force=attempt > 1)
        await asyncio.sleep(_BACKOFF.delay(attempt))


def append_outcome(result):
    """An append's outcome from what its future gave (`TxnLog.append_here`) or its call
    answered: this process's owner's one-element list (Appended or an AtomlogError), or a
    partition server's ProduceResult, its error as the AtomlogError it carries (an unknown
    reason as INTERNAL, `from_item`)."""
    if isinstance(result, list):
        [outcome] = result
        return outcome
    return from_item(result.error) if result.error.reason else result


def snapshot_chunks(snapshot_id: int, data: bytes,
                    chunk_bytes: int = SNAPSHOT_CHUNK_BYTES) -> list[bytes]:
    count = max(1, -(-len(data) // chunk_bytes))
    return [SNAPSHOT_CHUNK.pack(snapshot_id, index, count)
            + data[index * chunk_bytes:(index + 1) * chunk_bytes]
            for index in range(count)]


# What a snapshot chunk's batch holds besides the chunk: the batch's header, the record's
# fields and key, the chunk's own header (generously).
SNAPSHOT_BATCH_OVERHEAD = 512


def chunk_bytes_within(error: AtomlogError, chunk_bytes: int) -> int | None:
    """A snapshot chunk size whose batches fit under the limit a BATCH_TOO_LARGE refusal
    names (partition.max_batch_bytes of the partition server holding the TC log, which
    may be below SNAPSHOT_CHUNK_BYTES), when it is smaller than `chunk_bytes`; else None
    (another refusal, or no limit named)."""
    if error.reason != "BATCH_TOO_LARGE":
        return None
    try:
        limit = int(error.metadata.get("limit", ""))
    except ValueError:
        return None
    smaller = max(limit - SNAPSHOT_BATCH_OVERHEAD, limit // 2)
    return smaller if 0 < smaller < chunk_bytes else None


class SnapshotAssembler:
    """Collects snapshot chunks while a log is read; `add` returns the snapshot's bytes
    once its last chunk arrives in order, None otherwise (an interrupted snapshot — a
    gap, or another id starting — is dropped)."""

    def __init__(self) -> None:
        self._id: int | None = None
        self._parts: list[bytes] = []
        self.first_offset = -1

    def add(self, entry: LogEntry) -> bytes | None:
        if len(entry.value) < SNAPSHOT_CHUNK.size:
            raise AtomlogError("INTERNAL", f"{TOPIC}: snapshot chunk at offset {entry.offset} "
                               "is too short")
        snapshot_id, index, count = SNAPSHOT_CHUNK.unpack_from(entry.value)
        if index == 0:
            self._id, self._parts, self.first_offset = snapshot_id, [], entry.offset
        elif snapshot_id != self._id or index != len(self._parts):
            self._id, self._parts = None, []
            return None
        self._parts.append(entry.value[SNAPSHOT_CHUNK.size:])
        if len(self._parts) == count:
            data = b"".join(self._parts)
            self._id, self._parts = None, []
            return data
        return None
