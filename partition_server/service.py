"""PartitionService: a thin adapter from gRPC to the partition owners.

Validation happens here, before anything is queued: each batch's size, header and
CRC32C (the server never reads records). Batched requests answer per item: one bad
item does not fail the others, and a failed item appended nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass

from atomlog.v1 import common_pb2, partition_pb2, partition_pb2_grpc
from partition_server import copies
from partition_server import metrics as m
from partition_server.coordinator_epochs import MARKERS, STALE_MARKERS, CoordinatorEpochs
from partition_server.cursor_store import validate_subscription_name
from partition_server.lease import LeaseWatch
from partition_server.manager import NotOwner, PartitionManager
from partition_server.owner import (Appended, Marker, MarkerResult, PartitionOwner, State,
                                    written_in_step)
from partition_server.replica import (REPLICATE_MANY_MAX_BYTES, REPLICATE_MANY_MAX_PARTITIONS,
                                      SESSION_EPOCH_MAX, ReplicateSession, replicate_many)
from partition_server.read_wire import SplicedResponse
from partition_server.replicate_wire import ReplicateItem, ReplicateManyAnswer
from partition_server.record_batch import (NO_PRODUCER_ID, NO_SEQUENCE, BatchHeader,
                                           ControlType, TxnId, iter_batches, stamp_transaction,
                                           validate_batch)
from partition_server.subscription_cursor import (InitialPosition, resolve_initial_position,
                                                  validate_consumer_id)
from partition_server.verifier import TxnVerifier
from services import acl, auth, clock, failpoints
from services.batching import WhenAllDone, failure_of, observe_failure
from services.errors import AtomlogError
from services.topics import TXN_LOG_TOPIC, validate_topic_name

STATE_ENUM = {
    State.LOADING: partition_pb2.PARTITION_STATE_LOADING,
    State.ONLINE: partition_pb2.PARTITION_STATE_ONLINE,
    State.DATA_LOSS: partition_pb2.PARTITION_STATE_DATA_LOSS,
    State.CLOSED: partition_pb2.PARTITION_STATE_UNSPECIFIED,
}
MAX_ITEMS_PER_REQUEST = 10_000
MAX_DESCRIBED_TRANSACTIONS = 1_000  # open transactions listed by DescribePartition, oldest first
MAX_DESCRIBED_SUBSCRIPTIONS = 1_000  # cursors listed by DescribePartition (DescribeSubscription: any)
MAX_REPLICATE_SESSIONS = 1_024  # followers' ReplicateSessions kept (one per follower server)
# The shortest ack timeout a Receive gets (as subscription.default_ack_timeout_ms's).
MIN_ACK_TIMEOUT_MS = 100


@dataclass(frozen=True)
class SubscriptionSettings:
    """Bounds of the subscription RPCs: the subscription.* settings (services/config.py
    has their meaning; the defaults are theirs)."""

    default_ack_timeout_ms: int = 30_000
    max_ack_timeout_ms: int = 3_600_000
    max_offsets_per_receive: int = 10_000
    max_verified_acks: int = 100_000  # cached (transaction, subscription) verifications

    def __post_init__(self) -> None:
        assert 0 < self.default_ack_timeout_ms <= self.max_ack_timeout_ms, self
        assert self.max_offsets_per_receive >= 1 and self.max_verified_acks >= 1, self


def _cursor_fields(sp, d) -> dict:
    return {"subscription_partition": sp, "cumulative_end_offset": d.cumulative_end,
            "individual_ranges": [partition_pb2.OffsetRange(start_offset=r.start,
                                                            end_offset=r.end)
                                  for r in d.individual_ranges],
            "pending_acks": [partition_pb2.PendingAck(
                txn_id=common_pb2.TxnId(tc_partition=p.txn.tc_partition, sequence=p.txn.sequence),
                cumulative_end_offset=p.cumulative_end,
                individual_ranges=[partition_pb2.OffsetRange(start_offset=r.start,
                                                             end_offset=r.end)
                                   for r in p.ranges]) for p in d.pending_acks],
            "delivered_unacknowledged_count": d.delivered_unacknowledged_count,
            "redelivery_backlog_count": d.redelivery_backlog_count,
            "backlog_records": d.backlog_records}
RESPONSE_OVERHEAD_BYTES = 1 << 20
# DeleteRecords' wait for in-sync followers to delete too (its request's timeout_ms).
DELETE_RECORDS_DEFAULT_WAIT_MS = 30_000
DELETE_RECORDS_MAX_WAIT_MS = 300_000
DELETE_RECORDS_ANSWER_MARGIN_S = 0.2


def _check_copy_position(request: partition_pb2.ReplicateRequest, prefix: str) -> None:
    """A Replicate request's (or ReplicateMany item's) position fields are sane."""
    if request.fetch_offset < 0:
        raise AtomlogError("INVALID_ARGUMENT",
                           f"{prefix}fetch_offset {request.fetch_offset} is negative")
    if request.last_fetched_epoch < -1:
        raise AtomlogError("INVALID_ARGUMENT",
                           f"{prefix}last_fetched_epoch {request.last_fetched_epoch} < -1")
    if request.replica_incarnation <= 0:
        raise AtomlogError("INVALID_ARGUMENT",
                           f"{prefix}replica_incarnation {request.replica_incarnation} must be "
                           "> 0 (the follower's /incarnations zxid)")
    if request.log_start_offset < 0 or request.log_start_offset > request.fetch_offset:
        raise AtomlogError("INVALID_ARGUMENT",
                           f"{prefix}log_start_offset {request.log_start_offset} is not in "
                           f"[0, fetch_offset {request.fetch_offset}]")


def item_error(error: AtomlogError) -> partition_pb2.ItemError:
    return partition_pb2.ItemError(reason=error.reason, message=error.message,
                                   metadata=error.metadata)


# How long DescribeSubscription waits for the in-sync replicas to hold every cursor change
# a replicated leader applied before it shows its cursors.
DESCRIBE_REPLICATED_WAIT_S = 2.0


async def _cursors_replicated_for_reading(owner: PartitionOwner) -> None:
    """A replicated leader shows its cursors only once the cursor high watermark covers
    every change applied to them (docs/replication.md, "Cursors"), as a log read never
    goes past the high watermark: else a leader deposed without knowing it yet (cut off
    from ZooKeeper) shows an ack that never became acknowledged, and its successor then
    shows the cursor lower (chaos run ctp 2302 found that cursor regression). A deposed
    leader's followers have left it, so the wait ends in a retriable refusal.

    The caller reads the cursors right after this returns, with no await between: so
    the check that returns is made against the journal's end as it is then. A wait
    yields to the event loop, and a change staged meanwhile (a marker queued behind this
    request, as after a stall) would otherwise be shown unreplicated (chaos run ctp 2548
    found that cursor regression): LeaderReplication.cursors_readable reads the end
    again at every check. Not past DESCRIBE_REPLICATED_WAIT_S: NOT_ENOUGH_REPLICAS."""
    store = owner.subscriptions.store
    if owner.replication is None or store is None:
        return
    await owner.replication.cursors_readable(lambda: store.appended_end,
                                             time.monotonic() + DESCRIBE_REPLICATED_WAIT_S)
    if owner.subscriptions.store is not store:  # reopened meanwhile
        raise AtomlogError("PARTITION_LOADING", f"subscriptions of {owner.name} were "
                           "reopened; retry", {"retry_after_ms": "200"})


def _refused(tp, error: AtomlogError, bad_batch: bool = True) -> partition_pb2.ProduceResult:
    """The ProduceResult of a batch refused with `error` (counted as a bad batch unless
    `bad_batch` is False)."""
    if bad_batch:
        m.BAD_BATCHES.labels(error.reason).inc()
    return partition_pb2.ProduceResult(topic_partition=tp, error=item_error(error),
                                       base_offset=-1, last_offset=-1)


def _produce_result(tp, owner: PartitionOwner,
                    outcome: Appended | AtomlogError) -> partition_pb2.ProduceResult:
    """The ProduceResult of a batch its owner answered with `outcome`."""
    if not isinstance(outcome, Appended):
        return _refused(tp, outcome)
    return partition_pb2.ProduceResult(
        topic_partition=tp, base_offset=outcome.base_offset, last_offset=outcome.last_offset,
        log_append_time_unix_ms=outcome.log_append_time_ms,
        log_start_offset=owner.log.log_start_offset if owner.log else -1,
        duplicate=outcome.duplicate)


def _timed_out(tp, timeout_s: float) -> partition_pb2.ProduceResult:
    """The ProduceResult of a write not answered in time (not a bad batch)."""
    return _refused(tp, AtomlogError("REQUEST_TIMED_OUT", f"the write was not answered "
                                     f"within {timeout_s} s (its outcome is unknown)"),
                    bad_batch=False)


def _require_items(items, what: str, field: str | None = None) -> None:
    """At least one item, at most MAX_ITEMS_PER_REQUEST (INVALID_ARGUMENT; naming the
    repeated `field` in the metadata when given)."""
    metadata = {"field": field} if field else {}
    if not items:
        raise AtomlogError("INVALID_ARGUMENT", f"{what} has no items", metadata)
    if len(items) > MAX_ITEMS_PER_REQUEST:
        raise AtomlogError("INVALID_ARGUMENT",
                           f"{what} has {len(items)} items; at most {MAX_ITEMS_PER_REQUEST}",
                           metadata)


class PartitionServicer(partition_pb2_grpc.PartitionServiceServicer):
    def __init__(self, manager: PartitionManager, metadata_store, max_batch_bytes: int,
                 fetch_max_wait_ms: int, fetch_default_max_bytes: int, max_message_bytes: int,
                 coordinator_epochs: CoordinatorEpochs | None = None,
                 verifier: TxnVerifier | None = None,
                 subscriptions: SubscriptionSettings = SubscriptionSettings(),
                 lease: LeaseWatch | None = None, skip_quiet_partitions: bool = True,
                 scrubber=None):
        self.manager = manager
        self.scrubber = scrubber  # None: ScrubPartition answers UNIMPLEMENTED
        self.lease = lease  # None: deliveries never wait for a session check
        self.subscription_settings = subscriptions
        self.coordinator_epochs = coordinator_epochs  # None: markers answer UNIMPLEMENTED
        self.verifier = verifier  # None: transactional batches answer UNIMPLEMENTED
        # services.acl.Authorizer (auth.authorizer=acl, set by install): a transactional
        # write or ack is taken only from its transaction's opener (check_joining).
        self.authorizer = None
        self.metadata_store = metadata_store
        self.max_batch_bytes = max_batch_bytes
        self.fetch_max_wait_ms = fetch_max_wait_ms
        self.fetch_default_max_bytes = fetch_default_max_bytes
        # Room for headers and positions of many items beside the batches.
        self.max_response_bytes = max_message_bytes - RESPONSE_OVERHEAD_BYTES
        self.max_message_bytes = max_message_bytes
        self._replicate_rotation = 0  # where a ReplicateMany answer begins (fairness)
        # Each follower's ReplicateSession (its quiet partitions), the least recently
        # used dropped beyond MAX_REPLICATE_SESSIONS (a dropped one only costs a full call).
        self._replicate_sessions: OrderedDict[str, ReplicateSession] = OrderedDict()
        self.skip_quiet_partitions = skip_quiet_partitions  # replication.skip_quiet_partitions

    # ------------------------------------------------------------------ routing
    async def _owner(self, tp: common_pb2.TopicPartition) -> PartitionOwner:
        if not tp.topic:
            raise AtomlogError("INVALID_ARGUMENT", "topic_partition.topic is empty")
        try:
            return self.manager.owner(tp.topic, tp.partition)
        except NotOwner as not_owner:
            servers = {s.name: s for s in await self.metadata_store.servers()}
            entry = servers.get(not_owner.owner)
            raise AtomlogError(
                "NOT_PARTITION_OWNER",
                f"{self.manager.server_name} does not own {tp.topic}-{tp.partition}; "
                f"{not_owner.owner} does", {
                    "owner_server_name": not_owner.owner or "",
                    "owner_address": entry.grpc_address if entry else ""}) from None

    # ------------------------------------------------------------------ replication
    async def Replicate(self, request, context):
        """A follower's copy request (docs/replication.md); this server must lead the
        partition (else NOT_PARTITION_OWNER, FENCED_LEADER_EPOCH for an old epoch)."""
        tp = request.topic_partition
        if not request.replica:
            raise AtomlogError("INVALID_ARGUMENT", "replica is empty")
        _check_copy_position(request, "")
        owner = await self._owner(tp)
        if owner.replication is None:
            raise AtomlogError("NOT_A_REPLICA",
                               f"{tp.topic}-{tp.partition} is not replicated; nothing to copy")
        owner.check_loaded()
        wait_s = min(request.max_wait_ms, self.fetch_max_wait_ms) / 1000
        return await owner.replication.replicate(request, wait_s)

    async def ReplicateMany(self, request, context):
        """A follower's copy request for every partition it follows on this server
        (docs/replication.md, "One call per leader"), or for what changed in its fetch
        session ("Fetch sessions"). The request's form is checked whole before anything
        is recorded; each partition this server cannot serve answers with its own error."""
        replica = request.replica
        if not replica:
            raise AtomlogError("INVALID_ARGUMENT", "replica is empty")
        epoch, incremental = request.session_epoch, request.session_epoch > 1
        if epoch > SESSION_EPOCH_MAX:
            raise AtomlogError("INVALID_ARGUMENT",
                               f"session_epoch {epoch} exceeds {SESSION_EPOCH_MAX}")
        if not incremental and (request.session_id or request.forgotten):
            raise AtomlogError("INVALID_ARGUMENT",
                               f"session_epoch {epoch} opens no session to continue: "
                               "session_id and forgotten must be empty")
        if incremental and not request.session_id:
            raise AtomlogError("INVALID_ARGUMENT",
                               f"session_epoch {epoch} continues a session: session_id is 0")
        lowest = 0 if incremental else 1
        if not lowest <= len(request.partitions) <= REPLICATE_MANY_MAX_PARTITIONS:
            raise AtomlogError("INVALID_ARGUMENT",
                               f"{len(request.partitions)} partitions; {lowest} .. "
                               f"{REPLICATE_MANY_MAX_PARTITIONS} per call")
        if request.max_bytes > self.max_message_bytes:
            raise AtomlogError("INVALID_ARGUMENT",
                               f"max_bytes {request.max_bytes} exceeds grpc.max_message_bytes "
                               f"{self.max_message_bytes}")
        # (Per item as little as can be: a call without a session names every partition
        # its follower copies from here, written or not; the messages are built only for
        # a refusal.)
        named: dict[tuple[str, int], partition_pb2.ReplicateRequest] = {}
        for item in request.partitions:
            tp = item.topic_partition
            key = (tp.topic, tp.partition)
            if not key[0]:
                raise AtomlogError("INVALID_ARGUMENT", "a partition's topic is empty")
            if key in named:
                raise AtomlogError("INVALID_ARGUMENT", f"{key[0]}-{key[1]} is asked for twice")
            named[key] = item
            if item.replica and item.replica != replica:
                raise AtomlogError("INVALID_ARGUMENT",
                                   f"{key[0]}-{key[1]}: replica {item.replica!r} is not the "
                                   f"caller {replica!r}")
            if item.fetch_offset < 0 or item.last_fetched_epoch < -1 or \
                    item.replica_incarnation <= 0 or not \
                    0 <= item.log_start_offset <= item.fetch_offset:
                _check_copy_position(item, f"{key[0]}-{key[1]}: ")
        forgotten = []
        for tp in request.forgotten:
            if not tp.topic:
                raise AtomlogError("INVALID_ARGUMENT", "a forgotten partition's topic is empty")
            forgotten.append((tp.topic, tp.partition))
        if len(set(forgotten)) < len(forgotten):
            raise AtomlogError("INVALID_ARGUMENT", "a partition is forgotten twice")
        for item in named.values():
            if item.replica != replica:
                item.replica = replica
        session = more = None
        if incremental:
            session = self._replicate_sessions.get(replica) \
                if self.skip_quiet_partitions else None
            if session is not None:
                self._replicate_sessions.move_to_end(replica)  # (the least recent goes)
            else:
                raise AtomlogError("REPLICATE_SESSION_INVALID",
                                   f"session {request.session_id}: this leader holds none for "
                                   f"{replica}", {"session_id": str(request.session_id)})
            session.advance(request.session_id, epoch, named, forgotten)
            keys = session.working(named)
            asked = session.asked
            requests = [asked[key] for key in keys]
            looked = set(keys)

            def more() -> list | None:
                if (session.id, session.epoch) != this_call:
                    return None  # a later call of the follower's took over: the stirs are its
                fresh = [key for key in session.take_stirred()
                         if key in asked and key not in looked]
                looked.update(fresh)
                return [(self._leader_of(asked[key], False), asked[key]) for key in fresh]
        else:
            requests = list(request.partitions)
            if self.skip_quiet_partitions:
                session = self._replicate_session(replica)
                if epoch == 1:
                    session.open(named)
                else:
                    session.take_stirred()  # (a call without a session looks at every one)
        this_call = (session.id, session.epoch) if session is not None else (0, 0)
        items = []
        for item in requests:
            leader = self._leader_of(item)
            if isinstance(leader, NotOwner):
                try:
                    await self._owner(item.topic_partition)  # (raises, naming the owner)
                except AtomlogError as error:
                    leader = error
            items.append((leader, item))
        self._replicate_rotation += 1
        outcomes = await replicate_many(
            items, min(request.max_wait_ms, self.fetch_max_wait_ms) / 1000,
            min(request.max_bytes or REPLICATE_MANY_MAX_BYTES, self.max_response_bytes),
            self._replicate_rotation, session, more)
        if epoch and session is not None and session.id \
                and (session.id, session.epoch) == this_call:  # (not a later call's)
            keys = [(item.topic_partition.topic, item.topic_partition.partition)
                    for _leader, item in items]
            session.settle(keys, [key for key, outcome in zip(keys, outcomes)
                                  if outcome is not None])
        # A ReplicateManyAnswer: each partition's records stay as read from its log
        # (replicate_wire splices them into the wire bytes; an in-process caller gets
        # them as they are).
        results = []
        for (_leader, item), outcome in zip(items, outcomes):
            if outcome is None:
                continue  # nothing new: left out
            result = partition_pb2.ReplicateResult(topic_partition=item.topic_partition)
            if isinstance(outcome, AtomlogError):
                result.error.CopyFrom(item_error(outcome))
                results.append(ReplicateItem(result))
            else:
                results.append(ReplicateItem(result, outcome))
        return ReplicateManyAnswer(results, session_id=this_call[0] if epoch else 0)

    def _leader_of(self, item, not_owner: bool = True):
        """The LeaderReplication serving a ReplicateMany item, or the AtomlogError it is
        answered with; with `not_owner`, the NotOwner of a partition led elsewhere (the
        caller looks up the owner's address for its error), else that error without it."""
        tp = item.topic_partition
        try:
            owner = self.manager.owner(tp.topic, tp.partition)
        except NotOwner as error:
            if not_owner:
                return error
            return AtomlogError("NOT_PARTITION_OWNER",
                                f"{self.manager.server_name} does not own "
                                f"{tp.topic}-{tp.partition}; {error.owner} does",
                                {"owner_server_name": error.owner or "", "owner_address": ""})
        except AtomlogError as error:  # (no such partition)
            return error
        if owner.replication is None:
            return AtomlogError("NOT_A_REPLICA", f"{tp.topic}-{tp.partition} is not "
                                "replicated; nothing to copy")
        try:
            owner.check_loaded()
        except AtomlogError as error:
            return error
        return owner.replication

    def _replicate_session(self, replica: str) -> ReplicateSession:
        sessions = self._replicate_sessions
        session = sessions.get(replica)
        if session is None:
            session = sessions[replica] = ReplicateSession()
            while len(sessions) > MAX_REPLICATE_SESSIONS:
                sessions.popitem(last=False)
        else:
            sessions.move_to_end(replica)
        return session

    # ------------------------------------------------------------------ produce
    async def Produce(self, request, context):
        _require_items(request.items, "ProduceRequest")
        results: list[partition_pb2.ProduceResult | None] = [None] * len(request.items)
        per_owner: dict[tuple[str, int], tuple[PartitionOwner, list[int], list]] = {}
        for index, item in enumerate(request.items):
            tp = item.topic_partition
            # Read the bytes field once: each access copies it out of the parsed message.
            batch = item.record_batch
            try:
                owner, header = await self._produce_target(tp, batch)
            except AtomlogError as error:
                results[index] = _refused(tp, error)
                continue
            entry = per_owner.setdefault((tp.topic, tp.partition), (owner, [], []))
            entry[1].append(index)
            entry[2].append((batch, header))

        def settle(owner: PartitionOwner, indexes: list[int], batches: list,
                   future: asyncio.Future) -> None:
            try:
                outcomes = future.result()
            except AtomlogError as error:
                outcomes = [error] * len(batches)
            for index, outcome in zip(indexes, outcomes):
                results[index] = _produce_result(request.items[index].topic_partition, owner,
                                                 outcome)

        def queue(owner: PartitionOwner, batches: list, tokens=None) -> asyncio.Future:
            try:
                return owner.queue_produce(batches, tokens)
            except AtomlogError as error:
                future = asyncio.get_running_loop().create_future()
                future.set_exception(error)
                return future

        def enter(owner: PartitionOwner, batches: list) -> tuple:
            """Take the place of these batches among their producers' on the partition,
            in this step (before any await: arrival order). Returns (this request's
            gate, its producer ids, the gates of the earlier requests of those producers
            that still wait)."""
            gates = owner.produce_gates
            producers = {header.producer_id for _, header in batches} - {NO_PRODUCER_ID}
            before = {gates[p] for p in producers if p in gates}
            gate = asyncio.get_running_loop().create_future()
            for producer in producers:
                gates[producer] = gate
            return gate, producers, before

        async def run(owner: PartitionOwner, indexes: list[int], batches: list,
                      place: tuple) -> None:
            """Batches that may wait before they are queued: a verification, or an
            earlier request of the same producer that waits. They are queued in the
            order their requests came (their producer's sequence order): queued out of
            it, a later batch would be refused as out of order, and its producer would
            resend it and everything behind it one at a time (found 2026-11-29: 102
            such refusals in 10 s of bench/transactions.py's commit_async() stream)."""
            gate, producers, before = place
            future = None
            try:
                if before:
                    await asyncio.wait(before)
                indexes, batches, tokens = await self._verify_all(owner, indexes, batches,
                                                                  results, request)
                if batches:
                    future = queue(owner, batches, tokens)
            finally:
                gate.set_result(None)
                gates = owner.produce_gates
                for producer in producers:
                    if gates.get(producer) is gate:
                        del gates[producer]
            if future is not None:
                with contextlib.suppress(AtomlogError):  # settle() reads it
                    await future
                settle(owner, indexes, batches, future)

        ordered, queued = [], []
        with written_in_step():  # those queued here are written here, not in their tasks
            for entry in per_owner.values():
                owner, _, batches = entry
                gates = owner.produce_gates
                if any(header.is_transactional or (gates and header.producer_id in gates)
                       for _, header in batches):
                    ordered.append((*entry, enter(owner, batches)))
                else:  # queued in this step, no task
                    queued.append((entry, queue(owner, batches)))
        if len(ordered) == 1 and not queued:
            await run(*ordered[0])
        elif ordered or queued:
            outcomes = await asyncio.gather(*(run(*entry) for entry in ordered),
                                            *(future for _, future in queued),
                                            return_exceptions=True)
            for outcome in outcomes[:len(ordered)]:  # (a queued one's error: settle() reads it)
                if isinstance(outcome, BaseException):
                    raise outcome
        for (owner, indexes, batches), future in queued:
            settle(owner, indexes, batches, future)
        return partition_pb2.ProduceResponse(results=results)

    async def _produce_target(self, tp, batch: bytes) -> tuple[PartitionOwner, BatchHeader]:
        """The owner of a produced batch and its checked header (Produce's checks of one
        item); raises AtomlogError."""
        owner = await self._owner(tp)
        header = validate_batch(batch, max_batch_bytes=self.max_batch_bytes)
        if header.is_control:
            raise AtomlogError("INVALID_ARGUMENT", "control batches are written only by "
                               "transaction markers, not by producers")
        owner.check_serving()
        if header.is_transactional:
            self._check_transactional_header(header, tp)
        return owner, header

    def queue_produce_here(self, tp, batch: bytes) -> asyncio.Future | AtomlogError:
        """Produce of one idempotent, non-transactional batch by a caller in this process
        that cannot wait for routing (a TC log's append from the coordinator's commit
        lane, coordinator/tc_partition.py): Produce's checks, then queued on the owner
        hosted here in the caller's step. The future of the owner's one-element result
        list (Appended or an AtomlogError); or the refusal, with nothing queued (also for
        a partition not hosted here, and for a batch that would have to wait for its
        producer's turn: the caller appends through `produce_here` instead)."""
        owner = self._route_now(tp)
        if owner is None:
            return AtomlogError("NOT_PARTITION_OWNER", f"{tp.topic}-{tp.partition} is not "
                                "hosted here")
        if isinstance(owner, AtomlogError):
            return owner
        return self._queue_produce_on(owner, batch)

    def _queue_produce_on(self, owner: PartitionOwner,
                          batch: bytes) -> asyncio.Future | AtomlogError:
        """`queue_produce_here` once routed to `owner` (a StageTxn's riding appends too)."""
        try:
            header = validate_batch(batch, max_batch_bytes=self.max_batch_bytes)
            if header.is_control or header.is_transactional or \
                    header.producer_id in owner.produce_gates:
                raise AtomlogError("INVALID_ARGUMENT", "not a batch queue_produce_here takes")
            return owner.queue_produce([(batch, header)])
        except AtomlogError as error:
            return error

    async def produce_here(self, item: partition_pb2.ProduceItem,
                           timeout_s: float) -> partition_pb2.ProduceResult:
        """Produce of one item by a caller in this process (a TC log's append on the
        combined server, coordinator/txn_log.py): the same checks and the same result,
        queued on its owner in the caller's step, without a ProduceRequest, a stub and a
        per-destination queue. A batch that must wait for its turn (transactional, or an
        earlier request of its producer still waiting) goes through Produce. Not
        answered within `timeout_s`: REQUEST_TIMED_OUT (the outcome is unknown; the write
        goes on)."""
        tp = item.topic_partition
        batch = item.record_batch
        try:
            owner, header = await self._produce_target(tp, batch)
            if header.is_transactional or header.producer_id in owner.produce_gates:
                async with asyncio.timeout(timeout_s):
                    response = await self.Produce(
                        partition_pb2.ProduceRequest(items=[item]), None)
                return response.results[0]
            future = owner.queue_produce([(batch, header)])
        except AtomlogError as error:
            return _refused(tp, error)
        except TimeoutError:
            return _timed_out(tp, timeout_s)
        # Waited for, not awaited: a caller cancelled meanwhile leaves the write be.
        try:
            await asyncio.wait([future], timeout=timeout_s)
        except asyncio.CancelledError:
            future.add_done_callback(observe_failure)  # nobody reads it now
            raise
        if not future.done():
            future.add_done_callback(observe_failure)
            return _timed_out(tp, timeout_s)
        try:
            [outcome] = future.result()
        except AtomlogError as error:
            outcome = error
        return _produce_result(tp, owner, outcome)

    def _check_transactional_header(self, header: BatchHeader, tp) -> None:
        if self.verifier is None:
            raise AtomlogError("UNIMPLEMENTED", "this server takes no transactional batches")
        if header.txn is None:
            raise AtomlogError("INVALID_ARGUMENT", "a transactional batch needs a transaction "
                               "id in its header")
        if header.producer_id == NO_PRODUCER_ID or header.base_sequence == NO_SEQUENCE:
            raise AtomlogError("INVALID_ARGUMENT", "a transactional batch needs a producer id "
                               "and a base sequence (transactional writes are idempotent)")
        if header.txn.tc_partition >= self.coordinator_epochs.tc_partitions:
            raise AtomlogError("INVALID_ARGUMENT",
                               f"txn tc_partition {header.txn.tc_partition} is not below the "
                               f"cluster's {self.coordinator_epochs.tc_partitions} TC partitions")

    async def _verify_all(self, owner: PartitionOwner, indexes: list[int], batches: list,
                          results: list, request) -> tuple[list[int], list, list]:
        """Give every transactional batch of one partition its verification token: none
        needed while its transaction is open here, a cached one, or a fresh answer from
        the coordinator (one question per transaction, asked concurrently). A batch that
        fails verification still goes to the owner, with its error for a token: a retry
        of a batch written before its transaction ended is a duplicate and answered with
        its offsets (refused, its sender would take the batch for unwritten and give its
        sequence numbers to the next batch, which would then be taken for the retry and
        dropped); a new batch gets the error. A partition still replaying its transaction
        buffer refuses them all here (retriable PARTITION_LOADING)."""
        asked: dict[TxnId, asyncio.Task] = {}
        recovering = owner.txns_recovering  # then transactional batches wait (retriable)
        # With ACLs, a transaction open here is asked about again when its cached answer
        # (which names its opener) is gone: evicted, or from before a restart.
        openers = self.authorizer is not None
        for _, header in batches:
            txn = header.txn
            if (header.is_transactional and not recovering and txn not in asked
                    and (openers or owner.txns.open_transaction(txn) is None)
                    and owner.guard.cached(txn) is None):
                asked[txn] = asyncio.ensure_future(self._verify(owner, txn))
        if asked:
            await asyncio.wait(asked.values())
        kept_indexes, kept, tokens = [], [], []
        for index, (batch, header) in zip(indexes, batches):
            token: int | AtomlogError | None = None
            try:
                if header.is_transactional:
                    owner.check_txns_ready()
                    try:
                        token = self._token_for(owner, header, asked)
                    except AtomlogError as refusal:
                        token = refusal  # the owner decides: a duplicate, or refused
            except AtomlogError as error:
                results[index] = _refused(request.items[index].topic_partition, error)
                continue
            kept_indexes.append(index)
            kept.append((batch, header))
            tokens.append(token)
        return kept_indexes, kept, tokens

    async def _verify(self, owner: PartitionOwner, txn: TxnId) -> None:
        token = owner.guard.token()
        answer = await self.verifier.verify(txn, owner.topic, owner.partition)
        owner.guard.remember(txn, token, answer.session, answer.opener)

    def _token_for(self, owner: PartitionOwner, header: BatchHeader, asked: dict) -> int | None:
        txn = header.txn
        task = asked.get(txn)
        if task is not None and task.exception() is not None:
            raise task.exception()
        open_here = task is None and owner.txns.open_transaction(txn) is not None
        if open_here and self.authorizer is None:
            return None  # open here: verified at its first write
        verified = owner.guard.cached(txn)
        if verified is None:
            raise owner.verify_again(txn)
        if self.authorizer is not None:
            self.authorizer.check_joining(f"a transactional write into {txn.tc_partition}:"
                                          f"{txn.sequence}", auth.current(), verified.opener)
            if open_here:
                return None  # (the opener checked; its session was at its first write)
        if verified.session is not None and verified.session != (header.producer_id,
                                                                  header.producer_epoch):
            raise AtomlogError(
                "PRODUCER_FENCED",
                f"transaction {txn.tc_partition}:{txn.sequence} belongs to producer "
                f"{verified.session[0]} epoch {verified.session[1]}; this batch comes from "
                f"producer {header.producer_id} epoch {header.producer_epoch}",
                {"producer_id": str(verified.session[0]),
                 "producer_epoch": str(verified.session[1])})
        return verified.token

    # ------------------------------------------------------------------ fetch
    async def Fetch(self, request, context):
        _require_items(request.items, "FetchRequest")
        if request.isolation_level not in (common_pb2.ISOLATION_LEVEL_UNSPECIFIED,
                                           common_pb2.ISOLATION_LEVEL_READ_COMMITTED,
                                           common_pb2.ISOLATION_LEVEL_READ_UNCOMMITTED):
            raise AtomlogError("INVALID_ARGUMENT",
                               f"unknown isolation_level {request.isolation_level}")
        for item in request.items:
            if item.fetch_offset < 0:
                raise AtomlogError("INVALID_ARGUMENT",
                                   f"fetch_offset {item.fetch_offset} is negative")
        committed = request.isolation_level != common_pb2.ISOLATION_LEVEL_READ_UNCOMMITTED
        wait_s = min(request.max_wait_ms, self.fetch_max_wait_ms) / 1000
        deadline = time.monotonic() + wait_s
        min_bytes = max(1, request.min_bytes)
        while True:
            response, total, owners, moved = await self._fetch_once(request, committed)
            remaining = deadline - time.monotonic()
            if (total >= min_bytes or moved or remaining <= 0 or not owners
                    or context.cancelled()):
                return response
            waits = [asyncio.create_task(owner.wait_for_data(offset, remaining, committed))
                     for owner, offset in owners]
            _, pending = await asyncio.wait(waits, timeout=remaining,
                                            return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()

    async def _fetch_once(self, request, committed: bool):
        """One pass over the items: (response, bytes, owners to wait on, whether any
        item moved past filtered-out batches). The batches are kept beside the response,
        not copied into it (read_wire splices them into the wire bytes), and it never
        exceeds the gRPC message limit."""
        budget = min(request.max_bytes or self.fetch_default_max_bytes * len(request.items),
                     self.max_response_bytes)
        response = SplicedResponse(partition_pb2.FetchResponse())  # read_wire
        total, waiting, moved = 0, [], False
        for item in request.items:
            tp = item.topic_partition
            try:
                owner = await self._owner(tp)
                owner.check_serving()
                room = budget - total
                aborted = []
                if total and room <= 0:
                    data, next_offset = b"", item.fetch_offset
                else:
                    limit = max(min(item.max_bytes or self.fetch_default_max_bytes, room), 1)
                    data, next_offset, aborted = owner.read(
                        item.fetch_offset, limit, committed=committed,
                        include_control=request.include_control_batches)
                if data:
                    m.RECORDS_OUT.labels(tp.topic).inc(
                        sum(h.record_count for _, h in iter_batches(data)))
                elif next_offset > item.fetch_offset:
                    moved = True  # only filtered-out batches: answer, the reader moves on
                else:
                    waiting.append((owner, item.fetch_offset))
                result = response.results.add(
                    topic_partition=tp, record_batches=data,
                    next_fetch_offset=max(next_offset, item.fetch_offset), **owner.positions())
                for entry in aborted:
                    result.aborted_transactions.add(
                        txn_id=common_pb2.TxnId(tc_partition=entry.txn.tc_partition,
                                                sequence=entry.txn.sequence),
                        first_offset=entry.first_offset, marker_offset=entry.marker_offset)
                total += len(data)
            except AtomlogError as error:
                response.results.add(
                    topic_partition=tp, error=item_error(error), next_fetch_offset=item.fetch_offset,
                    log_start_offset=-1, high_watermark=-1, max_read_position=-1,
                    last_data_offset=-1)
        return response, total, waiting, moved

    # ------------------------------------------------------------------ offsets
    async def ListOffsets(self, request, context):
        _require_items(request.items, "ListOffsetsRequest")
        results = []
        for item in request.items:
            tp = item.topic_partition
            try:
                owner = await self._owner(tp)
                owner.check_serving()
                positions = owner.positions()
                offset, timestamp = self._look_up(owner, item, positions)
                results.append(partition_pb2.ListOffsetsResult(
                    topic_partition=tp, offset=offset, timestamp_unix_ms=timestamp, **positions))
            except AtomlogError as error:
                results.append(partition_pb2.ListOffsetsResult(
                    topic_partition=tp, error=item_error(error), offset=-1, timestamp_unix_ms=-1,
                    log_start_offset=-1, high_watermark=-1, max_read_position=-1,
                    last_data_offset=-1))
        return partition_pb2.ListOffsetsResponse(results=results)

    @staticmethod
    def _look_up(owner: PartitionOwner, item, positions) -> tuple[int, int]:
        spec = item.spec
        if spec == partition_pb2.OFFSET_SPEC_EARLIEST:
            return positions["log_start_offset"], -1
        if spec == partition_pb2.OFFSET_SPEC_LATEST:
            return positions["high_watermark"], -1
        if spec == partition_pb2.OFFSET_SPEC_MAX_READ_POSITION:
            return owner.max_read_position(), -1  # PARTITION_LOADING while it recovers
        if spec == partition_pb2.OFFSET_SPEC_BY_TIMESTAMP:
            found = owner.offset_for_timestamp(item.timestamp_unix_ms)
            return found if found is not None else (-1, -1)
        raise AtomlogError("INVALID_ARGUMENT", f"ListOffsets spec {spec} is not valid")

    # ------------------------------------------------------------------ admin
    def _summary(self, owner: PartitionOwner) -> dict:
        summary = {"topic_partition": common_pb2.TopicPartition(topic=owner.topic,
                                                                 partition=owner.partition),
                   "state": STATE_ENUM[owner.state]}
        if owner.state is State.DATA_LOSS and owner.log is not None and owner.log.data_loss:
            loss = owner.log.data_loss
            summary["data_loss"] = partition_pb2.DataLossInfo(
                file=os.path.relpath(loss.path, self.manager.data_dir), offset=loss.offset,
                file_position_bytes=loss.position,
                detail=loss.error().message)
        if owner.state is State.ONLINE:
            positions = owner.positions()
            summary.update(log_start_offset=positions["log_start_offset"],
                           high_watermark=positions["high_watermark"],
                           max_read_position=positions["max_read_position"],
                           size_bytes=owner.log.size_bytes,
                           open_transaction_count=(0 if owner.txns_recovering
                                                   else owner.txns.open_count))
        return summary

    async def ListPartitions(self, request, context):
        owners = sorted(self.manager.owners.values(), key=lambda o: (o.topic, o.partition))
        return partition_pb2.ListPartitionsResponse(partitions=[
            partition_pb2.PartitionSummary(**self._summary(o)) for o in owners
            if request.include_internal or not o.topic.startswith("__")])

    async def DescribePartition(self, request, context):
        owner = await self._owner(request.topic_partition)
        summary = self._summary(owner)
        summary.pop("size_bytes", None)
        summary.pop("open_transaction_count", None)
        response = partition_pb2.DescribePartitionResponse(**summary)
        response.producer_snapshot_offset = owner.producer_snapshot_offset
        response.transaction_buffer_snapshot_offset = owner.txn_snapshot_offset
        if owner.state is State.ONLINE:
            now_ms = int(time.time() * 1000)  # (ages of log records: wall-clock times)
            response.last_data_offset = owner.positions()["last_data_offset"]
            response.segment_count = owner.log.segment_count
            response.size_bytes = owner.log.size_bytes
            ready = response.transaction_buffer_ready = not owner.txns_recovering
            txns = owner.txns
            response.aborted_transaction_count = txns.aborted_count if ready else 0
            for tc, epoch in (txns.coordinator_epochs().items() if ready else ()):
                response.coordinator_epochs[tc] = epoch
            for entry in (txns.describe() if ready else [])[:MAX_DESCRIBED_TRANSACTIONS]:
                response.open_transactions.add(
                    txn_id=common_pb2.TxnId(tc_partition=entry.txn.tc_partition,
                                            sequence=entry.txn.sequence),
                    first_offset=entry.first_offset, last_offset=entry.last_offset,
                    producer_id=entry.producer_id, producer_epoch=entry.producer_epoch,
                    first_append_unix_ms=entry.first_timestamp_ms,
                    age_ms=max(0, now_ms - entry.first_timestamp_ms))
            response.producer_count = owner.producers.producer_count
            limit = request.max_producers or 100
            live = owner.producers.live_entries(now_ms)
            for entry in sorted(live.values(), key=lambda e: e.producer_id)[:limit]:
                response.producers.add(
                    producer_id=entry.producer_id, producer_epoch=entry.producer_epoch,
                    last_sequence=entry.last_sequence, last_offset=entry.last_offset,
                    last_append_unix_ms=entry.last_timestamp_ms,
                    cached_batch_count=len(entry.batches))
            tp = request.topic_partition
            # The backlog counts up to the max read position: unknown while recovering.
            readable = owner.max_read_position() if ready else -1
            for name in sorted(owner.subscriptions.names() if ready else ()
                               )[:MAX_DESCRIBED_SUBSCRIPTIONS]:
                sp = common_pb2.SubscriptionPartition(topic=tp.topic, partition=tp.partition,
                                                      subscription=name)
                d = owner.subscriptions.describe(name, readable, clock.steady_ms())
                response.subscriptions.add(**_cursor_fields(sp, d))
        if owner.replication is not None:
            owner.replication.status(response.replication)
        if self.authorizer is not None:
            self._withhold(response)
        return response

    def _withhold(self, response) -> None:
        """With ACLs: leave out of a DescribePartition answer what the caller may not see
        (`withheld` names each part): the transactions and producers need describe on
        transaction_admin (as ListTransactions), a subscription's cursor describe on it."""
        principal = auth.current()
        admin = acl.Permission("describe", "transaction_admin", acl.CLUSTER)
        if not self.authorizer.may(principal, admin):
            if response.open_transactions or response.producers or \
                    response.aborted_transaction_count:
                response.withheld.append("open_transactions, aborted_transaction_count, "
                                         "producers: describe on transaction_admin")
            del response.open_transactions[:]
            del response.producers[:]
            response.aborted_transaction_count = 0
        shown = [cursor for cursor in response.subscriptions if self.authorizer.may(
            principal, acl.Permission("describe", "subscription",
                                      cursor.subscription_partition.subscription))]
        if len(shown) < len(response.subscriptions):
            response.withheld.append(f"subscriptions ({len(response.subscriptions) - len(shown)} "
                                     "of them): describe on each subscription")
            del response.subscriptions[:]
            response.subscriptions.extend(shown)

    async def RecoverPartition(self, request, context):
        if not request.accept_data_loss:
            raise AtomlogError("INVALID_ARGUMENT", "RecoverPartition truncates the log; set "
                               "accept_data_loss to confirm")
        owner = await self._owner(request.topic_partition)
        report = await owner.recover_data_loss(request.expected_file, request.expected_offset)
        return partition_pb2.RecoverPartitionResponse(
            state=STATE_ENUM[owner.state], truncated_at_offset=report.truncated_at_offset,
            removed_bytes=report.removed_bytes, high_watermark=owner.log.high_watermark)

    async def DescribeCopy(self, request, context):
        tp = request.topic_partition
        if not tp.topic:
            raise AtomlogError("INVALID_ARGUMENT", "topic_partition.topic is empty")
        manager = self.manager
        record = manager.assignments.topic(tp.topic) if manager.assignments else None
        me = manager.server_name
        if record is None or not 0 <= tp.partition < record.partitions or \
                me not in record.replicas_of(tp.partition):
            raise AtomlogError("UNKNOWN_TOPIC_OR_PARTITION",
                               f"{me} holds no replica of {tp.topic}-{tp.partition}",
                               {"topic": tp.topic, "partition": str(tp.partition)})
        key = (tp.topic, tp.partition)
        role = "leader" if key in manager.owners else \
            "follower" if key in manager.followers else "none"
        state = await asyncio.to_thread(copies.inspect,
                                        manager.data_dir / f"{tp.topic}-{tp.partition}")
        return partition_pb2.DescribeCopyResponse(
            server_name=me, role=role, present=state.present,
            log_start_offset=state.log_start_offset, log_end_offset=state.log_end_offset,
            tail_detail=state.tail_detail, latest_leader_epoch=state.latest_leader_epoch,
            latest_epoch_start_offset=state.latest_epoch_start_offset,
            segment_count=state.segment_count, size_bytes=state.size_bytes,
            data_loss_detail=state.data_loss_detail)

    async def ScrubPartition(self, request, context):
        tp = request.topic_partition
        if not tp.topic:
            raise AtomlogError("INVALID_ARGUMENT", "topic_partition.topic is empty")
        if self.scrubber is None:
            raise AtomlogError("UNIMPLEMENTED", "this server has no scrubber")
        report = await self.scrubber.scrub_now((tp.topic, tp.partition))
        response = partition_pb2.ScrubPartitionResponse(
            role=report.role, segments_checked=report.segments, bytes_checked=report.bytes)
        if report.damage is not None:
            span, failure = report.damage
            response.damage.file = str(span.path)
            response.damage.position = failure.position
            response.damage.offset = failure.offset
            response.damage.detail = failure.detail
            response.damage.acted_on = report.acted_on
        return response

    # ------------------------------------------------------------------ delete records
    async def DeleteRecords(self, request, context):
        _require_items(request.items, "DeleteRecordsRequest")
        if request.timeout_ms > DELETE_RECORDS_MAX_WAIT_MS:
            raise AtomlogError("INVALID_ARGUMENT",
                               f"timeout_ms {request.timeout_ms} is above "
                               f"{DELETE_RECORDS_MAX_WAIT_MS}", {"field": "timeout_ms"})
        wait_s = (request.timeout_ms or DELETE_RECORDS_DEFAULT_WAIT_MS) / 1000
        remaining = context.time_remaining()
        if remaining is not None:  # answered (REQUEST_TIMED_OUT) before the caller gives up
            wait_s = min(wait_s, max(0.0, remaining - DELETE_RECORDS_ANSWER_MARGIN_S))
        deadline = time.monotonic() + wait_s
        response = partition_pb2.DeleteRecordsResponse()
        waits = []
        for item in request.items:
            result = response.results.add(topic=item.topic, partition=item.partition)
            try:
                if item.before_offset < 0:
                    raise AtomlogError("INVALID_ARGUMENT",
                                       f"before_offset {item.before_offset} is negative")
                owner = await self._owner(common_pb2.TopicPartition(topic=item.topic,
                                                                    partition=item.partition))
                result.log_start_offset = await owner.delete_records(item.before_offset)
                # (Not when the leader holds no record at all, its active segment empty
                # after a retention roll: a follower's last segment, holding the same
                # records, is its active one and stays until new records start the next
                # there; docs/replication.md. Waiting for it timed out every time.)
                if owner.replication is not None and \
                        result.log_start_offset < owner.log.log_end_offset:
                    waits.append((result, owner.replication))
            except AtomlogError as error:
                result.error.CopyFrom(item_error(error))
                result.log_start_offset = -1
        if waits:  # every replicated item's in-sync followers, side by side
            behind = await asyncio.gather(*(
                replication.followers_deleted(result.log_start_offset, deadline)
                for result, replication in waits), return_exceptions=True)
            for (result, replication), outcome in zip(waits, behind):
                if not outcome:
                    continue
                start, result.log_start_offset = result.log_start_offset, -1
                if isinstance(outcome, BaseException):
                    if not isinstance(outcome, AtomlogError):
                        raise outcome
                    result.error.CopyFrom(item_error(outcome))
                    continue
                result.error.CopyFrom(item_error(AtomlogError(
                    "REQUEST_TIMED_OUT",
                    f"{replication.name}: deleted below {start} on the leader; in-sync "
                    f"follower(s) {', '.join(outcome)} have not deleted there yet (send it "
                    "again, or read the log start offset later)",
                    {"log_start_offset": str(start), "replicas_behind": ",".join(outcome)})))
        return response

    # ------------------------------------------------------------------ subscriptions
    async def _subscription_owner(self, sp) -> PartitionOwner:
        if not sp.subscription:
            raise AtomlogError("INVALID_ARGUMENT", "subscription_partition.subscription is empty")
        owner = await self._owner(common_pb2.TopicPartition(topic=sp.topic,
                                                             partition=sp.partition))
        owner.check_serving()
        return owner

    async def _each(self, items, what: str, handle):
        """Run handle(item) per item concurrently; (item, result | AtomlogError) in order."""
        _require_items(items, what)

        async def one(item):
            try:
                return await handle(item)
            except AtomlogError as error:
                return error

        return list(zip(items, await asyncio.gather(*(one(i) for i in items))))

    @staticmethod
    def _check_position(position: int, offset: int, timestamp_ms: int, field: str) -> None:
        if position not in partition_pb2.SubscriptionInitialPosition.values():
            raise AtomlogError("INVALID_ARGUMENT", f"unknown {field} {position}",
                               {"field": field})
        if position == partition_pb2.SUBSCRIPTION_INITIAL_POSITION_OFFSET and offset < 0:
            raise AtomlogError("INVALID_ARGUMENT", f"offset {offset} is negative",
                               {"field": "offset"})
        if position == partition_pb2.SUBSCRIPTION_INITIAL_POSITION_TIMESTAMP and timestamp_ms < 0:
            raise AtomlogError("INVALID_ARGUMENT", f"timestamp_unix_ms {timestamp_ms} is "
                               "negative", {"field": "timestamp_unix_ms"})

    @staticmethod
    def _resolve_position(owner: PartitionOwner, position: int, offset: int,
                          timestamp_ms: int) -> int:
        """The cursor position a SubscriptionInitialPosition names on this partition
        (UNSPECIFIED: LATEST; TIMESTAMP: the OFFSET of the first batch at or after it, or
        the end), clamped to [log start, max read position]. The end is the max read
        position, not the high watermark (Kafka's read_committed "latest" is the last
        stable offset): what open transactions hold above it becomes readable, if they
        commit, after the cursor exists, and counted as acknowledged it was never
        delivered (until 2026-12-06)."""
        positions = owner.positions()
        end = max(positions["log_start_offset"], owner.max_read_position())
        if position == partition_pb2.SUBSCRIPTION_INITIAL_POSITION_TIMESTAMP:
            found = owner.offset_for_timestamp(timestamp_ms)
            position = partition_pb2.SUBSCRIPTION_INITIAL_POSITION_OFFSET
            offset = end if found is None else found[0]
        return resolve_initial_position(
            InitialPosition(position or InitialPosition.LATEST), offset,
            positions["log_start_offset"], end)

    @staticmethod
    def _cursor_results(response, outcomes) -> None:
        """One result per (subscription partition, outcome): its cumulative end, or its
        error and -1."""
        for sp, outcome in outcomes:
            if isinstance(outcome, AtomlogError):
                response.results.add(subscription_partition=sp, error=item_error(outcome),
                                     cumulative_end_offset=-1)
            else:
                response.results.add(subscription_partition=sp, cumulative_end_offset=outcome)

    async def CreateSubscription(self, request, context):
        self._check_position(request.initial_position, request.start_offset,
                             request.timestamp_unix_ms, "initial_position")

        async def create(sp):
            owner = await self._subscription_owner(sp)
            return await owner.subscriptions.create(sp.subscription, self._resolve_position(
                owner, request.initial_position, request.start_offset,
                request.timestamp_unix_ms))

        response = partition_pb2.CreateSubscriptionResponse()
        for sp, outcome in await self._each(request.subscription_partitions,
                                            "CreateSubscriptionRequest", create):
            if isinstance(outcome, AtomlogError):
                response.results.add(subscription_partition=sp, error=item_error(outcome),
                                     cumulative_end_offset=-1)
            else:
                response.results.add(subscription_partition=sp, created=outcome[0],
                                     cumulative_end_offset=outcome[1])
        return response

    async def DeleteSubscription(self, request, context):
        async def delete(sp):
            owner = await self._subscription_owner(sp)
            await owner.subscriptions.delete(sp.subscription)

        response = partition_pb2.DeleteSubscriptionResponse()
        for sp, outcome in await self._each(request.subscription_partitions,
                                            "DeleteSubscriptionRequest", delete):
            result = response.results.add(subscription_partition=sp)
            if isinstance(outcome, AtomlogError):
                result.error.CopyFrom(item_error(outcome))
        return response

    async def ResetSubscription(self, request, context):
        if request.position == partition_pb2.SUBSCRIPTION_INITIAL_POSITION_UNSPECIFIED:
            raise AtomlogError("INVALID_ARGUMENT", "position is required: EARLIEST, LATEST, "
                               "OFFSET or TIMESTAMP", {"field": "position"})
        self._check_position(request.position, request.offset, request.timestamp_unix_ms,
                             "position")

        async def reset(sp):
            owner = await self._subscription_owner(sp)
            return await owner.subscriptions.reset(sp.subscription, self._resolve_position(
                owner, request.position, request.offset, request.timestamp_unix_ms))

        response = partition_pb2.ResetSubscriptionResponse()
        self._cursor_results(response, await self._each(
            request.subscription_partitions, "ResetSubscriptionRequest", reset))
        return response

    async def Ack(self, request, context):
        async def ack(item):
            sp = item.subscription_partition
            owner = await self._subscription_owner(sp)
            txn = None
            if item.HasField("txn_id"):
                txn = TxnId(item.txn_id.tc_partition, item.txn_id.sequence)
                if txn.sequence <= 0 or txn.tc_partition >= self.coordinator_epochs.tc_partitions:
                    raise AtomlogError("INVALID_ARGUMENT", f"txn_id {txn.tc_partition}:"
                                       f"{txn.sequence} is not a valid transaction id")
                await self._verify_ack(owner, txn, sp.subscription)
            ranges = [(r.start_offset, r.end_offset) for r in item.individual_ranges]
            return await owner.subscriptions.ack(sp.subscription, item.cumulative_end_offset,
                                                 ranges, txn, owner.max_read_position())

        response = partition_pb2.AckResponse()
        self._cursor_results(response, ((item.subscription_partition, outcome) for item, outcome
                                        in await self._each(request.items, "AckRequest", ack)))
        return response

    async def _verify_ack(self, owner: PartitionOwner, txn: TxnId, subscription: str) -> None:
        """A transactional ack: its transaction is OPEN and lists this subscription
        partition (asked once per pair, cached until the pair's marker). A marker racing
        the answer leaves a tombstone on the cursor, which refuses the ack."""
        if self.verifier is None:
            raise AtomlogError("UNIMPLEMENTED", "this server takes no transactional acks")
        key = (txn, subscription)
        opener = owner.verified_acks.get(key)
        if opener is None:
            answer = await self.verifier.verify(txn, owner.topic, owner.partition,
                                                subscription=subscription)
            opener = owner.verified_acks[key] = answer.opener
        owner.verified_acks.move_to_end(key)
        while len(owner.verified_acks) > self.subscription_settings.max_verified_acks:
            owner.verified_acks.popitem(last=False)
        if self.authorizer is not None:
            self.authorizer.check_joining(f"a transactional ack in {txn.tc_partition}:"
                                          f"{txn.sequence}", auth.current(), opener)

    async def Nack(self, request, context):
        validate_consumer_id(request.consumer_id)
        limit = self.subscription_settings.max_ack_timeout_ms
        if request.redelivery_delay_ms > limit:
            # (Unbounded before: a wrong unit held messages for weeks, and releasing the
            # consumer did not free them.)
            raise AtomlogError("INVALID_ARGUMENT", f"redelivery_delay_ms "
                               f"{request.redelivery_delay_ms} is more than "
                               f"subscription.max_ack_timeout_ms ({limit})",
                               {"field": "redelivery_delay_ms"})
        now_ms = clock.steady_ms()  # (deliveries' deadlines: this process's memory only)

        async def nack(item):
            sp = item.subscription_partition
            owner = await self._subscription_owner(sp)
            owner.subscriptions.nack(sp.subscription, request.consumer_id,
                                     [(r.start_offset, r.end_offset) for r in item.ranges],
                                     now_ms, request.redelivery_delay_ms)

        response = partition_pb2.NackResponse()
        for item, outcome in await self._each(request.items, "NackRequest", nack):
            result = response.results.add(subscription_partition=item.subscription_partition)
            if isinstance(outcome, AtomlogError):
                result.error.CopyFrom(item_error(outcome))
        return response

    async def DescribeSubscription(self, request, context):
        _require_items(request.subscription_partitions, "DescribeSubscriptionRequest")
        response = partition_pb2.DescribeSubscriptionResponse()
        now_ms = clock.steady_ms()  # (deliveries' deadlines: this process's memory only)
        for sp in request.subscription_partitions:
            try:
                owner = await self._subscription_owner(sp)
                await _cursors_replicated_for_reading(owner)
                d = owner.subscriptions.describe(sp.subscription, owner.max_read_position(),
                                                 now_ms)
                response.cursors.add(**_cursor_fields(sp, d))
            except AtomlogError as error:
                response.cursors.add(subscription_partition=sp, error=item_error(error))
        return response

    async def Receive(self, request, context):
        validate_consumer_id(request.consumer_id)  # (in bytes, as the cursors count it)
        _require_items(request.subscription_partitions, "ReceiveRequest")
        if request.isolation_level not in (common_pb2.ISOLATION_LEVEL_UNSPECIFIED,
                                           common_pb2.ISOLATION_LEVEL_READ_COMMITTED,
                                           common_pb2.ISOLATION_LEVEL_READ_UNCOMMITTED):
            raise AtomlogError("INVALID_ARGUMENT",
                               f"unknown isolation_level {request.isolation_level}")
        committed = request.isolation_level != common_pb2.ISOLATION_LEVEL_READ_UNCOMMITTED
        limits = self.subscription_settings
        # Within [MIN_ACK_TIMEOUT_MS, the maximum]: a 1 ms one made a message bounce
        # between consumers every few milliseconds, each delivery waking every long poll.
        ack_timeout_ms = max(MIN_ACK_TIMEOUT_MS, min(
            request.ack_timeout_ms or limits.default_ack_timeout_ms, limits.max_ack_timeout_ms))
        deadline = time.monotonic() + min(request.max_wait_ms, self.fetch_max_wait_ms) / 1000
        while True:
            response, delivered, waits, failed = await self._receive_once(
                request, committed, ack_timeout_ms)
            remaining = deadline - time.monotonic()
            if delivered or remaining <= 0 or not waits or context.cancelled():
                return response
            # Wake for new data, at the earliest redelivery deadline (ack timeouts, Nack
            # delays), or when a cursor says something became deliverable sooner.
            wait_s = min(remaining, self._redelivery_wait_s(waits),
                         self.RECEIVE_ERROR_RECHECK_S if failed else remaining)
            tasks = [asyncio.create_task(owner.wait_for_data(offset, wait_s, committed))
                     for owner, _, offset, _ in waits if offset is not None]
            tasks += [asyncio.create_task(owner.subscriptions.wait_for_wakeup(name, mark,
                                                                              wait_s))
                      for owner, name, _, mark in waits]
            try:
                await asyncio.wait(tasks, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()

    async def _receive_once(self, request, committed: bool, ack_timeout_ms: int):
        """One pass: (response, whether anything was delivered, the items to wait on as
        (owner, subscription, read position or None, wake-up mark), whether an item
        failed). None: the cursor's new deliveries stopped at a limit, so new data would
        not wake it (an ack does: wait_for_wakeup)."""
        response = SplicedResponse(partition_pb2.ReceiveResponse())  # read_wire
        budget = min(request.max_bytes or self.fetch_default_max_bytes, self.max_response_bytes)
        per_partition = self.subscription_settings.max_offsets_per_receive
        offsets_left = request.max_messages or None  # None: only the per-partition limit
        delivered_any, waits, failed = False, [], False
        now_ms = clock.steady_ms()  # (deliveries' deadlines: this process's memory only)
        for sp in request.subscription_partitions:
            try:
                owner = await self._subscription_owner(sp)
                if owner.replication is not None and self.lease is not None \
                        and not self.lease.trusted():
                    # A leader paused past its session may have been replaced: it must
                    # not deliver from its own view of the cursor (partition_server/lease.py).
                    raise AtomlogError("ZOOKEEPER_UNAVAILABLE",
                                       f"{owner.name}: this server stalled and has not yet "
                                       "confirmed its ZooKeeper session; retry",
                                       {"retry_after_ms": "250"})
                if committed:
                    owner.check_txns_ready()
                positions = owner.positions()
                limit = positions["max_read_position"] if committed else positions["high_watermark"]

                if offsets_left == 0:  # the consumer asked for no more: the rest stay here
                    response.results.add(
                        subscription_partition=sp,
                        cumulative_end_offset=owner.subscriptions.cumulative_end(sp.subscription),
                        high_watermark=positions["high_watermark"],
                        max_read_position=positions["max_read_position"])
                    continue

                def read(offset: int, max_bytes: int, owner=owner):
                    data, next_offset, _ = owner.read(offset, max_bytes, committed=committed)
                    return data, next_offset

                data, delivery = owner.subscriptions.receive(
                    sp.subscription, request.consumer_id, read, limit, now_ms, ack_timeout_ms,
                    max(budget, 1), per_partition if offsets_left is None
                    else min(per_partition, offsets_left))
                result = response.results.add(
                    subscription_partition=sp, record_batches=data,
                    cumulative_end_offset=owner.subscriptions.cumulative_end(sp.subscription),
                    high_watermark=positions["high_watermark"],
                    max_read_position=positions["max_read_position"])
                for r in delivery.delivered:
                    result.delivered_ranges.add(start_offset=r.start, end_offset=r.end)
                for r in delivery.redelivered:
                    result.redelivered_ranges.add(start_offset=r.start, end_offset=r.end)
                if delivery.delivered:
                    delivered_any = True
                    budget -= len(data)
                    m.RECORDS_OUT.labels(sp.topic).inc(
                        sum(r.end - r.start for r in delivery.delivered))
                    if offsets_left is not None:
                        offsets_left -= min(offsets_left, sum(r.end - r.start
                                                              for r in delivery.delivered))
                else:
                    stopped = owner.subscriptions.new_deliveries_stopped(sp.subscription)
                    waits.append((owner, sp.subscription,
                                  None if stopped else delivery.read_position,
                                  owner.subscriptions.wakeup_mark()))
            except AtomlogError as error:
                failed = True
                response.results.add(subscription_partition=sp, error=item_error(error),
                                     cumulative_end_offset=-1, high_watermark=-1,
                                     max_read_position=-1)
        return response, delivered_any, waits, failed

    # A Receive long poll with a failed item (a subscription loading or recovering, say)
    # looks again this often: the old fixed poll interval, kept only for failures.
    RECEIVE_ERROR_RECHECK_S = 0.5
    # Deadlines are wall-clock ms, found due when `deadline <= now_ms` (now_ms truncated):
    # wake just after one, so the next pass sees it due.
    REDELIVERY_SLACK_MS = 2

    @classmethod
    def _redelivery_wait_s(cls, waits) -> float:
        """Seconds until the earliest delivery deadline or Nack delay end of the cursors
        waited on (inf: none); at least a millisecond, so a due one costs one more pass."""
        due = [d for owner, name, _, _ in waits
               if (d := owner.subscriptions.next_deadline_ms(name)) is not None]
        if not due:
            return float("inf")
        return max(min(due) + cls.REDELIVERY_SLACK_MS - clock.steady_ms(), 1) / 1000

    # ------------------------------------------------------------------ staging
    async def StageTxn(self, request, context):
        """One-call transactions' parts from their coordinators (partition.proto): per
        item, fence the coordinator epoch, then append each batch stamped with the
        transaction (deduplicated by transaction per partition) and make each ack
        pending. Items and their parts run concurrently; each part answers on its own.
        Markers riding with the call (`markers`) are applied as EndTxnOnPartition
        applies them, and TC-log appends riding with it (`appends`) as Produce appends
        them, in the same turn as the items."""
        epochs = self.coordinator_epochs
        if epochs is None or self.verifier is None:
            raise AtomlogError("UNIMPLEMENTED", "this server takes no transactional batches")
        riders = request.markers.markers
        appends = request.appends.items
        # As a server from before StageTxnRequest.appends: ignored, and no call without items.
        unknown = bool(appends) and failpoints.armed(failpoints.STAGE_APPENDS_UNKNOWN)
        if unknown:
            appends = ()
        if request.items or unknown or not (riders or appends):
            _require_items(request.items, "StageTxnRequest")
        if riders:  # checked whole before anything is applied, as EndTxnOnPartition does
            _require_items(riders, "StageTxnRequest.markers")
            _check_marker_request(riders, "StageTxnRequest.markers")
        if appends:
            _require_items(appends, "StageTxnRequest.appends")
            _check_appends(appends)
        response = partition_pb2.StageTxnResponse()
        # Everything below up to the await runs in this step, with no task per part: the
        # riding markers, then the staged parts, then the riding TC-log appends, reach
        # their partitions' owners before these next write, so they share a write and an
        # fsync (coordinator/markers.py, coordinator/staging.py).
        work = []  # coroutines: the markers' and acks' answers, parts routed by awaiting
        queued: list[tuple[asyncio.Future, PartitionOwner, object]] = []
        with written_in_step():  # the owners write in this step, not each in its task's
            self._stage_items(request, response, riders, epochs, work, queued)
            if appends:
                work.extend(self._queue_appends(appends, response.appends.results, queued))
        if queued or work:
            outcomes = await asyncio.gather(*(future for future, _, _ in queued), *work,
                                            return_exceptions=True)
            for outcome in outcomes[len(queued):]:
                if isinstance(outcome, BaseException):
                    raise outcome
            for future, owner, entry in queued:
                _staged_into(entry, owner, future)
        return response

    def _queue_appends(self, appends, results, queued: list) -> list:
        """StageTxn's riding TC-log appends: each one that Produce would queue at once
        (an idempotent batch of a partition hosted here whose producer waits for nothing)
        queued on its owner in the caller's step, into `queued` as (future, owner, its
        result entry), as the staged batches are; the others (and every refusal, so that
        it reads as Produce's) go through Produce together: the coroutine returned, if
        any. A result entry per append is added to `results`, in order."""
        others: list[int] = []
        slow: set[tuple[str, int]] = set()  # partitions whose earlier append went by Produce
        for index, item in enumerate(appends):
            tp = item.topic_partition
            entry = results.add(topic_partition=tp, base_offset=-1, last_offset=-1)
            owner = self._route_now(tp)
            future = None
            if isinstance(owner, PartitionOwner) and (tp.topic, tp.partition) not in slow:
                future = self._queue_produce_on(owner, item.record_batch)
            if not isinstance(future, asyncio.Future):
                others.append(index)  # after it, the partition's appends keep its order
                slow.add((tp.topic, tp.partition))
                continue
            queued.append((future, owner, entry))
        if not others:
            return []

        async def by_produce() -> None:
            response = await self.Produce(partition_pb2.ProduceRequest(
                items=[appends[index] for index in others]), None)
            for index, result in zip(others, response.results):
                results[index].CopyFrom(result)
        return [by_produce()]

    def _stage_items(self, request, response, riders, epochs, work: list,
                     queued: list) -> None:
        """StageTxn's step: the riding markers, then every item's batches queued on their
        owners (into `queued`) and its acks' and misrouted batches' coroutines (into
        `work`), each answer's entry added to `response` in request order."""
        if riders:
            refusals = self._fence_markers(riders)
            work.append(self._markers_into(response.markers, riders, refusals,
                                           self._queue_markers(riders, refusals)))
        for item in request.items:
            result = response.results.add(txn_id=item.txn_id)
            refusal = _invalid_stage(item, epochs.tc_partitions)
            if refusal is None:
                refusal = _fence(item, epochs)
            txn = TxnId(item.txn_id.tc_partition, item.txn_id.sequence)
            for batch_item in item.batches:
                entry = result.batch_results.add(topic_partition=batch_item.topic_partition,
                                                 base_offset=-1, last_offset=-1)
                if refusal is not None:
                    entry.error.CopyFrom(item_error(refusal))
                    continue
                owner = self._route_now(batch_item.topic_partition)
                if owner is None:  # not hosted here: the refusal names the owner (awaits)
                    work.append(self._stage_batch(txn, item.coordinator_epoch, batch_item,
                                                  entry))
                    continue
                future = self._queue_stage(owner, txn, item.coordinator_epoch, batch_item,
                                           entry)
                if future is not None:
                    queued.append((future, owner, entry))
            for ack in item.acks:
                entry = result.ack_results.add(subscription_partition=ack.subscription_partition,
                                               cumulative_end_offset=-1)
                if refusal is not None:
                    entry.error.CopyFrom(item_error(refusal))
                else:
                    work.append(self._stage_ack(txn, item.coordinator_epoch, ack, entry))

    def stage_here(self, txn: TxnId, epoch: int, items) -> list | AtomlogError:
        """A one-call transaction's batches (ProduceItems), staged by a coordinator in
        this process in the caller's step (its commit lane, coordinator/lane.py): as
        StageTxn stages one item, without a request, a task or an await. The coordinator
        epoch is fenced, then every batch is routed to an owner hosted here and checked
        before any is queued; the first refusal (a partition hosted elsewhere, a bad
        batch, a stale epoch, an owner not serving) is returned with nothing queued, for
        the caller to stage through StageTxn instead, which retries or refuses as it
        does (an owner's queue found full part-way leaves the batches queued before it:
        staged again there, they are answered as duplicates). Returns (owner, the
        owner's queued work) per batch in order: its future once durable
        (`staged_result` reads it), its results once written (`written_result`, for a
        caller gathering the owners' writes: owner.gather)."""
        epochs = self.coordinator_epochs
        if epochs is None or self.verifier is None:
            return AtomlogError("UNIMPLEMENTED", "this server takes no transactional batches")
        txn = TxnId(txn.tc_partition, txn.sequence)
        current = epochs.current(txn.tc_partition)
        if epoch < current:
            return AtomlogError("STALE_COORDINATOR_EPOCH",
                                f"coordinator epoch {epoch} of TC partition {txn.tc_partition}"
                                f" is stale; the current one is {current}")
        checked = []
        try:
            for item in items:
                owner = self._route_now(item.topic_partition)
                if owner is None:
                    return AtomlogError("NOT_PARTITION_OWNER", "hosted elsewhere")
                if isinstance(owner, AtomlogError):
                    return owner
                header = validate_batch(item.record_batch, max_batch_bytes=self.max_batch_bytes)
                data, header = stamp_transaction(item.record_batch, header, txn)
                owner.check_serving()
                owner.check_txns_ready()
                checked.append((owner, data, header))
        except AtomlogError as error:
            return error
        epochs.observe(txn.tc_partition, epoch)
        queued = []
        for owner, data, header in checked:
            try:
                work = owner.queue_stage_work(txn, data, header, coordinator_epoch=epoch)
            except AtomlogError as error:  # a full queue: the caller stages again, whole
                for _, queued_work in queued:
                    queued_work.future.add_done_callback(observe_failure)
                return error
            queued.append((owner, work))
        return queued

    def stage_ack_here(self, txn: TxnId, epoch: int, ack) -> asyncio.Future | AtomlogError:
        """A one-call transaction's ack (an AckItem), staged by a coordinator in this
        process in the caller's step (its commit lane, after `stage_here` fenced the
        epoch), as StageTxn stages an ack: checked and made pending on its cursor now, the
        epoch checked again there. The future of the cursor's cumulative end once
        durable (raising the refusal), or the refusal with nothing changed (a partition
        not hosted here among them)."""
        sp = ack.subscription_partition
        txn = TxnId(txn.tc_partition, txn.sequence)
        try:
            if not sp.subscription:
                raise AtomlogError("INVALID_ARGUMENT",
                                   "subscription_partition.subscription is empty")
            owner = self._route_now(common_pb2.TopicPartition(topic=sp.topic,
                                                              partition=sp.partition))
            if owner is None:
                raise AtomlogError("NOT_PARTITION_OWNER", f"{sp.topic}-{sp.partition} is "
                                   "not hosted here")
            if isinstance(owner, AtomlogError):
                raise owner
            owner.check_serving()
            ranges = [(r.start_offset, r.end_offset) for r in ack.individual_ranges]
            held = owner.subscriptions.ack_now(
                sp.subscription, ack.cumulative_end_offset, ranges, txn,
                owner.max_read_position(),
                check=lambda: owner.check_stage_epoch(txn, epoch, "staged ack"))
        except AtomlogError as error:
            return error
        return asyncio.ensure_future(held)

    @staticmethod
    def staged_result(tp, owner: PartitionOwner,
                      future: asyncio.Future) -> partition_pb2.ProduceResult:
        """A `stage_here` batch's settled future as StageTxn answers it."""
        result = partition_pb2.ProduceResult(topic_partition=tp, base_offset=-1,
                                             last_offset=-1)
        _staged_into(result, owner, future)
        return result

    def takes_gathered(self, tp) -> bool:
        """Whether `tp` is hosted here by an owner that would write in a gathering now
        (PartitionOwner.takes_gathered)."""
        owner = self._route_now(tp)
        return isinstance(owner, PartitionOwner) and owner.takes_gathered()

    @staticmethod
    def written_result(tp, owner: PartitionOwner, outcome) -> partition_pb2.ProduceResult:
        """A `stage_here` batch's outcome, read from its work once written (gathered),
        as StageTxn answers it."""
        result = partition_pb2.ProduceResult(topic_partition=tp, base_offset=-1,
                                             last_offset=-1)
        _outcome_into(result, owner, outcome)
        return result

    def queue_markers_here(self, markers: list) -> "MarkersHere":
        """Markers from a coordinator in this process (its commit lane's riders,
        coordinator/lane.py), as EndTxnOnPartition applies them but without its request
        and response: (target, Marker) pairs, each target a topic partition (`topic`,
        `partition`) or a subscription partition (and `subscription`). In the caller's
        step each is fenced at its coordinator epoch and queued on its partition's owner
        (all of one partition in one item), or its subscription's pending acks applied
        or released (staged on the cursor store), so the stages queued next share their
        write and fsync, and the acks their durability round. Returns the future of the
        outcome per marker, in order: MarkerResult, or the AtomlogError a marker would
        answer (STALE_COORDINATOR_EPOCH, a partition not hosted here, an owner not
        serving). Returns a MarkersHere: its `answer` is that future, and once the
        owners wrote in the caller's gathering, `settle_written` may answer it in the
        step instead."""
        loop = asyncio.get_running_loop()
        epochs = self.coordinator_epochs
        outcomes: list = [None] * len(markers)
        per_partition: dict[tuple[str, int], list] = {}
        subscriptions: list = []  # (index, (target, marker)) of subscription targets
        for index, (target, marker) in enumerate(markers):
            tc, epoch = marker.txn.tc_partition, marker.coordinator_epoch
            current = epochs.current(tc)
            if epoch < current:
                outcomes[index] = AtomlogError(
                    "STALE_COORDINATOR_EPOCH", f"coordinator epoch {epoch} of TC partition "
                    f"{tc} is stale; the current one is {current}")
                STALE_MARKERS.inc()
                continue
            epochs.observe(tc, epoch)
            if getattr(target, "subscription", None) is not None:
                subscriptions.append((index, (target, marker)))
                continue
            per_partition.setdefault((target.topic, target.partition), []).append(
                (index, marker))
        pending = []
        works = []  # (items, work) per owner queued
        for index, (target, marker) in subscriptions:
            try:  # the cursor's pending acks applied or released, staged now
                owner = self._route_now(common_pb2.TopicPartition(topic=target.topic,
                                                                  partition=target.partition))
                if owner is None:
                    raise AtomlogError("NOT_PARTITION_OWNER", f"{target.topic}-"
                                       f"{target.partition} is not hosted here")
                if isinstance(owner, AtomlogError):
                    raise owner
                owner.check_serving()
                owner.verified_acks.pop((marker.txn, target.subscription), None)
                held = owner.subscriptions.end_txn_now(
                    target.subscription, marker.txn, marker.decision is ControlType.COMMIT)
            except AtomlogError as error:
                outcomes[index] = error
                continue
            pending.append(([(index, marker)], _single(asyncio.ensure_future(held))))
        for (topic, partition), items in per_partition.items():
            owner = self._route_now(common_pb2.TopicPartition(topic=topic, partition=partition))
            if owner is None:
                owner = AtomlogError("NOT_PARTITION_OWNER", f"{topic}-{partition} is not "
                                     "hosted here")
            work = _queue_marker_work(owner, items, outcomes)
            if work is not None:
                pending.append((items, work.future))
                works.append((items, work, owner))
        queued = MarkersHere(markers, outcomes, pending, works, loop.create_future())
        WhenAllDone([future for _, future in pending], queued.settle)
        return queued

    def _route_now(self, tp) -> PartitionOwner | AtomlogError | None:
        """The owner of `tp` hosted here, or the error routing it gives, without awaiting;
        None when it is hosted elsewhere (`_owner` awaits the metadata store to name the
        owner in the refusal)."""
        if not tp.topic:
            return AtomlogError("INVALID_ARGUMENT", "topic_partition.topic is empty")
        try:
            return self.manager.owner(tp.topic, tp.partition)
        except NotOwner:
            return None
        except AtomlogError as error:
            return error

    def _queue_stage(self, owner: PartitionOwner | AtomlogError, txn: TxnId, epoch: int,
                     item, entry) -> asyncio.Future | None:
        """Check one staged batch and queue it on its owner, without awaiting: the future
        of its result, or None with the refusal in `entry`. The epoch was fenced by the
        caller; the owner checks it again in its write step, where nothing can come in
        between (a ResolveStaged that raised it meanwhile makes this stage STALE there)."""
        try:
            if isinstance(owner, AtomlogError):
                raise owner
            batch = item.record_batch
            header = validate_batch(batch, max_batch_bytes=self.max_batch_bytes)
            data, header = stamp_transaction(batch, header, txn)
            owner.check_serving()
            owner.check_txns_ready()
            return owner.queue_stage(txn, data, header, coordinator_epoch=epoch)
        except AtomlogError as error:
            m.BAD_BATCHES.labels(error.reason).inc()
            entry.error.CopyFrom(item_error(error))
            return None

    async def _stage_batch(self, txn: TxnId, epoch: int, item, entry) -> None:
        """One staged batch whose routing awaits (a partition not hosted here)."""
        try:
            owner = await self._owner(item.topic_partition)
        except AtomlogError as error:
            m.BAD_BATCHES.labels(error.reason).inc()
            entry.error.CopyFrom(item_error(error))
            return
        future = self._queue_stage(owner, txn, epoch, item, entry)
        if future is not None:
            with contextlib.suppress(AtomlogError):  # _staged_into reads it
                await future
            _staged_into(entry, owner, future)

    async def _stage_ack(self, txn: TxnId, epoch: int, ack, entry) -> None:
        """One staged ack. As for a batch, the epoch fenced above is checked again where
        the ack is staged (the cursor store's step): a fence raised while this waited to
        run (a newer coordinator's marker or ResolveStaged) refuses it there."""
        sp = ack.subscription_partition
        try:
            owner = await self._subscription_owner(sp)
            ranges = [(r.start_offset, r.end_offset) for r in ack.individual_ranges]
            entry.cumulative_end_offset = await owner.subscriptions.ack(
                sp.subscription, ack.cumulative_end_offset, ranges, txn,
                owner.max_read_position(),
                check=lambda: owner.check_stage_epoch(txn, epoch, "staged ack"))
        except AtomlogError as error:
            entry.error.CopyFrom(item_error(error))
            entry.cumulative_end_offset = -1

    # ------------------------------------------------------------------ parallel commits
    async def ResolveStaged(self, request, context):
        """Recovery of a parallel commit (partition.proto; docs/coordinator.md): per item,
        fence the TC partition at the item's coordinator epoch, then ask the owner of each
        of its partitions whether the transaction's staged data is durable there.

        The request is checked whole first: a bad one fences nothing. The items are then
        fenced in request order in one step without awaiting (a lower epoch: every
        partition of the item answers STALE_COORDINATOR_EPOCH); the questions run
        concurrently, each answering on its own. An owner decides in its write step,
        after everything it took before the question: a stage of an older epoch taken
        before the fence is in its log (staged), one that reaches the step after it is
        refused there (owner.py), so the answer cannot change once given. It answers only
        once everything taken before is durable (and held by the in-sync replicas)."""
        epochs = self.coordinator_epochs
        if epochs is None or self.verifier is None:
            raise AtomlogError("UNIMPLEMENTED", "this server takes no transactional batches")
        items = request.items
        _require_items(items, "ResolveStagedRequest", "items")
        _check_resolve_request(items, epochs.tc_partitions)
        response = partition_pb2.ResolveStagedResponse()
        work = []
        for item in items:
            refusal = _fence(item, epochs)
            txn = TxnId(item.txn_id.tc_partition, item.txn_id.sequence)
            result = response.results.add(txn_id=item.txn_id)
            for tp in item.topic_partitions:
                entry = result.partitions.add(topic_partition=tp)
                if refusal is not None:
                    entry.error.CopyFrom(item_error(refusal))
                else:
                    work.append(self._resolve_staged(txn, tp, entry))
            for sp in item.subscription_partitions:
                entry = result.subscription_partitions.add(subscription_partition=sp)
                if refusal is not None:
                    entry.error.CopyFrom(item_error(refusal))
                else:
                    work.append(self._resolve_staged_ack(txn, sp, entry))
        if work:
            await asyncio.gather(*work)
        counts = {"staged": 0, "not_staged": 0, "error": 0}
        for result in response.results:
            for entry in (*result.partitions, *result.subscription_partitions):
                counts["error" if entry.error.reason
                       else "staged" if entry.staged else "not_staged"] += 1
        for label, count in counts.items():
            if count:
                m.RESOLVE_STAGED.labels(label).inc(count)
        return response

    async def _resolve_staged(self, txn: TxnId, tp, entry) -> None:
        try:
            owner = await self._owner(tp)
            owner.check_serving()
            owner.check_txns_ready()
            entry.staged = await owner.resolve_staged(txn)
        except AtomlogError as error:
            entry.error.CopyFrom(item_error(error))

    async def _resolve_staged_ack(self, txn: TxnId, sp, entry) -> None:
        """Whether `txn`'s staged ack is durable on subscription partition `sp`: asked of
        its cursor store after the fence (PartitionSubscriptions.staged_ack_now)."""
        try:
            owner = await self._subscription_owner(sp)
            owner.check_txns_ready()
            entry.staged = await owner.subscriptions.staged_ack_now(sp.subscription, txn)
        except AtomlogError as error:
            entry.error.CopyFrom(item_error(error))

    # ------------------------------------------------------------------ markers
    async def EndTxnOnPartition(self, request, context):
        """Transaction markers from the coordinators: validate, fence, route, apply,
        answer in request order.

        Every accepted marker goes to the owner task of each of its partitions, all
        markers of one partition in one queued item (so one fsync covers them), in
        request order. There the transaction buffer decides: a transaction with data on
        the partition gets a COMMIT/ABORT control batch (marker_offset = its offset, once
        durable); one already ended there answers already_ended; one never seen there
        needs nothing. The buffer re-checks the coordinator epoch against the markers it
        wrote (durable in the log and its snapshots), since routing here awaits.
        Subscription targets have no pending acks until subscriptions exist: they are
        checked for routing and state only."""
        if self.coordinator_epochs is None:
            raise AtomlogError("UNIMPLEMENTED", "this server does not take transaction markers")
        markers = request.markers
        _require_items(markers, "EndTxnOnPartitionRequest")
        _check_marker_request(markers, "EndTxnOnPartitionRequest")
        response = partition_pb2.EndTxnOnPartitionResponse()
        await self._markers_into(response, markers, self._fence_markers(markers))
        return response

    def _fence_markers(self, markers) -> list[AtomlogError | None]:
        """Each marker's refusal (INVALID_ARGUMENT, STALE_COORDINATOR_EPOCH) or None. Fenced
        in request order, in one step without awaiting: a marker raising an epoch makes
        every later one of a lower epoch stale, in this request and in others."""
        epochs = self.coordinator_epochs
        refusals: list[AtomlogError | None] = []
        for index, marker in enumerate(markers):
            refusal = _invalid_marker(index, marker, epochs.tc_partitions)
            if refusal is None:
                refusal = _fence(marker, epochs)
            refusals.append(refusal)
        return refusals

    def _queue_markers(self, markers, refusals) -> tuple[dict, dict, list]:
        """Route the markers `_fence_markers` accepted and queue them on their partitions'
        owners (all markers of one partition in one queued item), without awaiting:
        (routes, outcomes of refused targets, [(key, items, future)] per partition not
        refused). A route of None (and a future of None) is a partition hosted elsewhere,
        routed by `_markers_into`."""
        routes: dict[tuple[str, int], PartitionOwner | AtomlogError | None] = {}
        per_owner: dict[tuple[str, int], list[tuple[tuple[int, int], Marker]]] = {}
        outcomes: dict[tuple[int, int], MarkerResult | AtomlogError] = {}
        for index, (marker, refusal) in enumerate(zip(markers, refusals)):
            if refusal is not None:
                continue
            for target in (*marker.topic_partitions, *marker.subscription_partitions):
                key = (target.topic, target.partition)
                if key not in routes:
                    routes[key] = self._route_now(target)
            txn = TxnId(marker.txn_id.tc_partition, marker.txn_id.sequence)
            decision = (ControlType.COMMIT if marker.decision == partition_pb2.TXN_DECISION_COMMIT
                        else ControlType.ABORT)
            for position, tp in enumerate(marker.topic_partitions):
                per_owner.setdefault((tp.topic, tp.partition), []).append(
                    ((index, position), Marker(txn, decision, marker.coordinator_epoch)))
        queued = []  # (key, items, future), the future None while the route is unknown
        for key, items in per_owner.items():
            future = None if routes[key] is None else \
                _queue_marker_items(routes[key], items, outcomes)
            if routes[key] is None or future is not None:  # (else refused: in outcomes)
                queued.append((key, items, future))
        return routes, outcomes, queued

    async def _markers_into(self, response, markers, refusals, queued=None) -> None:
        """Apply the markers `_fence_markers` accepted (queued by `_queue_markers`, here
        unless the caller did); their results into `response` (an
        EndTxnOnPartitionResponse), in request order."""
        routes, outcomes, pending = queued or self._queue_markers(markers, refusals)
        for key in [key for key, owner in routes.items() if owner is None]:
            try:  # hosted elsewhere: the refusal names the owner (or it moved here)
                routes[key] = await self._owner(common_pb2.TopicPartition(
                    topic=key[0], partition=key[1]))
            except AtomlogError as error:
                routes[key] = error
        pending = [(items, future if future is not None  # routed now, if it was not
                    else _queue_marker_items(routes[key], items, outcomes))
                   for key, items, future in pending]
        pending = [(items, future) for items, future in pending if future is not None]
        # The subscriptions' markers are staged now, beside the partitions' (not once
        # those are durable): the decision they carry is durable on the coordinator,
        # which retries each target until it lands, so their order does not matter; and
        # staged in this step they share the cursor stores' next durability round with
        # the acks of a staging call that carries them (docs/benchmarks.md).
        subscriptions = ([self._apply_subscription_markers(markers, refusals, routes)]
                         if any(marker.subscription_partitions for marker in markers) else [])
        sub_outcomes = {}
        if pending or subscriptions:
            gathered = await asyncio.gather(*(future for _, future in pending), *subscriptions,
                                            return_exceptions=True)
            if subscriptions:
                sub_outcomes = gathered[-1]
                if isinstance(sub_outcomes, BaseException):
                    raise sub_outcomes
        _marker_outcomes(pending, outcomes)
        counts: dict[tuple[str, str], int] = {}
        for index, (marker, refusal) in enumerate(zip(markers, refusals)):
            decision = _DECISION_LABELS.get(marker.decision, "invalid")
            result = response.results.add(txn_id=marker.txn_id)
            for position, tp in enumerate(marker.topic_partitions):
                outcome = refusal if refusal is not None else outcomes[(index, position)]
                entry = result.topic_partition_results.add(topic_partition=tp, marker_offset=-1,
                                                           already_ended=False)
                error = None
                if isinstance(outcome, MarkerResult):
                    entry.marker_offset = outcome.marker_offset
                    entry.already_ended = outcome.already_ended
                else:
                    error = outcome
                _count_marker_item(counts, decision, entry, error)
            for position, sp in enumerate(marker.subscription_partitions):
                outcome = refusal if refusal is not None else sub_outcomes[(index, position)]
                entry = result.subscription_partition_results.add(subscription_partition=sp,
                                                                  already_ended=False)
                error = outcome if isinstance(outcome, AtomlogError) else None
                if error is None:
                    entry.already_ended = bool(outcome)
                _count_marker_item(counts, decision, entry, error)
            if refusal is not None and refusal.reason == "STALE_COORDINATOR_EPOCH":
                STALE_MARKERS.inc()
        for labels, count in counts.items():
            MARKERS.labels(*labels).inc(count)

    @staticmethod
    def _apply_subscription_markers(markers, refusals, routes) -> Awaitable[dict]:
        """Apply (COMMIT) or release (ABORT) the pending acks of every subscription target
        of an accepted marker, each change staged now, in the caller's step, so it shares
        the cursor store's next durability round with what the caller stages after it (a
        staging call's acks). Await the result: {(marker index, position): already_ended
        | AtomlogError}, once every change is durable."""
        outcomes: dict[tuple[int, int], bool | AtomlogError] = {}
        held = []

        async def settle(where, answer):
            try:
                outcomes[where] = await answer
            except AtomlogError as error:
                outcomes[where] = error

        for index, (marker, refusal) in enumerate(zip(markers, refusals)):
            if refusal is not None:
                continue
            txn = TxnId(marker.txn_id.tc_partition, marker.txn_id.sequence)
            committed = marker.decision == partition_pb2.TXN_DECISION_COMMIT
            for position, sp in enumerate(marker.subscription_partitions):
                owner = routes[(sp.topic, sp.partition)]
                try:
                    if isinstance(owner, AtomlogError):
                        raise owner
                    owner.check_serving()
                    owner.verified_acks.pop((txn, sp.subscription), None)
                    # A task now: the staged change is awaited even if the caller is
                    # cancelled before all_held's first step.
                    held.append(asyncio.ensure_future(settle(
                        (index, position), owner.subscriptions.end_txn_now(
                            sp.subscription, txn, committed))))
                except AtomlogError as error:
                    outcomes[(index, position)] = error

        async def all_held() -> dict:
            await asyncio.gather(*held)
            return outcomes
        return all_held()


# ---------------------------------------------------------------------- markers (helpers)
MAX_MARKER_TARGETS_PER_REQUEST = 100_000  # topic + subscription partitions over all markers
_DECISION_LABELS = {partition_pb2.TXN_DECISION_COMMIT: "commit",
                    partition_pb2.TXN_DECISION_ABORT: "abort"}
_CONTROL_LABELS = {ControlType.COMMIT: "commit", ControlType.ABORT: "abort"}


def _check_marker_request(markers, what: str) -> None:
    """Whole-request checks beyond _require_items: the target bound, and no marker
    without targets (it would have no item to carry its error)."""
    total = 0
    for index, marker in enumerate(markers):
        count = len(marker.topic_partitions) + len(marker.subscription_partitions)
        if not count:
            raise AtomlogError("INVALID_ARGUMENT", f"{what}: markers[{index}] has no "
                               "topic_partitions and no subscription_partitions",
                               {"marker_index": index})
        total += count
    if total > MAX_MARKER_TARGETS_PER_REQUEST:
        raise AtomlogError("INVALID_ARGUMENT",
                           f"{what} has {total} topic and subscription partitions; at "
                           f"most {MAX_MARKER_TARGETS_PER_REQUEST}",
                           {"limit": str(MAX_MARKER_TARGETS_PER_REQUEST)})


def _invalid_marker(index: int, marker, tc_partitions: int) -> AtomlogError | None:
    """INVALID_ARGUMENT naming the first bad field of the marker, or None."""
    def bad(detail: str) -> AtomlogError:
        return AtomlogError("INVALID_ARGUMENT", f"markers[{index}]: {detail}",
                            {"marker_index": index})

    if not marker.HasField("txn_id"):
        return bad("txn_id is not set")
    if marker.txn_id.sequence <= 0:
        return bad("txn_id.sequence must be > 0")
    if marker.txn_id.tc_partition >= tc_partitions:
        return bad(f"txn_id.tc_partition {marker.txn_id.tc_partition} is not below the "
                   f"cluster's {tc_partitions} TC partitions")
    if marker.decision not in _DECISION_LABELS:
        return bad(f"decision {marker.decision} is not COMMIT or ABORT")
    if marker.coordinator_epoch <= 0:
        return bad("coordinator_epoch must be > 0")
    names: set[str] = set()  # names already checked in this marker
    for what, targets in (("topic_partitions", marker.topic_partitions),
                          ("subscription_partitions", marker.subscription_partitions)):
        for position, target in enumerate(targets):
            for field, name in (("topic", target.topic),
                                ("subscription", getattr(target, "subscription", None))):
                if name is None or name in names:
                    continue
                try:
                    validate_topic_name(name, internal_allowed=True)
                except AtomlogError as error:
                    return bad(f"{what}[{position}].{field}: {error.message}")
                names.add(name)
    return None


def _txn_and_epoch_problem(item, tc_partitions: int) -> tuple[str, str] | None:
    """(field, what is wrong) with the txn_id and coordinator_epoch of a coordinator's
    item (StageTxnItem, ResolveStagedItem), or None."""
    if not item.HasField("txn_id") or item.txn_id.sequence <= 0 \
            or item.txn_id.tc_partition >= tc_partitions:
        return "txn_id", ("txn_id is not a valid transaction id of this cluster's "
                          f"{tc_partitions} TC partitions")
    if item.coordinator_epoch <= 0:
        return "coordinator_epoch", "coordinator_epoch must be > 0"
    return None


def _marker_outcomes(pending: list, outcomes: dict | list) -> None:
    """Each settled owner future's results, per (where, Marker) item of it, into
    `outcomes[where]` (the owner's failure of the group for each, when it failed it)."""
    for items, future in pending:
        try:
            results = future.result()
        except AtomlogError as error:
            results = [error] * len(items)
        for (where, _), result in zip(items, results):
            outcomes[where] = result


def _single(future: asyncio.Future) -> asyncio.Future:
    """A subscription marker's future (already_ended, or raising) as a one-element result
    list, as an owner's marker future answers: MarkerResult(-1, already_ended) or the
    AtomlogError."""
    answer = asyncio.get_running_loop().create_future()

    def done(_future) -> None:
        error = failure_of(future, "a subscription's marker")
        answer.set_result([error if error is not None
                           else MarkerResult(-1, bool(future.result()))])

    future.add_done_callback(done)
    return answer


def _queue_marker_items(owner: PartitionOwner | AtomlogError, items: list,
                        outcomes: dict | list) -> asyncio.Future | None:
    """Queue one partition's markers ((where, Marker) items) on its owner: the future of
    their results, or None with the refusal (the route's error, or the owner's) recorded
    in `outcomes[where]` for each."""
    work = _queue_marker_work(owner, items, outcomes)
    return None if work is None else work.future


def _queue_marker_work(owner: PartitionOwner | AtomlogError, items: list,
                       outcomes: dict | list):
    """`_queue_marker_items`, returning the owner's queued work (or None)."""
    try:
        if isinstance(owner, AtomlogError):
            raise owner
        return owner.queue_marker_work([marker for _, marker in items])
    except AtomlogError as error:
        for where, _ in items:
            outcomes[where] = error
        return None


class MarkersHere:
    """Markers a coordinator of this process queued here (queue_markers_here): `answer`
    is the future of their outcomes, set once every owner's and cursor store's work of
    them is durable (`settle`), or in the caller's step by `settle_written`."""

    __slots__ = ("markers", "outcomes", "pending", "works", "answer")

    def __init__(self, markers: list, outcomes: list, pending: list, works: list,
                 answer: asyncio.Future):
        self.markers, self.outcomes, self.pending = markers, outcomes, pending
        self.works, self.answer = works, answer

    def settle(self) -> None:
        """Every pending future is done: the outcomes, counted, into `answer`."""
        if self.answer.done():
            return  # (settled in the step already)
        _marker_outcomes(self.pending, self.outcomes)
        self._answer()

    def settle_written(self, wrote: dict, done: asyncio.Future) -> list | None:
        """The outcomes now, when every marker went to a partition's owner (no
        subscription's) and each owner wrote its work in the caller's gathering
        (`wrote`: Gathering.owners, True for an owner whose write_gathered wrote; its
        frames are fatal: durable in the round that follows, or the server stops);
        else None, and `answer` comes as ever. The works' futures become `done` (a done
        future), so their flushes schedule no callback for them."""
        works = self.works
        if self.answer.done() or len(works) != len(self.pending) or not all(
                wrote.get(owner) and work.results for _, work, owner in works):
            return None  # (done: nothing was pending, `settle` answered already)
        outcomes = self.outcomes
        for items, work, _ in works:
            for (where, _), result in zip(items, work.results):
                outcomes[where] = result
            work.future = done
        self._answer()
        return outcomes

    def _answer(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        for (_, marker), outcome in zip(self.markers, self.outcomes):
            result = ("applied" if not isinstance(outcome, AtomlogError) else "stale"
                      if outcome.reason == "STALE_COORDINATOR_EPOCH" else "error")
            labels = (_CONTROL_LABELS[marker.decision], result)
            counts[labels] = counts.get(labels, 0) + 1
        for labels, count in counts.items():
            MARKERS.labels(*labels).inc(count)
        self.answer.set_result(self.outcomes)


def _staged_into(entry, owner: PartitionOwner, future: asyncio.Future) -> None:
    """A staged batch's (or a riding append's) settled owner future into its StageTxn
    result entry."""
    try:
        [outcome] = future.result()
    except AtomlogError as error:  # the owner failed the write group
        outcome = error
    _outcome_into(entry, owner, outcome)


def _outcome_into(entry, owner: PartitionOwner, outcome) -> None:
    """A staged batch's outcome (Appended or an AtomlogError) into its result entry."""
    if isinstance(outcome, AtomlogError):
        m.BAD_BATCHES.labels(outcome.reason).inc()
        entry.error.CopyFrom(item_error(outcome))
        return
    entry.base_offset = outcome.base_offset
    entry.last_offset = outcome.last_offset
    entry.log_append_time_unix_ms = outcome.log_append_time_ms
    entry.duplicate = outcome.duplicate
    entry.log_start_offset = owner.log.log_start_offset if owner.log else -1


def _check_appends(appends) -> None:
    """StageTxnRequest.appends name only the TC logs' topic (INVALID_ARGUMENT for the
    whole request otherwise: anything else is a client's Produce, under its ACLs)."""
    for index, item in enumerate(appends):
        if item.topic_partition.topic != TXN_LOG_TOPIC:
            raise AtomlogError("INVALID_ARGUMENT", f"StageTxnRequest.appends[{index}] names "
                               f"topic {item.topic_partition.topic!r}: only {TXN_LOG_TOPIC} "
                               "(the coordinators' TC logs) rides with staging",
                               {"field": f"appends[{index}].topic_partition.topic"})


def _invalid_stage(item, tc_partitions: int) -> AtomlogError | None:
    """INVALID_ARGUMENT naming the first bad field of a StageTxnItem, or None."""
    problem = _txn_and_epoch_problem(item, tc_partitions)
    if problem is not None:
        return AtomlogError("INVALID_ARGUMENT", problem[1], {"field": problem[0]})
    if not item.batches and not item.acks:
        return AtomlogError("INVALID_ARGUMENT", "the item has no batches and no acks")
    partitions = [(b.topic_partition.topic, b.topic_partition.partition) for b in item.batches]
    subscriptions = [(a.subscription_partition.topic, a.subscription_partition.partition,
                      a.subscription_partition.subscription) for a in item.acks]
    if len(set(partitions)) != len(partitions) or len(set(subscriptions)) != len(subscriptions):
        return AtomlogError("INVALID_ARGUMENT", "at most one batch per partition and one ack "
                            "per subscription partition in a transaction's stage")
    return None


MAX_RESOLVED_PARTITIONS_PER_REQUEST = 100_000  # over all items of a ResolveStagedRequest


def _check_resolve_request(items, tc_partitions: int) -> None:
    """A ResolveStagedRequest whole, before anything is fenced: each item a valid
    transaction id and epoch, at least one partition, no partition twice, well-formed
    topic and subscription names; at most MAX_RESOLVED_PARTITIONS_PER_REQUEST partitions
    and subscription partitions in all. Raises
    INVALID_ARGUMENT naming the first bad field (metadata `field`)."""
    def bad(field: str, detail: str) -> AtomlogError:
        return AtomlogError("INVALID_ARGUMENT", f"ResolveStagedRequest.{field}: {detail}",
                            {"field": field})

    total = 0
    for index, item in enumerate(items):
        where = f"items[{index}]"
        problem = _txn_and_epoch_problem(item, tc_partitions)
        if problem is not None:
            raise bad(f"{where}.{problem[0]}", problem[1])
        if not item.topic_partitions and not item.subscription_partitions:
            raise bad(f"{where}.topic_partitions", "the item names no partition and no "
                      "subscription partition")
        seen: set[tuple] = set()
        for position, tp in enumerate(item.topic_partitions):
            field = f"{where}.topic_partitions[{position}]"
            try:
                validate_topic_name(tp.topic, internal_allowed=True)
            except AtomlogError as error:
                raise bad(f"{field}.topic", error.message) from None
            if (tp.topic, tp.partition) in seen:
                raise bad(field, f"{tp.topic}-{tp.partition} is named twice")
            seen.add((tp.topic, tp.partition))
        for position, sp in enumerate(item.subscription_partitions):
            field = f"{where}.subscription_partitions[{position}]"
            try:
                validate_topic_name(sp.topic, internal_allowed=True)
            except AtomlogError as error:
                raise bad(f"{field}.topic", error.message) from None
            try:
                validate_subscription_name(sp.subscription)
            except AtomlogError as error:
                raise bad(f"{field}.subscription", error.message) from None
            if (sp.topic, sp.partition, sp.subscription) in seen:
                raise bad(field, f"{sp.topic}-{sp.partition} ({sp.subscription}) is named "
                          "twice")
            seen.add((sp.topic, sp.partition, sp.subscription))
        total += len(item.topic_partitions) + len(item.subscription_partitions)
    if total > MAX_RESOLVED_PARTITIONS_PER_REQUEST:
        raise AtomlogError("INVALID_ARGUMENT",
                           f"ResolveStagedRequest names {total} partitions; at most "
                           f"{MAX_RESOLVED_PARTITIONS_PER_REQUEST}",
                           {"field": "items", "limit": MAX_RESOLVED_PARTITIONS_PER_REQUEST})


def _fence(marker, epochs: CoordinatorEpochs) -> AtomlogError | None:
    """STALE_COORDINATOR_EPOCH below the TC partition's current epoch; else accept the
    epoch of the marker (or staged item, or ResolveStaged item), raising the current one
    when it is higher."""
    tc, epoch = marker.txn_id.tc_partition, marker.coordinator_epoch
    current = epochs.current(tc)
    if epoch < current:
        return AtomlogError(
            "STALE_COORDINATOR_EPOCH",
            f"coordinator epoch {epoch} of TC partition {tc} is stale; the current one is "
            f"{current}", {"tc_partition": tc, "coordinator_epoch": epoch,
                           "current_coordinator_epoch": current})
    epochs.observe(tc, epoch)
    return None


def _count_marker_item(counts: dict, decision: str, entry, error: AtomlogError | None) -> None:
    if error is None:
        result = "applied"
    else:
        entry.error.CopyFrom(item_error(error))
        result = "stale" if error.reason == "STALE_COORDINATOR_EPOCH" else "error"
    counts[(decision, result)] = counts.get((decision, result), 0) + 1
